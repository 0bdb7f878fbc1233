//! Progress reports from workers: a Unix datagram socket, one short text message each.
//!
//! ```text
//! <rank> step <n>        a step finished
//! <rank> begin <phase>   a long phase starts (checkpoint, eval, ...)
//! <rank> end <phase>     it ended
//! <rank> begin finish    training is over (sent at the interpreter's exit by progress.py)
//! ```
//!
//! Datagrams keep a worker's cost to one `sendto` with no connection to hold, and a worker
//! whose agent is gone loses nothing but the message. The socket's path is in the
//! workers' `FSDP_AGENT_PROGRESS`; `examples/progress.py` is the ten-line helper.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::UnixDatagram;
use tokio::task::AbortHandle;

/// The worker environment variable that names the socket.
pub const ENV: &str = "FSDP_AGENT_PROGRESS";
/// Step durations kept per rank for the automatic timeout.
const RECENT: usize = 20;

/// What one rank reported in the current group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankProgress {
    pub rank: u32,
    /// It reported anything at all (only then is it judged).
    pub reported: bool,
    pub last_report: Option<Instant>,
    /// The last step it finished, and when.
    pub last_step: Option<(u64, Instant)>,
    /// Durations of its recent steps, oldest first.
    pub recent: VecDeque<Duration>,
    /// The phase it is in, and since when.
    pub phase: Option<(String, Instant)>,
}

impl RankProgress {
    pub fn new(rank: u32) -> Self {
        Self {
            rank,
            reported: false,
            last_report: None,
            last_step: None,
            recent: VecDeque::new(),
            phase: None,
        }
    }

    fn heard(&mut self, at: Instant) {
        self.reported = true;
        self.last_report = Some(at);
    }

    pub fn step(&mut self, n: u64, at: Instant) {
        self.heard(at);
        // A step's duration runs from the previous step or the end of a phase, whichever
        // is later: a checkpoint between two steps is not a slow step.
        if let Some((_, prev)) = self.last_step {
            if self.recent.len() == RECENT {
                self.recent.pop_front();
            }
            self.recent.push_back(at.saturating_duration_since(prev));
        }
        self.last_step = Some((n, at));
    }

    pub fn phase_begin(&mut self, name: &str, at: Instant) {
        self.heard(at);
        self.phase = Some((name.to_owned(), at));
    }

    pub fn phase_end(&mut self, _name: &str, at: Instant) {
        self.heard(at);
        self.phase = None;
        // The next step is measured from here, not across the phase.
        if let Some((n, _)) = self.last_step {
            self.last_step = Some((n, at));
        }
    }
}

/// One parsed report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    Step(u64),
    Begin(String),
    End(String),
}

/// Parses `"<rank> step <n>"`, `"<rank> begin <phase>"`, `"<rank> end <phase>"`.
pub fn parse(text: &str) -> Option<(u32, Report)> {
    let mut words = text.split_whitespace();
    let rank = words.next()?.parse().ok()?;
    let kind = words.next()?;
    let arg = words.next()?;
    let report = match kind {
        "step" => Report::Step(arg.parse().ok()?),
        "begin" => Report::Begin(arg.chars().take(64).collect()),
        "end" => Report::End(arg.chars().take(64).collect()),
        _ => return None,
    };
    Some((rank, report))
}

type Ranks = Arc<Mutex<BTreeMap<u32, RankProgress>>>;

/// The agent's progress socket and what it heard, per rank of the current group.
pub struct Progress {
    path: PathBuf,
    ranks: Ranks,
    task: AbortHandle,
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Progress {
    /// Binds a socket in `dir` and starts reading it.
    pub fn start(dir: &Path) -> std::io::Result<Self> {
        let tag = &uuid::Uuid::new_v4().simple().to_string()[..8];
        let path = dir.join(format!("fsdp-agent-{}-{tag}.progress", std::process::id()));
        let socket = UnixDatagram::bind(&path)?;
        let ranks: Ranks = Arc::default();
        let heard = ranks.clone();
        let task = tokio::spawn(async move {
            let mut buf = [0u8; 256];
            loop {
                let Ok(n) = socket.recv(&mut buf).await else {
                    continue;
                };
                let Some((rank, report)) = std::str::from_utf8(&buf[..n]).ok().and_then(parse)
                else {
                    continue;
                };
                let now = Instant::now();
                let mut ranks = heard.lock().unwrap_or_else(|p| p.into_inner());
                // Only the current group's ranks: a stale worker's report is not progress.
                let Some(p) = ranks.get_mut(&rank) else {
                    continue;
                };
                match report {
                    Report::Step(s) => p.step(s, now),
                    Report::Begin(name) => p.phase_begin(&name, now),
                    Report::End(name) => p.phase_end(&name, now),
                }
            }
        });
        Ok(Self {
            path,
            ranks,
            task: task.abort_handle(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A new group with these global ranks: nothing heard yet.
    pub fn reset(&self, ranks: impl IntoIterator<Item = u32>) {
        let mut all = self.ranks.lock().unwrap_or_else(|p| p.into_inner());
        *all = ranks
            .into_iter()
            .map(|r| (r, RankProgress::new(r)))
            .collect();
    }

    /// What every rank of the group reported, by rank.
    pub fn snapshot(&self) -> Vec<RankProgress> {
        let all = self.ranks.lock().unwrap_or_else(|p| p.into_inner());
        all.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_parse_and_garbage_does_not() {
        assert_eq!(parse("3 step 12"), Some((3, Report::Step(12))));
        assert_eq!(
            parse("0 begin checkpoint\n"),
            Some((0, Report::Begin("checkpoint".into())))
        );
        assert_eq!(
            parse("0 end checkpoint"),
            Some((0, Report::End("checkpoint".into())))
        );
        for bad in [
            "",
            "x step 1",
            "1 step x",
            "1 leap 2",
            "1 step",
            "-1 step 2",
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_phase_is_not_counted_as_a_slow_step() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut p = RankProgress::new(0);
        p.step(1, t0);
        p.step(2, t0 + s);
        p.phase_begin("checkpoint", t0 + s);
        p.phase_end("checkpoint", t0 + 30 * s);
        p.step(3, t0 + 31 * s);
        assert_eq!(Vec::from(p.recent.clone()), [s, s]);
    }

    #[tokio::test]
    async fn reports_reach_the_group_s_ranks_only() {
        let progress = Progress::start(&std::env::temp_dir()).unwrap();
        progress.reset([4, 5]);
        let worker = std::os::unix::net::UnixDatagram::unbound().unwrap();
        for msg in ["4 step 1", "9 step 1", "5 begin eval", "junk"] {
            worker.send_to(msg.as_bytes(), progress.path()).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let ranks = progress.snapshot();
        assert_eq!(ranks.len(), 2);
        assert_eq!(ranks[0].last_step.map(|(n, _)| n), Some(1));
        assert_eq!(
            ranks[1].phase.as_ref().map(|(n, _)| n.as_str()),
            Some("eval")
        );
        let path = progress.path().to_owned();
        drop(progress);
        assert!(!path.exists(), "the socket file is removed");
    }
}
