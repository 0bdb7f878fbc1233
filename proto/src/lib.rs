//! Protobuf records that fsdp-agent stores in etcd, and its gRPC status service
//! (`fsdp.v1.AgentStatus`, with generated server and client in [`v1`]); and, in
//! [`etcdserverpb`], the servers of the part of etcd's v3 API that the embedded store of
//! `--rdzv-backend c10d` answers.
//!
//! Domain code never works on these types directly: the rendezvous crate decodes them with
//! [`decode`], which checks the schema version and names the key in every error, and then
//! converts them into its own types.

/// Generated types of `fsdp.v1`.
pub mod v1 {
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

/// Decodes the value stored at `key`, refusing garbage and other schema versions.
pub fn decode<T: Versioned>(key: &str, bytes: &[u8]) -> Result<T, RecordError> {
    let record = T::decode(bytes).map_err(|source| RecordError::Malformed {
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
        v1::Member {
            schema: SCHEMA_VERSION,
            node_id: "host-a-123-x".into(),
            addr: "10.0.0.5".into(),
            local_world_size: 8,
            wants_round: 3,
            ..Default::default()
        }
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

    #[test]
    fn missing_schema_is_refused() {
        let mut m = member();
        m.schema = 0;
        let err = decode::<v1::Member>("/k", &m.encode_to_vec()).unwrap_err();
        assert!(matches!(err, RecordError::Schema { found: 0, .. }), "{err}");
    }
}
