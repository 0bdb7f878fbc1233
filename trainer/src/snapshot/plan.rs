//! Which step a new group rebuilds from memory, and which rank sends each part: a pure
//! function of what every rank said it holds, so every rank computes the same plan.

use std::collections::{BTreeMap, BTreeSet};

use super::{At, Tag};

/// One intact snapshot a rank of the new group holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// The holder's rank in the new group.
    pub holder: usize,
    pub tag: Tag,
    pub at: At,
}

/// The step to rebuild: the group whose parts make it, and for each of that group's ranks
/// (in rank order) the new rank that sends its part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub group: u64,
    pub world: u32,
    pub at: At,
    pub senders: Vec<usize>,
}

/// Why no step can be rebuilt from memory, for the line that says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Short {
    /// Nobody holds a snapshot (a new job, or every process is new).
    Nothing,
    /// The newest step held anywhere, and the parts of it nobody holds.
    Missing {
        step: u64,
        world: u32,
        missing: Vec<u32>,
    },
}

impl std::fmt::Display for Short {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Nothing => write!(f, "no rank holds a snapshot"),
            Self::Missing {
                step,
                world,
                missing,
            } => write!(
                f,
                "the newest step held, {step}, lacks the part of rank(s) {missing:?} of {world} (both copies lost)"
            ),
        }
    }
}

/// A step as one group held it: (step, group, world, position), ordered newest last.
type Candidate = (u64, u64, u32, At);

/// The newest step of which every part is held by someone, with the same position in
/// every part (a part that disagrees is not the same step). Ties (one step held whole in
/// two groups: a group that re-formed snapshots the step it rebuilt) go to the larger
/// group id, so every rank picks the same. Each part is sent by its lowest holder.
pub fn plan(entries: &[Entry]) -> Result<Plan, Short> {
    // (step, group, world, position) → rank → holders.
    let mut steps: BTreeMap<Candidate, BTreeMap<u32, BTreeSet<usize>>> = BTreeMap::new();
    for e in entries {
        if e.tag.rank < e.tag.world {
            steps
                .entry((e.at.step, e.tag.group, e.tag.world, e.at))
                .or_default()
                .entry(e.tag.rank)
                .or_default()
                .insert(e.holder);
        }
    }
    let whole = steps
        .iter()
        .rev()
        .find(|((_, _, world, _), ranks)| ranks.len() == *world as usize);
    if let Some(((_, group, world, at), ranks)) = whole {
        return Ok(Plan {
            group: *group,
            world: *world,
            at: *at,
            senders: ranks
                .values()
                .map(|h| h.first().copied().unwrap_or(0))
                .collect(),
        });
    }
    match steps.iter().next_back() {
        None => Err(Short::Nothing),
        Some(((step, _, world, _), ranks)) => Err(Short::Missing {
            step: *step,
            world: *world,
            missing: (0..*world).filter(|r| !ranks.contains_key(r)).collect(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(step: u64) -> At {
        At {
            step,
            samples_seen: step * 8,
            adam_step: step,
        }
    }

    fn e(holder: usize, group: u64, world: u32, rank: u32, step: u64) -> Entry {
        Entry {
            holder,
            tag: Tag { group, world, rank },
            at: at(step),
        }
    }

    /// Three ranks, each with its own last two steps and its buddy's (rank r holds
    /// r-1's): the lists a group of three keeps after step `s`.
    fn three_after(s: u64) -> Vec<(usize, Vec<Entry>)> {
        (0..3u32)
            .map(|r| {
                let buddy = (r + 2) % 3;
                let mut v = Vec::new();
                for step in [s - 1, s] {
                    v.push(e(0, 7, 3, r, step));
                    v.push(e(0, 7, 3, buddy, step));
                }
                (r as usize, v)
            })
            .collect()
    }

    /// The survivors' entries, renumbered as ranks of the new group.
    fn survivors(all: Vec<(usize, Vec<Entry>)>, lost: &[usize]) -> Vec<Entry> {
        all.into_iter()
            .filter(|(r, _)| !lost.contains(r))
            .enumerate()
            .flat_map(|(new, (_, v))| v.into_iter().map(move |x| Entry { holder: new, ..x }))
            .collect()
    }

    #[test]
    fn one_node_lost_rebuilds_the_newest_step_from_its_buddy() {
        let p = plan(&survivors(three_after(10), &[1])).unwrap();
        assert_eq!((p.group, p.world, p.at), (7, 3, at(10)));
        // Rank 1's part is held by old rank 2 (new rank 1), its buddy; rank 2's by
        // itself and by old rank 0, the lower.
        assert_eq!(p.senders, [0, 1, 0]);
    }

    #[test]
    fn a_copy_still_in_flight_falls_back_one_step_not_to_disk() {
        let mut all = three_after(10);
        // Old rank 2 never received rank 1's step 10: it holds 8 and 9 of it instead.
        for x in &mut all[2].1 {
            if x.tag.rank == 1 && x.at.step == 10 {
                *x = e(0, 7, 3, 1, 8);
            }
        }
        let p = plan(&survivors(all, &[1])).unwrap();
        assert_eq!(p.at, at(9));
    }

    #[test]
    fn both_copies_lost_is_said_with_what_is_missing() {
        let short = plan(&survivors(three_after(10), &[1, 2])).unwrap_err();
        assert_eq!(
            short,
            Short::Missing {
                step: 10,
                world: 3,
                missing: vec![1]
            }
        );
        assert!(short.to_string().contains("both copies lost"));
        assert_eq!(plan(&[]).unwrap_err(), Short::Nothing);
    }

    #[test]
    fn a_joiner_holds_nothing_and_parts_that_disagree_are_not_one_step() {
        let mut entries = survivors(three_after(10), &[]);
        // A fourth, new process: nothing. The plan is the same.
        assert_eq!(plan(&entries).unwrap().senders, [0, 1, 0]);
        // Rank 0's own copy of step 10 says another sample count: corrupt or another run.
        for x in &mut entries {
            if x.tag.rank == 0 && x.at.step == 10 {
                x.at.samples_seen += 1;
            }
        }
        assert_eq!(plan(&entries).unwrap().at, at(9));
    }

    #[test]
    fn a_step_rebuilt_in_a_new_group_is_read_from_that_group() {
        let mut entries = survivors(three_after(10), &[1]);
        // The group of two that formed snapshotted step 10 again under its id 9.
        entries.push(e(0, 9, 2, 0, 10));
        entries.push(e(1, 9, 2, 1, 10));
        let p = plan(&entries).unwrap();
        assert_eq!((p.group, p.world, p.senders.clone()), (9, 2, vec![0, 1]));
    }
}
