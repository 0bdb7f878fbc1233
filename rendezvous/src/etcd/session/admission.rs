//! Admission at formation: how fast a joining node adds load to etcd. A job's nodes start
//! together, and at 10,000 of them every node's grant, read and registration arrived at
//! once: etcd's apply loop fell a TTL behind, keep-alives were answered "waiting for the
//! applied index took too long", leases expired, and every lost lease was a new grant
//! and a new registration — more load while etcd was behind, a crowd that never formed.
//!
//! Nodes on separate hosts share nothing but etcd, so the pace is what etcd's answers
//! say: a request answered within the target (a tenth of the TTL) lets the next go at
//! once; one answered later, or refused as too busy, or a keep-alive answered later (etcd
//! 3.4 renews only once its apply loop caught up, which its reads do not wait for),
//! doubles this node's pause before its next request (at least the latency it saw), and
//! each fast answer to a request halves it; a lease lost while kept alive sets it to the
//! longest. The pause
//! is drawn around its value (from half to one and a half times) so that a crowd refused
//! together does not come back together. While etcd keeps up no request waits, so a
//! healthy join and every re-form cost nothing; a crowd slows itself to the pace etcd
//! drains at, each node's lease kept alive meanwhile (its keep-alive stream is opened
//! right after the grant, before its first sync: `sync.rs`).
//!
//! Before that, in a run of more than [`CROWD`] nodes, a node waits its
//! [`Turn`](super::Turn) until the coordinator lets the crowd that far (`turn.rs`), so the
//! crowd comes to etcd as fast as etcd completes joins, whatever etcd it is; a node whose
//! turn came at its place in the spread instead (no coordinator yet) goes through the
//! [`Gate`], which holds it while etcd's apply loop is behind.
//!
//! Pure: [`Admission::answered`], [`Admission::refused`], [`Admission::kept_alive`] and
//! [`Admission::lease_lost`] take what happened and say when the next paced request may
//! go; the machine holds requests until then. [`Gate::looked`] does the same for the
//! handle's join before the grant (`handle.rs`) and the simulator's.

use std::time::{Duration, Instant};

use super::io::Op;
use crate::job::fnv;

/// Whether `op` is one a joining node paces: a request etcd serves (not its streams, a
/// member count it answers from memory, or a departure).
pub(super) fn paced(op: &Op) -> bool {
    matches!(
        op,
        Op::Range { .. } | Op::Txn(_) | Op::Put(_) | Op::Grant { .. } | Op::TimeToLive { .. }
    )
}

/// A joining node's pace.
#[derive(Debug)]
pub(super) struct Admission {
    /// The pause before the next request, before it is drawn around.
    pause: Duration,
    /// When the next paced request may go.
    not_before: Option<Instant>,
    /// Answers slower than this mean etcd is behind.
    target: Duration,
    /// The longest pause: a node that waited this long between requests is paced enough
    /// (a crowd's lease is kept alive meanwhile, but its join must still end).
    longest: Duration,
    /// The draw's state (from the node id: every node draws differently, the same node
    /// the same way in every run of the simulator).
    draw: u64,
    /// The node ran a round: formation is over for it.
    over: bool,
}

/// Pauses shorter than this are none.
const NONE_BELOW: Duration = Duration::from_millis(10);

/// Runs of up to this many nodes join at once: etcd takes their first requests together
/// (1,000 agents formed in 3.3–5.3 s on two cores, nothing refused).
pub const CROWD: u32 = 1_000;

/// The fixed spread's mean rate, per second (the rate falls over the spread, [`TAPER`]):
/// a crowd's node goes at its place in it (slowed three times since turns are pushed) at
/// the latest, whatever its [`Turn`](super::Turn) says, and the turn's first look is
/// paced from it. Once it was the pace itself. Each join is two
/// proposals (the grant, the registration), and one etcd 3.4 on two cores applied
/// 2,300–2,600 proposals a second beside a crowd's keep-alives, reads and watches: at
/// 2,000 joins a second its apply loop fell behind within 2 s (1,800 proposals pending,
/// keep-alives refused, leases lost); at 1,000 a second 10,000 nodes registered in 11.3 s
/// with not one request refused. Faster spreads are bimodal: with a renewal less per
/// joining node (`enter` in `phases.rs`), 1,400 a second falling from 2,100 to 700 formed
/// 10,000 in 9.2–10.1 s in four runs and in 14.0–17.4 s in five, where the gate held
/// 1,764–2,844 nodes for up to 12 s; 1,250 a second formed them in 10.2–10.8 s, and once
/// in 16.5 s. This rate, with the same renewal less, formed every run in 12.0–12.4 s,
/// none held.
pub const JOINS_PER_SECOND: u32 = 1_000;

