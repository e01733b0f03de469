#!/usr/bin/env bash
# Prints one hash of the files the rope_ext wheel is built from (csrc/, cmake/, CMakeLists.txt,
# setup.py, and the Python package rope_ext/ without what the build puts there (lib/, include/) and bytecode), without git:
# `make gpu-build` records it beside the wheel it carries to a GPU machine, and
# `gpu_check.sh STEP=lease` recomputes it there, on a copied tree that may have no .git, to know
# whether that wheel was built from these sources. Run on another tree: source_hash.sh DIR.
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
find csrc cmake CMakeLists.txt setup.py rope_ext -type f ! -name '*.pyc' ! -path 'rope_ext/lib/*' ! -path 'rope_ext/include/*' -print0 |
  LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
