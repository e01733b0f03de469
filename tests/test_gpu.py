"""rope_ext on a real CUDA GPU: what host emulation cannot show. Run by `make gpu-check STEP=test`
(tools/gpu_check.sh, which sets ROPE_EXT_GPU_CHECK=1), together with the emulation suites re-pointed
at the real kernels (conftest.KernelsOn). Elsewhere the module is skipped whole, as one skip (no CUDA
call at import or collection); under gpu-check without a GPU each test skips.

The CPU kernel is the reference: both round each product and sum once (the CUDA build has
--fmad=false, and cuda-check finds no FFMA in its SASS), so every rotated element must be
bit-identical. Sums whose order differs between the devices (gradients of tables and caches, which
sum over rows) are held to the summation bound of tests/test_fuzz.py instead. Inputs reach the GPU
with their exact storage layout (conftest._twins), since x.to("cuda") makes a non-dense view
contiguous.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import CONVENTIONS, LAYOUTS, _twins, make_layout, randn, random_tables, tolerance

import rope_ext

if not os.environ.get("ROPE_EXT_GPU_CHECK"):
    pytest.skip("the GPU tests: run by make gpu-check (ROPE_EXT_GPU_CHECK=1)", allow_module_level=True)

ops = torch.ops.rope_ext
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def on(device, *tensors):
    """The tensors on `device` with their storage layouts (see conftest._twins), each requiring grad
    where its original does."""
    twins = _twins(tensors, device)[0]
    return [t.requires_grad_(o.requires_grad) for t, o in zip(twins, tensors, strict=True)]


def cpu(t):
    return _twins([t], "cpu")[0][0]


def assert_same_bits(gpu, ref, what=""):
    got = cpu(gpu)
    assert got.dtype == ref.dtype and got.shape == ref.shape, what
    assert torch.equal(got, ref) or torch.equal(got.isnan(), ref.isnan()) and torch.equal(
        got.nan_to_num(), ref.nan_to_num()), what


def assert_sums_close(gpu, ref, n_rows, what=""):
    """A table's or cache's gradient: per entry, a sum over the n_rows rows that read it of two
    products x * g (|x| <= 8, |g| <= 1.25 here), added in another order on each device. Each
    result is within gamma(2 n + 2) * A of the exact sum (tests/test_fuzz.py's bound), A <= 2 n * 10
    the sum of the products' magnitudes; so the two are within twice that."""
    got = cpu(gpu).double()
    u = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}[ref.dtype]
    k = 2 * n_rows + 2
    bound = 2 * (k * u / (1 - k * u)) * (2 * n_rows * 10.0)
    assert got.shape == ref.shape and (got - ref.double()).abs().max() <= bound, what


# --- every op, forward and backward, against the CPU kernel ----------------------------------

B, S, H, HK, D = 2, 7, 4, 2, 128
DIMS = {"full": 128, "partial_64": 64, "scalar_40": 40}  # 40: 20 pairs, not whole 16-byte vectors


def _tables(r, interleaved, table_dtype, gen, shape=(S, 1)):
    cos, sin = random_tables((*shape, r), table_dtype, gen)
    return cos, sin


def _caches(r, table_dtype, rows=64):
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(0, r, 2, dtype=torch.float64) / r)
    return angles.cos().to(table_dtype), angles.sin().to(table_dtype)


def _positions(index_dtype, gen, rows=64):
    return torch.randint(0, rows, (B, S, 1), generator=gen, dtype=torch.int64).to(index_dtype)


