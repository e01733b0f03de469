#!/usr/bin/env bash
# `make gpu-check [STEP=lease|rest|all|PART,PART...] [GPU_CHECK_OUT=dir]`: rope_ext proven on a CUDA
# GPU. Written for the lent machines (one H100 or H200, 16 cores, no network, 15 minutes of device
# time per issue with the machine's start, at most 10 a command, results only as files in $OUT: at
# most 8): tools/GPU_LEASE.md has the exact call. Each part runs under its own time cap and within the
# command's budget (GPU_CHECK_BUDGET, 520 s), and writes its log and its verdict as it finishes, so a
# command cut off still returns what was done; the summary's first lines are the parts' verdicts.
#
# STEP=lease (the default; one command of at most 9 minutes, most important first):
#   install   the rope_ext wheel `make gpu-build` carried (build/gpu-carry: cuda-check's, the one wheel
#             CI tests under three torches) installed in seconds, with the test hooks beside its
#             library and the other carried wheels beside the device's packages; built on the device
#             only if the carried wheel is missing, built from other sources (tools/source_hash.sh)
#             or registers no CUDA kernel (2 to 3 minutes on 16 cores).
#   smoke     every op forward and backward, bit for bit against the CPU kernel, on the bshd layout and
#             HF's view, in every dtype and pairing: whether the kernels run at all, in a minute.
#   test      tests/test_gpu.py and tests/test_cuda.py but the smoke's cases and the 2^31-element
#             tensors: double backward, opcheck, the module, the drop-ins, a patched transformers
#             model, Inductor, CUDA graphs, streams, the device-side assert.
#   memcheck  compute-sanitizer's memcheck over tests/gpu_kernel_cases.py: each of the 224 kernels
#             launched once, our kernels only; then its racecheck over the same cases (the QK-norm
#             kernels share their groups' sums through shared memory between barriers). Where the
#             sanitizer refuses the device (gVisor machines answer "Device not supported"), the
#             verdict says so and the part does not fail.
#   bench     benchmarks/bench_cuda.py --short: Llama-3-8B bfloat16 prefill (2k, 8k) and decode
#             against a device copy, HF eager, torch.compile of HF and Liger; then
#             benchmarks/bench_qk_norm.py --device cuda --quick: QK-norm + RoPE, Qwen3-8B bfloat16.
# STEP=rest (what the lease leaves out, for a later lease; more than one command's 10 minutes in all,
# so split it, e.g. STEP=mirror,large then STEP=initcheck,bench-full):
#   mirror     the host-emulation suites with the emulator swapped for the real kernels
#              (ROPE_EXT_TEST_KERNELS_ON=cuda, tests/conftest.py's KernelsOn);
#   large      the tensors past 2^31 elements and tokens (tests/test_gpu.py, marker gpu_large);
#   initcheck  compute-sanitizer's initcheck over the same 224 kernel cases;
#   bench-full benchmarks/bench_cuda.py, every case.
# STEP=all: both, for a machine with no time limit (it writes more than 8 files).
#
# Without an NVIDIA GPU it says so and exits 0 at once, running nothing. ROPE_EXT_GPU_CHECK_REHEARSAL=1
# (tools/gpu_rehearse.sh only, with a fake nvidia-smi) lets a CUDA build of torch with no device pass
# the device check, so that the harness itself is run here; its tests then skip.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STEP=${STEP:-lease}
PY=${PYTHON:-python3}
OUT=$(realpath -m "${GPU_CHECK_OUT:-build/gpu-check}")
BUDGET=${GPU_CHECK_BUDGET:-520}
CARRY=$ROOT/build/gpu-carry
export PYTHONUNBUFFERED=1
# torch infers CUDA_HOME from `which nvcc` (the parent of its folder: wrong for a wrapper script);
# the device build and sanitizer need it.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi

if ! command -v nvidia-smi > /dev/null 2>&1 || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi finds none): ran nothing"
  exit 0
