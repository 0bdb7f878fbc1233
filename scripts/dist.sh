#!/usr/bin/env bash
# Builds what a user installs without a Rust toolchain, into OUT_DIR (default dist/):
#   fsdp_agent-VERSION-py3-none-PLATFORM.whl  `pip install` it: the agent lands in the
#                                             environment's bin, beside its python
#   fsdp-agent-VERSION-ARCH-linux-gnu         the same binary alone, to copy into any
#                                             image with glibc (no musl target here)
# and prints both sizes and the oldest glibc the binary runs on.
#
# One build: maturin's (release, stripped). The plain binary is extracted from the wheel,
# so the two can never differ. The wheel's tag is the oldest manylinux the binary
# qualifies for (maturin's default) and `--auditwheel check` fails the build instead of
# bundling a library: the binary must need nothing but glibc and libgcc_s.
#
# FSDP_DIST_PROFILE=dev packages a debug build instead (scripts/test.sh: the same files
# and the same dynamic needs, without a second, release, compile in CI). The dev build
# goes to its own target directory, target/dist-dev, because maturin's build of the
# agent into target/debug would replace the binary the other tests run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${1:-$root/dist}")
profile=${FSDP_DIST_PROFILE:-release}
cd "$root"
source scripts/env.sh

case "$profile" in
  release) build=(--release --strip) ;;
  # Small and quick: no debug info (dependencies have none anyway), no incremental state.
  dev) build=(--profile dev)
       export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}/dist-dev
       export CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=false ;;
  *) echo "dist.sh: FSDP_DIST_PROFILE=$profile is not a profile: use release or dev" >&2
     exit 64 ;;
esac
for tool in maturin objdump readelf; do
  command -v "$tool" >/dev/null || {
    echo "dist.sh: $tool is missing: run scripts/setup.sh (maturin) or install binutils" >&2
    exit 69
  }
done

mkdir -p "$out"
# Exactly one of each afterwards, so that `pip install dist/fsdp_agent-*.whl` is one wheel.
rm -f "$out"/fsdp_agent-*.whl "$out"/fsdp-agent-*-linux-gnu

start=$SECONDS
maturin build --locked "${build[@]}" --auditwheel check --out "$out" >&2
wheel=$(ls "$out"/fsdp_agent-*.whl)
version=$(basename "$wheel" | cut -d- -f2)
binary="$out/fsdp-agent-$version-$(uname -m)-linux-gnu"
python3 - "$wheel" "$binary" <<'EOF'
import os, shutil, sys, zipfile
wheel, binary = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    [name] = [n for n in z.namelist() if n.endswith(".data/scripts/fsdp-agent")]
    with z.open(name) as src, open(binary, "wb") as dst:
        shutil.copyfileobj(src, dst)
os.chmod(binary, 0o755)
EOF

# The oldest glibc: the highest GLIBC_x.y among the versions its dynamic symbols require.
glibc=$(objdump -T "$binary" | grep -o 'GLIBC_[0-9][0-9.]*' | sort -uV | tail -n1)
needed=$(readelf -d "$binary" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | paste -sd' ')
case "$(basename "$wheel")" in
  *manylinux_*|*manylinux2014*) ;;
  *) echo "dist.sh: $(basename "$wheel") has no manylinux tag (needs: $needed)" >&2; exit 1 ;;
esac

size() { du -h --apparent-size "$1" | cut -f1; }
echo "wheel   $wheel ($(size "$wheel"))"
echo "binary  $binary ($(size "$binary"))"
echo "glibc   ${glibc#GLIBC_} or newer (needs: $needed)"
echo "built in $((SECONDS - start)) s ($profile)"