/// How far the join rate falls over a crowd's spread: it starts at `1 + TAPER` times
/// the mean and ends at `1 - TAPER` times it. Every node that joined is one more lease
/// renewed every third of a TTL, so at an even rate etcd's load grew all through the
/// spread and peaked at its end, just before the round was sealed and its header and
/// shards went to every member: at 10,000 nodes etcd's apply loop was 600–850 proposals
/// behind there, 100–310 with this taper. The first second's 1,300 joins are more than
/// the even rate's 1,000, but few renewals run beside them. (Formations at 10,000 that
/// collapsed at the seal did so with the taper too, 3 runs of 42 against 2 of 12: not
/// shown to change.) In `0..1`: at 0 the spread is even, at 1 its last joins never come.
pub const TAPER: f64 = 0.3;

const _: () = assert!(TAPER >= 0.0 && TAPER < 1.0);

/// Node `node_id`'s place in the fixed spread of a run of at most `max_nodes`, the
/// latest its turn came before turns were pushed ([`Turn`](super::Turn)): none in a run of up to `crowd` nodes; in a larger
/// one a draw from the node id, spread over `max_nodes / per_second` seconds at a rate
/// that falls from the first second to the last ([`TAPER`]), so that 10,000 nodes
/// started together arrive at etcd over 10 s at most, not in one instant (when they did,
/// etcd fell a TTL behind and formation collapsed).
pub fn spread(node_id: &str, max_nodes: u32, crowd: u32, per_second: u32) -> Duration {
    if !a_crowd(max_nodes, crowd) {
        return Duration::ZERO;
    }
    let span = Duration::from_secs_f64(f64::from(max_nodes) / f64::from(per_second.max(1)));
    span.mul_f64(tapered(place_in_crowd(node_id)))
}

/// The moment, as a fraction of the spread, by which a fraction `u` of the crowd has
/// joined when the rate falls linearly from `1 + TAPER` to `1 - TAPER` times the mean:
/// the inverse of `x -> (1 + TAPER) x - TAPER x²`, in the form that is `u` itself when
/// `TAPER` is 0 (the other root's form divides by it).
fn tapered(u: f64) -> f64 {
    let (a, u) = (TAPER, u.clamp(0.0, 1.0));
    2.0 * u / ((1.0 + a) + ((1.0 + a) * (1.0 + a) - 4.0 * a * u).max(0.0).sqrt())
}

/// Node `node_id`'s place in a crowd, in `0..1`: a draw from its id, the same in every
/// run. Two rounds: node ids that differ in their last character hash to nearby values.
pub fn place_in_crowd(node_id: &str) -> f64 {
    unit(xorshift(xorshift(fnv(node_id.as_bytes()) | 1)))
}

/// The next of a xorshift64 sequence (never 0 from a value that is not).
fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// `x` as a fraction in `0..1`.
fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}

