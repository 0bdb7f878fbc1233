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
//! Before that, in a run of more than [`CROWD`] nodes, a node waits its [`Turn`]: it
//! goes once the crowd made the registrations before its place, as etcd's revision
//! counts them, so the crowd comes to etcd as fast as etcd completes joins, whatever
//! etcd it is; then the [`Gate`] holds it while etcd's apply loop is behind.
//!
//! Pure: [`Admission::answered`], [`Admission::refused`], [`Admission::kept_alive`] and
//! [`Admission::lease_lost`] take what happened and say when the next paced request may
//! go; the machine holds requests until then. [`Turn::looked`] and [`Gate::looked`] do
//! the same for the handle's join before the grant (`handle.rs`) and the simulator's.

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
/// a crowd's node goes at its place in it at the latest, whatever its [`Turn`] says, and
/// the turn's looks are paced from it. Once it was the pace itself. Each join is two
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
/// latest its turn comes ([`Turn`]): none in a run of up to `crowd` nodes; in a larger
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

/// A crowd node's turn: when it may go to the gate and its grant, paced by how far the
/// crowd got, as etcd's revision says. A spread fixed in joins a second is etcd's pace on
/// one etcd only: 1,000 a second is what Debian's 3.4 takes on two cores, and a third
/// of what 3.5 takes there. Here node `k` of the crowd (its place times the run's size)
/// goes once `k - CROWD` registrations were made, so at most about [`CROWD`] joins are
/// under way, as fast as etcd completes them, whatever etcd it is; and at the latest at
/// its place in the fixed spread ([`spread`]), so it is never later than that (figures:
/// docs/bench/agents-scale.md, eighteenth section).
///
/// Registrations are a forming crowd's only writes that move etcd's revision (a grant
/// and a keep-alive do not), and every member runs in the same etcd, so the revision
/// counts them without a read of the registrations. Other writes count too (another
/// run's on a shared etcd, registrations made again after a lost lease): nodes then go
/// earlier, and the [`Gate`] holds them while etcd is behind. The count starts at the
/// coordinator key's create revision: the coordinator is one of the crowd's first
/// [`CROWD`] (`waiting.rs`), which go at once, and its key is written among their first
/// registrations, so the count is late by those before it: fewer joins under way than
/// [`CROWD`], never more (counted half a crowd earlier, up to 1,500 under way, etcd 3.4
/// formed 10,000 nodes in 17–20 s in two runs of five, the gate holding up to 1,768 for
/// 10 s). Were the key written after all of the first, a turn would come at its place in
/// the spread, as before turns.
///
/// A node's first look is itself spread, four times faster than the fixed spread, so
/// that a crowd's connections do not open in one instant; it reads the coordinator key
/// (serializable: no wait for the apply loop), the later looks ask etcd's status (its
/// revision, answered from memory), each when 70% of the wait the pace seen so far
/// predicts has passed. A run whose formation is over (its revision far past the count)
/// lets a node that joins it go at its first look. A look etcd does not answer is no
/// turn ([`Turn::unanswered`]).
///
/// Pure: [`Turn::first_look`], [`Turn::looked`] and [`Turn::unanswered`] say when to
/// look and whether to go.
#[derive(Debug, Clone)]
pub struct Turn {
    /// This node's place, in nodes: its place in the crowd times the run's size.
    ticket: f64,
    /// How many joins may be under way ([`CROWD`] at the agent's scale).
    window: f64,
    /// The fixed spread's rate, joins a second (the looks' pace derives from it).
    per_second: f64,
    started: Instant,
    /// Its place in the fixed spread: it goes then whatever its looks said.
    latest: Instant,
    /// The revision the crowd's count starts at, once the coordinator key was seen.
    base: Option<i64>,
    looks: u32,
}

