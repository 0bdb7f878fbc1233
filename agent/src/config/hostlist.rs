//! Slurm's host-list syntax (`SLURM_STEP_NODELIST`, `SLURM_JOB_NODELIST`), expanded without
//! calling `scontrol show hostnames`: a node of the step need not have the client tools,
//! and the agent needs only the list itself.
//!
//! `n[1-3,5]` is n1 n2 n3 n5; `gpu-[001-016]` keeps the zero padding of the range's first
//! number; `a,b[1-2],c` is several entries; `rack[1-2]-n[1-2]` (several brackets in one
//! name) is every combination, left bracket outermost, as Slurm writes them.

/// Every host of `list`, in Slurm's order. An error says what in the list is malformed.
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for entry in split_top_level(list)? {
        if entry.is_empty() {
            continue;
        }
        hosts.extend(expand_entry(entry)?);
    }
    if hosts.is_empty() {
        return Err(format!("no host in '{list}'"));
    }
    Ok(hosts)
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

/// One name with zero or more bracket groups.
fn expand_entry(entry: &str) -> Result<Vec<String>, String> {
    let Some(open) = entry.find('[') else {
        return Ok(vec![entry.to_owned()]);
    };
    // split_top_level checked that every '[' has its ']'.
    let close = open + entry[open..].find(']').unwrap_or(entry.len() - open);
    let prefix = &entry[..open];
    let rest = expand_entry(&entry[close + 1..])?;
    let mut hosts = Vec::new();
    for number in expand_ranges(&entry[open + 1..close], entry)? {
        for tail in &rest {
            hosts.push(format!("{prefix}{number}{tail}"));
        }
    }
    Ok(hosts)
}

/// The inside of one bracket, `1-3,5` or `001-016`: the numbers as written, padded.
fn expand_ranges(inside: &str, entry: &str) -> Result<Vec<String>, String> {
    let mut numbers = Vec::new();
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
        numbers.extend((from..=to).map(|n| format!("{n:0width$}")));
    }
    Ok(numbers)
}

#[cfg(test)]
mod tests {
    use super::expand;

    fn hosts(list: &str) -> Vec<String> {
        expand(list).unwrap_or_else(|e| panic!("{list}: {e}"))
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
            let err = expand(list).expect_err(list);
            assert!(err.contains(part), "{list}: {err}");
        }
    }
}
