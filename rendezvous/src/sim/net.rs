//! The network between the agents and the simulated etcd: ops that get through or time
//! out, keep-alives, lease expiry, and watch events delivered by revision, in order on each
//! stream.

use std::time::Instant;

use fsdp_proto::v1;
use fsdp_store::state::WatchSpec;

use super::agent::Watching;
use super::etcd::{APPLY_WAIT, Proposal, REQUEST_TIMEOUT, cut, prefix_end};
use super::world::{Ev, World};
use crate::etcd::session::{Answer, Compare, Input, Op, Role, WatchEvent, Write};

/// etcd's answer to a request it gave up on while overloaded.
fn timed_out() -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::unavailable("etcdserver: request timed out"))
}

/// etcd 3.4's answer to a linearizable read or renewal that waited too long for its apply
/// loop.
fn apply_wait() -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::unavailable(
        "etcdserver: request timed out, waiting for the applied index took too long",
    ))
}

/// etcd's refusal of a proposal while its apply loop is far behind.
fn too_many() -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::resource_exhausted(
        "etcdserver: too many requests",
    ))
}

/// How an op meets an etcd whose apply loop is behind.
enum Queued {
    /// Not through the apply loop: served as it comes.
    Served,
    /// A proposal: applied in its turn.
    Proposal,
    /// A linearizable read or a renewal: waits for the loop to catch up.
    Waits,
}

fn queued(op: &Op) -> Queued {
    match op {
        Op::Txn(_) | Op::Put(_) | Op::Grant { .. } | Op::Revoke { .. } | Op::Depart { .. } => {
            Queued::Proposal
        }
        Op::Range {
            serializable: false,
            ..
        }
        | Op::TimeToLive { .. }
        | Op::ReopenKeepAlive { .. } => Queued::Waits,
        _ => Queued::Served,
    }
}

/// A request etcd answers on its own (not a stream, not the connection's).
fn is_request(op: &Op) -> bool {
    // (The real driver's departure always answers: its errors are logged, not returned.)
    !matches!(
        op,
        Op::Watch { .. }
            | Op::KeepAlive
            | Op::ReopenKeepAlive { .. }
            | Op::PickEndpoint
            | Op::Depart { .. }
    )
}

fn op_name(op: &Op) -> &'static str {
    match op {
        Op::Range { .. } => "range",
        Op::Txn(_) => "txn",
        Op::Put(_) => "put",
        Op::Grant { .. } => "grant",
        Op::Revoke { .. } => "revoke",
        Op::TimeToLive { .. } => "time-to-live",
        Op::MemberCount => "member count",
        Op::Depart { .. } => "departure",
        Op::Watch { .. } | Op::KeepAlive | Op::ReopenKeepAlive { .. } | Op::PickEndpoint => {
            "stream op"
        }
    }
}

impl World {
    /// An op reaches etcd: carried out if it gets through, answered after the way back.
    pub fn arrive(&mut self, a: usize, process: u64, op: Op) {
        if self.agents[a].process != process || self.agents[a].machine.is_none() {
            return;
        }
        let now = self.now();
        let three = self.opts.three_members;
        if let Op::PickEndpoint = op {
            if let Some(up) = (0..3).find(|m| self.etcd.members_up[*m]) {
                self.agents[a].pinned = up;
            }
        }
        let through = !self.agents[a].cut && self.etcd.serves(now, self.agents[a].pinned, three);
        if !through {
            return self.refuse(a, process);
        }
        if self.etcd.queueing(now) {
            match queued(&op) {
                Queued::Served => {}
                Queued::Proposal => return self.propose(a, process, op, now),
                Queued::Waits => return self.wait_applied(a, process, op, now),
            }
        }
        let answer = if self.agents[a].slow && is_request(&op) && self.rng.chance(30) {
            self.time_out_overloaded(a, &op, now)
        } else {
            self.serve_op(a, &op, now)
        };
        let lat = self.latency(a);
        self.after(
            lat,
            Ev::Deliver {
                a,
                process,
                input: Input::Answer(answer.map_err(Into::into)),
            },
        );
        self.broadcast();
    }

