//! Where a node sits in the network (its segment), and what the seal rule makes of it: the
//! rank order, and with a segment size the nodes that may form a round. Pure functions.
//!
//! A segment is a path of names from the widest part of the network down to the smallest
//! group of nodes that share a fast link, separated by `/`: `us-east-1a/rack-17`, or the
//! switches above a Slurm node (`s0/s1`). Ring and tree collectives send most of their
//! bytes between neighbouring ranks, and FSDP's shards are laid out along the ranks: ranks
//! in an order that keeps each segment together keep that traffic under the switch the
//! segment shares, where a join order scatters it across the spine.

use std::cmp::Ordering;
use std::collections::HashMap;

use crate::text::NAME_MAX;

/// The longest segment: it is shown where node names are, and a DNS name's limit is
/// room for any real switch path.
pub const SEGMENT_MAX: usize = NAME_MAX;

/// Why a segment is refused. Each says what a good one looks like; the caller names where
/// it came from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SegmentError {
    #[error(
        "is empty; give a path of names separated by '/', widest first (e.g. zone-a/rack-3), or leave it out for no location"
    )]
    Empty,
    #[error("is {chars} characters long; a segment is at most {SEGMENT_MAX}")]
    TooLong { chars: usize },
    #[error(
        "has an empty name (a '/' at either end, or two in a row); separate names with single '/', e.g. zone-a/rack-3"
    )]
    EmptyName,
    #[error(
        "has a space or a control character ({found}); names are printable, without spaces (e.g. zone-a/rack-3)"
    )]
    Unprintable { found: String },
}

/// Checks a segment as an agent is given it, before it registers with it: non-empty, at
/// most [`SEGMENT_MAX`] characters, names between single `/`, printable, no spaces.
pub fn check(segment: &str) -> Result<(), SegmentError> {
    if segment.is_empty() {
        return Err(SegmentError::Empty);
    }
    let chars = segment.chars().count();
    if chars > SEGMENT_MAX {
        return Err(SegmentError::TooLong { chars });
    }
    if let Some(c) = segment
        .chars()
        .find(|c| c.is_control() || c.is_whitespace())
    {
        return Err(SegmentError::Unprintable {
            found: c.escape_unicode().to_string(),
        });
    }
    if segment.split('/').any(str::is_empty) {
        return Err(SegmentError::EmptyName);
    }
    Ok(())
}

/// How two segments sort: name by name, so that every prefix is one contiguous run (a
/// plain string order would put `a/b-x` between `a/b` and `a/b/c` once depths differ); no
/// location after every location.
pub fn compare(a: &str, b: &str) -> Ordering {
    a.is_empty()
        .cmp(&b.is_empty())
        .then_with(|| a.split('/').cmp(b.split('/')))
}

/// Puts `nodes` in rank order: nodes that share the longest prefix of their segment next
/// to each other. The sort is stable, so within one segment (and among the nodes with no
/// location, which come last) the order given is kept: the survivors of a round keep
/// their relative order, which is what lets a re-form be written as a small delta
/// (`etcd::roster::delta`). With no location anywhere nothing moves.
pub fn order<T>(nodes: &mut [T], segment: impl Fn(&T) -> &str) {
    if nodes.iter().all(|n| segment(n).is_empty()) {
        return;
    }
    nodes.sort_by(|a, b| compare(segment(a), segment(b)));
}

/// The nodes a round of whole blocks may take: from `nodes`, in the order of preference
/// given (survivors first), each segment's nodes in blocks of `size`, a block taken once
/// its last node is reached, until `max` nodes are taken. Nodes of a segment left short
/// of a block are not taken (they wait as spares); nodes with no location count as one
/// segment of their own. Returns the nodes taken, in the order given. A `size` of 0 or 1
/// takes the first `max`.
pub fn blocks<T: Copy>(
    nodes: &[T],
    size: usize,
    max: usize,
    segment: impl Fn(&T) -> &str,
) -> Vec<T> {
    if size <= 1 {
        return nodes.iter().copied().take(max).collect();
    }
    let mut filling: HashMap<&str, Vec<usize>> = HashMap::new();
    let mut taken = vec![false; nodes.len()];
    let mut count = 0;
    for (i, n) in nodes.iter().enumerate() {
        if count + size > max {
            break;
        }
        let block = filling.entry(segment(n)).or_default();
        block.push(i);
        if block.len() == size {
            for j in block.drain(..) {
                taken[j] = true;
            }
            count += size;
        }
    }
    nodes
        .iter()
        .zip(taken)
        .filter_map(|(n, t)| t.then_some(*n))
        .collect()
}

/// The most nodes a round of whole blocks of `size` can have under `max`.
pub fn most(size: u32, max: u32) -> u32 {
    let size = size.max(1);
    max - max % size
}

/// Checks a segment size against `--nnodes MIN:MAX`: some multiple of it must lie between
/// them. The error says what to change.
pub fn check_size(size: u32, (min, max): (u32, u32)) -> Result<(), String> {
    if size == 0 {
        return Err("must be at least 1 (1: rounds of any size)".into());
    }
    let least = min.div_ceil(size).max(1) * size;
    if least > max {
        return Err(format!(
            "no multiple of {size} lies within --nnodes {min}:{max}, so no round could form; give a size that divides a node count in that range, or widen --nnodes"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
