//! How fast rounds may be sealed: the safety net under every re-form rule, as a pure
//! function of (now, the seals so far, the basis of the next one) → go, or hold until when
//! and why.
//!
//! [`crate::seal::decide`] seals a round for a reason that the new round should settle (a
//! member lost, a failure reported, a node waiting, a member that stopped its workers). A
//! fact that stays true after the round it caused (a stale departure, a registration
//! written again and again) makes it seal round after round: outside testing saw 600
//! rounds a second for minutes, with no exit code and etcd growing by megabytes. The root
//! causes are fixed where they were; this module makes any loop of the future loud and
//! slow instead of silent and fast:
//!
//! * **per basis:** a seal is justified by what the coordinator sees — the registrations
//!   present (node and incarnation) and the failures reported: its [`Basis`]. The first
//!   [`PaceConfig::per_basis`] seals on one basis go at once; each further one waits a
//!   delay that doubles from [`PaceConfig::first_hold`] up to [`PaceConfig::last_hold`]
//!   after the previous seal. A node that joins, leaves, registers again or fails changes
//!   the basis and starts afresh.
//! * **per second:** once [`PaceConfig::per_second`] rounds were sealed within a second,
//!   each next one waits a delay that doubles from the first hold, whatever the basis,
//!   until the rounds calm down: a gap of [`WINDOW`] beyond the hold in force ends it.
//!   The hold is measured from the last seal, never from a sliding window: a window that
//!   emptied while the coordinator waited lifted an 8 s hold after 0.4 s, so a loop whose
//!   basis changed every round ran at 5 rounds a second instead of backing off.
//!
//! A hold on one basis ([`HoldRule::SameBasis`]) is a bug: nothing a node did explains the
//! rounds, and the coordinator's log says so as an error naming the reasons of the last
//! rounds. A hold of the per-second rule alone ([`HoldRule::Churn`]) is nodes coming and
//! going faster than a group can settle, which a flapping network or a crowd of restarts
//! does: one info line per episode. Both count in `fsdp_agent_round_seals_held_total`,
//! beside `fsdp_agent_rounds_sealed_total`.

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

/// How far back the per-second rule looks to grow its delay.
pub const WINDOW: Duration = Duration::from_secs(10);
/// Seals remembered: enough for [`WINDOW`] at the most the rules let through, and for the
/// reasons a hold names.
const KEPT: usize = 64;
/// Reasons a hold names (the latest rounds).
const NAMED: usize = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PaceConfig {
    /// Seals on one basis that go at once.
    pub per_basis: u32,
    /// Seals within a second before the per-second rule holds.
    pub per_second: u32,
    /// The first hold; each further one doubles, up to `last_hold`.
    pub first_hold: Duration,
    pub last_hold: Duration,
}

impl Default for PaceConfig {
    fn default() -> Self {
        Self {
            per_basis: 3,
            per_second: 5,
            first_hold: Duration::from_millis(500),
            last_hold: Duration::from_secs(30),
        }
    }
}

/// What a seal rests on: the registrations present, each by node and incarnation, and the
/// failures reported. Kept as a digest: at 1,000 nodes the coordinator computes it on every
/// change it observes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Basis(u64);

impl Basis {
    /// The basis of `registrations` (node, incarnation, create revision; in any order the
    /// caller keeps stable, e.g. by node) and `failures` (the rounds with a failure
    /// record). Neither the members a round would have (a loop that drops a node and takes
    /// it back would alternate between two bases, never three in a row) nor the round a
    /// node asks for (a node asking for the next round after every seal, on one
    /// registration, was the loop of the frozen agent itself) counts.
    pub fn of<'a>(
        registrations: impl IntoIterator<Item = (&'a str, u64, i64)>,
        failures: impl IntoIterator<Item = u64>,
    ) -> Self {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for r in registrations {
            r.hash(&mut h);
        }
        0xfa11u16.hash(&mut h);
        for f in failures {
            f.hash(&mut h);
        }
        Self(h.finish())
    }
}

/// One round sealed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Sealed {
    at: Instant,
    number: u64,
    basis: Basis,
    reason: String,
}

