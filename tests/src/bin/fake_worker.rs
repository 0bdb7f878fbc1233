//! A worker for the agent's tests: records what it saw and behaves as told.
//!
//! Flags (all optional):
//! * `--dir DIR`: where to write records; each file name ends in `.<RESTART>.<RANK>`.
//! * `--write-env`: write the environment as JSON to `env.<restart>.<rank>`.
//! * `--exit-code N`: exit with N (default 0).
//! * `--fail-until-restart N`: exit with --exit-code only while TORCHELASTIC_RESTART_COUNT < N.
//! * `--only-local-rank R`: only that local rank fails; the others succeed.
//! * `--only-if-env VAR`: only fail when the environment has VAR (set per agent).
//! * `--sleep SECS`: run this long before exiting (failing ranks fail at once).
//! * `--fail-after SECS`: failing ranks run this long before they fail.
//! * `--ignore-sigterm`: ignore SIGTERM (the agent must SIGKILL us after its grace).
//! * `--spawn-child`: start a `sleep` grandchild and record its pid in `child.<..>`.
//! * `--error-message MSG`: write a torchelastic error file with MSG before failing.
//! * `--checkpoint-on-term SECS`: on SIGTERM, work SECS more (a checkpoint being saved),
//!   then write `checkpoint.<..>` and exit 143.
//!
//! Always writes `pid.<restart>.<rank>` once signal handlers are in place, and
//! `sigterm.<restart>.<rank>` when SIGTERM arrives (then exits 143).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

static TERM: AtomicBool = AtomicBool::new(false);

extern "C" fn on_term(_: libc::c_int) {
    TERM.store(true, Ordering::SeqCst);
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut dir, mut write_env, mut exit_code, mut fail_until, mut only_rank) =
        (None, false, 0, None, None);
    let (mut sleep, mut ignore_term, mut spawn_child, mut error_message) =
        (0.0f64, false, false, None);
    let mut only_if_env: Option<String> = None;
    let mut checkpoint_secs: Option<f64> = None;
    let mut fail_after = 0.0f64;
    while let Some(a) = args.next() {
        let mut val = || args.next().expect("flag needs a value");
        match a.as_str() {
            "--dir" => dir = Some(PathBuf::from(val())),
            "--write-env" => write_env = true,
            "--exit-code" => exit_code = val().parse().expect("exit code"),
            "--fail-until-restart" => fail_until = Some(val().parse::<u32>().expect("count")),
            "--only-local-rank" => only_rank = Some(val()),
            "--sleep" => sleep = val().parse().expect("seconds"),
            "--ignore-sigterm" => ignore_term = true,
            "--spawn-child" => spawn_child = true,
            "--error-message" => error_message = Some(val()),
            "--only-if-env" => only_if_env = Some(val()),
            "--fail-after" => fail_after = val().parse().expect("seconds"),
            "--checkpoint-on-term" => checkpoint_secs = Some(val().parse().expect("seconds")),
            other => {
                eprintln!("fake-worker: unknown flag {other}");
                std::process::exit(2);
            }
        }
    }
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let suffix = format!("{}.{}", var("TORCHELASTIC_RESTART_COUNT"), var("RANK"));
    let write = |name: &str, body: String| {
        if let Some(d) = &dir {
            // Temp file and rename: a test polling for the record never reads it half-written.
            let path = d.join(format!("{name}.{suffix}"));
            let tmp = d.join(format!(".{name}.{suffix}.tmp"));
            std::fs::write(&tmp, body).expect("write record");
            std::fs::rename(&tmp, &path).expect("publish record");
        }
    };

    #[expect(unsafe_code, reason = "installing a signal handler in a test helper")]
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        let handler = if ignore_term {
            libc::SIG_IGN
        } else {
            on_term as *const () as libc::sighandler_t
        };
        libc::signal(libc::SIGTERM, handler);
    }
    if write_env {
        let env: serde_json::Map<String, serde_json::Value> = std::env::vars()
            .map(|(k, v)| (k, serde_json::Value::String(v)))
            .collect();
        write("env", serde_json::Value::Object(env).to_string());
    }
    if spawn_child {
        let child = std::process::Command::new("sleep")
            .arg("300")
            .spawn()
            .expect("spawn sleep");
        write("child", child.id().to_string());
        std::mem::forget(child);
    }
    write("pid", std::process::id().to_string());

    let restart: u32 = var("TORCHELASTIC_RESTART_COUNT").parse().unwrap_or(0);
    let rank_selected = only_rank.as_deref().is_none_or(|r| r == var("LOCAL_RANK"));
    let env_selected = only_if_env
        .as_deref()
        .is_none_or(|v| std::env::var_os(v).is_some());
    let fails =
        exit_code != 0 && rank_selected && env_selected && fail_until.is_none_or(|n| restart < n);
    if fails && env_selected && sleep > 0.0 && only_if_env.is_some() {
        // A node whose worker fails late: others may already be done.
        std::thread::sleep(Duration::from_secs_f64(sleep));
    }
    if fails {
        std::thread::sleep(Duration::from_secs_f64(fail_after));
        if let Some(msg) = error_message {
            let file = var("TORCHELASTIC_ERROR_FILE");
            let body = serde_json::json!({"message": {"message": msg, "extraInfo": {"py_callstack": "fake traceback", "timestamp": "0"}}});
            std::fs::write(file, body.to_string()).expect("write error file");
        }
        std::process::exit(exit_code);
    }
    let end = Instant::now() + Duration::from_secs_f64(sleep);
    while Instant::now() < end {
        if TERM.load(Ordering::SeqCst) {
            write("sigterm", String::new());
            if let Some(secs) = checkpoint_secs {
                std::thread::sleep(Duration::from_secs_f64(secs));
                write("checkpoint", String::new());
            }
            std::process::exit(143);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