    /// A proposal while the apply loop is behind: refused past its queue's bound;
    /// otherwise applied in its turn, and answered then, or "request timed out" if its
    /// turn is past the request timeout (applied anyway).
    fn propose(&mut self, a: usize, process: u64, op: Op, now: Instant) {
        let restarts = self.etcd.restarts;
        match self.etcd.propose(now) {
            Proposal::Refused => {
                self.note(|| format!("etcd: refuses n{a}'s {} (too many requests)", op_name(&op)));
                let lat = self.latency(a);
                let input = Input::Answer(Err(too_many().into()));
                self.after(lat, Ev::Deliver { a, process, input });
            }
            Proposal::At(at) => {
                let late = at - now > REQUEST_TIMEOUT && !matches!(op, Op::Depart { .. });
                if late {
                    let input = Input::Answer(Err(timed_out().into()));
                    let wait = REQUEST_TIMEOUT.as_millis() as u64;
                    self.after(wait, Ev::Deliver { a, process, input });
                }
                self.apply_at(at, a, process, op, restarts, !late);
            }
        }
    }

    /// A linearizable read or a renewal while the apply loop is behind: served once it
    /// caught up, or refused after [`APPLY_WAIT`].
    fn wait_applied(&mut self, a: usize, process: u64, op: Op, now: Instant) {
        let lag = self.etcd.lag(now);
        if lag > APPLY_WAIT {
            let input = Input::Answer(Err(apply_wait().into()));
            return self.after(
                APPLY_WAIT.as_millis() as u64,
                Ev::Deliver { a, process, input },
            );
        }
        let restarts = self.etcd.restarts;
        self.apply_at(now + lag, a, process, op, restarts, true);
    }

    /// Agent `a`'s `op` reaches the apply loop at `at` (queued while etcd had restarted
    /// `restarts` times); `answer`: the agent waits for its answer.
    fn apply_at(
        &mut self,
        at: Instant,
        a: usize,
        process: u64,
        op: Op,
        restarts: u64,
        answer: bool,
    ) {
        let at = self.ms(at);
        let ev = Ev::Apply {
            a,
            process,
            op,
            restarts,
            answer,
        };
        self.push(at, ev);
    }

    /// The apply loop reaches agent `a`'s op: carried out (unless etcd restarted since it
    /// was queued, or serves no more), and answered if the agent still waits.
    pub fn applied(&mut self, a: usize, process: u64, op: &Op, restarts: u64, answer: bool) {
        let now = self.now();
        let three = self.opts.three_members;
        let gone = self.agents[a].process != process;
        let result = if restarts != self.etcd.restarts || !self.etcd.has_leader(now, three) {
            // Lost with the process that queued it: the request fails as its connection
            // does.
            Err(cut())
        } else if gone && matches!(op, Op::ReopenKeepAlive { .. }) {
            // A dead process's stream opens nothing.
            return;
        } else {
            self.serve_op(a, op, now)
        };
        self.broadcast();
        if answer && self.agents[a].process == process {
            let lat = self.latency(a);
            let input = Input::Answer(result.map_err(Into::into));
            self.after(lat, Ev::Deliver { a, process, input });
        }
    }

    /// An op that does not get through: a cut network times out; a stopped etcd refuses
    /// at once.
    fn refuse(&mut self, a: usize, process: u64) {
        let wait = if self.agents[a].cut {
            self.rng.range(1_000, 3_000)
        } else {
            self.rng.range(1, 20)
        };
        self.after(
            wait,
            Ev::Deliver {
                a,
                process,
                input: Input::Answer(Err(cut().into())),
            },
        );
    }

    /// A slow etcd answers "request timed out" to some requests, having applied some of
    /// them anyway (the proposal committed after the server gave up waiting): the session
    /// sends the same op again.
    fn time_out_overloaded(
        &mut self,
        a: usize,
        op: &Op,
        now: Instant,
    ) -> Result<Answer, etcd_client::Error> {
        self.expire();
        let applied = self.rng.chance(50);
        if applied {
            // Applied after the server gave up waiting: the answer is the time-out.
            let _ = self.execute(a, op, now);
            self.broadcast();
        }
        self.note(|| {
            format!(
                "etcd: n{a}'s {} timed out (applied: {applied})",
                op_name(op)
            )
        });
        Err(timed_out())
    }

