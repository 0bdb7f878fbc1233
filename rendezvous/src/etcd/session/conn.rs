//! The connection to etcd and the streams open on it, and how each op the machine sends
//! goes to etcd with etcd-client: a request on its own handle to the connection, or an op
//! on the streams (watches, keep-alives) that the driver waits on alone.

use etcd_client::{
    Client, Compare as EtcdCompare, CompareOp, DeleteOptions, GetOptions, LeaseKeepAliveStream,
    LeaseKeeper, PutOptions, Txn, TxnOp, WatchOptions, WatchResponse, WatchStream,
};
use fsdp_proto::v1;

use super::fault::Fault;
use super::io::{Answer, Compare, Kv, Op, Role, TxnSpec, Write};
use super::records;
use crate::etcd::connect::{self, EtcdOptions};
use crate::etcd::keys::Keys;
use crate::etcd::token;

pub(super) type EtcdResult<T> = Result<T, etcd_client::Error>;

/// The streams the session watches while it is in its watching phase.
pub(super) struct Streams {
    /// Control keys; for the coordinator, every key of the run. None while a joining
    /// node keeps its lease alive before its first sync (`Todo::KeepFromGrant`).
    pub(super) ctl: Option<Watched>,
    /// Member departures (members only: the coordinator's one watch has them in order).
    pub(super) members: Option<Watched>,
    pub(super) keeper: LeaseKeeper,
    /// `None` once it failed or ended, until a new one is opened: an ended stream answers
    /// every poll at once, and each answer would be read as the lease gone again.
    pub(super) kept: Option<LeaseKeepAliveStream>,
}

/// The connection to etcd and the streams open on it: what an op needs.
pub(super) struct Conn {
    pub(super) client: Client,
    pub(super) keys: Keys,
    pub(super) options: Option<EtcdOptions>,
    pub(super) ttl: std::time::Duration,
    pub(super) streams: Option<Streams>,
    /// The stream a crowd node waited for its turn on ([`TurnStream`]): its first watch
    /// of the control keys opens there, not on a stream of its own.
    pub(super) turn: Option<TurnStream>,
}

/// A watch stream and the one watch on it whose answers are not this session's: the
/// turn's, cancelled as the stream is taken over (its last events, and the answer to
/// the cancel, may still come).
pub(super) struct Watched {
    stream: WatchStream,
    skip: Option<i64>,
}

impl Watched {
    async fn message(&mut self) -> EtcdResult<Option<WatchResponse>> {
        loop {
            let msg = self.stream.message().await?;
            if msg.as_ref().is_none_or(|r| Some(r.watch_id()) != self.skip) {
                return Ok(msg);
            }
        }
    }
}

/// The watch stream a crowd node waited for its turn on (`handle.rs`, `await_turn`),
/// its turn's watch `id` cancelled once the turn came. A crowd's node opens one stream
/// for its turn and one for its session's watches: at 10,000 nodes, 9,000 stream opens
/// more than the floor's, each two more goroutines for etcd to run and scan while the
/// stream lives, and a few more tasks in the node's own process.
pub struct TurnStream {
    pub(crate) stream: WatchStream,
    pub(crate) id: i64,
}

impl Conn {
    /// Sends one keep-alive on the open stream, if there is one (the lease clock counts
    /// it sent: an error here ends the stream, and its end is what the machine hears).
    pub(super) async fn keep_alive(&mut self) {
        if let Some(s) = self.streams.as_mut() {
            if let Err(e) = s.keeper.keep_alive().await {
                tracing::debug!(error = %e, "a keep-alive beside an op could not be sent");
            }
        }
    }

    pub(super) async fn execute(&mut self, op: Op) -> EtcdResult<Answer> {
        if !op.uses_streams() {
            return request(self.client.clone(), op).await;
        }
        match self.on_streams(op.clone()).await {
            Err(e) if token::expired(&e) => {
                token::renew(&self.client, &e).await?;
                self.on_streams(op).await
            }
            answer => answer,
        }
    }

