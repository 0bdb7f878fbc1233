//! The last round this thread decoded, kept with the bytes it came from.
//!
//! Every member of a run takes each round it is sent, and the round is the one large
//! record (a member per node). Where one process holds many nodes (`rdzv-bench`: thousands
//! of simulated nodes on a few connections), each decoding the same bytes into its own
//! copy made the process decode N rounds of N members and hold them all: at 10,000 nodes,
//! 10^8 members, more than the machine's memory. Separate hosts each decode once, on
//! their own CPU; with the memo the nodes of one process decode once a thread between them
//! and share the members (each a counted handle, [`fsdp_proto::v1::Member`]). For an
//! agent, one node to a process, it costs a comparison of the bytes and a copy of the
//! member handles per round. Per thread, not per process: no lock for the runtime's
//! threads to wait on, and no thread's decoding changes what another's memo holds.

use std::cell::RefCell;

use fsdp_proto::{RecordError, decode, v1};

thread_local! {
    /// The bytes last decoded on this thread and what they decoded to.
    static LAST: RefCell<Option<(Vec<u8>, v1::Round)>> = const { RefCell::new(None) };
}

/// The round stored as `value` at `key`: the memo's if it came from the very same bytes,
/// else decoded (and then kept). A value that does not decode is not kept.
pub fn round(key: &str, value: &[u8]) -> Result<v1::Round, RecordError> {
    if let Some(round) = held(value) {
        return Ok(round);
    }
    let round = decode::<v1::Round>(key, value)?;
    LAST.with_borrow_mut(|last| *last = Some((value.to_vec(), round.clone())));
    Ok(round)
}

fn held(value: &[u8]) -> Option<v1::Round> {
    LAST.with_borrow(|last| {
        let (bytes, round) = last.as_ref()?;
        (bytes.as_slice() == value).then(|| round.clone())
    })
}

#[cfg(test)]
mod tests;
