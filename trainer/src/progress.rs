//! Progress reports to the agent (`FSDP_AGENT_PROGRESS`, see fsdp-agent's docs/hangs.md):
//! a datagram per finished step and around each checkpoint, so the agent can tell a hung
//! group from a slow one. Without the variable, or if a send fails, nothing happens.

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;

pub struct Progress {
    socket: Option<(UnixDatagram, PathBuf)>,
    rank: usize,
}

impl Progress {
    pub fn from_env(rank: usize) -> Self {
        match std::env::var_os("FSDP_AGENT_PROGRESS") {
            Some(p) => Self::to(PathBuf::from(p), rank),
            None => Self { socket: None, rank },
        }
    }

    /// Reports to the socket at `path`.
    fn to(path: PathBuf, rank: usize) -> Self {
        let socket = UnixDatagram::unbound().ok().map(|s| (s, path));
        Self { socket, rank }
    }

    fn say(&self, what: &str) {
        if let Some((s, path)) = &self.socket {
            let _ = s.send_to(format!("{} {what}", self.rank).as_bytes(), path);
        }
    }

    pub fn step(&self, n: usize) {
        self.say(&format!("step {n}"));
    }

    pub fn begin(&self, phase: &str) {
        self.say(&format!("begin {phase}"));
    }

    pub fn end(&self, phase: &str) {
        self.say(&format!("end {phase}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_and_checkpoints_reach_the_agent_in_its_format() {
        let path =
            std::env::temp_dir().join(format!("fsdp-trainer-progress-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let agent = UnixDatagram::bind(&path).unwrap();
        let p = Progress::to(path.clone(), 3);
        p.step(41);
        p.begin("checkpoint");
        p.end("checkpoint");
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        for _ in 0..3 {
            let n = agent.recv(&mut buf).unwrap();
            got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        assert_eq!(got, ["3 step 41", "3 begin checkpoint", "3 end checkpoint"]);
        std::fs::remove_file(&path).unwrap();
        // Without an agent nothing is sent and nothing fails.
        Progress::to(path, 0).step(1);
    }
}
