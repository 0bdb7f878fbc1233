//! The writes the session makes, as data ([`Op`], [`TxnSpec`]): a record written as its
//! declaration's [`Mode`] says, and the transactions of the records written their own way
//! (the registration with its election, the fenced round, the withdrawal).

use fsdp_proto::{SCHEMA_VERSION, v1};

use super::io::{Compare, Op, TxnSpec, Write};
use crate::etcd::keys::Keys;
use crate::etcd::record::{Mode, Outgoing, Record};

/// A put of `value` at `key`, on `lease` (0: none).
pub fn put(key: String, value: Vec<u8>, lease: i64) -> Write {
    Write::Put { key, value, lease }
}

/// Writes `value` at `key` unless the key exists (the first word stands), and only while
/// every key of `unless` is absent too.
pub fn first_word(key: String, value: Vec<u8>, unless: &[String]) -> TxnSpec {
    let when = std::iter::once(&key)
        .chain(unless)
        .map(|k| Compare::Absent(k.clone()))
        .collect();
    TxnSpec {
        when,
        then: vec![put(key, value, 0)],
        otherwise: Vec::new(),
    }
}

/// The op that writes `o` as its mode says, on `lease` when leased.
pub fn write(keys: &Keys, o: &Outgoing, lease: i64) -> Op {
    let (key, value) = (o.key.clone(), o.value.clone());
    match o.mode {
        // `Outgoing::of` refuses a record written its own way when it is compiled.
        Mode::Put | Mode::Own => Op::Put(put(key, value, 0)),
        Mode::Leased => Op::Put(put(key, value, lease)),
        Mode::FirstWord { unless } => {
            let unless: Vec<String> = unless.iter().map(|p| keys.place(*p, "")).collect();
            Op::Txn(first_word(key, value, &unless))
        }
    }
}

/// How `node`'s loss from `round` was noticed.
pub fn noticed(round: u64, node: &str, how: v1::Detection, detect_ms: u32) -> v1::Noticed {
    v1::Noticed {
        schema: SCHEMA_VERSION,
        round,
        node_id: node.to_owned(),
        how: how.into(),
        detect_ms,
    }
}

/// The record of how a member's loss was noticed (its declaration: the first word stands).
pub fn say_noticed(keys: &Keys, g: &v1::Noticed) -> TxnSpec {
    const {
        assert!(matches!(
            <v1::Noticed as Record>::MODE,
            Mode::FirstWord { unless: [] }
        ))
    };
    first_word(keys.of(g), fsdp_proto::encode(g), &[])
}

/// Why this node leaves (`word`), beside the first word on how (`gone`), if it has one:
/// without `news_since`, its word is put whether or not the first word stands, and
/// replaces a "lost" the coordinator wrote at its key meanwhile. The oldest records at
/// `trim` go with it.
///
/// `news_since`: the revision of the round this node leaves, where it holds one. Its word
/// is then written only while no departure record was written after it, that is while
/// the round's members know of no departure yet: members that leave together each find
/// their own word news in their views, but only the first is, and every word is sent to
/// every member (at 10,000, 0.1–0.9 s of etcd's apply loop each: 50 leaving together
/// stalled etcd past the TTL and the run collapsed). The others write nothing, as a node
/// whose view holds the word already does ([`crate::etcd::left::news`]): their members
/// report them unsaid, and the coordinator seals the next round from the registrations.
/// A word of an older round written late, a finish, or a first word on how already
/// written for this node holds the word back too (a "lost" at this node's own key does
/// not, and is replaced): the coordinator then says the node lost, the one word its
/// members need, and status shows that instead of the node's own reason.
pub fn say_left(
    keys: &Keys,
    word: &v1::Left,
    gone: Option<&v1::Noticed>,
    trim: &[String],
    news_since: Option<i64>,
) -> TxnSpec {
    let mut then = vec![put(keys.of(word), fsdp_proto::encode(word), 0)];
    then.extend(trim.iter().map(|t| Write::Delete(keys.key::<v1::Left>(t))));
    if let Some(rev) = news_since {
        // Every departure record but this node's own key: the coordinator's "lost" there
        // (it saw the revoke, sent beside the word, before the word) is replaced as ever.
        let (start, own) = (keys.key::<v1::Left>(""), keys.of(word));
        let end = crate::etcd::keys::past(&start);
        let mut when = vec![
            Compare::NoneWrittenAfter {
                from: start,
                to: own.clone(),
                rev,
            },
            Compare::NoneWrittenAfter {
                from: format!("{own}\0"),
                to: end,
                rev,
            },
        ];
        // One transaction can hold one branch: the word goes with the first word on how
        // only while that one is absent too (a ring neighbour that found this node dead
        // first says how; the coordinator then says why).
        if let Some(g) = gone {
            let said = say_noticed(keys, g);
            when.extend(said.when);
            then.splice(0..0, said.then);
        }
        return TxnSpec {
            when,
            then,
            otherwise: Vec::new(),
        };
    }
    match gone {
        Some(g) => {
            let mut said = say_noticed(keys, g);
            said.otherwise = then.clone();
            said.then.extend(then);
            said
        }
        None => TxnSpec {
            then,
            ..TxnSpec::default()
        },
    }
}

