//! One declaration per etcd record: where it lives under the run's root, how it is
//! written, and what it does to an agent's [`View`] when a watch or a read brings it.
//!
//! ```text
//! members/<node_id>                 Member       leased: present while the agent lives
//! ctl/round                         Round        fenced on the revision of the round it replaces;
//!                                                the difference from it when it can be
//! roster                            Roster       beside a delta, the whole round, in the same
//!                                                transaction
//! placement/<tag>/<shard>           Placement    a placed round's members, under the name its
//!                                                header gives them, written before it or
//!                                                with it; read apart
//!                                                ([`crate::etcd::placement`])
//! ctl/master                        Master       leased: where the round's workers meet
//! ctl/coordinator                   Coordinator  leased, claimed if absent: the election key
//! ctl/failures/<n>                  Failure      first word, unless halted: round n failed
//! ctl/done/<n>/<node>               Done         the node's workers all succeeded in round n
//! ctl/noticed/<n>/<node>            Noticed      first word: how the node's loss was noticed
//! ctl/hang/<n>/<node>               HangReport   where the node's ranks were when round n hung
//! ctl/halt                          Halt         first word: the run is over for every node
//! ctl/unhealthy/<node>              Unhealthy    leased: the node's health check fails
//! ctl/faults/<n>/<node>             Fault        the node saw its own worker fail in round n
//! ctl/quarantine/<machine>          Quarantine   the machine is kept out until a time
//! ctl/left/<node>/<incarnation>     Left         why the node left: its own word, else the
//!                                                coordinator's "lost"; the last 100 kept
//! ```
//!
//! The declarations are in [`declared`] and, for the round and the halt, `round.rs`;
//! adding a record is one `impl Record` there and one line in [`DECLARED`]. [`View::put`] and [`View::delete`] look keys up here, the
//! session writes an [`Outgoing`] as its [`Mode`] says, and [`super::Keys`] builds keys
//! from a record's [`Place`].

mod allowed;
mod declared;
mod memo;
mod round;

use std::time::Instant;

use fsdp_proto::{Versioned, decode};

use super::keys::Keys;
use super::view::View;

pub use allowed::{Allowed, LEFT_DETAIL_MAX, left_detail};
pub use declared::{left_tail, per_round};
pub(super) use memo::ranked;
pub(crate) use round::set_placed;

/// Where a record lives under the run's root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// One key of this name (`ctl/round`).
    Fixed(&'static str),
    /// Keys under this prefix (`ctl/faults/`), the tail named by the record.
    Under(&'static str),
}

impl Place {
    /// The tail of `rest` (a key less the run's root) if the key is this place.
    fn tail(self, rest: &str) -> Option<&str> {
        match self {
            Place::Fixed(name) => (rest == name).then_some(""),
            Place::Under(prefix) => rest.strip_prefix(prefix),
        }
    }

    /// The place's name (`Fixed`) or prefix (`Under`) under the run's root.
    pub fn path(self) -> &'static str {
        match self {
            Place::Fixed(p) | Place::Under(p) => p,
        }
    }
}

/// How a record is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A plain put: a later write replaces it.
    Put,
    /// A put on the writer's lease: the record goes when the agent does.
    Leased,
    /// Created only while absent, so that the first word stands, and only while each
    /// record of `unless` is absent too.
    FirstWord { unless: &'static [Place] },
    /// Written by a transaction of its own (the round's fence, the registration with
    /// its election): see `session/records.rs`.
    Own,
}

/// The revisions and lease a stored key came with.
#[derive(Debug, Clone, Copy, Default)]
pub struct At {
    pub create_rev: i64,
    pub mod_rev: i64,
    /// 0: none.
    pub lease: i64,
}

/// A record of the run, declared once.
pub trait Record: Versioned + Sized {
    const PLACE: Place;
    const MODE: Mode;
    /// What writing it is, in an error ("reporting a worker failure").
    const WRITING: &'static str;

    /// The tail of its key under an [`Place::Under`] (what it names); empty when fixed.
    fn tail(&self) -> String {
        String::new()
    }

    /// Whether this node accepts the record, found at the key of `tail`: the rule each
    /// kind states (required, so that a new kind cannot forget one: anyone who can write
    /// the store can write any record). `Err` says why not: it is then refused, logged
    /// once and left out of the view, never obeyed.
    fn allowed(&self, view: &View, tail: &str) -> Result<(), String>;

    /// Takes the record, found at the key of `tail`, into `view` once it is
    /// [`Record::allowed`]; `Err` says why it cannot be trusted after all (a check that
    /// needs the view changed): it is then refused and leaves the view as it was.
    fn apply(self, view: &mut View, tail: &str, at: At) -> Result<(), String>;

    /// The record stored as `value` at `key`, or why it is not one.
    fn read(key: &str, value: &[u8]) -> Result<Self, fsdp_proto::RecordError> {
        decode::<Self>(key, value)
    }

