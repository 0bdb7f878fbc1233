//! Where a rank computes and which library carries its collectives: a pure function of
//! the `--backend` flag, the GPUs this process sees and its launch, so every rule is
//! tested without a GPU.

use clap::ValueEnum;

/// `--backend`: the collectives library, as a script passes it to
/// `init_process_group(backend=...)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// NCCL on a GPU, Gloo on CPU; a world of one trains without a process group.
    Auto,
    /// Gloo, on the GPU's tensors where there is a GPU; a group even at world 1.
    Gloo,
    /// NCCL (a CUDA build and a GPU); a group even at world 1.
    Nccl,
}

/// What [`choose`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// `Some(i)`: CUDA device `i`; `None`: the CPU.
    pub cuda: Option<usize>,
    /// The process group's backend, or `None` to train without one.
    pub group: Option<&'static str>,
}

/// `gpus`: the CUDA devices visible to this process (0 in a CPU build). `local_rank` and
/// `world` are the launch's (`None` when started by hand).
pub fn choose(
    backend: Backend,
    gpus: usize,
    local_rank: Option<usize>,
    world: Option<usize>,
) -> Result<Placement, String> {
    let cuda = if gpus == 0 {
        None
    } else {
        let local = local_rank.unwrap_or(0);
        // One GPU per local rank, as torchrun scripts set it: two ranks on one GPU
        // would be refused by NCCL ("Duplicate GPU detected") and starve each other.
        if local >= gpus {
            return Err(format!(
                "LOCAL_RANK is {local} but this node has {gpus} GPU(s): start at most {gpus} \
                 workers per node (--nproc-per-node {gpus}), or make more GPUs visible \
                 (CUDA_VISIBLE_DEVICES)"
            ));
        }
        Some(local)
    };
    let launched = world.is_some();
    let group = match backend {
        Backend::Auto => match world {
            Some(w) if w > 1 => Some(if cuda.is_some() { "nccl" } else { "gloo" }),
            _ => None,
        },
        Backend::Nccl if cuda.is_none() => {
            return Err(if cfg!(feature = "cuda") {
                "--backend nccl needs a GPU and this process sees none (is CUDA_VISIBLE_DEVICES \
                 empty?); use --backend gloo on CPU"
                    .into()
            } else {
                "--backend nccl needs a CUDA build of fsdp-trainer (cargo build --features cuda) \
                 and a GPU; this build has no CUDA: use --backend gloo"
                    .into()
            });
        }
        Backend::Nccl if launched => Some("nccl"),
        Backend::Gloo if launched => Some("gloo"),
        // Started by hand there is no store to meet at: train alone, whatever was asked.
        Backend::Nccl | Backend::Gloo => None,
    };
    Ok(Placement { cuda, group })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(b: Backend, gpus: usize, local: Option<usize>, world: Option<usize>) -> Placement {
        choose(b, gpus, local, world).unwrap()
    }

    #[test]
    fn auto_is_nccl_on_a_gpu_and_gloo_on_cpu_and_no_group_alone() {
        assert_eq!(
            place(Backend::Auto, 8, Some(3), Some(16)).group,
            Some("nccl")
        );
        assert_eq!(place(Backend::Auto, 8, Some(3), Some(16)).cuda, Some(3));
        assert_eq!(
            place(Backend::Auto, 0, Some(3), Some(16)).group,
            Some("gloo")
        );
        assert_eq!(place(Backend::Auto, 0, Some(3), Some(16)).cuda, None);
        assert_eq!(place(Backend::Auto, 1, Some(0), Some(1)).group, None);
        assert_eq!(place(Backend::Auto, 0, None, None).group, None);
    }

    #[test]
    fn a_named_backend_forms_a_group_even_at_world_one() {
        assert_eq!(
            place(Backend::Gloo, 0, Some(0), Some(1)).group,
            Some("gloo")
        );
        assert_eq!(
            place(Backend::Nccl, 1, Some(0), Some(1)).group,
            Some("nccl")
        );
        assert_eq!(
            place(Backend::Gloo, 1, Some(0), Some(2)),
            Placement {
                cuda: Some(0),
                group: Some("gloo")
            }
        );
        assert_eq!(place(Backend::Gloo, 1, None, None).group, None);
    }

    #[test]
    fn more_workers_than_gpus_is_refused_with_the_fix() {
        let e = choose(Backend::Auto, 1, Some(1), Some(2)).unwrap_err();
        assert!(
            e.contains("LOCAL_RANK is 1") && e.contains("--nproc-per-node 1"),
            "{e}"
        );
    }

    #[test]
    fn nccl_without_a_gpu_is_refused_with_the_fix() {
        let e = choose(Backend::Nccl, 0, Some(0), Some(2)).unwrap_err();
        assert!(e.contains("--backend gloo"), "{e}");
    }
}