/// Which rule holds a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldRule {
    /// Rounds on one basis: no node joined, left, registered again or failed. A bug.
    SameBasis,
    /// Only the per-second rule, in the `episode`-th episode of churn (the first hold of
    /// each is worth an info line).
    Churn { episode: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PaceDecision {
    Go,
    /// Do not seal before `until`; `why` says which rule and the last rounds' reasons.
    Hold {
        until: Instant,
        why: String,
        rule: HoldRule,
    },
}

/// The seals so far, newest last.
#[derive(Debug, Clone, Default)]
pub struct Pace {
    cfg: PaceConfig,
    sealed: VecDeque<Sealed>,
    /// Seals made while the per-second rule was in force, in the current episode (0: none).
    strikes: u32,
    /// Episodes of churn so far.
    episodes: u64,
}

impl Pace {
    pub fn new(cfg: PaceConfig) -> Self {
        Self {
            cfg,
            sealed: VecDeque::new(),
            strikes: 0,
            episodes: 0,
        }
    }

    /// May a round resting on `basis` be sealed at `now`?
    pub fn check(&self, now: Instant, basis: Basis) -> PaceDecision {
        let Some(last) = self.sealed.back() else {
            return PaceDecision::Go;
        };
        let mut until = None;
        let mut rules = Vec::new();
        let same = self
            .sealed
            .iter()
            .rev()
            .take_while(|s| s.basis == basis)
            .count() as u32;
        if same >= self.cfg.per_basis {
            let extra = same - self.cfg.per_basis;
            let at = last.at + self.hold(extra);
            until = until.max(Some(at));
            rules.push(format!(
                "{same} rounds in a row were sealed with no node joining, leaving, registering again or failing"
            ));
        }
        // The loop's rule, when its own hold is what still holds the round.
        let same_basis = until.is_some_and(|u| u > now);
        if self.strikes > 0 {
            let at = last.at + self.hold(self.strikes - 1);
            until = until.max(Some(at));
            rules.push(format!(
                "{} or more rounds within a second ({} in the last {}s)",
                self.cfg.per_second,
                self.sealed
                    .iter()
                    .filter(|s| last.at.saturating_duration_since(s.at) < WINDOW)
                    .count(),
                WINDOW.as_secs()
            ));
        }
        let rule = if same_basis {
            HoldRule::SameBasis
        } else {
            HoldRule::Churn {
                episode: self.episodes,
            }
        };
        match until {
            Some(until) if until > now => PaceDecision::Hold {
                until,
                why: format!(
                    "{}; holding the next round for {:.1}s (the last rounds: {})",
                    rules.join(" and "),
                    (until - now).as_secs_f64(),
                    self.last_reasons()
                ),
                rule,
            },
            _ => PaceDecision::Go,
        }
    }

    /// Round `number` resting on `basis` was sealed at `now` for `reason`.
    pub fn sealed(&mut self, now: Instant, number: u64, basis: Basis, reason: &str) {
        let going_on = self.going_on(now);
        self.remember(now, number, basis, reason);
        let burst = self
            .sealed
            .iter()
            .filter(|s| now.saturating_duration_since(s.at) < Duration::from_secs(1))
            .count() as u32
            >= self.cfg.per_second;
        self.strikes = match (going_on, burst) {
            (true, _) => self.strikes.saturating_add(1),
            (false, true) => {
                self.episodes += 1;
                1
            }
            (false, false) => 0,
        };
    }

    /// Round `number` resting on `basis`, which only dropped members, was sealed at `now`
    /// without asking [`Pace::check`]: there are only so many members to lose. It counts
    /// for the per-basis rule and the next hold is measured from it, but it is no strike:
    /// where nodes kept dying and coming back, each loss doubled the hold of the nodes
    /// that came back after it, up to 30 s past the moment everything had healed
    /// (simulator seed 2423531759). A long quiet before it still ends the episode.
    pub fn dropped(&mut self, now: Instant, number: u64, basis: Basis, reason: &str) {
        if !self.going_on(now) {
            self.strikes = 0;
        }
        self.remember(now, number, basis, reason);
    }

    /// Whether a seal at `now` goes on the episode of churn: seals keep coming within a
    /// window of the hold in force; a longer quiet ends it.
    fn going_on(&self, now: Instant) -> bool {
        self.strikes > 0
            && self.sealed.back().is_some_and(|p| {
                now.saturating_duration_since(p.at) < self.hold(self.strikes - 1) + WINDOW
            })
    }

    fn remember(&mut self, now: Instant, number: u64, basis: Basis, reason: &str) {
        if self.sealed.len() == KEPT {
            self.sealed.pop_front();
        }
        self.sealed.push_back(Sealed {
            at: now,
            number,
            basis,
            reason: reason.to_owned(),
        });
    }

    /// The `n`-th (0-based) hold of a rule that keeps being crossed.
    fn hold(&self, n: u32) -> Duration {
        crate::backoff::nth(self.cfg.first_hold, self.cfg.last_hold, n)
    }

    fn last_reasons(&self) -> String {
        self.sealed
            .iter()
            .rev()
            .take(NAMED)
            .map(|s| format!("round {}: {}", s.number, s.reason))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn basis(nodes: &[(&str, u64)], failures: &[u64]) -> Basis {
        Basis::of(
            nodes.iter().map(|(n, i)| (*n, *i, 1)),
            failures.iter().copied(),
        )
    }

    fn held(d: &PaceDecision) -> Option<Instant> {
        match d {
            PaceDecision::Go => None,
            PaceDecision::Hold { until, .. } => Some(*until),
        }
    }

    #[test]
    fn a_basis_names_registrations_and_failures() {
        let a = basis(&[("a", 1), ("b", 1)], &[]);
        assert_eq!(a, basis(&[("a", 1), ("b", 1)], &[]));
        assert_ne!(a, basis(&[("a", 2), ("b", 1)], &[]), "a new incarnation");
        assert_ne!(a, basis(&[("a", 1)], &[]), "a node gone");
        assert_ne!(a, basis(&[("a", 1), ("b", 1)], &[4]), "a failure reported");
    }

    /// The livelock's shape: one node registering again and again for the next round on
    /// one registration, each seal at once. Three go; then the holds double.
    #[test]
    fn seals_on_one_basis_go_three_times_then_back_off() {
        let t0 = Instant::now();
        let mut p = Pace::new(PaceConfig::default());
        let b = basis(&[("me", 2)], &[]);
        // Spread out, so that only the per-basis rule can hold.
        for n in 0..3u32 {
            let at = t0 + n * Duration::from_secs(2);
            assert_eq!(p.check(at, b), PaceDecision::Go, "seal {n}");
            p.sealed(at, n.into(), b, "re-form (me stopped their workers)");
        }
        let last = t0 + Duration::from_secs(4);
        let PaceDecision::Hold { until, why, rule } = p.check(last + MS, b) else {
            panic!("a fourth seal on one basis must wait")
        };
        assert_eq!(rule, HoldRule::SameBasis);
        assert_eq!(until, last + 500 * MS);
        assert!(why.contains("3 rounds in a row"), "{why}");
        assert!(
            why.contains("round 2: re-form (me stopped their workers)"),
            "{why}"
        );
        // Right after the previous seal it waits the first hold; then each doubles.
        let mut last = last;
        for (n, hold) in [500u32, 1000, 2000, 4000].into_iter().enumerate() {
            let at = last + Duration::from_millis(1);
            assert_eq!(held(&p.check(at, b)), Some(last + hold * MS), "hold {n}");
            assert_eq!(p.check(last + hold * MS, b), PaceDecision::Go);
            last += hold * MS;
            p.sealed(last, 3 + n as u64, b, "again");
        }
        // A change of basis (a node joined, one registered again, a failure) goes at once.
        let other = basis(&[("me", 3)], &[]);
        assert_eq!(p.check(last + MS, other), PaceDecision::Go);
        let failed = basis(&[("me", 2)], &[9]);
        assert_eq!(p.check(last + MS, failed), PaceDecision::Go);
    }

    #[test]
    fn more_than_five_seals_a_second_are_held_whatever_their_basis() {
        let t0 = Instant::now();
        let mut p = Pace::new(PaceConfig::default());
        for n in 0..5u64 {
            let b = basis(&[("n", n)], &[]);
            let at = t0 + n as u32 * 10 * MS;
            assert_eq!(p.check(at, b), PaceDecision::Go, "seal {n}");
            p.sealed(at, n, b, &format!("growth {n}"));
        }
        let next = basis(&[("n", 99)], &[]);
        let now = t0 + 50 * MS;
        let PaceDecision::Hold { until, why, rule } = p.check(now, next) else {
            panic!("a sixth seal within a second must wait")
        };
        assert_eq!(rule, HoldRule::Churn { episode: 1 }, "{why}");
        assert_eq!(until, t0 + 40 * MS + 500 * MS);
        assert!(
            why.contains("5 or more rounds within a second (5 in the last 10s)"),
            "{why}"
        );
        assert!(why.contains("round 4: growth 4"), "{why}");
        // Sealed anyway at the end of the hold: the next hold is longer (10 s window).
        p.sealed(until, 5, next, "growth 5");
        let again = basis(&[("n", 100)], &[]);
        assert_eq!(held(&p.check(until + MS, again)), Some(until + 1000 * MS));
        // At the end of that hold it goes.
        assert_eq!(
            p.check(until + Duration::from_secs(1), again),
            PaceDecision::Go
        );
    }

    /// Ten pods stopping 2 s in 4: a hold of 8 s was lifted 0.4 s later, once fewer than
    /// five seals were left in the last second, and the doubling never took hold.
    #[test]
    fn a_churn_hold_lasts_its_time_and_doubles_while_the_churn_goes_on() {
        let t0 = Instant::now();
        let mut p = Pace::new(PaceConfig::default());
        let mut n = 0u64;
        let mut seal = |p: &mut Pace, at: Instant| {
            n += 1;
            let b = basis(&[("n", n)], &[]);
            p.sealed(at, n, b, "churn");
        };
        for k in 0..5u32 {
            seal(&mut p, t0 + k * 10 * MS);
        }
        let mut last = t0 + 40 * MS;
        let fresh = || basis(&[("other", 7)], &[]);
        for (nth, hold_ms) in [500u32, 1000, 2000, 4000, 8000, 16000, 30000, 30000]
            .into_iter()
            .enumerate()
        {
            // Asked at any time before its end, the hold stands, even with the last second empty.
            for asked in [last + MS, last + (hold_ms - 1) * MS] {
                let d = p.check(asked, fresh());
                let PaceDecision::Hold { until, rule, .. } = d else {
                    panic!("hold {nth} lifted at {:?}", asked - last)
                };
                assert_eq!(until, last + hold_ms * MS, "hold {nth}");
                assert_eq!(rule, HoldRule::Churn { episode: 1 }, "hold {nth}");
            }
            last += hold_ms * MS;
            assert_eq!(p.check(last, fresh()), PaceDecision::Go);
            seal(&mut p, last);
        }
        // Quiet for the hold and a window: the episode is over, and one seal goes at once.
        let later = last + Duration::from_secs(41);
        assert_eq!(p.check(later, fresh()), PaceDecision::Go);
        seal(&mut p, later);
        assert_eq!(p.check(later + MS, fresh()), PaceDecision::Go);
    }

    /// A round that only drops members is sealed without asking the pace, and it does
    /// not lengthen the churn hold either: there are only so many members to lose. In a
    /// run where nodes kept dying and coming back (simulator seed 2423531759, six
    /// agents), every loss counted as a strike, the hold reached 30 s, and the two nodes
    /// back after the last loss waited past the point where everything had healed.
    #[test]
    fn rounds_that_only_drop_members_do_not_lengthen_the_churn_hold() {
        let t0 = Instant::now();
        let mut p = Pace::new(PaceConfig::default());
        for n in 0..5u64 {
            let b = basis(&[("n", n)], &[]);
            p.sealed(t0 + n as u32 * 10 * MS, n, b, "growth");
        }
        // Three losses, 2 s apart, within the episode's window.
        let mut last = t0;
        for k in 1..=3u32 {
            last = t0 + k * Duration::from_secs(2);
            let b = basis(&[("n", 10 + u64::from(k))], &[]);
            p.dropped(last, 4 + u64::from(k), b, "re-form (lost n)");
        }
        // The nodes come back: held the episode's first hold from the last loss, not a
        // hold doubled by every loss.
        let back = basis(&[("n", 99)], &[]);
        let d = p.check(last + MS, back);
        assert_eq!(held(&d), Some(last + 500 * MS), "{d:?}");
        // A loss after a long quiet ends the episode: what comes next goes at once.
        let quiet = last + Duration::from_secs(30);
        p.dropped(quiet, 8, basis(&[("n", 100)], &[]), "re-form (lost n)");
        assert_eq!(p.check(quiet + MS, back), PaceDecision::Go);
        // Losses alone never start an episode.
        let mut p = Pace::new(PaceConfig::default());
        for n in 0..6u64 {
            p.dropped(t0 + n as u32 * 10 * MS, n, basis(&[("n", n)], &[]), "lost");
        }
        assert_eq!(p.check(t0 + 60 * MS, back), PaceDecision::Go);
    }

    #[test]
    fn the_normal_life_of_a_job_is_never_held() {
        // Formation, a failure, a loss, a node back, growth: each a new basis, seconds apart.
        let t0 = Instant::now();
        let mut p = Pace::new(PaceConfig::default());
        let steps = [
            basis(&[("a", 1), ("b", 1)], &[]),
            basis(&[("a", 1), ("b", 1)], &[0]),
            basis(&[("a", 1)], &[0]),
            basis(&[("a", 1), ("b", 2)], &[0]),
            basis(&[("a", 1), ("b", 2), ("c", 1)], &[0]),
        ];
        for (n, b) in steps.into_iter().enumerate() {
            let at = t0 + Duration::from_millis(300 * n as u64);
            assert_eq!(p.check(at, b), PaceDecision::Go, "step {n}");
            p.sealed(at, n as u64, b, "fine");
        }
    }
}
