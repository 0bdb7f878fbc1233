//! What makes two agents one job, so that two jobs started with the same `--rdzv-id` on
//! one etcd do not merge. They used to: the second job's agents waited as spares of the
//! first, and when one of its nodes died a stranger took its rank and resumed from its own
//! checkpoint, all-reducing two runs' gradients without a word. torchrun has the same
//! hazard.
//!
//! The job is what every node of one job is given alike: the entrypoint and its
//! arguments, `--nproc-per-node` (a number as given; `gpu`, `cpu` and `auto` as one word,
//! since each node counts its own) and `--nnodes`. Not what differs per node by design: the
//! node's address, host name, rank, its log or working directory, its environment. A job
//! whose nodes are given different arguments on purpose turns the check off
//! (`--rdzv-conf job_check=0`).
//!
//! The job travels as `cmd=<digest>;nproc=<as given>;nnodes=<MIN:MAX>` (and
//! `;segments=<K>` with `--segment-size`) in each registration and once in each round: short, and readable enough that a refusal names
//! what differs. The command is a digest (FNV-1a, stable across builds): arguments may hold
//! paths and names that are nobody else's business, and any length.

/// The job of an agent given `entrypoint` with `args`, `--nproc-per-node nproc` and
/// `--nnodes MIN:MAX`.
pub fn fingerprint(entrypoint: &str, args: &[String], nproc: &str, nnodes: (u32, u32)) -> String {
    let mut h = Fnv::default();
    h.write(entrypoint.as_bytes());
    for a in args {
        // Each argument ends where the next begins: `a b` and `ab` differ.
        h.write(&(a.len() as u64).to_le_bytes());
        h.write(a.as_bytes());
    }
    let nnodes = if nnodes.0 == nnodes.1 {
        nnodes.0.to_string()
    } else {
        format!("{}:{}", nnodes.0, nnodes.1)
    };
    format!("cmd={:016x};nproc={nproc};nnodes={nnodes}", h.0)
}

/// `job` for rounds of whole blocks of `size` nodes (`--segment-size`): agents that
/// count blocks differently would seal rounds the others' rule breaks at once. Without
/// blocks the job is unchanged, so agents from before blocks still match it.
pub fn with_segment_size(job: String, size: u32) -> String {
    if size <= 1 || job.is_empty() {
        return job;
    }
    format!("{job};segments={size}")
}

/// What differs between this agent's job `mine` and the running job `theirs`, in words;
/// `None` when they are one job (or either does not say: an older agent, a check turned
/// off).
pub fn differs(mine: &str, theirs: &str) -> Option<String> {
    if mine.is_empty() || theirs.is_empty() || mine == theirs {
        return None;
    }
    let part = |job: &str, key: &str| -> Option<String> {
        job.split(';')
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .map(str::to_owned)
    };
    let mut what = Vec::new();
    if part(mine, "cmd") != part(theirs, "cmd") {
        what.push("the command (the entrypoint or its arguments)".to_owned());
    }
    // What a job without the part means: unknown, but no segments is blocks of one.
    let parts = [
        ("nproc", "--nproc-per-node", "?"),
        ("nnodes", "--nnodes", "?"),
        ("segments", "--segment-size", "1"),
    ];
    for (key, flag, absent) in parts {
        let value = |job: &str| part(job, key).unwrap_or_else(|| absent.to_owned());
        let (a, b) = (value(mine), value(theirs));
        if a != b {
            what.push(format!("{flag} ({a} here, {b} there)"));
        }
    }
    if what.is_empty() {
        what.push(format!("its job ({mine} here, {theirs} there)"));
    }
    Some(what.join(", "))
}

/// FNV-1a of `bytes`, 64 bits ([`Fnv`]).
pub(crate) fn fnv(bytes: &[u8]) -> u64 {
    let mut h = Fnv::default();
    h.write(bytes);
    h.0
}

/// FNV-1a, 64 bits: a digest that is the same in every build of every version, unlike
/// the standard library's hasher.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn one_job_is_one_fingerprint_in_every_build() {
        let a = fingerprint("train.py", &args(&["--ckpt", "/a"]), "gpu", (2, 3));
        assert_eq!(
            a,
            fingerprint("train.py", &args(&["--ckpt", "/a"]), "gpu", (2, 3))
        );
        // Fixed here so that a change of digest, which would split mixed versions of
        // one job, is seen.
        assert_eq!(a, "cmd=cfd6caedeae80bde;nproc=gpu;nnodes=2:3");
        assert!(fingerprint("t.py", &[], "8", (4, 4)).ends_with(";nproc=8;nnodes=4"));
    }

    #[test]
    fn what_differs_is_named() {
        let a = fingerprint("train.py", &args(&["--ckpt", "/a"]), "8", (3, 3));
        let b = fingerprint("train.py", &args(&["--ckpt", "/b"]), "8", (3, 3));
        assert_eq!(differs(&a, &a), None);
        assert_eq!(
            differs(&b, &a).as_deref(),
            Some("the command (the entrypoint or its arguments)")
        );
        let c = fingerprint("train.py", &args(&["--ckpt", "/a"]), "4", (2, 3));
        assert_eq!(
            differs(&c, &a).as_deref(),
            Some("--nproc-per-node (4 here, 8 there), --nnodes (2:3 here, 3 there)")
        );
        // Argument boundaries count.
        assert_ne!(
            fingerprint("t", &args(&["a b"]), "1", (1, 1)),
            fingerprint("t", &args(&["a", "b"]), "1", (1, 1))
        );
        // Blocks are part of the job; none is what an agent from before blocks runs.
        let blocks = with_segment_size(a.clone(), 4);
        assert_eq!(blocks, format!("{a};segments=4"));
        assert_eq!(with_segment_size(a.clone(), 1), a);
        assert_eq!(with_segment_size(String::new(), 4), "");
        assert_eq!(
            differs(&blocks, &a).as_deref(),
            Some("--segment-size (4 here, 1 there)")
        );
        // An older agent, or the check turned off: nothing to compare.
        assert_eq!(differs("", &a), None);
        assert_eq!(differs(&a, ""), None);
    }
}
