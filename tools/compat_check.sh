#!/usr/bin/env bash
# `make compat-check TORCH=<version>`: rope_ext built and tested against one torch release.
#  1. a venv with that torch (what pip gives for `torch==<version>`: on Linux the CUDA build, whose
#     CMake package is built against here with no CUDA toolkit needed), setuptools, ninja and the
#     core tests' dependencies, kept in build/compat/<version>/venv and reused. torch is installed
#     first and alone; nothing installed after it may replace it (checked);
#  2. a copy of the source tree (build/compat/<version>/src; its CMake build directory is kept, so a
#     rerun recompiles only what changed), pip-installed into that venv CPU-only (ROPE_EXT_CUDA=0)
#     with the test hooks (ROPE_EXT_TESTING=1), without build isolation and without dependencies,
#     as a user installs it;
#  3. the core tests (CORE_TESTS in the Makefile) under that torch, against that installation, on
#     the CPU. PYTHONSAFEPATH keeps the checkout off sys.path, so `import rope_ext` finds the venv's
#     build and not the checkout's own (built against another torch).
# It prints each step's time and a last line with the torch, the counts and the times.
# A pip configuration that caps torch (a constraints file) applies here as everywhere; lift it for
# one run with PIP_CONSTRAINT=/dev/null.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TORCH=${TORCH:-}
if [[ ! $TORCH =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "compat-check: TORCH must be a torch release, e.g. \`make compat-check TORCH=2.11.0\`; got '$TORCH'" >&2
  exit 2
fi
CORE_TESTS=${CORE_TESTS:?"the core test files: run this through make compat-check"}
HERE=$ROOT/build/compat/$TORCH
VENV=$HERE/venv
SRC=$HERE/src
PY=$VENV/bin/python
mkdir -p "$HERE"
log() { echo "compat-check [torch $TORCH]: $*"; }
pip_in() {  # pip_in <log name> <pip install arguments>...: quiet, its output in build/compat/<version>
  local log=$HERE/$1.log
  shift
  "$PY" -m pip install "$@" > "$log" 2>&1 || { tail -30 "$log"; log "FAILED: pip install $* ($log)"; exit 1; }
}
torch_is() { "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; }

# ---- 1. the venv --------------------------------------------------------------------------------
t0=$(date +%s)
if ! torch_is; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  pip_in pip-torch "torch==$TORCH"
fi
if ! "$PY" -c "import ninja, pytest, hypothesis, expecttest, numpy, setuptools; assert int(setuptools.__version__.split('.')[0]) >= 77" 2>/dev/null; then
  # The build tools and the tests' dependencies, with torch pinned to the installed one so that
  # pip cannot replace it; setuptools 77 or newer (setup.py), within what this torch accepts.
  pip_in pip-tools "torch==$("$PY" -c 'from importlib.metadata import version; print(version("torch"))')" \
    "setuptools>=77" ninja "pytest>=7" "hypothesis==6.155.2" expecttest numpy
fi
torch_is || { log "FAILED: the venv's torch is $("$PY" -c 'import torch; print(torch.__version__)')"; exit 1; }
DESC=$("$PY" -c "import torch; print(torch.__version__ + (f', CUDA {torch.version.cuda} build' if torch.version.cuda else ', CPU build'))")
t1=$(date +%s)
log "venv $VENV: torch $DESC ($((t1 - t0)) s)"
# COMPAT_VENV_ONLY=1: step 1 alone (CI makes the venv in the background while earlier steps run).
[ "${COMPAT_VENV_ONLY:-0}" = 1 ] && exit 0

# ---- 2. the CPU-only build ----------------------------------------------------------------------
mkdir -p "$SRC"
find "$SRC" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +   # keep the CMake build directory
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$SRC"
( cd "$SRC" && ROPE_EXT_CUDA=0 ROPE_EXT_TESTING=1 "$PY" -m pip install -v --no-build-isolation --no-deps \
    --force-reinstall . > "$HERE/build.log" 2>&1 ) || { tail -40 "$HERE/build.log"; log "FAILED: the build ($HERE/build.log)"; exit 1; }
torch_is || { log "FAILED: installing rope_ext replaced torch"; exit 1; }
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
t2=$(date +%s)
log "rope_ext built CPU-only against it and installed into the venv ($((t2 - t1)) s)"

# ---- 3. the core tests --------------------------------------------------------------------------
PYTHONSAFEPATH=1 "$PY" -c "
import pathlib, rope_ext
assert pathlib.Path('$SITE') in pathlib.Path(rope_ext.__file__).resolve().parents, rope_ext.__file__" 2>/dev/null ||
  { log "FAILED: import rope_ext does not find the venv's build"; exit 1; }
set +e
# shellcheck disable=SC2086  # CORE_TESTS is a list of paths
PYTHONSAFEPATH=1 "$PY" -m pytest -q -p no:cacheprovider $CORE_TESTS 2>&1 | tee "$HERE/tests.log"
status=${PIPESTATUS[0]}
set -e
t3=$(date +%s)
counts=$(tail -1 "$HERE/tests.log" | sed 's/^=* *//; s/ *=*$//')
log "torch $DESC: $counts; venv $((t1 - t0)) s, build $((t2 - t1)) s, tests $((t3 - t2)) s"
exit "$status"
