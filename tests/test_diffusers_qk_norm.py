"""QK-norm + RoPE fused in diffusers' processors (rope_ext.integrations.diffusers.patch's ``qk_norm``):
the norm classes against themselves, tiny Flux, Wan, HunyuanVideo, LTX, QwenImage, CogVideoX and
CogView4 models against stock in float32 and bfloat16 (outputs and every parameter's gradient), the
fused op seen where it must run and nowhere after unpatch, and a compiled Flux block as one graph."""
from __future__ import annotations

import contextlib
import re

import fusion_checks
import pytest
import torch
from conftest import RopeOpSpy

from rope_ext import qk_norm_rotary
from rope_ext.integrations import _diffusers_forms, _qk_norm_call
from rope_ext.integrations import diffusers as rope_diffusers

pytest.importorskip("diffusers")
from test_diffusers_models import _build, _randn  # noqa: E402  (after the importorskip)

# --- the norm classes -------------------------------------------------------------------------------


def _norm_classes():
    """kind -> (class, make(n, eps, affine), a file whose processors may meet it)."""
    from diffusers.models.normalization import MochiRMSNorm, RMSNorm
    from diffusers.models.transformers.transformer_krea2 import Krea2RMSNorm
    from diffusers.models.transformers.transformer_stable_audio3 import StableAudio3RMSNorm

    return {"torch": (torch.nn.RMSNorm, lambda n, eps, affine: torch.nn.RMSNorm(n, eps=eps, elementwise_affine=affine),
                      "flux"),
            "diffusers": (RMSNorm, lambda n, eps, affine: RMSNorm(n, eps=eps, elementwise_affine=affine), "flux"),
            "mochi": (MochiRMSNorm, lambda n, eps, affine: MochiRMSNorm(n, eps=eps, elementwise_affine=affine),
                      "attention_processor"),
            "krea2": (Krea2RMSNorm, lambda n, eps, affine: Krea2RMSNorm(n, eps=eps), "krea2"),
            "stable_audio3": (StableAudio3RMSNorm, lambda n, eps, affine: StableAudio3RMSNorm(n, eps=eps),
                              "stable_audio3")}


# (eps=None is torch's RMSNorm's alone; Krea2RMSNorm and StableAudio3RMSNorm always have a weight)
NORM_CASES = [(kind, eps, affine, x, w) for kind in ("torch", "diffusers", "mochi", "krea2", "stable_audio3")
              for eps in (1e-6, None) for affine in (True, False)
              for x, w in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                           (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16))
              if (kind == "torch" or eps is not None) and (affine or x == w)
              and (affine or kind not in ("krea2", "stable_audio3"))]


@pytest.mark.parametrize("kind,eps,affine,x_dtype,w_dtype", NORM_CASES)
def test_norm_class_matches_its_form(kind, eps, affine, x_dtype, w_dtype):
    """The fused op with the class's NormForm (identity tables), against the class itself, where the
    fusion takes it: only where the class returns x's dtype. Bound: two roundings of x's dtype
    (the class may round its normalized value and its product with the weight; the op rounds once);
    in float32, each is within about three roundings of the float64 value (the mean of 32 squares
    summed in another order, rsqrt, the products: measured 2.3 ulps each, 4.1 apart), so 8 * 2^-24."""
    cls, make, file = _norm_classes()[kind]
    entry = rope_diffusers._fused_norms(file).get(cls)
    assert entry is not None and entry[1] is cls.forward
    form = entry[0]
    gen = torch.Generator().manual_seed(0)
    norm = make(32, eps, affine)
    if affine:
        with torch.no_grad():
            getattr(norm, form.weight).copy_(torch.randn(32, generator=gen, dtype=torch.float64) * 0.5 + 0.3)
    norm = norm.to(w_dtype)
    x = (torch.randn(3, 5, 4, 32, generator=gen, dtype=torch.float64) * 3).to(x_dtype)
    expected = norm(x)
    weight = _qk_norm_call._norm_weight(norm, form)
    takes = _qk_norm_call._weight_ok(weight, form, x, 32)
    # never where the class returns another dtype (it may decline more: the op takes a weight in x's
    # dtype or float32 only, so a bfloat16 weight with float32 x runs torch's own norm)
    assert not takes or expected.dtype == x_dtype
    assert takes or expected.dtype != x_dtype or (weight.dtype, x_dtype) == (torch.bfloat16, torch.float32) or (
        form.offset_in_weight_dtype and weight.dtype != torch.float32)  # (Krea2's 1 + w would round)
    if not takes:
        return
    ones, zeros = torch.ones(5, 32, dtype=x_dtype), torch.zeros(5, 32, dtype=x_dtype)
    ours, _ = qk_norm_rotary(x, x, weight, weight, ones.unsqueeze(1), zeros.unsqueeze(1),
                             eps=_qk_norm_call._eps(norm, form, x), weight_offset=form.offset)
    ulp = {torch.float32: 8 * 2**-24, torch.bfloat16: 2 * 2**-8}[x_dtype]
    scale = expected.double().abs().amax(-1, keepdim=True)
    assert ((ours.double() - expected.double()).abs() <= ulp * scale).all()


