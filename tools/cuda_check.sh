#!/usr/bin/env bash
# `make cuda-check`: build rope_ext's CUDA extension on a machine without a GPU, and prove it.
#  1. a venv with a CUDA build of torch (torch==2.14.1, cu130) and cuobjdump, kept in build/;
#  2. a copy of the source tree, built there with ROPE_EXT_CUDA=1: every .cu file through nvcc
#     for the default arch list (or TORCH_CUDA_ARCH_LIST), linked against libtorch_cuda;
#  3. tools/cuda_check.py: loads the library under the CUDA torch (every symbol resolves), checks
#     the CUDA kernels are registered and the fatbin holds SASS for every requested arch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath -m "${CUDA_VENV:-build/venv-cuda}")
OUT=$(realpath -m build/cuda-check)
PY="$VENV/bin/python"
# torch infers CUDA_HOME from `which nvcc`; where nvcc is a symlink in /usr/local/bin that gives
# /usr/local, whose lib64 has no libcudart. Point it at the toolkit itself.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi

t0=$(date +%s)
if ! "$PY" -c "import torch; assert torch.version.cuda" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$PY" -m pip install -q torch==2.14.1 setuptools wheel "nvidia-cuda-cuobjdump>=13,<14"
fi
t1=$(date +%s)

rm -rf "$OUT" && mkdir -p "$OUT/src"
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$OUT/src"
( cd "$OUT/src" && ROPE_EXT_CUDA=1 "$PY" -m pip install -v --no-build-isolation --no-deps \
    --target "$OUT/site" . > "$OUT/build.log" 2>&1 ) || { tail -40 "$OUT/build.log"; exit 1; }
t2=$(date +%s)
grep -o -- "-gencode[= ]arch=[^ ]*" "$OUT/build.log" | sort -u > "$OUT/gencode.txt" || true

PYTHONPATH="$OUT/site" "$PY" tools/cuda_check.py --site "$OUT/site" --build-log "$OUT/build.log"
echo "cuda-check: CUDA torch venv $((t1 - t0)) s, nvcc build + link $((t2 - t1)) s"
