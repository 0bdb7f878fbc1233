//! Slurm's host-list syntax (`SLURM_STEP_NODELIST`, `SLURM_JOB_NODELIST`), read without
//! calling `scontrol show hostnames`: a node of the step need not have the client tools.
//!
//! `n[1-3,5]` is n1 n2 n3 n5; `gpu-[001-016]` keeps the zero padding of the range's first
//! number; `a,b[1-2],c` is several entries; `rack[1-2]-n[1-2]` (several brackets in one
//! name) is every combination, left bracket outermost, as Slurm writes them.
//!
//! The agent needs the first host and whether a name is in the list, so the list is never
//! expanded: `n[1-99999999]` took 2.7 GB and then aborted, and a range of 10^12 numbers
//! aborted at once. [`first`] reads the first number of each bracket, [`contains`] matches
//! a name against the pattern; both check the whole list's syntax first ([`check`]).

/// The first host of `list`, in Slurm's order. An error says what in the list is malformed.
pub fn first(list: &str) -> Result<String, String> {
    let entries = check(list)?;
    let entry = entries
        .first()
        .ok_or_else(|| format!("no host in '{list}'"))?;
    Ok(first_of(entry))
}

/// Whether `host` is one of the hosts of `list`.
pub fn contains(list: &str, host: &str) -> Result<bool, String> {
    Ok(check(list)?.iter().any(|entry| matches(entry, host)))
}

/// The non-empty entries of `list`, each checked: brackets closed, ranges of numbers that
/// do not run backwards.
fn check(list: &str) -> Result<Vec<&str>, String> {
    let entries: Vec<&str> = split_top_level(list)?
        .into_iter()
        .filter(|e| !e.is_empty())
        .collect();
    if entries.is_empty() {
        return Err(format!("no host in '{list}'"));
    }
    for entry in &entries {
        let mut rest = *entry;
        while let Some((_, inside, after)) = bracket(rest) {
            ranges(inside, entry)?;
            rest = after;
        }
    }
    Ok(entries)
}

/// The text before the first bracket of `entry`, the bracket's inside and what follows it.
fn bracket(entry: &str) -> Option<(&str, &str, &str)> {
    let open = entry.find('[')?;
    // split_top_level checked that every '[' has its ']'.
    let close = open + entry[open..].find(']')?;
    Some((&entry[..open], &entry[open + 1..close], &entry[close + 1..]))
}

/// One range of a bracket: its bounds and the width its numbers are written with.
#[derive(Debug, Clone, Copy)]
struct Range {
    from: u64,
    to: u64,
    width: usize,
}

/// The ranges of one bracket's inside, `1-3,5` or `001-016`.
fn ranges(inside: &str, entry: &str) -> Result<Vec<Range>, String> {
    let mut out = Vec::new();
    for range in inside.split(',').map(str::trim) {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let (lo, hi) = (lo.trim(), hi.trim());
        let parse = |s: &str| {
            s.parse::<u64>()
                .ok()
                .filter(|_| s.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| format!("'{range}' in '{entry}' is not a number or a range a-b"))
        };
        let (from, to) = (parse(lo)?, parse(hi)?);
        if from > to {
            return Err(format!("range '{range}' in '{entry}' runs backwards"));
        }
        // Slurm pads to the width of the first number when it is written with zeros.
        let width = if lo.len() > 1 && lo.starts_with('0') {
            lo.len()
        } else {
            0
        };
        out.push(Range { from, to, width });
    }
    Ok(out)
}

/// The first host an entry names: the first number of each bracket. `entry` is checked.
fn first_of(entry: &str) -> String {
    let Some((prefix, inside, after)) = bracket(entry) else {
        return entry.to_owned();
    };
    let r = ranges(inside, entry).ok().and_then(|r| r.first().copied());
    let number = r.map_or(String::new(), |r| format!("{:0w$}", r.from, w = r.width));
    format!("{prefix}{number}{}", first_of(after))
}