/// The coordinator's word for a member that left without one: written only while its key
/// is absent (the member's own word, however late, stands). The oldest records at `trim`
/// go either way.
pub fn say_lost(keys: &Keys, word: &v1::Left, trim: &[String]) -> TxnSpec {
    let deletes: Vec<Write> = trim
        .iter()
        .map(|t| Write::Delete(keys.key::<v1::Left>(t)))
        .collect();
    let key = keys.of(word);
    let mut said = first_word(key, fsdp_proto::encode(word), &[]);
    said.then.extend(deletes.clone());
    said.otherwise = deletes;
    said
}

/// Deletes the departure records at `trim` (the oldest, beyond those kept).
pub fn trim_left(keys: &Keys, trim: &[String]) -> TxnSpec {
    TxnSpec {
        then: trim
            .iter()
            .map(|t| Write::Delete(keys.key::<v1::Left>(t)))
            .collect(),
        ..TxnSpec::default()
    }
}

/// This node's registration under `lease`: its member record when given (stamped with the
/// lease and incarnation), and, when `claim`, the coordinator key if nobody holds it (the
/// record is written either way).
pub fn registration(
    keys: &Keys,
    node_id: &str,
    member: Option<&v1::Member>,
    (lease, incarnation): (i64, u64),
    claim: bool,
) -> TxnSpec {
    // A registration says the node is healthy again: its unhealthy record goes with it.
    let put_member: Vec<Write> = member
        .map(|m| {
            let record = v1::Member::from(v1::MemberFields {
                lease,
                incarnation,
                ..(**m).clone()
            });
            [
                put(keys.of(&record), fsdp_proto::encode(&record), lease),
                Write::Delete(keys.key::<v1::Unhealthy>(&m.node_id)),
            ]
        })
        .into_iter()
        .flatten()
        .collect();
    if !claim {
        return TxnSpec {
            then: put_member,
            ..TxnSpec::default()
        };
    }
    let key = keys.key::<v1::Coordinator>("");
    let record = v1::Coordinator {
        schema: SCHEMA_VERSION,
        node_id: node_id.to_owned(),
    };
    let mut then = put_member.clone();
    then.push(put(key.clone(), fsdp_proto::encode(&record), lease));
    TxnSpec {
        when: vec![Compare::Absent(key)],
        then,
        otherwise: put_member,
    }
}

/// Whether `node`'s registration lives on `lease` now (one comparison, no read).
pub fn lease_holds(keys: &Keys, node: &str, lease: i64) -> TxnSpec {
    TxnSpec {
        when: vec![Compare::Lease(keys.key::<v1::Member>(node), lease)],
        ..TxnSpec::default()
    }
}

/// `record` as the next round, fenced on the round it replaces: it succeeds only if the
/// round key still has revision `fence` (or does not exist when `fence` is `None`) and the
/// coordinator key still lives on `lease`, the one the coordinator saw it on when it
/// decided. Two coordinators racing for the same round cannot both win, and no round
/// follows a halt.
///
/// The revision alone is not a fence across an etcd that lost its data: revisions start
/// again at 1 there, so a commit decided before the loss and sent after it can find a
/// round sealed since at the very revision it names. No lease outlives the data (and
/// etcd does not give an ID twice), so the lease comparison refuses it.
///
/// `ctl/round` gets the difference from `base` (the round replaced and its revision, which
/// is the fence) where there is one, and then `roster` the whole round beside it
/// ([`crate::etcd::roster`]); the whole round otherwise, once.
pub fn commit_round(
    keys: &Keys,
    fence: Option<i64>,
    lease: i64,
    record: &v1::Round,
    base: Option<(&v1::Round, i64)>,
) -> TxnSpec {
    let key = keys.key::<v1::Round>("");
    let delta = base
        .filter(|(_, rev)| fence == Some(*rev))
        .and_then(|(b, rev)| crate::etcd::roster::delta(b, rev, record));
    let roster = v1::Roster {
        schema: fsdp_proto::SCHEMA_VERSION,
        round: Some(record.clone()),
    };
    let mut then = match &delta {
        Some(d) => vec![
            put(key, fsdp_proto::encode(d), 0),
            put(keys.of(&roster), fsdp_proto::encode(&roster), 0),
        ],
        // Once: etcd refuses a request over 1.5 MiB (`--max-request-bytes`), and a
        // round of 10,000 written twice was 2.4 MB. The roster is read only for a
        // delta's whole round; it keeps the last of those, which is never older
        // than a delta a member could still be waiting to apply.
        None => vec![put(key, fsdp_proto::encode(record), 0)],
    };
    if base.is_some_and(|(b, _)| b.shards > 0) {
        // A placed round replaced by a whole one (the group shrank): nothing names its
        // shards any more. (A member still reading its own reads the run again.)
        then.extend(deletes(keys.stale_placements(None, None)));
    }
    TxnSpec {
        when: seal_fences(keys, fence, lease),
        then,
        otherwise: Vec::new(),
    }
}

