#!/usr/bin/env bash
# Installs what fsdp-agent's demo and tests need on a fresh Debian machine with Rust and
# python3. Idempotent: a second run only checks.
#   apt: etcd-server (tests start real etcd), libgloo-dev (Gloo headers for the trainer),
#        protobuf-compiler (etcd-client compiles etcd's protos at build time),
#        g++ (the trainer's C++ shim), python3-venv (the venv), util-linux and hostname (pod tests),
#        binutils (objcopy: the doc-messages test reads the binary's literals),
#        iproute2 (network namespaces and ss for the partition and liveness tests),
#        slurmctld slurmd slurm-client munge (the three-node Slurm cluster of the Slurm
#        tests, scripts/slurm/start.sh)
#   pip: torch==2.13.0, numpy, python-etcd (torchrun's etcd-v2 backend, for the
#        benchmarks), py-spy (stack dumps of hung workers) and maturin (scripts/dist.sh builds the wheel)
#        into a cached virtual environment ($FSDP_VENV)
set -euo pipefail

FSDP_VENV=${FSDP_VENV:-$HOME/.cache/fsdp-agent/venv}
TORCH_VERSION=2.13.0

need_apt=()
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
[ -f /usr/include/gloo/config.h ] || need_apt+=(libgloo-dev)
# tests/tests/doc_messages.rs reads the agent binary's literals with objcopy.
command -v objcopy >/dev/null 2>&1 || need_apt+=(binutils)
# The trainer's c10d shim is C++ (the Rust toolchain only guarantees a C linker).
command -v c++ >/dev/null 2>&1 || need_apt+=(g++)
# Debian's python3 creates venvs only with python3-venv (ensurepip).
python3 -c "import ensurepip" >/dev/null 2>&1 || need_apt+=(python3-venv)
command -v unshare >/dev/null 2>&1 || need_apt+=(util-linux)
# Each test pod names itself with hostname(1), absent from some minimal images.
command -v hostname >/dev/null 2>&1 || need_apt+=(hostname)
# Partition and liveness tests: network namespaces and veth (ip), cutting connections (ss).
{ command -v ip && command -v ss; } >/dev/null 2>&1 || need_apt+=(iproute2)
# The Slurm tests run a real cluster: controller, node daemons, clients and munge.
command -v slurmctld >/dev/null 2>&1 || need_apt+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || need_apt+=(slurmd)
command -v srun >/dev/null 2>&1 || need_apt+=(slurm-client)
command -v munged >/dev/null 2>&1 || need_apt+=(munge)
# scripts/rdzv-etcd.sh (and its test in bench_smoke) reads etcd's health and metrics.
command -v curl >/dev/null 2>&1 || need_apt+=(curl)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if ! "$FSDP_VENV/bin/python" -c "import torch, numpy, etcd, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null \
    || [ ! -x "$FSDP_VENV/bin/py-spy" ] || [ ! -x "$FSDP_VENV/bin/maturin" ]; then
  echo "setup: creating $FSDP_VENV with torch==$TORCH_VERSION (one-time download)"
  python3 -m venv "$FSDP_VENV"
  "$FSDP_VENV/bin/pip" install -q --upgrade pip
  "$FSDP_VENV/bin/pip" install -q "torch==$TORCH_VERSION" numpy python-etcd py-spy maturin
fi

# The suite is written for nextest (one process per test: the pod and signal tests rely
# on it); a fresh machine gets it once, from crates.io.
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "setup: cargo install cargo-nextest (one-time build)"
  cargo install --locked --quiet cargo-nextest \
    || echo "setup: cargo-nextest could not be installed; tests will run with cargo test"
fi
echo "setup: ok (venv $FSDP_VENV, $("$FSDP_VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
