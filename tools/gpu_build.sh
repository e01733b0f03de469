#!/usr/bin/env bash
# `make gpu-build`: everything a lent GPU machine needs, built here where the time is free, into
# build/gpu-carry/, the one folder the device call carries (tools/GPU_LEASE.md):
#   lib/        librope_ext.so.<ver> with the CUDA kernels for sm_90 (the H100 and H200), and the test
#               hooks' librope_ext_testing.so, built against the device's torch (2.11.0, CUDA 13) from
#               the package index, in build/gpu-venv. The library is no Python extension module, so
#               this Python 3.11 build loads into the device's Python 3.12 beside the same torch.
#   wheels/     the packages the device lacks or has at another version: transformers at the release
#               the integration's fingerprints were taken from (the device has 5.17), Liger-Kernel (the
#               benchmark's peer), expecttest (opcheck's import).
#   BUILD_INFO  the commit, torch, CUDA, arch, and the hash of the sources the library was built from:
#               the copied tree on the device has no .git, and `gpu_check.sh STEP=lease` builds there
#               instead if the carried library does not match the checkout it arrives with.
# Then, as far as a machine without a GPU allows: the build is installed into that venv as a user's is,
# tools/cuda_check.py reads its SASS (registers, stack, no local memory or FFMA, parameter bytes) and
# checks the CUDA kernels are registered, tools/smoke_test.py runs its CPU ops, and the carry's size
# is checked against what a device call may send (64 MiB with the working tree).
# About 1.5 minutes for the venv (a 2.6 GB download) the first time, 3 to 5 for the build on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DEVICE_TORCH=2.11.0  # the lent machines' torch: 2.11.0+cu130 (the device tool's KINDS.md)
ARCH=9.0             # H100 and H200
VENV=$ROOT/build/gpu-venv
WORK=$ROOT/build/gpu-build
CARRY=$ROOT/build/gpu-carry
PY=$VENV/bin/python
WHEELS=(transformers==5.23.0 liger-kernel==0.8.5 expecttest==0.3.0)
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi

t0=$(date +%s)
if ! "$PY" -c "import pathlib, torch, ninja, nvidia
assert torch.__version__.split('+')[0] == '$DEVICE_TORCH' and (torch.version.cuda or '').startswith('13.')
assert any(True for r in nvidia.__path__ for _ in pathlib.Path(r).rglob('nvdisasm'))" 2> /dev/null; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$PY" -m pip install -q "torch==$DEVICE_TORCH" "setuptools>=77" wheel ninja "nvidia-cuda-cuobjdump>=13,<14" \
    "nvidia-cuda-nvdisasm>=13,<14"
  "$PY" -c "import torch, sys; sys.exit(0 if (torch.version.cuda or '').startswith('13.') else
    f'gpu-build: torch $DEVICE_TORCH from the package index is built for CUDA {torch.version.cuda}, the device\'s for 13.0')"
fi
t1=$(date +%s)

# The build, installed into the venv's site-packages (in place: CMake's build directory is
# build/cmake-<configuration>, kept between runs, so a rebuild compiles only what changed).
mkdir -p "$WORK"
if ! ROPE_EXT_CUDA=1 ROPE_EXT_TESTING=1 TORCH_CUDA_ARCH_LIST=$ARCH "$PY" -m pip install -v --no-build-isolation \
    --no-deps --force-reinstall . > "$WORK/build.log" 2>&1; then
  tail -40 "$WORK/build.log"; echo "gpu-build: the build failed (build/gpu-build/build.log)"; exit 1
fi
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
CMAKE_DIR=$(sed -n 's/^ *rope_ext: CMake build directory //p' "$WORK/build.log" | tail -1)
t2=$(date +%s)

# What cuda-check checks of its build, for this one; then the installed package's CPU smoke test,
# from outside the checkout.
PYTHONSAFEPATH=1 "$PY" tools/cuda_check.py --site "$SITE" --compile-commands "$CMAKE_DIR/compile_commands.json" \
  --resource-dir "$WORK" | sed 's/^cuda-check:/gpu-build:/'
(cd "$WORK" && "$PY" "$ROOT/tools/smoke_test.py") | sed 's/^/gpu-build: smoke: /'

rm -rf "$CARRY" && mkdir -p "$CARRY/lib" "$CARRY/wheels"
cp "$SITE"/rope_ext/lib/librope_ext.so.* "$SITE/rope_ext/lib/librope_ext_testing.so" "$CARRY/lib/"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform any -d "$CARRY/wheels" "${WHEELS[@]}"
{
  echo "commit=$(git rev-parse HEAD 2> /dev/null || echo unknown)$(git diff --quiet HEAD -- 2> /dev/null || echo -dirty)"
  echo "sources=$(bash tools/source_hash.sh)"
  echo "torch=$("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
  echo "arch=sm_${ARCH/./}"
  echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
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
[ "$total" -lt $((60 * 1048576)) ] || { echo "gpu-build: over 60 MiB: the device call would refuse it"; exit 1; }
cat "$CARRY/BUILD_INFO" | sed 's/^/gpu-build: /'
echo "gpu-build: venv $((t1 - t0)) s, CUDA build $((t2 - t1)) s, checks and carry $((t3 - t2)) s"
