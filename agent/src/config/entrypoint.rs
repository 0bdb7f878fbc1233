//! The command line a worker runs: a Python script, module or `run_path`, or a binary.

use std::path::{Path, PathBuf};

use super::ConfigError;

/// The program and arguments every worker execs (before `${local_rank}` substitution).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entrypoint {
    pub program: PathBuf,
    pub args: Vec<String>,
}

impl Entrypoint {
    /// Whether the workers run the Python interpreter (every form but `--no-python`
    /// starts it with `-u`, as torchrun does).
    pub fn runs_python(&self) -> bool {
        self.args.first().is_some_and(|a| a == "-u")
    }

    /// The command as a shell-like line, for logs and the configuration printout.
    pub fn display(&self) -> String {
        std::iter::once(self.program.display().to_string())
            .chain(self.args.iter().cloned())
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Runs the script the way torchrun's `--run-path` does, through `runpy.run_path`, in a
/// plain `python -c` so the worker is still a process we exec and supervise. Its first
/// argument is `sys.path[0]`: torchrun's workers inherit the launcher's, the directory of
/// the `torchrun` executable; ours get the agent's directory (a venv's `bin` when the
/// agent is installed there, as torchrun's would be).
const RUN_PATH_SNIPPET: &str = "import runpy, sys; sys.path[0] = sys.argv[1]; sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')";

/// The workers' command line, and when it runs Python, why that interpreter.
pub fn resolve(
    script: &str,
    script_args: &[String],
    module: bool,
    no_python: bool,
    run_path: bool,
    env: &dyn Fn(&str) -> Option<String>,
    agent_dir: Option<&Path>,
) -> Result<(Entrypoint, Option<String>), ConfigError> {
    if module && no_python {
        return Err(ConfigError::Conflict(
            "-m/--module and --no-python cannot be combined: a module needs the Python interpreter"
                .into(),
        ));
    }
    if script.starts_with('-') {
        return Err(ConfigError::CommandLine(format!(
            "unknown option '{script}' before the training script"
        )));
    }
    let mut args: Vec<String> = Vec::new();
    let mut why = None;
    let mut python = || {
        let (p, w) = python(env, agent_dir)?;
        why = Some(w);
        Ok::<_, ConfigError>(p)
    };
    // torchrun gives --run-path precedence over --no-python; so do we.
    let program = if run_path {
        require_file(script)?;
        let python = python()?;
        // torchrun's workers see torchrun's directory first on sys.path: the bin directory
        // of the environment it was installed into, which is the interpreter's (not ours:
        // a release binary may live anywhere).
        let launcher_dir = Path::new(&python)
            .parent()
            .map(|d| std::path::absolute(d).unwrap_or_else(|_| d.to_owned()))
            .map(|d| d.display().to_string())
            .unwrap_or_default();
        args.extend([
            "-u".into(),
            "-c".into(),
            RUN_PATH_SNIPPET.into(),
            launcher_dir,
            script.into(),
        ]);
        python
    } else if no_python {
        find_executable(script, env)?
    } else if module {
        args.extend(["-u".into(), "-m".into(), script.into()]);
        python()?
    } else {
        require_file(script)?;
        args.extend(["-u".into(), script.into()]);
        python()?
    };
    args.extend(script_args.iter().cloned());
    Ok((Entrypoint { program, args }, why))
}

fn require_file(script: &str) -> Result<(), ConfigError> {
    let p = Path::new(script);
    if p.is_file() {
        return Ok(());
    }
    let cwd = std::env::current_dir()
        .map(|d| d.display().to_string())
        .unwrap_or_default();
    let hint = if p.exists() {
        "it is not a file"
    } else {
        "no such file"
    };
    Err(ConfigError::Entrypoint(format!(
        "training script '{script}' not found ({hint}; looked relative to {cwd}); \
         pass a path to a script, -m for a module, or --no-python for a binary"
    )))
}

/// The interpreter, and why: `PYTHON_EXEC` (torchrun's variable), then `PYTHON`, then the
/// `python3` or `python` beside the agent's own executable (installed in a venv, the agent
/// runs that venv's Python, as torchrun runs its own interpreter, without the venv being
/// activated), then the first on `PATH`.
fn python(
    env: &dyn Fn(&str) -> Option<String>,
    agent_dir: Option<&Path>,
) -> Result<(PathBuf, String), ConfigError> {
    for var in ["PYTHON_EXEC", "PYTHON"] {
        if let Some(p) = env(var).filter(|p| !p.is_empty()) {
            return find_executable(&p, env)
                .map(|p| (p, format!("${var}")))
                .map_err(|_| {
                    ConfigError::Entrypoint(format!(
                        "{var}={p} does not name an executable Python interpreter"
                    ))
                });
        }
    }
    if let Some(dir) = agent_dir {
        for name in ["python3", "python"] {
            let p = dir.join(name);
            if is_executable(&p) {
                return Ok((p, format!("beside fsdp-agent in {}", dir.display())));
            }
        }
    }
    for name in ["python3", "python"] {
        if let Ok(p) = find_executable(name, env) {
            return Ok((p, format!("the first {name} on PATH")));
        }
    }
    Err(ConfigError::Entrypoint(
        "no python3 or python on PATH to run the script; set PYTHON=/path/to/python or use --no-python".into(),
    ))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Resolves a program name the way `execvp` would, so a missing binary is reported before
/// anything is spawned.
fn find_executable(
    name: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<PathBuf, ConfigError> {
    if name.contains('/') {
        let p = PathBuf::from(name);
        return if is_executable(&p) {
            Ok(p)
        } else {
            Err(ConfigError::Entrypoint(format!(
                "'{name}' is not an executable file (--no-python execs the entrypoint directly)"
            )))
        };
    }
    let path = env("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
        .ok_or_else(|| {
            ConfigError::Entrypoint(format!(
                "'{name}' was not found on PATH (--no-python execs the entrypoint directly)"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(k: &str) -> Option<String> {
        std::env::var(k).ok()
    }

    #[test]
    fn module_and_no_python_conflict() {
        let err = resolve("pkg", &[], true, true, false, &env, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot be combined"), "{err}");
    }

    #[test]
    fn binary_on_path_is_resolved() {
        let (e, why) = resolve("true", &["x".into()], false, true, false, &env, None).unwrap();
        assert_eq!(why, None, "no interpreter for a binary");
        assert!(e.program.ends_with("true"));
        assert_eq!(e.args, ["x"]);
    }

    #[test]
    fn missing_script_names_the_path() {
        let err = resolve("nope/train.py", &[], false, false, false, &env, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("nope/train.py"), "{err}");
    }

    #[test]
    fn python_named_by_env_must_exist() {
        let fake = |k: &str| match k {
            "PYTHON" => Some("/no/such/python".to_owned()),
            _ => std::env::var(k).ok(),
        };
        let err = resolve("-", &[], true, false, false, &fake, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown option"), "{err}");
        let err = resolve("mod", &[], true, false, false, &fake, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("PYTHON=/no/such/python"), "{err}");
    }

    #[test]
    fn the_python_beside_the_agent_comes_before_path_and_after_the_variables() {
        let venv = tempfile::tempdir().unwrap();
        let py = venv.path().join("python3");
        std::fs::write(&py, "").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&py, std::fs::Permissions::from_mode(0o755)).unwrap();
        let (p, why) = python(&env, Some(venv.path())).unwrap();
        assert_eq!(
            (p, why.starts_with("beside fsdp-agent")),
            (py.clone(), true)
        );
        let exec = |k: &str| match k {
            "PYTHON_EXEC" => Some("/bin/sh".to_owned()),
            _ => std::env::var(k).ok(),
        };
        let (p, why) = python(&exec, Some(venv.path())).unwrap();
        assert_eq!(
            (p, why.as_str()),
            (PathBuf::from("/bin/sh"), "$PYTHON_EXEC")
        );
        let empty = tempfile::tempdir().unwrap();
        let fallback = |k: &str| match k {
            "PYTHON_EXEC" | "PYTHON" => None,
            _ => std::env::var(k).ok(),
        };
        let (_, why) = python(&fallback, Some(empty.path())).unwrap();
        assert!(why.contains("on PATH"), "{why}");
    }
}
