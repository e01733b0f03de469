"""QK-norm + RoPE on the CPU (or a GPU): rope_ext.qk_norm_rotary against what models run today (issue 38).

    python benchmarks/bench_qk_norm.py               # every case, 2 threads (about 5 minutes)
    python benchmarks/bench_qk_norm.py --quick       # Qwen3 in bfloat16 only, no torch.compile
    python benchmarks/bench_qk_norm.py --reuse-memory  # freed outputs reused (no page faults per call)
    python benchmarks/bench_qk_norm.py --device cuda --quick  # on a GPU (make gpu-check's lease runs it)

Cases:
  qwen3  Qwen3-8B attention at S=4096: q (1, 4096, 32, 128), k (1, 4096, 8, 128), a (128,) weight
         per head (Qwen3RMSNorm), half-split RoPE.
  wan    Wan-14B self-attention at S=4096: q and k (1, 4096, 40, 128), normalized across heads (a
         (5120,) weight), half-split RoPE.
  layer  Qwen3-8B's shapes with torch's nn.LayerNorm(128) and its bias in place of the RMS norm (the
         full-rotary LayerNorm of Chameleon's and Cohere's heads of 128).
  cohere Qwen3-8B's shapes with Cohere's QK-norm: CohereLayerNorm((heads, 128)), a LayerNorm per head
         with a row of weights per head, no bias (Command R's norm; its RoPE interleaved, here
         half-split as the other cases).
  phi    Phi-2's attention with its QK LayerNorm at S=4096: q and k (1, 4096, 32, 80), nn.LayerNorm(80)
         with its weight and bias per head, half-split RoPE on the first 32 columns (partial rotary,
         sliced and joined as PhiAttention does).
  bfloat16 and float32 each; the weights in the dtype (as the model holds them) and requiring grad.
Providers:
  eager     transformers' Qwen3RMSNorm (over H * D for wan; phi: torch's nn.LayerNorm) in the (B, S,
            H, D) projection layout, then transformers' apply_rotary_pos_emb on the (B, H, S, D) view,
            as Qwen3Attention does;
  compiled  torch.compile (Inductor) of eager;
  unfused   torch.nn.functional.rms_norm (phi: layer_norm), then rope_ext.rotary_qk;
  fused     rope_ext.qk_norm_rotary (phi: norm="layer" with the biases).
Modes: fwd (no grad) and fwd+bwd (forward, then backward of random output gradients into q, k and
both weights). Every provider is checked against the float64 reference first. Providers run
interleaved, one call each per round; the table gives medians and the ratios of medians, all from
one run. Also: fused fwd against `neg_` of q and k in place (the same bytes read and written, out of
cache: q + k are 40 to 168 MiB) and against `clone` (the same bytes into fresh tensors, as every
out-of-place op writes); the in-place `qk_norm_rotary_` against `neg_`, and the rotation alone
(`rotary_` in place) against both, and the out-of-place fused against `rotary_qk` alone (timed one after the
other, so that both find the allocator in the same state); and the peak memory of one
fwd+bwd (torch profiler accounting; on a GPU, torch.cuda's peak allocation). On a GPU each call is
timed to its end (a synchronize), and the tensors are the same sizes.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

import rope_ext
from rope_ext.reference import norm_rotary_reference

S, EPS = 4096, 1e-6
# name: (q heads, k heads, norm_over, head dim, rotary dim, norm)
CASES = {"qwen3": (32, 8, "head", 128, 128, "rms"), "wan": (40, 40, "heads", 128, 128, "rms"),
         "layer": (32, 8, "head", 128, 128, "layer"), "phi": (32, 32, "head", 80, 32, "layer"),
         "cohere": (32, 8, "rows", 128, 128, "layer")}  # (rows: per head, a row of weights per head)
# glibc.malloc thresholds for --reuse-memory: keep freed blocks of any size for reuse, as a caching
# allocator (a GPU's, jemalloc) does; without it each call's output is a fresh mmap whose pages fault
# in on first write (bench_rope.py's docstring).
REUSE_TUNABLES = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296"
TARGETS = {"eager": 5.0, "compiled": 1.5, "unfused": 1.3}  # fwd+bwd speedups the issue asks for


DEVICE = torch.device("cpu")


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


class Case:
    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype
        self.hq, self.hk, form, D, self.r, self.norm = CASES[name]
        self.rows = form == "rows"
        self.norm_over = "head" if self.rows else form
        self.D = D
        g = torch.Generator().manual_seed(0)
        mean = 0.5 if self.norm == "layer" else 0.0  # (rows away from a mean of 0: centering changes them)
        self.q = (torch.randn(1, S, self.hq, D, generator=g) + mean).to(dtype)
        self.k = (torch.randn(1, S, self.hk, D, generator=g) + mean).to(dtype)
        wide = self.norm_over == "heads"
        norm_class = torch.nn.LayerNorm if self.norm == "layer" else Qwen3RMSNorm
        if self.rows:
            from transformers.models.cohere.modeling_cohere import CohereLayerNorm as norm_class

        def make(heads):
            return norm_class((heads, D) if self.rows else D * (heads if wide else 1), eps=EPS)

        self.nq = make(self.hq).to(dtype)
        self.nk = make(self.hk).to(dtype)
        with torch.no_grad():
            for p in (*self.nq.parameters(), *self.nk.parameters()):
                p.uniform_(0.5, 1.5, generator=g)
        r = self.r
        angles = torch.arange(S, dtype=torch.float64)[:, None] * 1e6 ** (-torch.arange(0, r, 2) / r)
        emb = torch.cat((angles, angles), -1)
        self.cos, self.sin = emb.cos()[None].to(dtype), emb.sin()[None].to(dtype)  # (1, S, D), as HF's
        self.q, self.k, self.cos, self.sin = (t.to(DEVICE) for t in (self.q, self.k, self.cos, self.sin))
        self.nq, self.nk = self.nq.to(DEVICE), self.nk.to(DEVICE)

    def label(self) -> str:
        return f"{self.name} {str(self.dtype).removeprefix('torch.')}"

    # -- providers: (q, k) in the (B, S, H, D) projection layout -> the rotated (q, k)
    def eager(self, q, k):
        if self.norm_over == "heads":
            q = self.nq(q.flatten(-2)).unflatten(-1, q.shape[-2:])
            k = self.nk(k.flatten(-2)).unflatten(-1, k.shape[-2:])
        else:
            q, k = self.nq(q), self.nk(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.r == self.D:
            return apply_rotary_pos_emb(q, k, self.cos, self.sin)
        r = self.r  # (PhiAttention's partial rotary: the rotated columns sliced off, rotated, joined back)
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :r], k[..., :r], self.cos, self.sin)
        return torch.cat((q_rot, q[..., r:]), -1), torch.cat((k_rot, k[..., r:]), -1)

    def _params(self):
        biases = dict(norm="layer", q_bias=getattr(self.nq, "bias", None), k_bias=getattr(self.nk, "bias", None)
                      ) if self.norm == "layer" else {}
        return (self.nq.weight, self.nk.weight, self.cos[:, :, None], self.sin[:, :, None]), biases

    def unfused(self, q, k):
        shape = (q.shape[-2] * self.D,) if self.norm_over == "heads" else (self.D,)

        def norm(x, n):
            v = x.flatten(-2) if self.norm_over == "heads" else x
            if self.rows:  # (torch's layer_norm has one row of weights: the rows after it)
                return F.layer_norm(v, shape, None, None, EPS) * n.weight
            v = F.layer_norm(v, shape, n.weight, n.bias, EPS) if self.norm == "layer" else F.rms_norm(v, shape,
                                                                                                   n.weight, EPS)
            return v.unflatten(-1, x.shape[-2:]) if self.norm_over == "heads" else v

        return rope_ext.rotary_qk(norm(q, self.nq), norm(k, self.nk), self.cos[:, :, None], self.sin[:, :, None])

    def fused_inplace(self, q, k):
        tensors, biases = self._params()
        with torch.no_grad():
            return rope_ext.qk_norm_rotary_(q, k, *tensors, eps=EPS, norm_over=self.norm_over, **biases)

    def fused(self, q, k):
        tensors, biases = self._params()
        return rope_ext.qk_norm_rotary(q, k, *tensors, eps=EPS, norm_over=self.norm_over, **biases)


def check(case: Case, fns: dict) -> None:
    """Each provider's forward against the float64 reference, within a few roundings of the dtype."""
    want = [norm_rotary_reference(x.double().cpu(), n.weight.detach().double().cpu(),
                                  case.cos[:, :, None].double().cpu(), case.sin[:, :, None].double().cpu(),
                                  eps=EPS, norm_over=case.norm_over, norm=case.norm,
                                  bias=None if getattr(n, "bias", None) is None else n.bias.detach().double().cpu())
            for x, n in ((case.q, case.nq), (case.k, case.nk))]
    u = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}[case.dtype]
    with torch.no_grad():
        for name, fn in fns.items():
            for got, exp in zip(fn(case.q, case.k), want, strict=True):
                got = got.transpose(1, 2) if got.shape[1] != S else got  # HF's (B, H, S, D) view
                err = float((got.double().cpu() - exp).abs().max() / exp.abs().max())
                if not err <= 8 * u + 2e-5:
                    raise SystemExit(f"{case.label()}: {name} is off by {err:.3g} of the largest output")


