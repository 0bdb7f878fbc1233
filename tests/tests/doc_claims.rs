//! What the docs say, checked against what the agent does. Each claim is a phrase a doc
//! must contain, word for word, and a check of the behaviour that phrase states, run
//! against the real binary (`--print-config`, a refused abbreviation, a one-node job of
//! `true`) or the pure function the binary runs. A claim fails when either side moves:
//! the doc no longer says it, or the agent no longer does it. Its message names the doc
//! line and the behaviour that disagree, so the fix is to change one to match the other.
//!
//! No etcd: everything here runs in a few seconds on any machine.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use fsdp_rendezvous::etcd::inspect::Health;
use fsdp_rendezvous::etcd::liveness::{Contact, Verdict, verdict};
use fsdp_rendezvous::seal::{Candidate, SealConfig, SealDecision, SealState, decide};
use fsdp_tests::{agent_bin, workspace_file};

/// One statement of the docs and how to check it.
struct Claim {
    /// The document, from the workspace root.
    doc: &'static str,
    /// What it must contain; runs of white space (line breaks included) count as one space.
    phrase: &'static str,
    /// The behaviour the check looks at, in words, for the failure message.
    behaviour: &'static str,
    /// Checks the behaviour; given the whole document and the phrase, for claims about a
    /// list.
    check: fn(&str, &str) -> Result<(), String>,
}

