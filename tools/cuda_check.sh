#!/usr/bin/env bash
# `make cuda-check`: build rope_ext's CUDA library on a machine without a GPU, and prove it.
#  1. a venv with a CUDA build of torch (torch==2.14.1, cu130), the build tools, cuobjdump, and the tests'
#     packages (step 5), kept in build/ (CUDA_VENV_ONLY=1 stops after it: CI makes it in the background);
#  2. the wheel, made by tools/dist_check.sh in build/cuda-check with this venv's Python and
#     ROPE_EXT_CUDA=1: the sdist of this checkout, a wheel built from the unpacked sdist (src/)
#     through setup.py's CMake build (the one build: every .cu file through nvcc for the default
#     arch list, or TORCH_CUDA_ARCH_LIST; the CUDA runtime linked statically and no CUDA library of
#     torch's), dist-check's checks of both, and the wheel smoke-tested in a fresh venv beside
#     torch 2.13.0's CPU build. That wheel, build/cuda-check/dist/*.whl, is the one wheel for every
#     torch from 2.10, CPU or CUDA (make wheel-check runs it under four; CI builds no other).
#     Installed into the venv as a user's is, beside torch in site-packages, with the test hooks'
#     library of `make setup` beside its library (they are stable-ABI code too; the wheel leaves
#     them out);
#  3. tools/cuda_check.py: loads the library under the CUDA torch (every symbol resolves), checks
#     the CUDA kernels are registered and the fatbin holds SASS for every requested arch, and for
#     every arch prints the kernels' registers, stack, local memory and parameter bytes (cuobjdump),
#     failing on local memory, on stack beyond the position check's printf frame, on any local load
#     or fused multiply-add in the SASS (nvdisasm), and on CompactIndex kernels with 256 bytes of
#     parameters or more;
#  4. examples/cpp built against that installed package through find_package(rope_ext), as a C++
#     user of a CUDA build links it, and run (beside step 3: each keeps about one core busy);
#  5. the timm integration's tests against the build of step 2, which run here only: timm needs
#     torchvision, whose builds here load beside torch 2.14.1 alone (about 25 s in all: the two
#     installs 7 s, the tests 10 to 20 s), and those tests again under timm's previous release
#     (about 15 s). The core tests run on this very wheel in wheel-check, under torch 2.10, 2.11
#     and 2.15, and dist-check's smoke test beside 2.13.0's CPU build (the core tests ran here
#     under 2.14.1 too until that cost 225 s of a CI run over its budget).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath -m "${CUDA_VENV:-build/venv-cuda}")
OUT=$(realpath -m build/cuda-check)
PY="$VENV/bin/python"
# No CUDA_HOME is set here: the build finds the toolkit as a user's does (setup.py's
# find_cuda_toolkit: CUDA_HOME if the caller set one, else the toolkit the nvcc on PATH says it
# belongs to, which on the developers' machines is reached only through a wrapper script in
# /usr/local/bin, else /usr/local/cuda), and the build's record (lib/build.json) says which.

t0=$(date +%s)
# (PYTHONSAFEPATH: the checkout's build/ folder must not pass for the package build)
if ! PYTHONSAFEPATH=1 "$PY" -c "import pathlib, torch, build, ninja, nvidia; assert torch.version.cuda
assert any(True for r in nvidia.__path__ for _ in pathlib.Path(r).rglob('nvdisasm'))" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$PY" -m pip install -q torch==2.14.1 "setuptools>=77" wheel build ninja "nvidia-cuda-cuobjdump>=13,<14" "nvidia-cuda-nvdisasm>=13,<14"
fi
# Step 5's test dependencies: timm without its optional packages (huggingface_hub, safetensors,
# pyyaml: for downloads and data loading, which the tests do not do); torchvision pinned to the
# build for this torch.
if ! "$PY" -c "import pytest, hypothesis, expecttest, numpy, torchvision, timm" 2>/dev/null; then
  "$PY" -m pip install -q "pytest>=7" "hypothesis==6.155.2" expecttest numpy torchvision==0.29.1
  "$PY" -m pip install -q --no-deps timm==1.0.31
fi
t1=$(date +%s)
# CUDA_VENV_ONLY=1: step 1 alone (CI makes the venv in the background while earlier steps run).
[ "${CUDA_VENV_ONLY:-0}" = 1 ] && { echo "cuda-check: venv $VENV ready ($((t1 - t0)) s)"; exit 0; }

HOOKS=$(python3 -c "import rope_ext, pathlib; print(pathlib.Path(rope_ext._LIBRARY).with_name('librope_ext_testing.so'))")
[ -f "$HOOKS" ] || { echo "cuda-check: no test hooks library at $HOOKS: run make setup"; exit 1; }
DIST_OUT="$OUT" DIST_BUILD_PYTHON="$PY" DIST_CUDA=1 bash tools/dist_check.sh
"$PY" -m pip install --no-deps --force-reinstall "$OUT"/dist/rope_ext-*.whl > "$OUT/install.log" 2>&1 ||
  { tail -40 "$OUT/install.log"; exit 1; }
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp "$HOOKS" "$SITE/rope_ext/lib/"
# What a user asks of the install: the CUDA kernels built, for which architectures, and registered.
PYTHONSAFEPATH=1 "$PY" -m rope_ext.info > "$OUT/info.txt"
sed 's/^/cuda-check: rope_ext.info: /' "$OUT/info.txt"
grep -q "^CUDA kernels: built by nvcc " "$OUT/info.txt" && grep -q "registered with torch's dispatcher: yes" "$OUT/info.txt" ||
  { echo "cuda-check: FAILED: python -m rope_ext.info does not say the CUDA kernels are built and registered"; exit 1; }
