//! Naming a straggler, and choosing one to take out.
//!
//! In a synchronous job every rank's step takes as long as the slowest rank's: the ranks
//! that are done wait in the next collective. A step's wall time therefore names nobody;
//! a rank's own working time in it (what it did outside the collectives, which workers
//! report with each step: `<rank> step <n> <busy>`) does. [`judge`] compares each node's
//! slowest rank's median working time over its recent steps with the median of the other
//! nodes' ranks, a pure function: medians, so that one slow step (a page fault, a
//! neighbour's burst) names nobody; the others' median, so that the node judged does not
//! pull its own reference (in a group of two, a node at half speed scores 2, not 1.33); a
//! minimum number of steps, so that a new group names nobody; a margin to be named by and
//! a lower one to stop being named by, so that a rank on the line does not flap.
//!
//! [`take_out`] is the `--straggler-policy replace` decision of the node that judges (the
//! group's rank 0): the slowest node named for longer than a bound, at most one per
//! window, never leaving the group below its minimum.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// One rank's pace: the median of its recent working times, over `steps` steps.
#[derive(Debug, Clone, PartialEq)]
pub struct Pace {
    pub node: String,
    pub rank: u32,
    pub busy_s: f64,
    pub steps: u32,
}

/// What it takes to be named.
#[derive(Debug, Clone, PartialEq)]
pub struct Rules {
    /// Steps a rank must have reported in its window to be judged.
    pub min_steps: u32,
    /// A node at or above this many times the other nodes' median is a straggler...
    pub named_at: f64,
    /// ...and stays one until it falls below this.
    pub cleared_below: f64,
    /// And it must be this much slower in absolute terms: at a step of a few
    /// milliseconds, the clock and the scheduler alone make ratios of 1.5.
    pub min_excess_s: f64,
}

/// The agent's rules. A rank at half speed scores 2; a loaded machine's noise on medians
/// of 20 steps stays well under 1.5 (0.90–1.03 in 10 loaded minutes, docs/benchmarks.md
/// §19).
pub const RULES: Rules = Rules {
    min_steps: 10,
    named_at: 1.5,
    cleared_below: 1.25,
    min_excess_s: 0.005,
};

/// One node's score: its slowest judged rank's median over the other nodes' median.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeScore {
    pub node: String,
    pub score: f64,
    /// Its slowest rank, and that rank's median working time.
    pub rank: u32,
    pub busy_s: f64,
    /// The median working time of the other nodes' ranks: what it is measured against.
    pub others_s: f64,
    pub straggler: bool,
}

/// A judgement of the group: the judged nodes, slowest first.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Judgement {
    pub nodes: Vec<NodeScore>,
}

impl Judgement {
    /// The judged nodes named now.
    pub fn stragglers(&self) -> BTreeSet<String> {
        self.nodes
            .iter()
            .filter(|n| n.straggler)
            .map(|n| n.node.clone())
            .collect()
    }

    /// The nodes named after this judgement, `before` the ones named before: those named
    /// now, and those named before that this look could not judge (a node whose agent
    /// did not answer in time stays named: one missed look must not restart the bound).
    pub fn still_named(&self, before: &BTreeSet<String>) -> BTreeSet<String> {
        let mut named = self.stragglers();
        named.extend(
            before
                .iter()
                .filter(|b| !self.nodes.iter().any(|n| &n.node == *b))
                .cloned(),
        );
        named
    }

    /// The words for one node's score, e.g. "node b: rank 3 works 0.210 s a step, 2.0x
    /// the other nodes' median of 0.105 s".
    pub fn words(&self, node: &str) -> Option<String> {
        let n = self.nodes.iter().find(|n| n.node == node)?;
        Some(format!(
            "node {}: rank {} works {:.3} s a step, {:.1}x the other nodes' median of {:.3} s",
            n.node, n.rank, n.busy_s, n.score, n.others_s
        ))
    }
}

