//! Naming the rank behind a hang across nodes.
//!
//! In a synchronous job every rank waits in the same collective, so when the group hangs
//! the ranks that reached it finished the same step and the one that did not is a step
//! (or more) behind. Each node of the hung round publishes where its ranks were
//! ([`fsdp_rendezvous::HangReport`]); [`blame`] compares them, a pure function, and the
//! node that declared the hang logs and shows its words.

use fsdp_rendezvous::HangReport;

/// Who a hang points at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blame {
    /// `(node, rank)` of every rank behind the furthest step, by rank.
    pub behind: Vec<(String, u32)>,
    /// One line for logs and status, e.g. "rank 3 on node b last finished step 9; all
    /// others finished step 10".
    pub text: String,
}

/// Compares the reports of a hung round whose members were `members`.
pub fn blame(reports: &[HangReport], members: &[String]) -> Blame {
    let mut ranks: Vec<(&str, &fsdp_rendezvous::RankStep)> = reports
        .iter()
        .flat_map(|r| r.ranks.iter().map(move |s| (r.node_id.as_str(), s)))
        .collect();
    ranks.sort_by_key(|(_, s)| s.rank);
    let furthest = ranks.iter().filter_map(|(_, s)| s.last_step).max();
    let behind: Vec<(&str, &fsdp_rendezvous::RankStep)> = ranks
        .iter()
        .filter(|(_, s)| furthest.is_some() && s.last_step < furthest)
        .copied()
        .collect();
    let mut parts = Vec::new();
    match (furthest, behind.as_slice()) {
        (None, _) if ranks.is_empty() => parts.push("no rank reported progress".to_owned()),
        (None, _) => parts.push("no rank finished a step yet".to_owned()),
        (Some(f), []) => parts.push(format!(
            "every reporting rank finished step {f}: none is behind (a collective itself may be stuck, e.g. the network)"
        )),
        (Some(f), [(node, s)]) => parts.push(format!(
            "rank {} on node {node} last finished {}; all others finished step {f}",
            s.rank,
            step_words(s.last_step)
        )),
        (Some(f), many) => {
            let each: Vec<String> = many
                .iter()
                .map(|(node, s)| {
                    format!("rank {} on node {node} ({})", s.rank, step_words(s.last_step))
                })
                .collect();
            parts.push(format!(
                "{} are behind; the others finished step {f}",
                each.join(", ")
            ));
        }
    }
    for (node, s) in &ranks {
        if let Some(p) = &s.phase {
            parts.push(format!("rank {} on node {node} was in phase '{p}'", s.rank));
        }
    }
    let silent: Vec<&str> = members
        .iter()
        .map(String::as_str)
        .filter(|m| !reports.iter().any(|r| r.node_id == *m))
        .collect();
    if !silent.is_empty() {
        parts.push(format!(
            "no report from node {} (gone, or its ranks do not report progress)",
            silent.join(", ")
        ));
    }
    Blame {
        behind: behind
            .iter()
            .map(|(node, s)| ((*node).to_owned(), s.rank))
            .collect(),
        text: parts.join("; "),
    }
}

fn step_words(step: Option<u64>) -> String {
    match step {
        Some(n) => format!("step {n}"),
        None => "no step".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fsdp_rendezvous::RankStep;

    fn node(id: &str, ranks: &[(u32, Option<u64>)]) -> HangReport {
        HangReport {
            node_id: id.into(),
            declared: false,
            reason: String::new(),
            ranks: ranks
                .iter()
                .map(|&(rank, last_step)| RankStep {
                    rank,
                    last_step,
                    phase: None,
                })
                .collect(),
        }
    }

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn the_one_rank_a_step_behind_is_named_with_its_node() {
        let reports = [
            node("pod0", &[(0, Some(10)), (1, Some(10))]),
            node("pod1", &[(2, Some(10)), (3, Some(9))]),
        ];
        let b = blame(&reports, &ids(&["pod0", "pod1"]));
        assert_eq!(b.behind, [("pod1".to_owned(), 3)]);
        assert_eq!(
            b.text,
            "rank 3 on node pod1 last finished step 9; all others finished step 10"
        );
    }

    #[test]
    fn several_behind_are_all_named_and_a_rank_without_steps_is_behind() {
        let reports = [
            node("a", &[(0, Some(5)), (1, None)]),
            node("b", &[(2, Some(4)), (3, Some(5))]),
        ];
        let b = blame(&reports, &ids(&["a", "b"]));
        assert_eq!(b.behind, [("a".to_owned(), 1), ("b".to_owned(), 2)]);
        assert!(
            b.text
                .starts_with("rank 1 on node a (no step), rank 2 on node b (step 4) are behind"),
            "{}",
            b.text
        );
    }

    #[test]
    fn nobody_is_blamed_when_every_rank_reached_the_same_step() {
        let reports = [node("a", &[(0, Some(7))]), node("b", &[(1, Some(7))])];
        let b = blame(&reports, &ids(&["a", "b"]));
        assert!(b.behind.is_empty());
        assert!(b.text.contains("none is behind"), "{}", b.text);
    }

    #[test]
    fn silent_nodes_and_phases_are_said() {
        let mut a = node("a", &[(0, Some(7))]);
        a.ranks[0].phase = Some("checkpoint".into());
        let b = blame(&[a], &ids(&["a", "b", "c"]));
        assert!(
            b.text
                .contains("rank 0 on node a was in phase 'checkpoint'"),
            "{}",
            b.text
        );
        assert!(b.text.contains("no report from node b, c"), "{}", b.text);
        let none = blame(&[], &ids(&["a"]));
        assert!(
            none.text.starts_with("no rank reported progress"),
            "{}",
            none.text
        );
    }
}
