#!/usr/bin/env bash
# `make gpu-build`: everything a lent GPU machine needs, made here where the time is free, into
# build/gpu-carry/, the one folder the device call carries (tools/GPU_LEASE.md):
#   dist/       the rope_ext wheel itself: the one `make cuda-check` builds and CI tests under three
#               torches (CPU and CUDA kernels for every architecture, against torch 2.14.1, on the
#               stable ABI), so the GPU proves the file a user installs. Made by `make cuda-check`
#               first when build/cuda-check holds none of these sources.
#   lib/        the test hooks' librope_ext_testing.so from `make setup` (stable-ABI code too; the
#               wheel leaves it out), put beside the wheel's library on the device.
#   wheels/     the packages the device lacks or has at another version: transformers at the release
#               the integration's fingerprints were taken from (the device has 5.17), Liger-Kernel (the
#               benchmark's peer), expecttest (opcheck's import).
#   BUILD_INFO  the commit, the hash of the sources the wheel was built from (tools/source_hash.sh:
#               the copied tree on the device has no .git, and `gpu_check.sh STEP=lease` builds there
#               instead if the carried wheel does not match the checkout it arrives with), the wheel's
#               library's sha256, the torch it was built against.
# Then, as far as a machine without a GPU allows: the wheel installed into GPU_VENV (build/gpu-venv: the
# device's torch, 2.11.0 with CUDA 13) as a user's is, its CUDA kernels found registered, and
# tools/smoke_test.py run on its CPU ops; the carry's size checked against what a device call may
# send (64 MiB with the working tree).
# About 1.5 minutes for the venv (a 2.6 GB download) the first time; cuda-check's 10 to 15 when it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DEVICE_TORCH=2.11.0  # the lent machines' torch: 2.11.0+cu130 (the device tool's KINDS.md)
VENV=$(realpath -m "${GPU_VENV:-build/gpu-venv}")  # (CI gives wheel-check's venv of the same torch)
WORK=$ROOT/build/gpu-build
CARRY=$ROOT/build/gpu-carry
BUILT=$ROOT/build/cuda-check  # cuda-check's wheel (dist/) and the tree it was built from (src/)
PY=$VENV/bin/python
WHEELS=(transformers==5.23.0 liger-kernel==0.8.5 expecttest==0.3.0)
fail() { echo "gpu-build: FAILED: $*"; exit 1; }

t0=$(date +%s)
here=$(bash tools/source_hash.sh)
wheel_sources() { [ -d "$BUILT/src" ] && bash tools/source_hash.sh "$BUILT/src" || echo none; }
if [ "$(wheel_sources)" != "$here" ] || ! ls "$BUILT"/dist/rope_ext-*.whl > /dev/null 2>&1; then
  echo "gpu-build: build/cuda-check holds no wheel of these sources ($here): make cuda-check"
  make -C "$ROOT" cuda-check > "$ROOT/build/gpu-build-cuda-check.log" 2>&1 ||
    { tail -40 "$ROOT/build/gpu-build-cuda-check.log"; fail "make cuda-check (build/gpu-build-cuda-check.log)"; }
  [ "$(wheel_sources)" = "$here" ] || fail "the sources changed while cuda-check built them"
fi
wheels=("$BUILT"/dist/rope_ext-*.whl)
[ "${#wheels[@]}" = 1 ] || fail "expected one wheel in build/cuda-check/dist, found: ${wheels[*]}"
WHEEL=${wheels[0]}
HOOKS=$(python3 -c "import rope_ext, pathlib; print(pathlib.Path(rope_ext._LIBRARY).with_name('librope_ext_testing.so'))")
[ -f "$HOOKS" ] || fail "no test hooks library at $HOOKS: run make setup"
t1=$(date +%s)

