#!/usr/bin/env bash
# Prints one hash of the files librope_ext.so is built from (csrc/, cmake/, CMakeLists.txt,
# setup.py), without git: `make gpu-build` records it beside the library it carries to a GPU machine,
# and `gpu_check.sh STEP=lease` recomputes it there, on a copied tree that may have no .git, to
# know whether that library was built from these sources.
set -euo pipefail
cd "$(dirname "$0")/.."
find csrc cmake CMakeLists.txt setup.py -type f ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum |
  sha256sum | cut -c1-16