    /// An op etcd carries out against the store; a watch is opened first.
    fn serve_op(&mut self, a: usize, op: &Op, now: Instant) -> Result<Answer, etcd_client::Error> {
        self.expire();
        match op {
            Op::Watch {
                role,
                from,
                lease,
                keep_stream,
            } if !self.open_watch(a, *role, *from, *lease, *keep_stream) => {
                // Not opened; an open that took goes on to `execute` below.
                return Err(crate::etcd::errors::kept_stream_ended());
            }
            // A new keep-alive stream beside the open watches (or, joining, before them).
            Op::ReopenKeepAlive { lease } => {
                self.agents[a].keep_alive_ended = false;
                self.agents[a].kept = Some(*lease);
            }
            _ => {}
        }
        self.execute(a, op, now)
    }

    /// Agent `a`'s `op` carried out by etcd, and checked: a grant is remembered as this
    /// process's, and a registration on a new lease must not be written while this
    /// process's registration on another still stands.
    fn execute(&mut self, a: usize, op: &Op, now: Instant) -> Result<Answer, etcd_client::Error> {
        let standing = self.standing_registration(a, op, now);
        let answer = self.etcd.execute(op, now);
        if let Ok(Answer::Granted { id }) = &answer {
            self.granted_to.insert(*id, (a, self.agents[a].process));
        }
        if let (Some((node, old, new)), Ok(Answer::Txn { succeeded: true })) = (standing, &answer) {
            self.violate(format!(
                "re-registration: n{a} registered {node} on lease {new} while its registration on lease {old} stood"
            ));
        }
        self.after_write(op, &answer);
        answer
    }

    /// If `op` writes agent `a`'s registration on a lease other than the one its key is
    /// on now, and that lease is one this same process was granted and etcd still holds:
    /// the node, the old lease and the new.
    fn standing_registration(&self, a: usize, op: &Op, now: Instant) -> Option<(String, i64, i64)> {
        let Op::Txn(spec) = op else { return None };
        let members = self.keys.members();
        let process = self.agents[a].process;
        spec.then.iter().find_map(|w| {
            let Write::Put { key, lease, .. } = w else {
                return None;
            };
            let node = key.strip_prefix(&members)?;
            let req = fsdp_proto::etcdserverpb::RangeRequest {
                key: key.as_bytes().to_vec(),
                ..Default::default()
            };
            let old = self.etcd.state.range(&req).ok()?.kvs.first()?.lease;
            let mine = self.granted_to.get(&old) == Some(&(a, process));
            let stands = self.etcd.state.time_to_live(old, now).is_some();
            (old != *lease && mine && stands).then(|| (node.to_owned(), old, *lease))
        })
    }

    /// Agent `a`'s watches open, as `role` from revision `from`, with a new keep-alive
    /// stream for `lease` unless the one it has for it is to be kept; their first answer
    /// says the revision etcd is at. False, and nothing opened, if that one ended (as
    /// the driver, which fails the op).
    fn open_watch(
        &mut self,
        a: usize,
        role: Role,
        from: i64,
        lease: i64,
        keep_stream: bool,
    ) -> bool {
        let ag = &self.agents[a];
        let kept = ag.watching.is_none() && ag.kept == Some(lease) && !ag.keep_alive_ended;
        if keep_stream && !kept {
            return false;
        }
        if !keep_stream {
            // The open replaces every stream the agent had (the driver drops them first):
            // what the old ones still carry is never read, as a closed stream's is not.
            self.agents[a].streams += 1;
        }
        let (g, rev) = (self.agents[a].streams, self.etcd.state.revision());
        self.note(|| format!("n{a} watches as {role:?} from {from} (etcd at {rev}, streams {g})"));
        self.agents[a].watching = Some(Watching {
            role,
            next_rev: from,
        });
        self.agents[a].keep_alive_ended = false;
        self.agents[a].kept = Some(lease);
        let (streams, revision) = (self.agents[a].streams, self.etcd.state.revision());
        let lat = self.latency(a);
        self.after(
            lat + 1,
            Ev::Stream {
                a,
                streams,
                input: Input::WatchCreated { revision },
            },
        );
        true
    }

