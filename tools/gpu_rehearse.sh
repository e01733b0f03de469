#!/usr/bin/env bash
# `make gpu-rehearse`: the lease (tools/GPU_LEASE.md) end to end on this machine, against a fake GPU,
# so that a lent GPU's minutes go to the kernels and not to the harness:
#  1. the carried wheel is of these sources (`make gpu-build` otherwise) and the command written in
#     GPU_LEASE.md is under the device call's 2,000 characters;
#  2. the tree as the device call sends it (tracked and untracked files git does not ignore, and the
#     carried folder; no .git), in build/gpu-rehearse/tree, under the call's 64 MiB;
#  3. a fake GPU: nvidia-smi names an H100; compute-sanitizer answers as on a gVisor machine ("Device
#     not supported"); python3 is GPU_VENV's (build/gpu-venv), which holds the device's torch (2.11.0, CUDA 13)
#     and the packages the device has that the tests import; pip cannot reach an index;
#  4. the command itself, with $OUT = build/gpu-rehearse/out. The install part runs for real: the
#     carried wheels installed, the rope_ext wheel among them, its library checked to be the
#     wheel's and its CUDA kernels found registered under the device's torch. The GPU tests then skip (no device), the benchmark finds no device, and memcheck
#     must be reported NOT RUN, not failed;
#  5. what $OUT holds against what comes back (at most 8 files, 16 MiB each, 2 folders deep, plain
#     names: here the summary and 5 logs, which the benchmark's 2 tables join on a GPU), and the
#     summary's verdict lines, first, one per part in order;
#  6. the command cut short: with a 70-second budget and a 55-second pause after each part
#     (GPU_CHECK_REHEARSAL_PAUSE: a part starts only with 15 s left, so install runs and nothing
#     after it, however fast the parts run here), the parts the budget leaves no time for are NOT RUN,
#     every part has its line, the exit is non-zero; with smoke capped at 1 second
#     (GPU_CHECK_CAP_SMOKE), it is TIMED OUT and the parts after it still run.
# The two runs of 6 start with the full one of 4, in the background: the cut one mostly waits out its
# pauses and each keeps about one core busy, so the three take about as long as the full one alone
# (measured: 56 s, against 136 s one after another). Each has a TMPDIR of its own, where the lease
# installs the wheels (gpu_check.sh's WHEEL_SITE) and writes its summary.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=$(realpath -m "${GPU_VENV:-build/gpu-venv}")/bin/python  # (gpu_build.sh's venv)
WORK=$ROOT/build/gpu-rehearse
fail() { echo "gpu-rehearse: FAILED: $*"; wait; exit 1; }  # (after any lease still running)

# 1.
if [ "$(sed -n 's/^sources=//p' build/gpu-carry/BUILD_INFO 2> /dev/null)" != "$(bash tools/source_hash.sh)" ]; then
  echo "gpu-rehearse: build/gpu-carry is missing or its wheel was built from other sources: make gpu-build"
  bash tools/gpu_build.sh
fi
cmd=$(awk '/<!-- lease-command -->/ {f = 1; next} f && /^```/ {if (n++) exit; next} f' tools/GPU_LEASE.md)
[ -n "$cmd" ] || fail "no lease command found in tools/GPU_LEASE.md"
[ "${#cmd}" -le 2000 ] || fail "the lease command is ${#cmd} characters, over the device call's 2,000"
echo "gpu-rehearse: the lease command, ${#cmd} characters: $cmd"

# 2.
rm -rf "$WORK" && mkdir -p "$WORK/tree/build" "$WORK/bin" "$WORK/out"
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$WORK/tree"
cp -r build/gpu-carry "$WORK/tree/build/"
sent=$(du -sb "$WORK/tree" | cut -f1)
[ "$sent" -lt $((64 * 1048576)) ] || fail "the device call would send $((sent / 1048576)) MiB, over 64"
echo "gpu-rehearse: the call sends $((sent / 1024)) KiB (the tree and build/gpu-carry) of 64 MiB"

# 3.
"$PY" -m pip install -q pytest pytest-timeout "hypothesis==6.155.2" numpy expecttest huggingface_hub tokenizers \
  safetensors pyyaml regex tqdm typer
cat > "$WORK/bin/nvidia-smi" << 'EOF'
#!/bin/sh
case "$*" in
  *--query-gpu*) echo "NVIDIA H100 80GB HBM3 (fake: gpu-rehearse), 81559 MiB, 580.159.04" ;;
  *) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-fake-gpu-rehearse)" ;;
esac
EOF
cat > "$WORK/bin/compute-sanitizer" << 'EOF'
#!/bin/sh
echo "========= COMPUTE-SANITIZER"
echo "========= Error: Device not supported (fake: gpu-rehearse, as on a gVisor machine)"
exit 1
EOF
printf '#!/bin/sh\nexec %s "$@"\n' "$PY" > "$WORK/bin/python3"
chmod +x "$WORK/bin/"*

