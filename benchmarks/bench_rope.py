"""CPU benchmark suite: rope_ext against the HF formula, its torch.compile, and the physical floor.

    python benchmarks/bench_rope.py            # the full suite (the run behind docs/devlog.md)
    python benchmarks/bench_rope.py --quick    # what `make bench` runs: HF layout, 2 threads
    python benchmarks/bench_rope.py --positions  # issue 18: positions + caches (positions_suite.py)
    python benchmarks/bench_rope.py --cache      # issue 30: against a plain loop (cache_suite.py)

Shape: Llama-3-8B attention, 32 q heads and 8 kv heads of head dim 128.
  prefill  S = 2048, with B chosen so that q + k take 160 MiB in every dtype, 5x the 32 MiB
           of last-level cache the issue assumed (lscpu here reports 8 MiB of L3), so nothing is
           timed from cache;
  decode   S = 1, B in 1, 4, 16, 32, each sequence at its own position (cos/sin are (B, 1, 1, D)).
Layouts (x's shape, and what the storage is):
  hf_view  (B, H, S, D) view over (B, S, H, D) storage: q_proj(x).view(B, S, H, D).transpose(1, 2)
  bshd     contiguous (B, S, H, D)
  bhsd     contiguous (B, H, S, D)
Providers (each returns the rotated q and k):
  rope_ext          rope_ext.rotary on q, then on k
  rope_ext_qk       rope_ext.rotary_qk: q and k in one op call
  rope_ext_inplace  rope_ext.rotary_ on q and on k (fwd only: in place is for inference)
  hf_eager          q * cos + rotate_half(q) * sin, the same for k (transformers' formula)
  hf_compiled       torch.compile (inductor) of hf_eager
  floor             dst.copy_(src) over the same tensors into preallocated buffers: the same bytes
                    read and written with no math and no allocation. For in place: x.neg_().
  floor_alloc       src.clone(): the same bytes into a fresh output, as every out-of-place op
                    (and autograd's gradients) must be. Shown as its own ratio column.
Modes: fwd (no grad), bwd (autograd.grad of a recorded forward, retain_graph), fwd+bwd.
Tables: cos/sin in q's dtype, as transformers' rotary embedding returns them, the same tensors
for every provider. GB/s counts x read once and the result written once (q and k; twice for
fwd+bwd); the tables are small and stay in cache.

Every provider's forward and gradient are checked against a float64 reference before anything
is timed. Timing uses torch.utils.benchmark's blocked_autorange with the thread count set per
measurement; the providers of one configuration are interleaved round by round and each row
reports the median and interquartile range of all blocks, so ratios within a configuration are
measured side by side. Output: a table, the targets of issue 6 as measured ratios, the memory
report, and a CSV plus a PNG plot in --out.

Fresh outputs and glibc: glibc serves every allocation above its mmap threshold (at most
32 MiB) with a new mmap and returns it on free, so each call's output is new memory whose pages
fault in on first write, which costs more than the rotation itself (see docs/devlog.md).
--reuse-memory reruns the suite with GLIBC_TUNABLES raising glibc's mmap and trim thresholds,
so freed outputs are reused as a caching allocator (jemalloc, tcmalloc, a GPU's) would: that
run measures the kernels rather than the kernel's page faults.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.utils.benchmark as tb

import rope_ext
from rope_ext import reference

HQ, HKV, D = 32, 8, 128
BASE = 500000.0
PREFILL_SEQ = 2048
PREFILL_BYTES = 160 * 2**20  # q + k per prefill case
DECODE_BATCHES = (1, 4, 16, 32)
LAYOUTS = ("hf_view", "bshd", "bhsd")
MODES = ("fwd", "bwd", "fwd+bwd")
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


# ----------------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # "prefill" or "decode"
    batch: int
    seq: int
    layout: str
    dtype: torch.dtype
    threads: int

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def label(self) -> str:
        return f"{self.kind} B={self.batch} S={self.seq} {self.layout} {self.dtype_name} t={self.threads}"


def prefill_batch(dtype: torch.dtype) -> int:
    per_sequence = PREFILL_SEQ * (HQ + HKV) * D * torch.finfo(dtype).bits // 8
    return max(1, PREFILL_BYTES // per_sequence)


def make_tensor(case: Case, heads: int, g: torch.Generator) -> torch.Tensor:
    """x in the case's layout; returns a (B, H, S, D) or (B, S, H, D) tensor as the formula sees it."""
    b, s = case.batch, case.seq
    if case.layout == "hf_view":
        return torch.randn(b, s, heads, D, generator=g).to(case.dtype).transpose(1, 2)
    if case.layout == "bshd":
        return torch.randn(b, s, heads, D, generator=g).to(case.dtype)
    return torch.randn(b, heads, s, D, generator=g).to(case.dtype)