def _grad_pair(op_name, args, kw, grads_of):
    """(outputs, gradients of grads_of) for one call of the public op with a fixed upstream gradient."""
    fn = getattr(rope_ext, op_name)
    out = fn(*args, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    g = [torch.ones_like(o).mul_(0.5).add_(torch.arange(o.numel(), device=o.device).view(o.shape) % 7 / 8)
         for o in outs]
    grads = torch.autograd.grad(outs, grads_of, g, allow_unused=True)
    return [o.detach() for o in outs], grads


@pytest.mark.parametrize("layout", ["bshd", "hf_view", "qkv_slice", "padded", "strided_cols"])
@pytest.mark.parametrize("dims", DIMS.values(), ids=DIMS.keys())
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_full_table_ops_forward_backward_bitwise(cuda, dtype, interleaved, dims, layout, gen):
    """rotary, rotary_qk (GQA), rotary_: outputs and x's gradients bit-identical to the CPU kernel;
    the tables' gradients within the summation bound (float32/float64 tables)."""
    r = dims
    x, to_layout = make_layout(layout, B, S, H, D, dtype, gen)
    k, _ = make_layout(layout, B, S, HK, D, dtype, gen)
    for table_dtype in {dtype, torch.float32}:
        cos, sin = (to_layout(t) for t in _tables(r, interleaved, table_dtype, gen, (B, S, 1)))
        learn = table_dtype in (torch.float32, torch.float64)
        for conjugate in (False, True):
            kw = dict(interleaved=interleaved, conjugate=conjugate)
            # rotary
            xc, cc, sc = (t.detach().requires_grad_(t.is_floating_point() and (t is x or learn)) for t in (x, cos, sin))
            xg, cg, sg = on(cuda, xc, cc, sc)
            want = _grad_pair("rotary", (xc, cc, sc), kw, (xc, cc, sc) if learn else (xc,))
            got = _grad_pair("rotary", (xg, cg, sg), kw, (xg, cg, sg) if learn else (xg,))
            assert_same_bits(got[0][0], want[0][0], "rotary out")
            assert_same_bits(got[1][0], want[1][0], "rotary dx")
            if learn:
                for a, b in zip(got[1][1:], want[1][1:], strict=True):
                    assert_sums_close(a, b, B * H, "rotary dcos/dsin")
            # rotary_qk: k in the same layout with its own head count (GQA)
            q2, k2 = (t.detach().requires_grad_() for t in (x, k))
            qg, kg = on(cuda, q2, k2)
            want = _grad_pair("rotary_qk", (q2, k2, cos, sin), kw, (q2, k2))
            got = _grad_pair("rotary_qk", (qg, kg, *on(cuda, cos, sin)), kw, (qg, kg))
            for a, b, what in zip(got[0] + list(got[1]), want[0] + list(want[1]), ("q", "k", "dq", "dk"), strict=True):
                assert_same_bits(a, b, f"rotary_qk {what}")
            # rotary_ in place, on a copy of the layout's whole storage
            (y,) = on("cpu", x)
            (yg,) = on(cuda, x)
            rope_ext.rotary_(y, cos, sin, **kw)
            rope_ext.rotary_(yg, *on(cuda, cos, sin), **kw)
            assert_same_bits(yg, y, "rotary_")


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("layout", ["bshd", "hf_view", "qkv_slice", "strided_cols"])
@pytest.mark.parametrize("dims", DIMS.values(), ids=DIMS.keys())
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gathered_ops_forward_backward_bitwise(cuda, dtype, interleaved, dims, layout, index_dtype, gen):
    """rotary_pos, rotary_pos_qk (GQA), rotary_pos_: outputs and x's gradients bit-identical to the
    CPU kernel, and the caches' gradients (repeated positions sum) within the summation bound."""
    r = dims
    x, to_layout = make_layout(layout, B, S, H, D, dtype, gen)
    k, _ = make_layout(layout, B, S, HK, D, dtype, gen)
    pos = to_layout(_positions(index_dtype, gen))
    for table_dtype in {dtype, torch.float32}:
        cc, sc = _caches(r, table_dtype)
        learn = table_dtype in (torch.float32, torch.float64)
        for conjugate in (False, True):
            kw = dict(interleaved=interleaved, conjugate=conjugate)
            xc, ccc, scc = (t.detach().requires_grad_(t is x or learn) for t in (x, cc, sc))
            xg, ccg, scg = on(cuda, xc, ccc, scc)
            (pg,) = on(cuda, pos)
            want = _grad_pair("rotary_pos", (xc, ccc, scc, pos), kw, (xc, ccc, scc) if learn else (xc,))
            got = _grad_pair("rotary_pos", (xg, ccg, scg, pg), kw, (xg, ccg, scg) if learn else (xg,))
            assert_same_bits(got[0][0], want[0][0], "rotary_pos out")
            assert_same_bits(got[1][0], want[1][0], "rotary_pos dx")
            if learn:
                for a, b in zip(got[1][1:], want[1][1:], strict=True):
                    assert_sums_close(a, b, B * S * H, "rotary_pos dcache")
            q2, k2 = (t.detach().requires_grad_() for t in (x, k))
            qg, kg = on(cuda, q2, k2)
            want = _grad_pair("rotary_pos_qk", (q2, k2, cc, sc, pos), kw, (q2, k2))
            got = _grad_pair("rotary_pos_qk", (qg, kg, *on(cuda, cc, sc), pg), kw, (qg, kg))
            for a, b, what in zip(got[0] + list(got[1]), want[0] + list(want[1]), ("q", "k", "dq", "dk"), strict=True):
                assert_same_bits(a, b, f"rotary_pos_qk {what}")
            y, yk = on("cpu", x, k)
            yg, ykg = on(cuda, x, k)
            rope_ext.rotary_pos_(y, yk, cc, sc, pos, **kw)
            rope_ext.rotary_pos_(yg, ykg, *on(cuda, cc, sc), pg, **kw)
            assert_same_bits(yg, y, "rotary_pos_ q")
            assert_same_bits(ykg, yk, "rotary_pos_ k")


def _differentiable_calls(device, gen, dtype=torch.float64):
    """One small call of each out-of-place op, on float64 inputs for gradcheck."""
    x = randn(2, 3, 2, 8, dtype=dtype, gen=gen).to(device)
    k = randn(2, 3, 1, 8, dtype=dtype, gen=gen).to(device)
    cos, sin = (t.to(device) for t in random_tables((3, 1, 6), dtype, gen))
    cc, sc = (t.to(device) for t in random_tables((5, 3), dtype, gen))
    pos = torch.tensor([[0, 4, 4], [2, 0, 1]], device=device)[..., None]  # repeated positions
    return {
        "rotary": (lambda x, c, s: rope_ext.rotary(x, c, s), (x, cos, sin)),
        "rotary_qk": (lambda x, k, c, s: rope_ext.rotary_qk(x, k, c, s, interleaved=True), (x, k, cos, sin)),
        "rotary_pos": (lambda x, c, s: rope_ext.rotary_pos(x, c, s, pos), (x, cc, sc)),
        "rotary_pos_qk": (lambda x, k, c, s: rope_ext.rotary_pos_qk(x, k, c, s, pos, interleaved=True), (x, k, cc, sc)),
    }


@pytest.mark.parametrize("op", ["rotary", "rotary_qk", "rotary_pos", "rotary_pos_qk"])  # (the in-place ops record no
def test_gradcheck_and_gradgradcheck_float64_on_cuda(cuda, op, gen):                   # gradient: refused by name)
    fn, args = _differentiable_calls(cuda, gen)[op]
    args = tuple(a.detach().requires_grad_() for a in args)
    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradgradcheck(fn, args)


def test_opcheck_every_op_on_cuda(cuda, gen):
    x = randn(2, 6, 4, 32, gen=gen).to(cuda).transpose(1, 2)
    k = randn(2, 6, 1, 32, gen=gen).to(cuda).transpose(1, 2)
    cos, sin = (t.to(cuda) for t in random_tables((6, 16), torch.float32, gen))
    cc, sc = (t.to(cuda) for t in random_tables((16, 8), torch.float32, gen))
    pos = torch.randint(0, 16, (2, 1, 6), generator=gen).to(cuda)
    for requires_grad in (False, True):
        xr = x.detach().requires_grad_(requires_grad)
        torch.library.opcheck(ops.rotary.default, (xr, cos, sin, False, False))
        torch.library.opcheck(ops.rotary_qk.default, (xr, k, cos, sin, True, None, None, False))
        torch.library.opcheck(ops.rotary_pos.default, (xr, cc, sc, pos, False, False))
        torch.library.opcheck(ops.rotary_pos_qk.default, (xr, k, cc, sc, pos, True, False))
    torch.library.opcheck(ops.rotary_.default, (x.clone(), cos, sin, False, False))
    torch.library.opcheck(ops.rotary_pos_.default, (x.clone(), k.clone(), cc, sc, pos, False, False))


# --- the module, on the device -------------------------------------------------------------------

MODULES = {
    "default": dict(),
    "linear": dict(scaling={"rope_type": "linear", "factor": 4.0}),
    "dynamic": dict(scaling={"rope_type": "dynamic", "factor": 2.0}),
    "yarn": dict(scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}),
    "llama3": dict(scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}),
    "longrope": dict(scaling={"rope_type": "longrope", "original_max_position_embeddings": 64,
                              "short_factor": [1.0 + i / 32 for i in range(32)],
                              "long_factor": [2.0 + i / 16 for i in range(32)]}),
    "proportional": dict(scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0}),
    "xpos": dict(xpos_scale_base=512.0),
    "mrope": dict(mrope_section=[8, 12, 12]),
    "interleaved_partial": dict(interleaved=True, rotary_dim=32),
}


