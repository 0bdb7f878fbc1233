//! This machine's host name, looked up in one place for every part of the agent.

/// The host name (`gethostname(2)`, the UTS namespace's name: a pod's name in Kubernetes),
/// or `localhost` when it cannot be read.
pub fn hostname() -> String {
    nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "localhost".into())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_host_name_is_the_kernels() {
        let kernel = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        assert_eq!(super::hostname(), kernel.trim());
    }
}