/// Judges the group from its ranks' paces; `before` are the nodes named last time (they
/// stay named down to [`Rules::cleared_below`]). Ranks with too few steps are left out; a
/// group of fewer than two judged nodes names nobody (a node is slow only beside others).
pub fn judge(paces: &[Pace], before: &BTreeSet<String>, rules: &Rules) -> Judgement {
    let judged: Vec<&Pace> = paces
        .iter()
        .filter(|p| p.steps >= rules.min_steps && p.busy_s.is_finite() && p.busy_s > 0.0)
        .collect();
    let nodes: BTreeSet<&str> = judged.iter().map(|p| p.node.as_str()).collect();
    if nodes.len() < 2 {
        return Judgement::default();
    }
    let others = |node: &str| {
        let mut times: Vec<f64> = judged
            .iter()
            .filter(|p| p.node != node)
            .map(|p| p.busy_s)
            .collect();
        median(&mut times)
    };
    let mut slowest: BTreeMap<&str, &Pace> = BTreeMap::new();
    for p in &judged {
        let e = slowest.entry(p.node.as_str()).or_insert(p);
        if p.busy_s > e.busy_s {
            *e = p;
        }
    }
    let mut scored: Vec<NodeScore> = slowest
        .into_iter()
        .map(|(node, p)| {
            let reference = others(node);
            let score = p.busy_s / reference;
            let bar = if before.contains(node) {
                rules.cleared_below
            } else {
                rules.named_at
            };
            NodeScore {
                node: node.to_owned(),
                score,
                rank: p.rank,
                busy_s: p.busy_s,
                others_s: reference,
                straggler: score >= bar && p.busy_s - reference >= rules.min_excess_s,
            }
        })
        .collect();
    scored.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.node.cmp(&b.node)));
    Judgement { nodes: scored }
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// The median of durations, in seconds (a rank's window).
pub fn median_s(window: impl IntoIterator<Item = Duration>) -> Option<f64> {
    let mut xs: Vec<f64> = window.into_iter().map(|d| d.as_secs_f64()).collect();
    (!xs.is_empty()).then(|| median(&mut xs))
}

/// The nodes named now that were not before, and those no longer named.
pub fn changes(before: &BTreeSet<String>, now: &BTreeSet<String>) -> (Vec<String>, Vec<String>) {
    (
        now.difference(before).cloned().collect(),
        before.difference(now).cloned().collect(),
    )
}

/// How a take-out's quarantine reason starts: what a later judge recognises it by (at
/// most one take-out per window, whichever node judged).
pub const REASON: &str = "straggler: ";

/// `--straggler-policy`: what a named node costs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Named in the log, status and metrics; nothing else.
    #[default]
    Warn,
    /// Also taken out of the group (quarantined) once it stays named past a bound.
    Replace,
}

impl Policy {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "warn" => Ok(Self::Warn),
            "replace" => Ok(Self::Replace),
            other => Err(format!(
                "'{other}' is no straggler policy: say 'warn' (name slow nodes) or 'replace' (also take a slow node out)"
            )),
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Self::Warn => "warn",
            Self::Replace => "replace",
        }
    }
}

/// How `replace` paces itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Pacing {
    /// A node is taken out once it has been named this long without a break.
    pub after: Duration,
    /// At most one node out per window.
    pub window: Duration,
}

/// `replace`'s pacing: long enough that a burst of noise clears first, short enough to
/// matter in a job of hours (the judge looks every few seconds).
pub const PACING: Pacing = Pacing {
    after: Duration::from_secs(20),
    window: Duration::from_secs(300),
};

/// The group's room to lose a node: its size and `--nnodes`' minimum. A spare waiting
/// to join is not counted: the judge does not see registrations outside the round (only
/// the coordinator's session does), so a node is taken out only while the group is above
/// its minimum; a waiting spare then takes its place at the re-form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    pub members: u32,
    pub min_nodes: u32,
}

/// Who else a take-out takes: a quarantine keeps out a machine, and every member of the
/// run on that machine leaves with it (at once or at its next join).
pub fn on_machine<'a>(machines: impl IntoIterator<Item = (&'a str, &'a str)>, node: &str) -> u32 {
    let all: Vec<(&str, &str)> = machines.into_iter().collect();
    let Some(machine) = all.iter().find(|(n, _)| *n == node).map(|(_, m)| *m) else {
        return 1;
    };
    all.iter().filter(|(_, m)| *m == machine).count().max(1) as u32
}

