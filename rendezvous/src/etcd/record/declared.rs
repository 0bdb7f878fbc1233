//! The records of a run other than the round and the halt (`round.rs`), each declared
//! once: its place, its write mode and how it applies to the [`View`].

use std::time::Instant;

use fsdp_proto::{decode, v1};

use super::round::HALT;
use super::{At, Mode, Place, Record, own_key};
use crate::etcd::view::{LeftEntry, MemberEntry, View};
use crate::ranks;
use crate::text::{LINE_MAX, NAME_MAX, field};

/// Rounds whose hang reports a view keeps.
const HANG_ROUNDS_KEPT: usize = 4;
/// Rounds whose faults a view keeps (quarantine looks at the last few failed rounds).
const FAULT_ROUNDS_KEPT: usize = 32;

/// The tail of a record about `node` in `round`: rounds zero-padded, so that keys sort by
/// round.
pub fn per_round(round: u64, node: &str) -> String {
    format!("{round:020}/{node}")
}

impl Record for v1::Member {
    const PLACE: Place = Place::Under("members/");
    const MODE: Mode = Mode::Own;
    const WRITING: &'static str = "registering this node";

    fn tail(&self) -> String {
        self.node_id.clone()
    }

    fn allowed(&self, _: &View, _: &str) -> Result<(), String> {
        // Its key, its lease and its worker count are judged in `apply`.
        field("node id", &self.node_id, NAME_MAX)?;
        field("address", &self.addr, NAME_MAX)?;
        field("status address", &self.status_addr, NAME_MAX)?;
        field("job", &self.job, NAME_MAX)?;
        // Only bounded: a segment orders ranks and is shown, and whatever path a peer was
        // given is its own (the agent checked it before registering).
        field("segment", &self.segment, crate::topology::SEGMENT_MAX)
    }

    fn apply(self, view: &mut View, tail: &str, at: At) -> Result<(), String> {
        check_member(tail, &self, at.lease)?;
        view.allowed.workers(self.local_world_size)?;
        view.members.insert(
            tail.to_owned(),
            MemberEntry {
                record: self,
                create_rev: at.create_rev,
            },
        );
        Ok(())
    }

    fn remove(view: &mut View, tail: &str, now: Instant, prev: Option<&[u8]>) {
        let known = view.members.remove(tail).map(|m| m.record.incarnation);
        // Which registration went: the event's old value says, else the one we knew, else
        // any (so that it counts against every incarnation).
        let went = prev
            .and_then(|value| decode::<v1::Member>(tail, value).ok())
            .map(|m| m.incarnation)
            .or(known)
            .unwrap_or(u64::MAX);
        view.depart(tail, went, now);
    }
}

impl Record for v1::Master {
    const PLACE: Place = Place::Fixed("ctl/master");
    const MODE: Mode = Mode::Leased;
    const WRITING: &'static str = "publishing the master address";

    fn allowed(&self, _: &View, _: &str) -> Result<(), String> {
        // Its port is judged in `apply`.
        field("address", &self.addr, NAME_MAX)
    }

    fn apply(self, view: &mut View, _: &str, _: At) -> Result<(), String> {
        if !(1..=u32::from(u16::MAX)).contains(&self.port) || self.addr.is_empty() {
            return Err(format!(
                "has address '{}' and port {}, not a host and a port 1-65535",
                self.addr, self.port
            ));
        }
        view.master = Some(self);
        Ok(())
    }

    fn remove(view: &mut View, _: &str, _: Instant, _: Option<&[u8]>) {
        view.master = None;
    }
}

impl Record for v1::Coordinator {
    const PLACE: Place = Place::Fixed("ctl/coordinator");
    const MODE: Mode = Mode::Own;
    const WRITING: &'static str = "claiming the coordinator role";

    fn allowed(&self, _: &View, _: &str) -> Result<(), String> {
        field("node id", &self.node_id, NAME_MAX)
    }

    fn apply(self, view: &mut View, _: &str, at: At) -> Result<(), String> {
        view.coordinator = Some(self.node_id);
        view.coordinator_lease = at.lease;
        Ok(())
    }

    fn remove(view: &mut View, _: &str, _: Instant, _: Option<&[u8]>) {
        view.coordinator = None;
        view.coordinator_lease = 0;
    }
}

impl Record for v1::Failure {
    const PLACE: Place = Place::Under("ctl/failures/");
    // Not once the run is halted: a peer's workers that fail because the halting node's
    // did must not spend the budget the halt leaves untouched.
    const MODE: Mode = Mode::FirstWord { unless: &[HALT] };
    const WRITING: &'static str = "reporting a worker failure";