/// The gate before a crowd's grant, for the nodes no reach of the coordinator let in (the
/// crowd's first places, which go at once, and turns that came at their place in the
/// spread, [`JOINS_PER_SECOND`]): nothing said etcd can take one more now, and etcd's
/// room for joins shrinks as the nodes already in renew their leases (every third of a
/// TTL: 12,000 renewals a second at 20,000 nodes). There etcd's apply loop fell behind
/// 4–8 s into the spread (1,300–3,300 proposals pending, where 10,000 nodes stayed under
/// 310), keep-alives waited for it and were refused, and leases expired: once a node has
/// its lease and registration it adds load whatever pace its later requests keep, so the
/// pace must hold it before. Its first request, the nesting check, is read
/// linearizably in a crowd: etcd answers it only once its apply loop has caught up with
/// the moment it was asked, so how long it took is how far that loop is behind. A prompt
/// answer opens the gate; a slow one (a refusal as too busy is asked again within the
/// look, with the join's backoff, and makes it slow) holds the node for a pause that
/// doubles with each slow look, from the latency seen to at most [`LATENCIES_HELD`]
/// times it (a look just over the target may be a spike, not a lag), and never beyond
/// twice the TTL, drawn from half to one and a half times its value, and it looks
/// again. Nodes held there
/// have no lease and no registration yet: they add reads, nothing to renew and nothing
/// to expire.
#[derive(Debug)]
pub struct Gate {
    pause: Duration,
    /// Answers slower than this mean etcd is behind (as [`Admission`]'s target).
    target: Duration,
    longest: Duration,
    draw: u64,
}

impl Gate {
    /// The gate of node `node_id` with lease TTL `ttl`.
    pub fn new(node_id: &str, ttl: Duration) -> Self {
        Self {
            pause: Duration::ZERO,
            target: ttl / 10,
            longest: ttl * 2,
            // Not the admission's draw: a node's two pauses need not coincide.
            draw: xorshift(fnv(node_id.as_bytes()) | 1),
        }
    }

    /// The gate's read, sent at `sent`, came back at `now` (answered, or etcd kept
    /// refusing it as too busy until then): `None` to go on to the grant, or when to look
    /// again.
    pub fn looked(&mut self, sent: Instant, now: Instant) -> Option<Instant> {
        let latency = now.saturating_duration_since(sent);
        if latency <= self.target {
            return None;
        }
        // Bounded by this look's latency: pauses doubled by a run of looks just over the
        // target held a crowd's last nodes for tens of seconds with etcd idle.
        let pause = (self.pause * 2).min(latency.saturating_mul(LATENCIES_HELD));
        self.pause = pause.max(latency).min(self.longest);
        self.draw = xorshift(self.draw);
        Some(now + self.pause.mul_f64(0.5 + unit(self.draw)))
    }
}

/// A slow look holds a node for at most this many times its latency (before the draw;
/// the longest pause comes first).
const LATENCIES_HELD: u32 = 4;

/// Whether a run of at most `max_nodes` nodes joins through the [`Gate`]: a crowd (the
/// nodes spread their joins), unless admission is switched off.
pub fn gated(max_nodes: u32) -> bool {
    a_crowd(max_nodes, CROWD)
}

/// Whether a run of at most `max_nodes` nodes is a crowd of more than `crowd` whose joins
/// are spread and gated (the simulator gives its own, scaled-down `crowd`), unless
/// admission is switched off.
pub fn a_crowd(max_nodes: u32, crowd: u32) -> bool {
    max_nodes > crowd && !crate::switches::NO_ADMISSION.with(std::cell::Cell::get)
}

impl Admission {
    /// The pace of node `node_id` with lease TTL `ttl`.
    pub(super) fn new(node_id: &str, ttl: Duration) -> Self {
        let draw = fnv(node_id.as_bytes());
        Self {
            pause: Duration::ZERO,
            not_before: None,
            target: ttl / 10,
            longest: ttl / 2,
            draw: draw | 1,
            over: false,
        }
    }

    /// Whether requests are paced: until the node runs a round.
    pub(super) fn active(&self) -> bool {
        !self.over && !crate::switches::NO_ADMISSION.with(std::cell::Cell::get)
    }

    /// The node runs its first round: its later requests go unpaced (a re-form must not
    /// wait).
    pub(super) fn ran_a_round(&mut self) {
        self.over = true;
    }

    /// Whether the node ran a round (its formation is over).
    pub(super) fn formation_over(&self) -> bool {
        self.over
    }

    /// When a request may go, if not at `now`.
    pub(super) fn wait(&self, now: Instant) -> Option<Instant> {
        self.not_before.filter(|at| *at > now && self.active())
    }