fi
LEASE_PARTS=(smoke test memcheck bench)
REST_PARTS=(mirror large initcheck bench-full)
case "$STEP" in
  lease) PARTS=("${LEASE_PARTS[@]}") ;;
  rest) PARTS=("${REST_PARTS[@]}") ;;
  all) PARTS=("${LEASE_PARTS[@]}" "${REST_PARTS[@]}") ;;
  *) IFS=, read -ra PARTS <<< "$STEP" ;;
esac
for p in "${PARTS[@]}"; do
  case " ${LEASE_PARTS[*]} ${REST_PARTS[*]} " in *" $p "*) ;; *)
    echo "gpu-check: STEP must be lease, rest, all or a comma-separated list of parts" \
         "(${LEASE_PARTS[*]} ${REST_PARTS[*]}), got '$STEP'"; exit 2;; esac
done
if ! "$PY" -c "import os, torch, sys; sys.exit(not (torch.version.cuda and (torch.cuda.is_available() or
    os.environ.get('ROPE_EXT_GPU_CHECK_REHEARSAL') == '1')))" 2> /dev/null; then
  echo "gpu-check: a GPU is here, but $PY's torch is not a CUDA build that sees it; install one first"
  exit 1
fi
mkdir -p "$OUT"
SUMMARY=$OUT/summary.md
SUMMARY_TMP=${TMPDIR:-/tmp}/gpu_check_summary.$$
DEADLINE=$BUDGET  # (SECONDS counts from the script's start: the checks above are inside the budget)
FAILED=0
VERDICTS=()
RUNNING=""
# `import rope_ext` finds the carried wheel's package (or, built here, the checkout's) from any script
# and test, and the carried wheels come before the machine's own packages. PYTHONSAFEPATH: no
# script's folder or current directory ahead of them (the tests find conftest through pytest).
WHEEL_SITE=${TMPDIR:-/tmp}/rope_ext_gpu_check_site
export PYTHONPATH="$WHEEL_SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1

commit() {  # the checkout's commit: from git, else from the carried build's record (a copied tree has no .git)
  if [ "$(git rev-parse --show-toplevel 2> /dev/null)" = "$ROOT" ]; then git rev-parse --short HEAD; return; fi
  sed -n 's/^commit=\(.\{12\}\).*/\1 (from build\/gpu-carry\/BUILD_INFO)/p' "$CARRY/BUILD_INFO" 2> /dev/null || echo unknown
}
NVCC=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
MACHINE=(
  "- device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
  "- $("$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")' 2>&1 | tail -1); $("$NVCC" --version 2> /dev/null | tail -1)"
  "- kernel $(uname -r), $(nproc) cores; rope_ext $(commit)"
)

write_summary() {  # the verdicts first, then the machine; rewritten whole after every change
  {
    echo "# gpu-check STEP=$STEP, $(date -u +%Y-%m-%dT%H:%M:%SZ), ${SECONDS} s of a ${BUDGET} s budget"
    echo
    printf '%s\n' "${VERDICTS[@]}"
    [ -n "$RUNNING" ] && echo "- **$RUNNING**: RUNNING (cut off here if nothing follows)"
    echo
    printf '%s\n' "${MACHINE[@]}"
  } > "$SUMMARY_TMP" && mv "$SUMMARY_TMP" "$SUMMARY"  # (never half-written; the temporary file outside $OUT)
}

