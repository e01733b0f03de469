#!/usr/bin/env bash
# `make dist-check`: rope_ext as a user gets it, from an sdist and from a wheel built from that sdist.
#
#  1. A fresh venv with only torch==2.13.0 (the CPU build) and the build tools (setuptools, build,
#     ninja; CMake is the system's) builds the sdist from this checkout, unpacks it, and builds a
#     wheel from the unpacked sdist with build isolation, as a plain `pip install .` does: the
#     isolated environment gets pyproject.toml's build requires, torch among them (pinned to the
#     venv's torch, so that no other is downloaded), and a file that the sdist leaves out fails the
#     build here. The build went through CMake with Ninja. (Builds without isolation are make setup's
#     and make newcomer-check's.)
#  2. The wheel: tagged py3-none-<platform> (the library does not use Python's C API); it holds
#     librope_ext.so, the headers and the CMake package, and not the test hooks' library; its
#     metadata requires torch>=2.10 and nothing more (the library is on torch's stable ABI; make
#     wheel-check runs this wheel under several torches).
#  3. Another fresh venv installs torch==2.13.0 and the wheel, and runs tools/smoke_test.py from
#     outside the checkout: forward, backward, opcheck, torch.compile, RotaryEmbedding. Then
#     examples/cpp is built against the installed wheel through find_package(rope_ext), as a C++
#     user would, and run: it links the very file Python loads.
# Everything lives in build/dist-check (DIST_OUT: another folder; its src/ is the unpacked sdist the
# wheel was built in, its dist/ the sdist and the wheel); the editable install and the machine's
# Python are untouched.
#
# DIST_BUILD_PYTHON and DIST_CUDA=1: `make cuda-check` makes its CUDA wheel through this script, so
# that CI compiles the library from the sdist once, not once for each wheel. Step 1 then builds with
# that Python (cuda-check's venv: a CUDA build of torch and the build tools) instead of a fresh venv
# with torch 2.13.0, and with ROPE_EXT_CUDA=1; steps 2 and 3 are the same, so the CUDA wheel is also
# the one smoke-tested beside torch 2.13.0's CPU build in a fresh venv.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
OUT=$(realpath -m "${DIST_OUT:-$ROOT/build/dist-check}")
TORCH=torch==2.13.0
# The library's file name and soname carry the release's major.minor (CMakeLists.txt).
LIBNAME=librope_ext.so.$(sed -n 's/^#define ROPE_EXT_VERSION "\([0-9]*\.[0-9]*\)\..*"$/\1/p' csrc/include/rope_ext/version.h)
rm -rf "$OUT" && mkdir -p "$OUT/dist"
fail() { echo "dist-check: FAILED: $*" >&2; exit 1; }
pip_in() {  # pip_in <python> <log name> <pip install arguments>...: quiet, its output in build/dist-check
  local py=$1 log=$OUT/$2.log
  shift 2
  "$py" -m pip install "$@" > "$log" 2>&1 || { tail -30 "$log"; fail "pip install $* (${log#"$ROOT"/})"; }
}
t0=$(date +%s)

# ---- 1. sdist, then a wheel from it ---------------------------------------------------------------
if [ -n "${DIST_BUILD_PYTHON:-}" ]; then
  B=$DIST_BUILD_PYTHON
  PYTHONSAFEPATH=1 "$B" -c "import build, ninja, setuptools, torch" || fail "DIST_BUILD_PYTHON=$B lacks torch or a build tool (build, ninja, setuptools)"
else
  "$PY" -m venv "$OUT/build-env"
  B=$OUT/build-env/bin/python
  pip_in "$B" pip-build-env --upgrade pip
  pip_in "$B" pip-build-env-tools "$TORCH" "setuptools>=77" build ninja
fi
CUDA=${DIST_CUDA:-0}
# (the sdist needs none of the build requires: CMake and torch are for the wheel)
"$B" -m build --sdist --no-isolation --skip-dependency-check -o "$OUT/dist" . > "$OUT/sdist.log" 2>&1 || { tail -30 "$OUT/sdist.log"; fail "sdist"; }
SDIST=$(ls "$OUT"/dist/rope_ext-*.tar.gz)
tar tzf "$SDIST" > "$OUT/sdist-files.txt"
for f in csrc/include/rope_ext/version.h csrc/rotary_math.h csrc/cuda/rotary_cuda.cu CMakeLists.txt \
         cmake/rope_extConfig.cmake.in MANIFEST.in LICENSE; do
  grep -q "^rope_ext-[^/]*/$f$" "$OUT/sdist-files.txt" || fail "the sdist has no $f"
done
mkdir -p "$OUT/src" && tar xzf "$SDIST" -C "$OUT/src" --strip-components=1
t1=$(date +%s)
# (PIP_CONSTRAINT reaches the pip that installs the isolated environment's packages. The version as
# the package index knows it: a CUDA build's torch.__version__ carries a local label, +cu130, that the
# index's file names do not.)
TORCH_PIN=$("$B" -c 'from importlib.metadata import version; print(version("torch"))')
echo "torch==$TORCH_PIN" > "$OUT/build-constraints.txt"
(cd "$OUT/src" && ROPE_EXT_CUDA=$CUDA PIP_CONSTRAINT="$OUT/build-constraints.txt" "$B" -m build --wheel -o "$OUT/dist" . \
   > "$OUT/wheel.log" 2>&1) || { tail -30 "$OUT/wheel.log"; fail "the isolated wheel build from the sdist (ROPE_EXT_CUDA=$CUDA)"; }
