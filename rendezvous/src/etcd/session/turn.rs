//! A crowd's turns, pushed by its coordinator. In a run of more than [`CROWD`] nodes a
//! node past the crowd's first [`CROWD`] waits its [`Turn`] before it grants a lease:
//! until the coordinator says the crowd got far enough, or at the latest until its place
//! in the fixed spread ([`spread`]).
//!
//! The coordinator sees every registration and times its own writes, so it alone decides
//! how far the crowd may go ([`Frontier`]): registrations made plus the joins it lets be
//! under way, which shrink while etcd answers its writes late and grow back while it
//! answers them promptly. It publishes that reach as one key of [`ADMISSION_KEYS`] under
//! `admit/` (each stands for an equal slice of the crowd's places), and a waiting node
//! watches the keys from its own to the last: the first put there is its turn. Each
//! node so gets one event, whatever the crowd's size, and etcd serves the crowd's
//! waiting with one read and one watch a node, where nodes that looked for themselves
//! asked it their count again and again (the revision's, then the gate's read of the
//! apply loop: at 20,000 nodes 1,700–2,450 linearizable reads a second, the load that
//! kept etcd too slow to let them in; docs/bench/agents-scale.md, twentieth section).
//!
//! A node whose turn came by the push goes straight to its grant (the coordinator's
//! writes already said etcd keeps up); one whose place in the spread came first, the
//! coordinator away or slow, goes through the [`super::Gate`] as before. A crowd smaller
//! than its maximum is counted by the places of its registrations ([`Frontier`]).
//!
//! Pure: [`Turn`] says which key a node waits for and until when; [`Frontier::due`],
//! [`Frontier::answered`] and [`Frontier::failed`] say what the coordinator publishes
//! and when. The machine's part is in `admit.rs`, the handle's in `handle.rs`
//! (`await_turn`).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::admission::{CROWD, JOINS_PER_SECOND, a_crowd, place_in_crowd, spread};

/// How many keys a crowd's reach is published in: a put to one wakes the nodes whose
/// places are in its slice and every slice before it still waiting, each node once.
pub const ADMISSION_KEYS: u32 = 200;

/// A turn's first look comes this many times faster than the fixed spread: a crowd's
/// reads and watches do not all open in one instant.
const FIRST_LOOKS_FASTER: f64 = 4.0;

/// A turn comes at the latest at its place in the fixed spread slowed this many times:
/// the coordinator's push is the way on, and a crowd whose nodes went at their places
/// (1,000 a second, faster than two cores' etcd completes joins with its keep-alives
/// beside them) waited at the gate, each node reading again and again. The latest is for
/// a crowd without a coordinator yet, or one that no longer writes.
const LATEST_SLOWER: f64 = 3.0;

/// The places one admission key stands for in a run of at most `max_nodes`.
fn per_key(max_nodes: u32) -> u32 {
    max_nodes.div_ceil(ADMISSION_KEYS).max(1)
}

/// The last admission key of a run of at most `max_nodes`: every place is in.
fn last_key(max_nodes: u32) -> u32 {
    max_nodes.div_ceil(per_key(max_nodes))
}

/// A crowd node's turn: the admission key whose put (or any later key's) lets it go, and
/// the moment it goes whatever it saw.
#[derive(Debug, Clone)]
pub struct Turn {
    key: u32,
    first_look: Instant,
    latest: Instant,
}

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
        let place = place_in_crowd(node_id) * f64::from(max_nodes);
        let ahead = place - f64::from(crowd);
        if ahead <= 0.0 {
            return None;
        }
        let latest = started + spread(node_id, max_nodes, crowd, per_second).mul_f64(LATEST_SLOWER);
        let first = ahead / (FIRST_LOOKS_FASTER * f64::from(per_second.max(1)));
        let key = admission_key(node_id, max_nodes);
        Some(Self {
            key,
            first_look: (started + Duration::from_secs_f64(first)).min(latest),
            latest,
        })
    }

    /// When to read the admission keys first (and watch them if this node's is not put).
    pub fn first_look(&self) -> Instant {
        self.first_look
    }

    /// Its place in the fixed spread: it goes then whatever it saw.
    pub fn latest(&self) -> Instant {
        self.latest
    }

    /// The admission key it waits for: a put to it or to any later one is its turn.
    pub fn key(&self) -> u32 {
        self.key
    }

    /// Whether admission key `put` lets it go.
    #[cfg(test)]
    pub fn admitted_by(&self, put: u32) -> bool {
        put >= self.key
    }
}