t2=$(date +%s)
COMMANDS=$(ls "$OUT"/src/build/cmake-*/compile_commands.json)

# 4. A C++ program linking this CUDA build through find_package(rope_ext), from the installed
#    package, built in the background while step 3 reads the SASS (each keeps about one core busy).
#    torch's CMake package wants libnvrtc, which a compiler-only CUDA install lacks: the torch wheel's
#    nvidia package has it.
TOOLKIT=$(PYTHONSAFEPATH=1 "$PY" -c 'import rope_ext.info as i; print(i.build_record()["cuda"]["toolkit"])')
NVRTC=$("$PY" -c 'import nvidia, pathlib; print(next(p for r in nvidia.__path__ for p in sorted(pathlib.Path(r).rglob("libnvrtc.so*"))))')
PREFIXES="$(PYTHONSAFEPATH=1 "$PY" -c 'import rope_ext; print(rope_ext.cmake_prefix_path)');$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
{ cmake -S examples/cpp -B "$OUT/example-cuda" -G Ninja -DCMAKE_MAKE_PROGRAM="$("$PY" -c 'import ninja, os; print(os.path.join(ninja.BIN_DIR, "ninja"))')" \
    -DCMAKE_CUDA_COMPILER="$TOOLKIT/bin/nvcc" -DCUDA_TOOLKIT_ROOT_DIR="$TOOLKIT" -DCUDA_nvrtc_LIBRARY="$NVRTC" \
    -DCMAKE_PREFIX_PATH="$PREFIXES" && cmake --build "$OUT/example-cuda" && "$OUT/example-cuda/rope_example"; } > "$OUT/example-cuda.log" 2>&1 &
EXAMPLE=$!

# 3. (step numbers as in the header)
"$PY" tools/cuda_check.py --site "$SITE" --compile-commands "$COMMANDS" --resource-dir "$OUT" || { kill "$EXAMPLE"; exit 1; }

wait "$EXAMPLE" || { tail -40 "$OUT/example-cuda.log"; exit 1; }
LIB=$(PYTHONSAFEPATH=1 "$PY" -c 'import rope_ext; print(rope_ext._LIBRARY)')
cmake -DEXE="$OUT/example-cuda/rope_example" -DLIB="$LIB" -P tests/cpp/check_linked_library.cmake >> "$OUT/example-cuda.log" 2>&1 ||
  { tail -5 "$OUT/example-cuda.log"; echo "cuda-check: the example does not link the installed package's $LIB"; exit 1; }
echo "cuda-check: examples/cpp built against the installed CUDA package (find_package(rope_ext)) and ran: $(tail -1 "$OUT/example-cuda.log")"
# The CUDA library on torch's stable ABI too (the audit's tools are this machine's Python's)
LIB="$LIB" bash tools/abi_audit.sh > "$OUT/abi-audit.log" 2>&1 || { cat "$OUT/abi-audit.log"; echo "cuda-check: the CUDA library fails the stable-ABI audit"; exit 1; }
echo "cuda-check: the CUDA library passes the stable-ABI audit: $(grep 'NEEDED:' "$OUT/abi-audit.log" | sed 's/^abi-audit: //')"
t3=$(date +%s)

# PYTHONSAFEPATH: the checkout (the current directory) stays off sys.path, so `import rope_ext` finds
# the venv's build, not the checkout's own (built against another torch).
"$PY" -c "import timm.models.eva"  # the timm tests skip where timm does not import: not here
PYTHONSAFEPATH=1 "$PY" -c "
import pathlib, rope_ext, torch
assert pathlib.Path('$SITE') in pathlib.Path(rope_ext.__file__).resolve().parents, rope_ext.__file__
print(f'cuda-check: the timm tests under torch {torch.__version__}, rope_ext from {rope_ext.__file__}')"
PYTHONSAFEPATH=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_timm_integration.py
# The timm tests again under timm's previous release, 1.0.30 (its functions return the promoted
# dtype, 1.0.31's cast back), installed --no-deps into a folder first on the path.
"$PY" -m pip install -q --no-deps --target "$OUT/timm-1.0.30" timm==1.0.30
PYTHONPATH="$OUT/timm-1.0.30" PYTHONSAFEPATH=1 "$PY" -c "import timm; assert timm.__version__ == '1.0.30', timm.__file__"
PYTHONPATH="$OUT/timm-1.0.30" PYTHONSAFEPATH=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_timm_integration.py
# 6. The kernels' memory traffic as the host emulator measures it (benchmarks/cuda_traffic.py): the
# least sector efficiency of the rotation's main cases and of the QK-norm kernels' must reach 0.90.
PYTHONSAFEPATH=1 "$PY" benchmarks/cuda_traffic.py | grep "min sector efficiency" > "$OUT/traffic.txt"
sed 's/^/cuda-check: host-emulated traffic, /' "$OUT/traffic.txt"
[ "$(wc -l < "$OUT/traffic.txt")" = 2 ] && awk '$NF < 0.90 { exit 1 }' "$OUT/traffic.txt" ||
  { echo "cuda-check: FAILED: a host-emulated sector efficiency under 0.90 (or missing)"; exit 1; }
t4=$(date +%s)
echo "cuda-check: CUDA torch venv $((t1 - t0)) s, sdist, CUDA wheel and dist-check $((t2 - t1)) s, C++ example $((t3 - t2)) s," \
     "timm tests under torch 2.14.1 $((t4 - t3)) s"