/// A turn's first look comes this many times faster than the fixed spread.
const FIRST_LOOKS_FASTER: f64 = 4.0;
/// The slowest pace a turn assumes, as a fraction of the fixed spread's rate: a crowd
/// that made nothing yet is looked at again soon, not in minutes.
const SLOWEST_PACE: f64 = 0.2;
/// A node looks again when this much of the wait its pace predicts has passed: a crowd
/// speeds up as etcd gets to its joins, and nodes that slept the whole prediction left
/// etcd idle with their turns come (a 10,000-node crowd against a model etcd of 2,500
/// joins a second formed in 5.7 s, 2.7 looks a node; with this, 4.3 s and 3.1; with
/// waits also capped at the first look's distance from the start, 4.0 s and 3.6).
const LOOK_AHEAD: f64 = 0.7;
/// Looks come at least this far apart.
const LOOKS_APART: Duration = Duration::from_millis(100);

impl Turn {
    /// The turn of node `node_id`, which started at `started`, in a run of at most
    /// `max_nodes`: `None` when it goes at once (not a crowd, or one of its first
    /// [`CROWD`], or admission switched off).
    pub fn new(node_id: &str, max_nodes: u32, started: Instant) -> Option<Self> {
        Self::scaled(node_id, max_nodes, started, CROWD, JOINS_PER_SECOND)
    }

    /// [`Turn::new`] with the crowd (and window) and the fixed spread's rate given (the
    /// simulator runs them scaled down).
    pub fn scaled(
        node_id: &str,
        max_nodes: u32,
        started: Instant,
        crowd: u32,
        per_second: u32,
    ) -> Option<Self> {
        if !a_crowd(max_nodes, crowd) {
            return None;
        }
        let ticket = place_in_crowd(node_id) * f64::from(max_nodes);
        let window = f64::from(crowd);
        (ticket > window).then(|| Self {
            ticket,
            window,
            per_second: f64::from(per_second.max(1)),
            started,
            latest: started + spread(node_id, max_nodes, crowd, per_second),
            base: None,
            looks: 0,
        })
    }

    /// When to look first: the node's place at four times the fixed spread's rate.
    pub fn first_look(&self) -> Instant {
        let ahead = (self.ticket - self.window) / (FIRST_LOOKS_FASTER * self.per_second);
        (self.started + Duration::from_secs_f64(ahead)).min(self.latest)
    }

    /// Whether the next look must read the coordinator key (the count's start is not
    /// known yet), or may ask etcd's status alone.
    pub fn needs_start(&self) -> bool {
        self.base.is_none()
    }

    /// The latest moment of this turn: its place in the fixed spread.
    pub fn latest(&self) -> Instant {
        self.latest
    }

    /// Looks so far.
    pub fn looks(&self) -> u32 {
        self.looks
    }

    /// A look sent at `sent` came back unanswered at `now` (an error, or no answer in
    /// time): etcd is busy or away, which is no time to add a join. `None` at the turn's
    /// latest moment (the gate is next, which waits for etcd as a join does), or when to
    /// look again: as long after as the look took, at least 100 ms.
    pub fn unanswered(&mut self, sent: Instant, now: Instant) -> Option<Instant> {
        self.looks += 1;
        if now >= self.latest {
            return None;
        }
        let wait = now.saturating_duration_since(sent).max(LOOKS_APART);
        Some((now + wait).min(self.latest))
    }

    /// A look at `now` found etcd at `revision`, and the coordinator key created at
    /// `coordinator` (when the look read it and it was there): `None` to go on to the
    /// gate, or when to look again.
    pub fn looked(
        &mut self,
        now: Instant,
        revision: i64,
        coordinator: Option<i64>,
    ) -> Option<Instant> {
        self.looks += 1;
        if self.base.is_none() {
            self.base = coordinator;
        }
        if now >= self.latest {
            return None;
        }
        let slowest = SLOWEST_PACE * self.per_second;
        let elapsed = now.saturating_duration_since(self.started).as_secs_f64();
        let (left, rate) = match self.base {
            Some(base) => {
                let made = (revision - base).max(0) as f64;
                let left = self.ticket - self.window - made;
                if left <= 0.0 {
                    return None;
                }
                (left, (made / elapsed.max(0.1)).max(slowest))
            }
            // No coordinator yet: the crowd's first have not registered; again after
            // 70% of the first look's distance from the start (at least 100 ms).
            None => (
                self.ticket - self.window,
                FIRST_LOOKS_FASTER * self.per_second,
            ),
        };
        // Never longer than the first look's distance from the start: a crowd that has
        // made little yet (its pace the slowest) may speed up at any moment.
        let first = (self.ticket - self.window) / (FIRST_LOOKS_FASTER * self.per_second);
        let wait = Duration::from_secs_f64((left / rate * LOOK_AHEAD).min(first)).max(LOOKS_APART);
        Some((now + wait).min(self.latest))
    }
}

