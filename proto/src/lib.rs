//! Protobuf records that fsdp-agent stores in etcd, and its gRPC status service
//! (`fsdp.v1.AgentStatus`, with generated server and client in [`v1`]); and, in
//! [`etcdserverpb`], the servers of the part of etcd's v3 API that the embedded store of
//! `--rdzv-backend c10d` answers.
//!
//! The rendezvous crate reads records only through [`decode`], which checks the schema
//! version and names the key in every error, and writes them with [`encode`], which stores
//! a large record packed (zstd), so that a round of tens of thousands of members stays
//! within etcd's request limit. A member is [`v1::Member`], a shared handle to its
//! [`v1::MemberFields`]: every agent makes each new round from the one it holds, and a
//! member kept from one round to the next is not copied.

mod member;

/// Generated types of `fsdp.v1`; a member is [`v1::Member`], a shared handle to its
/// [`v1::MemberFields`].
pub mod v1 {
    pub use crate::member::Member;
    include!(concat!(env!("OUT_DIR"), "/fsdp.v1.rs"));
}

/// Generated messages and servers of the etcd v3 API subset (`proto/etcdserverpb/store.proto`).
pub mod etcdserverpb {
    include!(concat!(env!("OUT_DIR"), "/etcdserverpb.rs"));
}

/// The encoded `FileDescriptorSet` of every `fsdp.v1` file, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/fsdp_descriptor.bin"));

/// The schema version this build writes and accepts.
pub const SCHEMA_VERSION: u32 = 1;

/// A stored value that is not a record this build can trust.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("value at {key} is not a valid packed {kind} record: {why}")]
    Packed {
        key: String,
        kind: &'static str,
        why: String,
    },
    #[error("value at {key} is not a valid {kind} record (foreign or corrupted data)")]
    Malformed {
        key: String,
        kind: &'static str,
        #[source]
        source: prost::DecodeError,
    },
    #[error(
        "{kind} record at {key} has schema {found}, this agent understands {SCHEMA_VERSION}; run agents of one version per job"
    )]
    Schema {
        key: String,
        kind: &'static str,
        found: u32,
    },
}

/// Records whose plain encoding is longer than this are stored packed (see [`encode`]).
/// Small records, nearly all of them, stay plain protobuf.
pub const PACK_ABOVE: usize = 16 * 1024;

/// The most a packed value may unpack to: far above any real record (a round of 100,000
/// members is ~13 MB), and a bound on what one forged value can make an agent allocate.
pub const UNPACKED_AT_MOST: u64 = 64 << 20;

/// What a packed value starts with, before its zstd frame. A 0 byte can start no protobuf
/// message (field number 0 is invalid), so no plain record reads as packed, and an agent
/// from before packing refuses a packed record as malformed instead of misreading it.
const PACKED: &[u8] = b"\0zst";

/// A record with a schema version field.
pub trait Versioned: prost::Message + Default {
    /// Name used in error messages.
    const KIND: &'static str;
    fn schema(&self) -> u32;
}

macro_rules! versioned {
    ($($t:ident => $kind:literal),* $(,)?) => {
        $(impl Versioned for v1::$t {
            const KIND: &'static str = $kind;
            fn schema(&self) -> u32 {
                self.schema
            }
        })*
    };
}

versioned!(Member => "member", Round => "round", Roster => "roster", Master => "master", Failure => "failure", Coordinator => "coordinator", Done => "done", Gone => "gone", HangReport => "hang report", Halt => "halt", Unhealthy => "unhealthy", Fault => "fault", Quarantine => "quarantine", Left => "left");

/// `record` as stored: its protobuf encoding, packed when that is longer than
/// [`PACK_ABOVE`] and packing makes it shorter.
///
/// Why: etcd takes at most 1.5 MiB in one request by default, and a round of 10,000
/// members with real host names is ~1.3 MB plain (about 130 bytes a member), so a job of
/// ~12,000 nodes could never seal its first round. Packed, the same round is ~0.36 MB
/// (what stays is the random part of each member: its lease, pid and suffix). And every
/// member is sent the whole first round by its watch: a quarter of the bytes is a quarter
/// of the load on etcd at formation.
pub fn encode<T: Versioned>(record: &T) -> Vec<u8> {
    let plain = record.encode_to_vec();
    if plain.len() <= PACK_ABOVE {
        return plain;
    }
    // Level 1: the coordinator packs a round at every seal, and zstd's fastest level
    // already removes what repeats (host names, the run's settings in every member).
    match zstd::bulk::compress(&plain, 1) {
        Ok(z) if PACKED.len() + z.len() < plain.len() => [PACKED, &z].concat(),
        _ => plain,
    }
}

/// The protobuf bytes of a stored value: itself if plain, unpacked if packed. A packed
/// value must say how long it unpacks to, at most [`UNPACKED_AT_MOST`].
pub fn unpack(bytes: &[u8]) -> Result<std::borrow::Cow<'_, [u8]>, String> {
    let Some(frame) = bytes.strip_prefix(PACKED) else {
        return Ok(std::borrow::Cow::Borrowed(bytes));
    };
    // zstd says "unknown" as u64::MAX and "not a frame" as u64::MAX - 1: past the bound too.
    let size = zstd::zstd_safe::get_frame_content_size(frame);
    if size > UNPACKED_AT_MOST {
        return Err(if size >= u64::MAX - 1 {
            "its frame does not say how long it unpacks to".to_owned()
        } else {
            format!("it would unpack to {size} bytes, more than {UNPACKED_AT_MOST}")
        });
    }
    let plain = zstd::bulk::decompress(frame, size as usize).map_err(|e| e.to_string())?;
    if plain.len() as u64 != size {
        return Err(format!(
            "it unpacked to {} bytes, not the {size} its frame says",
            plain.len()
        ));
    }
    Ok(std::borrow::Cow::Owned(plain))
}

