"""The host's cost of an eager training call: forward, and forward + backward, of rope_ext's ops at
decode sizes, where the kernels take a few microseconds and the rest is Python, the dispatcher and
autograd.

    python benchmarks/bench_host_cost.py               # 7 rounds, 1 thread (about a minute)
    python benchmarks/bench_host_cost.py --rounds 15 --calls 400

Ops: rotary_qk (full-form tables), rotary_pos_qk (half-width caches gathered at positions, the
RotaryEmbedding module's call) and qk_norm_rotary (Qwen3's RMS norm over each head, its two
weights requiring grad). Shapes: Llama-3-8B's heads, 32 for q and 8 for k, head dim 128, float32,
HF's (B, H, S, D) layout, S = 1 (decode) and 16 tokens.

Providers:
  eager     the same math in plain torch ops (transformers' rotate_half formula; for qk_norm_rotary
            the RMS norm first, as Qwen3RMSNorm computes it);
  dispatch  the call through torch.ops.rope_ext.<op>.default, every argument given: the op's
            registered autograd kernel, as torch.compile and torch.export see the op (and the call
            the public function made in eager mode before it had a Function of its own);
  rope_ext  the public function (rope_ext.rotary_qk, ...);
  minimal   a minimal torch.autograd.Function around the same kernel, called below autograd: its
            forward saves only what its backward needs, its backward is the kernel with
            conjugate=True (qk_norm_rotary: the op's backward kernel, once for q and once for k);
  mul       q * 1.0 and k * 1.0: two of the cheapest differentiable ops, autograd's own floor.
Modes: fwd (a forward that records the graph) and fwd+bwd (the forward, then torch.autograd.grad
of the outputs into q and k, and qk_norm_rotary's weights; mul's into q and k).

Every provider's outputs and gradients are checked against eager's first. The providers and modes
run interleaved, each round timing every case; a figure is the median over rounds of the round's
mean per call, and beside each ratio to minimal, its range over the rounds. The target: rope_ext's
fwd+bwd within 1.15x of minimal's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import rope_ext
from rope_ext._torch_private import below_autograd

HQ, HK, D, EPS, POSITION = 32, 8, 128, 1e-6, 1000
TARGET = 1.15
OPS = ("rotary_qk", "rotary_pos_qk", "qk_norm_rotary")
PROVIDERS = ("eager", "dispatch", "rope_ext", "minimal", "mul")
MODES = ("fwd", "fwd+bwd")

_ops = torch.ops.rope_ext


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


class MinimalRotaryQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        with below_autograd():
            return _ops.rotary_qk.default(q, k, cos, sin, False, None, None, False)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        with below_autograd():
            dq, dk = _ops.rotary_qk.default(gq, gk, cos, sin, False, None, None, True)
        return dq, dk, None, None


class MinimalRotaryPosQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos_cache, sin_cache, positions):
        ctx.save_for_backward(cos_cache, sin_cache, positions)
        with below_autograd():
            return _ops.rotary_pos_qk.default(q, k, cos_cache, sin_cache, positions, False, False)

    @staticmethod
    def backward(ctx, gq, gk):
        cos_cache, sin_cache, positions = ctx.saved_tensors
        with below_autograd():
            dq, dk = _ops.rotary_pos_qk.default(gq, gk, cos_cache, sin_cache, positions, False, True)
        return dq, dk, None, None, None


class MinimalQKNormRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin):
        with below_autograd():
            q_out, k_out, q_stats, k_stats = _ops.qk_norm_rotary.default(q, k, q_weight, k_weight, cos, sin, EPS)
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin, q_stats, k_stats)
        return q_out, k_out

    @staticmethod
    def backward(ctx, gq, gk):
        q, k, q_weight, k_weight, cos, sin, q_stats, k_stats = ctx.saved_tensors
        with below_autograd():
            dq, dqw, _ = _ops.qk_norm_rotary_backward.default(gq, q, q_weight, q_stats, cos, sin, None, 0.0, False,
                                                              False, True, False, False, False)
            dk, dkw, _ = _ops.qk_norm_rotary_backward.default(gk, k, k_weight, k_stats, cos, sin, None, 0.0, False,
                                                              False, True, False, False, False)
        return dq, dk, dqw, dkw, None, None


def case(op: str, seqlen: int) -> tuple[dict, tuple]:
    """The providers' calls for one op and length, and the tensors the gradients are taken of."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, seqlen, D, generator=gen, requires_grad=True)
    k = torch.randn(1, HK, seqlen, D, generator=gen, requires_grad=True)
    angles = torch.outer(torch.arange(4096, dtype=torch.float64),
                         10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D))
    cos_cache, sin_cache = angles.cos().float(), angles.sin().float()  # (4096, D / 2)
    positions = torch.arange(POSITION, POSITION + seqlen)
    cos = torch.cat((cos_cache[positions],) * 2, -1)[None, None]  # (1, 1, S, D): the rows, full form
    sin = torch.cat((sin_cache[positions],) * 2, -1)[None, None]
    mul = lambda: (q * 1.0, k * 1.0)  # noqa: E731

    if op == "qk_norm_rotary":
        qw = (1.0 + 0.1 * torch.randn(D, generator=gen)).requires_grad_()
        kw = (1.0 + 0.1 * torch.randn(D, generator=gen)).requires_grad_()
        calls = {
            "eager": lambda: (rms_norm(q, qw) * cos + rotate_half(rms_norm(q, qw)) * sin,
                              rms_norm(k, kw) * cos + rotate_half(rms_norm(k, kw)) * sin),
            "dispatch": lambda: _ops.qk_norm_rotary.default(q, k, qw, kw, cos, sin, EPS, 0.0, False, False, False,
                                                            None, None, False)[:2],
            "rope_ext": lambda: rope_ext.qk_norm_rotary(q, k, qw, kw, cos, sin, eps=EPS),
            "minimal": lambda: MinimalQKNormRotary.apply(q, k, qw, kw, cos, sin),
            "mul": mul,
        }
        return calls, (q, k, qw, kw)
    if op == "rotary_pos_qk":
        calls = {
            "dispatch": lambda: _ops.rotary_pos_qk.default(q, k, cos_cache, sin_cache, positions, False, False),
            "rope_ext": lambda: rope_ext.rotary_pos_qk(q, k, cos_cache, sin_cache, positions),
            "minimal": lambda: MinimalRotaryPosQK.apply(q, k, cos_cache, sin_cache, positions),
        }
    else:
        calls = {
            "dispatch": lambda: _ops.rotary_qk.default(q, k, cos, sin, False, None, None, False),
            "rope_ext": lambda: rope_ext.rotary_qk(q, k, cos, sin),
            "minimal": lambda: MinimalRotaryQK.apply(q, k, cos, sin),
        }
    calls = {"eager": lambda: (q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin), **calls, "mul": mul}
    return calls, (q, k)


