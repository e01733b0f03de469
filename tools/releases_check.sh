#!/usr/bin/env bash
# `make releases-check`: the integrations under the library releases users run, beside the ones the
# suite (`make test`) installs, transformers 5.23.0 and diffusers 0.42.1:
#   transformers 4.57.6  the last 4.x, still pinned by many training stacks (it imports only beside
#                        tokenizers 0.22 and huggingface_hub < 1.0, installed with it);
#   transformers 5.24.0  the newest;
#   diffusers 0.41.0     the one before.
# (timm's previous release, 1.0.30, is tests/test_timm_integration.py's second run in cuda-check,
# whose venv has the torchvision timm needs.)
# Each is installed with --no-deps (nothing may pull another torch) into build/releases/<name>, a
# folder put first on the path of the suite's own Python (seconds, not a venv per release), and runs
# the tests that hold that library's code: the forms tests (every fingerprint against the library's
# own function, the classification, the listing) and for transformers the QK-norm fusion's tests
# (its norm forms, whole tiny models fused against stock, a cold patch() in a fresh process). The releases run two at a time (each test run keeps about one core busy), each with one
# OpenMP thread (two runs of two would spin on each other's cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=$(realpath -m build/releases)
mkdir -p "$OUT"

# name | the packages | the test files
# (the longest first)
RELEASES=(
  "transformers-5.24.0|transformers==5.24.0|tests/test_transformers_forms.py tests/test_qk_norm_fusion.py"
  "transformers-4.57.6|transformers==4.57.6 tokenizers==0.22.2 huggingface_hub==0.36.2|tests/test_transformers_forms.py tests/test_qk_norm_fusion.py"
  "diffusers-0.41.0|diffusers==0.41.0|tests/test_diffusers_forms.py"
)

check() {  # check <name> <packages> <tests>: install, then run; writes $OUT/<name>/{pip,tests}.log and
  # returns nonzero where either fails
  local name=$1 packages=$2 tests=$3 here=$OUT/$1 t0=$SECONDS rc=0
  rm -rf "$here" && mkdir -p "$here" || return 1
  # shellcheck disable=SC2086  (the packages are words)
  "$PYTHON" -m pip install -q --no-deps --target "$here/site" $packages > "$here/pip.log" 2>&1 ||
    { tail -20 "$here/pip.log"; echo "releases-check: FAILED: installing $packages"; return 1; }
  # shellcheck disable=SC2086
  PYTHONPATH="$here/site" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PYTHON" -m pytest -q -p no:cacheprovider $tests \
    > "$here/tests.log" 2>&1 || rc=$?
  echo "releases-check: $name: $(tail -1 "$here/tests.log" | sed 's/^=* *//; s/ *=*$//') ($((SECONDS - t0)) s)"
  [ "$rc" = 0 ] || { tail -40 "$here/tests.log"; echo "releases-check: FAILED: $name"; }
  return "$rc"
}

t0=$SECONDS
status=0
running=0
for entry in "${RELEASES[@]}"; do
  IFS='|' read -r name packages tests <<< "$entry"
  [ "$running" -lt 2 ] || { wait -n || status=1; running=$((running - 1)); }
  check "$name" "$packages" "$tests" > "$OUT/$name.out" 2>&1 &
  running=$((running + 1))
done
while [ "$running" -gt 0 ]; do wait -n || status=1; running=$((running - 1)); done
for entry in "${RELEASES[@]}"; do cat "$OUT/${entry%%|*}.out"; done
echo "releases-check: ${#RELEASES[@]} releases in $((SECONDS - t0)) s"
exit "$status"
