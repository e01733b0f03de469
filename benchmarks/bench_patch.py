"""What `rope_ext.integrations.transformers.patch()` costs a training script at start-up, in fresh
processes, all variants in one run.

    python benchmarks/bench_patch.py             # 5 rounds (about 2 minutes)
    python benchmarks/bench_patch.py --rounds 3

Each variant is a new interpreter (torch, transformers and rope_ext imported cold, as a script
starts), timed from inside it with time.perf_counter() after `import torch` (whose own import is
the same in all of them and left out):
  import    `import transformers` and rope_ext's integration, nothing else: the floor;
  lazy      the same, then `patch()`: what patch() costs now (families are switched as their modeling
            modules are imported);
  eager     the same, then what patch() did before it switched families at import: every family
            classified from its source (survey()), its modeling modules imported, then patch();
  strict    the same, then `patch(strict=True)`, which checks every family that way first;
  model     `import transformers`, then a tiny Qwen3 model built (its modeling module imported);
  model+patch  `patch()` first, then the same model: the per-family cost the import hook adds.
Variants run interleaved, one of each per round; the table gives medians, and the costs beyond the
`import` (or `model`) floor measured in this run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys

_PRELUDE = """
import time, torch
t0 = time.perf_counter()
import transformers
from rope_ext.integrations import transformers as rope_hf
"""
_MODEL = """
config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)
model = transformers.AutoModelForCausalLM.from_config(config)
"""
_EAGER = """
import importlib
for report in rope_hf.survey().values():
    for module in sorted({fn.module for fn in report.functions} | {s.module for s in report.qk_norms}):
        importlib.import_module(module)
patched = rope_hf.patch()
"""
VARIANTS = {
    "import": "",
    "lazy": "patched = rope_hf.patch()\n",
    "eager": _EAGER,
    "strict": "patched = rope_hf.patch(strict=True)\n",
    "model": _MODEL,
    "model+patch": "patched = rope_hf.patch()\n" + _MODEL + "assert patched == ['qwen3'], patched\n",
}


def run(variant: str) -> float:
    code = _PRELUDE + VARIANTS[variant] + "print(time.perf_counter() - t0)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode:
        raise SystemExit(f"{variant} failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import torch
    import transformers

    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; Python {platform.python_version()}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}; {args.rounds} rounds, fresh "
          "processes, seconds after `import torch`")
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    run("import")  # warm the file cache once
    for _ in range(args.rounds):
        for variant in VARIANTS:
            times[variant].append(run(variant))
    median = {v: statistics.median(t) for v, t in times.items()}
    print(f"\n{'variant':<12} {'median s':>9} {'min s':>7} {'max s':>7}  beyond its floor")
    for variant, t in times.items():
        floor = "model" if variant == "model+patch" else "import"
        beyond = "" if variant in ("import", "model") else f"{median[variant] - median[floor]:+.2f} s"
        print(f"{variant:<12} {median[variant]:>9.2f} {min(t):>7.2f} {max(t):>7.2f}  {beyond}")
    print(f"\npatch() beyond `import transformers`: {median['lazy'] - median['import']:+.2f} s now; "
          f"{median['eager'] - median['import']:+.2f} s as before (every family classified and imported); "
          f"a model's family switched at its import: {median['model+patch'] - median['model']:+.2f} s "
          f"(the rounds' spread: {max(max(t) - min(t) for t in times.values()):.2f} s)")


if __name__ == "__main__":
    main()
