#!/usr/bin/env bash
# `make gpu-check [STEP=all|build|test|mirror|sanitize|bench]`: rope_ext proven on a CUDA GPU, in steps
# that each fit in the lent machine's 10 minutes a command (16 cores, one H100/H200, no network):
#   build     rope_ext with its CUDA kernels for this GPU's architecture only, against the installed
#             torch, editable, with the tests' hooks; no download (pip --no-index). About 2 to 3
#             minutes on 16 cores: the CI build of all 6 architectures takes 8 to 11 on 2.
#   test      tests/test_gpu.py and tests/test_cuda.py: every op forward, backward and double
#             backward against the CPU kernel bit for bit, the module, the drop-ins, a patched
#             transformers model, Inductor, CUDA graphs, streams, 2^31-element and -token tensors, the
#             device-side assert in a subprocess. About 4 minutes.
#   mirror    the host-emulation suites (test_cuda_emulation, test_rotary_pos, test_fuzz with its
#             2,000 examples, test_robustness) with the emulator swapped for the real kernels
#             (ROPE_EXT_TEST_KERNELS_ON=cuda, tests/conftest.py's KernelsOn). About 3 minutes here on
#             2 cores against the CPU (most of it is the CPU side and hypothesis).
#   sanitize  tests/gpu_kernel_cases.py (each of the 112 kernels once) under compute-sanitizer's
#             memcheck, racecheck and initcheck, our kernels only. About 1 to 2 minutes a tool.
#   bench     benchmarks/bench_cuda.py (--quick with QUICK=1). About 4 to 6 minutes, most of it
#             torch.compile of the HF baseline and the 32k-token cases.
#   all       the five in turn (for a machine with no time limit).
# Each step appends what ran and what it found to $GPU_CHECK_OUT/summary.md (default build/gpu-check;
# on the lent machine pass GPU_CHECK_OUT=$OUT so the logs come back) and prints the summary. On a
# machine without an NVIDIA GPU it says so and exits 0 at once, building and running nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
STEP=${STEP:-all}
PY=${PYTHON:-python3}
OUT=$(realpath -m "${GPU_CHECK_OUT:-build/gpu-check}")

if ! command -v nvidia-smi > /dev/null 2>&1 || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi finds none): ran nothing"
  exit 0
fi
case "$STEP" in all|build|test|mirror|sanitize|bench) ;; *)
  echo "gpu-check: STEP must be all, build, test, mirror, sanitize or bench, got '$STEP'"; exit 2;; esac
if ! "$PY" -c "import torch, sys; sys.exit(not (torch.version.cuda and torch.cuda.is_available()))" 2> /dev/null; then
  echo "gpu-check: a GPU is here, but $PY's torch is not a CUDA build that sees it; install one first"
  exit 1
fi
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
if [ ! -f "$SUMMARY" ]; then
  {
    echo "# gpu-check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo "- device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
    echo "- $("$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, capability {torch.cuda.get_device_capability()}")')"
    echo "- $(nvcc --version 2> /dev/null | tail -1), $(nproc) cores; rope_ext $(git rev-parse --short HEAD 2> /dev/null)"
    echo
  } > "$SUMMARY"
fi
FAILED=0

# step NAME COMMAND...: runs the command with its output in $OUT/NAME.log, records the time and its
# closing line (pytest's counts, or the script's last line) in the summary.
step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "gpu-check: $name: $*"
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local last
  last=$(grep -E "passed|failed|error|gpu_kernel_cases|bench_cuda|ERROR SUMMARY|Successfully installed" "$OUT/$name.log" | tail -1)
  local verdict="ok"; [ $rc -ne 0 ] && { verdict="FAILED (exit $rc)"; FAILED=1; }
  echo "- **$name**: $verdict in $((SECONDS - t0)) s: ${last:-$(tail -1 "$OUT/$name.log")}" >> "$SUMMARY"
  [ $rc -ne 0 ] && tail -30 "$OUT/$name.log"
  return 0
}

built() {
  "$PY" -c "import torch, rope_ext, sys; sys.exit(not torch._C._dispatch_has_kernel_for_dispatch_key('rope_ext::rotary', 'CUDA'))" 2> /dev/null
}

if [ "$STEP" = build ] || [ "$STEP" = all ]; then
  if ! "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)"; then
    echo "gpu-check: the build needs setuptools 77 or newer and this machine has $("$PY" -c 'import setuptools; print(setuptools.__version__)');" \
      "with no network, bring its wheel (pip download setuptools==80.9.0 where there is one) and install it first"
    exit 1
  fi
  ARCH=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  step build env ROPE_EXT_CUDA=1 ROPE_EXT_TESTING=1 TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="$(nproc)" \
    "$PY" -m pip install --no-build-isolation --no-deps --no-index -v -e .
fi
if [ "$STEP" != build ] && ! built; then
  echo "gpu-check: rope_ext is not built with CUDA here: run STEP=build first"
  exit 1
fi
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
"$PY" -c "import pytest_timeout" 2> /dev/null && PYTEST+=(--timeout=600)  # (a hung test fails, not the step)
if [ "$STEP" = test ] || [ "$STEP" = all ]; then
  step test env ROPE_EXT_GPU_CHECK=1 "${PYTEST[@]}" tests/test_gpu.py tests/test_cuda.py
fi
if [ "$STEP" = mirror ] || [ "$STEP" = all ]; then
  step mirror env ROPE_EXT_TEST_KERNELS_ON=cuda "${PYTEST[@]}" tests/test_cuda_emulation.py tests/test_rotary_pos.py \
    tests/test_fuzz.py tests/test_robustness.py
fi
if [ "$STEP" = sanitize ] || [ "$STEP" = all ]; then
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null)
  if [ -z "$SAN" ]; then
    echo "- **sanitize**: FAILED: compute-sanitizer not found" >> "$SUMMARY"; FAILED=1
  else
    for tool in memcheck racecheck initcheck; do
      # Each tensor its own allocation (no caching allocator), so an access past one is caught.
      step "sanitize-$tool" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SAN" --tool "$tool" --error-exitcode 1 \
        --kernel-name kns=rotary_kernel "$PY" tests/gpu_kernel_cases.py --device cuda
    done
  fi
fi
if [ "$STEP" = bench ] || [ "$STEP" = all ]; then
  step bench "$PY" benchmarks/bench_cuda.py ${QUICK:+--quick} --out "$OUT"
  if [ -f "$OUT/bench_cuda.md" ]; then
    { echo; echo "Llama-3-8B, bfloat16, HF's view (the full table: $OUT/bench_cuda.md):"; echo
      grep -E "^\| (mode|---) " "$OUT/bench_cuda.md"
      grep -E "^\| (fwd|decode) \| 8B \| bhsd \| bfloat16 " "$OUT/bench_cuda.md"; } >> "$SUMMARY"
  fi
fi

echo
cat "$SUMMARY"
exit $FAILED