def step(case: Case, fn, mode: str):
    """One call of fn: its forward under no_grad, or forward and backward (case.grads, in the
    (B, S, H, D) layout, given to HF's (B, H, S, D) outputs as their transposed views)."""
    if mode == "fwd":
        with torch.no_grad():
            fn(case.q, case.k)
        return None
    q, k = case.q.detach().requires_grad_(), case.k.detach().requires_grad_()
    outs = fn(q, k)
    grads = [g if g.shape == o.shape else g.transpose(1, 2) for o, g in zip(outs, case.grads, strict=True)]
    torch.autograd.backward(outs, grads)
    for p in (*case.nq.parameters(), *case.nk.parameters()):
        p.grad = None
    return None


def measure(case: Case, fns: dict, mode: str, rounds: int) -> dict[str, list[float]]:
    if mode == "fwd+bwd":
        g = torch.Generator().manual_seed(1)
        outs = fns["fused"](case.q, case.k)
        case.grads = [torch.randn(o.shape, generator=g).to(case.dtype).to(DEVICE) for o in outs]  # (B, S, H, D)
    times = {name: [] for name in fns}
    if mode == "fwd":
        qi, ki = case.q.clone(), case.k.clone()
        for name in ("neg_", "clone", "fused_", "rotary_", "rotary_qk", "fused_beside"):
            times[name] = []
    for fn in fns.values():  # warm-up (and compilation)
        step(case, fn, mode)
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            t = time.perf_counter()
            step(case, fn, mode)
            sync()
            times[name].append(time.perf_counter() - t)
        if mode == "fwd":
            t = time.perf_counter()
            qi.neg_()
            ki.neg_()
            sync()
            times["neg_"].append(time.perf_counter() - t)
            t = time.perf_counter()
            case.q.clone()
            case.k.clone()
            sync()
            times["clone"].append(time.perf_counter() - t)
            t = time.perf_counter()
            case.fused_inplace(qi, ki)
            sync()
            times["fused_"].append(time.perf_counter() - t)
            t = time.perf_counter()
            rope_ext.rotary_(qi, case.cos[:, :, None], case.sin[:, :, None])
            rope_ext.rotary_(ki, case.cos[:, :, None], case.sin[:, :, None])
            sync()
            times["rotary_"].append(time.perf_counter() - t)
            t = time.perf_counter()
            rope_ext.rotary_qk(case.q, case.k, case.cos[:, :, None], case.sin[:, :, None])
            sync()
            times["rotary_qk"].append(time.perf_counter() - t)
            # (fused again, right after rotary_qk: both then write fresh outputs of the same sizes from
            # the same allocator state; where the outputs are mapped afresh, their page faults are most
            # of an out-of-place call's time, and the round's first calls find the allocator elsewhere)
            t = time.perf_counter()
            fns["fused"](case.q, case.k)
            sync()
            times["fused_beside"].append(time.perf_counter() - t)
    return times


