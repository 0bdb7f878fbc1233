use super::*;

fn set(pairs: &[(&str, &str)]) -> Overlay {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), Some((*v).to_owned())))
        .collect()
}

fn view(readiness: Readiness, age_s: u64, overlay: &Overlay) -> SpareView<'_> {
    SpareView {
        readiness,
        age: Duration::from_secs(age_s),
        overlay,
    }
}

const PATIENCE: Duration = Duration::from_secs(30);

#[test]
fn a_ready_spare_takes_any_round_that_changes_only_per_round_variables() {
    let spare = set(&[("LOCAL_RANK", "1"), ("OMP_NUM_THREADS", "1")]);
    let round = set(&[
        ("LOCAL_RANK", "1"),
        ("OMP_NUM_THREADS", "1"),
        ("RANK", "5"),
        ("WORLD_SIZE", "6"),
        ("MASTER_PORT", "29511"),
        ("TORCHELASTIC_RESTART_COUNT", "2"),
    ]);
    let (start, _) = decide(Some(&view(Readiness::Ready, 1, &spare)), &round, PATIENCE);
    assert_eq!(start, Start::Warm);
}

#[test]
fn a_changed_device_list_or_a_removed_variable_means_a_cold_start_that_names_it() {
    let spare = set(&[("CUDA_VISIBLE_DEVICES", "0"), ("LOCAL_RANK", "0")]);
    let round = set(&[("CUDA_VISIBLE_DEVICES", "1"), ("LOCAL_RANK", "0")]);
    let (start, why) = decide(Some(&view(Readiness::Ready, 1, &spare)), &round, PATIENCE);
    assert_eq!(start, Start::Cold);
    assert!(
        why.contains("CUDA_VISIBLE_DEVICES=0, the round needs CUDA_VISIBLE_DEVICES=1"),
        "{why}"
    );

    let mut scrubbed = spare.clone();
    scrubbed.push(("FSDP_ETCD_PASSWORD".into(), None));
    let (start, why) = decide(
        Some(&view(Readiness::Ready, 1, &spare)),
        &scrubbed,
        PATIENCE,
    );
    assert_eq!(start, Start::Cold);
    assert!(
        why.contains(
            "FSDP_ETCD_PASSWORD as the agent has it, the round needs FSDP_ETCD_PASSWORD removed"
        ),
        "{why}"
    );
}

#[test]
fn an_importing_spare_is_waited_for_until_the_patience_is_spent() {
    let o = set(&[("LOCAL_RANK", "0")]);
    let (start, _) = decide(Some(&view(Readiness::Importing, 2, &o)), &o, PATIENCE);
    assert_eq!(start, Start::Wait(Duration::from_secs(28)));
    let (start, why) = decide(Some(&view(Readiness::Importing, 30, &o)), &o, PATIENCE);
    assert_eq!(start, Start::Cold);
    assert!(why.contains("still importing after 30 s"), "{why}");
}

#[test]
fn a_dead_or_failed_spare_or_none_means_cold_with_the_reason() {
    let o = set(&[]);
    let gone = view(Readiness::Gone("exited (signal 9 (SIGKILL))".into()), 5, &o);
    let (start, why) = decide(Some(&gone), &o, PATIENCE);
    assert_eq!(
        (start, why.as_str()),
        (Start::Cold, "the spare exited (signal 9 (SIGKILL))")
    );
    let failed = view(Readiness::Failed("import nosuch failed".into()), 5, &o);
    let (start, why) = decide(Some(&failed), &o, PATIENCE);
    assert_eq!(start, Start::Cold);
    assert!(why.starts_with("the spare failed: import nosuch"), "{why}");
    assert_eq!(decide(None, &o, PATIENCE).0, Start::Cold);
}

#[test]
fn a_mismatched_environment_is_cold_even_while_the_spare_imports() {
    let spare = set(&[("PYTHONPATH", "/a")]);
    let round = set(&[("PYTHONPATH", "/b")]);
    let (start, _) = decide(
        Some(&view(Readiness::Importing, 1, &spare)),
        &round,
        PATIENCE,
    );
    assert_eq!(start, Start::Cold);
}

#[test]
fn the_environment_applies_sets_and_removals_over_the_agents() {
    let home = std::env::var_os("HOME").expect("HOME is set");
    let env = environment(&vec![
        ("FSDP_TEST_NEW".into(), Some("1".into())),
        ("HOME".into(), None),
    ]);
    assert!(env.iter().any(|(k, v)| k == "FSDP_TEST_NEW" && v == "1"));
    assert!(!env.iter().any(|(k, v)| k == "HOME" && *v == home));
}

#[test]
fn orders_are_nul_separated_counts_and_fields() {
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let o = Orders {
        args: vec!["train.py".into(), "--lr".into()],
        env: vec![("A".into(), "1=2".into())],
        cwd: "/work".into(),
        stdout: a.into(),
        stderr: b.into(),
    };
    assert_eq!(encode(&o), b"2\0train.py\0--lr\x001\0A=1=2\0/work".to_vec());
}

/// The source every spare runs cannot be changed by another process of the same user
/// through `/proc/<agent>/fd/N`.
#[test]
fn the_spare_source_is_sealed_against_writes_and_resizing() {
    use std::io::Write;
    let fd = source_fd().unwrap();
    let path = format!("/proc/self/fd/{fd}");
    // The seals belong to the file, so any descriptor of it reads them.
    let reader = std::fs::File::open(&path).unwrap();
    let seals = SealFlag::from_bits_truncate(fcntl(&reader, FcntlArg::F_GET_SEALS).unwrap());
    assert!(seals.contains(SOURCE_SEALS), "seals: {seals:?}");
    // What the outside tester did: open the descriptor's /proc entry and write.
    let refused = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|mut f| f.write_all(b"import os; os._exit(7)\n"));
    let err = refused.expect_err("a write through /proc must fail");
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text, SOURCE);
}
