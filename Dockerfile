# syntax=docker/dockerfile:1
#
# The image the k8s/ manifests run: fsdp-agent and fsdp-trainer in /usr/local/bin, and a
# Python virtual environment with PyTorch 2.13 at /opt/venv (fsdp-trainer links against
# the wheel's libtorch; Python scripts launched by the agent use the same torch).
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

# tch/torch-sys find libtorch through the venv's torch instead of downloading their own.
ENV PATH=/opt/venv/bin:${PATH} \
    LIBTORCH_USE_PYTORCH=1

WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    features="" \
 && if [ -n "${TRAINER_FEATURES}" ]; then features="--features fsdp-trainer/${TRAINER_FEATURES}"; fi \
 && cargo build --release --locked -p fsdp-agent -p fsdp-trainer ${features} \
 && mkdir -p /out \
 && cp target/release/fsdp-agent target/release/fsdp-trainer /out/

FROM ${RUNTIME_BASE} AS runtime
# python3 for the venv (and for users' own train.py; py-spy in it dumps hung workers); procps for `ps`/`pkill` when
# testing resiliency from `kubectl exec`. Nothing else: the wheel ships its own OpenMP
# and, for CUDA, the nvidia-* wheels ship CUDA's runtime and NCCL.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 procps ca-certificates \
 && rm -rf /var/lib/apt/lists/*

COPY --from=build /opt/venv /opt/venv
COPY --from=build /out/fsdp-agent /out/fsdp-trainer /usr/local/bin/

# The trainer carries an rpath to the wheel's lib dir; LD_LIBRARY_PATH also covers tch's
# own link to libtorch and anything started from a shell.
ENV PATH=/opt/venv/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/venv/lib/python3.11/site-packages/torch/lib \
    PYTHONUNBUFFERED=1

# Fail the build, not the first pod, when a library cannot be found.
RUN fsdp-agent --version \
 && ! ldd /usr/local/bin/fsdp-trainer | grep "not found"

# The agent's status server: gRPC status and health, HTTP /metrics.
EXPOSE 29450
# The agent runs as PID 1 (the manifests set `command: [fsdp-agent]` too), so a pod
# delete's SIGTERM reaches it directly.
ENTRYPOINT ["fsdp-agent"]
CMD ["--help"]
