//! What the tests read from a step's effects: the etcd ops sent, the replies, whether the
//! watches closed, and the writes of a transaction.

use super::*;

pub(super) fn etcd_ops(effects: &[Effect]) -> Vec<Op> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Etcd(op) => Some(op.clone()),
            _ => None,
        })
        .collect()
}

/// The one etcd op among `effects`.
#[track_caller]
pub(super) fn the_op(effects: &[Effect]) -> Op {
    let ops = etcd_ops(effects);
    assert_eq!(ops.len(), 1, "expected one etcd op in {effects:?}");
    ops.into_iter().next().unwrap()
}

#[track_caller]
pub(super) fn no_op(effects: &[Effect]) {
    assert!(
        etcd_ops(effects).is_empty(),
        "expected no etcd op in {effects:?}"
    );
}

#[track_caller]
pub(super) fn txn(op: Op) -> TxnSpec {
    match op {
        Op::Txn(spec) => spec,
        other => panic!("expected a transaction, got {other:?}"),
    }
}

pub(super) fn replied(effects: &[Effect]) -> Vec<CommandId> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Reply(id, _) => Some(*id),
            _ => None,
        })
        .collect()
}

/// The one reply to command `id` among `effects`.
#[track_caller]
pub(super) fn reply_of(effects: &[Effect], id: CommandId) -> &Result<(), RendezvousError> {
    let found: Vec<_> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Reply(i, r) if *i == id => Some(r),
            _ => None,
        })
        .collect();
    assert_eq!(found.len(), 1, "expected one reply to {id} in {effects:?}");
    found[0]
}

#[track_caller]
pub(super) fn replied_ok(effects: &[Effect], id: CommandId) {
    let r = reply_of(effects, id);
    assert!(r.is_ok(), "command {id} answered {r:?}");
}

pub(super) fn closes_watches(effects: &[Effect]) -> bool {
    effects.iter().any(|e| matches!(e, Effect::CloseWatches))
}

/// The value and lease of the put of `key` among `writes`.
#[track_caller]
pub(super) fn put_at<'a>(writes: &'a [Write], key: &str) -> (&'a [u8], i64) {
    writes
        .iter()
        .find_map(|w| match w {
            Write::Put {
                key: k,
                value,
                lease,
            } if k == key => Some((value.as_slice(), *lease)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no put of {key} in {writes:?}"))
}

pub(super) fn touches(writes: &[Write], key: &str) -> bool {
    writes.iter().any(|w| match w {
        Write::Put { key: k, .. } | Write::Delete(k) => k == key,
        Write::DeleteRange { from, to } => from.as_str() <= key && key < to.as_str(),
    })
}