if ! "$PY" -c "import torch
assert torch.__version__.split('+')[0] == '$DEVICE_TORCH' and (torch.version.cuda or '').startswith('13.')" 2> /dev/null; then
  # (a venv the caller named is another step's: not replaced)
  [ -z "${GPU_VENV:-}" ] || fail "GPU_VENV=$GPU_VENV holds no torch $DEVICE_TORCH built for CUDA 13"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$PY" -m pip install -q "torch==$DEVICE_TORCH" "setuptools>=77" wheel
  "$PY" -c "import torch, sys; sys.exit(0 if (torch.version.cuda or '').startswith('13.') else
    f'gpu-build: torch $DEVICE_TORCH from the package index is built for CUDA {torch.version.cuda}, the device\'s for 13.0')"
fi
t2=$(date +%s)

# The wheel under the device's torch, as a user installs it (--no-deps: torch stays), from outside the
# checkout: its CUDA kernels registered, its CPU ops through the smoke test.
mkdir -p "$WORK"
"$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL"
(cd "$WORK" && PYTHONSAFEPATH=1 "$PY" - "$WHEEL" <<'PYEOF'
import sys, torch, rope_ext
assert torch._C._dispatch_has_kernel_for_dispatch_key("rope_ext::rotary", "CUDA"), "no CUDA kernel registered"
print(f"gpu-build: {sys.argv[1].rsplit('/', 1)[-1]} under torch {torch.__version__}: CUDA kernels registered")
PYEOF
)
(cd "$WORK" && PYTHONSAFEPATH=1 "$PY" "$ROOT/tools/smoke_test.py") | sed 's/^/gpu-build: smoke: /'
"$PY" -m pip uninstall -q -y rope_ext  # (the venv stands for the device, which has no rope_ext: gpu-rehearse)
# (and no hooks library that wheel-check put beside the wheel's, which pip does not know of)
rm -rf "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/rope_ext"

rm -rf "$CARRY" && mkdir -p "$CARRY/dist" "$CARRY/lib" "$CARRY/wheels"
cp "$WHEEL" "$CARRY/dist/"
cp "$HOOKS" "$CARRY/lib/"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform any -d "$CARRY/wheels" "${WHEELS[@]}"
# the library's sha256, and the torch the wheel's build record says it was built against
info=$(python3 - "$WHEEL" <<'PYEOF'
import hashlib, json, re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if re.fullmatch(r"rope_ext/lib/librope_ext\.so\.[0-9.]+", n))
    print(hashlib.sha256(z.read(name)).hexdigest(), json.loads(z.read("rope_ext/lib/build.json"))["built_against_torch"])
PYEOF
) || fail "could not read the library's sha256 and build record (rope_ext/lib/build.json) from $WHEEL"
read -r library built_against <<< "$info"
{
  echo "commit=$(git rev-parse HEAD 2> /dev/null || echo unknown)$(git diff --quiet HEAD -- 2> /dev/null || echo -dirty)"
  echo "sources=$here"
  echo "wheel=$(basename "$WHEEL")"
  echo "library_sha256=$library"
  echo "built_against=torch $built_against (make cuda-check)"
  echo "built=$(date -u -r "$WHEEL" +%Y-%m-%dT%H:%M:%SZ)"
} > "$CARRY/BUILD_INFO"
t3=$(date +%s)

# What a device call sends: the working tree (tracked and untracked files git does not ignore) and
# the carried folder, 64 MiB in all.
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2> /dev/null | tail -1 | cut -f1)
carry=$(du -sb "$CARRY" | cut -f1)
total=$((tree + carry))
files=$(find "$CARRY" -type f | wc -l)
echo "gpu-build: build/gpu-carry $((carry / 1024)) KiB ($files files) + the working tree $((tree / 1024)) KiB" \
     "= $((total / 1048576)) MiB of the device call's 64"
[ "$total" -lt $((60 * 1048576)) ] || fail "over 60 MiB: the device call would refuse it"
sed 's/^/gpu-build: /' "$CARRY/BUILD_INFO"
echo "gpu-build: cuda-check's wheel $((t1 - t0)) s, venv $((t2 - t1)) s, checks and carry $((t3 - t2)) s"