const CLAIMS: &[Claim] = &[
    // The exit barrier.
    Claim {
        doc: "docs/migrating-from-torchrun.md",
        phrase: "With `etcd` or `c10d`, a node whose workers all exit 0 waits for the other members of its round, up to `close_timeout` (300 s by default",
        behaviour: "--print-config's rendezvous line under etcd and c10d (exit_barrier=300s)",
        check: |_, _| exit_barrier_of_elastic_backends_is("300s"),
    },
    Claim {
        doc: "docs/exit-codes.md",
        phrase: "within `close_timeout` (default 300 s)",
        behaviour: "--print-config's rendezvous line under etcd and c10d (exit_barrier=300s)",
        check: |_, _| exit_barrier_of_elastic_backends_is("300s"),
    },
    Claim {
        doc: "docs/rendezvous.md",
        phrase: "| `close_timeout` | 300 s | exit barrier",
        behaviour: "--print-config's rendezvous line under etcd and c10d (exit_barrier=300s)",
        check: |_, _| exit_barrier_of_elastic_backends_is("300s"),
    },
    Claim {
        doc: "docs/migrating-from-torchrun.md",
        phrase: "A static group has no exit barrier: its nodes share no records, so a node whose workers succeeded exits 0 at once and logs `a static group has no exit barrier`",
        behaviour: "node 1 of a static group of 2 running `true` alone, and --print-config (exit_barrier=none)",
        check: |_, _| static_node_has_no_exit_barrier(),
    },
    Claim {
        doc: "docs/migrating-from-torchrun.md",
        phrase: "A standalone node has no one to wait for.",
        behaviour: "a --standalone job of `true`",
        check: |_, _| standalone_node_waits_for_nobody(),
    },
    // Abbreviations: the doc quotes the error lines themselves.
    Claim {
        doc: "docs/migrating-from-torchrun.md",
        phrase: "fsdp-agent: error: ambiguous option: --max could match --max-restarts, --max_restarts (torchrun refuses it too); write the flag out in full; see fsdp-agent --help",
        behaviour: "`fsdp-agent --max 3 train.py` (exit 64 and this line)",
        check: |_, line| abbreviation_refused("--max", line),
    },
    Claim {
        doc: "docs/migrating-from-torchrun.md",
        phrase: "fsdp-agent: error: ambiguous option: --hang could match --hang-timeout, --hang-min; write the flag out in full; see fsdp-agent --help",
        behaviour: "`fsdp-agent --hang 3 train.py` (exit 64 and this line)",
        check: |_, line| abbreviation_refused("--hang", line),
    },
    // Ranges.
    Claim {
        doc: "docs/migrating-from-torchrun.md",
        phrase: "A range works with `--rdzv-backend etcd` or `c10d`; the static backend needs a fixed node count, and says so.",
        behaviour: "--print-config of --nnodes 1:2 under c10d and etcd (accepted), and under static (exit 64 naming the fix)",
        check: |_, _| ranges_work_on_elastic_backends_only(),
    },
    Claim {
        doc: "README.md",
        phrase: "fsdp-agent --nnodes 2:4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host0 train.py",
        behaviour: "--print-config of the README's c10d line (accepted, nnodes=2:4 on a c10d store)",
        check: |_, line| {
            // The README's own words, less the program and the script.
            let args: Vec<&str> = line
                .split_whitespace()
                .skip(1)
                .filter(|w| *w != "train.py")
                .collect();
            let out = print_config(&args)?;
            expect_in(
                &setting(&out, "rendezvous")?,
                &["c10d store=host0:29400", "nnodes=2:4"],
            )
        },
    },
    // Failure detection: the lease TTL and the condition for fast detection.
    Claim {
        doc: "docs/rendezvous.md",
        phrase: "| `keep_alive_ttl` | 5 s | lease TTL",
        behaviour: "--print-config's rendezvous line under etcd (lease_ttl=5s)",
        check: |_, _| default_lease_ttl_is("5s"),
    },
    Claim {
        doc: "docs/kubernetes.md",
        phrase: "it is noticed after the lease TTL, `keep_alive_ttl` (rdzvConf, 5 s by default)",
        behaviour: "--print-config's rendezvous line under etcd (lease_ttl=5s)",
        check: |_, _| default_lease_ttl_is("5s"),
    },
    Claim {
        doc: "README.md",
        phrase: "a SIGKILLed agent well under a second when each agent's status port is reachable at its advertised address (ring liveness), else after the lease TTL, 5 s by default",
        behaviour: "the ring watcher's verdict (a refusal where the agent answered before evicts it; a refusal elsewhere or no answer leaves it to the lease) and the default lease TTL",
        check: |_, _| {
            ring_liveness_needs_a_reachable_status_port()?;
            default_lease_ttl_is("5s")
        },
    },
    Claim {
        doc: "docs/kubernetes.md",
        phrase: "A SIGKILLed pod is noticed within a fraction of a second when each agent's status port is reachable from the other pods at its advertised address",
        behaviour: "the ring watcher's verdict (a refusal where the agent answered before evicts it; a refusal elsewhere or no answer leaves it to the lease)",
        check: |_, _| ring_liveness_needs_a_reachable_status_port(),
    },
    Claim {
        doc: "docs/kubernetes.md",
        phrase: "Where the status port cannot be reached from the other pods (a NetworkPolicy, `--status-addr off`), the lease expiry decides",
        behaviour: "the ring watcher's verdict (a refusal where the agent answered before evicts it; a refusal elsewhere or no answer leaves it to the lease)",
        check: |_, _| ring_liveness_needs_a_reachable_status_port(),
    },
    Claim {
        doc: "docs/troubleshooting.md",
        phrase: "the others notice when its lease expires (`keep_alive_ttl`, 5 s by default) instead of within a fraction of a second",
        behaviour: "the ring watcher's verdict and --print-config's rendezvous line under etcd (lease_ttl=5s)",
        check: |_, _| {
            ring_liveness_needs_a_reachable_status_port()?;
            default_lease_ttl_is("5s")
        },
    },
    // The last call and choosing MIN:MAX.
    Claim {
        doc: "docs/migrating-from-torchrun.md",
        phrase: "So `--nnodes 2:4` with only two nodes waits the last call, 30 s by default, for more nodes before sealing with two.",
        behaviour: "--print-config of --nnodes 2:4 (last_call=30s) and the sealing rule with 2 of max 4 nodes",
        check: |_, _| {
            let out = print_config(&etcd_args("2:4", &[]))?;
            expect_in(&setting(&out, "rendezvous")?, &["last_call=30s"])?;
            two_of_four_wait_the_last_call(Duration::from_secs(30))
        },
    },
    Claim {
        doc: "docs/migrating-from-torchrun.md",
        phrase: "(`--rdzv-conf last_call_timeout=5`)",
        behaviour: "--print-config with --rdzv-conf last_call_timeout=5 (last_call=5s)",
        check: |_, _| {
            let out = print_config(&etcd_args("2:4", &["--rdzv-conf", "last_call_timeout=5"]))?;
            expect_in(&setting(&out, "rendezvous")?, &["last_call=5s"])
        },
    },
    Claim {
        doc: "docs/migrating-from-torchrun.md",
        phrase: "Equal MIN and MAX have no last call: the round is sealed as soon as all the nodes are there.",
        behaviour: "the sealing rule with --nnodes 2:2 and both nodes present",
        check: |_, _| equal_min_and_max_seal_at_once(),
    },
    Claim {
        doc: "docs/rendezvous.md",
        phrase: "| `last_call_timeout` | 30 s |",
        behaviour: "--print-config of --nnodes 2:4 (last_call=30s)",
        check: |_, _| {
            let out = print_config(&etcd_args("2:4", &[]))?;
            expect_in(&setting(&out, "rendezvous")?, &["last_call=30s"])
        },
    },
    // Topology-aware ranks.
    Claim {
        doc: "docs/rendezvous.md",
        phrase: "nodes that share a prefix are one contiguous run of ranks (each zone together, each rack within its zone), nodes within one segment keep their order, and nodes without a segment follow the others in theirs. When no node has a segment nothing moves",
        behaviour: "the sealing rule's order of a first round of located and unlocated nodes, and of one with no segments",
        check: |_, _| ranks_follow_segments(),
    },
    // The health values `fsdp-agent status` can print, and the agent's phases.
    Claim {
        doc: "docs/kubernetes.md",
        phrase: "`health` is one of healthy, forming, degraded, finished, stopped, corrupt, halted:",
        behaviour: "the values of fsdp_rendezvous::etcd::inspect::Health, the verdicts `fsdp-agent status` prints",
        check: |_, phrase| same_names("the list", &list_in(phrase, "healthy"), &health_values()),
    },
    Claim {
        doc: "docs/kubernetes.md",
        phrase: "- `healthy`: every member of the round is alive",
        behaviour: "the values of fsdp_rendezvous::etcd::inspect::Health, the verdicts `fsdp-agent status` prints",
        check: |doc, _| {
            let explained = bullets_after(doc, "`health` is one of");
            same_names(
                "the bullets explaining each value",
                &explained,
                &health_values(),
            )
        },
    },
    Claim {
        doc: "docs/migrating-from-torchrun.md",
        phrase: "verdict (healthy, forming, degraded, finished, stopped, corrupt, halted)",
        behaviour: "the values of fsdp_rendezvous::etcd::inspect::Health, the verdicts `fsdp-agent status` prints",
        check: |_, phrase| same_names("the list", &list_in(phrase, "healthy"), &health_values()),
    },
    Claim {
        doc: "docs/glossary.md",
        phrase: "healthy, forming, degraded, finished, stopped, corrupt or halted",
        behaviour: "the values of fsdp_rendezvous::etcd::inspect::Health, the verdicts `fsdp-agent status` prints",
        check: |_, phrase| same_names("the list", &list_in(phrase, "healthy"), &health_values()),
    },
    Claim {
        doc: "docs/kubernetes.md",
        phrase: "`GetStatus` returns the phase (rendezvous, running, stopping, finishing, succeeded, failed, leaving)",
        behaviour: "the values of fsdp.v1.Phase that GetStatus returns",
        check: |_, phrase| same_names("the list", &list_in(phrase, "rendezvous"), &phase_values()),
    },
    // The status address.
    Claim {
        doc: "docs/migrating-from-torchrun.md",
        phrase: "Default `0.0.0.0:29450`, and `127.0.0.1:0` under `--standalone`",
        behaviour: "--print-config's status-addr under --standalone (127.0.0.1:0), and for a job of several nodes and a one-node etcd job (0.0.0.0:29450)",
        check: |_, _| status_addr_defaults(),
    },
    Claim {
        doc: "README.md",
        phrase: "default 0.0.0.0:29450 for a job with a rendezvous backend, one node or many, 127.0.0.1 and a free port under --standalone",
        behaviour: "--print-config's status-addr under --standalone (127.0.0.1:0), and for a job of several nodes and a one-node etcd job (0.0.0.0:29450)",
        check: |_, _| status_addr_defaults(),
    },
    Claim {
        doc: "docs/glossary.md",
        phrase: "`0.0.0.0:29450` for a job with a rendezvous backend (etcd, c10d, static; even of one node, where a pod's probes aim), `127.0.0.1:0` under `--standalone`",
        behaviour: "--print-config's status-addr under --standalone (127.0.0.1:0), and for a job of several nodes and a one-node etcd job (0.0.0.0:29450)",
        check: |_, _| status_addr_defaults(),
    },
];