    /// A record of this kind, at revisions `at`, was refused: what the view must still
    /// know of it. Most records: nothing.
    fn refused(_view: &mut View, _at: At) {}

    /// Its key at `tail` was deleted, seen at `now`; `prev` is the value the event
    /// carried. Most records are never deleted by agents: nothing to do.
    fn remove(_view: &mut View, _tail: &str, _now: Instant, _prev: Option<&[u8]>) {}
}

/// A record of a kind whose key names it ([`Place::Under`]) must be at its own key: one at
/// another's would stand for that other (a `done` of node a at node b's key).
fn own_key<R: Record>(r: &R, tail: &str) -> Result<(), String> {
    if r.tail() == tail {
        return Ok(());
    }
    Err(format!(
        "is at {}, not at its own key",
        crate::text::shown(tail)
    ))
}

/// A record's entry in the table a key is looked up in.
struct Declared {
    place: Place,
    put: fn(&mut View, &str, &str, &[u8], At),
    remove: fn(&mut View, &str, Instant, Option<&[u8]>),
}

const fn declare<R: Record>() -> Declared {
    Declared {
        place: R::PLACE,
        put: put_as::<R>,
        remove: R::remove,
    }
}

/// Every record of a run.
const DECLARED: &[Declared] = {
    use fsdp_proto::v1::*;
    &[
        declare::<Member>(),
        declare::<Round>(),
        declare::<Roster>(),
        declare::<Master>(),
        declare::<Coordinator>(),
        declare::<Failure>(),
        declare::<Done>(),
        declare::<Noticed>(),
        declare::<HangReport>(),
        declare::<Halt>(),
        declare::<Unhealthy>(),
        declare::<Fault>(),
        declare::<Quarantine>(),
        declare::<Left>(),
    ]
};

/// Decodes the value at `key` as an `R` and applies it; an undecodable or untrusted value
/// marks the key corrupt, a good one clears it.
fn put_as<R: Record>(view: &mut View, key: &str, tail: &str, value: &[u8], at: At) {
    let record = match R::read(key, value) {
        Ok(r) => r,
        Err(e) => {
            view.corrupt.insert(
                key.to_owned(),
                crate::text::shown(&e.to_string()).into_owned(),
            );
            return;
        }
    };
    view.corrupt.remove(key);
    let judged = record
        .allowed(view, tail)
        .and_then(|()| record.apply(view, tail, at));
    match judged {
        Ok(()) => {
            view.refused.remove(key);
        }
        Err(why) => {
            R::refused(view, at);
            let shown = crate::text::shown(key);
            view.refuse(key, format!("{} record at {shown} {why}", R::KIND));
        }
    }
}

/// The declaration `key` falls under, and its tail.
fn find<'k>(keys: &Keys, key: &'k str) -> Option<(&'static Declared, &'k str)> {
    let rest = key.strip_prefix(keys.root())?;
    DECLARED
        .iter()
        .find_map(|d| d.place.tail(rest).map(|tail| (d, tail)))
}

/// Applies a put of `value` at `key` to `view`.
pub(super) fn put(view: &mut View, keys: &Keys, key: &str, value: &[u8], at: At) {
    match find(keys, key) {
        Some((d, tail)) => (d.put)(view, key, tail, value, at),
        // Another run whose prefix lies under ours: its keys are not ours to judge
        // (agents refuse to start such a run; this keeps a race harmless).
        None if keys.nested_run_key(key) => {}
        // A placed round's shards: read apart, by the members that need them.
        None if keys.is_placement(key) => {}
        // A crowd's admission keys: for the nodes that wait their turn.
        None if keys.is_admission(key) => {}
        None => {
            let shown = crate::text::shown(key);
            view.refuse(
                key,
                format!("unexpected key {shown} under the run's prefix"),
            );
        }
    }
}

/// Applies a delete of `key`, seen at `now`, to `view`.
pub(super) fn delete(view: &mut View, keys: &Keys, key: &str, now: Instant, prev: Option<&[u8]>) {
    view.corrupt.remove(key);
    view.refused.remove(key);
    if let Some((d, tail)) = find(keys, key) {
        (d.remove)(view, tail, now, prev);
    }
}

/// A record encoded for its key, as the session writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub key: String,
    pub value: Vec<u8>,
    pub mode: Mode,
    /// What writing it is, in an error.
    pub writing: &'static str,
}

impl Outgoing {
    /// `record`, for its key. Only records with a write of their own mode: the others are
    /// written by their own transactions.
    pub fn of<R: Record>(keys: &Keys, record: &R) -> Self {
        const { assert!(!matches!(R::MODE, Mode::Own)) };
        Outgoing {
            key: keys.of(record),
            value: fsdp_proto::encode(record),
            mode: R::MODE,
            writing: R::WRITING,
        }
    }
}

#[cfg(test)]
mod tests;