/// Whether `host` is one of the names `entry` stands for. `entry` is checked.
fn matches(entry: &str, host: &str) -> bool {
    let Some((prefix, inside, after)) = bracket(entry) else {
        return entry == host;
    };
    let Some(rest) = host.strip_prefix(prefix) else {
        return false;
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let Ok(ranges) = ranges(inside, entry) else {
        return false;
    };
    // The number is a run of the digits that follow; the rest must match what follows
    // the bracket (which may itself start with digits).
    (1..=digits.min(20)).any(|len| {
        let written = &rest[..len];
        let Ok(n) = written.parse::<u64>() else {
            return false;
        };
        ranges
            .iter()
            .any(|r| (r.from..=r.to).contains(&n) && format!("{n:0w$}", w = r.width) == written)
            && matches(after, &rest[len..])
    })
}

/// The entries of a list: split at the commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let mut entries = Vec::new();
    let (mut depth, mut start) = (0u32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth > 0 => return Err(format!("nested '[' in '{list}'")),
            '[' => depth = 1,
            ']' if depth == 0 => return Err(format!("']' without '[' in '{list}'")),
            ']' => depth = 0,
            ',' if depth == 0 => {
                entries.push(list[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err(format!("'[' without ']' in '{list}'"));
    }
    entries.push(list[start..].trim());
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every host of `list`, expanded: the tests' reference for [`first`] and
    /// [`contains`] on small lists.
    fn expand(list: &str) -> Result<Vec<String>, String> {
        fn entry_hosts(entry: &str) -> Vec<String> {
            let Some((prefix, inside, after)) = bracket(entry) else {
                return vec![entry.to_owned()];
            };
            let tails = entry_hosts(after);
            let mut out = Vec::new();
            for r in ranges(inside, entry).unwrap() {
                for n in r.from..=r.to {
                    for t in &tails {
                        out.push(format!("{prefix}{n:0w$}{t}", w = r.width));
                    }
                }
            }
            out
        }
        Ok(check(list)?.into_iter().flat_map(entry_hosts).collect())
    }

    /// The hosts of `list`, checked against what [`first`] and [`contains`] say of it.
    fn hosts(list: &str) -> Vec<String> {
        let all = expand(list).unwrap_or_else(|e| panic!("{list}: {e}"));
        assert_eq!(first(list).unwrap(), all[0], "{list}");
        for h in &all {
            assert!(contains(list, h).unwrap(), "{list} holds {h}");
        }
        all
    }

    #[test]
    fn a_plain_name_is_itself() {
        assert_eq!(hosts("node7"), ["node7"]);
    }

    #[test]
    fn ranges_and_single_numbers_in_one_bracket() {
        assert_eq!(hosts("n[1-3,5]"), ["n1", "n2", "n3", "n5"]);
        assert_eq!(hosts("n[8-10]"), ["n8", "n9", "n10"]);
    }

    #[test]
    fn zero_padding_follows_the_first_number() {
        let h = hosts("gpu-[001-016]");
        assert_eq!(h.len(), 16);
        assert_eq!((h[0].as_str(), h[15].as_str()), ("gpu-001", "gpu-016"));
        assert_eq!(hosts("gpu-[09-11]"), ["gpu-09", "gpu-10", "gpu-11"]);
    }

    #[test]
    fn several_entries_split_only_outside_brackets() {
        assert_eq!(hosts("a,b[1-2],c"), ["a", "b1", "b2", "c"]);
        assert_eq!(
            hosts("cpu[1-2],gpu[01,03]"),
            ["cpu1", "cpu2", "gpu01", "gpu03"]
        );
    }

    #[test]
    fn several_brackets_in_one_name_are_every_combination() {
        assert_eq!(
            hosts("rack[1-2]-n[1-2]"),
            ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
        );
        assert_eq!(hosts("n[1-2].ib"), ["n1.ib", "n2.ib"]);
    }

    #[test]
    fn malformed_lists_say_what_is_wrong() {
        for (list, part) in [
            ("n[1-3", "without ']'"),
            ("n1-3]", "without '['"),
            ("n[3-1]", "backwards"),
            ("n[a-b]", "not a number"),
            ("n[[1]]", "nested"),
            ("", "no host"),
        ] {
            for err in [
                first(list).expect_err(list),
                contains(list, "n1").expect_err(list),
            ] {
                assert!(err.contains(part), "{list}: {err}");
            }
        }
    }

    #[test]
    fn names_outside_the_list_are_not_in_it() {
        for (list, host) in [
            ("n[1-3,5]", "n4"),
            ("n[1-3]", "n01"),
            ("gpu-[001-016]", "gpu-1"),
            ("gpu-[001-016]", "gpu-017"),
            ("rack[1-2]-n[1-2]", "rack1-n3"),
            ("n[1-2].ib", "n1"),
            ("a,b", "c"),
        ] {
            assert!(
                !contains(list, host).unwrap(),
                "{list} does not hold {host}"
            );
        }
    }

    /// Only the first host is ever built: a range of a hundred million, or of 10^12 padded
    /// numbers, costs nothing (it took 2.7 GB and aborted, or aborted at once).
    #[test]
    fn huge_ranges_are_never_expanded() {
        assert_eq!(first("n[1-99999999]").unwrap(), "n1");
        assert!(contains("n[1-99999999]", "n99999999").unwrap());
        assert!(!contains("n[1-99999999]", "n100000000").unwrap());
        let huge = "n[000000000000-999999999999]";
        assert_eq!(first(huge).unwrap(), "n000000000000");
        assert!(contains(huge, "n000000012345").unwrap());
        assert!(!contains(huge, "n12345").unwrap());
        let many = format!("x[1-{}]-y[1-{}]", u64::MAX, u64::MAX);
        assert_eq!(first(&many).unwrap(), "x1-y1");
    }
}
