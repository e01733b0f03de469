"""rope_ext.compat.timm and rope_ext.integrations.timm against timm itself: each of timm's RoPE
functions and EVA's prefix-token rotation (outputs and gradients, float32, bfloat16, and float32
tables with bfloat16 x, both pairings), tiny randomly initialised EVA-02, DINOv3, RoPE and
RoPE-Mixed ViTs and NaFlexViT (outputs and every parameter's gradient against the stock model, a
rope_ext op seen running, no concatenation of q or k), patch/unpatch, and the refusal of code that
matches no tested form.

timm needs torchvision, which loads beside torch 2.14.1 only: these tests run in cuda-check's venv
(see tools/cuda_check.sh) and skip where timm does not import."""
from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
timm = pytest.importorskip("timm")

import torch  # noqa: E402
from conftest import RopeOpSpy  # noqa: E402
from form_checks import rand as _rand  # noqa: E402
from form_checks import weights as _weights  # noqa: E402
from form_checks import wide as _wide  # noqa: E402
from form_checks import within_rounding  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from rope_ext.compat import timm as compat  # noqa: E402
from rope_ext.integrations import _timm_forms  # noqa: E402
from rope_ext.integrations import timm as rope_timm  # noqa: E402

sincos = pytest.importorskip("timm.layers.pos_embed_sincos")
eva = pytest.importorskip("timm.models.eva")
attention = pytest.importorskip("timm.layers.attention")

B, H, N, D = 2, 3, 7, 16

# The implementations held to the installed timm's code: what patch() puts in for it ("patched"), and
# rope_ext.compat.timm, timm 1.0.31's drop-in, where the installed timm's forms are 1.0.31's.
_SURVEY = rope_timm.survey()
IMPLS = {"patched": lambda name: _timm_forms.replacement(_SURVEY[name].form)}
if all(_SURVEY[name].form in _timm_forms.KNOWN_1_0_31.values() for name in _timm_forms.ROPE_FUNCTIONS):
    IMPLS["compat"] = lambda name: getattr(compat, name)
_PREFIX_METHOD = "EvaAttention.forward"


@pytest.fixture(autouse=True)
def _unpatched():
    assert rope_timm.patched_names() == []
    yield
    rope_timm.unpatch()


def _within_rounding(got, truth, dtype, terms=0, term_bound=0.0):
    """form_checks.within_rounding, and for a table's gradient, which sums `terms` products over the
    dims the table broadcasts along, each rounded to dtype first (by timm's autograd and by
    rope_ext's alike), up to one rounding of each: eps * terms * term_bound more, with term_bound
    the largest product."""
    if not terms:
        return within_rounding(got, truth, dtype)
    got, truth = got.detach().double(), truth.detach().double()
    eps = torch.finfo(dtype).eps
    bound = eps * truth.abs() + 2.0**-20 * truth.abs().max().item() + eps * terms * term_bound
    bad = (got - truth).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements off by up to {(got - truth).abs().max().item():.3g}"


DTYPES = {  # (x, tables): the models' own pairs, and float32 tables (timm's default) for bfloat16 x
    "f32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16-f32-tables": (torch.bfloat16, torch.float32),
}
HALF = {"interleaved": False, "half-split": True}
# Table shapes as timm's models pass them, for (B, H, tokens, D) x: EVA's shared (tokens, D),
# NaFlexViT's per image (B, 1, tokens, D), RoPE-Mixed's per head (H, tokens, D).
TABLES = {"shared": lambda n: (n, D), "per-image": lambda n: (B, 1, n, D), "per-head": lambda n: (H, n, D)}


def _call(fn_name, impl, x, sin, cos, half):
    if fn_name == "apply_rot_embed":
        return impl(x, sin, cos, half=half)
    if fn_name == "apply_rot_embed_list":
        return impl([x, 2 * x], sin, cos, half=half)
    return impl(x, torch.cat([sin, cos], -1), half=half)


def _outs(result):
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _run(impl, fn_name, x, sin, cos, half):
    x, sin, cos = (t.detach().requires_grad_() for t in (x, sin, cos))
    outs = _outs(_call(fn_name, impl, x, sin, cos, half))
    sum((o.float() * _weights(o).float()).sum() for o in outs).backward()
    return outs, (x.grad, sin.grad, cos.grad)