    fn tail(&self) -> String {
        format!("{:020}", self.round)
    }

    fn allowed(&self, _: &View, tail: &str) -> Result<(), String> {
        own_key(self, tail)?;
        field("node id", &self.node_id, NAME_MAX)
    }

    fn apply(self, view: &mut View, _: &str, _: At) -> Result<(), String> {
        view.failures.insert(self.round);
        Ok(())
    }
}

impl Record for v1::Done {
    const PLACE: Place = Place::Under("ctl/done/");
    const MODE: Mode = Mode::Put;
    const WRITING: &'static str = "reporting this node finished";

    fn tail(&self) -> String {
        per_round(self.round, &self.node_id)
    }

    fn allowed(&self, _: &View, tail: &str) -> Result<(), String> {
        own_key(self, tail)?;
        field("node id", &self.node_id, NAME_MAX)
    }

    fn apply(self, view: &mut View, _: &str, _: At) -> Result<(), String> {
        view.done
            .entry(self.round)
            .or_default()
            .insert(self.node_id);
        Ok(())
    }
}

impl Record for v1::Noticed {
    const PLACE: Place = Place::Under("ctl/noticed/");
    // A leaver's own "left" is not overwritten by the neighbour that then finds its port
    // closed.
    const MODE: Mode = Mode::FirstWord { unless: &[] };
    const WRITING: &'static str = "recording how a member was lost";

    fn tail(&self) -> String {
        per_round(self.round, &self.node_id)
    }

    fn allowed(&self, _: &View, tail: &str) -> Result<(), String> {
        own_key(self, tail)?;
        field("node id", &self.node_id, NAME_MAX)
    }

    fn apply(self, view: &mut View, _: &str, _: At) -> Result<(), String> {
        let newer = view
            .noticed
            .get(&self.node_id)
            .is_none_or(|old| old.round <= self.round);
        if newer {
            view.noticed.insert(self.node_id.clone(), self);
        }
        Ok(())
    }
}

impl Record for v1::HangReport {
    const PLACE: Place = Place::Under("ctl/hang/");
    const MODE: Mode = Mode::Put;
    const WRITING: &'static str = "reporting where this node's ranks were in a hang";

    fn tail(&self) -> String {
        per_round(self.round, &self.node_id)
    }

    fn allowed(&self, _: &View, tail: &str) -> Result<(), String> {
        own_key(self, tail)?;
        field("node id", &self.node_id, NAME_MAX)?;
        field("reason", &self.reason, LINE_MAX)?;
        for r in &self.ranks {
            field("rank's phase", &r.phase, NAME_MAX)?;
        }
        Ok(())
    }

    fn apply(self, view: &mut View, _: &str, _: At) -> Result<(), String> {
        view.hangs
            .entry(self.round)
            .or_default()
            .insert(self.node_id.clone(), self);
        // Only the latest hangs matter (the declaring node names the culprit at the next
        // round; status shows the last one).
        while view.hangs.len() > HANG_ROUNDS_KEPT {
            view.hangs.pop_first();
        }
        Ok(())
    }
}

impl Record for v1::Unhealthy {
    const PLACE: Place = Place::Under("ctl/unhealthy/");
    // Leased, in the transaction that withdraws the registration.
    const MODE: Mode = Mode::Own;
    const WRITING: &'static str = "withdrawing an unhealthy node";

    fn tail(&self) -> String {
        self.node_id.clone()
    }

    fn allowed(&self, _: &View, tail: &str) -> Result<(), String> {
        own_key(self, tail)?;
        field("node id", &self.node_id, NAME_MAX)?;
        field("reason", &self.reason, LINE_MAX)
    }

    fn apply(self, view: &mut View, tail: &str, _: At) -> Result<(), String> {
        view.unhealthy.insert(tail.to_owned(), self);
        Ok(())
    }

    fn remove(view: &mut View, tail: &str, _: Instant, _: Option<&[u8]>) {
        view.unhealthy.remove(tail);
    }
}

impl Record for v1::Fault {
    const PLACE: Place = Place::Under("ctl/faults/");
    const MODE: Mode = Mode::Put;
    const WRITING: &'static str = "reporting a worker fault";

    fn tail(&self) -> String {
        per_round(self.round, &self.node_id)
    }

    fn allowed(&self, _: &View, tail: &str) -> Result<(), String> {
        own_key(self, tail)?;
        field("node id", &self.node_id, NAME_MAX)?;
        field("exit", &self.exit, LINE_MAX)
    }

