//! The `fsdp-agent` binary: parse, resolve, run, and map the outcome to an exit code.

fn main() -> std::process::ExitCode {
    fsdp_agent::main_entry(std::env::args_os().collect())
}
