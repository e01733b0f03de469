"""The CUDA kernels' memory traffic, measured without a GPU.

The host emulator (csrc/testing/host_emulation.cpp) runs every thread of the launch the CUDA
launcher would choose and, while recording, groups each warp's loads and stores (32 consecutive
threads of a block, tid = tx + ty * block_x) by instruction instance, as a GPU coalesces them. For
every case this prints

  ld eff / st eff  sector efficiency: the bytes each warp instruction needs (distinct bytes, so a
                   table value several lanes read counts once) over the bytes of the 32-byte sectors
                   it touches, summed over the loads, and over the stores;
  moved / min      the sector bytes of all those instructions (loads and stores: what L1 asks of L2
                   if nothing is reused) over the minimum: q and k read and written once, the tables
                   once per token (full tables: r values of cos and sin; gathered: r/2 of each and a
                   position);
  distinct / min   the distinct sectors touched over the same minimum (what DRAM must move at best).

and the op's launch: one for q's heads and then k's, for rotary_qk (q and k share the tables) as for
rotary_pos_qk (vec: elements per vector; tvec: vector table loads; compact: CompactIndex rather than
PlanIndex; block: items x heads). Its last line is `min sector efficiency: X`, the least of ld eff
and st eff over the main cases: the layouts bshd, HF's bhsd view, packed thd and a qkv slice, both
pairings, bfloat16 and float32 (with tables in that dtype and, for bfloat16, float32 tables too),
prefill, full tables (rotary_qk) and the gathered cache (rotary_pos_qk), at Llama's 32/8 heads and
D = 128. Other cases (partial rotary, tables shared over the batch, a contiguous bhsd, decode at
B = 1 to 64) follow.

Then the QK-norm kernels (qk_norm_rotary's, csrc/cuda/qk_norm_thread.h), forward and backward (with
the weight's gradient), at Qwen3-8B's heads (32 and 8, D = 128, a norm per head) and Wan 14B's (40
heads, D = 128, one norm across them), at 256 tokens of prefill (the traffic per token does not
change with the token count). Their minimum is q and k read and written once (the
backward: x and dy read, dx written), the tables once per token, the weights and statistics once. The
kernels read each item twice, before and after their group's reduction, the second time from L1 or
L2 (the block read it just before), and read the weight and the tables once per row: so moved / min
is about 2 in the forward, and distinct / min about 1. The backward reads x, dy and the tables twice
and adds into its partial sums of the weight's gradient (piece-major, qk_norm_thread.h's
PartialLayout) at each group: at most 512 blocks' worth (8 MiB for Qwen3's per-head norm), which at
256 tokens is twice q's bytes (distinct / min about 2.3) and at 4,096 tokens an eighth of them.
Its last line is `qk_norm min sector efficiency: X`, over those cases.

Run after `make setup` (it needs rope_ext_testing): python benchmarks/cuda_traffic.py [--sites]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import torch

import rope_ext

HQ, HK, D = 32, 8, 128  # Llama-3-8B's attention: 32 query heads, 8 key/value heads, head dim 128
TRAFFIC_FIELDS = ("ld_needed", "ld_sectors", "st_needed", "st_sectors", "ld_distinct", "st_distinct",
                  "ld_instructions", "st_instructions", "ld_lanes", "st_lanes")
LAUNCH_FIELDS = ("grid_x", "grid_y", "block_x", "block_y", "vec", "pairs_per_item", "rot_items", "pass_items",
                 "table_vec", "compact")


def load_testing():
    lib = pathlib.Path(rope_ext.__file__).resolve().parent / "lib" / "librope_ext_testing.so"
    if not lib.exists():
        sys.exit(f"cuda_traffic: {lib} is missing: build rope_ext with its test hooks (ROPE_EXT_TESTING=1, "
                 "as `make setup` does)")
    torch.ops.load_library(str(lib))
    return torch.ops.rope_ext_testing


TESTING = load_testing()


@dataclasses.dataclass
class Case:
    name: str
    layout: str  # bshd, bhsd_view, thd, qkv_slice, bhsd
    tables: str  # full, gathered, full_shared (one (S, r) table for the whole batch)
    dtype: torch.dtype
    table_dtype: torch.dtype
    interleaved: bool
    B: int
    S: int
    r: int = D
    main: bool = False


def make_qk(layout: str, B: int, S: int, dtype):
    """q (HQ heads) and k (HK heads) as the layout lays them out, and how a (B, S, 1, c) table or a
    (B, S, 1) positions tensor maps onto it."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if layout == "bshd":
        return rnd(B, S, HQ, D), rnd(B, S, HK, D), lambda t: t
    if layout == "bhsd_view":  # HF: q_proj(x).view(B, S, H, D).transpose(1, 2)
        return rnd(B, S, HQ, D).transpose(1, 2), rnd(B, S, HK, D).transpose(1, 2), lambda t: t.transpose(1, 2)
    if layout == "bhsd":
        return (rnd(B, HQ, S, D), rnd(B, HK, S, D), lambda t: t.transpose(1, 2))
    if layout == "thd":
        return rnd(B * S, HQ, D), rnd(B * S, HK, D), lambda t: t.reshape(B * S, *t.shape[2:])
    if layout == "qkv_slice":  # a fused qkv projection's output, (B, S, HQ + 2 HK, D), sliced
        qkv = rnd(B, S, HQ + 2 * HK, D)
        return qkv[:, :, :HQ], qkv[:, :, HQ:HQ + HK], lambda t: t
    raise ValueError(layout)


