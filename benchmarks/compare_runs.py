"""Compares two runs of bench_rope.py (their bench_rope.csv files): did anything regress?

    python benchmarks/compare_runs.py BEFORE.csv AFTER.csv [--worst 10]

For every (kind, dtype, mode, provider) it prints the geometric mean, minimum and maximum over the
cases of the time ratio after / before (below 1.0: faster after). rope_ext's providers are the ones
under test; the `copy_` floor and HF eager run the same code in both runs, so their spread is how far
two runs of unchanged code drift apart on this machine, the noise any rope_ext row must exceed to
count. Then the rope_ext rows that slowed down most, with the floor's ratio in the same case.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections import defaultdict
from pathlib import Path

UNDER_TEST = ("rope_ext", "rope_ext_qk", "rope_ext_inplace")
REFERENCES = ("floor", "hf_eager")


def load(path: Path) -> dict[tuple, float]:
    """(kind, batch, seq, layout, dtype, threads, mode, provider) -> median ms."""
    with path.open(newline="") as f:
        return {
            (r["kind"], r["batch"], r["seq"], r["layout"], r["dtype"], r["threads"], r["mode"], r["provider"]):
            float(r["median_ms"])
            for r in csv.DictReader(f)
        }  # fmt: skip


def gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--worst", type=int, default=10, help="how many of the rope_ext rows that slowed most to list")
    args = ap.parse_args()
    before, after = load(args.before), load(args.after)
    common = sorted(k for k in before.keys() & after.keys() if k[-1] in UNDER_TEST + REFERENCES)
    if not any(k[-1] in UNDER_TEST for k in common):
        raise SystemExit("compare_runs: the two files share no rope_ext rows")
    ratio = {k: after[k] / before[k] for k in common}
    groups = defaultdict(list)
    for k, r in ratio.items():
        groups[(k[0], k[4], k[6], k[-1])].append(r)
    print(f"time after / before (below 1.0: faster after), {len(common)} rows in both runs")
    print(f"{'kind':8} {'dtype':9} {'mode':8} {'provider':17} {'cases':>5} {'gmean':>6} {'min':>6} {'max':>6}")
    for (kind, dtype, mode, provider), rs in sorted(groups.items()):
        tag = "" if provider in UNDER_TEST else "   (unchanged code: the noise)"
        print(f"{kind:8} {dtype:9} {mode:8} {provider:17} {len(rs):5d} {gmean(rs):6.2f} {min(rs):6.2f} "
              f"{max(rs):6.2f}{tag}")  # fmt: skip
    print(f"\nthe {args.worst} rope_ext rows that slowed most, and the floor in the same case:")
    slowest = sorted((r, k) for k, r in ratio.items() if k[-1] in UNDER_TEST)[::-1][: args.worst]
    for r, k in slowest:
        kind, batch, seq, layout, dtype, threads, mode, provider = k
        floor = ratio.get((*k[:-1], "floor"))
        floor_text = f"{floor:.2f}x" if floor else "n/a"
        print(f"  {kind} B={batch} S={seq} {layout} {dtype} t={threads} {mode} {provider}: {before[k]:.3f} -> "
              f"{after[k]:.3f} ms ({r:.2f}x); floor {floor_text}")  # fmt: skip


if __name__ == "__main__":
    main()