    async fn on_streams(&mut self, op: Op) -> EtcdResult<Answer> {
        Ok(match op {
            Op::Watch {
                role,
                from,
                lease,
                keep_stream,
            } => self.open_watches(role, from, lease, keep_stream).await?,
            Op::KeepAlive => {
                let Some(s) = self.streams.as_mut() else {
                    let e = std::io::Error::other("no keep-alive stream is open");
                    return Err(etcd_client::Error::IoError(e));
                };
                s.keeper.keep_alive().await?;
                Answer::Done
            }
            Op::ReopenKeepAlive { lease } => {
                let (keeper, kept) = self.client.lease_keep_alive(lease).await?;
                match self.streams.as_mut() {
                    Some(s) => (s.keeper, s.kept) = (keeper, Some(kept)),
                    // A joining node's, before its watches.
                    None => {
                        self.streams = Some(Streams {
                            ctl: None,
                            members: None,
                            keeper,
                            kept: Some(kept),
                        })
                    }
                }
                Answer::Done
            }
            Op::PickEndpoint => {
                if let Some(opts) = &self.options {
                    let patience = (self.ttl / 4).min(opts.connect_timeout);
                    if let Some(client) = connect::pick(opts, patience).await {
                        self.client = client;
                    }
                }
                Answer::Done
            }
            // `execute` sends a request on its own handle.
            request => return self::request(self.client.clone(), request).await,
        })
    }

    /// Opens the watches for `role` from revision `from` (replacing any open ones) over
    /// the keep-alive stream of `lease` kept from its grant if `keep_stream`, else with a
    /// new one.
    async fn open_watches(
        &mut self,
        role: Role,
        from: i64,
        lease: i64,
        keep_stream: bool,
    ) -> EtcdResult<Answer> {
        let old = self.streams.take().and_then(|s| Some((s.keeper, s.kept?)));
        let kept = match old {
            Some((keeper, kept)) if keep_stream && keeper.id() == lease => Some((keeper, kept)),
            // It ended meanwhile: a failure, so that the machine, which counts
            // its keep-alives as sent on it, syncs again instead of pairing
            // another stream's answers with them.
            _ if keep_stream => {
                return Err(crate::etcd::errors::kept_stream_ended());
            }
            _ => None,
        };
        let (ctl, members) = match self.watches(role, from).await {
            Ok(watches) => watches,
            Err(e) => {
                // The stream kept stays for the open tried again (with a renewed
                // token: `execute`).
                if let Some((keeper, kept)) = kept {
                    self.streams = Some(Streams {
                        ctl: None,
                        members: None,
                        keeper,
                        kept: Some(kept),
                    });
                }
                return Err(e);
            }
        };
        let (keeper, kept) = match kept {
            Some(kept) => kept,
            None => self.client.lease_keep_alive(lease).await?,
        };
        self.streams = Some(Streams {
            ctl: Some(ctl),
            members,
            keeper,
            kept: Some(kept),
        });
        Ok(Answer::Done)
    }

    /// Opens the watches for `role` from revision `from`.
    async fn watches(&mut self, role: Role, from: i64) -> EtcdResult<(Watched, Option<Watched>)> {
        let c = &self.client;
        let ctl_opts = WatchOptions::new().with_prefix().with_start_revision(from);
        let (ctl, members) = if role == Role::Coordinator {
            // One watch over the whole run, so that the view the coordinator seals from is
            // always etcd's history up to one revision. Two streams (control keys and
            // registrations) were read in whatever order they became ready: a node's
            // failure report and its registration for the next round, written in that
            // order, were seen the other way round, and the round was sealed without
            // charging the failure. (It knows every registration, so a delete needs no
            // previous value to say which incarnation went.)
            self.turn = None;
            let all = watch(c, self.keys.root(), ctl_opts).await?;
            (all, None)
        } else {
            // Only the coordinator watches registrations; the others learn of new rounds
            // through the round key and of departures through the records that say so
            // (`state.rs`, `said_departed`).
            let ctl = match self.turn.take() {
                Some(TurnStream { mut stream, id }) => {
                    stream.watch(self.keys.ctl(), Some(ctl_opts)).await?;
                    Watched {
                        stream,
                        skip: Some(id),
                    }
                }
                None => watch(c, self.keys.ctl(), ctl_opts).await?,
            };
            (ctl, None)
        };
        Ok((ctl, members))
    }
}