/// The gate before a crowd's grant. A node's turn says the registrations before it were
/// made, not whether etcd can take one more now (and a turn that came at its place in
/// the fixed spread, [`JOINS_PER_SECOND`], says less): etcd's
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

    /// A run of up to a crowd, and a crowd's first [`CROWD`], go at once; the others
    /// look first at their place at four times the fixed spread's rate, never after
    /// their place in it.
    #[test]
    fn only_a_crowds_nodes_past_the_window_wait_their_turn() {
        let t0 = Instant::now();
        assert!(Turn::new("sim-00001", 1_000, t0).is_none());
        let turns: Vec<Turn> = (0..10_000)
            .filter_map(|i| Turn::new(&format!("sim-{i:05}"), 10_000, t0))
            .collect();
        assert!(turns.len().abs_diff(9_000) < 200, "{}", turns.len());
        for t in &turns {
            let first = t.first_look() - t0;
            let want = Duration::from_secs_f64((t.ticket - t.window) / 4_000.0);
            assert!(first.abs_diff(want) < ms(1), "{first:?} {want:?}");
            assert!(t.first_look() <= t.latest && t.needs_start());
        }
    }

    /// Node `k` goes once the revision moved `k - CROWD` past the count's start (the
    /// coordinator key's creation); before, it looks again when 70% of the wait the pace
    /// seen so far predicts has passed (at most as long as its first look waited), at least 100 ms on and never after its place in the
    /// spread, where it goes whatever it saw.
    #[test]
    fn a_turn_comes_when_the_crowd_made_its_registrations() {
        let t0 = Instant::now();
        // A node late in the crowd.
        let late = |t0| {
            (0..)
                .filter_map(|i| Turn::new(&format!("sim-{i:05}"), 10_000, t0))
                .find(|t| t.ticket > 9_000.0)
                .expect("a late node")
        };
        let mut t = late(t0);
        let (k, w) = (t.ticket, t.window);
        // The count starts at the coordinator key's creation.
        let (coordinator, base) = (100, 100);
        // At 1 s, 2,000 registrations made: its turn needs k - 1,000.
        let now = t0 + Duration::from_secs(1);
        let made = 2_000.0;
        let at = t.looked(now, base + made as i64, Some(coordinator));
        assert!(!t.needs_start());
        // 70% of the wait the pace predicts (2,000 a second so far), at most the first
        // look's distance from the start.
        let first = (k - w) / 4_000.0;
        let want = Duration::from_secs_f64(((k - w - made) / 2_000.0 * 0.7).min(first));
        let want = (now + want).min(t.latest);
        assert_eq!(
            at.map(|a| a.duration_since(t0).as_millis()),
            Some(want.duration_since(t0).as_millis())
        );
        // Status looks after that: the revision alone.
        let now = at.unwrap();
        assert_eq!(
            t.looked(now, base + (k - w) as i64 + 1, None),
            None,
            "its turn"
        );
        assert_eq!(t.looks(), 2);
        // A crowd that made nothing: looked at again at the slowest pace, and at its
        // place in the spread it goes.
        let mut t = late(t0);
        let mut now = t.first_look();
        let mut looks = 0;
        while let Some(at) = t.looked(now, 50, Some(100)) {
            assert!(at > now && at <= t.latest, "{:?}", at - now);
            assert!(at - now >= ms(100) || at == t.latest);
            now = at;
            looks += 1;
        }
        assert_eq!(now, t.latest);
        assert!(looks < 10, "{looks} looks");
    }

    /// A look etcd did not answer is no turn: the node looks again as long after as the
    /// look took (at least 100 ms), until its place in the spread.
    #[test]
    fn an_unanswered_look_is_no_turn() {
        let t0 = Instant::now();
        let mut t = Turn::new("sim-05000", 10_000, t0).expect("waits");
        let sent = t.first_look();
        let again = t.unanswered(sent, sent + ms(2_000)).expect("looks again");
        assert_eq!(again, (sent + ms(4_000)).min(t.latest));
        let again = t.unanswered(sent, sent + ms(10)).expect("looks again");
        assert_eq!(again, (sent + ms(110)).min(t.latest));
        assert_eq!(
            t.unanswered(t.latest, t.latest),
            None,
            "its latest: on to the gate"
        );
        assert!(t.needs_start());
    }

    /// Before the coordinator key is there nothing is counted: the node looks again
    /// (reading the key again), and a run long formed lets it go at its first look.
    #[test]
    fn no_coordinator_yet_is_no_count_and_a_formed_run_is_no_wait() {
        let t0 = Instant::now();
        let mut t = Turn::new("sim-05000", 10_000, t0).expect("waits");
        let first = t.first_look();
        let again = t.looked(first, 7, None).expect("looks again");
        assert!(t.needs_start() && again > first && again <= t.latest);
        let mut t = Turn::new("sim-05000", 10_000, t0).expect("waits");
        assert_eq!(t.looked(first, 1_000_000, Some(12)), None);
    }

    /// A crowd of 10,000 pacing itself by its turns against an etcd that completes 2,500
    /// joins a second (a join completes 50 ms after it was sent, once etcd gets to it):
    /// it forms about as fast as etcd takes joins, never with much more than a window and
    /// a half under way, and with a few looks a node.
    #[test]
    fn a_crowd_by_its_turns_goes_at_etcds_pace_a_window_under_way() {
        let t0 = Instant::now();
        let n = 10_000;
        let step = ms(5);
        let (rate, latency) = (2_500.0, ms(50));
        let mut waiting: Vec<(Instant, Turn)> = Vec::new();
        let mut queue: std::collections::VecDeque<Instant> = Default::default();
        for i in 0..n {
            match Turn::new(&format!("sim-{i:05}"), n as u32, t0) {
                Some(t) => waiting.push((t.first_look(), t)),
                None => queue.push_back(t0),
            }
        }
        let (mut made, mut coordinator, mut credit) = (0i64, None, 0.0);
        let (mut most_under_way, mut looks) = (0, 0);
        let mut now = t0;
        while made < n as i64 {
            now += step;
            credit += rate * step.as_secs_f64();
            while credit >= 1.0 && queue.front().is_some_and(|sent| *sent + latency <= now) {
                queue.pop_front();
                credit -= 1.0;
                made += 1;
                if made == 300 {
                    coordinator = Some(made);
                }
            }
            credit = credit.min(1.0);
            let mut still = Vec::new();
            for (at, mut t) in waiting.drain(..) {
                if at > now {
                    still.push((at, t));
                    continue;
                }
                let seen = if t.needs_start() { coordinator } else { None };
                match t.looked(now, made, seen) {
                    Some(next) => still.push((next, t)),
                    None => {
                        looks += t.looks();
                        queue.push_back(now);
                    }
                }
            }
            waiting = still;
            most_under_way = most_under_way.max(queue.len());
        }
        let took = (now - t0).as_secs_f64();
        assert!(took < n as f64 / rate * 1.15, "formed in {took:.2} s");
        assert!(most_under_way < 1_700, "{most_under_way} under way");
        let per_node = f64::from(looks) / 9_000.0;
        assert!(per_node < 4.0, "{per_node:.2} looks a node");
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