@pytest.mark.parametrize("tables", TABLES)
@pytest.mark.parametrize("dtypes", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("half", HALF.values(), ids=HALF.keys())
@pytest.mark.parametrize("fn_name", _timm_forms.ROPE_FUNCTIONS)
@pytest.mark.parametrize("impl", IMPLS)
def test_function_matches_timm(impl, fn_name, half, dtypes, tables):
    """Outputs, output dtypes and the gradients of x and both tables, against timm's function: bit
    for bit in float32 (both round each product and the sum once, in the same order), within one
    rounding of the float64 truth otherwise (timm rounds each bfloat16 product to bfloat16, rope_ext
    computes in float32 and rounds once, so rope_ext is the closer of the two)."""
    x_dtype, t_dtype = dtypes
    gen = torch.Generator().manual_seed(0)
    x = _rand(B, H, N, D, dtype=x_dtype, gen=gen)[:, :, 1:]  # a strided view, as EVA passes it
    sin, cos = (_rand(*TABLES[tables](N - 1), dtype=t_dtype, gen=gen) for _ in range(2))
    ours, our_grads = _run(IMPLS[impl](fn_name), fn_name, x, sin, cos, half)
    theirs, their_grads = _run(getattr(sincos, fn_name), fn_name, x, sin, cos, half)
    truth, true_grads = _run(getattr(sincos, fn_name), fn_name, _wide(x), _wide(sin), _wide(cos), half)
    assert [o.dtype for o in ours] == [o.dtype for o in theirs]
    assert [o.shape for o in ours] == [o.shape for o in theirs]
    # each table entry's gradient sums this many products, none larger than max|x| (|weights| <= 1)
    summed = len(ours) * x.numel() // sin.numel()
    terms = [0] * (len(ours) + 1) + [summed, summed]
    for i, (got, ref, true) in enumerate(zip((*ours, *our_grads), (*theirs, *their_grads), (*truth, *true_grads),
                                             strict=True)):
        if x_dtype == t_dtype == torch.float32 and terms[i] == 0:
            torch.testing.assert_close(got, ref, atol=0, rtol=0)
        _within_rounding(got, true, got.dtype, terms[i], 2 * x.abs().max().item())


PREFIX = {"eva-1": 1, "dinov3-5": 5, "none": 0}


# k with every head, or one (AttentionRope's grouped-query attention); RoPE-Mixed's per-head tables
# need every head (timm's own call fails otherwise).
TABLES_KV = [(t, kv) for t in (*TABLES, "broadcast tokens") for kv in (H, 1) if t != "per-head" or kv == H]


@pytest.mark.parametrize("tables,kv_heads", TABLES_KV, ids=[f"{t}-kv{kv}" for t, kv in TABLES_KV])
@pytest.mark.parametrize("npt", PREFIX.values(), ids=PREFIX.keys())
@pytest.mark.parametrize("dtypes", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("half", HALF.values(), ids=HALF.keys())
@pytest.mark.parametrize("impl", IMPLS)
def test_prefix_rotation_matches_eva(impl, half, dtypes, npt, tables, kv_heads):
    """rot_embed_cat_after_prefix against EVA's statements
    ``q = torch.cat([q[:, :, :npt, :], apply_rot_embed_cat(q[:, :, npt:, :], rope, half=half)], dim=2)``
    (and k's): the prefix tokens bit-identical, the rest as in test_function_matches_timm, and the
    gradients of q, k and the table."""
    x_dtype, t_dtype = dtypes
    gen = torch.Generator().manual_seed(1)
    n = N - npt if tables != "broadcast tokens" else 1
    shape = TABLES.get(tables, TABLES["shared"])(n)
    q0, k0 = _rand(B, H, N, D, dtype=x_dtype, gen=gen), _rand(B, kv_heads, N, D, dtype=x_dtype, gen=gen)
    emb0 = _rand(*shape[:-1], 2 * D, dtype=t_dtype, gen=gen)

    def run(fn, q, k, emb):
        q, k, emb = (t.detach().requires_grad_() for t in (q, k, emb))
        outs = fn(q, k, emb)
        sum((o.float() * _weights(o).float()).sum() for o in outs).backward()
        return [*outs, q.grad, k.grad, emb.grad]

    def timm_statements(q, k, emb):
        cat = sincos.apply_rot_embed_cat
        return tuple(torch.cat([x[:, :, :npt, :], cat(x[:, :, npt:, :], emb, half=half)], dim=2) for x in (q, k))

    after_prefix = compat.rot_embed_cat_after_prefix if impl == "compat" else IMPLS[impl](_PREFIX_METHOD)
    ours = run(lambda q, k, e: after_prefix(q, k, e, npt, half), q0, k0, emb0)
    theirs = run(timm_statements, q0, k0, emb0)
    truth = run(timm_statements, _wide(q0), _wide(k0), _wide(emb0))
    # the table's gradient sums at most this many products over q's and k's broadcast dims
    terms = [0] * 4 + [(q0.numel() + k0.numel()) // (emb0.numel() // 2)]
    largest = max(q0.abs().max().item(), k0.abs().max().item())
    for i, (got, ref, true) in enumerate(zip(ours, theirs, truth, strict=True)):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        if i < 2:
            assert torch.equal(got[:, :, :npt], ref[:, :, :npt])
        if x_dtype == t_dtype == torch.float32 and i < 4:
            torch.testing.assert_close(got, ref, atol=0, rtol=0)
        _within_rounding(got, true, got.dtype, terms[i], largest)


# --- whole models -----------------------------------------------------------------------------------

_TINY = dict(depth=2, embed_dim=64, num_heads=2, num_classes=10)
MODELS = {  # name: (timm model, overrides, image size); every one built with pretrained=False
    "eva02": ("eva02_tiny_patch14_224", dict(ref_feat_shape=(4, 4)), 56),
    "dinov3": ("vit_small_patch16_dinov3", {}, 64),
    "rope-vit": ("vit_small_patch16_rope_224", {}, 64),
    "rope-mixed": ("vit_small_patch16_rope_mixed_224", {}, 64),
    "naflexvit-axial": ("naflexvit_base_patch16_gap", dict(rope_type="axial", pos_embed="none"), 64),
    "naflexvit-mixed": ("naflexvit_base_patch16_gap", dict(rope_type="mixed", pos_embed="none"), 64),
}
# The attention class each model's blocks use, whose prefix concatenation the patch rewrites.
ATTENTION = {"eva02": "EvaAttention", "dinov3": "EvaAttention"}


class CatSpy(TorchDispatchMode):
    """Records the shape of every aten.cat result."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.cat:
            self.shapes.append(tuple(out.shape))
        return out


def _model(key):
    name, overrides, size = MODELS[key]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, img_size=size, **_TINY, **overrides)
    images = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    return model, images


def _forward_backward(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(inputs)
    (out * _weights(out)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# float32: rope_ext rounds each product and the sum once, like timm's eager formula, and the
# prefix tokens pass through exactly (x * 1 + R(x) * 0), so outputs and gradients are bit-identical.
EXACT = dict(atol=0, rtol=0)


@pytest.mark.parametrize("key", MODELS)
def test_model_outputs_and_gradients_match(key):
    model, images = _model(key)
    attn = model.blocks[0].attn
    assert type(attn).__name__ == ATTENTION.get(key, "AttentionRope")
    tokens = []
    hook = attn.register_forward_pre_hook(lambda _, args: tokens.append(args[0].shape[1]))
    with CatSpy() as stock_cats:
        ref_out, ref_grads = _forward_backward(model, images)
    hook.remove()
    heads_shape = (2, attn.num_heads, tokens[0], attn.head_dim)  # q's and k's
    with rope_timm.patch() as patched, RopeOpSpy() as spy, CatSpy() as cats:
        assert set(patched) == set(rope_timm.survey())
        out, grads = _forward_backward(model, images)
    assert rope_timm.patched_names() == []  # the context manager restored timm's code
    assert [n for n in spy.names if n in ("rotary", "rotary_qk")], spy.names
    # timm concatenates q and k with their prefix tokens in each layer; rope_ext does not
    assert stock_cats.shapes.count(heads_shape) == 2 * len(model.blocks) * (attn.num_prefix_tokens > 0)
    assert heads_shape not in cats.shapes
    torch.testing.assert_close(out, ref_out, **EXACT)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **EXACT, msg=name)


def test_naflex_batches_of_mixed_sizes_match():
    """NaFlexViT's own input: patches with coordinates and padding, each image its own grid, so
    the tables are (B, 1, tokens, D) with zero rows for the padding."""
    model, _ = _model("naflexvit-axial")
    gen = torch.Generator().manual_seed(2)
    patches = torch.randn(2, 16, 16 * 16 * 3, generator=gen)
    coords = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij"), -1).flatten(0, 1)
    coord = torch.stack([coords, torch.where(coords < 3, coords, 0)])  # image 1: a 3x3 grid, then padding
    valid = torch.ones(2, 16, dtype=torch.bool)
    valid[1] = (coords < 3).all(-1)
    inputs = {"patches": patches, "patch_coord": coord, "patch_valid": valid}
    ref_out, ref_grads = _forward_backward(model, inputs)
    with rope_timm.patch(), RopeOpSpy() as spy:
        out, grads = _forward_backward(model, inputs)
    assert {args[2].shape[0] for name, args in spy.calls if name == "rotary_qk"} == {2}  # per-image tables
    torch.testing.assert_close(out, ref_out, **EXACT)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **EXACT, msg=name)


# --- patching ---------------------------------------------------------------------------------------


def _bindings():
    """Every timm module's binding of the three names, and the two attention methods' code."""
    import sys

    names = _timm_forms.ROPE_FUNCTIONS
    found = {(m, n): getattr(mod, n) for m, mod in list(sys.modules.items()) if m.startswith("timm") and mod
             for n in names if hasattr(mod, n)}
    found["eva"] = eva.EvaAttention.forward.__code__
    found["rope"] = attention.AttentionRope.forward.__code__
    return found


def test_patch_replaces_every_binding_and_unpatch_restores():
    before = _bindings()
    assert before[("timm.models.eva", "apply_rot_embed_cat")] is sincos.apply_rot_embed_cat
    patched = rope_timm.patch()
    try:
        assert patched == list(rope_timm.survey()) == rope_timm.patched_names()
        during = _bindings()
        for key, value in before.items():
            assert during[key] is not value, key  # every binding of timm's functions, both methods
        assert during[("timm.layers", "apply_rot_embed_cat")] is during[("timm.models.eva", "apply_rot_embed_cat")]
        assert rope_timm.patch() == []  # already patched: a nested call switches nothing
    finally:
        assert sorted(rope_timm.unpatch()) == sorted(patched)
    assert _bindings() == before and all(_bindings()[k] is v for k, v in before.items())
    # the holders rewritten code calls stay (a call running in another thread still finds them); unused
    holders = [name for name in vars(eva) if name.startswith("_rope_ext_")]
    assert all(getattr(eva, name).__module__.startswith("rope_ext.") for name in holders)
    assert not any(name in eva.EvaAttention.forward.__code__.co_names for name in holders)


def test_patch_some_names():
    with rope_timm.patch(["apply_rot_embed_cat"]) as patched:
        assert patched == ["apply_rot_embed_cat"]
        assert eva.apply_rot_embed_cat is not sincos.apply_rot_embed  # replaced where eva imported it
        assert sincos.apply_rot_embed.__module__ == "timm.layers.pos_embed_sincos"
    with pytest.raises(ValueError, match="cannot patch 'nope': not one of timm's RoPE functions"):
        rope_timm.patch(["nope"])


def test_code_replaced_by_someone_else_is_not_patched(monkeypatch):
    monkeypatch.setattr(sincos, "apply_rot_embed", lambda x, sin_emb, cos_emb, half=False: x)
    with pytest.raises(ValueError, match="not the function its file defines"):
        rope_timm.patch(["apply_rot_embed"])
    monkeypatch.setattr(eva, "apply_rot_embed_cat", lambda x, emb, half=False: x)
    with pytest.raises(ValueError, match="neither timm's function nor rope_ext's"):
        rope_timm.patch(["EvaAttention.forward"])
    assert rope_timm.patched_names() == []
    # patching everything refuses those two alone, says so, and switches the rest
    import warnings

    from rope_ext.integrations import _engine

    monkeypatch.setattr(_engine, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched = rope_timm.patch()
    assert set(patched) == set(rope_timm.survey()) - {"apply_rot_embed", "EvaAttention.forward"}
    refusals = [str(w.message) for w in caught if issubclass(w.category, _engine.RefusedWarning)]
    assert len(refusals) == 1 and "apply_rot_embed: timm.layers.pos_embed_sincos.apply_rot_embed is" in refusals[0]
    assert "EvaAttention.forward: timm.models.eva.apply_rot_embed_cat is" in refusals[0]
    rope_timm.unpatch()
    with pytest.raises(ValueError, match=r"2 RoPE site\(s\) .* \(strict=True: nothing was patched\)"):
        rope_timm.patch(strict=True)
    assert rope_timm.patched_names() == []


@pytest.fixture
def fresh_survey():
    rope_timm.survey.cache_clear()
    yield
    rope_timm.survey.cache_clear()


def _fake_timm(tmp_path, monkeypatch, module, old, new):
    """The installed timm's file for module, with the text old replaced by new; the classifier
    reads it instead."""
    source = rope_timm._source_path(module)
    text = open(source, encoding="utf-8").read()
    assert text.count(old) == 1
    fake = tmp_path / os.path.basename(source)
    fake.write_text(text.replace(old, new))
    real = rope_timm._source_path
    monkeypatch.setattr(rope_timm, "_source_path", lambda m: str(fake) if m == module else real(m))
    rope_timm.survey.cache_clear()
    return rope_timm.survey()


def test_unknown_rotation_is_refused_by_name(tmp_path, monkeypatch, fresh_survey):
    # timm's rot turned the other way: no tested form computes that
    survey = _fake_timm(tmp_path, monkeypatch, "timm.layers.pos_embed_sincos",
                        "return torch.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)",
                        "return torch.stack([x[..., 1::2], -x[..., ::2]], -1).reshape(x.shape)")
    for name in _timm_forms.ROPE_FUNCTIONS:  # each calls apply_rot_embed, which calls rot
        assert survey[name].form is None and "matches no form rope_ext is tested on" in survey[name].reason
    for name in ("EvaAttention.forward", "AttentionRope.forward"):
        assert survey[name].form is None and "apply_rot_embed_cat it calls is refused" in survey[name].reason
    with pytest.raises(ValueError, match=r"cannot patch 'apply_rot_embed_cat': its code \(fingerprint"):
        rope_timm.patch(["apply_rot_embed_cat"])
    assert rope_timm.patch() == [] and rope_timm.patched_names() == []


def test_unknown_attention_is_refused_and_keeps_timms_concatenation(tmp_path, monkeypatch, fresh_survey):
    survey = _fake_timm(tmp_path, monkeypatch, "timm.models.eva", "q, k = self.q_norm(q), self.k_norm(k)",
                        "q, k = self.q_norm(q), self.k_norm(k) * 2")
    assert survey["EvaAttention.forward"].form is None
    assert survey["AttentionRope.forward"].form is not None
    with rope_timm.patch() as patched:
        assert "EvaAttention.forward" not in patched and "apply_rot_embed_cat" in patched
        assert eva.EvaAttention.forward.__code__.co_filename == eva.__file__
        assert "apply_rot_embed_cat" in eva.EvaAttention.forward.__code__.co_names  # timm's code as it is


def test_rewrite_finds_the_statements_once():
    """EVA's forward holds the prefix concatenation of q and k once; code without it, never (the
    patch is refused then)."""
    import ast

    from rope_ext.integrations import _engine

    block, found = _timm_forms.prefix_rewrite()
    tree = ast.parse(open(eva.__file__, encoding="utf-8").read())
    node = dict(_engine.function_defs(tree))["EvaAttention.forward"]
    code = _engine.rewrite_method(node, "EvaAttention.forward", eva.__file__, eva.EvaAttention.forward.__code__,
                                  lambda fn: _engine.rewrite_each_block(fn, lambda st: block(st, "h")))
    assert len(found) == 1 and "h" in code.co_names and "apply_rot_embed_cat" not in code.co_names
    block, found = _timm_forms.prefix_rewrite()
    block(ast.parse("def forward(self, q, k, v, rope):\n    return q\n").body[0].body, "h")
    assert found == []


def test_listing(capsys):
    rope_timm.main()
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"timm {timm.__version__}: 5 RoPE functions and methods; 5 patched, 0 refused"
    assert any(line.startswith("timm.models.eva.EvaAttention.forward") and " patched " in line for line in out)
    bound = next(line for line in out if line.strip().startswith("in timm.layers, timm.layers.attention,"))
    assert "timm.models.eva" in bound


def test_readme_example(capsys):
    """docs/integrations.md's "Use with timm" example (tests/test_readme.py runs the others, where timm
    may be missing) runs as written, prints what it says, and leaves timm unpatched."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
              if "from rope_ext.integrations import timm as rope_timm\n" in b]
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/integrations.md timm example", "exec"), {})
    assert capsys.readouterr().out == f"{list(rope_timm.survey())}\n"
    assert rope_timm.patched_names() == []