/// The admission key whose put (or any later one's) lets node `node_id` of a run of at
/// most `max_nodes` go: its turn's, and, for one of the crowd's first places, what ends
/// its hold at the gate.
pub fn admission_key(node_id: &str, max_nodes: u32) -> u32 {
    let place = place_in_crowd(node_id) * f64::from(max_nodes);
    ((place / f64::from(per_key(max_nodes))).ceil() as u32).min(last_key(max_nodes))
}

/// Admission keys are written at least this far apart.
const SPACING: Duration = Duration::from_millis(100);

/// After a failed write the next waits this long.
const AFTER_FAILURE: Duration = Duration::from_secs(1);

/// The coordinator's reach for a forming crowd: how many of its places may have gone
/// ([`Turn`]), published one admission key at a time, one write in flight, at least
/// [`SPACING`] apart. The reach is the registrations made plus the joins allowed under
/// way, in places: [`CROWD`] while etcd answers the coordinator's writes within a
/// twentieth of the TTL; halved (down to one key's slice) at each write answered later
/// than a tenth of it (etcd answers a write once it applied it, so a late answer is an
/// apply loop behind, the loop keep-alives wait on); grown back by a quarter of [`CROWD`]
/// at each prompt one; held between the two. (Halved only past a fifth of the TTL, 4,000
/// nodes with a TTL of 3 s on etcd 3.4 went faster to the seal and collapsed there in
/// three runs of four: the crowd left etcd no room for the seal's own load.)
///
/// A crowd smaller than the run's maximum has fewer nodes than places: the registrations
/// made among the places let go a TTL ago or more say how many a place holds (each
/// node's place is a draw from its id, which the coordinator sees), and the reach is
/// widened by as much, so that such a crowd goes at etcd's pace too, not at its places'
/// in the fixed spread. Once the run has had a round every
/// place is in: nodes that come later (a node replaced, the crowd's stragglers) do not
/// wait.
#[derive(Debug)]
pub struct Frontier {
    max_nodes: u32,
    per_key: u32,
    last_key: u32,
    window: u32,
    allowed: u32,
    prompt: Duration,
    late: Duration,
    /// Places let go this long ago or more tell how many nodes a place holds.
    settled: Duration,
    /// The reaches written, with when: the newest one settled and those after it.
    reached: VecDeque<(Instant, f64)>,
    /// The highest key written.
    published: u32,
    /// The key in flight and when it was sent.
    in_flight: Option<(u32, Instant)>,
    /// No write before this.
    not_before: Option<Instant>,
    /// The last look that found no key due: the next is [`SPACING`] after it. A look
    /// takes every registration's place (a hash of each node id), and the coordinator
    /// looks after every batch of events it watches: at 10,000 nodes, hundreds of looks
    /// a second over up to 10,000 places, 4% of the CPU of the bench's 10,000 nodes, all
    /// of it on the coordinator's own task.
    looked: Option<Instant>,
    /// When to look again: a key was due while the writes had to stay apart.
    wake: Option<Instant>,
}

/// The fewest nodes a place is taken to hold: a crowd of a tenth of its maximum or less
/// goes at the pace of one of a tenth.
const FEWEST_A_PLACE: f64 = 0.1;

impl Frontier {
    /// The reach of a run of at most `max_nodes` with lease TTL `ttl`: none unless a crowd.
    #[cfg(test)]
    pub fn new(max_nodes: u32, ttl: Duration) -> Option<Self> {
        Self::scaled(max_nodes, ttl, CROWD)
    }

    /// The reach of a run of at most `max_nodes` with lease TTL `ttl` whose first `crowd`
    /// nodes go at once (the agent's [`CROWD`], the simulator's scaled down): none unless
    /// a crowd.
    pub fn scaled(max_nodes: u32, ttl: Duration, crowd: u32) -> Option<Self> {
        a_crowd(max_nodes, crowd).then(|| Self {
            max_nodes,
            per_key: per_key(max_nodes),
            last_key: last_key(max_nodes),
            window: crowd,
            allowed: crowd,
            prompt: ttl / 20,
            late: ttl / 10,
            settled: ttl,
            reached: VecDeque::new(),
            published: 0,
            in_flight: None,
            not_before: None,
            looked: None,
            wake: None,
        })
    }