def _module_calls(device, mrope, gen):
    """(name, q, k, kwargs) for every way of giving positions, on `device` (the same values each
    time: the generator is reseeded)."""
    g = torch.Generator().manual_seed(11)
    q, k = randn(2, 8, 6, 64, dtype=torch.bfloat16, gen=g), randn(2, 2, 6, 64, dtype=torch.bfloat16, gen=g)
    pq, pk = randn(9, 8, 64, gen=g), randn(9, 2, 64, gen=g)
    ids = torch.randint(0, 300, (3, 2, 6) if mrope else (2, 6), generator=g)
    calls = [("position_ids", q, k, dict(position_ids=ids)), ("int_offset", q, k, dict(offset=70)),
             ("row_offsets", q, k, dict(offset=torch.tensor([3, 200])))]
    if not mrope:
        calls.append(("cu_seqlens", pq, pk, dict(cu_seqlens=torch.tensor([0, 4, 4, 9], dtype=torch.int32))))
    moved = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return [(n, q.to(device), k.to(device), {key: moved(v) for key, v in kw.items()}) for n, q, k, kw in calls]


@pytest.mark.parametrize("module", MODULES.values(), ids=MODULES.keys())
def test_module_on_cuda_matches_the_cpu_module(cuda, module, gen):
    """Every rope type, xPos, M-RoPE and position form: the GPU module against the CPU module. The
    caches are built on each device (float64 cos/sin, libdevice vs the CPU's libm: an entry may
    differ by one float32 ulp, counted here), so outputs are held to the dtype's tolerance; with
    the CPU module's caches copied in, the cached paths must be bit-identical. A forward never waits
    for the device (set_sync_debug_mode('error')), and a second call with the same position tensor
    (the module's positions memo) gives the same result."""
    mrope = "mrope_section" in module
    # (512 positions: every position below covered, since a GPU position past the cache is a device-side
    # assert that would end this process's CUDA context; the CPU module would grow instead)
    ref = rope_ext.RotaryEmbedding(64, layout="bhsd", max_position_embeddings=512, **module)
    dev = rope_ext.RotaryEmbedding(64, layout="bhsd", max_position_embeddings=512, **module).to(cuda)
    calls = zip(_module_calls("cpu", mrope, gen), _module_calls(cuda, mrope, gen), strict=True)
    for (name, q, k, kw), (_, qg, kg, kwg) in calls:
        want = ref(q, k, **kw)
        dev(qg, kg, **kwg)  # may grow the cache (int offsets: host-known)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = dev(qg, kg, **kwg)
            again = dev(qg, kg, **kwg)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for a, b, c in zip(got, want, again, strict=True):
            torch.testing.assert_close(cpu(a), b, **tolerance(b.dtype), msg=name)
            assert torch.equal(a, c), name
        if dev.cos_cache.numel() and dev.cos_cache.shape == ref.cos_cache.shape:
            mismatches = int((cpu(dev.cos_cache) != ref.cos_cache).sum() + (cpu(dev.sin_cache) != ref.sin_cache).sum())
            assert mismatches <= max(4, ref.cos_cache.numel() // 10**6), (name, mismatches)
            dev.cos_cache.copy_(ref.cos_cache)
            dev.sin_cache.copy_(ref.sin_cache)
            # (dynamic NTK builds its tables per call for device positions: the int offset alone reads the cache)
            if name == "int_offset" or module.get("scaling", {}).get("rope_type") != "dynamic":
                for a, b in zip(dev(qg, kg, **kwg), ref(q, k, **kw), strict=True):
                    assert_same_bits(a, b, f"{name} with the CPU's caches")


# --- the drop-ins --------------------------------------------------------------------------------


def test_every_drop_in_on_cuda_matches_the_cpu(cuda, gen):
    from rope_ext.compat import flash_attn, hf, lucidrains, meta, mlx, vllm

    q, k = randn(2, 16, 4, 64, gen=gen), randn(2, 16, 2, 64, gen=gen)  # (B, S, H, D)
    cos, sin = random_tables((16, 32), torch.float32, gen)
    pos = torch.randint(0, 16, (2, 16), generator=gen)

    def both(fn, *args, **kw):
        want = fn(*args, **kw)
        got = fn(*on(cuda, *args), **kw) if args else fn(**kw)
        return got, want

    cases = {
        "flash_attn.apply_rotary_emb": both(flash_attn.apply_rotary_emb, q, cos, sin),
        "flash_attn.apply_rotary_emb offsets": both(
            lambda x, c, s, o: flash_attn.apply_rotary_emb(x, c[:8], s[:8], seqlen_offsets=o), q[:, :4], cos, sin,
            torch.tensor([0, 4])),
        "hf.apply_rotary_pos_emb": both(hf.apply_rotary_pos_emb, q.transpose(1, 2), k.transpose(1, 2),
                                        torch.cat((cos, cos), -1)[pos], torch.cat((sin, sin), -1)[pos]),
        "meta.apply_rotary_emb": both(meta.apply_rotary_emb, q, k,
                                      meta.precompute_freqs_cis(64, 16)),
        "mlx.rope": both(lambda a: mlx.rope(a, 64, traditional=False, base=10000.0, scale=1.0, offset=3),
                         q.transpose(1, 2)),
    }
    for name, (got, want) in cases.items():
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for a, b in zip(got, want, strict=True):
            assert_same_bits(a, b, name)
    # the modules: flash-attn's (in place on packed qkv) and lucidrains'
    # Each device builds flash-attn's tables with its own cos and sin, which differ by an ulp
    # (CUDA's and the CPU's libm), so the module's result on each is compared to a tolerance, and the
    # rotation with the CPU's tables given to the GPU module bit for bit.
    fa, fa_gpu = flash_attn.RotaryEmbedding(32), flash_attn.RotaryEmbedding(32, device=cuda)
    qkv = randn(2, 16, 3, 4, 64, gen=gen)
    (qkv_gpu,) = on(cuda, qkv)
    want = fa(qkv.clone())
    torch.testing.assert_close(cpu(fa_gpu(qkv_gpu.clone())), want, **tolerance(torch.float32))
    fa_gpu._cos_cached, fa_gpu._sin_cached = on(cuda, fa._cos_cached, fa._sin_cached)
    assert_same_bits(fa_gpu(qkv_gpu), want, "flash_attn.RotaryEmbedding")
    lr = lucidrains.RotaryEmbedding(32)
    lr_gpu = lucidrains.RotaryEmbedding(32).to(cuda)
    t = randn(2, 4, 16, 64, gen=gen)
    torch.testing.assert_close(cpu(lr_gpu.rotate_queries_or_keys(t.to(cuda))), lr.rotate_queries_or_keys(t),
                               **tolerance(torch.float32))
    # vLLM's op: in place on a flattened (T, H * D) query and key with a cat(cos, sin) cache
    cache = torch.cat(random_tables((32, 32), torch.float32, gen), -1)
    positions = torch.randint(0, 32, (10,), generator=gen)
    query, key = randn(10, 4 * 64, gen=gen), randn(10, 2 * 64, gen=gen)
    qg, kg, pg, cg = on(cuda, query, key, positions, cache)
    vllm.rotary_embedding(positions, query, key, 64, cache, True)
    vllm.rotary_embedding(pg, qg, kg, 64, cg, True)
    assert_same_bits(qg, query, "vllm query")
    assert_same_bits(kg, key, "vllm key")


# --- transformers: a tiny patched model against the stock one ----------------------------------


def _tiny_llama(cuda):
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return T.AutoModelForCausalLM.from_config(config).float().to(cuda)


def test_patched_transformers_model_on_cuda(cuda):
    from conftest import RopeOpSpy

    from rope_ext.integrations import transformers as rope_hf

    model = _tiny_llama(cuda)
    ids = torch.randint(1, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(cuda)

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # (parity within one device, TF32 off)
    try:
        ref_logits, ref_grads = fwd_bwd()
        kwargs = dict(max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
        with torch.no_grad():
            ref_tokens = model.generate(ids[:, :7], **kwargs)
        with rope_hf.patch(["llama"]) as patched, RopeOpSpy() as spy:
            assert patched == ["llama"]
            logits, grads = fwd_bwd()
            with torch.no_grad():
                tokens = model.generate(ids[:, :7], **kwargs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert any(n.startswith("rotary") for n in spy.names)
    assert torch.equal(logits, ref_logits)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)
    assert torch.equal(tokens, ref_tokens)


# --- compile, CUDA graphs -------------------------------------------------------------------------


def test_compiled_module_with_inductor_on_cuda(cuda, gen):
    """torch.compile(fullgraph=True) with Inductor: forward and backward equal eager; one graph."""
    import torch._dynamo.testing

    rope = rope_ext.RotaryEmbedding(128, layout="bhsd", max_position_embeddings=512).to(cuda)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(lambda q, k, p: [t.sum() for t in rope(q, k, position_ids=p)], fullgraph=True,
                             backend=counter)
    for seq in (16, 33):
        q = randn(2, 8, seq, 128, dtype=torch.bfloat16, gen=gen).to(cuda).requires_grad_()
        k = randn(2, 2, seq, 128, dtype=torch.bfloat16, gen=gen).to(cuda).requires_grad_()
        p = torch.randint(0, 512, (2, seq), generator=gen).to(cuda)
        got = compiled(q, k, p)
        gq, gk = torch.autograd.grad(sum(got), (q, k))
        want = [t.sum() for t in rope(q, k, position_ids=p)]
        wq, wk = torch.autograd.grad(sum(want), (q, k))
        assert torch.equal(gq, wq) and torch.equal(gk, wk)
    assert counter.frame_count <= 2  # (a second frame: the dynamic-shape recompile for a new length)


@pytest.mark.parametrize("module", MODULES.values(), ids=MODULES.keys())
def test_cuda_graph_capture_and_replay_of_the_module(cuda, module, gen):
    """The module's forward captured in a CUDA graph with static position buffers, replayed after
    new positions are copied in, equals eager: nothing in it syncs or allocates unsafely."""
    mrope = "mrope_section" in module
    rope = rope_ext.RotaryEmbedding(64, layout="bhsd", max_position_embeddings=512, **module).to(cuda)
    q, k = randn(2, 8, 6, 64, gen=gen).to(cuda), randn(2, 2, 6, 64, gen=gen).to(cuda)
    shape = (3, 2, 6) if mrope else (2, 6)
    static_pos = torch.randint(0, 512, shape, generator=gen).to(cuda)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            rope(q, k, position_ids=static_pos)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rope(q, k, position_ids=static_pos)
    for _ in range(3):
        static_pos.copy_(torch.randint(0, 512, shape, generator=gen).to(cuda))
        graph.replay()
        want = rope(q, k, position_ids=static_pos)
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


def test_graph_replay_after_the_cache_grows_reads_live_buffers(cuda, gen):
    """H7: a graph captured before the cache grows keeps reading the old buffers, which the module
    keeps alive: replaying after an eager call grew the cache and 1 GB was allocated and NaN-filled
    still gives the eager result for the captured positions."""
    rope = rope_ext.RotaryEmbedding(128, layout="bshd", max_position_embeddings=64).to(cuda)
    q, k = randn(1, 4, 8, 128, gen=gen).to(cuda), randn(1, 4, 2, 128, gen=gen).to(cuda)
    pos = torch.randint(0, 64, (1, 4), generator=gen).to(cuda)
    rope(q, k, position_ids=pos)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rope(q, k, position_ids=pos)
    want = [t.clone() for t in rope(q, k, position_ids=pos)]
    captured = {rope.cos_cache.data_ptr(), rope.sin_cache.data_ptr()}
    rope(q, k, offset=100)  # grows the cache
    kept = {t.data_ptr() for old in rope._retired_caches for t in old}
    assert captured <= kept and rope.cos_cache.data_ptr() not in captured
    # Blocks of the old caches' size (the allocator's small pool, where freed ones would be reused)
    # and 1 GB, all NaN: a replay reading freed memory would read these.
    fillers = [torch.full_like(rope.cos_cache[:64], float("nan")) for _ in range(256)]
    fillers.append(torch.full((1 << 28,), float("nan"), device=cuda))
    graph.replay()
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    del fillers


def _decode_step_eager_and_replayed(model, cuda):
    """A tiny Llama's decode step at position 8 (static KV cache, after an 8-token prefill), run
    eagerly and then captured in a CUDA graph and replayed: (eager logits, replayed logits)."""
    T = pytest.importorskip("transformers")
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(5)).to(cuda)
    with torch.no_grad():
        cache = T.StaticCache(config=model.config, max_cache_len=32)
        model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(8, device=cuda))
        token = torch.ones(2, 1, dtype=torch.long, device=cuda)
        where = torch.tensor([8], device=cuda)
        eager = model(input_ids=token, past_key_values=cache, cache_position=where).logits.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(input_ids=token, past_key_values=cache, cache_position=where)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(input_ids=token, past_key_values=cache, cache_position=where).logits
        graph.replay()
        torch.cuda.synchronize()
    return eager, logits.clone()


def test_cuda_graph_of_a_patched_model_decode_step(cuda):
    """A patched tiny Llama's decode step, captured and replayed, gives what the unpatched model's
    gives under the same capture, and replays as the unpatched one does: rope_ext adds no difference
    between a CUDA graph and eager. (The unpatched model is the control: a gap between its own eager
    and replayed steps is transformers', and shows here as the same gap on both sides.)"""
    from rope_ext.integrations import transformers as rope_hf

    model = _tiny_llama(cuda).eval()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        plain_eager, plain_replayed = _decode_step_eager_and_replayed(model, cuda)
        with rope_hf.patch(["llama"]):
            eager, replayed = _decode_step_eager_and_replayed(model, cuda)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32

    def gap(a, b):
        return f"{(a - b).abs().max().item():.3g}"

    report = (f"max |difference|: patched eager vs replayed {gap(eager, replayed)}, unpatched eager vs "
              f"replayed {gap(plain_eager, plain_replayed)}, patched vs unpatched eager "
              f"{gap(eager, plain_eager)}, replayed {gap(replayed, plain_replayed)}")
    print(report)
    # float32 logits through two layers: rope_ext's rotation and HF's differ by a few ulps of the
    # rotated q and k (HF rounds cos*x and sin*rotate_half(x) separately), ~1e-6 relative after the
    # model's matmuls.
    torch.testing.assert_close(eager, plain_eager, rtol=1e-5, atol=1e-5, msg=report)
    torch.testing.assert_close(replayed, plain_replayed, rtol=1e-5, atol=1e-5, msg=report)
    assert torch.equal(replayed, eager) == torch.equal(plain_replayed, plain_eager), report


def test_in_place_ops_under_reduce_overhead_do_not_skip_cudagraphs(cuda, gen):
    from torch._dynamo.utils import counters

    cc, sc = (t.to(cuda) for t in _caches(64, torch.float32))
    counters.clear()

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(q, k, pos):
        rope_ext.rotary_pos_(q, k, cc, sc, pos)
        return q.sum() + k.sum()

    q, k = randn(4, 8, 64, gen=gen).to(cuda), randn(4, 2, 64, gen=gen).to(cuda)
    pos = torch.arange(4, device=cuda)[:, None]
    for t in (q, k):  # (buffers that live across steps, as a KV cache does: cudagraphs may write them)
        torch._dynamo.mark_static_address(t)
    for _ in range(3):
        step(q, k, pos)
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])


