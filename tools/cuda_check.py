"""Second half of `make cuda-check` (see cuda_check.sh): run inside the CUDA-torch venv."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import torch


def cuobjdump() -> str:
    import nvidia  # the nvidia-cuda-cuobjdump wheel

    for root in map(Path, nvidia.__path__):
        hits = sorted(root.rglob("cuobjdump"))
        if hits:
            return str(hits[0])
    raise SystemExit("cuda-check: cuobjdump not found in the nvidia wheels")


def resource_usage(lib: Path, arch: str, out: Path) -> None:
    """Prints, for sm_<arch>, each kernel's registers, stack (where spills and dynamically indexed
    arrays live), local memory and parameter constant bank, from cuobjdump --dump-resource-usage;
    the full table goes to `out`."""
    dump = subprocess.run(
        [cuobjdump(), "--dump-resource-usage", "-arch", f"sm_{arch}", str(lib)], capture_output=True, text=True,
        check=True,
    ).stdout
    demangled = subprocess.run(["c++filt"], input=dump, capture_output=True, text=True, check=True).stdout
    rows = re.findall(
        r"RotaryThread<([^>]*)> >\(.*?\):\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+) CONSTANT\[0\]:(\d+)",
        demangled,
    )
    if not rows:
        raise SystemExit(f"cuda-check: no rotary kernel in cuobjdump's resource usage for sm_{arch}")
    lines = [f"{'kernel (scalar, table, conj, interleaved, vec, gathered)':60} REG STACK LOCAL PARAM_BANK"]
    lines += [f"{args.replace(' ', ''):60} {r:>3} {st:>5} {lo:>5} {c0:>10}" for args, r, st, lo, c0 in rows]
    out.write_text("\n".join(lines) + "\n")
    regs = [int(r[1]) for r in rows]
    stacked = [r for r in rows if int(r[2]) or int(r[3])]
    print(
        f"cuda-check: sm_{arch} resource usage of {len(rows)} kernels (table: {out}): registers "
        f"{min(regs)}-{max(regs)}, parameter bank {max(int(r[4]) for r in rows)} bytes, "
        f"{len(stacked)} with stack or local memory (up to {max((int(r[2]) for r in rows), default=0)} bytes of stack)"
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--site", required=True)
    p.add_argument("--compile-commands", required=True, help="the CMake build's compile_commands.json")
    p.add_argument("--resource-table", type=Path, required=True, help="where the sm_90 resource usage table goes")
    args = p.parse_args()

    import rope_ext

    lib = Path(torch.ops.rope_ext._library_path())
    assert Path(args.site).resolve() in lib.resolve().parents, f"loaded the wrong librope_ext.so: {lib}"
    print(
        f"cuda-check: torch {torch.__version__} (CUDA {torch.version.cuda}), GPU present: "
        f"{torch.cuda.is_available()}; loaded {lib.name}: every symbol resolved against libtorch_cuda"
    )

    ops = ("rotary", "rotary_qk", "rotary_", "rotary_pos", "rotary_pos_qk", "rotary_pos_")
    missing = [
        op
        for op in ops
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"rope_ext::{op}", "CUDA")
    ]
    if missing:
        raise SystemExit(f"cuda-check: no CUDA kernel registered for {missing}")
    print(f"cuda-check: CUDA kernels registered for rope_ext::{', '.join(ops)}")

    cu = [c["command"] for c in json.loads(Path(args.compile_commands).read_text()) if c["file"].endswith(".cu")]
    if not cu:
        raise SystemExit(f"cuda-check: no .cu file in {args.compile_commands}")
    log = "\n".join(cu)
    requested = sorted(set(re.findall(r"arch=compute_(\d+),code=sm_\d+", log)), key=int)
    ptx = sorted(set(re.findall(r"arch=compute_(\d+),code=compute_\d+", log)), key=int)
    listing = subprocess.run([cuobjdump(), "--list-elf", str(lib)], capture_output=True, text=True, check=True).stdout
    present = sorted(set(re.findall(r"\.sm_(\d+)\.", listing)), key=int)
    print(
        f"cuda-check: nvcc targets sm_{', sm_'.join(requested)} (+PTX compute_{', compute_'.join(ptx)}); "
        f"SASS in the library: sm_{', sm_'.join(present)}"
    )
    if not requested or set(requested) - set(present):
        raise SystemExit(f"cuda-check: SASS missing for sm_{sorted(set(requested) - set(present))}")

    resource_usage(lib, "90", args.resource_table)

    # The CPU path of the CUDA build still computes the right thing.
    x, c = torch.randn(2, 5, 3, 16), torch.randn(5, 1, 16)
    ref = rope_ext.reference.rotary_reference(x.double(), c.double(), c.double())
    torch.testing.assert_close(rope_ext.rotary(x, c, c).double(), ref, atol=1e-5, rtol=1e-5)
    print("cuda-check: OK")


if __name__ == "__main__":
    sys.exit(main())
