"""One small call for every CUDA kernel rope_ext instantiates, checked bit for bit: what `make
gpu-check` runs under compute-sanitizer (memcheck in the lease, initcheck in STEP=rest), where each
kernel must launch at least once.

The kernels are RotaryThread<scalar, table, interleaved, vec, gathered, memory, index>: 7 pairs of x
and table dtypes (16-bit x with its own or float32 tables, float32, float64 with its own or float32
tables) x both pairings x vector or scalar x full tables or gathered caches x CompactIndex or
PlanIndex = 112, each run on q and a GQA k in one launch. Which one a call takes is the launcher's
run-time choice (rotary_thread.h's plan_call); the same choice, made on the host by the testing
library for the same strides and alignments, tells which ones these cases reach, and a case set that
misses one fails. Each is checked against the CPU kernel.

The QK-norm kernels are NormThread<scalar, table, interleaved, vec, gathered, backward, memory>: the
same 7 dtype pairs x both pairings x vector or scalar x full tables or gathered caches x forward or
backward = 112 more, each run on a GQA pair of q and k (forward) or on q with its weight's gradient
(backward), and checked against their host emulation (tests/test_qk_norm_emulation.py): the same
float operations in the same order, so the same bits.

    python tests/gpu_kernel_cases.py [--device cuda]    # --device cpu: only the coverage, here
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import LAUNCH_FIELDS, TESTING, _twins, random_tables  # noqa: E402

import rope_ext  # noqa: E402

DTYPE_PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
               (torch.float16, torch.float32), (torch.float32, torch.float32), (torch.float64, torch.float64),
               (torch.float64, torch.float32)]


def _offset(t: torch.Tensor, by: int) -> torch.Tensor:
    """t's values in a buffer that starts `by` elements earlier: misaligned for vector accesses."""
    buf = torch.zeros(t.numel() + by, dtype=t.dtype)
    buf[by:] = t.flatten()
    return buf[by:].view(t.shape)


def _apart(t: torch.Tensor) -> torch.Tensor:
    """t with a wider row stride (rows of 2 * width): cos and sin then differ in layout."""
    return torch.cat((t, torch.zeros_like(t)), -1)[..., : t.shape[-1]]


