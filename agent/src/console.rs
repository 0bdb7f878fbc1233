//! What the agent prints itself, to a console that may be gone.
//!
//! `fsdp-agent ... 2>&1 | head -1` closes the agent's stderr after one line. `eprintln!`
//! panics on the next write ("failed printing to stderr: Broken pipe", exit 101), and a
//! panic in the agent leaves its workers unsupervised. A person who stopped reading has
//! not asked the job to stop, as torchrun's users know it: so every line the agent prints
//! goes through here, and a write that fails is dropped. The workers' own output has the
//! same rule in `supervisor::output`, and the log lines in `init_tracing` (which turns off
//! tracing's own `eprintln!` of a failed write).

use std::io::Write;

/// An error line: `who: error: text`, its control characters shown as escapes (a value
/// from a flag, a file or the store can hold ESC).
pub fn error(who: &str, text: &str) {
    error_line(format_args!(
        "{who}: error: {}",
        fsdp_rendezvous::text::shown(text)
    ));
}

/// Writes `args` and a newline to stderr; a closed or full stream drops it.
pub fn error_line(args: std::fmt::Arguments<'_>) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_fmt(args).and_then(|()| err.write_all(b"\n"));
}

/// Writes `text` to stdout as it is; a reader that stopped early (`| head`) is no error.
pub fn out(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
}

/// `eprintln!` that never panics: see the module docs.
#[macro_export]
macro_rules! say_err {
    ($($arg:tt)*) => {
        $crate::console::error_line(format_args!($($arg)*))
    };
}