#[test]
fn every_claim_of_the_docs_holds() {
    let failures: Vec<String> = CLAIMS.iter().filter_map(|c| judge(c).err()).collect();
    assert!(
        failures.is_empty(),
        "{} of {} claims disagree with the agent:\n\n{}",
        failures.len(),
        CLAIMS.len(),
        failures.join("\n\n")
    );
}

/// The glossary is linked from the README, and every link into it lands on a term.
#[test]
fn links_into_the_glossary_land_on_a_term() {
    let glossary = read("docs/glossary.md");
    let readme = read("README.md");
    assert!(
        readme.contains("(docs/glossary.md)"),
        "README.md does not link docs/glossary.md"
    );
    let mut docs = vec![("README.md".to_owned(), readme)];
    for entry in std::fs::read_dir(workspace_file("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            let name = format!("docs/{}", path.file_name().unwrap().to_string_lossy());
            docs.push((name.clone(), read(&name)));
        }
    }
    let mut broken = Vec::new();
    for (name, text) in &docs {
        for (at, _) in text.match_indices("glossary.md#") {
            let id: String = text[at + "glossary.md#".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            if !glossary.contains(&format!("<a id=\"{id}\"></a>")) {
                broken.push(format!(
                    "{name}:{} links glossary.md#{id}",
                    line_of(text, at)
                ));
            }
        }
    }
    for (at, _) in glossary.match_indices("](#") {
        let id: String = glossary[at + 3..]
            .chars()
            .take_while(|c| *c != ')')
            .collect();
        if !glossary.contains(&format!("<a id=\"{id}\"></a>")) {
            broken.push(format!(
                "docs/glossary.md:{} links #{id}",
                line_of(&glossary, at)
            ));
        }
    }
    assert!(
        broken.is_empty(),
        "no such term in docs/glossary.md:\n{}",
        broken.join("\n")
    );
}

/// One line per term, as the glossary promises, each with its anchor.
#[test]
fn the_glossary_gives_each_term_one_line() {
    let glossary = read("docs/glossary.md");
    let terms: Vec<&str> = glossary.lines().filter(|l| l.starts_with("- ")).collect();
    assert!(terms.len() >= 20, "only {} terms", terms.len());
    for line in &terms {
        assert!(
            line.starts_with("- <a id=\"") && line.contains("</a>**"),
            "a glossary line without its anchor and term: {line}"
        );
    }
    for term in [
        "round",
        "sealed",
        "fencing",
        "coordinator",
        "ring-neighbour",
        "straggler",
        "last-call",
        "spare",
        "restart-budget",
        "exit-barrier",
        "lease",
        "incarnation",
        "quarantine",
        "halt",
        "c10d-store",
    ] {
        assert!(
            glossary.contains(&format!("<a id=\"{term}\"></a>")),
            "docs/glossary.md has no line for {term}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Judging a claim.

fn judge(c: &Claim) -> Result<(), String> {
    let text = read(c.doc);
    let Some(line) = find_phrase(&text, c.phrase) else {
        return Err(format!(
            "{} no longer says: \"{}\"\n  the check of it ({}) stays in tests/tests/doc_claims.rs: change the claim with the doc",
            c.doc, c.phrase, c.behaviour
        ));
    };
    (c.check)(&text, c.phrase).map_err(|why| {
        format!(
            "{}:{line} says: \"{}\"\n  but {}: {why}",
            c.doc, c.phrase, c.behaviour
        )
    })
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(workspace_file(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The line where `phrase` starts in `text`, runs of white space counting as one space.
fn find_phrase(text: &str, phrase: &str) -> Option<usize> {
    let want = collapse(phrase).0;
    let (flat, offsets) = collapse(text);
    flat.find(&want).map(|at| line_of(text, offsets[at]))
}

/// `text` with every run of white space made one space, and where each byte of the
/// result came from. A `# ` that opens a line counts as white space too, so a phrase
/// may run on from one line of a shell comment (the README's examples) to the next.
fn collapse(text: &str) -> (String, Vec<usize>) {
    let (mut flat, mut offsets) = (String::new(), Vec::new());
    let mut space = false;
    let mut line_start = true;
    let mut chars = text.char_indices().peekable();
    while let Some((i, ch)) = chars.next() {
        if ch.is_whitespace() {
            space = true;
            line_start |= ch == '\n';
            continue;
        }
        if line_start && ch == '#' && chars.peek().is_some_and(|(_, c)| *c == ' ') {
            space = true;
            line_start = false;
            continue;
        }
        line_start = false;
        if space && !flat.is_empty() {
            flat.push(' ');
            offsets.push(i);
        }
        space = false;
        flat.push(ch);
        offsets.extend(std::iter::repeat_n(i, ch.len_utf8()));
    }
    (flat, offsets)
}

fn line_of(text: &str, byte: usize) -> usize {
    text[..byte].matches('\n').count() + 1
}

/// The names of the list in `phrase` that starts with `first` and ends at `)`, `:` or
/// the phrase's end: `a, b, c` or `a, b or c`.
fn list_in(phrase: &str, first: &str) -> Vec<String> {
    let from = &phrase[phrase.find(first).unwrap_or(phrase.len())..];
    let list = from.split([')', ':']).next().unwrap_or("");
    list.split(',')
        .flat_map(|item| item.split(" or "))
        .map(str::trim)
        .filter(|w| !w.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The `- \`name\`:` bullets of the list that follows `heading` in `doc`.
fn bullets_after(doc: &str, heading: &str) -> Vec<String> {
    let Some(at) = doc.find(heading) else {
        return Vec::new();
    };
    doc[at..]
        .lines()
        .skip_while(|l| !l.starts_with("- `"))
        .take_while(|l| l.starts_with("- `") || l.starts_with("  "))
        .filter_map(|l| l.strip_prefix("- `")?.split('`').next().map(str::to_owned))
        .collect()
}

fn same_names(what: &str, doc: &[String], code: &[String]) -> Result<(), String> {
    let missing: Vec<&String> = code.iter().filter(|n| !doc.contains(n)).collect();
    let extra: Vec<&String> = doc.iter().filter(|n| !code.contains(n)).collect();
    if missing.is_empty() && extra.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{what} in the doc is {doc:?}; the code has {code:?} (missing from the doc: {missing:?}; not in the code: {extra:?})"
    ))
}

fn health_values() -> Vec<String> {
    Health::ALL.iter().map(|h| h.as_str().to_owned()).collect()
}

fn phase_values() -> Vec<String> {
    use fsdp_proto::v1::Phase;
    (1..64)
        .filter_map(|n| Phase::try_from(n).ok())
        .map(|p| {
            p.as_str_name()
                .trim_start_matches("PHASE_")
                .to_ascii_lowercase()
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Running the agent.

/// The agent with none of the caller's PET_*, FSDP_* or TORCHELASTIC_* settings.
fn agent() -> Command {
    let mut cmd = Command::new(agent_bin());
    for (k, _) in std::env::vars() {
        if k.starts_with("PET_") || k.starts_with("FSDP_") || k.starts_with("TORCHELASTIC_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("RUST_LOG", "info").stdin(Stdio::null());
    cmd
}

/// `fsdp-agent ARGS --print-config examples/allreduce.py`: its stdout, or why it failed.
fn print_config(args: &[&str]) -> Result<String, String> {
    let out = agent()
        .args(args)
        .arg("--print-config")
        .arg(workspace_file("examples/allreduce.py"))
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "`fsdp-agent {} --print-config` exited {:?}: {}",
            args.join(" "),
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The value and source of one `--print-config` setting.
fn setting(config: &str, name: &str) -> Result<String, String> {
    config
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .map(|l| l[name.len()..].trim().to_owned())
        .ok_or_else(|| format!("--print-config shows no `{name}`:\n{config}"))
}

fn expect_in(line: &str, wanted: &[&str]) -> Result<(), String> {
    match wanted.iter().find(|w| !line.contains(**w)) {
        None => Ok(()),
        Some(w) => Err(format!("`{line}` lacks `{w}`")),
    }
}

fn etcd_args<'a>(nnodes: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![
        "--nnodes",
        nnodes,
        "--rdzv-backend",
        "etcd",
        "--rdzv-endpoint",
        "127.0.0.1:2379",
        "--rdzv-id",
        "doc-claims",
    ];
    v.extend_from_slice(extra);
    v
}

const C10D: [&str; 4] = [
    "--rdzv-backend",
    "c10d",
    "--rdzv-endpoint",
    "127.0.0.1:29400",
];

/// Runs a short job to its end: (exit code, stderr).
fn run_job(args: &[&str]) -> Result<(i32, String), String> {
    let mut child = agent()
        .args(["--status-addr", "off", "--log-dir", "/dev/null"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().map_err(|e| e.to_string())?.is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().map_err(|e| e.to_string())?;
            return Err(format!(
                "`fsdp-agent {}` still ran after 60 s: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let Output { status, stderr, .. } = child.wait_with_output().map_err(|e| e.to_string())?;
    Ok((
        status.code().unwrap_or(-1),
        String::from_utf8_lossy(&stderr).into_owned(),
    ))
}

// ---------------------------------------------------------------------------------------
// The checks.

fn exit_barrier_of_elastic_backends_is(default: &str) -> Result<(), String> {
    let want = format!("exit_barrier={default}");
    let etcd = print_config(&etcd_args("2", &[]))?;
    expect_in(&setting(&etcd, "rendezvous")?, &[&want])?;
    let c10d = print_config(&[&["--nnodes", "2"][..], &C10D].concat())?;
    expect_in(&setting(&c10d, "rendezvous")?, &[&want])
}

fn static_node_has_no_exit_barrier() -> Result<(), String> {
    let out = print_config(&[
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
    ])?;
    expect_in(
        &setting(&out, "rendezvous")?,
        &["static", "exit_barrier=none"],
    )?;
    // Node 1 done while node 0's worker still runs: were there a barrier it would wait
    // for node 0. (Node 0 is there: a static group's first round waits for every node.)
    let port = free_port().to_string();
    let mut node0 = agent()
        .args(["--status-addr", "off", "--log-dir", "/dev/null"])
        .args([
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "127.0.0.1",
        ])
        .args(["--master-port", &port, "--no-python", "sleep", "60"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let node1 = run_job(&[
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port,
        "--no-python",
        "true",
    ]);
    let _ = node0.kill();
    let _ = node0.wait();
    let (code, err) = node1?;
    if code != 0 || !err.contains("a static group has no exit barrier") {
        return Err(format!("exit {code}, log:\n{err}"));
    }
    if err.contains("waiting for the other nodes") {
        return Err(format!("it waited for the other nodes:\n{err}"));
    }
    Ok(())
}

fn standalone_node_waits_for_nobody() -> Result<(), String> {
    let (code, err) = run_job(&["--standalone", "--no-python", "true"])?;
    if code != 0 || err.contains("waiting for the other nodes") || err.contains("exit barrier") {
        return Err(format!("exit {code}, log:\n{err}"));
    }
    Ok(())
}

fn abbreviation_refused(prefix: &str, line: &str) -> Result<(), String> {
    let out = agent()
        .args([prefix, "3"])
        .arg(workspace_file("examples/allreduce.py"))
        .output()
        .map_err(|e| e.to_string())?;
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.code() != Some(64) || err.trim() != line {
        return Err(format!(
            "exit {:?}, stderr: {}",
            out.status.code(),
            err.trim()
        ));
    }
    Ok(())
}

fn ranges_work_on_elastic_backends_only() -> Result<(), String> {
    let c10d = print_config(&[&["--nnodes", "1:2"][..], &C10D].concat())?;
    expect_in(
        &setting(&c10d, "rendezvous")?,
        &["c10d store=", "nnodes=1:2"],
    )?;
    let etcd = print_config(&etcd_args("1:2", &[]))?;
    expect_in(
        &setting(&etcd, "rendezvous")?,
        &["etcd endpoints=", "nnodes=1:2"],
    )?;
    let out = agent()
        .args([
            "--nnodes",
            "1:2",
            "--master-addr",
            "127.0.0.1",
            "--print-config",
        ])
        .arg(workspace_file("examples/allreduce.py"))
        .output()
        .map_err(|e| e.to_string())?;
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.code() != Some(64)
        || !err.contains("static backend needs a fixed node count")
        || !err.contains("c10d")
    {
        return Err(format!(
            "a static range gave exit {:?}: {}",
            out.status.code(),
            err.trim()
        ));
    }
    Ok(())
}

fn default_lease_ttl_is(ttl: &str) -> Result<(), String> {
    let out = print_config(&etcd_args("2", &[]))?;
    expect_in(
        &setting(&out, "rendezvous")?,
        &[&format!("lease_ttl={ttl}")],
    )
}

/// Fast detection holds only where the watched agent's status port answered at its
/// advertised address: then a refusal proves it dead. Anywhere else the lease decides.
fn ring_liveness_needs_a_reachable_status_port() -> Result<(), String> {
    let addr = "10.0.0.2:29450";
    let refused = Contact::Refused;
    if !matches!(verdict("n2", addr, &refused, true), Verdict::Gone { .. }) {
        return Err("a refusal where the agent answered before does not evict it".into());
    }
    if verdict("n2", addr, &refused, false) != Verdict::Keep {
        return Err("a refusal at an address that never answered evicts the agent".into());
    }
    if verdict("n2", addr, &Contact::Silent, true) != Verdict::Keep {
        return Err("no answer evicts the agent, where the docs leave it to the lease".into());
    }
    Ok(())
}

fn two_of_four_wait_the_last_call(last_call: Duration) -> Result<(), String> {
    let cfg = SealConfig {
        min_nodes: 2,
        max_nodes: 4,
        last_call,
        straggler_timeout: Duration::from_secs(30),
        segment_size: 1,
    };
    let start = Instant::now();
    let nodes = candidates(2);
    let state = |quiet_since| SealState {
        current: None,
        candidates: &nodes,
        quiet_since,
        reform_since: None,
    };
    match decide(start, &state(start), &cfg).0 {
        SealDecision::Wait {
            recheck_at: Some(at),
        } if at == start + last_call => {}
        other => return Err(format!("two of 2:4 at once: {other:?}")),
    }
    match decide(start + last_call, &state(start), &cfg).0 {
        SealDecision::Seal(p) if p.members.len() == 2 => Ok(()),
        other => Err(format!("two of 2:4 after the last call: {other:?}")),
    }
}

fn equal_min_and_max_seal_at_once() -> Result<(), String> {
    let cfg = SealConfig {
        min_nodes: 2,
        max_nodes: 2,
        last_call: Duration::from_secs(30),
        straggler_timeout: Duration::from_secs(30),
        segment_size: 1,
    };
    let now = Instant::now();
    let nodes = candidates(2);
    let state = SealState {
        current: None,
        candidates: &nodes,
        quiet_since: now,
        reform_since: None,
    };
    match decide(now, &state, &cfg).0 {
        SealDecision::Seal(p) if p.members.len() == 2 => Ok(()),
        other => Err(format!("two of 2:2 the moment both are there: {other:?}")),
    }
}

/// A first round of six nodes in two zones (racks in one), two of them unlocated, in join
/// order node0 to node5; and the same nodes with no segment at all.
fn ranks_follow_segments() -> Result<(), String> {
    let cfg = SealConfig {
        min_nodes: 6,
        max_nodes: 6,
        last_call: Duration::from_secs(30),
        straggler_timeout: Duration::from_secs(30),
        segment_size: 1,
    };
    let segments = ["z1", "", "z0/r1", "z0/r0", "z0/r1", ""];
    let mut nodes = candidates(6);
    for (n, s) in nodes.iter_mut().zip(segments) {
        n.segment = s.into();
    }
    let now = Instant::now();
    let order = |nodes: &[Candidate]| match decide(
        now,
        &SealState {
            current: None,
            candidates: nodes,
            quiet_since: now,
            reform_since: None,
        },
        &cfg,
    )
    .0
    {
        SealDecision::Seal(p) => Ok(p.members),
        other => Err(format!("six of 6:6: {other:?}")),
    };
    let located = order(&nodes)?;
    let want = ["node3", "node2", "node4", "node0", "node1", "node5"];
    if located != want {
        return Err(format!("located nodes ranked {located:?}, not {want:?}"));
    }
    let plain = order(&candidates(6))?;
    let join: Vec<String> = (0..6).map(|i| format!("node{i}")).collect();
    if plain != join {
        return Err(format!("with no segments ranked {plain:?}, not join order"));
    }
    Ok(())
}

fn candidates(n: i64) -> Vec<Candidate> {
    (0..n)
        .map(|i| Candidate {
            node_id: format!("node{i}"),
            joined_rev: i + 1,
            ready: true,
            segment: String::new(),
        })
        .collect()
}

fn status_addr_defaults() -> Result<(), String> {
    let standalone = print_config(&["--standalone"])?;
    expect_in(
        &setting(&standalone, "status-addr")?,
        &["127.0.0.1:0", "(default)"],
    )?;
    let several = print_config(&etcd_args("2", &[]))?;
    expect_in(
        &setting(&several, "status-addr")?,
        &["0.0.0.0:29450", "(default)"],
    )?;
    let one = print_config(&etcd_args("1", &[]))?;
    expect_in(
        &setting(&one, "status-addr")?,
        &["0.0.0.0:29450", "(default)"],
    )
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[test]
fn a_phrase_is_found_across_line_breaks_and_only_there() {
    let text = "one\ntwo three\n  four five\n";
    assert_eq!(find_phrase(text, "three four"), Some(2));
    assert_eq!(find_phrase(text, "two three four"), Some(2));
    assert_eq!(find_phrase(text, "one two"), Some(1));
    assert_eq!(find_phrase(text, "three five"), None);
    let comment = "# the rest re-form\n# at once\n## Heading\n";
    assert_eq!(find_phrase(comment, "re-form at once"), Some(1));
    assert_eq!(find_phrase(comment, "once ## Heading"), Some(2));
}
