//! The deterministic simulator's command line (`scripts/sim.sh`): long campaigns with a
//! progress bar, one seed replayed with its trace, a failing seed shrunk.

use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use fsdp_rendezvous::sim::{self, Options};

const USAGE: &str =
    "usage: sim.sh [--seeds N] [--seed-start S] [--agents K] [--faults F] [--threads T] [--crowd]
              [--switch old-departures|old-store|broken-fence|no-charge-in-broken|no-admission]...
              [--seed S [--shrink]] [--quiet]
  --seeds N       run seeds S..S+N (default 10000) and print 'seeds N, events E, violations V'
  --seed S        run one seed and print its trace (with --shrink: the fewest faults that fail)
  --crowd         formation alone: K agents (default 24) started together on an overloaded etcd
  --switch X      put back a fixed bug (old-departures, old-store), break the fence on purpose,
                  or join without admission (no-admission)";

struct Args {
    seeds: u64,
    start: u64,
    one: Option<u64>,
    shrink: bool,
    threads: usize,
    quiet: bool,
    opts: Options,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        seeds: 10_000,
        start: 0,
        one: None,
        shrink: false,
        threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
        quiet: false,
        opts: Options::new(4),
    };
    let mut it = std::env::args().skip(1);
    let mut agents = None;
    let mut faults = None;
    let mut crowd = false;
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> Result<u64, String> {
            let v = it.next().ok_or(format!("{name} needs a value"))?;
            v.parse()
                .map_err(|_| format!("{name} takes a number, not {v:?}"))
        };
        match flag.as_str() {
            "--seeds" => a.seeds = value("--seeds")?,
            "--seed-start" => a.start = value("--seed-start")?,
            "--seed" => a.one = Some(value("--seed")?),
            "--agents" => agents = Some(value("--agents")? as usize),
            "--faults" => faults = Some(value("--faults")? as usize),
            "--threads" => a.threads = value("--threads")? as usize,
            "--shrink" => a.shrink = true,
            "--quiet" => a.quiet = true,
            "--crowd" => crowd = true,
            "--switch" => {
                let s = &mut a.opts.switches;
                match it.next().as_deref() {
                    Some("old-departures") => s.old_departures = true,
                    Some("old-store") => s.old_store = true,
                    Some("broken-fence") => s.broken_fence = true,
                    Some("no-charge-in-broken") => s.no_charge_in_broken = true,
                    Some("no-admission") => s.no_admission = true,
                    other => {
                        return Err(format!(
                            "--switch takes old-departures, old-store, broken-fence, no-charge-in-broken or no-admission, not {other:?}"
                        ));
                    }
                }
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if crowd || agents.is_some() {
        let switches = a.opts.switches;
        a.opts = if crowd {
            Options::crowd(agents.unwrap_or(24))
        } else {
            Options::new(agents.unwrap_or(4))
        };
        a.opts.switches = switches;
    }
    if let Some(f) = faults {
        a.opts.faults = f;
    }
    Ok(a)
}

fn replay(seed: u64, a: &Args) -> ExitCode {
    let (plan, report) = if a.shrink {
        sim::shrink(seed, &a.opts)
    } else {
        let mut o = a.opts.clone();
        o.trace = true;
        let o = o.for_seed(seed);
        (
            sim::faults::schedule(seed, &sim::mix(seed, &o)),
            sim::run_seed(seed, &o),
        )
    };
    for line in &report.trace {
        println!("{line}");
    }
    if a.shrink {
        println!("-- {} fault(s) left: {plan:?}", plan.len());
    }
    match &report.violation {
        Some(v) => {
            println!("seed {seed}: VIOLATION {v}");
            ExitCode::FAILURE
        }
        None => {
            println!(
                "seed {seed}: ok ({} events, {} faults)",
                report.events, report.faults
            );
            ExitCode::SUCCESS
        }
    }
}

fn main() -> ExitCode {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("sim: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(if e.is_empty() { 0 } else { 64 });
        }
    };
    if let Some(seed) = a.one {
        return replay(seed, &a);
    }
    let started = Instant::now();
    let (done, events) = (AtomicU64::new(0), AtomicU64::new(0));
    let formation_writes = AtomicU64::new(0);
    let progress = |r: &sim::Report| {
        let d = done.fetch_add(1, Ordering::Relaxed) + 1;
        events.fetch_add(r.events, Ordering::Relaxed);
        formation_writes.fetch_max(r.formation_writes, Ordering::Relaxed);
        if !a.quiet && (d % 50 == 0 || d == a.seeds) {
            let width = 40;
            let filled = (d * width / a.seeds.max(1)) as usize;
            let rate = d as f64 / started.elapsed().as_secs_f64();
            eprint!(
                "\r[{}{}] {d}/{} seeds, {rate:.0} seeds/s ",
                "#".repeat(filled),
                ".".repeat(width as usize - filled),
                a.seeds
            );
            let _ = std::io::stderr().flush();
        }
        if let Some(v) = &r.violation {
            let crowd = if a.opts.crowd_ms.is_some() {
                " --crowd"
            } else {
                ""
            };
            eprintln!(
                "\nseed {}: {v}\n  replay: scripts/sim.sh --seed {} --agents {}{crowd} --shrink",
                r.seed, r.seed, a.opts.agents
            );
        }
    };
    let failed = sim::campaign(a.start, a.seeds, &a.opts, a.threads, &progress);
    let secs = started.elapsed().as_secs_f64();
    if !a.quiet {
        eprintln!();
    }
    println!(
        "seeds {}, events {}, violations {} ({:.1} s, {:.0} seeds/s, {} agents, {} faults per seed; \
         most writes by a node before its first round {})",
        a.seeds,
        events.load(Ordering::Relaxed),
        failed.len(),
        secs,
        a.seeds as f64 / secs,
        a.opts.agents,
        a.opts.faults,
        formation_writes.load(Ordering::Relaxed)
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
