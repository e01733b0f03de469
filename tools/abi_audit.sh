#!/usr/bin/env bash
# make abi-audit: how far librope_ext.so is from torch's stable ABI (issue 37), three ways, and a
# ratchet that fails when it gets further.
#
#   1. nm -uD, demangled: the library's undefined symbols from libtorch's unstable C++ surface
#      (at::, c10::, torch::, caffe2::) and from OpenMP; listed.
#   2. readelf -d: its NEEDED libraries, each checked against the allow-list below.
#   3. torch-abi-audit (Quansight's checker, which reads nm -uD too): its verdict and minimum torch,
#      run on a copy named *.so, because it skips files with other names (librope_ext.so.0.1), where
#      it would pass without having looked.
#
# The ratchet: tools/abi_budget.txt holds the most unstable symbols (count 1) the library may have.
# A change that adds one fails here; a change that removes some lowers the budget with it. When
# the port is done the budget is 0 and torch-abi-audit's --check torch must pass (ABI_STRICT=1).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LIB=$($PYTHON -c "import rope_ext; print(rope_ext._LIBRARY)")
BUDGET=$(tr -dc 0-9 < tools/abi_budget.txt)
# What a stable-ABI library may need: the C and C++ runtimes, and libtorch's libraries only for the
# shim's C functions (aoti_torch_*, torch_*), which are defined in libtorch_cpu.so.
ALLOWED_NEEDED="libc.so.6 libm.so.6 libstdc++.so.6 libgcc_s.so.1 ld-linux-x86-64.so.2 libtorch_cpu.so"
# While the port is under way: libtorch.so and libc10.so (the glue's C++ calls) and libgomp.so.1
# (at::parallel_for's inline OpenMP; torch::stable::parallel_for runs on torch's pool instead).
ALLOWED_NEEDED="$ALLOWED_NEEDED libtorch.so libc10.so libgomp.so.1"

echo "abi-audit: $LIB"
unstable=$(nm -uD -C "$LIB" | grep -E 'at::|c10::|torch::|caffe2::|GOMP_|omp_|__kmpc_' || true)
count=$(printf '%s' "$unstable" | grep -c . || true)
echo "abi-audit: $count undefined symbols from libtorch's unstable C++ surface or OpenMP (budget $BUDGET):"
printf '%s\n' "$unstable" | sed 's/^ *U /  /' | cut -c1-160
status=0
if [ "$count" -gt "$BUDGET" ]; then
  echo "abi-audit: FAIL: $count unstable symbols, more than the budget of $BUDGET (tools/abi_budget.txt)" >&2
  status=1
elif [ "$count" -lt "$BUDGET" ]; then
  echo "abi-audit: $count is under the budget of $BUDGET: lower tools/abi_budget.txt to $count" >&2
  status=1
fi

needed=$(readelf -d "$LIB" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
echo "abi-audit: NEEDED: $(echo $needed)"
for lib in $needed; do
  case " $ALLOWED_NEEDED " in
    *" $lib "*) ;;
    *) echo "abi-audit: FAIL: NEEDED $lib is not on the allow-list ($ALLOWED_NEEDED)" >&2; status=1 ;;
  esac
done

copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
mkdir "$copy/rope_ext_lib" && cp "$LIB" "$copy/rope_ext_lib/librope_ext.so"
$PYTHON -m torch_abi_audit.cli -v "$copy/rope_ext_lib" | sed -n 's/^/abi-audit: torch-abi-audit: /; 1,12p' 
if [ "${ABI_STRICT:-0}" = 1 ]; then
  $PYTHON -m torch_abi_audit.cli --check torch "$copy/rope_ext_lib" || status=1
fi
exit $status