# part NAME CAP COMMAND...: COMMAND with its output in $OUT/NAME.log, stopped after CAP seconds or at
# the command's deadline; its verdict (time, exit, the log's closing line) goes into the summary.
CLOSING="passed|failed|error|skipped|gpu_kernel_cases|bench_cuda|ERROR SUMMARY|gpu-check:"
part() {
  local name=$1 cap=$2
  shift 2
  local left=$((DEADLINE - SECONDS - 5))
  if [ "$left" -lt 15 ]; then
    VERDICTS+=("- **$name**: NOT RUN: the command's $BUDGET s were spent"); FAILED=1; write_summary; return 0
  fi
  local own=GPU_CHECK_CAP_${name//-/_}  # GPU_CHECK_CAP_<PART> (upper case): another cap, for the rehearsal
  own=${own^^}
  [ -n "${!own:-}" ] && cap=${!own}
  [ "$cap" -gt "$left" ] && cap=$left
  RUNNING=$name
  write_summary
  echo "gpu-check: $name (at most $cap s): $*"
  local t0=$SECONDS rc=0
  timeout --kill-after=5 "$cap" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  local took=$((SECONDS - t0)) last verdict
  last=$(grep -E "$CLOSING" "$OUT/$name.log" | tail -1)
  last=${last:-$(tail -1 "$OUT/$name.log")}
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    verdict="TIMED OUT after $took s (cap $cap s)"; FAILED=1
  elif [ "$rc" != 0 ] && [[ $name == memcheck || $name == initcheck ]] && grep -q "Device not supported" "$OUT/$name.log"; then
    verdict="NOT RUN: compute-sanitizer refuses this device (\"Device not supported\"; kernel $(uname -r): gVisor"
    verdict+=" machines do this); run it on another machine"
    last=""
  elif [ "$rc" != 0 ]; then
    verdict="FAILED (exit $rc) in $took s"; FAILED=1
  else
    verdict="ok in $took s"
  fi
  VERDICTS+=("- **$name**: $verdict${last:+: $last}")
  RUNNING=""
  write_summary
  [ "$rc" != 0 ] && tail -20 "$OUT/$name.log"
  # (the rehearsal only: a pause after each part, so that a short budget is spent after the first
  # part however fast the parts run without a GPU)
  [ -n "${ROPE_EXT_GPU_CHECK_REHEARSAL:-}" ] && sleep "${GPU_CHECK_REHEARSAL_PAUSE:-0}"
  return 0
}

built() {
  "$PY" -c "import torch, rope_ext, sys; sys.exit(not torch._C._dispatch_has_kernel_for_dispatch_key('rope_ext::rotary', 'CUDA'))" 2> /dev/null
}

# The carried wheel installed (or a build here), the carried wheels installed; exits non-zero when
# rope_ext has no CUDA kernels afterwards.
install_build() {
  set -e
  rm -rf "$WHEEL_SITE"/rope_ext "$WHEEL_SITE"/rope_ext-*.dist-info
  if [ -d "$CARRY/wheels" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$WHEEL_SITE" "$CARRY"/wheels/*.whl
    echo "gpu-check: installed $(ls "$CARRY/wheels" | tr '\n' ' ')into $WHEEL_SITE"
  fi
  local here carried
  here=$(bash tools/source_hash.sh)
  carried=$(sed -n 's/^sources=//p' "$CARRY/BUILD_INFO" 2> /dev/null || true)
  if [ "$carried" = "$here" ] && ls "$CARRY"/dist/rope_ext-*.whl > /dev/null 2>&1; then
    # The wheel as a user installs it (--no-deps: the device's torch stays), ahead of the checkout on
    # PYTHONPATH; the test hooks beside its library. Its library must be the very file CI tested.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$WHEEL_SITE" "$CARRY"/dist/rope_ext-*.whl
    local lib
    lib=$("$PY" -c "import rope_ext; print(rope_ext._LIBRARY)")
    cp "$CARRY/lib/librope_ext_testing.so" "$(dirname "$lib")/"
    [ "$(sha256sum "$lib" | cut -c1-64)" = "$(sed -n 's/^library_sha256=//p' "$CARRY/BUILD_INFO")" ] ||
      { echo "gpu-check: $lib is not the carried wheel's library"; return 1; }
    echo "gpu-check: the carried wheel is installed, rope_ext from $lib: $(tr '\n' ' ' < "$CARRY/BUILD_INFO")"
    if built; then echo "gpu-check: carried wheel, CUDA kernels registered"; return 0; fi
    echo "gpu-check: the carried wheel registers no CUDA kernel under this torch: building here"
    rm -rf "$WHEEL_SITE"/rope_ext "$WHEEL_SITE"/rope_ext-*.dist-info
  else
    echo "gpu-check: no carried wheel of these sources (carried '${carried:-none}', these $here): building here"
  fi
  "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" ||
    { echo "gpu-check: the build needs setuptools 77 or newer; carry its wheel"; return 1; }
  local arch
  arch=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  rm -rf rope_ext/lib
  ROPE_EXT_CUDA=1 ROPE_EXT_TESTING=1 TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="$(nproc)" \
    "$PY" -m pip install --no-build-isolation --no-deps --no-index -e .
  built || { echo "gpu-check: built here, and still no CUDA kernel registered"; return 1; }
  echo "gpu-check: built here, CUDA kernels registered"
}

sanitizer() {  # sanitizer TOOL: compute-sanitizer's TOOL over one call of each of the 224 kernels
  local san
  san=$(command -v compute-sanitizer || ls "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" 2> /dev/null) ||
    { echo "gpu-check: compute-sanitizer not found"; return 1; }
  # Each tensor its own allocation (no caching allocator), so an access past one is caught.
  # (kns=rope_ext: every kernel of ours, rotary_kernel, qk_norm_kernel and weight_grad_sum_kernel,
  # whose names are in namespace rope_ext; torch's own kernels are not checked.)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$san" --tool "$1" --error-exitcode 1 --kernel-name kns=rope_ext \
    "$PY" tests/gpu_kernel_cases.py --device cuda
}

PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
"$PY" -c "import pytest_timeout" 2> /dev/null && PYTEST+=(--timeout=120)  # a hung test fails, not the part
SMOKE_K="forward_backward_bitwise and (bshd or hf_view)"  # smoke's cases; test runs the others
export -f install_build built sanitizer
export PY CARRY WHEEL_SITE

echo "gpu-check: STEP=$STEP: ${PARTS[*]}; output in $OUT; budget $BUDGET s"
write_summary
part install 330 bash -c install_build
for p in "${PARTS[@]}"; do
  if [ "$FAILED" = 1 ] && [[ ${VERDICTS[0]} != "- **install**: ok"* ]]; then
    VERDICTS+=("- **$p**: NOT RUN: no CUDA build of rope_ext to test (install failed)")
    write_summary
    continue
  fi
  case $p in
    smoke) part smoke 120 env ROPE_EXT_GPU_CHECK=1 "${PYTEST[@]}" -k "$SMOKE_K" tests/test_gpu.py ;;
    test) part test 240 env ROPE_EXT_GPU_CHECK=1 "${PYTEST[@]}" -m "not gpu_large" -k "not ($SMOKE_K)" \
            tests/test_gpu.py tests/test_cuda.py ;;
    memcheck) part memcheck 210 bash -c "sanitizer memcheck && sanitizer racecheck" ;;
    bench) part bench 200 bash -c "\"$PY\" benchmarks/bench_cuda.py --short --out \"$OUT\" &&
             \"$PY\" benchmarks/bench_qk_norm.py --device cuda --quick --rounds 15" ;;
    mirror) part mirror 420 env ROPE_EXT_TEST_KERNELS_ON=cuda "${PYTEST[@]}" tests/test_cuda_emulation.py tests/test_qk_norm_emulation.py \
              tests/test_rotary_pos.py tests/test_fuzz.py tests/test_robustness.py ;;
    large) part large 300 env ROPE_EXT_GPU_CHECK=1 "${PYTEST[@]}" -m gpu_large tests/test_gpu.py ;;
    initcheck) part initcheck 240 bash -c "sanitizer initcheck" ;;
    bench-full) part bench-full 480 "$PY" benchmarks/bench_cuda.py --out "$OUT" ;;
  esac
done
echo
cat "$SUMMARY"
exit $FAILED
