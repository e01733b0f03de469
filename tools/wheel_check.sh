#!/usr/bin/env bash
# `make wheel-check`: one wheel, built once, under many torches (issue 37). The wheel is WHEEL: CI
# gives the one `make cuda-check` built (build/cuda-check/dist: CPU and CUDA kernels, against torch
# 2.14.1); by default it is the CPU-only one `make dist-check` built from the sdist against torch
# 2.13. The library is on torch's stable ABI, so the same file must load and pass under every torch
# from 2.10, CUDA torches of CUDA 12 and 13 alike (a CPU-only torch: dist-check loads the wheel under
# one, and `make test` runs the whole suite under one, on the same sources).
# For each release in TORCHES (default 2.10.0 2.11.0 2.15.0: the oldest the stable ABI allows, the
# GPU machines', the newest; 2.13.0, this machine's CPU build, runs the whole suite in `make test`
# on the same sources, and the wheel itself in dist-check's venv, where it loads, registers its ops
# and runs the C++ example):
#  1. a venv in build/wheel-check/<version> (reused) with that torch, as pip gives it (on Linux the
#     CUDA build; 2.13.0 would be the CPU build), and the tests' dependencies;
#  2. the wheel installed into it with --no-deps (its requirement torch>=2.10 must not move torch),
#     and beside its library the test hooks' library built by `make setup` (also stable-ABI code:
#     csrc/testing/), which the wheel leaves out;
#  3. the core tests, run from outside the checkout against the venv's rope_ext, whose library is
#     checked to be the wheel's very file; but for the tests that run the CPU kernels' other ISA
#     variants in subprocesses of their own (VARIANT_TESTS): which variant runs, and what it
#     computes, depend on the CPU and the build, not on the torch it loads into, and `make test`
#     and `make sanitize` run them (three torches' runs of them took 27 CPU-seconds each).
# WHEEL_VENV_ONLY=1 only makes the venvs (CI makes them in the background while other steps run).
set -euo pipefail
[ -z "${WHEEL:-}" ] || WHEEL=$(realpath -m "$WHEEL")  # (relative to the caller's directory)
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}  # the checkout's Python, whose `make setup` built the test hooks
TORCHES=${TORCHES:-2.10.0 2.11.0 2.15.0}
CORE_TESTS=${CORE_TESTS:?"the core test files: run this through make wheel-check"}
# (step 3's deselection, a pytest -k expression over test names)
VARIANT_TESTS="under_the_other_variants or compiled_for_their_isa or under_the_avx2_variant"
OUT=$ROOT/build/wheel-check
log() { echo "wheel-check: $*"; }
fail() { echo "wheel-check: FAILED: $*" >&2; exit 1; }
mkdir -p "$OUT"

make_venv() {  # make_venv <torch version>: build/wheel-check/<version>/venv with that torch and the tests' tools
  local version=$1 here=$OUT/$1
  local py=$here/venv/bin/python
  mkdir -p "$here"
  torch_is() { "$py" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; }
  if ! torch_is; then
    rm -rf "$here/venv"
    python3 -m venv "$here/venv"
    # (this machine's pip configuration caps torch at 2.14.1: PIP_CONSTRAINT=/dev/null lifts it here)
    PIP_CONSTRAINT=/dev/null "$py" -m pip install "torch==$version" > "$here/pip-torch.log" 2>&1 || { tail -20 "$here/pip-torch.log"; fail "torch==$version"; }
  fi
  if ! "$py" -c "import pytest, hypothesis, expecttest, numpy" 2>/dev/null; then
    # torch pinned to the installed one, so that pip cannot replace it
    PIP_CONSTRAINT=/dev/null "$py" -m pip install "torch==$("$py" -c 'from importlib.metadata import version; print(version("torch"))')" \
      "pytest>=7" "hypothesis==6.155.2" expecttest numpy > "$here/pip-tools.log" 2>&1 ||
      { tail -20 "$here/pip-tools.log"; fail "the test tools for torch $version"; }
  fi
  torch_is || fail "the venv for $version has torch $("$py" -c 'import torch; print(torch.__version__)')"
}

t0=$(date +%s)
for version in $TORCHES; do make_venv "$version"; done
log "venvs for torch $TORCHES ready ($(($(date +%s) - t0)) s)"
[ "${WHEEL_VENV_ONLY:-0}" = 1 ] && exit 0

if [ -z "${WHEEL:-}" ]; then
  wheels=("$ROOT"/build/dist-check/dist/rope_ext-*.whl)
  [ "${#wheels[@]}" = 1 ] || fail "expected one wheel in build/dist-check/dist, found: ${wheels[*]}"
  WHEEL=${wheels[0]}