def peak_memory(case: Case, fn) -> float:
    """MiB allocated at the peak of one fwd+bwd, beyond what existed before (profiler accounting)."""
    from torch.profiler import ProfilerActivity, profile

    step(case, fn, "fwd+bwd")
    if DEVICE.type == "cuda":
        sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(case, fn, "fwd+bwd")
        sync()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(case, fn, "fwd+bwd")
    level = peak = 0
    events = prof.profiler.kineto_results.events()
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        level += nbytes
        peak = max(peak, level)
    return peak / 2**20


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="qwen3 bfloat16 only, without torch.compile")
    p.add_argument("--cases", default=",".join(CASES), help=f"a comma-separated subset of {', '.join(CASES)}")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu, or cuda (a GPU)")
    p.add_argument("--reuse-memory", action="store_true",
                   help="rerun under GLIBC_TUNABLES that keep freed outputs for reuse (no page faults per call)")
    args = p.parse_args()
    if args.reuse_memory and "GLIBC_TUNABLES" not in os.environ:  # (glibc reads it at startup: re-exec)
        os.environ["GLIBC_TUNABLES"] = REUSE_TUNABLES
        os.execv(sys.executable, [sys.executable, *sys.argv])
    torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        # (as bench_cuda.py: the lease's bench part runs both, and its rehearsal has no GPU)
        print("bench_qk_norm: no CUDA device here; nothing to measure")
        return 0
    where = (torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else
             f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(f"{where}, torch {torch.__version__}, rope_ext {rope_ext.__version__} "
          f"({'CUDA' if DEVICE.type == 'cuda' else rope_ext.cpu_kernel_isa()} kernel)")
    dtypes = (torch.bfloat16, torch.float32)
    pairs = [("qwen3", torch.bfloat16)] if args.quick else [(n, d) for n in args.cases.split(",") for d in dtypes]
    verdicts = []
    print(f"{'case':16} {'mode':8} {'provider':9} {'ms':>8} {'eager/x':>8} {'compiled/x':>10} {'unfused/x':>9}")
    for name, dtype in pairs:
        case = Case(name, dtype)
        fns = {"eager": case.eager, "unfused": case.unfused, "fused": case.fused}
        if not args.quick:
            fns["compiled"] = torch.compile(case.eager)
        check(case, fns)
        for mode in ("fwd", "fwd+bwd"):
            times = measure(case, fns, mode, args.rounds)
            med = {n: statistics.median(ts) for n, ts in times.items()}
            for n in fns:
                ratios = [f"{med[o] / med[n]:>{w}.2f}" if o in med else f"{'-':>{w}}"
                          for o, w in (("eager", 8), ("compiled", 10), ("unfused", 9))]
                print(f"{case.label():16} {mode:8} {n:9} {med[n] * 1e3:8.2f} {' '.join(ratios)}")
            if mode == "fwd":
                ratio = med["neg_"] / med["fused"]
                print(f"{case.label():16} {mode:8} {'neg_':9} {med['neg_'] * 1e3:8.2f}   fused at {ratio:.2f} of neg_ "
                      "on the same bytes (target >= 0.8)")
                print(f"{case.label():16} {mode:8} {'clone':9} {med['clone'] * 1e3:8.2f}   fused at "
                      f"{med['clone'] / med['fused']:.2f} of clone (the same bytes into fresh tensors)")
                inplace = med["neg_"] / med["fused_"]
                print(f"{case.label():16} {mode:8} {'fused_':9} {med['fused_'] * 1e3:8.2f}   in place at "
                      f"{inplace:.2f} of neg_ (qk_norm_rotary_, the same bytes read and written in place)")
                print(f"{case.label():16} {mode:8} {'rotary_':9} {med['rotary_'] * 1e3:8.2f}   the rotation alone in "
                      f"place at {med['neg_'] / med['rotary_']:.2f} of neg_ (what the norm adds: fused_ at "
                      f"{med['rotary_'] / med['fused_']:.2f} of it)")
                beside = med["fused_beside"] / med["rotary_qk"]
                print(f"{case.label():16} {mode:8} {'rotary_qk':9} {med['rotary_qk'] * 1e3:8.2f}   the rotation alone "
                      f"out of place: fused, timed next to it, takes {beside:.2f}x its time")
                verdicts.append((f"{case.label()} fwd in place vs neg_", inplace, 0.8))
                verdicts.append((f"{case.label()} fwd vs neg_", ratio, 0.8))
                # (the norm's cost over the rotation alone: time ratios, at most 1.5)
                verdicts.append((f"{case.label()} fwd in place, time over rotary_'s", med["fused_"] / med["rotary_"],
                                 -1.5))
                verdicts.append((f"{case.label()} fwd, time over rotary_qk's", beside, -1.5))
            else:
                for other, target in TARGETS.items():
                    if other in med:
                        verdicts.append((f"{case.label()} fwd+bwd vs {other}", med[other] / med["fused"], target))
        peaks = {n: peak_memory(case, fns[n]) for n in ("eager", "fused")}
        ratio = peaks["fused"] / peaks["eager"]
        print(f"{case.label():16} peak memory of fwd+bwd: eager {peaks['eager']:.0f} MiB, "
              f"fused {peaks['fused']:.0f} MiB "
              f"({ratio:.2f} of eager; target <= 0.5)")
        verdicts.append((f"{case.label()} peak memory vs eager (lower is better)", 1 / ratio, 2.0))
    print("\ntargets (issue 38), measured in this run:")
    for what, got, target in verdicts:  # (a negative target is a most: a time ratio)
        met = got >= target if target > 0 else got <= -target
        bound = f"{target}x" if target > 0 else f"at most {-target}x"
        print(f"  {'met ' if met else 'MISSED'} {what}: {got:.2f}x (target {bound})")


if __name__ == "__main__":
    sys.exit(main())
