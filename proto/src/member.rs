//! `fsdp.v1.Member` as records hold it: a shared handle to its fields.
//!
//! Every agent holds the group's round and applies each new round to it. A round of 1,000
//! members copied member by member was about 10,000 allocations and frees in every agent
//! at every re-form; malloc and free were a fifth of an agent's CPU then.
//! Shared, the next round is the kept members' handles plus the new ones: a count goes
//! up, no member's strings are copied.
//!
//! Reading a field goes through [`Deref`]; changing one copies the fields first if another
//! record still holds them ([`Arc::make_mut`]), so a change never shows in another round.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use prost::bytes::{Buf, BufMut};
use prost::encoding::{DecodeContext, WireType};

use crate::v1::MemberFields;

/// One node's registration, and one member of a round: `fsdp.v1.Member` on the wire.
#[derive(Clone, Default)]
pub struct Member(Arc<MemberFields>);

impl Member {
    /// Whether `a` and `b` are one record, not only equal ones.
    pub fn same(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

impl From<MemberFields> for Member {
    fn from(fields: MemberFields) -> Self {
        Self(Arc::new(fields))
    }
}

impl Deref for Member {
    type Target = MemberFields;
    fn deref(&self) -> &MemberFields {
        &self.0
    }
}

impl DerefMut for Member {
    fn deref_mut(&mut self) -> &mut MemberFields {
        Arc::make_mut(&mut self.0)
    }
}

impl PartialEq for Member {
    fn eq(&self, other: &Self) -> bool {
        Self::same(self, other) || self.0 == other.0
    }
}

impl Eq for Member {}

impl std::hash::Hash for Member {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state)
    }
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl prost::Message for Member {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        self.0.encode_raw(buf)
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        Arc::make_mut(&mut self.0).merge_field(tag, wire_type, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.0.encoded_len()
    }

    fn clear(&mut self) {
        // Cleared is the default: no need to copy fields only to empty them.
        self.0 = Arc::default();
    }
}

#[cfg(test)]
mod tests;