/// A watch of `key` with `opts` on `client`'s connection, its events as large as etcd
/// sends them ([`crate::etcd::connect::watcher`]).
async fn watch(
    client: &Client,
    key: impl Into<Vec<u8>>,
    opts: WatchOptions,
) -> EtcdResult<Watched> {
    let stream = connect::watcher(client).watch(key, Some(opts)).await?;
    Ok(Watched { stream, skip: None })
}

/// Carries out an op that needs no stream, on its own handle to the connection
/// (authenticating again if the token it carried had expired).
pub(super) async fn request(client: Client, op: Op) -> EtcdResult<Answer> {
    token::renewing(&client, || send(client.clone(), op.clone())).await
}

async fn send(mut client: Client, op: Op) -> EtcdResult<Answer> {
    let c = &mut client;
    Ok(match op {
        Op::Range {
            key,
            prefix,
            keys_only,
            serializable,
        } => {
            let mut opts = GetOptions::new();
            if prefix {
                opts = opts.with_prefix();
            }
            if serializable {
                opts = opts.with_serializable();
            }
            if keys_only {
                opts = opts.with_keys_only();
            }
            let resp = connect::reader(c).get(key, Some(opts)).await?;
            Answer::Range {
                revision: resp.header().map_or(0, |h| h.revision()),
                kvs: resp.kvs().iter().map(kv).collect(),
            }
        }
        Op::MemberCount => Answer::MemberCount(c.member_list().await?.members().len()),
        Op::Txn(spec) => Answer::Txn {
            succeeded: c.txn(txn(spec)).await?.succeeded(),
        },
        Op::Put(Write::Put { key, value, lease }) => {
            c.put(key, value, lease_opts(lease)).await?;
            Answer::Done
        }
        Op::Put(Write::Delete(key)) => {
            c.delete(key, None).await?;
            Answer::Done
        }
        Op::Put(Write::DeleteRange { from, to }) => {
            c.delete(from, Some(DeleteOptions::new().with_range(to)))
                .await?;
            Answer::Done
        }
        Op::Grant { ttl } => Answer::Granted {
            id: c.lease_grant(ttl, None).await?.id(),
        },
        Op::Revoke { lease } => {
            c.lease_revoke(lease).await?;
            Answer::Done
        }
        Op::TimeToLive { lease } => Answer::TimeToLive {
            ttl: c.lease_time_to_live(lease, None).await?.ttl(),
        },
        Op::Depart { record, lease } => depart(c, record, lease).await,
        // `Conn::execute` sends these on the streams; asked here, it is refused in words.
        Op::Watch { .. } | Op::KeepAlive | Op::ReopenKeepAlive { .. } | Op::PickEndpoint => {
            let what = "an op on the streams, sent as a request".to_owned();
            return Err(etcd_client::Error::InvalidArgs(what));
        }
    })
}

pub(super) async fn next_watch(s: Option<&mut Watched>) -> EtcdResult<Option<WatchResponse>> {
    match s {
        Some(s) => s.message().await,
        None => std::future::pending().await,
    }
}

pub(super) async fn next_answer(
    s: Option<&mut LeaseKeepAliveStream>,
) -> EtcdResult<Option<etcd_client::LeaseKeepAliveResponse>> {
    match s {
        Some(s) => s.message().await,
        None => std::future::pending().await,
    }
}

/// The first word on how this node left, beside the revoke of its lease (both at once:
/// one more round trip first would delay what every survivor waits for).
async fn depart(c: &Client, record: Option<TxnSpec>, lease: i64) -> Answer {
    let (mut a, mut b) = (c.clone(), c.clone());
    let said = async move {
        match record {
            Some(spec) => a.txn(txn(spec)).await.map(drop),
            None => Ok(()),
        }
    };
    let (said, revoked) = tokio::join!(said, b.lease_revoke(lease));
    Answer::Departed {
        said: said.err().map(Fault::from),
        revoked: revoked.err().map(Fault::from),
    }
}