def make_tables(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-format (full width, half-split) cos/sin in q's dtype, shaped to broadcast against x."""
    if case.kind == "decode":
        positions = torch.arange(case.batch, dtype=torch.float64)[:, None] * 37 + 100  # (B, 1)
    else:
        positions = torch.arange(case.seq, dtype=torch.float64)[None]  # (1, S)
    inv_freq = BASE ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    cos, sin = reference.angles_to_cos_sin(positions[..., None] * inv_freq)  # (B or 1, S, D)
    head_axis = 2 if case.layout == "bshd" else 1
    return cos.unsqueeze(head_axis).to(case.dtype), sin.unsqueeze(head_axis).to(case.dtype)


# -------------------------------------------------------------------------------- providers


def hf_formula(q, k, cos, sin):
    return q * cos + reference.rotate_half(q) * sin, k * cos + reference.rotate_half(k) * sin


def rope_ext_each(q, k, cos, sin):
    return rope_ext.rotary(q, cos, sin), rope_ext.rotary(k, cos, sin)


def rope_ext_qk(q, k, cos, sin):
    return rope_ext.rotary_qk(q, k, cos, sin)


def rope_ext_inplace(q, k, cos, sin):
    return rope_ext.rotary_(q, cos, sin), rope_ext.rotary_(k, cos, sin)


OUT_OF_PLACE = {"rope_ext": rope_ext_each, "rope_ext_qk": rope_ext_qk, "hf_eager": hf_formula}
PROVIDERS = ("rope_ext", "rope_ext_qk", "rope_ext_inplace", "hf_eager", "hf_compiled", "floor", "floor_alloc")
# glibc.malloc thresholds for --reuse-memory: keep freed blocks of any size for reuse.
REUSE_TUNABLES = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296"


def providers_for(compiled: Callable | None) -> dict[str, Callable]:
    fns = dict(OUT_OF_PLACE)
    if compiled is not None:
        fns["hf_compiled"] = compiled
    return fns


# ------------------------------------------------------------------------------ correctness


def check(case: Case, fns: dict[str, Callable], modes) -> None:
    """Forward and gradient of every provider against the float64 reference of the same tables."""
    g = torch.Generator().manual_seed(1)
    q, k = make_tensor(case, HQ, g), make_tensor(case, HKV, g)
    cos, sin = make_tables(case)
    c64, s64 = cos.double(), sin.double()
    want = [reference.rotary_reference(t.double(), c64, s64) for t in (q, k)]
    # Each output is a sum of two products of x with tables of magnitude <= 1: at most three
    # roundings in the dtype (two products, one sum), each <= u * max|x| * sqrt(2).
    tol = 6 * UNIT_ROUNDOFF[case.dtype] * max(q.abs().max().item(), k.abs().max().item())

    def close(name, what, got, exp):
        err = (got.double() - exp).abs().max().item()
        if not err <= tol:
            raise SystemExit(f"{case.label()}: {name} {what} is off by {err:.3g} (tolerance {tol:.3g})")

    for name, fn in fns.items():
        for got, exp in zip(fn(q, k, cos, sin), want, strict=True):
            close(name, "forward", got, exp)
        if {"bwd", "fwd+bwd"} & set(modes):
            qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
            outs = fn(qg, kg, cos, sin)
            grads_out = [torch.randn_like(o) for o in outs]
            grads = torch.autograd.grad(outs, (qg, kg), grads_out)
            for got, go in zip(grads, grads_out, strict=True):
                close(name, "gradient", got, reference.rotary_reference(go.double(), c64, s64, conjugate=True))
    qi, ki = q.clone(), k.clone()
    for got, exp in zip(rope_ext_inplace(qi, ki, cos, sin), want, strict=True):
        close("rope_ext_inplace", "forward", got, exp)


# ----------------------------------------------------------------------------------- timing


def statements(case: Case, mode: str, fns: dict[str, Callable]) -> tuple[dict[str, str], dict]:
    """The timed statement of every provider in `mode`, and the globals they run with."""
    g = torch.Generator().manual_seed(0)
    q, k = make_tensor(case, HQ, g), make_tensor(case, HKV, g)
    cos, sin = make_tables(case)
    env = dict(q=q, k=k, cos=cos, sin=sin, grad=torch.autograd.grad, **fns)
    env.update(dq=torch.empty_like(q), dk=torch.empty_like(k))
    stmts = {}
    if mode == "fwd":
        for name in fns:
            stmts[name] = f"{name}(q, k, cos, sin)"
        env.update(qi=q.clone(), ki=k.clone(), rope_ext_inplace=rope_ext_inplace)
        stmts["rope_ext_inplace"] = "rope_ext_inplace(qi, ki, cos, sin)"
        stmts["floor"] = "dq.copy_(q); dk.copy_(k)"
        stmts["floor_alloc"] = "q.clone(); k.clone()"
        stmts["floor_inplace"] = "qi.neg_(); ki.neg_()"
        return stmts, env
    qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
    env.update(qg=qg, kg=kg, gq=torch.randn_like(q), gk=torch.randn_like(k))
    if mode == "bwd":
        for name, fn in fns.items():
            env[f"out_{name}"] = fn(qg, kg, cos, sin)  # recorded once, differentiated each run
            stmts[name] = f"grad(out_{name}, (qg, kg), (gq, gk), retain_graph=True)"
        stmts["floor"] = "dq.copy_(gq); dk.copy_(gk)"
        stmts["floor_alloc"] = "gq.clone(); gk.clone()"
    else:
        for name in fns:
            stmts[name] = f"grad({name}(qg, kg, cos, sin), (qg, kg), (gq, gk))"
        env.update(dq2=torch.empty_like(q), dk2=torch.empty_like(k))
        stmts["floor"] = "dq.copy_(q); dk.copy_(k); dq2.copy_(gq); dk2.copy_(gk)"
        stmts["floor_alloc"] = "q.clone(); k.clone(); gq.clone(); gk.clone()"
    return stmts, env


# A median is trusted when its interquartile range is at most this fraction of it. Where a provider's
# spread is wider, the configuration's providers are all measured again, interleaved (up to
# EXTRA_ROUNDS more rounds, all blocks kept); a row that stays wider is marked noisy, and a ratio with
# a noisy row on either side gives no verdict and leaves the summary.
MAX_SPREAD = 0.5
EXTRA_ROUNDS = 3


def spread(ts: list[float]) -> float:
    """Interquartile range over median."""
    if len(ts) < 2:
        return 0.0
    q1, med, q3 = statistics.quantiles(ts, n=4)
    return (q3 - q1) / med


def measure(case, mode, stmts, env, rounds, min_run_time, progress) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in stmts}

    def block(name):
        timer = tb.Timer(stmts[name], globals=env, num_threads=case.threads, label=case.label(), sub_label=name)
        times[name].extend(timer.blocked_autorange(min_run_time=min_run_time).times)

    for _ in range(rounds):
        for name in stmts:
            block(name)
            progress.update(1)
    for _ in range(EXTRA_ROUNDS):  # every provider again, interleaved, so that the ratios stay side by side
        if all(spread(times[name]) <= MAX_SPREAD for name in stmts):
            break
        for name in stmts:
            block(name)
    return times