def run_case(c: Case, sites: bool = False) -> dict:
    q, k, to_layout = make_qk(c.layout, c.B, c.S, c.dtype)
    g = torch.Generator().manual_seed(1)
    tokens = c.B * c.S
    esize = q.element_size()
    tsize = torch.empty((), dtype=c.table_dtype).element_size()
    if c.tables == "gathered":
        rows = 4096
        cache = torch.randn(2, rows, c.r // 2, generator=g).to(c.table_dtype)
        cos, sin = cache[0], cache[1]
        pos = torch.randint(0, rows, (c.B, c.S), generator=g)  # one position per token, a head dim of 1
        by_layout = {"thd": pos.reshape(tokens, 1), "bhsd_view": pos[:, None], "bhsd": pos[:, None]}
        pos = by_layout.get(c.layout, pos[..., None])
        args = (q, k, cos, sin, pos, c.interleaved)
        run = lambda: TESTING.cuda_emulate_rotary_pos_qk(*args, False)  # noqa: E731
        expected = lambda: rope_ext.rotary_pos_qk(q, k, cos, sin, pos, interleaved=c.interleaved)  # noqa: E731
        table_min = tokens * (2 * (c.r // 2) * tsize + pos.element_size())
    else:
        shape = (1, c.S, 1, c.r) if c.tables == "full_shared" else (c.B, c.S, 1, c.r)
        tab = torch.randn(2, *shape, generator=g).to(c.table_dtype)
        cos, sin = to_layout(tab[0]), to_layout(tab[1])
        if c.layout == "thd":
            cos, sin = tab[0].reshape(tokens, 1, c.r), tab[1].reshape(tokens, 1, c.r)
        run = lambda: TESTING.cuda_emulate_rotary_qk(q, k, cos, sin, c.interleaved, None, None, False)  # noqa: E731
        expected = lambda: rope_ext.rotary_qk(q, k, cos, sin, interleaved=c.interleaved)  # noqa: E731
        table_min = tokens * 2 * c.r * tsize
    TESTING.cuda_record_traffic(True)
    TESTING.cuda_record_launches(True)
    try:
        got = run()
        t = dict(zip(TRAFFIC_FIELDS, TESTING.cuda_traffic(), strict=True))
        by_site = TESTING.cuda_traffic_by_site()
        launches = TESTING.cuda_launches()
    finally:
        TESTING.cuda_record_traffic(False)
        TESTING.cuda_record_launches(False)
    assert len(launches) == len(LAUNCH_FIELDS), f"{c.name}: {len(launches) // len(LAUNCH_FIELDS)} launches, not one"
    same = all(torch.equal(a, b) for a, b in zip(got, expected(), strict=True))
    assert same, f"{c.name}: the emulated kernel differs from the CPU op"
    qk_bytes = (q.numel() + k.numel()) * esize
    minimum = 2 * qk_bytes + table_min
    assert t["ld_needed"] >= qk_bytes and t["st_needed"] == qk_bytes, f"{c.name}: not every element moved once"
    row = {
        "ld_eff": t["ld_needed"] / t["ld_sectors"],
        "st_eff": t["st_needed"] / t["st_sectors"],
        "moved": (t["ld_sectors"] + t["st_sectors"]) / minimum,
        "distinct": (t["ld_distinct"] + t["st_distinct"]) / minimum,
        "launch": dict(zip(LAUNCH_FIELDS, launches, strict=True)),
    }
    if sites:
        names, totals = by_site
        row["sites"] = {n: totals[3 * i:3 * i + 3] for i, n in enumerate(names)}
    return row


def cases() -> list[Case]:
    out = []
    mixed = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)]
    short = {torch.bfloat16: "bf16", torch.float32: "f32"}
    for layout in ("bshd", "bhsd_view", "thd", "qkv_slice"):
        for tables in ("full", "gathered"):
            for interleaved in (False, True):
                for dtype, tdt in mixed:
                    name = (f"{layout} {'rotary_qk' if tables == 'full' else 'rotary_pos_qk'} "
                            f"{'inter' if interleaved else 'half'} {short[dtype]}/{short[tdt]} prefill B=2 S=1024")
                    out.append(Case(name, layout, tables, dtype, tdt, interleaved, 2, 1024, main=True))
    bf = torch.bfloat16
    for tables in ("full", "gathered"):
        op = "rotary_qk" if tables == "full" else "rotary_pos_qk"
        for r in (64, 32):
            for interleaved in (False, True):
                out.append(Case(f"bshd {op} {'inter' if interleaved else 'half'} bf16 partial r={r} B=2 S=64",
                                "bshd", tables, bf, bf, interleaved, 2, 64, r=r))
        out.append(Case(f"bhsd {op} half bf16 contiguous B=2 S=64", "bhsd", tables, bf, bf, False, 2, 64))
    out.append(Case("bshd rotary_qk half bf16 (S, r) tables shared over B=4 S=32", "bshd", "full_shared", bf, bf,
                    False, 4, 32))
    out.append(Case("bhsd_view rotary_qk half bf16 (S, r) tables shared over B=4 S=32", "bhsd_view", "full_shared",
                    bf, bf, False, 4, 32))
    for B in (1, 8, 64):
        for tables in ("full", "gathered"):
            op = "rotary_qk" if tables == "full" else "rotary_pos_qk"
            for dtype, tdt in mixed[:2]:
                out.append(Case(f"bhsd_view {op} half {short[dtype]}/{short[tdt]} decode B={B}", "bhsd_view", tables,
                                dtype, tdt, False, B, 1))
    return out


@dataclasses.dataclass
class NormCase:
    name: str
    heads: tuple  # (q heads, k heads)
    across: bool
    dtype: torch.dtype
    table_dtype: torch.dtype
    gathered: bool
    tokens: int = 256


def norm_cases() -> list[NormCase]:
    out = []
    bf, f32 = torch.bfloat16, torch.float32
    for gathered in (True, False):
        form = "qk_norm_rotary_pos" if gathered else "qk_norm_rotary"
        for dtype, tdt in ((bf, f32), (bf, bf), (f32, f32)):
            out.append(NormCase(f"qwen3 {form} {str(dtype)[6:]}/{str(tdt)[6:]} per head", (32, 8), False, dtype, tdt,
                                gathered))
        out.append(NormCase(f"wan {form} bfloat16/float32 across 40 heads", (40, 40), True, bf, f32, gathered))
    return out


def run_norm_case(c: NormCase) -> list[tuple[str, dict]]:
    """The forward's and the backward's traffic (q's backward, with the weight's gradient)."""
    g = torch.Generator().manual_seed(2)
    hq, hk = c.heads
    q = torch.randn(1, c.tokens, hq, D, generator=g).to(c.dtype)
    k = torch.randn(1, c.tokens, hk, D, generator=g).to(c.dtype)
    wq = torch.rand(D * (hq if c.across else 1), generator=g).to(c.dtype)
    wk = torch.rand(D * (hk if c.across else 1), generator=g).to(c.dtype)
    tsize = torch.empty((), dtype=c.table_dtype).element_size()
    if c.gathered:
        cache = torch.randn(2, 4096, D // 2, generator=g).to(c.table_dtype)
        positions = torch.randint(0, 4096, (1, c.tokens, 1), generator=g)
        tables = (cache[0], cache[1], positions)
        table_min = c.tokens * (D * tsize + 8)
    else:
        tab = torch.randn(2, 1, c.tokens, 1, D, generator=g).to(c.table_dtype)
        tables = (tab[0], tab[1], None)
        table_min = c.tokens * 2 * D * tsize
    scalars = (1e-6, 0.0, c.across, False)
    rows = []
    for direction in ("forward", "backward"):
        TESTING.cuda_record_traffic(True)
        try:
            if direction == "forward":
                cos, sin, pos = tables
                out = (TESTING.cuda_emulate_qk_norm_rotary_pos(q, k, wq, wk, cos, sin, pos, *scalars) if c.gathered
                       else TESTING.cuda_emulate_qk_norm_rotary(q, k, wq, wk, cos, sin, *scalars))
                x_bytes = (q.numel() + k.numel()) * q.element_size()
                stat_bytes = (out[2].numel() + out[3].numel()) * out[2].element_size()
                minimum = 2 * x_bytes + 2 * table_min + stat_bytes + (wq.numel() + wk.numel()) * wq.element_size()
                rstd = out[2]
            else:
                dy = torch.randn(q.shape, generator=g).to(c.dtype)
                TESTING.cuda_emulate_qk_norm_rotary_backward(dy, q, wq, rstd, *tables, 0.0, c.across, False, True)
                x_bytes = q.numel() * q.element_size()
                minimum = 3 * x_bytes + table_min + rstd.numel() * rstd.element_size() + wq.numel() * 6
            t = dict(zip(TRAFFIC_FIELDS, TESTING.cuda_traffic(), strict=True))
        finally:
            TESTING.cuda_record_traffic(False)
        rows.append((direction, {
            "ld_eff": t["ld_needed"] / t["ld_sectors"],
            "st_eff": t["st_needed"] / t["st_sectors"],
            "moved": (t["ld_sectors"] + t["st_sectors"]) / minimum,
            "distinct": (t["ld_distinct"] + t["st_distinct"]) / minimum,
        }))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", action="store_true", help="also print each case's traffic by access site")
    args = parser.parse_args()
    header = f"{'case':<64} {'ld eff':>7} {'st eff':>7} {'moved/min':>9} {'distinct/min':>12}  launch"
    print(header)
    print("-" * len(header))
    worst = None
    for c in cases():
        r = run_case(c, args.sites)
        L = r["launch"]
        print(f"{c.name:<64} {r['ld_eff']:7.3f} {r['st_eff']:7.3f} {r['moved']:9.3f} {r['distinct']:12.3f}  "
              f"vec={L['vec']} tvec={L['table_vec']} {'compact' if L['compact'] else 'plan'} "
              f"block={L['block_x']}x{L['block_y']}{'' if c.main else '  (not a main case)'}")
        if args.sites:
            for name, (needed, sectors, instructions) in r["sites"].items():
                print(f"    {name:<10} {needed / sectors:6.3f}  {needed:>9} of {sectors:>9} sector bytes, "
                      f"{instructions} warp instructions")
        if c.main:
            eff = min(r["ld_eff"], r["st_eff"])
            worst = eff if worst is None else min(worst, eff)
    print(f"min sector efficiency: {worst:.3f}")
    print()
    print(f"{'QK-norm case':<64} {'ld eff':>7} {'st eff':>7} {'moved/min':>9} {'distinct/min':>12}")
    print("-" * len(header))
    worst = None
    for c in norm_cases():
        for direction, r in run_norm_case(c):
            print(f"{c.name + ' ' + direction:<64} {r['ld_eff']:7.3f} {r['st_eff']:7.3f} {r['moved']:9.3f} "
                  f"{r['distinct']:12.3f}")
            eff = min(r["ld_eff"], r["st_eff"])
            worst = eff if worst is None else min(worst, eff)
    print(f"qk_norm min sector efficiency: {worst:.3f}")


if __name__ == "__main__":
    main()
