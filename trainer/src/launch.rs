//! The launcher's environment (fsdp-agent or torchrun): who this process is and where the
//! group meets.

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    /// Ranks on this node (`LOCAL_WORLD_SIZE`, 1 when the launcher does not say): ranks
    /// `local_world` apart are on different nodes.
    pub local_world: usize,
    pub master_addr: String,
    pub master_port: u16,
}

const VARS: [&str; 4] = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"];

/// `Ok(None)` when no launcher variable is set (train alone); an error naming what is
/// missing or malformed when only some are.
pub fn from_env(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Launch>, String> {
    let present: Vec<&str> = VARS.iter().copied().filter(|k| get(k).is_some()).collect();
    if present.is_empty() {
        return Ok(None);
    }
    let missing: Vec<&str> = VARS.iter().copied().filter(|k| get(k).is_none()).collect();
    if !missing.is_empty() {
        return Err(format!(
            "{} set but {} missing; run under fsdp-agent or torchrun, or set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT",
            present.join(", "),
            missing.join(", ")
        ));
    }
    let num = |k: &str| -> Result<usize, String> {
        let v = get(k).unwrap_or_default();
        v.trim()
            .parse()
            .map_err(|_| format!("{k}={v} is not a non-negative integer"))
    };
    let (rank, world) = (num("RANK")?, num("WORLD_SIZE")?);
    let local_rank = match get("LOCAL_RANK") {
        Some(_) => num("LOCAL_RANK")?,
        None => 0,
    };
    let local_world = match get("LOCAL_WORLD_SIZE") {
        Some(_) => num("LOCAL_WORLD_SIZE")?.max(1),
        None => 1,
    };
    if world == 0 || rank >= world {
        return Err(format!("RANK={rank} must be below WORLD_SIZE={world}"));
    }
    let port = get("MASTER_PORT").unwrap_or_default();
    let master_port = port
        .trim()
        .parse()
        .map_err(|_| format!("MASTER_PORT={port} is not a port number"))?;
    Ok(Some(Launch {
        rank,
        world,
        local_rank,
        local_world,
        master_addr: get("MASTER_ADDR").unwrap_or_default(),
        master_port,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: std::collections::HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn alone_partial_and_full() {
        assert_eq!(from_env(&env(&[])), Ok(None));
        let e = from_env(&env(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.contains("MASTER_ADDR, MASTER_PORT missing"), "{e}");
        let full = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "29500"),
            ("LOCAL_RANK", "1"),
        ];
        let l = from_env(&env(&full)).unwrap().unwrap();
        assert_eq!(
            (l.rank, l.world, l.local_rank, l.master_port),
            (1, 2, 1, 29500)
        );
        let bad = [
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "x"),
        ];
        assert!(from_env(&env(&bad)).is_err());
    }
}
