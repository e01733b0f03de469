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


# Where sm_90 kernels' parameters start in constant bank 0 (the driver's block precedes them); checked
# against every kernel's EIATTR_PARAM_CBANK attribute in the ELF.
PARAM_OFFSET = 0x210
COMPACT_PARAM_LIMIT = 256


def resource_usage(lib: Path, arch: str, out: Path) -> None:
    """Prints, for sm_<arch>, each kernel's registers, stack (where spills and dynamically indexed
    arrays live), local memory and parameter bytes, from cuobjdump --dump-resource-usage; the full
    table goes to `out`. Fails on any stack or local memory, and on a CompactIndex kernel (the
    gathered kernel for nearly every layout) with COMPACT_PARAM_LIMIT bytes of parameters or more."""
    tool = cuobjdump()
    dump = subprocess.run(
        [tool, "--dump-resource-usage", "-arch", f"sm_{arch}", str(lib)], capture_output=True, text=True, check=True
    ).stdout
    elf = subprocess.run([tool, "-elf", "-arch", f"sm_{arch}", str(lib)], capture_output=True, text=True, check=True)
    offsets = {
        int(v, 16) & 0xFFFF
        for v in re.findall(r"EIATTR_PARAM_CBANK\s+Format:\s+\S+\s+Value:\s+\S+ (0x[0-9a-f]+)", elf.stdout)
    }
    if offsets != {PARAM_OFFSET}:
        raise SystemExit(
            f"cuda-check: sm_{arch} kernel parameters start at {sorted(map(hex, offsets))}, not {PARAM_OFFSET:#x}"
        )
    demangled = subprocess.run(["c++filt"], input=dump, capture_output=True, text=True, check=True).stdout
    rows = re.findall(
        r"RotaryThread<([^>]*)> >\(.*?\):\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+) CONSTANT\[0\]:(\d+)",
        demangled,
    )
    if not rows:
        raise SystemExit(f"cuda-check: no rotary kernel in cuobjdump's resource usage for sm_{arch}")
    kernels = [
        (args.replace(" ", "").replace("rope_ext::cuda::", ""), int(r), int(st), int(lo), int(c0) - PARAM_OFFSET)
        for args, r, st, lo, c0 in rows
    ]
    lines = [f"{'kernel (scalar, table, conj, interleaved, vec, gathered, index)':72} REG STACK LOCAL PARAM_BYTES"]
    lines += [f"{k:72} {r:>3} {st:>5} {lo:>5} {p:>11}" for k, r, st, lo, p in kernels]
    out.write_text("\n".join(lines) + "\n")
    compact = [k for k in kernels if k[0].endswith("CompactIndex")]
    general = [k for k in kernels if not k[0].endswith("CompactIndex")]
    print(
        f"cuda-check: sm_{arch} resource usage of {len(kernels)} kernels (table: {out}): registers "
        f"{min(k[1] for k in kernels)}-{max(k[1] for k in kernels)}; parameters: {len(compact)} CompactIndex kernels "
        f"{max((k[4] for k in compact), default=0)} bytes at most, {len(general)} PlanIndex kernels "
        f"{max((k[4] for k in general), default=0)} bytes at most"
    )
    stacked = [k[0] for k in kernels if k[2] or k[3]]
    if stacked:
        raise SystemExit(
            f"cuda-check: {len(stacked)} kernels use stack or local memory (spills or "
            f"runtime-indexed arrays), e.g. {stacked[0]}; see {out}"
        )
    if not compact:
        raise SystemExit("cuda-check: no CompactIndex kernel found")
    heavy = [k[0] for k in compact if k[4] >= COMPACT_PARAM_LIMIT]
    if heavy:
        raise SystemExit(
            f"cuda-check: {len(heavy)} CompactIndex kernels take {COMPACT_PARAM_LIMIT} bytes of "
            f"parameters or more, e.g. {heavy[0]}"
        )
    print(
        "cuda-check: no kernel uses stack or local memory; every CompactIndex kernel's parameters are under "
        f"{COMPACT_PARAM_LIMIT} bytes"
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
    missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(f"rope_ext::{op}", "CUDA")]
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