    /// Whether a key may be written at `now` (none in flight, the last far enough back,
    /// not all written): the registrations' places are needed only then.
    pub fn ready(&mut self, now: Instant) -> bool {
        self.wake = None;
        if self.in_flight.is_some() || self.published >= self.last_key {
            return false;
        }
        let next_look = self.looked.map(|at| at + SPACING);
        if let Some(at) = self.not_before.max(next_look).filter(|at| *at > now) {
            self.wake = Some(at);
            return false;
        }
        true
    }

    /// The key to write at `now`, if one is due ([`Frontier::ready`] said so): `places`
    /// are the registrations' places in the crowd ([`place_in_crowd`] times the run's
    /// size), and `formed` says the run has had a round.
    pub fn due(&mut self, now: Instant, places: &[f64], formed: bool) -> Option<u32> {
        if !self.ready(now) {
            return None;
        }
        let reach = if formed {
            f64::INFINITY
        } else {
            (places.len() as f64 + f64::from(self.allowed)) / self.a_place_holds(now, places)
        };
        let key = if reach >= f64::from(self.max_nodes) {
            self.last_key
        } else {
            (reach / f64::from(self.per_key)) as u32
        };
        if key <= self.published {
            self.looked = Some(now);
            return None;
        }
        self.looked = None;
        self.reached.push_back((now, reach));
        self.in_flight = Some((key, now));
        Some(key)
    }

    /// How many nodes a place holds, from the places let go a TTL ago or more: 1 until
    /// a reach past the first [`CROWD`] settled.
    fn a_place_holds(&mut self, now: Instant, places: &[f64]) -> f64 {
        let settled = |at: &Instant| now.saturating_duration_since(*at) >= self.settled;
        while self.reached.len() > 1 && self.reached.get(1).is_some_and(|(at, _)| settled(at)) {
            self.reached.pop_front();
        }
        let Some(&(at, upto)) = self.reached.front() else {
            return 1.0;
        };
        if !settled(&at) || upto <= f64::from(self.window) {
            return 1.0;
        }
        let upto = upto.min(f64::from(self.max_nodes));
        let made = places.iter().filter(|p| **p <= upto).count() as f64;
        (made / upto).clamp(FEWEST_A_PLACE, 1.0)
    }

    /// The write in flight was answered at `now`.
    pub fn answered(&mut self, now: Instant) {
        let Some((key, sent)) = self.in_flight.take() else {
            return;
        };
        self.published = self.published.max(key);
        let latency = now.saturating_duration_since(sent);
        if latency > self.late {
            self.allowed = (self.allowed / 2).max(self.per_key);
        } else if latency <= self.prompt {
            self.allowed = (self.allowed + self.window / 4).min(self.window);
        }
        self.not_before = Some(now + SPACING);
    }

    /// This node's keep-alive sent at `sent` was answered at `now`. etcd 3.4 renews a
    /// lease only once its apply loop caught up, so a late renewal is a loop behind even
    /// while writes are answered in time (on 3.4 the coordinator's writes came back within
    /// a second while a crowd's keep-alives were late enough to ask etcd about their
    /// leases, thousands of times). The joins under way halve, as after a late write.
    pub fn kept_alive(&mut self, sent: Instant, now: Instant) {
        if now.saturating_duration_since(sent) > self.late {
            self.allowed = (self.allowed / 2).max(self.per_key);
        }
    }

    /// The write in flight failed at `now`: etcd is in trouble, which is no time to let
    /// more in.
    pub fn failed(&mut self, now: Instant) {
        self.in_flight = None;
        self.allowed = (self.allowed / 2).max(self.per_key);
        self.not_before = Some(now + AFTER_FAILURE);
    }

    /// Not coordinating now: nothing to look again for.
    pub fn idle(&mut self) {
        self.wake = None;
    }

    /// When the machine should look again, if a key waits for its writes to be apart.
    pub fn wake(&self) -> Option<Instant> {
        self.wake
    }

