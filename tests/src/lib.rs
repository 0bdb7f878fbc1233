//! Test harness for fsdp-agent's integration tests.
