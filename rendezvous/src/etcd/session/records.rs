//! The transactions the session writes, as data ([`TxnSpec`]): who may write what, and on
//! which condition.

use fsdp_proto::{SCHEMA_VERSION, v1};
use prost::Message;

use super::io::{Compare, TxnSpec, Write};
use crate::etcd::keys::Keys;

/// A put of `value` at `key`, on `lease` (0: none).
pub fn put(key: String, value: Vec<u8>, lease: i64) -> Write {
    Write::Put { key, value, lease }
}

/// Writes `value` at `key` unless the key exists (the first word stands), and only while
/// every key of `unless` is absent too.
pub fn first_word(key: String, value: Vec<u8>, unless: &[String]) -> TxnSpec {
    let when = std::iter::once(&key)
        .chain(unless)
        .map(|k| Compare::Absent(k.clone()))
        .collect();
    TxnSpec {
        when,
        then: vec![put(key, value, 0)],
        otherwise: Vec::new(),
    }
}

/// How `node`'s loss from `round` was noticed.
pub fn gone(round: u64, node: &str, how: v1::Detection, detect_ms: u32) -> v1::Gone {
    v1::Gone {
        schema: SCHEMA_VERSION,
        round,
        node_id: node.to_owned(),
        how: how.into(),
        detect_ms,
    }
}

/// The record of how a member's loss was noticed; the first word stands (a leaver's own
/// "left" is not overwritten by the neighbour that then finds its port closed).
pub fn say_gone(keys: &Keys, g: &v1::Gone) -> TxnSpec {
    first_word(keys.gone(g.round, &g.node_id), g.encode_to_vec(), &[])
}

/// This node's registration under `lease`: its member record when given (stamped with the
/// lease and incarnation), and, when `claim`, the coordinator key if nobody holds it (the
/// record is written either way).
pub fn registration(
    keys: &Keys,
    node_id: &str,
    member: Option<&v1::Member>,
    (lease, incarnation): (i64, u64),
    claim: bool,
) -> TxnSpec {
    // A registration says the node is healthy again: its unhealthy record goes with it.
    let put_member: Vec<Write> = member
        .map(|m| {
            let record = v1::Member {
                lease,
                incarnation,
                ..m.clone()
            };
            [
                put(keys.member(&m.node_id), record.encode_to_vec(), lease),
                Write::Delete(keys.unhealthy(&m.node_id)),
            ]
        })
        .into_iter()
        .flatten()
        .collect();
    if !claim {
        return TxnSpec {
            then: put_member,
            ..TxnSpec::default()
        };
    }
    let key = keys.coordinator();
    let record = v1::Coordinator {
        schema: SCHEMA_VERSION,
        node_id: node_id.to_owned(),
    };
    let mut then = put_member.clone();
    then.push(put(key.clone(), record.encode_to_vec(), lease));
    TxnSpec {
        when: vec![Compare::Absent(key)],
        then,
        otherwise: put_member,
    }
}

/// Whether `node`'s registration lives on `lease` now (one comparison, no read).
pub fn lease_holds(keys: &Keys, node: &str, lease: i64) -> TxnSpec {
    TxnSpec {
        when: vec![Compare::Lease(keys.member(node), lease)],
        ..TxnSpec::default()
    }
}

/// `record` as the next round, fenced on the round it replaces: it succeeds only if the
/// round key still has revision `fence` (or does not exist when `fence` is `None`). Two
/// coordinators racing for the same round cannot both win, and no round follows a halt.
pub fn commit_round(keys: &Keys, fence: Option<i64>, record: &v1::Round) -> TxnSpec {
    let key = keys.round();
    let when = match fence {
        Some(rev) => Compare::ModRevision(key.clone(), rev),
        None => Compare::Absent(key.clone()),
    };
    TxnSpec {
        // Never after a halt, even one this coordinator has not seen yet.
        when: vec![when, Compare::Absent(keys.halt())],
        then: vec![put(key, record.encode_to_vec(), 0)],
        otherwise: Vec::new(),
    }
}

/// Out of every round until it registers again: the registration goes, the reason stays
/// (on the lease), and the coordinator role when `coordinating` (a healthy node takes
/// over).
pub fn withdrawal(
    keys: &Keys,
    node: &str,
    record: &v1::Unhealthy,
    lease: i64,
    coordinating: bool,
) -> TxnSpec {
    let mut then = vec![
        Write::Delete(keys.member(node)),
        put(keys.unhealthy(node), record.encode_to_vec(), lease),
    ];
    if coordinating {
        then.push(Write::Delete(keys.coordinator()));
    }
    TxnSpec {
        then,
        ..TxnSpec::default()
    }
}
