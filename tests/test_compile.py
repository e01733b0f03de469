"""Registration quality: torch.library.opcheck, torch.compile (fullgraph, dynamic) and export."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from conftest import DTYPES, randn, rope_tables

import rope_ext

OP = torch.ops.rope_ext.rotary.default


def _samples():
    """Both conventions, partial r, strided layouts, broadcast tables, every dtype, with
    and without gradients."""
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for interleaved in (False, True):
            # HF layout: (B,H,S,D) view over (B,S,H,D), tables (1,1,S,r), partial rotary
            x = randn(2, 5, 3, 16, dtype=dtype, gen=gen).transpose(1, 2)
            cos, sin = rope_tables(torch.arange(5), 8, interleaved, dtype)
            yield (x, cos, sin, interleaved, False)
            # packed qkv slice (B,S,H,D) with per-batch float32 tables, conjugate
            qkv = randn(2, 4, 3, 2, 12, dtype=dtype, gen=gen)
            cos, sin = rope_tables(torch.arange(8).view(2, 4, 1), 12, interleaved, torch.float32)
            yield (qkv[:, :, 0], cos, sin, interleaved, True)
        # gradients, also for the tables
        x = randn(3, 2, 8, dtype=dtype, gen=gen).requires_grad_()
        cos, sin = rope_tables(torch.arange(3)[:, None], 8, False, dtype)
        yield (x, cos.requires_grad_(), sin.requires_grad_(), False, False)


def _sample_id(a):
    return f"{a[0].dtype}-{tuple(a[0].shape)}-i{int(a[3])}-c{int(a[4])}-g{int(a[0].requires_grad)}"


@pytest.mark.parametrize("args", list(_samples()), ids=_sample_id)
def test_opcheck(args):
    torch.library.opcheck(OP, args)


def _hf_block(q, k, cos, sin):
    """How a model uses the op: rotate q and k, then attention-like math."""
    q = rope_ext.rotary(q, cos, sin)
    k = rope_ext.rotary(k, cos, sin)
    return (q @ k.transpose(-1, -2)).softmax(-1)


def test_compile_fullgraph_matches_eager_fwd_and_bwd(gen):
    q = randn(2, 4, 9, 32, gen=gen).requires_grad_()
    k = randn(2, 4, 9, 32, gen=gen).requires_grad_()
    cos, sin = rope_tables(torch.arange(9), 32, False)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._inductor.compile(gm, example_inputs)

    compiled = torch.compile(_hf_block, fullgraph=True, backend=backend)
    out = compiled(q, k, cos, sin)
    ref = _hf_block(q, k, cos, sin)
    torch.testing.assert_close(out, ref)
    g_c = torch.autograd.grad(out.square().sum(), (q, k))
    g_e = torch.autograd.grad(ref.square().sum(), (q, k))
    for a, b in zip(g_c, g_e, strict=True):
        torch.testing.assert_close(a, b)
    # the graph holds the op itself, not a decomposition of it
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(OP) + targets.count(torch.ops.rope_ext.rotary) == 2, targets


def test_compile_dynamic_does_not_recompile_per_seq_len(gen):
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_hf_block, fullgraph=True, dynamic=True, backend=counter)
    for s in (5, 8, 13, 21):
        q, k = randn(1, 2, s, 16, gen=gen), randn(1, 2, s, 16, gen=gen)
        cos, sin = rope_tables(torch.arange(s), 16, False)
        torch.testing.assert_close(compiled(q, k, cos, sin), _hf_block(q, k, cos, sin))
    assert counter.frame_count == 1


def test_export_holds_the_op(gen):
    class Rope(torch.nn.Module):
        def forward(self, x, cos, sin):
            return rope_ext.rotary(x, cos, sin, interleaved=True)

    x = randn(2, 6, 4, 16, gen=gen)
    cos, sin = rope_tables(torch.arange(6)[:, None], 16, True)
    ep = torch.export.export(Rope(), (x, cos, sin))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert OP in targets
    torch.testing.assert_close(ep.module()(x, cos, sin), Rope()(x, cos, sin), rtol=0, atol=0)
