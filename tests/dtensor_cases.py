"""The DTensor cases of tests/test_dtensor.py, each written once and run twice: on DTensors by two
gloo processes (`Sharded`), and on ordinary tensors in the test process (`Plain`), which is the
unsharded result they must equal. Importable by spawned processes.

A case returns {"out": outputs, "grads": gradients of the leaves (rotated inputs first), and, on
DTensors, "placements" / "grad_placements" of the outputs and the rotated inputs' gradients}, all
gathered to full tensors. Placements are written as strings: "R", "P" (Partial sum), "S<dim>",
several comma-separated for a 2-D mesh.
"""
from __future__ import annotations

import functools
import os
from datetime import timedelta

import torch
import torch.distributed as dist

import rope_ext

B, S, H, HK, D, R = 2, 6, 4, 2, 16, 12  # a partial rotary width: columns R..D pass through


def _randn(*shape, seed, dtype=torch.float64):
    """float64 unless asked: outputs are bitwise equal in any dtype, but the table gradients sum
    over batch and heads (and repeated positions), and a sharded sum adds in another order; in
    float64 that moves a sum of at most 24 terms of size < 50 by < 24 * 2^-53 * 1200 (3e-12), far
    below the 1e-10 the tests allow."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _tables(angles, layout):
    """Full-form half-split tables of angles (B or 1, S, R/2), shaped for x of the layout."""
    full = torch.cat((angles, angles), dim=-1)
    cos, sin = full.cos(), full.sin()
    return (cos[:, :, None], sin[:, :, None]) if layout == "bshd" else (cos[:, None], sin[:, None])


def _x(heads, seq, layout, seed):
    return _randn(B, seq, heads, D, seed=seed) if layout == "bshd" else _randn(B, heads, seq, D, seed=seed)


class Plain:
    """Runs a case on ordinary tensors: the unsharded result."""

    sharded = False

    def put(self, t, placements=None, grad=False, mesh=None):
        return t.clone().requires_grad_(grad)

    def full(self, t):
        return t

    def like(self, t, x):
        return t

    def placements(self, t):
        return None

    def compile(self, fn):
        return fn


class Sharded:
    """Runs a case on DTensors over a 1-D mesh of the world (or the 2-D mesh (world, 1))."""

    sharded = True

    def __init__(self):
        from torch.distributed.tensor import init_device_mesh

        world = dist.get_world_size()
        self.mesh = init_device_mesh("cpu", (world,))
        self.meshes = {
            None: self.mesh,
            "2d": init_device_mesh("cpu", (world, 1), mesh_dim_names=("a", "b")),
            "2d-inner": init_device_mesh("cpu", (1, world), mesh_dim_names=("c", "d")),  # the split on mesh dim 1
        }
        self.frames = None

    def put(self, t, placements="R", grad=False, mesh=None):
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

        mesh = self.meshes[mesh]
        parsed = [Replicate() if p == "R" else Partial() if p == "P" else Partial("max") if p == "Pmax"
                  else Shard(int(p[1:])) for p in placements.split(",")]
        if any(isinstance(p, Partial) for p in parsed):
            assert len(parsed) == 1
            # sum: each rank holds t / world (exact for world 2); max: each holds t
            return DTensor.from_local(t.clone() / (mesh.size() if placements == "P" else 1), mesh, parsed)
        return distribute_tensor(t.clone(), mesh, parsed).requires_grad_(grad)

    def full(self, t):
        return t.full_tensor()

    def like(self, t, x):
        """t distributed as x is (replicated where x is partial)."""
        from torch.distributed.tensor import Replicate, distribute_tensor

        placements = [Replicate() if p.is_partial() else p for p in x.placements]
        return distribute_tensor(t, x.device_mesh, placements)

    def placements(self, t):
        return ",".join("R" if p.is_replicate() else "P" if p.is_partial() else f"S{p.dim}" for p in t.placements)

    def compile(self, fn):
        from torch._dynamo.testing import CompileCounterWithBackend

        self.frames = CompileCounterWithBackend("aot_eager")
        return torch.compile(fn, backend=self.frames, fullgraph=True)


def _result(place, outs, rotated, others=()):
    """Backward of sum(out_i * w_i) (w_i placed like the rotated input), then everything gathered."""
    leaves = [t for t in (*rotated, *others) if t.requires_grad]
    if leaves:
        loss = sum((o * place.like(_randn(*o.shape, seed=90 + i, dtype=o.dtype), x)).sum()
                   for i, (o, x) in enumerate(zip(outs, rotated, strict=True)))
        loss.backward()
    return {
        "out": [place.full(o).detach() for o in outs],
        "grads": [place.full(t.grad) for t in leaves],
        "placements": [place.placements(o) for o in outs],
        "grad_placements": [place.placements(t.grad) for t in rotated if t.requires_grad],
    }


def rotary(place, x="S2", tables="R", layout="bshd", seq=S, per_batch=False, dtype=None, mesh=None,
           table_dims=4, grad=True):
    n = B if per_batch else 1
    cos, sin = _tables(_randn(n, seq, R // 2, seed=1), layout)
    if table_dims == 2:  # (S, r) tables for (B, H, S, D) x: fewer dims than x
        assert layout == "bhsd"
        cos, sin = cos[0, 0], sin[0, 0]
    grad = grad and dtype is None  # 16-bit x: the forward (float32 tables)
    if dtype is not None:
        cos, sin = cos.float(), sin.float()
    x_ = _x(H, seq, layout, seed=2)
    xs = place.put(x_ if dtype is None else x_.to(dtype), x, grad=grad and not x.startswith("P"), mesh=mesh)
    tg = grad and not tables.startswith("P")
    c, s = place.put(cos, tables, grad=tg, mesh=mesh), place.put(sin, tables, grad=tg, mesh=mesh)
    return _result(place, [rope_ext.rotary(xs, c, s)], [xs], [c, s])


def rotary_qk(place, q="S2", k="S2", tables="R", separate=False, k_tables=None, k_batchless=False, heads_k=HK,
              mesh=None):
    cos, sin = _tables(_randn(1, S, R // 2, seed=1), "bshd")
    k_ = _x(heads_k, S, "bshd", 3)[0] if k_batchless else _x(heads_k, S, "bshd", 3)  # (S, HK, D): fewer dims than q
    qs, ks = place.put(_x(H, S, "bshd", 2), q, grad=True, mesh=mesh), place.put(k_, k, grad=True, mesh=mesh)
    if mesh is not None:
        tables = ",".join("R" for _ in q.split(","))
    c, s = place.put(cos, tables, grad=True, mesh=mesh), place.put(sin, tables, grad=True, mesh=mesh)
    extra = {}
    if separate:  # k's own tables, as xPos uses
        ck, sk = (cos[0], sin[0]) if k_batchless else (cos, sin)
        k_tables = k_tables or tables
        extra = dict(cos_k=place.put(ck * 0.5, k_tables, grad=True), sin_k=place.put(sk * 0.5, k_tables, grad=True))
    outs = rope_ext.rotary_qk(qs, ks, c, s, **extra)
    return _result(place, list(outs), [qs, ks], [c, s, *extra.values()])


def _caches(max_pos=16):
    angles = _randn(max_pos, R // 2, seed=4)
    return angles.cos(), angles.sin()


def _positions(seq, per_batch):
    pos = torch.randperm(16, generator=torch.Generator().manual_seed(5))[:seq]  # any rows
    pos[-1] = pos[0]  # a repeated row: its cache gradient adds up
    return (torch.stack((pos, pos.flip(0))) if per_batch else pos)[..., None]  # (S, 1) or (B, S, 1)


def rotary_pos(place, x="S2", positions="R", caches="R", seq=S, per_batch=False):
    cc, sc = _caches()
    xs = place.put(_x(H, seq, "bshd", 2), x, grad=x != "P")
    c, s = place.put(cc, caches, grad=True), place.put(sc, caches, grad=True)
    p = place.put(_positions(seq, per_batch), positions)
    return _result(place, [rope_ext.rotary_pos(xs, c, s, p)], [xs], [c, s])


def rotary_pos_qk(place, q="S2", k="S2", positions="R"):
    cc, sc = _caches()
    qs, ks = place.put(_x(H, S, "bshd", 2), q, grad=True), place.put(_x(HK, S, "bshd", 3), k, grad=True)
    c, s = place.put(cc, "R", grad=True), place.put(sc, "R", grad=True)
    outs = rope_ext.rotary_pos_qk(qs, ks, c, s, place.put(_positions(S, False), positions))
    return _result(place, list(outs), [qs, ks], [c, s])


def qk_norm(place, q="S2", k="S2", tables="R", norm_over="head", positions=None, weight_after=False, norm="rms"):
    """qk_norm_rotary (qk_norm_rotary_pos with `positions`' placement) with both weights learned, and
    with norm="layer" both biases; norm_over="rows": per head, a row of each per head, (heads, D)."""
    wide, rows = norm_over == "heads", norm_over == "rows"

    def shape(n):
        return (n, D) if rows else (D * (n if wide else 1),)

    qs, ks = place.put(_x(H, S, "bshd", 2), q, grad=True), place.put(_x(HK, S, "bshd", 3), k, grad=True)
    wq = place.put(_randn(*shape(H), seed=6).abs() + 0.5, "R", grad=True)
    wk = place.put(_randn(*shape(HK), seed=7).abs() + 0.5, "R", grad=True)
    kw = dict(eps=1e-6, weight_offset=0.25, norm_over="head" if rows else norm_over, weight_after=weight_after,
              norm=norm)
    biases = []
    if norm == "layer":
        biases = [place.put(_randn(*shape(n), seed=seed), "R", grad=True) for n, seed in ((H, 8), (HK, 9))]
        kw.update(q_bias=biases[0], k_bias=biases[1])
    if positions is None:
        cos, sin = _tables(_randn(1, S, R // 2, seed=1), "bshd")
        c, s = place.put(cos, tables, grad=True), place.put(sin, tables, grad=True)
        outs = rope_ext.qk_norm_rotary(qs, ks, wq, wk, c, s, **kw)
    else:
        cc, sc = _caches()
        c, s = place.put(cc, "R", grad=True), place.put(sc, "R", grad=True)
        outs = rope_ext.qk_norm_rotary_pos(qs, ks, wq, wk, c, s, place.put(_positions(S, False), positions), **kw)
    return _result(place, list(outs), [qs, ks], [wq, wk, c, s, *biases])


def norm_one(place, x="S2", tables="R", norm_over="head", weight_after=False, norm="rms"):
    """norm_rotary (one tensor) with its weight learned, and with norm="layer" its bias."""
    wide = norm_over == "heads"
    xs = place.put(_x(H, S, "bshd", 2), x, grad=True)
    w = place.put(_randn(D * (H if wide else 1), seed=6).abs() + 0.5, "R", grad=True)
    b = place.put(_randn(D * (H if wide else 1), seed=8), "R", grad=True) if norm == "layer" else None
    cos, sin = _tables(_randn(1, S, R // 2, seed=1), "bshd")
    c, s = place.put(cos, tables, grad=True), place.put(sin, tables, grad=True)
    out = rope_ext.norm_rotary(xs, w, c, s, eps=1e-6, weight_offset=0.25, norm_over=norm_over,
                               weight_after=weight_after, norm=norm, bias=b)
    return _result(place, [out], [xs], [w, c, s] + ([b] if b is not None else []))


def qk_norm_inplace(place, q="S1", k="S1", positions="S0"):
    """qk_norm_rotary_pos_ on DTensors: q and k keep their placements, the weights are replicated."""
    cc, sc = _caches()
    qs, ks = place.put(_x(H, S, "bshd", 2), q), place.put(_x(HK, S, "bshd", 3), k)
    wq, wk = place.put(_randn(D, seed=6).abs() + 0.5), place.put(_randn(D, seed=7).abs() + 0.5)
    p = place.put(_positions(S, False), positions)
    rope_ext.qk_norm_rotary_pos_(qs, ks, wq, wk, place.put(cc), place.put(sc), p, eps=1e-6)
    return _result(place, [qs, ks], [qs, ks])


def rotary_inplace(place, x="S2", tables="R"):
    cos, sin = _tables(_randn(1, S, R // 2, seed=1), "bshd")
    xs = place.put(_x(H, S, "bshd", 2), x)
    rope_ext.rotary_(xs, place.put(cos, tables), place.put(sin, tables))
    return _result(place, [xs], [xs])


def rotary_pos_inplace(place, q="S2", k="S2", positions="R", mesh=None, k_heads=HK):
    cc, sc = _caches()
    qs, ks = place.put(_x(H, S, "bshd", 2), q, mesh=mesh), place.put(_x(k_heads, S, "bshd", 3), k, mesh=mesh)
    replicated = ",".join("R" for _ in positions.split(","))
    rope_ext.rotary_pos_(qs, ks, place.put(cc, replicated, mesh=mesh), place.put(sc, replicated, mesh=mesh),
                         place.put(_positions(S, False), positions, mesh=mesh))
    return _result(place, [qs, ks], [qs, ks])


def module(place, q="S2", k="S2", layout="bshd", offset=0, compiled=False, first_position=None, norm=False,
           **kwargs):
    """RotaryEmbedding on DTensors: default positions are the global ones, also for a q split over
    the sequence. first_position: explicit positions from there (plain, as the module's callers
    pass them). norm: with a QKNorm of plain weights (they enter the op replicated)."""
    rope = rope_ext.RotaryEmbedding(D, 5e5, rotary_dim=R, layout=layout, max_position_embeddings=64, **kwargs)
    qs, ks = place.put(_x(H, S, layout, 2), q, grad=True), place.put(_x(HK, S, layout, 3), k, grad=True)
    call = dict(offset=offset)
    if first_position is not None:
        call = dict(position_ids=torch.arange(first_position, first_position + S))
    if norm:
        call["norm"] = rope_ext.QKNorm(D, eps=1e-6, dtype=torch.float64)
    result = _result(place, list((place.compile(rope) if compiled else rope)(qs, ks, **call)), [qs, ks])
    if compiled and place.sharded:
        result["frames"] = (place.frames.frame_count, place.frames.op_count > 0)
    return result


def compiled(place):
    """A compiled function on DTensors calling both op families: one graph, no break."""
    cos, sin = _tables(_randn(1, S, R // 2, seed=1), "bshd")
    cc, sc = _caches()

    def attention_inputs(q, k, cos, sin, cc, sc, positions):
        q, k = rope_ext.rotary_qk(q, k, cos, sin)
        return rope_ext.rotary_pos_qk(q * 2, k, cc, sc, positions)

    fn = place.compile(attention_inputs)
    qs, ks = place.put(_x(H, S, "bshd", 2), "S1", grad=True), place.put(_x(HK, S, "bshd", 3), "S1", grad=True)
    outs = fn(qs, ks, place.put(cos, "S1"), place.put(sin, "S1"), place.put(cc), place.put(sc),
              place.put(_positions(S, False), "S0"))
    result = _result(place, list(outs), [qs, ks])
    if place.sharded:
        result["frames"] = (place.frames.frame_count, place.frames.op_count > 0)
    return result


def llama_tp(place):
    """One training step's loss and gradients of a tiny Llama. On DTensors: attention is tensor
    parallel over heads (q/k/v colwise with DTensor outputs, o rowwise), so rope_ext's patched
    apply_rotary_pos_emb rotates head-sharded DTensors by replicated DTensor tables; the plain run
    is the unpatched, unsharded model."""
    from distributed_workers import batch, tiny_llama

    from rope_ext.integrations import transformers as rope_hf

    model = tiny_llama()
    model.config._attn_implementation = "eager"  # DTensor has no rule for CPU flash attention
    ids = batch()
    if not place.sharded:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return {"out": [loss.detach()], "grads": [p.grad for p in model.parameters()], "calls": None}

    from conftest import RopeOpSpy
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {name: ColwiseParallel(use_local_output=False) for name in ("q_proj", "k_proj", "v_proj")}
    plan["o_proj"] = RowwiseParallel()
    for layer in model.model.layers:
        parallelize_module(layer.self_attn, place.mesh, plan)
    tables = PrepareModuleOutput(output_layouts=(Replicate(), Replicate()),
                                 desired_output_layouts=(Replicate(), Replicate()), use_local_output=False)
    parallelize_module(model.model.rotary_emb, place.mesh, tables)
    # implicit_replication: eager attention adds the (plain) causal mask to DTensor scores
    with rope_hf.patch(["llama"]), implicit_replication(), RopeOpSpy() as spy:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    calls = [(name, type(args[0]).__name__, place.placements(args[0])) for name, args in spy.calls]
    grads = [place.full(p.grad) if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    return {"out": [loss.detach()], "grads": grads, "calls": calls}


P = functools.partial
# name: (case, the output placements expected on DTensors)
CASES = {
    # x split over heads, sequence or batch; the tables follow (sharded with it, or broadcasting)
    "rotary/heads": (P(rotary, x="S2"), ["S2"]),
    "rotary/seq": (P(rotary, x="S1", tables="S1"), ["S1"]),
    "rotary/seq, tables replicated": (P(rotary, x="S1", tables="R"), ["S1"]),
    "rotary/seq, uneven": (P(rotary, x="S1", tables="S1", seq=7), ["S1"]),
    "rotary/batch, per-batch tables": (P(rotary, x="S0", tables="S0", per_batch=True), ["S0"]),
    "rotary/bhsd heads": (P(rotary, x="S1", layout="bhsd"), ["S1"]),
    "rotary/bhsd seq": (P(rotary, x="S2", tables="S2", layout="bhsd"), ["S2"]),
    "rotary/seq, bfloat16": (P(rotary, x="S1", tables="S1", dtype=torch.bfloat16), ["S1"]),
    "rotary/2-D mesh": (P(rotary, x="S1,S2", tables="S1,R", mesh="2d"), ["S1,S2"]),
    "rotary/2-D mesh, split on its inner dim": (P(rotary, x="S2,S1", tables="R,S1", mesh="2d-inner"), ["S2,S1"]),
    "rotary/bhsd seq, (S, r) tables": (P(rotary, x="S2", tables="S0", layout="bhsd", table_dims=2), ["S2"]),
    "rotary/seq of one token": (P(rotary, x="S1", tables="S1", seq=1), ["R"]),
    # what the op cannot keep is redistributed
    "rotary/x split on the rotated dim": (P(rotary, x="S3"), ["R"]),
    "rotary/x partial": (P(rotary, x="P"), ["R"]),
    "rotary/tables split on the rotary dim": (P(rotary, x="S2", tables="S3"), ["S2"]),
    "rotary/tables partial": (P(rotary, x="S2", tables="P"), ["S2"]),
    # (forward only: the tables' gradient multiplies the saved x, and DTensor's own ops refuse to mix
    # the max-partial x with the min-partial its negation makes; an error, not a wrong number)
    "rotary/x partial max": (P(rotary, x="Pmax", grad=False), ["R"]),
    "rotary/tables split on a broadcast dim": (P(rotary, x="S2", tables="S1"), ["S2"]),
    "rotary_qk/heads": (P(rotary_qk, q="S2", k="S2"), ["S2", "S2"]),
    "rotary_qk/seq": (P(rotary_qk, q="S1", k="S1", tables="S1"), ["S1", "S1"]),
    "rotary_qk/seq, separate k tables": (P(rotary_qk, q="S1", k="S1", tables="S1", separate=True), ["S1", "S1"]),
    "rotary_qk/q heads, k replicated": (P(rotary_qk, q="S2", k="R"), ["S2", "R"]),
    "rotary_qk/q seq, k heads": (P(rotary_qk, q="S1", k="S2", tables="S1"), ["R", "S2"]),
    # q's batch split alone would leave q and k differing in batch and heads: q is gathered
    "rotary_qk/GQA, q batch, k replicated": (P(rotary_qk, q="S0", k="R"), ["R", "R"]),
    # a 2-D mesh (whose second dim, of size 1, splits nothing: the rule's mesh-wide guarantee is
    # checked on a 2 x 2 mesh in test_dtensor.py)
    "rotary_qk/2-D mesh, q batch and heads, k replicated": (
        P(rotary_qk, q="S0,S2", k="R,R", mesh="2d", heads_k=H), None),
    "rotary_qk/k of fewer dims, own tables": (
        P(rotary_qk, q="S1", k="S0", tables="S1", separate=True, k_tables="S0", k_batchless=True), ["S1", "S0"]),
    "rotary_pos/heads": (P(rotary_pos, x="S2"), ["S2"]),
    "rotary_pos/seq": (P(rotary_pos, x="S1", positions="S0"), ["S1"]),
    "rotary_pos/seq, positions replicated": (P(rotary_pos, x="S1"), ["S1"]),
    "rotary_pos/seq, uneven": (P(rotary_pos, x="S1", positions="S0", seq=7), ["S1"]),
    "rotary_pos/batch, per-batch positions": (P(rotary_pos, x="S0", positions="S0", per_batch=True), ["S0"]),
    "rotary_pos/caches split": (P(rotary_pos, x="S2", caches="S0"), ["S2"]),
    "rotary_pos/x partial": (P(rotary_pos, x="P"), ["R"]),
    "rotary_pos_qk/heads": (P(rotary_pos_qk, q="S2", k="S2"), ["S2", "S2"]),
    "rotary_pos_qk/seq": (P(rotary_pos_qk, q="S1", k="S1", positions="S0"), ["S1", "S1"]),
    "rotary_pos_qk/GQA, q batch, k replicated": (P(rotary_pos_qk, q="S0", k="R"), ["R", "R"]),
    "qk_norm_rotary/heads": (P(qk_norm, q="S2", k="S2"), ["S2", "S2"]),
    "qk_norm_rotary/seq": (P(qk_norm, q="S1", k="S1", tables="S1"), ["S1", "S1"]),
    "qk_norm_rotary/across heads, batch": (P(qk_norm, q="S0", k="S0", norm_over="heads"), ["S0", "S0"]),
    "qk_norm_rotary/seq, weight after": (P(qk_norm, q="S1", k="S1", tables="S1", weight_after=True), ["S1", "S1"]),
    "qk_norm_rotary/seq, layer norm": (P(qk_norm, q="S1", k="S1", tables="S1", norm="layer"), ["S1", "S1"]),
    "qk_norm_rotary/seq, layer norm, rows per head": (
        P(qk_norm, q="S1", k="S1", tables="S1", norm="layer", norm_over="rows"), ["S1", "S1"]),
    "qk_norm_rotary_pos/heads, layer norm, weight after": (
        P(qk_norm, q="S2", k="S2", positions="R", norm="layer", weight_after=True), ["S2", "S2"]),
    "norm_rotary/heads": (P(norm_one, x="S2"), ["S2"]),
    "norm_rotary/across heads, batch, layer norm": (P(norm_one, x="S0", norm_over="heads", norm="layer"), ["S0"]),
    "norm_rotary/across heads, batch, weight after": (P(norm_one, x="S0", norm_over="heads", weight_after=True),
                                                      ["S0"]),
    "norm_rotary/across heads, seq": (P(norm_one, x="S1", tables="S1", norm_over="heads"), ["S1"]),
    "qk_norm_rotary_pos/seq": (P(qk_norm, q="S1", k="S1", positions="S0"), ["S1", "S1"]),
    "qk_norm_rotary_pos/across heads, seq": (P(qk_norm, q="S1", k="S1", positions="S0", norm_over="heads"),
                                             ["S1", "S1"]),
    "qk_norm_rotary_pos_/seq": (P(qk_norm_inplace, q="S1", k="S1", positions="S0"), ["S1", "S1"]),
    "qk_norm_rotary_pos_/heads": (P(qk_norm_inplace, q="S2", k="S2", positions="R"), ["S2", "S2"]),
    "rotary_/heads": (P(rotary_inplace, x="S2"), ["S2"]),
    "rotary_/seq, tables replicated": (P(rotary_inplace, x="S1"), ["S1"]),
    "rotary_pos_/heads": (P(rotary_pos_inplace, q="S2", k="S2"), ["S2", "S2"]),
    "rotary_pos_/seq": (P(rotary_pos_inplace, q="S1", k="S1", positions="S0"), ["S1", "S1"]),
    "rotary_pos_/q heads, k replicated": (P(rotary_pos_inplace, q="S2", k="R"), ["S2", "R"]),
    "rotary_pos_/2-D mesh": (
        P(rotary_pos_inplace, q="S1,S2", k="S1,S2", positions="S0,R", mesh="2d"), ["S1,S2", "S1,S2"]),
    "module/heads": (P(module, q="S2", k="S2"), ["S2", "S2"]),
    "module/seq, offset": (P(module, q="S1", k="S1", offset=5), ["S1", "S1"]),
    "module/bhsd seq": (P(module, q="S2", k="S2", layout="bhsd"), ["S2", "S2"]),
    "module/xPos seq (tables, not the cache)": (P(module, q="S1", k="S1", xpos_scale_base=64.0), ["S1", "S1"]),
    "module/compiled seq": (P(module, q="S1", k="S1", compiled=True), ["S1", "S1"]),
    # positions 61..66 with a cache of 64: only the second rank's share passes it; every rank
    # must grow the cache alike
    "module/seq, positions past the cache": (P(module, q="S1", k="S1", first_position=61), ["S1", "S1"]),
    "module/MQA-like: q heads, k replicated": (P(module, q="S2", k="R"), ["S2", "R"]),
    "module/seq, with a QK norm": (P(module, q="S1", k="S1", offset=2, norm=True), ["S1", "S1"]),
    "compiled": (compiled, ["S1", "S1"]),
}

# Cases that need transformers (tests/test_distributed.py), apart from the core cases.
EXTRA = {"llama tensor parallel": (llama_tp, None)}

# Calls refused: in-place ones whose written inputs cannot keep their placements, and a norm across
# heads over sharded heads; with the words the error must contain.
REFUSED = {
    "qk_norm_rotary/across heads, heads sharded": (
        P(qk_norm, q="S2", k="S2", norm_over="heads"), ["rope_ext.qk_norm_rotary", "q", "sharded over its heads"]),
    "qk_norm_rotary/rows per head, heads sharded": (
        P(qk_norm, q="S2", k="S2", norm_over="rows"),
        ["rope_ext.qk_norm_rotary", "q", "sharded over its heads", "q_weight, a row of weights per head"]),
    "rotary_/x split on the rotated dim": (P(rotary_inplace, x="S3"), ["rope_ext.rotary_", "x", "in-place"]),
    "rotary_pos_/k split on the rotated dim": (P(rotary_pos_inplace, q="S1", k="S3"), ["rope_ext.rotary_pos_", "k"]),
    "rotary_pos_/q seq, k heads": (P(rotary_pos_inplace, q="S1", k="S2"), ["rope_ext.rotary_pos_", "head count"]),
    "rotary_pos_/q seq, k replicated": (
        P(rotary_pos_inplace, q="S1", k="R", k_heads=H), ["rope_ext.rotary_pos_", "positions cannot be split"]),
    # DTensor pins only q's placement; k's is kept by offering one choice per q placement
    "rotary_pos_/2-D mesh, k ambiguous": (
        P(rotary_pos_inplace, q="R,R", k="S2,R", positions="R,R", mesh="2d"),
        ["rope_ext.rotary_pos_", "k", "mesh dims"],
    ),
}


def run_all(rank, world, port, out_path, names):
    """Worker: the named cases (of CASES, REFUSED and EXTRA) on DTensors; rank 0 saves {name: result,
    or the error as a string}."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        place = Sharded()
        results = {}
        every = {**CASES, **REFUSED, **EXTRA}
        for name in names:
            try:
                results[name] = every[name][0](place)
            except Exception as e:  # every rank raises alike: the sharding decision is the same
                results[name] = f"{type(e).__name__}: {e}"
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()