/// Which node `replace` takes out now, if any, with the reason either way.
/// `named_since`: when each named node was first named in this unbroken stretch;
/// `last_out`: when a straggler was last taken out of the run (by any judge);
/// `leaving(node)`: how many members leave with that node (its machine's).
pub fn take_out(
    now: Instant,
    j: &Judgement,
    named_since: &BTreeMap<String, Instant>,
    last_out: Option<Instant>,
    room: Room,
    leaving: impl Fn(&str) -> u32,
    pacing: &Pacing,
) -> (Option<String>, String) {
    let due = j.nodes.iter().find(|n| {
        n.straggler
            && named_since
                .get(&n.node)
                .is_some_and(|t| now.saturating_duration_since(*t) >= pacing.after)
    });
    let Some(n) = due else {
        return (None, "no node has been a straggler long enough".into());
    };
    if let Some(t) = last_out.filter(|t| now.saturating_duration_since(*t) < pacing.window) {
        let left = pacing.window - now.saturating_duration_since(t);
        return (
            None,
            format!(
                "node {} stays: a straggler was taken out {}s ago, at most one per {}s",
                n.node,
                (pacing.window - left).as_secs(),
                pacing.window.as_secs()
            ),
        );
    }
    let gone = leaving(&n.node);
    let after = room.members.saturating_sub(gone);
    if after < room.min_nodes {
        let with = if gone > 1 {
            format!(" and the {} other members on its machine", gone - 1)
        } else {
            String::new()
        };
        return (
            None,
            format!(
                "node {} stays: without it{with} the group would have {after} nodes, below --nnodes' minimum of {}",
                n.node, room.min_nodes
            ),
        );
    }
    (
        Some(n.node.clone()),
        format!(
            "{} for {}s or more; the group re-forms without it (a waiting spare, if any, takes its place)",
            j.words(&n.node)
                .unwrap_or_else(|| format!("node {}", n.node)),
            pacing.after.as_secs()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pace(node: &str, rank: u32, busy_s: f64, steps: u32) -> Pace {
        Pace {
            node: node.into(),
            rank,
            busy_s,
            steps,
        }
    }

    /// Four nodes of two ranks at `times` (per node), 20 steps each.
    fn group(times: &[f64]) -> Vec<Pace> {
        times
            .iter()
            .enumerate()
            .flat_map(|(i, &t)| {
                let node = format!("n{i}");
                [
                    pace(&node, 2 * i as u32, t, 20),
                    pace(&node, 2 * i as u32 + 1, t * 0.98, 20),
                ]
            })
            .collect()
    }

    fn none() -> BTreeSet<String> {
        BTreeSet::new()
    }

    #[test]
    fn a_node_at_half_speed_is_named_with_its_slowest_rank() {
        let j = judge(&group(&[0.10, 0.10, 0.20, 0.10]), &none(), &RULES);
        assert_eq!(j.stragglers(), BTreeSet::from(["n2".to_owned()]));
        assert_eq!(j.nodes[0].node, "n2");
        assert_eq!(j.nodes[0].rank, 4);
        assert!((j.nodes[0].score - 2.0).abs() < 0.05, "{j:?}");
        let words = j.words("n2").unwrap();
        assert!(
            words.contains("rank 4 works 0.200 s a step, 2.0x"),
            "{words}"
        );
    }

    #[test]
    fn noise_of_a_loaded_machine_names_nobody() {
        let j = judge(&group(&[0.10, 0.12, 0.09, 0.13]), &none(), &RULES);
        assert!(j.stragglers().is_empty(), "{j:?}");
        assert_eq!(j.nodes.len(), 4);
    }

    #[test]
    fn too_few_steps_or_one_node_names_nobody() {
        let mut young = group(&[0.10, 0.10, 0.30, 0.10]);
        for p in &mut young {
            p.steps = RULES.min_steps - 1;
        }
        assert_eq!(judge(&young, &none(), &RULES), Judgement::default());
        let alone = [pace("n0", 0, 0.1, 20), pace("n0", 1, 0.3, 20)];
        assert_eq!(judge(&alone, &none(), &RULES), Judgement::default());
        // A node whose ranks are still young is left out; the others are judged.
        let mut some = group(&[0.10, 0.10, 0.30]);
        some[4].steps = 1;
        some[5].steps = 1;
        let j = judge(&some, &none(), &RULES);
        assert!(j.stragglers().is_empty() && j.nodes.len() == 2, "{j:?}");
    }

    #[test]
    fn a_named_node_stays_named_until_it_clears_the_lower_bar() {
        let g = group(&[0.10, 0.10, 0.14, 0.10]);
        assert!(judge(&g, &none(), &RULES).stragglers().is_empty());
        let was = BTreeSet::from(["n2".to_owned()]);
        assert_eq!(judge(&g, &was, &RULES).stragglers(), was);
        let cleared = judge(&group(&[0.10, 0.10, 0.12, 0.10]), &was, &RULES);
        assert!(cleared.stragglers().is_empty());
        assert_eq!(
            changes(&was, &cleared.stragglers()),
            (vec![], vec!["n2".to_owned()])
        );
    }

    #[test]
    fn tiny_steps_need_a_real_excess_and_garbage_is_not_judged() {
        // 2 ms against 1 ms: a ratio of 2, but within a scheduler's noise.
        assert!(
            judge(&group(&[0.001, 0.001, 0.002, 0.001]), &none(), &RULES)
                .stragglers()
                .is_empty()
        );
        let mut g = group(&[0.10, 0.10, 0.20, 0.10]);
        g.push(pace("n9", 99, f64::NAN, 20));
        g.push(pace("n8", 98, 0.0, 20));
        let j = judge(&g, &none(), &RULES);
        assert!(j.nodes.iter().all(|n| n.node != "n9" && n.node != "n8"));
    }

    #[test]
    fn in_a_group_of_two_the_node_at_half_speed_scores_two() {
        // Against the group's median (their mean here) it would score 1.33: never named.
        let j = judge(&group(&[0.10, 0.20]), &none(), &RULES);
        assert_eq!(j.stragglers(), BTreeSet::from(["n1".to_owned()]), "{j:?}");
        assert!((j.nodes[0].score - 2.0).abs() < 0.05, "{j:?}");
        assert!(j.nodes[1].score < 0.6, "{j:?}");
    }

    #[test]
    fn two_slow_nodes_of_four_are_both_named() {
        let j = judge(&group(&[0.10, 0.20, 0.20, 0.10]), &none(), &RULES);
        assert_eq!(
            j.stragglers(),
            BTreeSet::from(["n1".to_owned(), "n2".to_owned()]),
            "{j:?}"
        );
    }

    #[test]
    fn a_named_node_that_misses_a_look_stays_named() {
        let was = BTreeSet::from(["n2".to_owned()]);
        // n2's agent did not answer this look: the others are judged, n2 stays named.
        let j = judge(&group(&[0.10, 0.10]), &was, &RULES);
        assert_eq!(j.still_named(&was), was);
        // Nobody could be judged at all: nothing changes either.
        assert_eq!(Judgement::default().still_named(&was), was);
        // Judged and fast again: cleared.
        let j = judge(&group(&[0.10, 0.10, 0.10]), &was, &RULES);
        assert!(j.still_named(&was).is_empty());
    }

    fn room(members: u32, min_nodes: u32) -> Room {
        Room { members, min_nodes }
    }

    #[test]
    fn replace_takes_out_one_node_named_past_the_bound_and_keeps_the_minimum() {
        let t0 = Instant::now();
        let j = judge(&group(&[0.10, 0.10, 0.20, 0.10]), &none(), &RULES);
        let since = BTreeMap::from([("n2".to_owned(), t0)]);
        let p = &PACING;
        // Not yet named long enough.
        let one = |_: &str| 1;
        let (out, why) = take_out(t0 + p.after / 2, &j, &since, None, room(4, 3), one, p);
        assert_eq!(out, None, "{why}");
        let later = t0 + p.after;
        let (out, why) = take_out(later, &j, &since, None, room(4, 3), one, p);
        assert_eq!(out.as_deref(), Some("n2"));
        assert!(
            why.contains("rank 4 works 0.200 s a step, 2.0x")
                && why.contains("re-forms without it"),
            "{why}"
        );
        // Never below the minimum.
        let (out, why) = take_out(later, &j, &since, None, room(4, 4), one, p);
        assert_eq!(out, None);
        assert!(why.contains("below --nnodes' minimum of 4"), "{why}");
        // Counting the members that share its machine: they leave with it.
        let (out, why) = take_out(later, &j, &since, None, room(4, 3), |_| 2, p);
        assert_eq!(out, None);
        assert!(
            why.contains("and the 1 other members on its machine"),
            "{why}"
        );
        // One per window.
        let half = Some(later - p.window / 2);
        let (out, why) = take_out(later, &j, &since, half, room(4, 3), one, p);
        assert_eq!(out, None);
        assert!(why.contains("at most one per 300s"), "{why}");
        let (out, _) = take_out(
            later,
            &j,
            &since,
            Some(later - p.window),
            room(4, 3),
            one,
            p,
        );
        assert_eq!(out.as_deref(), Some("n2"));
    }

    #[test]
    fn the_members_on_a_machine_are_counted() {
        let m = [("a", "m1"), ("b", "m2"), ("c", "m1")];
        assert_eq!(on_machine(m.iter().copied(), "a"), 2);
        assert_eq!(on_machine(m.iter().copied(), "b"), 1);
        assert_eq!(on_machine(m.iter().copied(), "z"), 1);
    }

    #[test]
    fn replace_takes_nobody_out_of_a_healthy_group() {
        let t0 = Instant::now();
        let j = judge(&group(&[0.10, 0.11, 0.10, 0.12]), &none(), &RULES);
        let since = BTreeMap::new();
        let (out, _) = take_out(
            t0 + PACING.after * 10,
            &j,
            &since,
            None,
            room(4, 1),
            |_| 1,
            &PACING,
        );
        assert_eq!(out, None);
    }

    #[test]
    fn policies_parse_and_a_typo_says_the_choices() {
        assert_eq!(Policy::parse("warn"), Ok(Policy::Warn));
        assert_eq!(Policy::parse("replace"), Ok(Policy::Replace));
        let e = Policy::parse("kick").unwrap_err();
        assert!(e.contains("'warn'") && e.contains("'replace'"), "{e}");
    }
}
