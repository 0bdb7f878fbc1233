//! What the workers get: the program they run, how many there are, how they are stopped,
//! their devices and the environment they must not inherit.

use std::time::Duration;

use super::sources::Resolver;
use super::{ConfigError, DEFAULT_TERM_TIMEOUT, Entrypoint, Source, entrypoint, etcd, parse};
use crate::cli::Args;

/// How the training script is run (`-m`, `--no-python`, `--run-path`).
#[derive(Debug, Clone, Copy)]
pub(super) struct ProgramFlags {
    module: bool,
    no_python: bool,
    run_path: bool,
}

impl Resolver<'_> {
    pub(super) fn program_flags(&mut self, a: &Args) -> Result<ProgramFlags, ConfigError> {
        Ok(ProgramFlags {
            module: self.flag("module", a.module, "PET_MODULE")?,
            no_python: self.flag("no-python", a.no_python, "PET_NO_PYTHON")?,
            run_path: self.flag("run-path", a.run_path, "PET_RUN_PATH")?,
        })
    }

    pub(super) fn entrypoint(
        &mut self,
        a: &Args,
        p: ProgramFlags,
    ) -> Result<Entrypoint, ConfigError> {
        let (entrypoint, python) = entrypoint::resolve(
            &a.training_script,
            &a.script_args,
            p.module,
            p.no_python,
            p.run_path,
            self.env,
            self.agent_dir.as_deref(),
        )?;
        if let Some(why) = python {
            self.record(
                "python",
                entrypoint.program.display().to_string(),
                Source::Derived(why),
            );
        }
        self.record(
            "entrypoint",
            entrypoint.display(),
            Source::Derived("training script and mode flags".into()),
        );
        Ok(entrypoint)
    }

    /// `--prewarm` (or `FSDP_PREWARM`): the modules a spare imports, `None` when off.
    /// Spares run Python, so `--no-python` refuses it.
    pub(super) fn prewarm(
        &mut self,
        a: &Args,
        p: ProgramFlags,
    ) -> Result<Option<Vec<String>>, ConfigError> {
        if !self.flag("prewarm", a.prewarm, "FSDP_PREWARM")? {
            return Ok(None);
        }
        if p.no_python {
            return Err(ConfigError::Conflict(
                "--prewarm keeps Python interpreters ready, and --no-python execs a binary; drop one of them"
                    .into(),
            ));
        }
        self.value("prewarm-modules", &a.prewarm_modules, parse::modules)
            .map(Some)
    }

    /// `--nproc-per-node`, with `gpu`, `cpu` and `auto` counted on this machine.
    pub(super) fn nproc_per_node(&mut self, raw: &str) -> Result<u32, ConfigError> {
        use parse::NprocRequest::*;
        let req = self.value("nproc-per-node", raw, parse::nproc)?;
        let gpus = || crate::devices::gpu_count(self.env);
        let cpus = || std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        let (n, how) = match req {
            Count(n) => return Ok(n),
            Cpu => (cpus(), "cpu: CPUs available to this process"),
            Gpu => match gpus() {
                0 => {
                    return Err(self.invalid(
                        "nproc-per-node",
                        "gpu",
                        "no NVIDIA GPU is visible (no /dev/nvidiaN, or CUDA_VISIBLE_DEVICES is empty); use a number or `cpu`",
                    ));
                }
                n => (n, "gpu: visible NVIDIA GPUs"),
            },
            Auto => match gpus() {
                0 => (cpus(), "auto: no GPU, so CPUs available"),
                n => (n, "auto: visible NVIDIA GPUs"),
            },
        };
        self.record("nproc-per-node (resolved)", n, Source::Derived(how.into()));
        Ok(n)
    }

    /// `--monitor-interval` is checked and shown, as torchrun takes it, but nothing polls:
    /// worker exits are seen as they happen.
    pub(super) fn monitor_interval(&mut self, raw: &str) -> Result<(), ConfigError> {
        let interval = self.value("monitor-interval", raw, parse::duration)?;
        if interval.is_zero() {
            return Err(self.invalid("monitor-interval", raw, "must be greater than 0"));
        }
        Ok(())
    }

    /// `--term-timeout`, then torchrun's `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, then 30s.
    pub(super) fn term_timeout(&mut self, a: &Args) -> Result<Duration, ConfigError> {
        let given = self.flag_or_var(
            "term-timeout",
            a.term_timeout.as_deref(),
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
            parse::duration,
        )?;
        Ok(given.unwrap_or_else(|| {
            self.record("term-timeout", "30", Source::Default);
            DEFAULT_TERM_TIMEOUT
        }))
    }

    /// With `--virtual-local-rank` each worker sees one device of `CUDA_VISIBLE_DEVICES`:
    /// there must be one per worker.
    pub(super) fn check_virtual_local_rank(
        &self,
        on: bool,
        nproc_per_node: u32,
    ) -> Result<(), ConfigError> {
        if !on {
            return Ok(());
        }
        let Some(v) = (self.env)("CUDA_VISIBLE_DEVICES").filter(|v| !v.trim().is_empty()) else {
            return Ok(());
        };
        let n = v.split(',').count() as u32;
        if n < nproc_per_node {
            return Err(ConfigError::Conflict(format!(
                "--virtual-local-rank gives each worker one device, but CUDA_VISIBLE_DEVICES={v} lists {n} for {nproc_per_node} workers"
            )));
        }
        Ok(())
    }

    /// `OMP_NUM_THREADS=1` for the workers, as torchrun sets it: several workers and the
    /// agent's environment does not set it.
    pub(super) fn omp_threads_default(&self, nproc_per_node: u32) -> bool {
        nproc_per_node > 1 && (self.env)("OMP_NUM_THREADS").is_none()
    }

    /// What the workers must not inherit from the agent: the password variable, and the
    /// password item of `PET_RDZV_CONF` (the rest of it stays, as torchrun passes it on).
    pub(super) fn worker_env_scrub(&self) -> Vec<(String, Option<String>)> {
        let mut out = Vec::new();
        if (self.env)(etcd::PASSWORD_ENV).is_some() {
            out.push((etcd::PASSWORD_ENV.to_owned(), None));
        }
        if let Some(conf) = (self.env)("PET_RDZV_CONF") {
            let kept = parse::without_password(&conf);
            if kept != conf {
                out.push(("PET_RDZV_CONF".to_owned(), Some(kept)));
            }
        }
        out
    }
}