    /// A keep-alive reaches etcd.
    pub fn keep_alive(&mut self, a: usize, streams: u64, lease: i64) {
        let ag = &self.agents[a];
        let now = self.now();
        if ag.streams != streams
            || ag.cut
            || ag.keep_alive_ended
            || !self.etcd.serves(now, ag.pinned, self.opts.three_members)
        {
            return;
        }
        let behind = self.etcd.lag(now) > APPLY_WAIT;
        if behind || (ag.slow && self.rng.chance(20)) {
            // Too busy to renew: etcd ends the keep-alive stream (the watches go on).
            self.agents[a].keep_alive_ended = true;
            self.note(|| format!("etcd: ends n{a}'s keep-alive stream (too busy)"));
            let lat = self.latency(a);
            return self.after(
                lat,
                Ev::Stream {
                    a,
                    streams,
                    input: Input::KeepAliveFailed(timed_out().into()),
                },
            );
        }
        self.expire();
        // A renewal waits for the apply loop (at most a second: past that it was refused
        // above).
        let behind = self.etcd.lag(now).as_millis() as u64;
        let ttl = self.etcd.keep_alive(lease, now);
        if ttl == 0 {
            self.note(|| {
                format!(
                    "etcd: n{a}'s keep-alive of lease ..{} finds it gone",
                    lease % 1_000_000
                )
            });
        }
        let lat = self.latency(a) + behind;
        self.after(
            lat,
            Ev::Stream {
                a,
                streams,
                input: Input::LeaseAnswer(Some(ttl)),
            },
        );
        self.broadcast();
    }

    /// etcd expires what is due (it needs a leader).
    pub fn expire(&mut self) {
        let now = self.now();
        if !self.etcd.has_leader(now, self.opts.three_members) {
            return;
        }
        let gone = self.etcd.expire(now);
        if !gone.is_empty() {
            self.note(|| format!("etcd: leases {gone:?} expired"));
            self.broadcast();
        }
    }

    /// A round key written: the checker sees every commit.
    pub(super) fn after_write(&mut self, op: &Op, answer: &Result<Answer, etcd_client::Error>) {
        let Op::Txn(spec) = op else { return };
        let Ok(Answer::Txn { succeeded: true }) = answer else {
            return;
        };
        let roster_key = self.keys.key::<v1::Roster>("");
        if self.trace.is_some() {
            let members = self.keys.members();
            for w in &spec.then {
                if let Write::Put { key, value, lease } = w {
                    if key.starts_with(&members) {
                        if let Ok(m) = fsdp_proto::decode::<v1::Member>(key, value) {
                            let (id, inc, wants) =
                                (m.node_id.clone(), m.incarnation % 1_000_000, m.wants_round);
                            self.note(|| {
                                format!(
                                    "etcd: {id} registered #..{inc} for round {wants} (lease ..{})",
                                    lease % 1_000_000
                                )
                            });
                        }
                    }
                }
            }
        }
        // The whole round is at the roster beside a delta, in the shards a placed header
        // names (in the store now, written with it or ahead of it), at the round key
        // otherwise.
        let round_key = self.keys.key::<v1::Round>("");
        let (keys, state) = (&self.keys, &self.etcd.state);
        let shards = |r: &v1::Round| -> Vec<v1::Placement> {
            let prefix = keys.placement_of(&r.placement);
            let req = fsdp_proto::etcdserverpb::RangeRequest {
                key: prefix.as_bytes().to_vec(),
                range_end: prefix_end(prefix.as_bytes()),
                ..Default::default()
            };
            let kvs = state.range(&req).map(|r| r.kvs).unwrap_or_default();
            kvs.iter()
                .filter_map(|kv| fsdp_proto::decode(&prefix, &kv.value).ok())
                .collect()
        };
        let coordinator = self.keys.key::<v1::Coordinator>("");
        let sealing = spec
            .when
            .iter()
            .any(|c| matches!(c, Compare::Lease(k, _) if *k == coordinator));
        let (mut sealed, mut broken) = (Vec::new(), Vec::new());
        for w in &spec.then {
            if let Write::Put { key, value, .. } = w {
                let whole = if *key == roster_key {
                    fsdp_proto::decode::<v1::Roster>(key, value)
                        .ok()
                        .and_then(|r| r.round)
                } else if *key == round_key {
                    fsdp_proto::decode::<v1::Round>(key, value)
                        .ok()
                        .filter(|r| !r.delta)
                        .and_then(|r| match r.shards {
                            0 => Some(r),
                            _ => match crate::etcd::placement::whole(&r, &shards(&r)) {
                                Ok(whole) => Some(whole),
                                // Only a seal is judged: any other write of the round key
                                // (none writes a placed one now) says nothing of shards.
                                Err(why) if sealing => {
                                    broken.push(format!(
                                        "round {} sealed placed without its shards: {why}",
                                        r.number
                                    ));
                                    None
                                }
                                Err(_) => None,
                            },
                        })
                } else {
                    None
                };
                sealed.extend(whole);
            }
        }
        for why in broken {
            self.violate(why);
        }
        for r in sealed {
            self.on_sealed(&r);
        }
    }