@dataclasses.dataclass
class Row:
    case: Case
    mode: str
    provider: str
    median_ms: float
    iqr_ms: float
    gbps: float
    floor_ratio: float = float("nan")  # floor time / this time
    alloc_floor_ratio: float = float("nan")  # floor_alloc time / this time (out of place only)
    vs_hf_eager: float = float("nan")  # hf_eager time / this time
    vs_compiled: float = float("nan")  # hf_compiled time / this time
    noisy_refs: frozenset = frozenset()  # the references (floor_alloc, hf_eager, ...) whose rows are noisy

    @property
    def noisy(self) -> bool:  # a spread wider than MAX_SPREAD even after the extra rounds
        return self.iqr_ms > MAX_SPREAD * self.median_ms

    def trusted(self, *refs: str) -> bool:
        """Whether this row and the references its ratio is taken against are all within the spread."""
        return not self.noisy and not self.noisy_refs.intersection(refs)


def summarize(case: Case, mode: str, times: dict[str, list[float]]) -> list[Row]:
    elements = case.batch * case.seq * (HQ + HKV) * D
    nbytes = (4 if mode == "fwd+bwd" else 2) * elements * torch.finfo(case.dtype).bits // 8
    med = {name: statistics.median(ts) for name, ts in times.items()}
    noisy = frozenset(name for name, ts in times.items() if spread(ts) > MAX_SPREAD)
    rows = []
    for name, ts in times.items():
        if name == "floor_inplace":
            continue
        q1, _, q3 = statistics.quantiles(ts, n=4) if len(ts) > 1 else (ts[0],) * 3
        inplace = name == "rope_ext_inplace"
        floor = med["floor_inplace" if inplace else "floor"]
        alloc_floor = float("nan") if inplace else med["floor_alloc"]
        rows.append(
            Row(
                case, mode, name, med[name] * 1e3, (q3 - q1) * 1e3, nbytes / med[name] / 1e9,
                floor / med[name], alloc_floor / med[name], med["hf_eager"] / med[name],
                med.get("hf_compiled", float("nan")) / med[name], noisy,
            )
        )  # fmt: skip
    return rows


