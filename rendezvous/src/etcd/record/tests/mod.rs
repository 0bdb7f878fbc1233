//! The records of a run, tested by subject: the table of declarations (`table.rs`), the
//! round (`round.rs`), the halt (`halt.rs`), registrations (`members.rs`), departures
//! (`departures.rs`), and faults and quarantines (`faults.rs`). Every record kind has its
//! rule, and a record that breaks one is refused, never obeyed.

mod departures;
mod faults;
mod halt;
mod members;
mod round;
mod table;

use fsdp_proto::v1;

use super::*;

fn keys() -> Keys {
    Keys::new("/fsdp", "r").unwrap()
}

/// Where `key` is found, as the place of its declaration and its tail.
fn found(key: &str) -> (Place, String) {
    let (d, tail) = find(&keys(), key).unwrap_or_else(|| panic!("{key} is no record's"));
    (d.place, tail.to_owned())
}

fn halt(code: u32) -> v1::Halt {
    v1::Halt {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: "n1".into(),
        exit_code: code,
        ..Default::default()
    }
}

fn member(id: &str, local_world_size: u32) -> v1::Member {
    v1::Member::from(v1::MemberFields {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: id.into(),
        addr: "10.0.0.9".into(),
        local_world_size,
        ..Default::default()
    })
}

fn round(number: u64, members: Vec<v1::Member>) -> v1::Round {
    v1::Round {
        schema: fsdp_proto::SCHEMA_VERSION,
        number,
        members,
        ..Default::default()
    }
}

fn left(node: &str, incarnation: u64, kind: v1::LeftKind) -> v1::Left {
    v1::Left {
        schema: fsdp_proto::SCHEMA_VERSION,
        node_id: node.into(),
        incarnation,
        kind: kind.into(),
        detail: "health check failed 3 time(s) in a row: GPU 3 (exit code 79)".into(),
        ..Default::default()
    }
}

fn quarantine(until_ms: u64) -> v1::Quarantine {
    v1::Quarantine {
        schema: fsdp_proto::SCHEMA_VERSION,
        machine: "host-7".into(),
        node_id: "n1".into(),
        reason: "failed 3 rounds in a row".into(),
        until_ms,
    }
}
