"""Second half of `make cuda-check` (see cuda_check.sh): run inside the CUDA-torch venv."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
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


COMPACT_PARAM_LIMIT = 256
# The gathered kernels' position check prints the position and the row count before it asserts
# (rotary_thread.h, ROPE_EXT_POSITION_CHECK): printf's two 64-bit arguments are a 16-byte stack
# frame, written only when the check fails. Nothing else may use the stack: a spill or a runtime-
# indexed array lives there too, and would be read back (LDL), which no kernel may do.
PRINTF_STACK = 16
FUSED = ("FFMA", "FFMA2", "DFMA")  # (HFMA2 with zero operands is how SASS moves constants)


def _word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def count_instruction(body: str, names: tuple[str, ...], whole: bool = True) -> int:
    """How many times one of `names` stands in the SASS text `body` as a word: regex's
    \b(name)\b, or \bname where not `whole` (a suffix may follow). Found by substring search: the
    regexes took 14 of the 27 CPU-seconds of an architecture's check (131 MB of SASS on sm_90)."""
    n = 0
    for name in names:
        at = body.find(name)
        while at != -1:
            end = at + len(name)
            if (at == 0 or not _word(body[at - 1])) and (not whole or end == len(body) or not _word(body[end])):
                n += 1
            at = body.find(name, end)
    return n


def _tools_env() -> dict:
    """cuobjdump -sass runs nvdisasm, from the nvidia-cuda-nvdisasm wheel."""
    import os

    import nvidia

    hits = [p for root in map(Path, nvidia.__path__) for p in sorted(root.rglob("nvdisasm"))]
    if not hits:
        raise SystemExit("cuda-check: nvdisasm not found in the nvidia wheels")
    return {**os.environ, "NVDISASM_PATH": str(hits[0].parent), "PATH": f"{hits[0].parent}:{os.environ['PATH']}"}


# The thread functions whose kernels are rope_ext's: the rotation's, QK-norm's, and the sum of the
# weights' gradient.
THREADS = ("RotaryThread", "NormThread", "WeightGradSum")


def _rotary_functions(sass: str) -> dict[str, str]:
    """The kernels' SASS by (mangled) function name."""
    bodies = re.split(r"\n\s*Function : ", sass)[1:]
    return {b.split("\n", 1)[0].strip(): b for b in bodies if any(t in b.split("\n", 1)[0] for t in THREADS)}


def norm_ffma(counts: dict) -> list[tuple[str, int]]:
    """(kind, FFMA or DFMA count) of each kind of QK-norm kernel, for the summary."""
    return [(f"{'float64' if double else 'float32'} {'backward' if back == 'true' else 'forward'}",
             next(iter(v))[1 if double else 0]) for (double, back), v in sorted(counts.items())]