grep -q "Installing build dependencies\|Creating isolated environment" "$OUT/wheel.log" ||
  fail "the wheel was not built in an isolated environment (${OUT#"$ROOT"/}/wheel.log)"
WHEEL=$(ls "$OUT"/dist/rope_ext-*.whl)
t2=$(date +%s)
built_against=$("$B" -c 'import json, sys, zipfile; print(json.loads(zipfile.ZipFile(sys.argv[1]).read("rope_ext/lib/build.json"))["built_against_torch"])' "$WHEEL")
[ "${built_against%%+*}" = "${TORCH_PIN%%+*}" ] ||
  fail "the isolated build compiled against torch $built_against, not the pinned torch==$TORCH_PIN"
grep "^rope_ext: CUDA kernels: " "$OUT/wheel.log" | sed 's/^/dist-check: /' ||
  fail "the build printed no 'rope_ext: CUDA kernels:' line (${OUT#"$ROOT"/}/wheel.log)"
grep -qx "CMAKE_GENERATOR:INTERNAL=Ninja" "$OUT"/src/build/cmake-*/CMakeCache.txt ||
  fail "the wheel was not built by CMake with Ninja"
[[ $(basename "$WHEEL") == rope_ext-*-py3-none-linux_x86_64.whl ]] || fail "the wheel is not tagged py3-none: $WHEEL"
"$B" -c 'import sys, zipfile; print("\n".join(zipfile.ZipFile(sys.argv[1]).namelist()))' "$WHEEL" > "$OUT/wheel-files.txt"
grep -qx "rope_ext-[^/]*\.dist-info/licenses/LICENSE" "$OUT/wheel-files.txt" || fail "the wheel has no LICENSE"
for f in rope_ext/__init__.py rope_ext/lib/$LIBNAME rope_ext/lib/build.json rope_ext/include/rope_ext/rope.h \
         rope_ext/include/rope_ext/version.h rope_ext/lib/cmake/rope_ext/rope_extConfig.cmake; do
  grep -qx "$f" "$OUT/wheel-files.txt" || fail "the wheel has no $f"
done
! grep -q "testing" "$OUT/wheel-files.txt" || fail "the wheel carries the test hooks: $(grep testing "$OUT/wheel-files.txt")"
[ "$(grep -cE '\.so(\.[0-9]+)*$' "$OUT/wheel-files.txt")" = 1 ] ||
  fail "the wheel has not exactly one library: $(grep -E '\.so(\.[0-9]+)*$' "$OUT/wheel-files.txt")"
echo "dist-check: $(basename "$SDIST") and $(basename "$WHEEL") (wheel built from the sdist, isolated, against" \
     "$(cat "$OUT/build-constraints.txt") with ROPE_EXT_CUDA=$CUDA in $((t2 - t1)) s)"

# ---- 2. the wheel requires the stable ABI's oldest torch, with no upper pin -------------------------
requires=$("$B" - "$WHEEL" <<'PYEOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    # torch itself, not a package whose name starts with it (the test extra's torch-abi-audit)
    lines = z.read(meta).decode().splitlines()
    print("\n".join(l for l in lines if re.match(r"Requires-Dist: torch(?![\w.-])", l)))
PYEOF
)
[ "$requires" = "Requires-Dist: torch>=2.10" ] || fail "the wheel requires '$requires', not torch>=2.10"
echo "dist-check: the wheel requires torch>=2.10"

# ---- 3. a fresh venv runs the wheel ---------------------------------------------------------------
"$PY" -m venv "$OUT/run-env"
R=$OUT/run-env/bin/python
pip_in "$R" pip-run-env --upgrade pip
pip_in "$R" pip-run-env-wheel "$TORCH" "$WHEEL"
(cd "$OUT" && "$R" "$ROOT/tools/smoke_test.py") || fail "the smoke test of the installed wheel"
(cd "$OUT" && "$R" -m rope_ext.info) | sed 's/^/dist-check: rope_ext.info: /' || fail "python -m rope_ext.info"
t3=$(date +%s)
SITE_LIB=$(cd "$OUT" && "$R" -c 'import rope_ext; print(rope_ext._LIBRARY)')
PREFIXES="$(cd "$OUT" && "$R" -c 'import rope_ext, torch; print(rope_ext.cmake_prefix_path + ";" + torch.utils.cmake_prefix_path)')"
{ cmake -S "$ROOT/examples/cpp" -B "$OUT/example" -DCMAKE_PREFIX_PATH="$PREFIXES" && cmake --build "$OUT/example" &&
  "$OUT/example/rope_example"; } > "$OUT/example.log" 2>&1 || { tail -30 "$OUT/example.log"; fail "examples/cpp against the wheel"; }
cmake -DEXE="$OUT/example/rope_example" -DLIB="$SITE_LIB" -P "$ROOT/tests/cpp/check_linked_library.cmake" \
  >> "$OUT/example.log" 2>&1 || { tail -5 "$OUT/example.log"; fail "examples/cpp does not link the wheel's $SITE_LIB"; }
echo "dist-check: examples/cpp built against the installed wheel (find_package(rope_ext)) links $SITE_LIB and ran" \
     "in $(($(date +%s) - t3)) s"
t3=$(date +%s)
echo "dist-check: passed in $((t3 - t0)) s"
