//! The agent's one tokio runtime, for both commands (`fsdp-agent` and `fsdp-agent
//! status`): current-thread, on the main thread (see "One thread" in the crate docs for
//! why). A leaf: the commands below the crate root build their runtime here instead of
//! calling up into it.

use std::process::ExitCode;

use crate::exit_code;

/// Builds the runtime. `who` names the command in the error message; a failure is the
/// agent's own (exit 70).
pub(crate) fn build(who: &str) -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            say_err!("{who}: error: cannot start the async runtime: {e}");
            ExitCode::from(exit_code::INTERNAL)
        })
}
