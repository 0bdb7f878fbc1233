//! The round and the halt, declared as records: `ctl/round` (whole, or the difference
//! from the round before), the `roster` written beside a delta, and `ctl/halt`, judged by
//! the round it ends. A round is taken only once its members are distinct and form a
//! group; a halt only from a member of its round or the one before.

use std::collections::HashSet;
use std::time::Instant;

use fsdp_proto::v1;

use super::memo::{self, Judgement};
use super::{At, Mode, Place, Record};
use crate::etcd::roster;
use crate::etcd::view::{RoundEntry, View};
use crate::ranks;
use crate::text::{LINE_MAX, NAME_MAX, field};

/// Where the halt lives (records written only while it is absent name it).
pub(super) const HALT: Place = Place::Fixed("ctl/halt");

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
        if self.placed.is_some() {
            return Err("carries a member's own place, which no coordinator writes".into());
        }
        if self.shards > 0 && (self.delta || !self.members.is_empty()) {
            return Err("is placed and lists members too".into());
        }
        if self.shards > self.group_world_size.max(1) {
            return Err(format!(
                "is placed in {} shards, more than its {} members",
                self.shards, self.group_world_size
            ));
        }
        if self.shards > 0 && !crate::etcd::placement::tag_fits(&self.placement, self.number) {
            let shown = crate::text::shown(&self.placement);
            return Err(format!(
                "names its shards '{shown}', not a placement of round {}",
                self.number
            ));
        }
        field("job", &self.job, NAME_MAX)?;
        memo::judged(Judgement::Text, &self.members, || {
            self.members.iter().try_for_each(member_text)
        })?;
        self.dropped
            .iter()
            .try_for_each(|id| field("left-out node's id", id, NAME_MAX))?;
        let moves = self.gone.iter().chain(&self.rewired);
        self.added
            .iter()
            .chain(&self.updated)
            .chain(moves.flat_map(|p| p.member.iter().chain(&p.neighbour)))
            .try_for_each(member_text)
    }

    fn apply(self, view: &mut View, _: &str, at: At) -> Result<(), String> {
        if self.shards > 0 {
            return want_placement(view, self, at);
        }
        let (whole, distinct) = if self.delta {
            let held = view.round.as_ref();
            if held.is_some_and(|h| h.record.number >= self.number) {
                // Known already, from the roster written beside it.
                return Ok(());
            }
            // A member's copy of a placed round lists too few members to apply a delta to.
            let base = held.filter(|h| crate::etcd::joining::lists_all(&h.record));
            match base.filter(|h| h.record.number == self.base && h.mod_rev == self.base_rev) {
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
        view.placing = None;
        view.refused_round_rev = None;
    }
}

/// A placed round's header: its members are in the placement, read next (the machine
/// reads this node's shard, or every shard for a view that coordinates), unless this very
/// seal is held already.
fn want_placement(view: &mut View, header: v1::Round, at: At) -> Result<(), String> {
    let held = view.round.as_ref().map(|r| &r.record);
    if held.is_some_and(|h| h.number == header.number && h.sealed_at_ms == header.sealed_at_ms) {
        return Ok(());
    }
    // Its sizes before anything is read or made of them.
    view.allowed.placed(&header)?;
    // A copy of the very round it moves from makes this one without a read.
    let moved = view
        .round
        .as_ref()
        .filter(|h| h.mod_rev == header.base_rev)
        .and_then(|h| crate::etcd::placement::moved(&h.record, &header));
    if let Some(r) = moved {
        return set_placed(view, r, at.mod_rev);
    }
    view.round_wanted = Some(header.number);
    view.placing = Some(RoundEntry {
        record: std::sync::Arc::new(header),
        mod_rev: at.mod_rev,
    });
    Ok(())
}

/// The placed round `r` as the view's round, at revision `mod_rev` of its header: whole
/// (read from every shard, for a view that coordinates: judged as any whole round), a
/// member's own copy ([`crate::etcd::placement::window`]), or the header alone for a node
/// the round was sealed without. Not over a newer round the view took meanwhile.
pub(crate) fn set_placed(view: &mut View, r: v1::Round, mod_rev: i64) -> Result<(), String> {
    view.placing = None;
    if view
        .round
        .as_ref()
        .is_some_and(|h| h.record.number > r.number)
    {
        return Ok(());
    }
    let at = At {
        mod_rev,
        ..At::default()
    };
    if r.placed.is_none() && !r.members.is_empty() {
        return set_round(view, r, at, Distinct::Unchecked);
    }
    view.allowed.placed(&r)?;
    r.members.iter().try_for_each(member_text)?;
    install(view, r, at);
    Ok(())
}

/// Whether a member's text is what a record may carry.
fn member_text(m: &v1::Member) -> Result<(), String> {
    field("member's node id", &m.node_id, NAME_MAX)?;
    field("member's address", &m.addr, NAME_MAX)?;
    field("member's status address", &m.status_addr, NAME_MAX)
}

/// Whether a round's members are known to be distinct.
enum Distinct {
    Known,
    Unchecked,
}

/// `r` (a whole round) as the view's round, at revision `at`.
fn set_round(view: &mut View, r: v1::Round, at: At, distinct: Distinct) -> Result<(), String> {
    let judgement = Judgement::Group {
        nodes: view.allowed.nodes.clone(),
        workers_per_node: view.allowed.workers_per_node.clone(),
        check_distinct: matches!(distinct, Distinct::Unchecked),
    };
    memo::judged(judgement, &r.members, || {
        check_round(&r, distinct)?;
        view.allowed.round(&r)
    })?;
    install(view, r, at);
    Ok(())
}

/// `r`, judged, as the view's round.
fn install(view: &mut View, r: v1::Round, at: At) {
    view.refused_round_rev = None;
    if view
        .placing
        .as_ref()
        .is_some_and(|p| p.record.number <= r.number)
    {
        view.placing = None;
    }
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
}

/// A halt ends every node: only a node of the round it ends, or of the one before (where
/// it may have decided), can write one. Before any round is known it cannot be judged yet.
fn halt_writer(view: &View, h: &v1::Halt) -> Result<(), String> {
    let Some(round) = &view.round else {
        return Ok(());
    };
    let member = |r: &v1::Round| r.members.iter().any(|m| m.node_id == h.node_id);
    // The round before, as held, or as the round names those of it it left out.
    let before = view.previous_round.as_deref().is_some_and(member)
        || round.record.dropped.contains(&h.node_id);
    if member(&round.record) || before {
        return Ok(());
    }
    // A member's copy of a placed round names only itself and its neighbour: the halt is
    // judged by the round it says it ends, this one or the one before (a forger who reads
    // the round first gets through; one who does not, does not).
    let number = round.record.number;
    let partial = round.record.placed.is_some() || round.record.members.is_empty();
    if partial && (number.saturating_sub(1)..=number).contains(&h.round) {
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