fi
[ -f "$WHEEL" ] || fail "no wheel at $WHEEL: run make dist-check first (it leaves one in build/dist-check/dist), or set WHEEL"
HOOKS=$("$PYTHON" -c "import rope_ext, pathlib; print(pathlib.Path(rope_ext._LIBRARY).with_name('librope_ext_testing.so'))")
[ -f "$HOOKS" ] || fail "no test hooks library at $HOOKS: run make setup"
LIBRARY=$("$PYTHON" - "$WHEEL" <<'PYEOF'
import hashlib, re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if re.fullmatch(r"rope_ext/lib/librope_ext\.so\.[0-9.]+", n))
    print(name, hashlib.sha256(z.read(name)).hexdigest())
PYEOF
)
log "$(basename "$WHEEL") (its ${LIBRARY%% *} sha256 ${LIBRARY##* }), hooks from $HOOKS"

check_version() {  # check_version <torch version>: the wheel installed beside it and the core tests;
  # its summary line goes to $OUT/<version>/summary, and a failure returns nonzero
  local version=$1 here=$OUT/$1 t1 rc counts
  local py=$here/venv/bin/python
  t1=$(date +%s)
  "$py" -m pip install --no-deps --force-reinstall "$WHEEL" > "$here/pip-wheel.log" 2>&1 ||
    { tail -20 "$here/pip-wheel.log"; echo "wheel-check: FAILED: installing the wheel beside torch $version"; return 1; }
  site_lib=$(cd "$OUT" && "$py" -c 'import rope_ext; print(rope_ext._LIBRARY)')
  cp "$HOOKS" "$(dirname "$site_lib")/"
  (cd "$OUT" && "$py" - "$site_lib" "${LIBRARY##* }" <<'PYEOF'
import hashlib, pathlib, sys, sysconfig
import rope_ext, torch
lib, digest = pathlib.Path(sys.argv[1]), sys.argv[2]
assert hashlib.sha256(lib.read_bytes()).hexdigest() == digest, f"{lib} is not the wheel's library"
site = pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()
assert site in pathlib.Path(rope_ext.__file__).resolve().parents, f"rope_ext not from the venv: {rope_ext.__file__}"
print(f"wheel-check: torch {torch.__version__}: rope_ext {rope_ext.__version__} from {rope_ext.__file__}")
PYEOF
  ) || { echo "wheel-check: FAILED: the wheel's rope_ext under torch $version"; return 1; }
  rc=0
  (cd "$OUT" && OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONSAFEPATH=1 "$py" -m pytest -q -p no:cacheprovider --rootdir="$ROOT" -c "$ROOT/pyproject.toml" \
    -k "not ($VARIANT_TESTS)" $(for t in $CORE_TESTS; do echo "$ROOT/$t"; done)) > "$here/tests.log" 2>&1 || rc=$?
  counts=$(tail -1 "$here/tests.log" | sed 's/^=* *//; s/ *=*$//')
  [ "$rc" = 0 ] || tail -40 "$here/tests.log"
  echo "torch $("$py" -c 'import torch; print(torch.__version__)'): $counts ($(($(date +%s) - t1)) s)" > "$here/summary"
  return "$rc"
}

# Up to three torches at a time (WHEEL_LANES): a test run keeps about one core of the two busy
# (measured: 6.4 CPU minutes in 6.0 minutes of make test), so three runs share two cores in about
# 1.5 runs' time where two rounds (two, then one alone) take two; the runs share nothing but the
# wheel, read-only. Each with one OpenMP thread by default (runs of two threads spin on each other's
# cores; the tests that want threads set them).
status=0
running=0
for version in $TORCHES; do
  rm -f "$OUT/$version/summary"
  [ "$running" -lt "${WHEEL_LANES:-3}" ] || { wait -n || status=1; running=$((running - 1)); }
  check_version "$version" > "$OUT/$version/check.log" 2>&1 &
  running=$((running + 1))
done
while [ "$running" -gt 0 ]; do wait -n || status=1; running=$((running - 1)); done
summary=()
for version in $TORCHES; do
  cat "$OUT/$version/check.log"
  summary+=("$(cat "$OUT/$version/summary" 2>/dev/null || echo "torch $version: no result")")
done
for line in "${summary[@]}"; do log "$line"; done
log "one wheel under ${#summary[@]} torches in $(($(date +%s) - t0)) s"
exit "$status"