    /// A request sent at `sent` was answered at `now`: the next goes after the pause.
    pub(super) fn answered(&mut self, sent: Instant, now: Instant) {
        let latency = now.saturating_duration_since(sent);
        if latency > self.target {
            self.slower(latency);
        } else {
            self.pause /= 2;
            if self.pause < NONE_BELOW {
                self.pause = Duration::ZERO;
            }
        }
        self.not_before = self.next(now);
    }

    /// A keep-alive sent at `sent` was answered at `now`. etcd 3.4 renews a lease only
    /// once its apply loop has applied all that was committed (`waitAppliedIndex`), so a
    /// late answer says etcd is behind while reads come back at once (they wait for
    /// nothing): the next request waits as after a slow answer. At 20,000 nodes 11,101
    /// keep-alives waited there at one moment while the crowd's reads went on; then
    /// leases expired by etcd's clock and their nodes granted again. A prompt answer
    /// changes nothing: the requests' own answers bring the pace down.
    pub(super) fn kept_alive(&mut self, sent: Instant, now: Instant) {
        let latency = now.saturating_duration_since(sent);
        if latency <= self.target || !self.active() {
            return;
        }
        self.slower(latency);
        let next = self.next(now);
        self.not_before = self.not_before.max(next);
    }

    /// etcd refused a request sent at `sent` as too busy, at `now`: the pause grows;
    /// returns when to send it again (no earlier than `retry` from now, the session's own
    /// backoff).
    pub(super) fn refused(&mut self, sent: Instant, now: Instant, retry: Duration) -> Instant {
        self.slower(now.saturating_duration_since(sent).max(retry));
        let at = self.next(now).unwrap_or(now).max(now + retry);
        self.not_before = Some(at);
        at
    }

    /// etcd let this node's lease expire at `now` while the node kept it alive: it is a
    /// TTL behind. The pause grows to the longest, and the next request waits it.
    pub(super) fn lease_lost(&mut self, now: Instant) {
        self.slower(self.longest);
        self.not_before = self.next(now);
    }

    /// The current pause (before it is drawn around).
    #[cfg(test)]
    pub(super) fn pause(&self) -> Duration {
        self.pause
    }

    fn slower(&mut self, seen: Duration) {
        self.pause = (self.pause * 2).max(seen).min(self.longest);
    }