    /// The joins allowed under way now.
    #[cfg(test)]
    fn allowed(&self) -> u32 {
        self.allowed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(5);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// The places of `n` registrations of a crowd as large as its maximum.
    fn placed(n: usize) -> Vec<f64> {
        (0..n).map(|i| i as f64).collect()
    }

    /// A run of up to a crowd, and a crowd's first [`CROWD`], go at once; the others
    /// look first at their place at four times the fixed spread's rate, never after
    /// their place in it, and wait for the key of their slice.
    #[test]
    fn only_a_crowds_nodes_past_the_window_wait_for_their_key() {
        let t0 = Instant::now();
        assert!(Turn::new("sim-00001", 1_000, t0).is_none());
        let turns: Vec<Turn> = (0..10_000)
            .filter_map(|i| Turn::new(&format!("sim-{i:05}"), 10_000, t0))
            .collect();
        assert!(turns.len().abs_diff(9_000) < 200, "{}", turns.len());
        for t in &turns {
            assert!(t.first_look() <= t.latest());
            assert!(t.first_look() - t0 <= Duration::from_secs_f64(9_000.0 / 4_000.0));
            // 50 places a key: past the first 1,000 places, keys 21 to 200.
            assert!((21..=200).contains(&t.key()), "{}", t.key());
            assert!(t.admitted_by(t.key()) && t.admitted_by(200) && !t.admitted_by(t.key() - 1));
        }
        let keys: std::collections::BTreeSet<u32> = turns.iter().map(Turn::key).collect();
        assert_eq!(keys.len(), 180, "every slice past the first 1,000 places");
    }

    /// The reach is the registrations made plus a crowd under way; a key is written only
    /// when the reach passes the last one written, one at a time and 100 ms apart, and
    /// the machine is woken when the spacing ends.
    #[test]
    fn the_reach_is_the_registrations_made_and_a_crowd_under_way() {
        let mut f = Frontier::new(10_000, TTL).expect("a crowd");
        let t0 = Instant::now();
        assert_eq!(
            f.due(t0, &placed(0), false),
            Some(20),
            "1,000 places: key 20"
        );
        assert_eq!(f.due(t0, &placed(500), false), None, "one write in flight");
        f.answered(t0 + ms(20));
        assert_eq!(f.due(t0 + ms(30), &placed(40), false), None, "apart");
        assert_eq!(
            f.wake(),
            Some(t0 + ms(120)),
            "looked at again when writes may go"
        );
        assert_eq!(f.due(t0 + ms(50), &placed(600), false), None, "apart");
        assert_eq!(f.wake(), Some(t0 + ms(120)));
        assert_eq!(f.due(t0 + ms(120), &placed(600), false), Some(32));
        assert_eq!(f.wake(), None);
        f.answered(t0 + ms(150));
        assert_eq!(
            f.due(t0 + ms(300), &placed(9_100), false),
            Some(200),
            "all in"
        );
        f.answered(t0 + ms(320));
        assert_eq!(
            f.due(t0 + ms(500), &placed(10_000), true),
            None,
            "nothing past the last key"
        );
    }

    /// A look that finds no key due (the coordinator looks after every batch of events)
    /// is made again only a spacing later, and the machine is woken for it: each look
    /// hashes every registration's node id.
    #[test]
    fn a_look_that_finds_nothing_due_waits_a_spacing_for_the_next() {
        let mut f = Frontier::new(10_000, TTL).expect("a crowd");
        let t0 = Instant::now();
        assert_eq!(f.due(t0, &placed(0), false), Some(20));
        f.answered(t0 + ms(10));
        assert_eq!(f.due(t0 + ms(200), &placed(10), false), None, "nothing new");
        assert_eq!(f.wake(), None);
        assert_eq!(f.due(t0 + ms(250), &placed(600), false), None, "too soon");
        assert_eq!(f.wake(), Some(t0 + ms(300)));
        assert_eq!(f.due(t0 + ms(300), &placed(600), false), Some(32));
    }

    /// Writes answered later than a tenth of the TTL halve the joins under way (down to
    /// one key's slice); prompt ones (a twentieth) grow them back by a quarter crowd; in
    /// between they hold.
    #[test]
    fn late_writes_shrink_the_crowd_under_way_and_prompt_ones_grow_it_back() {
        let mut f = Frontier::new(10_000, TTL).expect("a crowd");
        let mut now = Instant::now();
        // A thousand registrations more at each write, so that each has a key to write.
        let mut seen = Vec::new();
        for (i, latency) in [1_500, 1_500, 1_500, 1_500, 1_500, 400, 20, 20, 20, 20]
            .into_iter()
            .enumerate()
        {
            now += ms(200);
            f.due(now, &placed(1_000 * (i + 1)), false)
                .expect("a key due");
            now += ms(latency);
            f.answered(now);
            seen.push(f.allowed());
        }
        assert_eq!(seen, [500, 250, 125, 62, 50, 50, 300, 550, 800, 1_000]);
    }

    /// A failed write lets nothing more in for a second and halves the joins under way.
    #[test]
    fn a_failed_write_holds_the_reach() {
        let mut f = Frontier::new(10_000, TTL).expect("a crowd");
        let t0 = Instant::now();
        assert_eq!(f.due(t0, &placed(0), false), Some(20));
        f.failed(t0 + ms(5));
        assert_eq!(f.allowed(), 500);
        assert_eq!(f.due(t0 + ms(500), &placed(100), false), None);
        assert_eq!(f.wake(), Some(t0 + ms(1_005)));
        assert_eq!(f.due(t0 + ms(1_005), &placed(100), false), Some(12));
    }

    /// A run that had a round lets every place in at once; a run that is no crowd has no
    /// reach to publish.
    #[test]
    fn a_formed_run_lets_everyone_in_and_a_small_run_has_no_reach() {
        let mut f = Frontier::new(20_000, TTL).expect("a crowd");
        assert_eq!(f.due(Instant::now(), &placed(3), true), Some(200));
        assert!(Frontier::new(1_000, TTL).is_none());
        // Keys for a size that does not divide evenly: the last one covers the end.
        assert_eq!((per_key(10_001), last_key(10_001)), (51, 197));
    }

    /// A crowd of `present` nodes in a run of at most `max` pushed by their coordinator,
    /// against a model etcd that completes `rate` joins a second (each 50 ms after it
    /// was sent, once etcd gets to it) and answers the coordinator's writes within 20 ms:
    /// how long it took to register them all, and the most joins under way at once.
    fn model(present: u32, max: u32, rate: f64) -> (f64, usize) {
        let t0 = Instant::now();
        let step = ms(5);
        let latency = ms(50);
        let place = |i: u32| place_in_crowd(&format!("sim-{i:05}")) * f64::from(max);
        let mut waiting: Vec<(u32, Turn)> = Vec::new();
        let mut queue: VecDeque<(Instant, u32)> = Default::default();
        for i in 0..present {
            match Turn::new(&format!("sim-{i:05}"), max, t0) {
                Some(t) => waiting.push((i, t)),
                None => queue.push_back((t0, i)),
            }
        }
        let mut f = Frontier::new(max, TTL).expect("a crowd");
        let (mut places, mut credit, mut most_under_way) = (Vec::new(), 0.0, 0);
        let (mut published, mut answer_at) = (0u32, None);
        let mut now = t0;
        while places.len() < present as usize {
            now += step;
            credit += rate * step.as_secs_f64();
            while credit >= 1.0
                && queue
                    .front()
                    .is_some_and(|(sent, _)| *sent + latency <= now)
            {
                let (_, i) = queue.pop_front().expect("checked");
                credit -= 1.0;
                places.push(place(i));
            }
            credit = credit.min(1.0);
            if let Some((key, at)) = answer_at.filter(|(_, at)| *at <= now) {
                f.answered(at);
                published = key;
                answer_at = None;
            }
            if let Some(key) = f.due(now, &places, false) {
                answer_at = Some((key, now + ms(20)));
            }
            waiting.retain(|(i, t)| {
                let go = t.admitted_by(published) || t.latest() <= now;
                if go {
                    queue.push_back((now, *i));
                }
                !go
            });
            most_under_way = most_under_way.max(queue.len());
        }
        ((now - t0).as_secs_f64(), most_under_way)
    }

    /// A whole crowd of 10,000 forms about as fast as etcd takes joins, never with much
    /// more than a crowd under way.
    #[test]
    fn a_crowd_by_pushed_turns_goes_at_etcds_pace_a_crowd_under_way() {
        let (took, most) = model(10_000, 10_000, 2_500.0);
        assert!(took < 10_000.0 / 2_500.0 * 1.15, "formed in {took:.2} s");
        assert!(most < 1_300, "{most} under way");
    }

    /// A crowd of half its maximum goes at etcd's pace too once its first places
    /// settled (a TTL), not at its places in the slowed spread (30 s), and with no more
    /// under way than a whole one.
    #[test]
    fn a_crowd_smaller_than_its_maximum_goes_at_etcds_pace_once_its_places_settled() {
        let (took, most) = model(5_000, 10_000, 2_500.0);
        eprintln!("half: {took:.2} s, {most} under way");
        let ttl = TTL.as_secs_f64();
        assert!(
            took < ttl + 5_000.0 / 2_500.0 * 2.0,
            "formed in {took:.2} s"
        );
        assert!(most < 1_300, "{most} under way");
        let (took, _) = model(2_000, 10_000, 2_500.0);
        assert!(took < ttl * 2.0, "a fifth: formed in {took:.2} s");
    }
}