/// What a seal is fenced on ([`commit_round`]).
fn seal_fences(keys: &Keys, fence: Option<i64>, lease: i64) -> Vec<Compare> {
    let key = keys.key::<v1::Round>("");
    vec![
        match fence {
            Some(rev) => Compare::ModRevision(key, rev),
            None => Compare::Absent(key),
        },
        Compare::Lease(keys.key::<v1::Coordinator>(""), lease),
        // Never after a halt, even one this coordinator has not seen yet.
        Compare::Absent(keys.key::<v1::Halt>("")),
    ]
}

/// A placed round's seal: the transactions that write its shards first, one at a time,
/// and then its header's ([`commit_placed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacedSeal {
    pub ahead: Vec<TxnSpec>,
    pub header: TxnSpec,
}

/// `record` sealed placed ([`crate::etcd::placement`]), fenced as [`commit_round`]: its
/// header at `ctl/round`, its shards outside `ctl/` under a name of this attempt's own
/// (`tag`: [`crate::etcd::placement::tag`] of the coordinating process's own lease and its
/// count of its placed seals), cut to `shape`. Shards that fit go in the header's
/// transaction; more (or more bytes than
/// [`crate::etcd::placement::SHARD_BYTES_PER_TXN`]) are written ahead, each
/// transaction fenced as the header is, so that no member reads a shard of a round that
/// was not sealed and a lost attempt's shards, late or not, are under a name no header
/// gives. The header's transaction deletes every other shard but those of the round it
/// replaces, which members that saw its header may still be reading. Fails when the
/// members' worker counts form no group.
pub fn commit_placed(
    keys: &Keys,
    fence: Option<i64>,
    lease: i64,
    record: &v1::Round,
    base: Option<(&v1::Round, i64)>,
    tag: String,
    shape: crate::etcd::placement::Shape,
) -> Result<PlacedSeal, String> {
    use crate::etcd::placement;
    let kept = base
        .filter(|(b, _)| b.shards > 0)
        .map(|(b, _)| b.placement.as_str());
    // Moves are said only from the round the seal replaces (its fence).
    let base = base.filter(|(_, rev)| fence == Some(*rev));
    debug_assert!(placement::tag_fits(&tag, record.number), "{tag}");
    let (mut header, shards) = placement::place(record, base, shape)?;
    header.placement = tag;
    let mut then = vec![put(
        keys.key::<v1::Round>(""),
        fsdp_proto::encode(&header),
        0,
    )];
    then.extend(deletes(
        keys.stale_placements(kept, Some(&header.placement)),
    ));
    let puts: Vec<(usize, Write)> = shards
        .iter()
        .map(|s| {
            let value = fsdp_proto::encode_packed(s);
            let key = keys.placement(&header.placement, s.shard);
            (value.len(), put(key, value, 0))
        })
        .collect();
    let mut ahead: Vec<TxnSpec> = Vec::new();
    let bytes: usize = puts.iter().map(|(size, _)| size).sum();
    if shards.len() <= shape.inline && bytes <= placement::SHARD_BYTES_PER_TXN {
        then.extend(puts.into_iter().map(|(_, w)| w));
    } else {
        let mut bytes = 0;
        for (size, w) in puts {
            let full = ahead.last().is_none_or(|t| {
                t.then.len() >= shape.per_txn || bytes + size > placement::SHARD_BYTES_PER_TXN
            });
            if full {
                ahead.push(TxnSpec {
                    when: seal_fences(keys, fence, lease),
                    ..TxnSpec::default()
                });
                bytes = 0;
            }
            bytes += size;
            if let Some(t) = ahead.last_mut() {
                t.then.push(w);
            }
        }
    }
    Ok(PlacedSeal {
        ahead,
        header: TxnSpec {
            when: seal_fences(keys, fence, lease),
            then,
            otherwise: Vec::new(),
        },
    })
}

/// `ranges` deleted.
fn deletes(ranges: Vec<(String, String)>) -> impl Iterator<Item = Write> {
    ranges
        .into_iter()
        .map(|(from, to)| Write::DeleteRange { from, to })
}

/// Out of every round until it registers again: the registration goes, the reason stays
/// (on the lease), and the coordinator role when `coordinating` (a healthy node takes
/// over).
pub fn withdrawal(
    keys: &Keys,
    node: &str,
    record: &v1::Unhealthy,
    lease: i64,
    coordinating: bool,
) -> TxnSpec {
    let mut then = vec![
        Write::Delete(keys.key::<v1::Member>(node)),
        put(keys.of(record), fsdp_proto::encode(record), lease),
    ];
    if coordinating {
        then.push(Write::Delete(keys.key::<v1::Coordinator>("")));
    }
    TxnSpec {
        then,
        ..TxnSpec::default()
    }
}
