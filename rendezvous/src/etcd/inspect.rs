//! A run's state as `fsdp-agent status` shows it: one ranged read of the run's keys
//! ([`inspect`]), decoded into a [`View`] and summarised by [`report()`], a pure function.
//! Its parts:
//!
//! * `report.rs` — the report and its rows, made of the view;
//! * `health.rs` — the verdict on the run, and why.

mod health;
mod report;
#[cfg(test)]
mod tests;

use etcd_client::{Client, GetOptions};
use fsdp_proto::v1;

pub use health::Health;
pub use report::{
    HangRound, LeftNode, MemberReport, MemberState, QuarantinedMachine, RunReport, UnhealthyNode,
    report,
};

use super::keys::Keys;
use super::view::View;
use crate::RendezvousError;

/// The rules the run's agents judge records by, as far as their registrations tell them:
/// the coordinator's `--nnodes` (else the first registration's). Status judges as the
/// agents do: a round larger than the run allows, or a halt no member wrote, is shown as
/// `refused`, not as the run's state.
fn told_bounds(keys: &Keys, kvs: &[etcd_client::KeyValue]) -> super::Allowed {
    let registrations: Vec<v1::Member> = kvs
        .iter()
        .filter(|kv| kv.key().starts_with(keys.members().as_bytes()))
        .filter_map(|kv| fsdp_proto::decode::<v1::Member>("", kv.value()).ok())
        .collect();
    let coordinator = kvs
        .iter()
        .find(|kv| kv.key() == keys.key::<v1::Coordinator>("").as_bytes())
        .and_then(|kv| fsdp_proto::decode::<v1::Coordinator>("", kv.value()).ok());
    let told = coordinator
        .and_then(|c| registrations.iter().find(|m| m.node_id == c.node_id))
        .or(registrations.first())
        .filter(|m| m.max_nodes > 0);
    let defaults = super::Allowed::default();
    super::Allowed {
        nodes: told.map_or(defaults.nodes.clone(), |m| 1..=m.max_nodes),
        ..defaults
    }
}

/// Reads the run's keys and summarises them; `Ok(None)` when the run has no keys at all.
pub async fn inspect(
    client: &mut Client,
    prefix: &str,
    run_id: &str,
) -> Result<Option<RunReport>, RendezvousError> {
    let keys = Keys::new(prefix, run_id).map_err(RendezvousError::InvalidConfig)?;
    let resp = super::connect::reader(client)
        .get(keys.root(), Some(GetOptions::new().with_prefix()))
        .await
        .map_err(|e| RendezvousError::Etcd {
            what: "reading the run's keys",
            source: e.into(),
        })?;
    if resp.kvs().is_empty() {
        return Ok(None);
    }
    let mut view = View {
        allowed: told_bounds(&keys, resp.kvs()),
        ..View::default()
    };
    for kv in resp.kvs() {
        let key = String::from_utf8_lossy(kv.key());
        view.put(
            &keys,
            &key,
            kv.value(),
            kv.create_revision(),
            kv.mod_revision(),
            kv.lease(),
        );
    }
    // A placed round's shards are in the read too: status shows the round whole.
    if let Some(header) = view.placing.clone() {
        let placements = keys.placement_of(&header.record.placement);
        let shards: Vec<v1::Placement> = resp
            .kvs()
            .iter()
            .map(|kv| (String::from_utf8_lossy(kv.key()), kv.value()))
            .filter(|(key, _)| key.starts_with(&placements))
            .filter_map(|(key, value)| fsdp_proto::decode(&key, value).ok())
            .collect();
        let whole = super::placement::whole(&header.record, &shards)
            .and_then(|r| super::record::set_placed(&mut view, r, header.mod_rev));
        if let Err(why) = whole {
            view.refuse(&keys.key::<v1::Round>(""), format!("placed round {why}"));
        }
    }
    // A halt is judged by the round it ends when that round comes after it in the read
    // (keys come sorted: `ctl/halt` before `ctl/round`). With no round at all (lost, or
    // refused as a forgery) nothing can vouch for its writer: shown refused, not halted.
    if view.round.is_none() && view.halt.is_some() {
        view.halt = None;
        let key = keys.key::<v1::Halt>("");
        let why = format!(
            "halt record at {key} names a writer no round of this run can vouch for (no round is readable)"
        );
        view.refused.insert(key, why);
    }
    Ok(Some(report(run_id, &view)))
}