# ------------------------------------------------------------------------------ memory


def memory_report(case: Case, fns: dict[str, Callable]) -> list[str]:
    """Peak memory of one fwd+bwd (torch profiler accounting) and what autograd saves."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(0)
    q, k = make_tensor(case, HQ, g), make_tensor(case, HKV, g)
    cos, sin = make_tables(case)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    mib = 2.0**-20
    xbytes = (q.numel() + k.numel()) * q.element_size()
    lines = [
        f"memory, one fwd+bwd at {case.label()}: q + k = {xbytes * mib:.0f} MiB; the least any fused op can",
        f"hold at its peak is its outputs plus the gradients, {2 * xbytes * mib:.0f} MiB",
        f"{'provider':12} {'peak MiB':>9} {'peak / least':>13} {'saved for backward':>40}",
    ]
    table_ptrs = {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    for name, fn in fns.items():
        qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
        fn(qg, kg, cos, sin)  # warm-up (and compilation) outside the profile
        saved: list[torch.Tensor] = []
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
                outs = fn(qg, kg, cos, sin)
            grads = torch.autograd.grad(outs, (qg, kg), (gq, gk))
        del outs, grads
        # Every allocation and free the profiler saw, in time order, as signed byte counts.
        events = prof.profiler.kineto_results.events()
        events = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        level = peak = 0
        for _, delta in events:
            level += delta
            peak = max(peak, level)
        new = [t for t in saved if t.untyped_storage().data_ptr() not in table_ptrs]
        new_bytes = sum(t.untyped_storage().nbytes() for t in new)
        what = "cos, sin only" if not new else f"{len(new)} more tensors, {new_bytes * mib:.0f} MiB"
        lines.append(f"{name:12} {peak * mib:9.0f} {peak / (2 * xbytes):13.2f} {what:>40}")
    return lines


# ------------------------------------------------------------------------------ output


def print_table(rows: list[Row]) -> None:
    hdr = (
        f"{'case':44} {'mode':8} {'provider':17} {'median ms':>10} {'IQR ms':>8} {'GB/s':>7} "
        f"{'floor/this':>10} {'alloc/this':>10} {'vs eager':>9} {'vs compiled':>11}"
    )
    print(hdr)
    print("-" * len(hdr))
    last = None
    for r in rows:
        key = (r.case, r.mode)
        if last is not None and key != last:
            print()
        last = key
        print(
            f"{r.case.label():44} {r.mode:8} {r.provider:17} {r.median_ms:10.3f} {r.iqr_ms:8.3f} {r.gbps:7.2f} "
            f"{r.floor_ratio:10.2f} {r.alloc_floor_ratio:10.2f} {r.vs_hf_eager:8.2f}x {r.vs_compiled:10.2f}x"
            f"{'  noisy' if r.noisy else ''}"
        )


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "batch", "seq", "layout", "dtype", "threads", "mode", "provider", "median_ms",
                    "iqr_ms", "gb_per_s", "floor_over_this", "floor_alloc_over_this", "hf_eager_over_this",
                    "hf_compiled_over_this"])  # fmt: skip
        for r in rows:
            c = r.case
            w.writerow([c.kind, c.batch, c.seq, c.layout, c.dtype_name, c.threads, r.mode, r.provider,
                        f"{r.median_ms:.4f}", f"{r.iqr_ms:.4f}", f"{r.gbps:.3f}", f"{r.floor_ratio:.3f}",
                        f"{r.alloc_floor_ratio:.3f}", f"{r.vs_hf_eager:.3f}", f"{r.vs_compiled:.3f}"])  # fmt: skip


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefill = [r for r in rows if r.case.kind == "prefill"]
    decode = [r for r in rows if r.case.kind == "decode"]
    fig, axes = plt.subplots(1, len(MODES) + 1, figsize=(6 * (len(MODES) + 1), 7))
    names = [p for p in PROVIDERS]
    for ax, mode in zip(axes, MODES, strict=False):
        sel = [r for r in prefill if r.mode == mode]
        cases = sorted({(r.case.dtype_name, r.case.layout, r.case.threads) for r in sel})
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ys = [next((r.gbps for r in sel if r.provider == name and
                        (r.case.dtype_name, r.case.layout, r.case.threads) == c), 0.0) for c in cases]  # fmt: skip
            ax.barh([j + i * width for j in range(len(cases))], ys, height=width, label=name)
        ax.set_yticks([j + 0.4 for j in range(len(cases))], [f"{d} {lay} t={t}" for d, lay, t in cases])
        ax.set_xlabel("GB/s (x read once, result written once)")
        ax.set_title(f"prefill, {mode}")
    axes[0].legend(loc="lower right", fontsize=8)
    ax = axes[-1]
    for name in ("rope_ext_qk", "rope_ext", "hf_eager", "hf_compiled", "floor"):
        for threads, style in ((1, "--"), (2, "-")):
            pts = sorted((r.case.batch, r.median_ms * 1e3) for r in decode if r.provider == name
                         and r.case.threads == threads and r.case.dtype == torch.bfloat16)  # fmt: skip
            if pts:
                ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{name} t={threads}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (S = 1, bfloat16)")
    ax.set_ylabel("µs per call, q and k")
    ax.set_title("decode latency")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def targets(rows: list[Row]) -> list[str]:
    """Issue 6's targets, each as a ratio measured in this run. Out of place, the floor is floor_alloc
    (the same bytes copied into a fresh output, which any out-of-place op must fill: a copy into
    reused memory is a floor no new output can reach; docs/devlog.md, section 1). A row whose
    spread stayed wider than MAX_SPREAD of its median gives no verdict."""

    def pick(kind, mode, provider, **match):
        return [
            r for r in rows
            if r.case.kind == kind and r.mode == mode and r.provider == provider
            and all(getattr(r.case, key) == val for key, val in match.items())
        ]  # fmt: skip

    lines = []

    def verdict(ok, r, *refs):
        return ("met" if ok else "MISSED") if r.trusted(*refs) else "noisy"

    for mode in ("fwd", "bwd"):
        for provider in ("rope_ext_qk", "rope_ext"):
            for r in pick("prefill", mode, provider, threads=2):
                lines.append(
                    f"out-of-cache {mode:3} floor_alloc/{provider:11} >= 0.85: {r.alloc_floor_ratio:5.2f}  "
                    f"{verdict(r.alloc_floor_ratio >= 0.85, r, 'floor_alloc'):6}  (floor/this {r.floor_ratio:4.2f})  "
                    f"{r.case.label()}"
                )
    for r in pick("prefill", "fwd+bwd", "rope_ext_qk"):
        lines.append(
            f"fwd+bwd vs hf_eager >= 4: {r.vs_hf_eager:5.2f}x {verdict(r.vs_hf_eager >= 4, r, 'hf_eager'):6}  "
            f"vs hf_compiled >= 1.2: {r.vs_compiled:5.2f}x {verdict(r.vs_compiled >= 1.2, r, 'hf_compiled'):6}  "
            f"{r.case.label()}"
        )
    for r in pick("decode", "fwd", "rope_ext_qk"):
        ratio = 1 / r.vs_hf_eager
        lines.append(f"decode rope_ext_qk / hf_eager <= 0.5: {ratio:5.2f}  {verdict(ratio <= 0.5, r, 'hf_eager'):6}  "
                     f"{r.case.label()}")
    return lines


def summary(rows: list[Row]) -> list[str]:
    """A few lines for the README: the ranges of the ratios the targets read, each over the rows whose
    ratio is trusted (both sides within MAX_SPREAD), and how many rows were noisy."""

    def span(rows_, ratio, ref, fmt, unit=""):
        values = sorted(v for r in rows_ if r.trusted(ref) and (v := ratio(r)) == v)
        return f"{values[0]:{fmt}}{unit} to {values[-1]:{fmt}}{unit}" if values else "not measured"

    def of(kind, mode):
        return [r for r in rows if r.case.kind == kind and r.mode == mode and r.provider == "rope_ext_qk"]

    fb, dec, oop = of("prefill", "fwd+bwd"), of("decode", "fwd"), of("prefill", "fwd")
    noisy = sum(r.noisy for r in rows)
    return [
        f"fwd+bwd of q and k: {span(fb, lambda r: r.vs_hf_eager, 'hf_eager', '.1f', 'x')} faster than HF "
        f"eager, {span(fb, lambda r: r.vs_compiled, 'hf_compiled', '.1f', 'x')} faster than torch.compile of HF",
        f"decode of q and k: {span(dec, lambda r: 1 / r.vs_hf_eager, 'hf_eager', '.2f')} of HF eager's time",
        f"out-of-cache forward: {span(oop, lambda r: r.alloc_floor_ratio, 'floor_alloc', '.2f', 'x')} the speed "
        f"of a copy into a fresh tensor (floor_alloc)",
        f"{len(rows) - noisy} of {len(rows)} rows within the spread limit (IQR <= {MAX_SPREAD:.0%} of the median)"
        + (f"; {noisy} noisy, left out with the ratios taken against them" if noisy else ""),
    ]


# ------------------------------------------------------------------------------ main


def cases(args) -> list[tuple[Case, tuple[str, ...]]]:
    out = []
    layouts = ("hf_view",) if args.quick else LAYOUTS
    threads = (2,) if args.quick else (1, 2)
    for t in threads:
        for dt in args.dtypes:
            dtype = getattr(torch, dt)
            for layout in layouts:
                out.append((Case("prefill", prefill_batch(dtype), PREFILL_SEQ, layout, dtype, t), MODES))
            for b in (1, 32) if args.quick else DECODE_BATCHES:
                out.append((Case("decode", b, 1, "hf_view", dtype, t), ("fwd",)))
    return out



def parallel_threads_seen(n: int) -> int | str:
    """How many threads at::parallel_for used for n items, from the tests' hook library when it
    was built (ROPE_EXT_TESTING=1, as `make setup` does)."""
    hooks = Path(rope_ext.__file__).resolve().parent / "lib" / "librope_ext_testing.so"
    if not hooks.exists():
        return f"unknown ({hooks.name} not built)"
    torch.ops.load_library(str(hooks))
    return torch.ops.rope_ext_testing.parallel_threads_used(n)

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="HF layout, 2 threads, decode B in {1, 32}, 2 rounds")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, help="interleaved rounds per configuration (default 3; 2 with --quick)")
    p.add_argument("--min-run-time", type=float, default=0.25, help="seconds per measurement block")
    p.add_argument("--no-compile", action="store_true", help="leave out hf_compiled (saves the compile time)")
    p.add_argument("--reuse-memory", action="store_true", help="rerun under GLIBC_TUNABLES that reuse freed outputs")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    p.add_argument("--positions", action="store_true", help="the positions + caches suite (positions_suite.py)")
    p.add_argument("--cache", action="store_true", help="issue 30's suite against a plain loop (cache_suite.py)")
    args = p.parse_args()
    if args.cache:
        import cache_suite

        cache_suite.run(rounds=args.rounds or 5)
        return
    if args.positions:
        import positions_suite

        positions_suite.run(rounds=args.rounds or 5)
        return
    if args.reuse_memory and os.environ.get("GLIBC_TUNABLES") != REUSE_TUNABLES:
        # glibc reads its tunables once, at startup: the process has to start again with them.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GLIBC_TUNABLES": REUSE_TUNABLES})
    rounds = args.rounds or (2 if args.quick else 3)
    from tqdm import tqdm

    print(f"rope_ext {rope_ext.__version__}, torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print(f"CPU kernel: {rope_ext.cpu_kernel_isa()}  |  torch threads available: {torch.get_num_threads()}")
    reuse = os.environ.get("GLIBC_TUNABLES") == REUSE_TUNABLES
    print(f"memory: {'freed outputs reused (GLIBC_TUNABLES=' + REUSE_TUNABLES + ')' if reuse else 'glibc defaults'}")
    plan = cases(args)
    # Measurements: per configuration, per mode, `rounds` x providers (fwd has 2 floors and in place).
    total = sum(rounds * (len(PROVIDERS) + 1 - args.no_compile - (m != "fwd") * 2) for _, ms in plan for m in ms)
    rows: list[Row] = []
    memory: list[str] = []
    with tqdm(total=total, desc="bench", unit="measurement", leave=False) as progress:
        for case, modes in plan:
            torch.set_num_threads(case.threads)
            # Inductor writes the thread count into the code it generates: a fresh compile per case.
            torch._dynamo.reset()
            compiled = None if args.no_compile else torch.compile(hf_formula, dynamic=False)
            fns = providers_for(compiled)
            check(case, fns, modes)
            for mode in modes:
                stmts, env = statements(case, mode, fns)
                rows += summarize(case, mode, measure(case, mode, stmts, env, rounds, args.min_run_time, progress))
            if case.kind == "prefill" and case.layout == "hf_view" and case.threads == 2 and not memory:
                memory = memory_report(case, fns)
    torch.set_num_threads(max(c.threads for c, _ in plan))
    seen = parallel_threads_seen(64)
    print(f"parallel_for threads seen at {torch.get_num_threads()} threads: {seen}")
    print()
    print_table(rows)
    print()
    print("\n".join(memory))
    print()
    print("targets (issue 6's; out of place against floor_alloc since issue 36), each a ratio of two medians "
          "measured side by side in this run:")
    print("\n".join("  " + line for line in targets(rows)))
    print()
    print("summary:")
    print("\n".join("  " + line for line in summary(rows)))
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "bench_rope.csv")
    plot(rows, args.out / "bench_rope.png")
    print(f"\nwrote {args.out / 'bench_rope.csv'} and {args.out / 'bench_rope.png'}")


if __name__ == "__main__":
    main()
