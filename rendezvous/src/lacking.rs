//! Who of one round the next lacks, as a pure function of the two member lists.
//!
//! Every agent asks this of every re-form, several times (the loss it reports, the detect
//! time it shows, the round it left). Sets of all N names built per question were a tenth
//! of an agent's CPU per re-form at 1,000 nodes. A round sealed after a change keeps the
//! survivors first and in their order (the coordinator's rule, and the shape a delta
//! writes), so one walk of both lists finds who went with one comparison per member;
//! rounds in another order fall back to a set.

use std::collections::HashSet;

/// More candidates than this from the walk, and the rounds are compared by a set: the
/// next round is in another order, or many went at once.
const FEW: usize = 8;

/// The ids of `before` that `after` lacks, in `before`'s order; `id` reads a member's id.
pub fn lacking<'a, T>(before: &'a [T], after: &[T], id: impl Fn(&T) -> &str) -> Vec<&'a str> {
    let mut next = after.iter().map(&id).peekable();
    let mut candidates = Vec::new();
    for m in before {
        let name = id(m);
        if next.peek().is_some_and(|n| *n == name) {
            next.next();
        } else {
            candidates.push(name);
            if candidates.len() > FEW {
                return by_set(before, after, id);
            }
        }
    }
    // A candidate the walk passed over is still in `after` only when `after` is in another
    // order: then the walk proves nothing.
    if candidates.iter().any(|c| after.iter().any(|m| id(m) == *c)) {
        return by_set(before, after, id);
    }
    candidates
}

fn by_set<'a, T>(before: &'a [T], after: &[T], id: impl Fn(&T) -> &str) -> Vec<&'a str> {
    let there: HashSet<&str> = after.iter().map(&id).collect();
    before
        .iter()
        .map(&id)
        .filter(|name| !there.contains(name))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    fn went(before: &str, after: &str) -> Vec<String> {
        let (b, a) = (names(before), names(after));
        lacking(&b, &a, String::as_str)
            .into_iter()
            .map(str::to_owned)
            .collect()
    }

    /// What a set of names would say, for comparison.
    fn by_sets(before: &str, after: &str) -> Vec<String> {
        let a = names(after);
        names(before)
            .into_iter()
            .filter(|n| !a.contains(n))
            .collect()
    }

    #[test]
    fn a_round_that_keeps_the_survivors_in_order_is_read_by_one_walk() {
        assert_eq!(went("a b c d", "a c d"), ["b"]);
        assert_eq!(went("a b c d", "a b c d e f"), Vec::<String>::new());
        assert_eq!(went("a b c d", "b d x"), ["a", "c"]);
        assert_eq!(went("a b c d", ""), ["a", "b", "c", "d"]);
        assert_eq!(went("", "a"), Vec::<String>::new());
    }

    #[test]
    fn any_order_and_any_number_gone_reads_as_sets_of_names_would() {
        let cases = [
            ("a b c d", "d c b a"),
            ("a b c d", "b a"),
            ("a b c d", "c x a"),
            ("a b c d e f g h i j k l", "l"),
            ("a b c d e f g h i j k l", "l k j"),
            ("a b a c", "a c"),
            ("a b c", "a a c"),
        ];
        for (before, after) in cases {
            assert_eq!(
                went(before, after),
                by_sets(before, after),
                "{before} -> {after}"
            );
        }
    }

    #[test]
    fn every_reordering_of_a_small_round_reads_as_sets_would() {
        // All subsets of five names, each in every rotation: orders the walk cannot trust.
        let all = ["a", "b", "c", "d", "e"];
        for mask in 0u32..32 {
            let kept: Vec<&str> = (0..5)
                .filter(|i| mask & (1 << i) != 0)
                .map(|i| all[i])
                .collect();
            for turn in 0..kept.len().max(1) {
                let mut order = kept.clone();
                let len = order.len();
                order.rotate_left(turn.min(len));
                let after = order.join(" ");
                assert_eq!(
                    went("a b c d e", &after),
                    by_sets("a b c d e", &after),
                    "{after}"
                );
            }
        }
    }
}
