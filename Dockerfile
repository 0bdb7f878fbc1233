# syntax=docker/dockerfile:1
#
# The image the k8s/ manifests run: a Python virtual environment with PyTorch 2.13 at
# /opt/venv, fsdp-agent installed into it from the wheel scripts/dist.sh builds (the one
# the README's Install section hands to users), and fsdp-trainer in /usr/local/bin. The
# wheel puts the agent in /opt/venv/bin beside the venv's python, which it then runs
# workers with; fsdp-trainer is not in the wheel (it links against the venv's libtorch),
# so it is built on its own. An image without Python needs only dist.sh's plain binary:
#   COPY dist/fsdp-agent-*-linux-gnu /usr/local/bin/fsdp-agent   (glibc 2.34 or newer)
#
# CPU image (k8s/pytorchjob-cpu.yaml):
#   docker build -t fsdp-agent:cpu .
#
# CUDA image (k8s/pytorchjob-gpu.yaml): the default PyPI wheel of torch is the CUDA build,
# and the trainer's `cuda` feature adds NCCL:
#   docker build -t fsdp-agent:cuda \
#     --build-arg TORCH_INDEX=https://pypi.org/simple \
#     --build-arg TRAINER_FEATURES=cuda .
# For EFA, NCCL also needs libfabric and the aws-ofi-nccl plugin at run time: set
# RUNTIME_BASE to a Debian bookworm image that has them (installed from the EFA installer
# and the plugin's release); the venv brings CUDA's runtime libraries and NCCL itself.
#
# The builder and the runtime must agree on two things, which is why both derive from
# Debian bookworm: the venv's Python (/usr/bin/python3.11, which the venv links to) and the
# venv's path (/opt/venv, which the trainer's rpath names).

ARG RUST_VERSION=1.95
ARG RUNTIME_BASE=debian:bookworm-slim

FROM rust:${RUST_VERSION}-bookworm AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TRAINER_FEATURES=

# protobuf-compiler: etcd-client compiles etcd's API at build time.
# libgloo-dev: the Gloo headers the trainer's c10d shim needs and the wheel lacks (the
# symbols themselves are in the wheel's libtorch_cpu).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      protobuf-compiler libgloo-dev python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" \
 && /opt/venv/bin/pip install --no-cache-dir numpy py-spy

# maturin builds the wheel (pyproject.toml, through scripts/dist.sh); in a venv of its own
# so that /opt/venv, which the runtime copies, holds only what the image runs.
RUN python3 -m venv /opt/maturin \
 && /opt/maturin/bin/pip install --no-cache-dir "maturin>=1.5,<2"

# tch/torch-sys find libtorch through the venv's torch instead of downloading their own.
ENV PATH=/opt/venv/bin:${PATH} \
    LIBTORCH_USE_PYTORCH=1

WORKDIR /src
COPY . .
# The agent: scripts/dist.sh, the script that makes the release files, so the image runs
# exactly what users install (a manylinux wheel whose binary needs glibc only, checked
# there; this stage's objdump and readelf read its glibc floor). FSDP_VENV tells it (through
# scripts/env.sh) which venv has maturin. It writes the wheel and the plain binary to
# /out/dist, outside the cache mount, so the runtime stage can reach them.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    features="" \
 && if [ -n "${TRAINER_FEATURES}" ]; then features="--features fsdp-trainer/${TRAINER_FEATURES}"; fi \
 && FSDP_VENV=/opt/maturin scripts/dist.sh /out/dist \
 && cargo build --release --locked -p fsdp-trainer ${features} \
 && cp target/release/fsdp-trainer /out/

FROM ${RUNTIME_BASE} AS runtime
# python3 for the venv (and for users' own train.py; py-spy in it dumps hung workers); procps for `ps`/`pkill` when
# testing resiliency from `kubectl exec`. Nothing else: the wheel ships its own OpenMP
# and, for CUDA, the nvidia-* wheels ship CUDA's runtime and NCCL.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 procps ca-certificates \
 && rm -rf /var/lib/apt/lists/*

COPY --from=build /opt/venv /opt/venv
COPY --from=build /out/fsdp-trainer /usr/local/bin/
# The wheel is mounted, not copied: the image keeps the installed agent only. No
# dependencies to resolve (the wheel has none) and no index to reach.
RUN --mount=type=bind,from=build,source=/out/dist,target=/tmp/dist \
    /opt/venv/bin/pip install --no-cache-dir --no-index --no-deps /tmp/dist/fsdp_agent-*.whl

# The trainer carries an rpath to the wheel's lib dir; LD_LIBRARY_PATH also covers tch's
# own link to libtorch and anything started from a shell.
ENV PATH=/opt/venv/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/venv/lib/python3.11/site-packages/torch/lib \
    PYTHONUNBUFFERED=1

# Fail the build, not the first pod, when a library cannot be found or PATH finds another
# fsdp-agent than the venv's (the manifests' `command: [fsdp-agent]` goes through PATH).
RUN test "$(command -v fsdp-agent)" = /opt/venv/bin/fsdp-agent \
 && fsdp-agent --version \
 && ! ldd /usr/local/bin/fsdp-trainer | grep "not found"

# The agent's status server: gRPC status and health, HTTP /metrics.
EXPOSE 29450
# The agent runs as PID 1 (the manifests set `command: [fsdp-agent]` too), so a pod
# delete's SIGTERM reaches it directly.
ENTRYPOINT ["fsdp-agent"]
CMD ["--help"]