# --- streams, devices, sizes ----------------------------------------------------------------------


def test_a_call_on_a_side_stream_is_ordered_on_that_stream(cuda, gen):
    cc, sc = (t.to(cuda) for t in _caches(128, torch.float32))
    src = randn(64, 32, 128, gen=gen).to(cuda)
    pos = torch.arange(64, device=cuda)[:, None] % 64
    want = rope_ext.rotary_pos(src, cc, sc, pos)
    s = torch.cuda.Stream()
    x = torch.zeros_like(src)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # the producer: a long kernel on s, then the copy
        x.copy_(src)
        out = rope_ext.rotary_pos(x, cc, sc, pos)
    s.synchronize()
    assert torch.equal(out, want)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_a_device_other_than_the_current_one(cuda, gen):
    x = randn(2, 5, 4, 64, gen=gen)
    cos, sin = random_tables((5, 1, 64), torch.float32, gen)
    with torch.cuda.device(0):
        got = rope_ext.rotary(x.to("cuda:1"), cos.to("cuda:1"), sin.to("cuda:1"))
    assert got.device == torch.device("cuda:1") and torch.equal(got.cpu(), rope_ext.rotary(x, cos, sin))


@pytest.mark.gpu_large
def test_more_than_2_pow_31_elements(cuda):
    """x of 2^31 + 128 bfloat16 elements (4 GiB), int32 positions: rows on both sides of element
    2^31 and at the end equal the CPU kernel on the same rows."""
    tokens = (1 << 24) + 1
    x = torch.empty(tokens, 1, 128, dtype=torch.bfloat16, device=cuda).normal_()
    pos = (torch.arange(tokens, device=cuda, dtype=torch.int32) % 4096)[:, None]
    cc, sc = (t.to(cuda) for t in _caches(128, torch.float32, rows=4096))
    out = rope_ext.rotary_pos(x, cc, sc, pos)
    for rows in (slice(0, 4), slice((1 << 24) - 3, (1 << 24) + 1)):
        want = rope_ext.rotary_pos(x[rows].cpu(), cc.cpu(), sc.cpu(), pos[rows].cpu())
        assert torch.equal(out[rows].cpu(), want)


