#!/usr/bin/env bash
# readme_block.sh <name>: prints the lines of README.md's bash block that follows the line
# `<!-- commands: <name> -->`, so that CI runs the README's own commands, not a copy of them.
# Fails when the README has no such block, or an empty one.
set -euo pipefail
README="$(dirname "$0")/../README.md"
lines=$(awk -v tag="<!-- commands: $1 -->" '
  $0 == tag { found = 1; next }
  found == 1 && /^```bash$/ { found = 2; next }
  found == 2 && /^```$/ { exit }
  found == 2 { print }' "$README")
[ -n "$lines" ] || { echo "readme_block.sh: README.md has no bash block after '<!-- commands: $1 -->'" >&2; exit 1; }
printf '%s\n' "$lines"
