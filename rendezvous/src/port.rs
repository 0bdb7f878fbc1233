//! Picking a free port to publish as `MASTER_PORT`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, ToSocketAddrs};

use crate::RendezvousError;

/// Asks the kernel for a port free on every address of this host and releases it at once.
///
/// Worker rank 0 binds the port later, when it starts the c10d store, and torch's store
/// binds the wildcard address, not `addr`: a port free on `addr` but taken on another
/// address (127.0.0.1, say) would fail there with EADDRINUSE. So the port is taken on the
/// wildcard address of `addr`'s family, which the kernel grants only if no address has it.
/// Another process could take it in between; the window is a few milliseconds and the same
/// one torchrun leaves when its agent does not host the store itself. A fresh port every
/// round (rather than a fixed 29500) keeps a restarted group clear of a previous store
/// still in `TIME_WAIT`.
pub fn free_port(addr: &str) -> Result<u16, RendezvousError> {
    let fail = |source| RendezvousError::NoFreePort {
        addr: addr.to_owned(),
        source,
    };
    let resolved = (addr, 0)
        .to_socket_addrs()
        .map_err(fail)?
        .next()
        .ok_or_else(|| fail(std::io::Error::other("address resolved to nothing")))?;
    let wildcard = match resolved.ip() {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let listener = TcpListener::bind(SocketAddr::new(wildcard, 0)).map_err(fail)?;
    Ok(listener.local_addr().map_err(fail)?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_port_is_bindable_and_nonzero() {
        let port = free_port("127.0.0.1").expect("a free port");
        assert_ne!(port, 0);
        TcpListener::bind(("127.0.0.1", port)).expect("the port is free again");
    }

    #[test]
    fn unresolvable_address_is_an_error_naming_it() {
        let err = free_port("no-such-host.invalid").unwrap_err();
        assert!(err.to_string().contains("no-such-host.invalid"), "{err}");
    }

    /// Outside testing: the port was picked on `--local-addr` (free there) while another
    /// address had it, and torch's store, which binds the wildcard address, failed with
    /// EADDRINUSE. In a network namespace of its own (this thread only) with two ephemeral
    /// ports, one of them taken on 127.0.0.1, the pick for 127.0.1.10 must be the other.
    #[test]
    fn the_port_is_free_on_the_wildcard_address_where_the_store_binds() {
        let in_ns = |cmd: &str| {
            // A child forked from this thread lives in its network namespace.
            let ok = std::process::Command::new("sh")
                .args(["-c", cmd])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "{cmd}");
        };
        std::thread::spawn(move || {
            if nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).is_err() {
                eprintln!("skipped: creating a network namespace needs root");
                return;
            }
            in_ns("ip link set lo up");
            in_ns("echo '40000 40001' > /proc/sys/net/ipv4/ip_local_port_range");
            let taken = TcpListener::bind(("127.0.0.1", 40001)).unwrap();
            for _ in 0..20 {
                let port = free_port("127.0.1.10").unwrap();
                assert_eq!(port, 40000, "a port taken on 127.0.0.1");
                TcpListener::bind(("0.0.0.0", port)).expect("the store can bind it");
            }
            drop(taken);
        })
        .join()
        .unwrap();
    }
}