@pytest.mark.gpu_large
def test_more_than_2_pow_31_tokens_and_the_head_loop(cuda):
    """H10: 2^31 + 65 tokens of (2,) float16 (the grid's token loop past gridDim.x), and 2^25 heads
    of one token (the head loop past grid_y * block_y), against the CPU kernel on sampled rows."""
    n = (1 << 31) + 65
    x = torch.empty(n, 2, dtype=torch.float16, device=cuda).uniform_(-1, 1)
    pos = torch.empty(n, dtype=torch.int32, device=cuda)
    for start in range(0, n, 1 << 28):  # (an int32 arange of n elements overflows)
        stop = min(n, start + (1 << 28))
        pos[start:stop].copy_(torch.arange(start, stop, device=cuda).remainder_(16))
    cc, sc = (t.to(cuda) for t in _caches(2, torch.float32, rows=16))
    out = rope_ext.rotary_pos(x, cc, sc, pos)
    for rows in (slice(0, 5), slice((1 << 31) - 3, (1 << 31) + 4), slice(n - 5, n)):
        assert torch.equal(out[rows].cpu(), rope_ext.rotary_pos(x[rows].cpu(), cc.cpu(), sc.cpu(), pos[rows].cpu()))
    del x, pos, out
    heads = torch.empty(1, 1 << 25, 2, dtype=torch.float32, device=cuda).uniform_(-1, 1)
    out = rope_ext.rotary_pos(heads, cc, sc, torch.tensor([[5]], device=cuda))
    for rows in (slice(0, 3), slice((1 << 25) - 3, 1 << 25)):
        want = rope_ext.rotary_pos(heads[:, rows].cpu(), cc.cpu(), sc.cpu(), torch.tensor([[5]]))
        assert torch.equal(out[:, rows].cpu(), want)


