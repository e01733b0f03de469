#!/usr/bin/env bash
# make abi-audit: proof that librope_ext.so is on torch's stable ABI (issue 37), three ways.
#
#   1. nm -uD, demangled: the library's undefined symbols from libtorch's unstable C++ surface
#      (at::, c10::, torch::, caffe2::) and from OpenMP; listed.
#   2. readelf -d: its NEEDED libraries, each checked against the allow-list below.
#   3. torch-abi-audit (Quansight's checker, which reads nm -uD too): its verdict and minimum torch,
#      run on a copy named *.so, because it skips files with other names (librope_ext.so.0.1), where
#      it would pass without having looked.
#
# Each must pass: no unstable symbol (1), only allowed libraries (2), and torch-abi-audit's --check
# torch (3). (The other half of the proof: every stable
# translation unit compiles under TORCH_TARGET_VERSION, where ATen's and c10's headers refuse to,
# and CI's wheel-check runs the tests under the oldest and the newest torch.)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LIB=${LIB:-$($PYTHON -c "import rope_ext; print(rope_ext._LIBRARY)")}
# What a stable-ABI library may need: the C and C++ runtimes, and libtorch's libraries only for the
# shim's C functions (aoti_torch_*, torch_*), which are defined in libtorch_cpu.so. A CUDA build links
# the CUDA runtime statically (glibc's libdl, librt and libpthread for it) and no CUDA library of
# torch's: it loads beside any torch, CPU-only or CUDA of either major.
ALLOWED_NEEDED="libc.so.6 libm.so.6 libstdc++.so.6 libgcc_s.so.1 ld-linux-x86-64.so.2 libtorch_cpu.so"
ALLOWED_NEEDED="$ALLOWED_NEEDED libdl.so.2 librt.so.1 libpthread.so.0"

echo "abi-audit: $LIB"
unstable=$(nm -uD -C "$LIB" | grep -E 'at::|c10::|torch::|caffe2::|GOMP_|omp_|__kmpc_' || true)
count=$(printf '%s' "$unstable" | grep -c . || true)
echo "abi-audit: $count undefined symbols from libtorch's unstable C++ surface or OpenMP"
status=0
if [ "$count" != 0 ]; then
  printf '%s\n' "$unstable" | sed 's/^ *U /  /' | cut -c1-160
  echo "abi-audit: FAIL: the library must use torch's stable ABI only" >&2
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
$PYTHON -m torch_abi_audit.cli --check torch "$copy/rope_ext_lib" || status=1
exit $status