    /// New events reach every open watch, by revision, each stream in order.
    pub fn broadcast(&mut self) {
        self.watch_membership();
        let rev = self.etcd.state.revision();
        for a in 0..self.agents.len() {
            let Some(w) = self.agents[a].watching.clone() else {
                continue;
            };
            if w.next_rev > rev || self.agents[a].cut {
                continue;
            }
            let specs = self.specs(w.role);
            let streams = self.agents[a].streams;
            for (i, spec) in specs.iter().enumerate() {
                match self.etcd.replay(w.next_rev, spec) {
                    None => {
                        self.after(
                            1,
                            Ev::Stream {
                                a,
                                streams,
                                input: Input::WatchEnded,
                            },
                        );
                    }
                    Some(batches) => {
                        for (_, batch) in batches {
                            let lat = self.latency(a);
                            let at = (self.now_ms + lat).max(self.stream_clock[a][i]);
                            self.stream_clock[a][i] = at;
                            self.push(
                                at,
                                Ev::Stream {
                                    a,
                                    streams,
                                    input: Input::Watched(batch),
                                },
                            );
                        }
                    }
                }
            }
            if let Some(w) = self.agents[a].watching.as_mut() {
                w.next_rev = rev + 1;
            }
        }
    }

    /// A membership change (a registration created or deleted, a failure reported) starts
    /// the livelock count again: the seals after one must stop by themselves.
    pub(super) fn watch_membership(&mut self) {
        let rev = self.etcd.state.revision();
        if self.membership_rev > rev {
            // An empty restart: a new history.
            self.membership_rev = 0;
        }
        let root = self.keys.root().as_bytes().to_vec();
        let spec = WatchSpec {
            range_end: prefix_end(&root),
            key: root,
            ..WatchSpec::default()
        };
        let (members, failures) = (self.keys.members(), self.keys.key::<v1::Failure>(""));
        if let Some(batches) = self.etcd.replay(self.membership_rev + 1, &spec) {
            let changes = batches.iter().flat_map(|(_, b)| b).filter(|e| match e {
                WatchEvent::Put(kv) => {
                    (kv.key.starts_with(&members) && kv.create_rev == kv.mod_rev)
                        || kv.key.starts_with(&failures)
                }
                WatchEvent::Delete { key, .. } => key.starts_with(&members),
            });
            let n = changes.count() as u32;
            self.changed(n);
        }
        self.membership_rev = rev;
    }

    /// The watches a role opens (as the driver opens them).
    pub(super) fn specs(&self, role: Role) -> Vec<WatchSpec> {
        let spec = |key: &str| WatchSpec {
            key: key.as_bytes().to_vec(),
            range_end: prefix_end(key.as_bytes()),
            no_put: false,
            no_delete: false,
            prev_kv: false,
        };
        match role {
            Role::Coordinator => vec![spec(self.keys.root())],
            Role::Member => vec![spec(&self.keys.ctl())],
        }
    }

    /// Streams of agent `a` fail (a cut, an etcd restart) after `delay`.
    pub fn fail_streams(&mut self, a: usize, delay: u64) {
        if self.agents[a].watching.is_none() && self.agents[a].kept.is_none() {
            return;
        }
        let streams = self.agents[a].streams;
        self.after(
            delay,
            Ev::Stream {
                a,
                streams,
                input: Input::StreamFailed(cut().into()),
            },
        );
    }
}