_PAST_THE_CACHE = textwrap.dedent("""
    import ctypes, sys, torch, rope_ext
    op, index_dtype, bad = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3])
    cc, sc = torch.randn(16, 64, device="cuda"), torch.randn(16, 64, device="cuda")
    q = torch.randn(1, 32, 4, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 32, 2, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([[bad]], device="cuda", dtype=index_dtype).expand(1, 32)[..., None]
    try:  # (with CUDA_LAUNCH_BLOCKING=1 the error is raised by the call itself)
        if op == "rotary_pos":
            rope_ext.rotary_pos(q, cc, sc, pos)
        elif op == "rotary_pos_qk":
            rope_ext.rotary_pos_qk(q, k, cc, sc, pos)
        elif op == "rotary_pos_":
            rope_ext.rotary_pos_(q, k, cc, sc, pos)
        else:
            rope = rope_ext.RotaryEmbedding(128, layout="bshd", max_position_embeddings=16).cuda()
            rope(q, k, position_ids=pos[..., 0])
        torch.cuda.synchronize()
    except RuntimeError as e:
        # The kernel's printf reached C's stdout buffer by now: flushed before anything that could
        # abort the process and lose it (stdout is a pipe here, so block-buffered).
        ctypes.CDLL(None).fflush(None)
        print("RAISED AT SYNC:", str(e).splitlines()[0], flush=True)
        try:
            torch.ones(1, device="cuda").cpu()  # (a kernel and a copy: the allocator's cache alone needs no CUDA call)
            print("LATER CALL WORKED", flush=True)
        except RuntimeError:
            print("LATER CALL FAILED", flush=True)
        sys.exit(3)
    print("NO ERROR", flush=True)
""")


@pytest.mark.parametrize(("bad", "index_dtype"), [(16, "int64"), (-1, "int32")])
@pytest.mark.parametrize("op", ["rotary_pos", "rotary_pos_qk", "rotary_pos_", "module"])
def test_a_position_past_the_cache_is_a_device_assert_that_names_it(cuda, op, bad, index_dtype):
    """H1, in a subprocess (the assert ends the CUDA context): the kernel prints the position and
    the row count, the error surfaces at the next sync, and every later CUDA call fails; also with
    CUDA_LAUNCH_BLOCKING=1 (for one op: each run starts CUDA anew, seconds apiece)."""
    for blocking in ("0", "1") if op == "rotary_pos" else ("0",):
        env = {**os.environ, "CUDA_LAUNCH_BLOCKING": blocking}
        run = subprocess.run([sys.executable, "-c", _PAST_THE_CACHE, op, index_dtype, str(bad)], env=env,
                             capture_output=True, text=True, timeout=120)
        text = run.stdout + run.stderr
        assert run.returncode != 0 and "NO ERROR" not in text, text[-2000:]
        assert f"rope_ext: position {bad} is outside the cache of 16 rows" in text, text[-2000:]
        assert "LATER CALL WORKED" not in text, text[-2000:]


# --- shapes that crashed other libraries on GPUs first (shared/LESSONS.md) -----------------------


