//! The records of a run, each declared once: its place, its write mode and how it applies
//! to the [`View`].

use std::collections::HashSet;
use std::time::Instant;

use fsdp_proto::{decode, v1};

use super::{At, Mode, Place, Record, own_key};
use crate::etcd::roster;
use crate::etcd::view::{LeftEntry, MemberEntry, RoundEntry, View};
use crate::ranks;
use crate::text::{LINE_MAX, NAME_MAX, field};

/// Rounds whose hang reports a view keeps.
const HANG_ROUNDS_KEPT: usize = 4;
/// Rounds whose faults a view keeps (quarantine looks at the last few failed rounds).
const FAULT_ROUNDS_KEPT: usize = 32;

const HALT: Place = Place::Fixed("ctl/halt");

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
        field("job", &self.job, NAME_MAX)
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

impl Record for v1::Round {
    const PLACE: Place = Place::Fixed("ctl/round");
    const MODE: Mode = Mode::Own;
    const WRITING: &'static str = "sealing a round";

    // Every member takes each round: see `memo` for why one process decodes it once.
    fn read(key: &str, value: &[u8]) -> Result<Self, fsdp_proto::RecordError> {
        super::memo::round(key, value)
    }

    /// Its size, its members' worker counts and their distinctness are judged whole in
    /// `apply` (a delta only together with the round it is based on); here its text.
    fn allowed(&self, _: &View, _: &str) -> Result<(), String> {
        field("reason", &self.reason, LINE_MAX)?;
        field("job", &self.job, NAME_MAX)?;
        for m in self.members.iter().chain(&self.added).chain(&self.updated) {
            field("member's node id", &m.node_id, NAME_MAX)?;
            field("member's address", &m.addr, NAME_MAX)?;
            field("member's status address", &m.status_addr, NAME_MAX)?;
        }
        Ok(())
    }

    fn apply(self, view: &mut View, _: &str, at: At) -> Result<(), String> {
        let (whole, distinct) = if self.delta {
            let held = view.round.as_ref();
            if held.is_some_and(|h| h.record.number >= self.number) {
                // Known already, from the roster written beside it.
                return Ok(());
            }
            match held.filter(|h| h.record.number == self.base && h.mod_rev == self.base_rev) {
                // The held round was checked distinct, and `apply` keeps it so.
                Some(h) => (roster::apply(&h.record, &self)?, Distinct::Known),
                None => {
                    // Based on a round this view does not hold: the roster says it whole.
                    view.round_wanted = Some(self.number);
                    return Ok(());
                }
            }
        } else {
            (self, Distinct::Unchecked)
        };
        set_round(view, whole, at, distinct)
    }

    // The forged round still holds the key: the next seal must replace it, fenced on its
    // revision, or no round could be sealed again.
    fn refused(view: &mut View, at: At) {
        view.refused_round_rev = Some(at.mod_rev);
    }

    fn remove(view: &mut View, _: &str, _: Instant, _: Option<&[u8]>) {
        view.round = None;
        view.round_wanted = None;
        view.refused_round_rev = None;
    }
}

/// Whether a round's members are known to be distinct.
enum Distinct {
    Known,
    Unchecked,
}

/// `r` (a whole round) as the view's round, at revision `at`.
fn set_round(view: &mut View, r: v1::Round, at: At, distinct: Distinct) -> Result<(), String> {
    check_round(&r, distinct)?;
    view.allowed.round(&r)?;
    view.refused_round_rev = None;
    if view.round_wanted.is_some_and(|n| n <= r.number) {
        view.round_wanted = None;
    }
    let replaced = view.round.replace(RoundEntry {
        record: std::sync::Arc::new(r),
        mod_rev: at.mod_rev,
    });
    if let Some(old) = replaced.filter(|old| {
        view.round
            .as_ref()
            .is_some_and(|new| new.record.number > old.record.number)
    }) {
        view.previous_round = Some(old.record);
    }
    // A halt read before any round was known is judged now.
    if let Some(h) = &view.halt
        && let Err(why) = halt_writer(view, h)
    {
        let why = format!(
            "{} record at ctl/halt {why}",
            <v1::Halt as fsdp_proto::Versioned>::KIND
        );
        view.halt = None;
        view.refuse("ctl/halt", why);
    }
    Ok(())
}