    fn apply(self, view: &mut View, _: &str, at: At) -> Result<(), String> {
        let round = view.faults.entry(self.round).or_default();
        round
            .entry(self.node_id)
            .or_insert(crate::etcd::view::FaultSeen {
                exited_ms: self.exited_ms,
                rev: at.mod_rev,
            });
        while view.faults.len() > FAULT_ROUNDS_KEPT {
            view.faults.pop_first();
        }
        Ok(())
    }
}

impl Record for v1::Quarantine {
    const PLACE: Place = Place::Under("ctl/quarantine/");
    const MODE: Mode = Mode::Put;
    const WRITING: &'static str = "quarantining this machine";

    fn tail(&self) -> String {
        self.machine.clone()
    }

    /// Obeyed only as far as this node's own policy would quarantine: not at all with
    /// `--quarantine-after 0`, never for longer than `--quarantine-for` from now.
    fn allowed(&self, view: &View, tail: &str) -> Result<(), String> {
        own_key(self, tail)?;
        field("machine", &self.machine, NAME_MAX)?;
        field("node id", &self.node_id, NAME_MAX)?;
        field("reason", &self.reason, LINE_MAX)?;
        view.allowed.quarantine(self, crate::unix_ms())
    }

    fn apply(self, view: &mut View, tail: &str, _: At) -> Result<(), String> {
        view.quarantine.insert(tail.to_owned(), self);
        Ok(())
    }

    fn remove(view: &mut View, tail: &str, _: Instant, _: Option<&[u8]>) {
        view.quarantine.remove(tail);
    }
}

/// The tail of the record of why `node` left, its registration `incarnation` gone:
/// incarnations zero-padded, so that one node's departures sort in order.
pub fn left_tail(node: &str, incarnation: u64) -> String {
    format!("{node}/{incarnation:020}")
}

impl Record for v1::Left {
    const PLACE: Place = Place::Under("ctl/left/");
    // A plain put: the node's own word replaces the coordinator's "lost" at the same key
    // when the two race (the coordinator writes it only while the key is absent), unless
    // etcd holds a departing member's word back as not its round's first
    // (`session::records::say_left`).
    const MODE: Mode = Mode::Put;
    const WRITING: &'static str = "recording why this node left";

    fn tail(&self) -> String {
        left_tail(&self.node_id, self.incarnation)
    }

    fn allowed(&self, _: &View, _: &str) -> Result<(), String> {
        // Its key and its kind are judged in `apply` and `Allowed::left`.
        field("node id", &self.node_id, NAME_MAX)?;
        field("address", &self.addr, NAME_MAX)?;
        field("writer", &self.written_by, NAME_MAX)?;
        field("detail", &self.detail, LINE_MAX)
    }

    fn apply(self, view: &mut View, tail: &str, at: At) -> Result<(), String> {
        if tail != self.tail() {
            return Err(format!(
                "names node {} incarnation {}, not its own key",
                self.node_id, self.incarnation
            ));
        }
        view.allowed.left(&self)?;
        // As `left::breakers` judges: a finish, or a node done with the round, breaks
        // nothing.
        let done = view.done.get(&self.round);
        let finished = crate::etcd::left::kind_of(&self) == Some(crate::LeftKind::Finished);
        if !finished && !done.is_some_and(|d| d.contains(&self.node_id)) {
            view.broken
                .entry(self.round)
                .or_insert_with(|| self.node_id.clone());
            while view.broken.len() > crate::etcd::view::BROKEN_KEPT {
                view.broken.pop_first();
            }
        }
        view.left.insert(
            tail.to_owned(),
            LeftEntry {
                record: self,
                mod_rev: at.mod_rev,
            },
        );
        Ok(())
    }

    fn remove(view: &mut View, tail: &str, _: Instant, _: Option<&[u8]>) {
        view.left.remove(tail);
    }
}

/// A registration is trusted only if it names its own key, is bound to a lease (a live
/// agent's always is: without one it would never go away) and asks for a sane number of
/// workers.
fn check_member(id: &str, m: &v1::Member, lease: i64) -> Result<(), String> {
    if m.node_id != id {
        return Err(format!("names another node ({})", m.node_id));
    }
    if lease == 0 {
        return Err("is not bound to a lease (agents always register under theirs)".into());
    }
    if m.local_world_size == 0 || m.local_world_size > ranks::MAX_LOCAL_WORLD_SIZE {
        return Err(format!(
            "has local_world_size {}, outside 1..={}",
            m.local_world_size,
            ranks::MAX_LOCAL_WORLD_SIZE
        ));
    }
    Ok(())
}