def cases(gen):
    """(name, intended kernel, op, tensors, interleaved) for every combination: q (2, 3, 4, 64) and a
    GQA k (2, 3, 2, 64) in one launch (rotary_qk with shared full tables, rotary_pos_qk), so that each
    kernel runs its second operand's code too; r = 64, or 32 with interleaved pairs (the pass-through
    columns copied)."""
    for (dtype, table_dtype), interleaved, vector, gathered, compact in itertools.product(
            DTYPE_PAIRS, (False, True), (True, False), (False, True), (True, False)):
        q = torch.randn(2, 3, 4, 64, generator=gen, dtype=torch.float64).to(dtype)
        k = torch.randn(2, 3, 2, 64, generator=gen, dtype=torch.float64).to(dtype)
        if not vector:
            q, k = _offset(q, 1), _offset(k, 1)  # not 16-byte aligned: the scalar path
        r = 32 if interleaved else 64
        name = f"{str(dtype)[6:]}/{str(table_dtype)[6:]} {'interleaved' if interleaved else 'halfsplit'} " \
               f"{'vector' if vector else 'scalar'} {'gathered' if gathered else 'full'} " \
               f"{'CompactIndex' if compact else 'PlanIndex'} r={r}"
        intended = (dtype, table_dtype, interleaved, vector, gathered, compact)
        if gathered:
            cc, sc = random_tables((16, r // 2), table_dtype, gen)
            if not compact:
                sc = _apart(sc)  # cos and sin rows of different strides: no CompactIndex
            pos = torch.randint(0, 16, (2, 3, 1), generator=gen)
            yield name, intended, "rotary_pos_qk", (q, k, cc, sc, pos), interleaved
        else:
            cos, sin = random_tables((3, 1, r), table_dtype, gen)
            if not compact:
                sin = sin.transpose(0, 1).contiguous().transpose(0, 1)  # (same values, another layout)
                sin = _apart(sin)
            yield name, intended, "rotary_qk", (q, k, cos, sin), interleaved


def kernel_of(op, tensors, interleaved) -> tuple:
    """(dtype, table dtype, interleaved, vector, gathered, compact): the template the launcher picks for
    its one launch (the launch configuration has a second launch's fields if it would make two)."""
    if op == "rotary_pos_qk":
        q, k, cc, sc, pos = tensors
        config = TESTING.cuda_pos_launch_config(q, k, cc, sc, pos, interleaved)
    else:
        q, k, cc, sc = tensors
        config = TESTING.cuda_qk_launch_config(q, k, cc, sc, interleaved)
    cfg = dict(zip(LAUNCH_FIELDS, config, strict=True))
    return q.dtype, cc.dtype, interleaved, cfg["vec"] > 1, op == "rotary_pos_qk", bool(cfg["compact"])


NORM_LAUNCH = ("grid_x", "block_x", "block_y", "groups", "vec", "pairs_per_item", "rot_items", "pass_items",
               "group_items", "partial_rows", "table_vec", "weight_vec")


def norm_cases(gen):
    """(name, intended kernel, op, arguments) for every QK-norm kernel: q (2, 3, 4, 32) and k (2, 3, 2, 32),
    r = 32 (16 with interleaved pairs: pass-through columns), across heads for the gathered caches,
    per head for full tables; scalar where the rows start one element past a vector boundary. Each
    kernel four times: the RMS norm and LayerNorm with biases (centered, a flag of the same kernel), each
    with the weight before the rotation and after it (weight_after, another flag)."""
    for (dtype, table_dtype), interleaved, vector, gathered, backward, after, centered in itertools.product(
            DTYPE_PAIRS, (False, True), (True, False), (False, True), (False, True), (False, True), (False, True)):
        q = torch.randn(2, 3, 4, 32, generator=gen, dtype=torch.float64).to(dtype)
        k = torch.randn(2, 3, 2, 32, generator=gen, dtype=torch.float64).to(dtype)
        if not vector:
            q, k = _offset(q, 1), _offset(k, 1)
        r = 16 if interleaved else 32
        across = gathered
        wq = torch.rand(32 * (4 if across else 1), generator=gen).to(dtype)
        wk = torch.rand(32 * (2 if across else 1), generator=gen)  # float32: the other weight form
        bq = (torch.rand(wq.shape, generator=gen) - 0.5).to(dtype) if centered else None
        bk = torch.rand(wk.shape, generator=gen) - 0.5 if centered else None
        if gathered:
            cc, sc = random_tables((16, r // 2), table_dtype, gen)
            tables = (cc, sc, torch.randint(0, 16, (2, 3, 1), generator=gen))
        else:
            tables = (*random_tables((3, 1, r), table_dtype, gen), None)
        name = f"qk_norm {'backward' if backward else 'forward'} {str(dtype)[6:]}/{str(table_dtype)[6:]} " \
               f"{'interleaved' if interleaved else 'halfsplit'} {'vector' if vector else 'scalar'} " \
               f"{'gathered across heads' if gathered else 'full per head'}{', weight after' if after else ''}" \
               f"{', layer norm' if centered else ''}"
        yield name, (dtype, table_dtype, interleaved, vector, gathered, backward), (q, k, wq, wk, *tables, bq, bk), \
            (1e-6, 0.5, across, interleaved, after, centered), backward


def run_norm(testing, args, scalars, backward):
    """The forward's four outputs, or the backward's (dx, dweight, dbias) of q, through `testing`'s op
    set (torch.ops.rope_ext_testing's cuda_emulate_*, or the product's ops without that prefix)."""
    q, k, wq, wk, cos, sin, positions, bq, bk = args
    eps, offset, across, interleaved, after, centered = scalars
    flags = (eps, offset, across, interleaved, after, bq, bk, centered)
    if positions is None:
        out = testing("qk_norm_rotary")(q, k, wq, wk, cos, sin, *flags)
    else:
        out = testing("qk_norm_rotary_pos")(q, k, wq, wk, cos, sin, positions, *flags)
    if not backward:
        return out
    dy = (q.detach().cpu().double() * 0.5 - 0.25).to(q.dtype).to(q.device)  # (any values)
    return testing("qk_norm_rotary_backward")(dy, q, wq, out[2], cos, sin, positions, offset, across, interleaved,
                                              True, after, centered, bq is not None)


def norm_kernel_of(args, scalars, backward) -> tuple:
    q, _, wq, _, cos, sin, positions, _, _ = args
    cfg = dict(zip(NORM_LAUNCH, TESTING.cuda_norm_launch_config(q, wq, cos, sin, positions, scalars[2], scalars[3],
                                                                backward), strict=True))
    return q.dtype, cos.dtype, scalars[3], cfg["vec"] > 1, positions is not None, backward


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    reached, failed = set(), []
    for name, intended, op, tensors, interleaved in cases(gen):
        kernel = kernel_of(op, tensors, interleaved)
        reached.add(kernel)
        if kernel != intended:
            failed.append(f"{name}: takes {kernel}")
        if args.device != "cpu":
            twins = _twins(tensors, args.device)[0]
            got = getattr(rope_ext, op)(*twins, interleaved=interleaved)
            ref = getattr(rope_ext, op)(*tensors, interleaved=interleaved)
            for which, g, want in zip("qk", _twins(got, "cpu")[0], ref, strict=True):
                if not torch.equal(g, want):
                    failed.append(f"{name}: {which} differs from the CPU kernel")
    emulated = lambda op: getattr(TESTING, "cuda_emulate_" + op)  # noqa: E731
    real = lambda op: getattr(torch.ops.rope_ext, op)  # noqa: E731
    for name, intended, args_, scalars, backward in norm_cases(gen):
        kernel = norm_kernel_of(args_, scalars, backward)
        reached.add(("qk_norm", *kernel))
        if kernel != intended:
            failed.append(f"{name}: takes {kernel}")
        if args.device != "cpu":
            got = run_norm(real, _twins(args_, args.device)[0], scalars, backward)
            want = run_norm(emulated, args_, scalars, backward)
            names = ("dx", "dweight", "dbias") if backward else ("q_out", "k_out", "q_rstd", "k_rstd")
            for which, g, w in zip(names, _twins(got, "cpu")[0], want, strict=True):
                if not (torch.equal(g, w) or torch.equal(g.isnan(), w.isnan()) and torch.equal(g.nan_to_num(),
                                                                                             w.nan_to_num())):
                    failed.append(f"{name}: {which} differs from the kernel's host emulation")
    if args.device != "cpu":
        # A backward of more groups than its 512 blocks take at once: each thread's group loop runs
        # several times (the shared shares reused after the second barrier, the partial sums read
        # back and added to), under the sanitizers too.
        x = torch.randn(32775, 4, 8, generator=gen)
        w = torch.rand(8, generator=gen)
        cos, sin = random_tables((32775, 1, 8), torch.float32, gen)
        scalars = (1e-6, 0.0, False, False, False, False)
        many = (x, x, w, w, cos, sin, None, None, None)
        cfg = dict(zip(NORM_LAUNCH, TESTING.cuda_norm_launch_config(x, w, cos, sin, None, False, False, True),
                       strict=True))
        if not cfg["groups"] > cfg["grid_x"] * cfg["block_y"]:
            failed.append(f"the many-groups case fits one iteration: {cfg}")
        got = run_norm(real, _twins(many, args.device)[0], scalars, True)
        want = run_norm(emulated, many, scalars, True)
        for which, g, w in zip(("dx", "dweight", "dbias"), _twins(got, "cpu")[0], want, strict=True):
            if not torch.equal(g, w):
                failed.append(f"qk_norm backward over many groups: {which} differs from the kernel's host emulation")
        # norm_rotary (one tensor): the same kernel as q's half of qk_norm_rotary, through its own op
        x = torch.randn(2, 3, 4, 32, generator=gen).bfloat16()
        w = torch.rand(32, generator=gen)
        cos, sin = random_tables((3, 1, 32), torch.float32, gen)
        b = torch.rand(32, generator=gen) - 0.5
        for form, bias, centered in (("rms", None, False), ("layer", b, True)):
            got = torch.ops.rope_ext.norm_rotary(*_twins((x, w, cos, sin), args.device)[0], 1e-6, 0.5, False, False,
                                                 True, None if bias is None else bias.to(args.device), centered)
            want = TESTING.cuda_emulate_norm_rotary(x, w, cos, sin, 1e-6, 0.5, False, False, True, bias, centered)
            for which, g, w_ in zip(("out", "stats"), _twins(got, "cpu")[0], want, strict=True):
                if not torch.equal(g, w_):
                    failed.append(f"norm_rotary ({form}): {which} differs from the kernel's host emulation")
    expected = 2 * 7 * 2 * 2 * 2 * 2
    print(f"gpu_kernel_cases: {len(reached)} of {expected} kernels reached on {args.device}"
          f"{'' if args.device == 'cpu' else ', each bit-identical to the CPU kernel or its emulation'}")
    for line in failed:
        print("  FAILED", line)
    return 0 if not failed and len(reached) == expected else 1


if __name__ == "__main__":
    sys.exit(main())
