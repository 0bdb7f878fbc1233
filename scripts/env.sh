# Sourced by the scripts: where the venv is, and what torch-sys needs to build the trainer
# against the PyTorch wheel in it (LIBTORCH_USE_PYTORCH=1 and that python first on PATH).
export FSDP_VENV=${FSDP_VENV:-$HOME/.cache/fsdp-agent/venv}
export FSDP_TEST_PYTHON="$FSDP_VENV/bin/python"
export VIRTUAL_ENV="$FSDP_VENV"
export LIBTORCH_USE_PYTORCH=1
export PATH="$FSDP_VENV/bin:$PATH"