/// The session's first read of the run's control keys, made by the handle before the
/// grant in the nesting check's transaction: one request less for each joining node
/// ([`super::Machine::with_first_read`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FirstRead {
    /// The revision the keys were read at: the watches go on from the next.
    pub revision: i64,
    pub kvs: Vec<Kv>,
}

impl FirstRead {
    /// `kvs` as etcd answered them at `revision`.
    pub fn of(revision: i64, kvs: &[etcd_client::KeyValue]) -> Self {
        Self {
            revision,
            kvs: kvs.iter().map(kv).collect(),
        }
    }

    /// Takes a watched event of one of its keys (a put if `put`, else a delete), so that
    /// the read stands at the event's revision: a watch from the revision after that
    /// one then misses nothing.
    pub fn caught_up(&mut self, event: &etcd_client::KeyValue, put: bool) {
        let key = event.key_str().unwrap_or("");
        let at = self.kvs.binary_search_by(|k| k.key.as_str().cmp(key));
        match (at, put) {
            (Ok(i), true) => self.kvs[i] = kv(event),
            (Err(i), true) => self.kvs.insert(i, kv(event)),
            (Ok(i), false) => drop(self.kvs.remove(i)),
            (Err(_), false) => {}
        }
        self.revision = self.revision.max(event.mod_revision());
    }
}

pub(super) fn kv(kv: &etcd_client::KeyValue) -> Kv {
    Kv {
        key: kv.key_str().unwrap_or("").to_owned(),
        value: kv.value().to_vec(),
        create_rev: kv.create_revision(),
        mod_rev: kv.mod_revision(),
        lease: kv.lease(),
    }
}

fn lease_opts(lease: i64) -> Option<PutOptions> {
    (lease != 0).then(|| PutOptions::new().with_lease(lease))
}

fn write(w: Write) -> TxnOp {
    match w {
        Write::Put { key, value, lease } => TxnOp::put(key, value, lease_opts(lease)),
        Write::Delete(key) => TxnOp::delete(key, None),
        Write::DeleteRange { from, to } => {
            TxnOp::delete(from, Some(DeleteOptions::new().with_range(to)))
        }
    }
}

/// A [`TxnSpec`] as etcd-client's transaction.
pub fn txn(spec: TxnSpec) -> Txn {
    let when: Vec<EtcdCompare> = spec
        .when
        .into_iter()
        .map(|c| match c {
            Compare::Absent(key) => EtcdCompare::version(key, CompareOp::Equal, 0),
            Compare::ModRevision(key, rev) => EtcdCompare::mod_revision(key, CompareOp::Equal, rev),
            Compare::Lease(key, id) => EtcdCompare::lease(key, CompareOp::Equal, id),
            Compare::NoneWrittenAfter { from, to, rev } => {
                EtcdCompare::mod_revision(from, CompareOp::Less, rev.saturating_add(1))
                    .with_range(to)
            }
        })
        .collect();
    let then: Vec<TxnOp> = spec.then.into_iter().map(write).collect();
    let otherwise: Vec<TxnOp> = spec.otherwise.into_iter().map(write).collect();
    Txn::new().when(when).and_then(then).or_else(otherwise)
}

/// Whether `node`'s registration lives on `lease` now (one comparison, no read).
pub async fn lease_holds(
    client: &mut Client,
    keys: &Keys,
    node: &str,
    lease: i64,
) -> EtcdResult<bool> {
    let spec = records::lease_holds(keys, node, lease);
    Ok(client.txn(txn(spec)).await?.succeeded())
}

/// Commits `record` as the next round, fenced on the round it replaces
/// ([`records::commit_round`]).
pub async fn commit_round(
    client: &mut Client,
    keys: &Keys,
    fence: Option<i64>,
    lease: i64,
    record: &v1::Round,
) -> EtcdResult<bool> {
    let spec = records::commit_round(keys, fence, lease, record, None);
    Ok(client.txn(txn(spec)).await?.succeeded())
}