def test_mla_strides_one_k_head(cuda, gen):
    """sglang issue 20559's illegal memory access: MLA's rope parts, q's a 64-column slice of rows of
    256 (head stride 256) and one k head of 64 (head stride 64), gathered bfloat16, in one launch."""
    t, h = 37, 16
    q_full = randn(t, h, 256, dtype=torch.bfloat16, gen=gen)
    k_pe = randn(t, 1, 64, dtype=torch.bfloat16, gen=gen)
    cc, sc = _caches(64, torch.float32, rows=128)
    pos = torch.randint(0, 128, (t, 1), generator=gen)
    q_pe = q_full[..., 192:]
    assert q_pe.stride(1) == 256 and k_pe.stride(1) == 64
    for interleaved in (False, True):
        got = rope_ext.rotary_pos_qk(*on(cuda, q_pe, k_pe, cc, sc, pos), interleaved=interleaved)
        want = rope_ext.rotary_pos_qk(q_pe, k_pe, cc, sc, pos, interleaved=interleaved)
        torch.cuda.synchronize()
        assert_same_bits(got[0], want[0], f"q, interleaved={interleaved}")
        assert_same_bits(got[1], want[1], f"k, interleaved={interleaved}")


def test_flash_attn_issue_1195_qkv(cuda):
    """flash-attention issue 1195's illegal memory access: interleaved RoPE of dim 72 on a
    (7200, 90, 3, 16, 72) float16 qkv, q and k as its strided views in one launch (2.2 G elements):
    the first and last sequences equal the CPU kernel's on the same rows."""
    qkv = torch.empty(7200, 90, 3, 16, 72, dtype=torch.float16, device=cuda).uniform_(-1, 1)
    angles = torch.arange(90, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, 72, 2) / 72)
    cos = angles.cos().repeat_interleave(2, -1).float()[:, None]  # (S, 1, 72): interleaved pairs' columns
    sin = angles.sin().repeat_interleave(2, -1).float()[:, None]
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    got_q, got_k = rope_ext.rotary_qk(q, k, cos.to(cuda), sin.to(cuda), interleaved=True)
    torch.cuda.synchronize()
    for rows in (slice(0, 2), slice(7198, 7200)):
        want_q, want_k = rope_ext.rotary_qk(q[rows].cpu(), k[rows].cpu(), cos, sin, interleaved=True)
        assert torch.equal(got_q[rows].cpu(), want_q) and torch.equal(got_k[rows].cpu(), want_k), rows


# --- the layouts' device copies keep their storage (H4) ----------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_copies_keep_each_layout(cuda, layout, gen):
    x, _ = make_layout(layout, 2, 5, 3, 40, torch.bfloat16, gen)
    (xg,) = on(cuda, x)
    assert xg.stride() == x.stride() and xg.storage_offset() == x.storage_offset()
    assert xg.data_ptr() % 16 == x.data_ptr() % 16 and torch.equal(cpu(xg), x)


# --- QK-norm + RoPE (qk_norm_rotary) on the device ------------------------------------------------
#
# The kernels' float math is IEEE with no contraction (--fmad=false; sqrt and division correctly
# rounded), in the same order as their host emulation (tests/test_qk_norm_emulation.py): so the
# device's results are the emulator's bit for bit, and the CPU kernel's to rounding (its group sums
# add in another order).

NORM_CASES = {  # name: (dtype, table dtype, norm_over, interleaved, D, r, gathered)
    "qwen3_bf16": (torch.bfloat16, torch.float32, "head", False, 128, 128, True),
    "wan_bf16_across": (torch.bfloat16, torch.bfloat16, "heads", False, 128, 128, False),
    "olmo_f32_across_gathered": (torch.float32, torch.float32, "heads", False, 64, 64, True),
    "interleaved_partial_f16": (torch.float16, torch.float16, "head", True, 64, 32, False),
    "scalar_40_bf16": (torch.bfloat16, torch.bfloat16, "head", False, 40, 40, False),  # 20 pairs: no 8-wide vectors
    "f64_gathered": (torch.float64, torch.float64, "head", True, 32, 24, True),
}


def _norm_inputs(case, gen, T=9, Hq=8, Hk=2):
    dtype, tdt, norm_over, interleaved, D, r, gathered = NORM_CASES[case]
    q, k = randn(2, T, Hq, D, dtype=dtype, gen=gen), randn(2, T, Hk, D, dtype=dtype, gen=gen)
    wq = torch.rand(D * (Hq if norm_over == "heads" else 1), generator=gen).to(dtype)
    wk = torch.rand(D * (Hk if norm_over == "heads" else 1), generator=gen).float()  # (float32: the other form)
    if gathered:
        cc, sc = _caches(r, tdt)
        tables = (cc, sc, torch.randint(0, 64, (2, T, 1), generator=gen))
    else:
        tables = _tables(r, interleaved, tdt, gen, shape=(2, T, 1))
    return (q, k, wq, wk, *tables), dict(eps=1e-6, weight_offset=0.5, across_heads=norm_over == "heads",
                                         interleaved=interleaved)


@pytest.mark.parametrize("case", NORM_CASES)
def test_qk_norm_equals_its_emulation_bit_for_bit(cuda, case, gen):
    """Forward (outputs and rstd) and backward (dx and the weight's gradient) of the device kernels
    against the host emulation of the same kernels."""
    testing = torch.ops.rope_ext_testing
    args, kw = _norm_inputs(case, gen)
    extra = (kw["eps"], kw["weight_offset"], kw["across_heads"], kw["interleaved"])
    gathered = len(args) == 7
    op = ops.qk_norm_rotary_pos if gathered else ops.qk_norm_rotary
    emu = testing.cuda_emulate_qk_norm_rotary_pos if gathered else testing.cuda_emulate_qk_norm_rotary
    got, want = op(*on(cuda, *args), *extra), emu(*args, *extra)
    for name, g, w in zip(("q_out", "k_out", "q_rstd", "k_rstd"), got, want, strict=True):
        assert_same_bits(g, w, f"{case} {name}")
    q, _, wq, _ = args[:4]
    tables = args[4:6]
    positions = args[6] if gathered else None
    dy = randn(*q.shape, dtype=q.dtype, gen=gen)
    back = (dy, q, wq, want[2], *tables, positions, kw["weight_offset"], kw["across_heads"], kw["interleaved"], True)
    got = ops.qk_norm_rotary_backward(*on(cuda, *back[:7]), *back[7:]) if positions is not None else \
        ops.qk_norm_rotary_backward(*on(cuda, *back[:6]), None, *back[7:])
    want = testing.cuda_emulate_qk_norm_rotary_backward(*back)
    assert_same_bits(got[0], want[0], f"{case} dx")
    assert_same_bits(got[1], want[1], f"{case} dweight")


