#!/usr/bin/env bash
# `make newcomer-check`: the README's from-source install, run as written (its own lines, read by
# tools/readme_block.sh) in a fresh clone of this checkout's HEAD, with a CUDA build of torch
# (torch 2.14.1: cuda-check's venv, made fresh in CI), where the CUDA toolkit is not where torch
# guesses it:
#  (a) nvcc on PATH only through a wrapper script outside the toolkit (/usr/local/bin/nvcc on the
#      developers' machines), no CUDA_HOME: setup.py's choice is printed and must name the toolkit
#      nvcc belongs to, not the wrapper's folder. (The whole build in this setup is cuda-check's,
#      which sets no CUDA_HOME either and checks what `python -m rope_ext.info` says of it.)
#  (b) CUDA_HOME naming a folder that holds no toolkit (as a runtime-only install leaves one), and no
#      nvcc on PATH: the install builds the CPU kernels and says why in one line; rope_ext imports
#      and `python -m rope_ext.info` says no CUDA kernels were built, and why.
#  (c) (b) with ROPE_EXT_CUDA=1: the install stops with that reason and says what to set.
# pip prints setup.py's line only with -v; the build records it, and `python -m rope_ext.info` prints
# it. About 2 minutes, nearly all of it (b)'s build of the CPU kernels. NEWCOMER_PYTHON: the Python
# whose venv is used (default cuda-check's venv); everything else lives in build/newcomer-check.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=$(realpath -ms "${NEWCOMER_PYTHON:-${CUDA_VENV:-build/venv-cuda}/bin/python}")
OUT=$(realpath -m build/newcomer-check)
fail() { echo "newcomer-check: FAILED: $*" >&2; exit 1; }
PYTHONSAFEPATH=1 "$PY" -c "import torch; assert torch.version.cuda, torch.__version__" 2>/dev/null ||
  fail "$PY has no CUDA build of torch (make cuda-check makes that venv: CUDA_VENV_ONLY=1 bash tools/cuda_check.sh)"
rm -rf "$OUT" && mkdir -p "$OUT/cuda-runtime-only/lib64"
git clone -q "$ROOT" "$OUT/clone"
git -C "$OUT/clone" checkout -q "$(git rev-parse HEAD)"
INSTALL=$(bash "$OUT/clone/tools/readme_block.sh" from-source)
echo "newcomer-check: the README's from-source install:"; sed 's/^/  /' <<< "$INSTALL"
VENV_BIN=$(dirname "$PY")
t0=$SECONDS

# ---- (a) the wrapper's nvcc, no CUDA_HOME: setup.py's choice --------------------------------------
choice=$(cd "$OUT/clone" && env -u CUDA_HOME -u CUDA_PATH PATH="$VENV_BIN:$PATH" "$PY" -c "
import runpy, sys
sys.argv = ['setup.py', '--version']
print(runpy.run_path('setup.py')['want_cuda']().line())" 2>&1 | tail -1)
echo "newcomer-check: (a) $choice"
nvcc=$(PATH="$VENV_BIN:$PATH" command -v nvcc || true)
outside=${nvcc:+$(realpath -m "$(dirname "$nvcc")/..")}  # where torch guesses the toolkit: the folder above nvcc's
if [ -n "$nvcc" ] && [ ! -e "$outside/include/cuda_runtime.h" ]; then  # a wrapper or a link outside the toolkit
  [[ $choice == "rope_ext: CUDA kernels: built with the toolkit at "* ]] ||
    fail "(a) the nvcc on PATH, $nvcc, is outside its toolkit, and setup.py found no toolkit through it"
  [[ $choice != *"toolkit at $outside ("* ]] || fail "(a) setup.py took $outside, the folder above nvcc's, for the toolkit"
else
  echo "newcomer-check: (a) the nvcc on PATH (${nvcc:-none}) sits in its toolkit: (a) is not this machine's setup"
fi

# ---- (b) CUDA_HOME without a toolkit, no nvcc on PATH: the CPU kernels, and why -------------------
IFS=: read -ra dirs <<< "$VENV_BIN:$PATH"
no_nvcc_path=
for d in "${dirs[@]}"; do
  if [ -n "$d" ] && [ ! -x "$d/nvcc" ]; then no_nvcc_path+="$d:"; fi
done
run_b() {  # run_b <extra env>...: the README's lines in the clone, setup (b)
  (cd "$OUT/clone" && env -u CUDA_PATH PATH="${no_nvcc_path%:}" CUDA_HOME="$OUT/cuda-runtime-only" "$@" \
     bash -euo pipefail -c "$INSTALL")
}
run_b > "$OUT/b.log" 2>&1 || { tail -30 "$OUT/b.log"; fail "(b) the README's install, CUDA_HOME without a toolkit"; }
echo "newcomer-check: (b) built and installed in $((SECONDS - t0)) s"
(cd "$OUT" && PATH="${no_nvcc_path%:}" "$PY" -m rope_ext.info) > "$OUT/b-info.txt" 2>&1 ||
  { cat "$OUT/b-info.txt"; fail "(b) import rope_ext / python -m rope_ext.info"; }
sed 's/^/newcomer-check: (b) rope_ext.info: /' "$OUT/b-info.txt"
grep -q "^CUDA kernels: none" "$OUT/b-info.txt" && grep -q "cuda-runtime-only is not a CUDA toolkit" "$OUT/b-info.txt" ||
  fail "(b) python -m rope_ext.info does not say that no CUDA kernels were built, and why"
(cd "$OUT" && "$PY" -c "
import torch, rope_ext
q, k = torch.randn(1, 4, 2, 8, requires_grad=True), torch.randn(1, 4, 2, 8, requires_grad=True)
cos, sin = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
sum(rope_ext.rotary_qk(q, k, cos, sin)).sum().backward()
assert q.grad is not None") || fail "(b) the installed CPU kernels do not run"

# ---- (c) ROPE_EXT_CUDA=1 in (b): stops, with the reason and the hint ------------------------------
rc=0
run_b ROPE_EXT_CUDA=1 > "$OUT/c.log" 2>&1 || rc=$?
[ "$rc" != 0 ] || fail "(c) ROPE_EXT_CUDA=1 without a toolkit installed"
grep -q "ROPE_EXT_CUDA=1, but the CUDA kernels cannot be built: CUDA_HOME=$OUT/cuda-runtime-only is not a CUDA toolkit" \
  "$OUT/c.log" && grep -q "set CUDA_HOME to a CUDA toolkit" "$OUT/c.log" ||
  { tail -30 "$OUT/c.log"; fail "(c) ROPE_EXT_CUDA=1 did not stop with the reason and the hint"; }
echo "newcomer-check: (c) $(grep -o "ROPE_EXT_CUDA=1, but the CUDA kernels cannot be built: [^.]*" "$OUT/c.log" | head -1)"
echo "newcomer-check: passed in $((SECONDS - t0)) s"