# --- whole models -----------------------------------------------------------------------------------

# The fused op's calls in a run of each tiny model: one per fused attention layer, two in Flux's
# double-stream block (its text tokens, normalized by norms of their own and concatenated in front
# of q and k before RoPE, are a call of their own, with their rows of the tables). HunyuanVideo's
# double-stream block rotates the image tokens alone (fused) and joins the text tokens after RoPE;
# its single-stream block rotates a slice of q: there the norms run alone, and RoPE after them.
# CogVideoX and CogView4 write RoPE into the image rows of q and k (their LayerNorms normalize the
# text rows in front too): one fused call over the whole of q and k in each layer.
FUSED_LAYERS = {"flux": 3, "wan": 2, "hunyuan_video": 1, "ltx": 2, "qwenimage": 2, "cogvideox_transformer_3d": 2,
                "cogview4": 2}


def _run(model, run, name, mode):
    patch = contextlib.nullcontext() if mode is None else rope_diffusers.patch([name], qk_norm=mode == "fused")
    return fusion_checks.step(model, run, patch)


def _randomize_norms(model):
    gen = torch.Generator().manual_seed(3)
    for name, p in model.named_parameters():
        if re.search(r"\.norm_(added_)?[qk]\.", name):  # (a text stream's norms too: weights of its own)
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + 1.0)