@pytest.mark.parametrize("norm_over", ["head", "heads"])
@pytest.mark.parametrize("gathered", [False, True], ids=["tables", "positions"])
def test_qk_norm_autograd_on_cuda_matches_the_cpu(cuda, norm_over, gathered, gen):
    """The public functions with autograd, every gradient (q, k, both weights, the tables unless
    gathered) against the CPU's, to float32 rounding over a group and over the rows of a sum."""
    dtype, D, T = torch.float32, 64, 5
    q = randn(2, T, 4, D, dtype=dtype, gen=gen).requires_grad_()
    k = randn(2, T, 2, D, dtype=dtype, gen=gen).requires_grad_()
    wq = torch.rand(D * (4 if norm_over == "heads" else 1), generator=gen).requires_grad_()
    wk = torch.rand(D * (2 if norm_over == "heads" else 1), generator=gen).requires_grad_()
    kw = dict(eps=1e-6, weight_offset=1.0, norm_over=norm_over)
    if gathered:
        cc, sc = _caches(D, torch.float32)
        pos = torch.randint(0, 64, (2, T, 1), generator=gen)
        fn, tabs = rope_ext.qk_norm_rotary_pos, (cc, sc, pos)
    else:
        cos, sin = _tables(D, False, torch.float32, gen, shape=(2, T, 1))
        fn, tabs = rope_ext.qk_norm_rotary, (cos.requires_grad_(), sin.requires_grad_())
    inputs = (q, k, wq, wk, *tabs)
    leaves = [t for t in inputs if t.requires_grad]
    gq, gk = randn(*q.shape, gen=gen), randn(*k.shape, gen=gen)
    want = torch.autograd.grad(fn(*inputs, **kw), leaves, (gq, gk))
    dev = on(cuda, *inputs)
    got = torch.autograd.grad(fn(*dev, **kw), [t for t in dev if t.requires_grad], on(cuda, gq, gk))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(cpu(g), w, atol=1e-4 * float(w.abs().max()), rtol=1e-5)


def test_qk_norm_gradcheck_opcheck_and_compile_on_cuda(cuda, gen):
    """float64 gradcheck and gradgradcheck of both forms, opcheck of every qk_norm op, and
    torch.compile(fullgraph=True) of the forward and backward, on the device."""
    q = randn(1, 3, 2, 8, dtype=torch.float64, gen=gen).to(cuda).requires_grad_()
    k = randn(1, 3, 1, 8, dtype=torch.float64, gen=gen).to(cuda).requires_grad_()
    wq = torch.rand(8, dtype=torch.float64, generator=gen).to(cuda).requires_grad_()
    cos, sin = (t.to(cuda).requires_grad_() for t in _tables(8, False, torch.float64, gen, shape=(1, 3, 1)))
    fn = lambda *a: rope_ext.qk_norm_rotary(*a, eps=1e-6, interleaved=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, wq, None, cos, sin))
    assert torch.autograd.gradgradcheck(fn, (q, k, wq, None, cos, sin))
    cc, sc = (t.to(cuda) for t in _caches(8, torch.float64, rows=4))
    pos = torch.randint(0, 4, (1, 3, 1), generator=gen).to(cuda)
    fp = lambda q, k, w: rope_ext.qk_norm_rotary_pos(q, k, w, w, cc, sc, pos, eps=1e-6, norm_over="heads")  # noqa
    w2 = torch.rand(16, dtype=torch.float64, generator=gen).to(cuda).requires_grad_()
    k2 = randn(1, 3, 2, 8, dtype=torch.float64, gen=gen).to(cuda).requires_grad_()
    assert torch.autograd.gradcheck(fp, (q, k2, w2))
    args = (q.detach(), k.detach(), wq.detach(), None, cos.detach(), sin.detach(), 1e-6, 0.0, False, False)
    torch.library.opcheck(ops.qk_norm_rotary.default, args)
    torch.library.opcheck(ops.qk_norm_rotary_pos.default, (q.detach(), k2.detach(), w2.detach(), w2.detach(), cc,
                                                            sc, pos, 1e-6, 0.0, True, False))
    torch.library.opcheck(ops.qk_norm_rotary_.default, (q.detach().clone(), k.detach().clone(), *args[2:]))
    compiled = torch.compile(fn, fullgraph=True)
    out = compiled(q, k, wq, None, cos, sin)
    ref = fn(q, k, wq, None, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
    g1 = torch.autograd.grad(sum(o.sum() for o in out), (q, wq))
    g2 = torch.autograd.grad(sum(o.sum() for o in ref), (q, wq))
    assert all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))


def test_module_with_norm_on_cuda_matches_the_cpu_module(cuda, gen):
    """RotaryEmbedding(...)(q, k, positions, norm=QKNorm(...)) on the device: one fused call, the
    CPU module's results to rounding."""
    q, k = randn(2, 6, 8, 64, dtype=torch.bfloat16, gen=gen), randn(2, 6, 2, 64, dtype=torch.bfloat16, gen=gen)
    rope = rope_ext.RotaryEmbedding(64, max_position_embeddings=32, layout="bshd")
    norm = rope_ext.QKNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.q_weight.uniform_(0.5, 1.5)
        norm.k_weight.uniform_(0.5, 1.5)
    pos = torch.randint(0, 32, (2, 6), generator=gen)
    want = rope(q, k, position_ids=pos, norm=norm)
    rope_d, norm_d = rope_ext.RotaryEmbedding(64, max_position_embeddings=32, layout="bshd").to(cuda), norm.to(cuda)
    got = rope_d(q.to(cuda), k.to(cuda), position_ids=pos.to(cuda), norm=norm_d)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu().float(), w.float(), atol=0, rtol=2.0**-7)
