//! The last round this thread decoded, kept with the bytes it came from.
//!
//! Every member of a run takes each round it is sent, and the round is the one large
//! record (a member per node). Where one process holds many nodes (`rdzv-bench`: thousands
//! of simulated nodes on a few connections), each decoding the same bytes into its own
//! copy made the process decode N rounds of N members and hold them all: at 10,000 nodes,
//! 10^8 members, more than the machine's memory. Separate hosts each decode once, on
//! their own CPU; with the memo the nodes of one process decode once a thread between them
//! and share the members (each a counted handle, [`fsdp_proto::v1::Member`]). For an
//! agent, one node to a process, it costs a comparison of the bytes and a copy of the
//! member handles per round. Per thread, not per process: no lock for the runtime's
//! threads to wait on, and no thread's decoding changes what another's memo holds.
//!
//! What a node then judges of the round's members (their text, their distinctness, their
//! worker counts against what this node allows) is kept the same way, beside the very
//! member handles it judged ([`judged`]): at 10,000 nodes in one process each judging the
//! same 10,000 members, the judging was 10^8 checks, a core for seconds while the round
//! was being delivered, and the nodes' keep-alives waited behind it.

use std::cell::RefCell;
use std::ops::RangeInclusive;
use std::sync::Arc;

use fsdp_proto::{RecordError, decode, v1};

use crate::{RoundMember, ranks};

thread_local! {
    /// The bytes last decoded on this thread and what they decoded to.
    static LAST: RefCell<Option<(Vec<u8>, v1::Round)>> = const { RefCell::new(None) };
    /// The last verdict of each judgement on this thread, with the members it judged.
    static JUDGED: RefCell<Vec<Verdict>> = const { RefCell::new(Vec::new()) };
    /// The last round's members given their ranks on this thread, and the world size.
    static RANKED: RefCell<Option<Ranked>> = const { RefCell::new(None) };
}

/// A round's members as a node runs them (in rank order, each with its ranks), shared
/// by every node of the thread that takes that round.
struct Ranked {
    /// The records they were made from, held as [`Verdict::members`] are.
    from: Vec<v1::Member>,
    said: Result<(Arc<[RoundMember]>, u32), String>,
}

/// A judgement of a round's members whose verdict depends on nothing else than the
/// members and the rules named here.
#[derive(Clone, PartialEq)]
pub enum Judgement {
    /// Their node ids and addresses are text a record may carry.
    Text,
    /// They form a group this node's rules allow (`--nnodes`, the workers a node may
    /// ask for), and, when `check_distinct`, name no node twice.
    Group {
        nodes: RangeInclusive<u32>,
        workers_per_node: RangeInclusive<u32>,
        check_distinct: bool,
    },
}

impl Judgement {
    /// Whether `other` is the same kind of judgement (under any rules): each kind keeps
    /// its last verdict only.
    fn kind_of(&self, other: &Self) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

struct Verdict {
    judgement: Judgement,
    /// Held: no member judged can be freed and another take its address, and none can be
    /// changed in place (a member's fields are changed in place only through its one
    /// handle; with this one beside it, they are copied first: [`v1::Member`]).
    members: Vec<v1::Member>,
    said: Result<(), String>,
}

/// The round stored as `value` at `key`: the memo's if it came from the very same bytes,
/// else decoded (and then kept). A value that does not decode is not kept.
pub fn round(key: &str, value: &[u8]) -> Result<v1::Round, RecordError> {
    if let Some(round) = held(value) {
        return Ok(round);
    }
    let round = decode::<v1::Round>(key, value)?;
    LAST.with_borrow_mut(|last| *last = Some((value.to_vec(), round.clone())));
    Ok(round)
}

fn held(value: &[u8]) -> Option<v1::Round> {
    LAST.with_borrow(|last| {
        let (bytes, round) = last.as_ref()?;
        (bytes.as_slice() == value).then(|| round.clone())
    })
}

/// What `judge` says of `members` under `judgement`: the verdict kept on this thread when
/// these very member handles were judged so last (held by the memo, the same handles are
/// the same fields: see [`Verdict::members`]), else `judge`'s, then kept.
pub fn judged(
    judgement: Judgement,
    members: &[v1::Member],
    judge: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    let kept = JUDGED.with_borrow(|kept| {
        kept.iter()
            .find(|v| v.judgement == judgement && same_handles(&v.members, members))
            .map(|v| v.said.clone())
    });
    if let Some(said) = kept {
        return said;
    }
    let said = judge();
    JUDGED.with_borrow_mut(|kept| {
        kept.retain(|v| !v.judgement.kind_of(&judgement));
        kept.push(Verdict {
            judgement,
            members: members.to_vec(),
            said: said.clone(),
        });
    });
    said
}

/// `members` in rank order with their ranks ([`ranks::rank_members`]) and the world
/// size: the list this thread last made from these very handles, else a new one (then
/// kept). Every node of a process that takes a round of 10,000 members made its own
/// 10,000 ranked members; one agent makes one list either way.
pub fn ranked(members: &[v1::Member]) -> Result<(Arc<[RoundMember]>, u32), String> {
    let kept = RANKED.with_borrow(|kept| {
        kept.as_ref()
            .filter(|k| same_handles(&k.from, members))
            .map(|k| k.said.clone())
    });
    if let Some(said) = kept {
        return said;
    }
    let mut list: Vec<RoundMember> = members.iter().map(RoundMember::from).collect();
    let said = ranks::rank_members(&mut list).map(|world| (Arc::from(list), world));
    RANKED.with_borrow_mut(|kept| {
        *kept = Some(Ranked {
            from: members.to_vec(),
            said: said.clone(),
        });
    });
    said
}

/// Whether `a` and `b` are the same records, one by one.
fn same_handles(a: &[v1::Member], b: &[v1::Member]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| v1::Member::same(x, y))
}

#[cfg(test)]
mod tests;