/// Decodes the value stored at `key` (plain or packed), refusing garbage and other schema
/// versions.
pub fn decode<T: Versioned>(key: &str, bytes: &[u8]) -> Result<T, RecordError> {
    let bytes = unpack(bytes).map_err(|why| RecordError::Packed {
        key: key.to_owned(),
        kind: T::KIND,
        why,
    })?;
    let record = T::decode(&*bytes).map_err(|source| RecordError::Malformed {
        key: key.to_owned(),
        kind: T::KIND,
        source,
    })?;
    if record.schema() != SCHEMA_VERSION {
        return Err(RecordError::Schema {
            key: key.to_owned(),
            kind: T::KIND,
            found: record.schema(),
        });
    }
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn member() -> v1::Member {
        v1::MemberFields {
            schema: SCHEMA_VERSION,
            node_id: "host-a-123-x".into(),
            addr: "10.0.0.5".into(),
            local_world_size: 8,
            wants_round: 3,
            ..Default::default()
        }
        .into()
    }

    #[test]
    fn round_trip() {
        let bytes = member().encode_to_vec();
        let back: v1::Member = decode("/k", &bytes).unwrap();
        assert_eq!(back, member());
    }

    #[test]
    fn garbage_is_an_error_naming_the_key() {
        let err = decode::<v1::Round>("/fsdp/job/round", b"\xff\xff\xff garbage").unwrap_err();
        assert!(err.to_string().contains("/fsdp/job/round"), "{err}");
    }

    /// A round of `n` members named as a real job's hosts are: a long host name, a pid
    /// and a random suffix in each id, its own lease.
    fn real_round(n: usize) -> v1::Round {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut rand = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let members = (0..n)
            .map(|i| {
                let host = format!("llama70b-pretrain-worker-{i}");
                let r = rand();
                v1::MemberFields {
                    schema: SCHEMA_VERSION,
                    node_id: format!("{host}-{}-{:08x}", r % 4_000_000, r >> 32),
                    status_addr: format!(
                        "10.{}.{}.{}:29401",
                        r % 256,
                        (r >> 8) % 256,
                        (r >> 16) % 254
                    ),
                    addr: host,
                    local_world_size: 8,
                    wants_round: 1,
                    lease: (rand() >> 1) as i64,
                    incarnation: 1,
                    min_nodes: n as u32 - 1,
                    max_nodes: n as u32,
                    max_restarts: Some(3),
                    restart_window_s: 3600,
                    job: String::new(),
                }
                .into()
            })
            .collect();
        v1::Round {
            schema: SCHEMA_VERSION,
            number: 1,
            members,
            sealed_at_ms: 1_764_000_000_000,
            reason: "first round".into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_large_record_is_stored_packed_and_reads_back_the_same() {
        let round = real_round(1_000);
        let stored = encode(&round);
        assert!(stored.starts_with(PACKED));
        assert!(
            stored.len() * 3 < round.encoded_len(),
            "{} bytes",
            stored.len()
        );
        let back: v1::Round = decode("/fsdp/job/ctl/round", &stored).unwrap();
        assert_eq!(back, round);
    }

    #[test]
    fn a_small_record_stays_plain_protobuf() {
        assert_eq!(encode(&member()), member().encode_to_vec());
    }

    /// What packing is for: etcd refuses a request over 1.5 MiB by default, and a round
    /// of 15,000 members named as real hosts are is ~2.0 MB plain, ~0.54 MB packed (about 36
    /// bytes a member: 1.5 MiB holds ~40,000).
    #[test]
    fn a_round_of_fifteen_thousand_real_hosts_fits_etcds_default_request_limit_packed() {
        let round = real_round(15_000);
        assert!(
            round.encoded_len() > 3 << 19,
            "plain: {}",
            round.encoded_len()
        );
        let stored = encode(&round);
        assert!(stored.len() < 1 << 20, "packed: {} bytes", stored.len());
    }

    #[test]
    fn a_packed_value_that_would_unpack_past_the_bound_is_refused_unread() {
        // A frame whose header says 1 GiB: refused from the header, nothing allocated.
        let mut big = Vec::new();
        {
            let mut enc = zstd::stream::Encoder::new(&mut big, 1).unwrap();
            enc.set_pledged_src_size(Some(1 << 30)).unwrap();
            enc.include_contentsize(true).unwrap();
            std::io::Write::write_all(&mut enc, &[0u8; 1 << 16]).unwrap();
            // Not finished (it would fail short of the pledge): the header is written.
            std::io::Write::flush(&mut enc).unwrap();
        }
        let value = [PACKED, &big].concat();
        let err = decode::<v1::Round>("/fsdp/job/ctl/round", &value).unwrap_err();
        assert!(err.to_string().contains("more than"), "{err}");
        let err = decode::<v1::Round>("/k", b"\0zst not a frame").unwrap_err();
        assert!(matches!(err, RecordError::Packed { .. }), "{err}");
    }

    #[test]
    fn missing_schema_is_refused() {
        let mut m = member();
        m.schema = 0;
        let err = decode::<v1::Member>("/k", &m.encode_to_vec()).unwrap_err();
        assert!(matches!(err, RecordError::Schema { found: 0, .. }), "{err}");
    }
}