def with_backward(call, inputs, grads):
    return lambda: torch.autograd.grad(call(), inputs, grads)


def check(op: str, seqlen: int, calls: dict, inputs: tuple) -> None:
    """Every provider's outputs and gradients against eager's (mul's aside: it computes something else).
    float32 throughout: each result is a few float32 roundings from eager's (the norm's rsqrt and
    mean, the rotation's two products and a sum), so 1e-5 relative to values of order 1."""
    gen = torch.Generator().manual_seed(1)
    expected = calls["eager"]()
    grads = tuple(torch.randn(o.shape, generator=gen) for o in expected)
    expected_grads = torch.autograd.grad(expected, inputs, grads)
    for name in ("dispatch", "rope_ext", "minimal"):
        outputs = calls[name]()
        for got, want in zip((*outputs, *torch.autograd.grad(outputs, inputs, grads)),
                             (*expected, *expected_grads), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{op} S={seqlen} {n}: {m}")


def run(rounds: int, calls_per: int, lengths: tuple[int, ...]) -> dict:
    """{(op, S, provider, mode): [mean us per call, one per round]}, the rounds interleaved."""
    timed = {}
    for op in OPS:
        for seqlen in lengths:
            calls, inputs = case(op, seqlen)
            check(op, seqlen, calls, inputs)
            grads = tuple(torch.ones_like(o) for o in calls["eager"]())
            for name in PROVIDERS:
                timed[(op, seqlen, name, "fwd")] = calls[name]
                wrt = inputs[:2] if name == "mul" else inputs  # (mul uses no weight)
                timed[(op, seqlen, name, "fwd+bwd")] = with_backward(calls[name], wrt, grads)
    times = {key: [] for key in timed}
    for _ in range(rounds):
        for key, fn in timed.items():
            for _ in range(max(2, calls_per // 10)):
                fn()
            t0 = time.perf_counter()
            for _ in range(calls_per):
                fn()
            times[key].append((time.perf_counter() - t0) / calls_per * 1e6)
    return times


def table(times: dict, lengths: tuple[int, ...]) -> list[str]:
    lines = []
    verdicts = []
    for op in OPS:
        for seqlen in lengths:
            lines += [f"\n{op}, S = {seqlen}  (us per call; ratio: fwd+bwd / minimal's, median [range over rounds])",
                      f"  {'provider':<10}{'fwd':>9}{'fwd+bwd':>10}   ratio"]
            base = times[(op, seqlen, "minimal", "fwd+bwd")]
            for name in PROVIDERS:
                fwd = statistics.median(times[(op, seqlen, name, "fwd")])
                fb = times[(op, seqlen, name, "fwd+bwd")]
                per_round = [a / b for a, b in zip(fb, base, strict=True)]
                ratio = statistics.median(fb) / statistics.median(base)
                lines.append(f"  {name:<10}{fwd:9.1f}{statistics.median(fb):10.1f}   {ratio:5.2f} "
                             f"[{min(per_round):.2f}, {max(per_round):.2f}]")
                if name == "rope_ext":
                    verdicts.append(f"{op:<15} S = {seqlen:<3} rope_ext / minimal = {ratio:.2f}  "
                                    f"{'met' if ratio <= TARGET else 'MISSED'}")
    return lines + [f"\ntarget: rope_ext's fwd+bwd within {TARGET}x of minimal's"] + verdicts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200, help="calls per case per round")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lengths = tuple(args.lengths)
    print(f"torch {torch.__version__}, rope_ext {rope_ext.__version__}, 1 thread, float32, "
          f"{args.rounds} rounds of {args.calls} calls")
    print("\n".join(table(run(args.rounds, args.calls, lengths), lengths)))


if __name__ == "__main__":
    main()