    /// `now` plus the pause drawn between half and one and a half times its value.
    fn next(&mut self, now: Instant) -> Option<Instant> {
        if self.pause.is_zero() {
            return None;
        }
        self.draw = xorshift(self.draw);
        Some(now + self.pause.mul_f64(0.5 + unit(self.draw)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(5);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A lease etcd let expire while it was kept alive says etcd is a TTL behind: the
    /// next request (the new grant) waits the longest pause, drawn around, and fast
    /// answers then bring the pace back down.
    #[test]
    fn a_lease_lost_while_kept_alive_holds_the_next_request_the_longest_pause() {
        let mut a = Admission::new("n1", TTL);
        let t0 = Instant::now();
        a.lease_lost(t0);
        assert_eq!(a.pause(), TTL / 2);
        let held = a.wait(t0).expect("held") - t0;
        assert!(held >= TTL / 4 && held <= TTL * 3 / 4, "{held:?}");
        let sent = t0 + held;
        a.answered(sent, sent + ms(20));
        assert_eq!(a.pause(), TTL / 4);
    }

    /// A late keep-alive holds the next request around the latency it saw; a prompt one
    /// neither holds a request nor shortens a pause.
    #[test]
    fn a_late_keep_alive_holds_the_next_request_and_a_prompt_one_changes_nothing() {
        let mut a = Admission::new("n1", TTL);
        let t0 = Instant::now();
        a.kept_alive(t0, t0 + ms(20));
        assert_eq!((a.pause(), a.wait(t0 + ms(20))), (Duration::ZERO, None));
        a.kept_alive(t0, t0 + ms(1200));
        assert_eq!(a.pause(), ms(1200));
        let now = t0 + ms(1200);
        let held = a.wait(now).expect("held") - now;
        assert!(held >= ms(600) && held <= ms(1800), "{held:?}");
        let at = a.wait(now);
        a.kept_alive(now, now + ms(10));
        assert_eq!((a.pause(), a.wait(now)), (ms(1200), at));
    }

    /// A late keep-alive never brings a longer hold nearer: after a lost lease (the
    /// longest pause), one 600 ms late leaves the next request where it was or later.
    #[test]
    fn a_late_keep_alive_never_shortens_a_hold() {
        let mut a = Admission::new("n1", TTL);
        let t0 = Instant::now();
        a.lease_lost(t0);
        let held = a.wait(t0).expect("held");
        a.kept_alive(t0, t0 + ms(600));
        assert!(a.wait(t0 + ms(600)).expect("still held") >= held);
    }

    /// The gate opens at a prompt answer, holds the node at a slow one for a drawn pause
    /// that doubles with each slow look up to four times the latency (and twice the
    /// TTL), and opens again at the first prompt one.
    #[test]
    fn the_gate_holds_a_node_while_etcd_answers_slowly_and_opens_at_a_prompt_answer() {
        let mut g = Gate::new("n1", TTL);
        let t0 = Instant::now();
        assert_eq!(g.looked(t0, t0 + ms(40)), None, "prompt: go");
        let mut now = t0;
        let mut pauses = Vec::new();
        for _ in 0..6 {
            let answered = now + ms(700);
            let at = g.looked(now, answered).expect("slow: held");
            let held = at - answered;
            pauses.push(g.pause);
            assert!(held >= g.pause / 2 && held <= g.pause * 3 / 2, "{held:?}");
            now = at;
        }
        assert_eq!(
            pauses,
            [ms(700), ms(1400), ms(2800), ms(2800), ms(2800), ms(2800)]
        );
        assert_eq!(g.looked(now, now + ms(10)), None, "prompt again: go");
    }

    /// A node whose looks are each just over the target (a spike as likely as a lag)
    /// waits a few latencies at most, where doubled pauses held a 15,000-node crowd's
    /// last nodes 33 s with etcd idle (docs/bench/agents-scale.md); one that etcd answers
    /// seconds late still backs off to the longest.
    #[test]
    fn a_node_whose_looks_are_just_slow_is_held_for_a_few_latencies_at_most() {
        let mut g = Gate::new("n1", TTL);
        let mut now = Instant::now();
        for _ in 0..8 {
            let answered = now + ms(600);
            let at = g.looked(now, answered).expect("slow: held");
            let most = ms(600) * LATENCIES_HELD * 3 / 2;
            assert!(at - answered <= most, "{:?}", at - answered);
            now = at;
        }
        let mut g = Gate::new("n2", TTL);
        let mut now = Instant::now();
        for _ in 0..4 {
            let answered = now + ms(3_000);
            now = g.looked(now, answered).expect("slow: held");
        }
        assert_eq!(g.pause, TTL * 2, "seconds late: the longest pause");
    }

    /// Two nodes held by the same slow answer look again at different moments: a crowd
    /// held together does not come back together.
    #[test]
    fn nodes_held_together_look_again_apart() {
        let t0 = Instant::now();
        let at: std::collections::BTreeSet<Instant> = (0..50)
            .map(|i| {
                let mut g = Gate::new(&format!("node-{i}"), TTL);
                g.looked(t0, t0 + ms(900)).expect("held")
            })
            .collect();
        assert!(at.len() > 45, "{} distinct moments of 50", at.len());
    }

    #[test]
    fn fast_answers_never_hold_a_request() {
        let mut a = Admission::new("n1", TTL);
        let t0 = Instant::now();
        for i in 0..10 {
            let sent = t0 + ms(100 * i);
            a.answered(sent, sent + ms(20));
            assert_eq!(a.wait(sent + ms(20)), None);
        }
    }

    #[test]
    fn slow_answers_pause_the_next_request_around_the_latency_seen_and_double() {
        let mut a = Admission::new("n1", TTL);
        let t0 = Instant::now();
        a.answered(t0, t0 + ms(800));
        assert_eq!(a.pause(), ms(800));
        let at = a.wait(t0 + ms(800)).expect("held");
        let held = at - (t0 + ms(800));
        assert!(held >= ms(400) && held <= ms(1200), "{held:?}");
        a.answered(t0, t0 + ms(900));
        assert_eq!(a.pause(), ms(1600));
        // Never past half a TTL.
        for _ in 0..10 {
            a.answered(t0, t0 + ms(900));
        }
        assert_eq!(a.pause(), TTL / 2);
    }

    #[test]
    fn fast_answers_halve_the_pause_down_to_none() {
        let mut a = Admission::new("n1", TTL);
        let t0 = Instant::now();
        a.answered(t0, t0 + ms(1000));
        let mut now = t0 + ms(1000);
        let mut halvings = 0;
        while !a.pause().is_zero() {
            a.answered(now, now + ms(5));
            now += ms(5);
            halvings += 1;
        }
        assert_eq!(halvings, 7, "1 s halved to below 10 ms");
        assert_eq!(a.wait(now), None);
    }

    #[test]
    fn a_refusal_waits_at_least_the_sessions_backoff_and_grows_the_pause() {
        let mut a = Admission::new("n1", TTL);
        let t0 = Instant::now();
        let at = a.refused(t0, t0 + ms(2), ms(100));
        assert!(at >= t0 + ms(102), "{:?}", at - t0);
        assert_eq!(a.pause(), ms(100));
        a.refused(t0, t0 + ms(2), ms(200));
        assert_eq!(a.pause(), ms(200));
        a.refused(t0, t0 + ms(2), ms(100));
        assert_eq!(a.pause(), ms(400));
    }

    #[test]
    fn a_crowd_draws_apart_and_each_node_draws_the_same_in_every_run() {
        let t0 = Instant::now();
        let draws = |seed: &str| {
            let mut a = Admission::new(seed, TTL);
            (0..5)
                .map(|_| a.refused(t0, t0, ms(100)) - t0)
                .collect::<Vec<_>>()
        };
        assert_eq!(draws("sim-00001"), draws("sim-00001"));
        let firsts: std::collections::BTreeSet<Duration> =
            (0..50).map(|i| draws(&format!("sim-{i:05}"))[1]).collect();
        assert!(firsts.len() > 40, "{} distinct of 50", firsts.len());
    }

    #[test]
    fn a_crowd_of_10000_is_spread_over_10_s_faster_first_and_a_run_of_1000_not_at_all() {
        assert_eq!(
            spread("sim-00001", 1_000, CROWD, JOINS_PER_SECOND),
            Duration::ZERO
        );
        let delays: Vec<Duration> = (0..10_000)
            .map(|i| spread(&format!("sim-{i:05}"), 10_000, CROWD, JOINS_PER_SECOND))
            .collect();
        assert!(delays.iter().all(|d| *d < Duration::from_secs(10)));
        // The rate falls from 1,300 a second to 700, by 60 a second each second.
        let per_second: Vec<usize> = (0..10)
            .map(|s| delays.iter().filter(|d| d.as_secs() == s).count())
            .collect();
        for (s, n) in per_second.iter().enumerate() {
            let want = 1_270 - 60 * s;
            assert!(n.abs_diff(want) <= 120, "second {s}: {n}, about {want}");
        }
        assert!(per_second[0] > per_second[9] + 400, "{per_second:?}");
        assert_eq!(
            spread("sim-00042", 10_000, CROWD, JOINS_PER_SECOND),
            spread("sim-00042", 10_000, CROWD, JOINS_PER_SECOND)
        );
    }

    #[test]
    fn the_taper_ends_where_an_even_spread_ends() {
        assert_eq!(tapered(0.0), 0.0);
        assert!((tapered(1.0) - 1.0).abs() < 1e-9);
        // Half the crowd is in before half the span: the first half goes faster.
        assert!(tapered(0.5) < 0.45, "{}", tapered(0.5));
        let mut x = 0.0;
        for i in 1..=100 {
            let next = tapered(f64::from(i) / 100.0);
            assert!(next > x);
            x = next;
        }
    }

    #[test]
    fn once_joined_nothing_is_held() {
        let mut a = Admission::new("n1", TTL);
        let t0 = Instant::now();
        a.answered(t0, t0 + ms(2000));
        assert!(a.wait(t0 + ms(2000)).is_some());
        a.ran_a_round();
        assert_eq!(a.wait(t0 + ms(2000)), None);
    }
}