/// A halt ends every node: only a node of the round it ends, or of the one before (where
/// it may have decided), can write one. Before any round is known it cannot be judged yet.
fn halt_writer(view: &View, h: &v1::Halt) -> Result<(), String> {
    let Some(round) = &view.round else {
        return Ok(());
    };
    let member = |r: &v1::Round| r.members.iter().any(|m| m.node_id == h.node_id);
    let before = view.previous_round.as_deref().is_some_and(member);
    if member(&round.record) || before {
        return Ok(());
    }
    Err(format!(
        "comes from node {}, a member of neither round {} nor the one before; only they end the run",
        crate::text::shown(&h.node_id),
        round.record.number
    ))
}

impl Record for v1::Roster {
    const PLACE: Place = Place::Fixed("roster");
    const MODE: Mode = Mode::Own;
    const WRITING: &'static str = "sealing a round";

    fn allowed(&self, view: &View, tail: &str) -> Result<(), String> {
        // The round in it is judged as a round.
        self.round
            .as_ref()
            .map_or(Ok(()), |r| r.allowed(view, tail))
    }

    /// Used only by a view that holds no round or waits for one it could not apply: any
    /// other has the round from `ctl/round` (written in the same transaction).
    fn apply(self, view: &mut View, _: &str, at: At) -> Result<(), String> {
        let r = self.round.ok_or("holds no round")?;
        let wanted = view.round_wanted.is_some_and(|n| r.number >= n);
        if view.round.is_none() || wanted {
            set_round(view, r, at, Distinct::Unchecked)?;
        }
        Ok(())
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

impl Record for v1::Gone {
    const PLACE: Place = Place::Under("ctl/gone/");
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
            .gone
            .get(&self.node_id)
            .is_none_or(|old| old.round <= self.round);
        if newer {
            view.gone.insert(self.node_id.clone(), self);
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

impl Record for v1::Halt {
    const PLACE: Place = HALT;
    const MODE: Mode = Mode::FirstWord { unless: &[] };
    const WRITING: &'static str = "ending the run for every node";

    /// Its exit code is judged in `apply` (this node's failure policy); here its text and
    /// its writer: a node of the round it ends (or of the one before, which it may have
    /// decided in). Before any round is known it waits for the round's judgement
    /// (`set_round`).
    fn allowed(&self, view: &View, _: &str) -> Result<(), String> {
        field("node id", &self.node_id, NAME_MAX)?;
        field("reason", &self.reason, LINE_MAX)?;
        halt_writer(view, self)
    }

    fn apply(self, view: &mut View, _: &str, _: At) -> Result<(), String> {
        view.allowed.halt(&self)?;
        view.halt = Some(self);
        Ok(())
    }

    fn remove(view: &mut View, _: &str, _: Instant, _: Option<&[u8]>) {
        view.halt = None;
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
    // when the two race (the coordinator writes it only while the key is absent).
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

/// A round is trusted only if its members are distinct and their worker counts form a
/// group without overflowing the rank arithmetic.
fn check_round(r: &v1::Round, distinct: Distinct) -> Result<(), String> {
    // Hashed: every member checks every round it takes, and at thousands of members an
    // ordered set's string comparisons were a tenth of a simulated node's work. A round
    // made from a delta is known distinct without it.
    if let Distinct::Unchecked = distinct {
        let mut seen = HashSet::with_capacity(r.members.len());
        if let Some(dup) = r.members.iter().find(|m| !seen.insert(m.node_id.as_str())) {
            return Err(format!("lists node {} twice", dup.node_id));
        }
    }
    let sizes: Vec<u32> = r.members.iter().map(|m| m.local_world_size).collect();
    ranks::assign(&sizes).map(drop)
}