# 4.
lease() {  # lease OUT [BUDGET [VAR=value...]]: the command, as the device runs it, in the copied tree
  local out=$1 run=$cmd  #                          (BUDGET in place of the command's own; VARs in its environment)
  [ -n "${2:-}" ] && run=$(sed -E "s/GPU_CHECK_BUDGET=[0-9]+/GPU_CHECK_BUDGET=$2/" <<< "$cmd")
  grep -q "GPU_CHECK_BUDGET=${2:-}" <<< "$run" || fail "the lease command sets no GPU_CHECK_BUDGET to replace"
  shift $(($# < 2 ? $# : 2))
  rm -rf "$out.tmp" && mkdir -p "$out.tmp"
  (cd "$WORK/tree" && env OUT="$out" TMPDIR="$out.tmp" PATH="$WORK/bin:$PATH" GIT_CEILING_DIRECTORIES="$WORK" \
    PIP_NO_INDEX=1 ROPE_EXT_GPU_CHECK_REHEARSAL=1 "$@" timeout 570 bash -c "$run")
}
t0=$SECONDS
# (6.'s two runs, beside this one: their exit statuses in files, checked below)
(rc=0; lease "$WORK/out-cut" 70 GPU_CHECK_REHEARSAL_PAUSE=55 > "$WORK/lease-cut.log" 2>&1 || rc=$?
 echo "$rc" > "$WORK/lease-cut.rc") &
cut_pid=$!
(rc=0; lease "$WORK/out-capped" "" GPU_CHECK_CAP_SMOKE=1 > "$WORK/lease-capped.log" 2>&1 || rc=$?
 echo "$rc" > "$WORK/lease-capped.rc") &
capped_pid=$!
rc=0
lease "$WORK/out" > "$WORK/lease.log" 2>&1 || rc=$?
cat "$WORK/lease.log"
[ "$rc" = 0 ] || fail "the lease exited $rc (build/gpu-rehearse/lease.log)"
echo "gpu-rehearse: the lease ran in $((SECONDS - t0)) s"

# 5.
files=$(cd "$WORK/out" && find . -type f | sort)
n=$(grep -c . <<< "$files")
# Exactly these: with a GPU the benchmark adds its two tables (bench_cuda.csv, bench_cuda.md), 8 in all.
expected_files=$'./bench.log\n./install.log\n./memcheck.log\n./smoke.log\n./summary.md\n./test.log'
[ "$files" = "$expected_files" ] || fail "\$OUT holds $(tr '\n' ' ' <<< "$files"), not the 6 files expected"
[ $((n + 2)) -le 8 ] || fail "\$OUT would hold $((n + 2)) files on a GPU, more than the 8 that come back"
while read -r f; do
  [ "$(stat -c %s "$WORK/out/$f")" -le $((16 * 1048576)) ] || fail "$f is over 16 MiB"
  [ "$(tr -cd / <<< "${f#./}" | wc -c)" -le 2 ] || fail "$f is more than 2 folders down"
  [[ ${f#./} =~ ^[A-Za-z0-9._/-]+$ ]] || fail "$f has a name that would not come back"
done <<< "$files"
echo "gpu-rehearse: \$OUT holds $n files ($(tr '\n' ' ' <<< "${files//.\//}")), all within what comes back"
summary=$WORK/out/summary.md
verdicts=$(sed -n '3,7p' "$summary" | sed 's/^- \*\*\([a-z-]*\)\*\*: \([A-Z]*[a-z]*\).*/\1 \2/')
expected=$'install ok\nsmoke ok\ntest ok\nmemcheck NOT\nbench ok'
[ "$verdicts" = "$expected" ] || { cat "$summary"; fail "the summary's first lines are not the five verdicts expected"; }
grep -q "^- \*\*install\*\*: ok .*carried wheel, CUDA kernels registered" "$summary" ||
  fail "the install part did not use the carried wheel"
grep -q "rope_ext from .*rope_ext_gpu_check_site/rope_ext/lib/librope_ext.so" "$WORK/out/install.log" ||
  fail "the tests' rope_ext is not the carried wheel's"
grep -q "Device not supported" "$summary" || fail "memcheck's refusal is not named in the summary"
grep -q "from build/gpu-carry/BUILD_INFO" "$summary" || fail "the summary has no commit for a tree without .git"
echo "gpu-rehearse: the summary opens with the five verdicts (install from the carried wheel; memcheck NOT RUN," \
     "named as the sanitizer's refusal); the commit comes from BUILD_INFO"

# 6.
wait "$cut_pid" "$capped_pid"
rc=$(cat "$WORK/lease-cut.rc")
cut=$WORK/out-cut/summary.md
[ "$rc" != 0 ] && grep -q "^- \*\*install\*\*: ok" "$cut" && grep -q "NOT RUN: the command's 70 s were spent" "$cut" &&
  [ "$(sed -n '3,7p' "$cut" | grep -c '^- \*\*')" = 5 ] ||
  { cat "$cut"; fail "the lease cut off at 70 s (exit $rc) does not say what was cut"; }
echo "gpu-rehearse: with a 70 s budget, the lease exits $rc and its summary says what did not run:"
sed -n '3,7p' "$cut"
rc=$(cat "$WORK/lease-capped.rc")
capped=$WORK/out-capped/summary.md
[ "$rc" != 0 ] && grep -q "^- \*\*smoke\*\*: TIMED OUT after [0-9]* s (cap 1 s)" "$capped" &&
  grep -q "^- \*\*test\*\*: ok" "$capped" && grep -q "^- \*\*bench\*\*: ok" "$capped" ||
  { cat "$capped"; fail "smoke capped at 1 s (exit $rc): not TIMED OUT, or the parts after it did not run"; }
echo "gpu-rehearse: with smoke capped at 1 s, it is TIMED OUT, the parts after it run, and the lease exits $rc"
echo "gpu-rehearse: OK ($((SECONDS - t0)) s for the three leases)"
