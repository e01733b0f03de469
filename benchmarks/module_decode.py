"""The module's decode cost against the op it calls, for this checkout's ``RotaryEmbedding`` and
the one at another git revision, measured side by side in one run.

    python benchmarks/module_decode.py [--before REV] [--rounds N]

Llama-3-8B heads (32 q, 8 kv, head dim 128), bfloat16, HF's layout, one token per row at position
1000 + b, B in {1, 32}, 1 thread. For each way of giving the positions (position_ids (B, 1), an int
offset, per-row offsets (B,)), each module version is timed against:
- ``pos_op``: the ``rotary_pos_qk`` call the module makes, its positions shaped beforehand;
- ``raw_op``: ``rotary_qk`` with full-width tables computed beforehand.
The variants of one configuration are interleaved round by round (benchmarks/positions_suite.py's
``timed``), and every output is checked against ``raw_op``'s first. The host syncs of one call
(aten::item, _local_scalar_dense, is_nonzero, in the profiler) and the rope_ext ops it runs are
counted for each version.

--before REV (default HEAD): the revision whose rope_ext/module.py is loaded beside this
checkout's (the rest of the package is this checkout's).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import rope_ext
from rope_ext.module import RotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parent))
from positions_suite import BASE, HKV, HQ, D, timed  # noqa: E402

SYNC_OPS = {"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero"}


def module_at(rev: str):
    """RotaryEmbedding as rope_ext/module.py defines it at git revision rev."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{rev}:rope_ext/module.py"], cwd=root, capture_output=True,
                            text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "module_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("rope_ext._module_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RotaryEmbedding


def profile(fn) -> tuple[int, list[str]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events()]
    return sum(n in SYNC_OPS for n in names), [n for n in names if n.startswith("rope_ext::")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="HEAD")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    args = parser.parse_args()
    Before = module_at(args.before)
    print(f"rope_ext {rope_ext.__version__}, torch {torch.__version__}, CPU kernel {rope_ext.cpu_kernel_isa()}; "
          f"'before' = rope_ext/module.py at {args.before}, 'after' = this checkout's")
    modules = {name: cls(D, BASE, max_position_embeddings=8192, layout="bhsd")
               for name, cls in (("before", Before), ("after", RotaryEmbedding))}
    g = torch.Generator().manual_seed(0)
    for batch in (1, 32):
        q = torch.randn(batch, HQ, 1, D, generator=g).bfloat16()
        k = torch.randn(batch, HKV, 1, D, generator=g).bfloat16()
        pos = 1000 + torch.arange(batch)[:, None]  # (B, 1)
        rows = pos if batch == 1 else pos[:, None]  # what the module passes rotary_pos_qk: (1, 1) or (B, 1, 1)
        cos, sin = modules["after"].cos_sin(pos)  # (B, 1, 128) float32
        cos, sin = cos[:, None], sin[:, None]
        cc, sc = modules["after"].cos_cache, modules["after"].sin_cache
        ways = {
            "position_ids": dict(position_ids=pos),
            "int offset": dict(offset=1000) if batch == 1 else None,  # (the same position for every row)
            "row offsets": dict(offset=pos[:, 0] - 0),
        }
        for way, kwargs in ways.items():
            if kwargs is None:
                continue
            fns = {
                "pos_op": lambda q=q, k=k, cc=cc, sc=sc, rows=rows: rope_ext.rotary_pos_qk(q, k, cc, sc, rows),
                "raw_op": lambda q=q, k=k, cos=cos, sin=sin: rope_ext.rotary_qk(q, k, cos, sin),
                **{name: (lambda q=q, k=k, m=m, kw=kwargs: m(q, k, **kw)) for name, m in modules.items()},
            }
            with torch.no_grad():
                want = fns["raw_op"]()
                for name, fn in fns.items():
                    for got, ref in zip(fn(), want, strict=True):
                        assert torch.equal(got, ref), (way, name)
                counts = {name: profile(fns[name]) for name in modules}
                t = timed(fns, 1, args.rounds, args.min_run_time)
            us = {name: v * 1e6 for name, v in t.items()}
            print(f"decode B={batch:<2} {way:12}  " + "  ".join(f"{n} {v:.1f} us" for n, v in us.items()))
            for name in modules:
                syncs, ops = counts[name]
                print(f"  {name:6}: / pos_op {t[name] / t['pos_op']:.2f}x, / raw_op {t[name] / t['raw_op']:.2f}x, "
                      f"host syncs {syncs}, rope_ext ops {ops}")


if __name__ == "__main__":
    main()