def check_arch(lib: Path, arch: str, out: Path) -> str:
    """Checks sm_<arch>'s rotary kernels in the library and returns a one-line summary; the full
    table (registers, stack, local memory, parameter bytes per kernel) goes to `out`. Fails on:
    local memory; stack beyond the gathered kernels' printf frame (PRINTF_STACK); any local load
    (LDL: a spill or an indexed array read back); any fused multiply-add (FFMA, DFMA): every
    product and sum must round on its own, as on the CPU (the build passes --fmad=false); and a
    CompactIndex kernel with COMPACT_PARAM_LIMIT bytes of parameters or more."""
    tool = cuobjdump()
    dump = subprocess.run(
        [tool, "--dump-resource-usage", "-arch", f"sm_{arch}", str(lib)], capture_output=True, text=True, check=True
    ).stdout
    elf = subprocess.run([tool, "-elf", "-arch", f"sm_{arch}", str(lib)], capture_output=True, text=True, check=True)
    # Where the kernels' parameters start in constant bank 0 (the driver's block precedes them): one
    # offset for every kernel of an architecture, read from their EIATTR_PARAM_CBANK attributes.
    offsets = {
        int(v, 16) & 0xFFFF
        for v in re.findall(r"EIATTR_PARAM_CBANK\s+Format:\s+\S+\s+Value:\s+\S+ (0x[0-9a-f]+)", elf.stdout)
    }
    if len(offsets) != 1:
        raise SystemExit(f"cuda-check: sm_{arch} kernel parameters start at {sorted(map(hex, offsets))}: not one "
                         "offset")
    param_offset = offsets.pop()
    demangled = subprocess.run(["c++filt"], input=dump, capture_output=True, text=True, check=True).stdout
    rows = re.findall(
        # (a kernel's first mention of its thread type: its template argument, or for the weights' sum its
        # parameter; other constant banks, e.g. CONSTANT[2] for literals on sm_80, may stand before bank 0)
        r"((?:RotaryThread|NormThread|WeightGradSum)<[^>]*>)[^\n]*?:\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)"
        r"[^\n]*?CONSTANT\[0\]:(\d+)",
        demangled,
    )
    if not rows:
        raise SystemExit(f"cuda-check: no rope_ext kernel in cuobjdump's resource usage for sm_{arch}")
    kernels = [
        (args.replace(" ", "").replace("rope_ext::cuda::", ""), int(r), int(st), int(lo), int(c0) - param_offset)
        for args, r, st, lo, c0 in rows
    ]
    header = ("kernel: RotaryThread<scalar, table, interleaved, vec, gathered, memory, index>, "
              "NormThread<scalar, table, interleaved, vec, gathered, backward, memory>, WeightGradSum<type, memory>")
    lines = [f"{header}\n{'':90} REG STACK LOCAL PARAM_BYTES"]
    lines += [f"{k:90} {r:>3} {st:>5} {lo:>5} {p:>11}" for k, r, st, lo, p in kernels]
    out.write_text("\n".join(lines) + "\n")

    def gathered(name: str) -> bool:  # (RotaryThread's and NormThread's fifth template argument, kGathered)
        args = name.split(",")
        return len(args) > 4 and args[4] == "true"

    stacked = [k[0] for k in kernels if k[3] or k[2] > (PRINTF_STACK if gathered(k[0]) else 0)]
    if stacked:
        raise SystemExit(
            f"cuda-check: sm_{arch}: {len(stacked)} kernels use local memory or more stack than the gathered "
            f"kernels' {PRINTF_STACK}-byte printf frame (spills or runtime-indexed arrays), e.g. {stacked[0]}; "
            f"see {out}"
        )
    rotation = [k for k in kernels if k[0].startswith("RotaryThread")]
    compact = [k for k in rotation if k[0].endswith("CompactIndex>")]
    general = [k for k in rotation if not k[0].endswith("CompactIndex>")]
    if not compact:
        raise SystemExit(f"cuda-check: sm_{arch}: no CompactIndex kernel found")
    heavy = [k[0] for k in compact if k[4] >= COMPACT_PARAM_LIMIT]
    if heavy:
        raise SystemExit(
            f"cuda-check: sm_{arch}: {len(heavy)} CompactIndex kernels take {COMPACT_PARAM_LIMIT} bytes of "
            f"parameters or more, e.g. {heavy[0]}"
        )
    sass = subprocess.run([tool, "-sass", "-arch", f"sm_{arch}", str(lib)], capture_output=True, text=True,
                          check=True, env=_tools_env()).stdout
    functions = _rotary_functions(sass)
    if len(functions) != len(kernels):
        raise SystemExit(f"cuda-check: sm_{arch}: {len(functions)} rope_ext kernels in the SASS, {len(kernels)} in "
                         "the resource usage")
    # The QK-norm kernels divide and take a square root (rstd, the mean): CUDA's correctly rounded
    # division and sqrt refine their estimate with fused multiply-adds, as they must. Those are the
    # only ones allowed: every QK-norm kernel of one direction and precision holds as many (31 in a
    # float forward on sm_90, 17 in a backward), whatever its vector width, where products and sums
    # of the elements contracted into FMAs would grow with it.
    names = dict(zip(functions, subprocess.run(["c++filt"], input="\n".join(functions), capture_output=True, text=True,
                                               check=True).stdout.splitlines(), strict=True))
    norm_counts: dict[tuple, set] = {}
    for name, body in functions.items():
        m = re.search(r"NormThread<([^,]*),[^,]*,[^,]*,[^,]*,[^,]*, (true|false),", names[name])
        if m:
            key = (m.group(1) == "double", m.group(2))
            norm_counts.setdefault(key, set()).add((count_instruction(body, ("FFMA",), whole=False),
                                                    count_instruction(body, ("DFMA",), whole=False)))
    uneven = {k: v for k, v in norm_counts.items() if len(v) != 1}
    if uneven:
        raise SystemExit(f"cuda-check: sm_{arch}: QK-norm kernels of one kind hold different numbers of fused "
                         f"multiply-adds (FFMA, DFMA) {uneven}: some beyond the division's and sqrt's")
    for what, instructions in (("a fused multiply-add", FUSED), ("a local-memory load (LDL)", ("LDL",))):
        bad = [name for name, body in functions.items() if not (instructions is FUSED and "NormThread<" in names[name])
               and count_instruction(body, instructions)]
        if bad:
            line = next(ln for ln in functions[bad[0]].splitlines() if count_instruction(ln, instructions))
            raise SystemExit(f"cuda-check: sm_{arch}: {len(bad)} rope_ext kernels contain {what}, e.g. {bad[0]}: "
                             f"{line.strip()}")
    norm = [k for k in kernels if k[0].startswith("NormThread")]
    sums = [k for k in kernels if k[0].startswith("WeightGradSum")]
    return (
        f"sm_{arch}: {len(rotation)} rotation kernels, registers {min(k[1] for k in rotation)}-"
        f"{max(k[1] for k in rotation)}; {len(norm)} QK-norm kernels, registers {min(k[1] for k in norm)}-"
        f"{max(k[1] for k in norm)}; {len(sums)} weight-gradient sums; "
        f"stack {max(k[2] for k in kernels)} B at most (gathered kernels' printf frame), no local memory, no LDL, "
        f"no FFMA/DFMA but the QK-norm kernels' division and sqrt "
        f"({', '.join(f'{n} in every {kind}' for kind, n in norm_ffma(norm_counts))}); "
        f"parameters: CompactIndex {max(k[4] for k in compact)} B at most, PlanIndex "
        f"{max((k[4] for k in general), default=0)} B at most"
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--site", required=True)
    p.add_argument("--compile-commands", required=True, help="the CMake build's compile_commands.json")
    p.add_argument("--resource-dir", type=Path, required=True,
                   help="where each architecture's resource usage table goes (resource-usage-sm_XX.txt)")
    args = p.parse_args()

    import rope_ext

    lib = Path(torch.ops.rope_ext._library_path())
    assert Path(args.site).resolve() in lib.resolve().parents, f"loaded the wrong librope_ext.so: {lib}"
    print(
        f"cuda-check: torch {torch.__version__} (CUDA {torch.version.cuda}), GPU present: "
        f"{torch.cuda.is_available()}; loaded {lib.name}: every symbol resolved against libtorch_cuda"
    )

    ops = ("rotary", "rotary_qk", "rotary_", "rotary_pos", "rotary_pos_qk", "rotary_pos_", "qk_norm_rotary",
           "qk_norm_rotary_pos", "qk_norm_rotary_", "qk_norm_rotary_pos_", "qk_norm_rotary_backward", "norm_rotary")
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

    # Two architectures at a time: each is cuobjdump and nvdisasm runs and their text parsed, about one
    # core's work, and the C++ example built beside this (cuda_check.sh) leaves the second core idle
    # once it is done. (fork: the workers need nothing torch started but the loaded library's path.)
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        outs = [args.resource_dir / f"resource-usage-sm_{arch}.txt" for arch in present]
        for summary in pool.map(check_arch, [lib] * len(present), present, outs):
            print(f"cuda-check: {summary}", flush=True)

    # The CPU path of the CUDA build still computes the right thing.
    x, c = torch.randn(2, 5, 3, 16), torch.randn(5, 1, 16)
    ref = rope_ext.reference.rotary_reference(x.double(), c.double(), c.double())
    torch.testing.assert_close(rope_ext.rotary(x, c, c).double(), ref, atol=1e-5, rtol=1e-5)
    print("cuda-check: OK")


if __name__ == "__main__":
    sys.exit(main())