def _check_parity(name, dtype):
    model, run = _build(name)
    _randomize_norms(model)
    truth = _run(model, run, name, None)
    model, run = _build(name, dtype)
    _randomize_norms(model)
    stock = _run(model, run, name, None)
    fused = _run(model, run, name, "fused")
    assert fused[2].count("qk_norm_rotary") == FUSED_LAYERS[name], fused[2]
    fusion_checks.assert_parity(dtype, fused[:2], stock[:2], truth[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", FUSED_LAYERS)
def test_model_matches_stock(name, dtype):
    """A tiny model with its q/k norms fused, against diffusers' own, output and every parameter's
    gradient, within fusion_checks.assert_parity's bounds. Wan's cross-attention and every unrotated
    path run the norms alone, through the same check."""
    _check_parity(name, dtype)


# --- each fused processor on its file's attention module ------------------------------------------

import diffusers_processor_cases_1  # noqa: E402
import diffusers_processor_cases_2  # noqa: E402
import diffusers_processor_cases_3  # noqa: E402

# "<file>:<Processor.__call__>" -> Case(build, fused_calls), for the processors no whole model above runs.
PROCESSOR_CASES = {**diffusers_processor_cases_1.CASES, **diffusers_processor_cases_2.CASES,
                   **diffusers_processor_cases_3.CASES}


def _check_processor(key, dtype):
    name, method = key.split(":")
    module, run = PROCESSOR_CASES[key].build()
    assert type(module.processor).__name__ == method.split(".")[0], "the case runs its key's processor"
    truth = fusion_checks.step(module, run, contextlib.nullcontext())
    module, run = PROCESSOR_CASES[key].build()
    module = module.to(dtype)
    stock = fusion_checks.step(module, run, contextlib.nullcontext())
    assert stock[2] == [], "the stock module runs no rope_ext op"
    fused = fusion_checks.step(module, run, rope_diffusers.patch([name]))
    assert fused[2].count("qk_norm_rotary") == PROCESSOR_CASES[key].fused_calls, fused[2]
    fusion_checks.assert_parity(dtype, fused[:2], stock[:2], truth[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("key", PROCESSOR_CASES)
def test_processor_matches_stock(key, dtype):
    """The processor fused, on its file's attention module with the file's own tables, against
    diffusers' own: output and every parameter's gradient, within fusion_checks.assert_parity's bounds."""
    _check_processor(key, dtype)


def _site(name, method):
    return next(s for s in rope_diffusers.model_report(name).qk_norms if s.method == method)


def _model_processors(name):
    """The processor classes a whole tiny model (FUSED_LAYERS) runs."""
    model, _ = _build(name)
    return {type(m.processor).__name__ for m in model.modules() if hasattr(m, "processor")}


def test_every_entry_is_run():
    """What patch() fuses in the installed diffusers is the table's list for its release, and the
    tests above run every entry: a whole model runs the fused processors its modules use; a
    processor case, its own."""
    import diffusers

    from rope_ext.integrations import _qk_norm_table

    fused = {s.fingerprint for name in rope_diffusers.survey() for s in rope_diffusers.model_report(name).qk_norms
             if s.fused}
    assert fused == _qk_norm_table.DIFFUSERS_RELEASES[diffusers.__version__]
    run = {}
    for name in FUSED_LAYERS:
        used = _model_processors(name)
        for s in rope_diffusers.model_report(name).qk_norms:
            if s.fused and s.method.split(".")[0] in used:
                run[s.fingerprint] = name
    for key in PROCESSOR_CASES:
        site = _site(*key.split(":"))
        assert site.fused, f"{key} is a case, but patch() does not fuse it: {site.reason}"
        run[site.fingerprint] = key
    assert set(run) == fused, f"entries no test runs: {sorted(fused - set(run))}"


@contextlib.contextmanager
def _without_entry(monkeypatch, key):
    """The table of tested fusions less one entry, as a release whose code changed would have it."""
    from rope_ext.integrations import _qk_norm_table

    table = _qk_norm_table.DIFFUSERS
    monkeypatch.setattr(_qk_norm_table, "DIFFUSERS", _qk_norm_table.Table(
        {k: v for k, v in table.tested.items() if k != key}, table.unfusable))
    rope_diffusers.model_report.cache_clear()
    rope_diffusers._fusion_sites.cache_clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        rope_diffusers.model_report.cache_clear()
        rope_diffusers._fusion_sites.cache_clear()


def test_a_processor_the_table_does_not_list_is_refused_by_fingerprint(monkeypatch):
    """Wan's processor with its entry taken out of the table: its RoPE is switched, its norms and
    RoPE run unfused, a RefusedWarning names the fingerprint; with strict=True, patch() raises and
    patches nothing."""
    from rope_ext.integrations import _engine, _qk_norm_sites

    key = _site("wan", "WanAttnProcessor.__call__").fingerprint
    model, run = _build("wan")
    with _without_entry(monkeypatch, key):
        site = _site("wan", "WanAttnProcessor.__call__")
        assert isinstance(site.refusal, _qk_norm_sites.Untested) and site.refusal.warns
        with pytest.raises(ValueError, match=f"fingerprint {key}.* not among the tested fusions.*strict=True"):
            rope_diffusers.patch(["wan"], strict=True)
        assert rope_diffusers.patched_models() == []
        monkeypatch.setattr(_engine, "_warned", set())
        warned = pytest.warns(_engine.RefusedWarning, match=f"qk-norm WanAttnProcessor.*fingerprint {key}")
        with torch.no_grad(), warned, rope_diffusers.patch(["wan"]), RopeOpSpy() as spy:
            run(model)
        assert "qk_norm_rotary" not in spy.names and spy.names, spy.names


def test_the_offline_tool_proposes_the_table(monkeypatch, capsys):
    """tools/qk_norm_table.py --library diffusers finds the sites and refusals the table records for
    the installed release, and reports an entry the table lacks as new, with its table line."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("qk_norm_table_tool", os.path.join(
        os.path.dirname(__file__), "..", "tools", "qk_norm_table.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setattr("sys.argv", ["qk_norm_table.py", "--library", "diffusers"])
    assert tool.main() == 0, capsys.readouterr().out
    key = _site("flux", "FluxAttnProcessor.__call__").fingerprint
    with _without_entry(monkeypatch, key):
        monkeypatch.setattr("sys.argv", ["qk_norm_table.py", "--library", "diffusers"])
        assert tool.main() == 1
    out = capsys.readouterr().out
    assert f"NEW fusion {key} (flux:FluxAttnProcessor, " in out, out
    assert f"\"{key}\": _attn('apply_rotary_emb', stream=_TEXT_FIRST)," in out, out


def test_the_bound_can_fail(monkeypatch):
    """A fusion that drops the norms' weights fails the float32 check, a whole model's and a processor case's."""
    import rope_ext

    real = rope_ext.qk_norm_rotary
    monkeypatch.setattr(rope_ext, "qk_norm_rotary",
                        lambda q, k, wq, wk, *a, **kw: real(q, k, None, None, *a, **kw))
    with pytest.raises(AssertionError):
        _check_parity("wan", torch.float32)
    with pytest.raises(AssertionError):
        _check_processor("flux2:Flux2AttnProcessor.__call__", torch.float32)


def test_unpatched_model_runs_no_op():
    model, run = _build("wan")
    with torch.no_grad():
        with rope_diffusers.patch(["wan"]), RopeOpSpy() as spy:
            run(model)
        assert spy.names.count("qk_norm_rotary") == 2
        with RopeOpSpy() as spy:
            run(model)
        assert spy.names == []


def test_a_hooked_norm_runs_diffusers_code():
    model, run = _build("wan")
    attn = model.blocks[0].attn1
    with torch.no_grad(), rope_diffusers.patch(["wan"], qk_norm=False):
        rope_only = run(model)
    handle = attn.norm_q.register_forward_hook(lambda *a: None)
    try:
        with torch.no_grad(), rope_diffusers.patch(["wan"]), RopeOpSpy() as spy:
            out = run(model)
    finally:
        handle.remove()
    assert spy.names.count("qk_norm_rotary") == 1  # the other block's layer
    torch.testing.assert_close(out, rope_only, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", ["hooked norm_added_q", "tables of one row"])
def test_a_double_stream_block_the_fusion_does_not_take_runs_diffusers_code(case):
    """Flux's double-stream block where one stream's checks fail (its text norm hooked), or where the
    tables are not the joined sequence's rows (one row for every token, which diffusers' RoPE
    broadcasts): diffusers' code (both streams' norms, the cat, RoPE) bit for bit, and no fused op;
    the block as built fuses both streams."""
    from test_diffusers_models import _flux_block

    block, args = _flux_block()

    def run(args, **kwargs):
        with torch.no_grad(), rope_diffusers.patch(["flux"], **kwargs), RopeOpSpy() as spy:
            return block(*args), spy.names

    assert run(args)[1].count("qk_norm_rotary") == 2
    handle = None
    if case == "hooked norm_added_q":
        handle = block.attn.norm_added_q.register_forward_hook(lambda *a: None)
    else:
        cos, sin = args[3]
        args = (*args[:3], (cos[:1], sin[:1]))
    try:
        stock, _ = run(args, qk_norm=False)
        out, names = run(args)
    finally:
        if handle is not None:
            handle.remove()
    assert "qk_norm_rotary" not in names and names, names
    assert len(out) == len(stock) == 2 and all(torch.equal(o, s) for o, s in zip(out, stock, strict=True))


@pytest.mark.parametrize("case", ["hooked norm_k", "cross-attention", "autocast", "no norms"])
def test_a_slice_in_place_processor_the_fusion_does_not_take_runs_diffusers_code(case):
    """A processor that writes RoPE into the image rows of q and k, where the fused call must not
    run: a norm hooked (CogVideoX), k left unrotated in cross-attention (CogVideoX's condition), a
    bfloat16 CogView4 under autocast (its LayerNorms' results cast: CUDA's autocast runs them in
    float32, so under autocast neither the deferral nor the fused op is taken), or no q/k norms.
    diffusers' code bit for bit (its norms, RoPE written into the slices), and no fused op; the
    module as built fuses."""
    import diffusers_processor_cases_3 as cases

    key = ("cogview4:CogView4AttnProcessor.__call__" if case == "autocast" else
           "attention_processor:CogVideoXAttnProcessor2_0.__call__")
    module, run = cases.CASES[key].build()
    if case == "autocast":  # (q and k then of the cast's dtype, as the call's check needs to be reached)
        module = module.to(torch.bfloat16)
    name = key.split(":")[0]

    def outputs(**kwargs):
        with torch.no_grad(), rope_diffusers.patch([name], **kwargs), RopeOpSpy() as spy, (
                torch.autocast("cpu", dtype=torch.bfloat16) if case == "autocast" else contextlib.nullcontext()):
            return run(module), spy.names

    if case != "autocast":
        assert outputs()[1].count("qk_norm_rotary") == 1
    handle = None
    if case == "hooked norm_k":
        handle = module.norm_k.register_forward_hook(lambda *a: None)
    elif case == "cross-attention":
        module.is_cross_attention = True
    elif case == "no norms":
        module.norm_q = module.norm_k = None
    try:
        stock, _ = outputs(qk_norm=False)
        out, names = outputs()
    finally:
        if handle is not None:
            handle.remove()
    assert "qk_norm_rotary" not in names and names, names
    assert torch.equal(out, stock)


def test_defers_cast_says_where_the_fused_calls_norms_return_the_casts_dtype(monkeypatch):
    """What a site whose norms' results are cast (CogView4's ``.to(dtype=dtype)``) asks the fused
    call before deferring them: torch's LayerNorm returns x's dtype with parameters of x's dtype and
    autocast off (deferred), but not under autocast (CUDA's runs layer_norm in float32; faked here, as
    this machine has no GPU), nor with float32 parameters for bfloat16 x, nor hooked; q or k not
    already of the cast's dtype is never deferred; a norm that is None is no obstacle."""
    import types

    call = _qk_norm_call.fused(rope_diffusers._fused_norms("cogview4"), None, lambda *a, **k: None, pair=True)
    bf16 = torch.bfloat16
    q, k = torch.randn(2, 3, 16, dtype=bf16), torch.randn(2, 3, 16, dtype=bf16)

    def attention(norm_q=True, dtype=bf16):
        return types.SimpleNamespace(norm_q=torch.nn.LayerNorm(16).to(dtype) if norm_q else None,
                                     norm_k=torch.nn.LayerNorm(16).to(dtype))

    def defers(module, q=q, dtype=bf16):
        return call.defers_cast(module, "norm_q", "norm_k", q, k, dtype)

    assert defers(attention()) and defers(attention(norm_q=False))
    assert not defers(attention(), q=q.float()) and not defers(attention(), dtype=torch.float32)
    assert not defers(attention(dtype=torch.float32))  # (float32 weight and bias, bfloat16 x)
    hooked = attention()
    hooked.norm_k.register_forward_hook(lambda *a: None)
    assert not defers(hooked)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: True)
    assert not defers(attention())


def test_q_and_k_rotated_by_tables_of_their_own_are_a_call_each():
    """LTX-2's processor: self-attention (k's tables are q's: one qk_norm_rotary call), audio-to-video
    cross-attention (k's tables its own: one norm_rotary call per tensor, each with its norm and its
    tables), then a split-RoPE attention (no fused call: the norms, then RoPE switched). The
    processor case checks the outputs and gradients against diffusers'."""
    import diffusers_processor_cases_3 as cases

    module, run = cases.CASES["ltx2:LTX2AudioVideoAttnProcessor.__call__"].build()
    with torch.no_grad(), rope_diffusers.patch(["ltx2"]), RopeOpSpy() as spy:
        run(module)
    assert spy.names == ["qk_norm_rotary", "norm_rotary", "norm_rotary", "rotary", "rotary"], spy.names


def test_a_norm_of_a_form_only_with_an_attribute_set_is_not_fused_without_it():
    """Stable Audio 3's norm is of its form only with force_fp32 (without it, it computes in x's
    dtype): with it off, both its attentions run diffusers' code bit for bit, and no fused op."""
    import diffusers_processor_cases_2 as cases

    module, run = cases.CASES["stable_audio3:StableAudio3SelfAttnProcessor.__call__"].build()
    module = module.to(torch.bfloat16)

    def outputs(**kwargs):
        with torch.no_grad(), rope_diffusers.patch(["stable_audio3"], **kwargs), RopeOpSpy() as spy:
            return run(module), spy.names

    assert outputs()[1].count("qk_norm_rotary") == 3
    for norm in (m for m in module.modules() if type(m).__name__ == "StableAudio3RMSNorm"):
        norm.force_fp32 = False
    stock, _ = outputs(qk_norm=False)
    out, names = outputs()
    assert "qk_norm_rotary" not in names and names, names
    assert torch.equal(out, stock)


def test_compiled_flux_single_block_is_one_graph():
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed, FluxSingleTransformerBlock

    torch.manual_seed(0)
    block = FluxSingleTransformerBlock(dim=32, num_attention_heads=2, attention_head_dim=16).eval()
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(6.0), indexing="ij"), -1)
    rotary = FluxPosEmbed(theta=10000, axes_dim=[4, 6, 6])(ids.reshape(24, 3))
    args = (_randn(2, 19, 32, seed=1), _randn(2, 5, 32, seed=2), _randn(2, 32, seed=3), rotary)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad(), rope_diffusers.patch(["flux"]):
        eager = block(*args)
        out = torch.compile(block, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1 and graphs[0].code.count("rope_ext.qk_norm_rotary") == 1
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


def test_listing_says_which_are_fused(capsys):
    rope_diffusers.main()
    out = capsys.readouterr().out
    assert re.search(r"qk-norm WanAttnProcessor\.__call__: fused, over all heads of a token", out)
    assert re.search(r"qk-norm FluxAttnProcessor\.__call__: fused, over each head; with the "
                     r"encoder_query/encoder_key stream it joins in front of q and k", out)
    assert re.search(r"qk-norm CogView4AttnProcessor\.__call__: fused, over each head, RoPE written into the rows "
                     r"of dim 2 from text_seq_length on", out)
    assert re.search(r"qk-norm Ideogram4AttnProcessor\.__call__: fused, over each head", out)  # (RoPE inline)
    assert re.search(r"qk-norm Cosmos3AttnProcessor\.__call__: not fused: `k_und_for_gen = ", out)
    counts = re.search(r"(\d+) have processors that normalize q and k and apply RoPE; (\d+) fuse them", out)
    assert int(counts[2]) >= 34  # of 0.42.1's 43


def test_fused_tables_read_what_the_replacements_read():
    """Each signature's tables_of gives the tables its replacement rotates with: rotating by them
    equals the replacement, for the shared function in both pairings and the complex form, Wan's
    strided tables and RoPE written inline."""
    from rope_ext.integrations._rotate import rotate

    gen = torch.Generator().manual_seed(5)
    bshd, bhsd = torch.randn(2, 6, 3, 16, generator=gen), torch.randn(2, 3, 6, 16, generator=gen)
    angles = torch.randn(6, 8, generator=gen)
    full = torch.cat((angles, angles), -1)
    strided = angles.repeat_interleave(2, -1)[None, :, None]
    cases = {
        "diffusers": [(bhsd, (full.cos(), full.sin())), (bshd, (full.cos(), full.sin()), True, -2, 1),
                      (bshd, torch.polar(torch.ones(2, 6, 8), angles.expand(2, 6, 8)), False)],
        "strided cos/sin": [(bshd, strided.cos(), strided.sin())],
        "inline x * cos + rotate_half(x) * sin": [(bshd, full.cos()[None, :, None], full.sin()[None, :, None])],
    }
    for signature, calls in cases.items():
        form = next(f for f in _diffusers_forms.KNOWN.values() if f.signature == signature)
        replacement = _diffusers_forms.replacement(form)
        tables_of = _diffusers_forms.FUSED_TABLES[signature](form)
        for x, *args in calls:
            got = tables_of(x, *args)
            assert got is not None, (signature, args)
            table_form, cos, sin = got
            torch.testing.assert_close(rotate(table_form, (x,), cos, sin)[0], replacement(x, *args), atol=0, rtol=0)
