"""Each RoPE form rope_ext recognises in diffusers' model files, against diffusers' own function of
that form: outputs, output dtypes and gradients, on random tables that need not be consistent, in
float32, bfloat16 and float64, with float32 tables for bfloat16 input; rope_ext.compat.diffusers'
apply_rotary_emb over every combination of its arguments. Also: every model file with RoPE is
classified, patching switches each kind of site and restores it, and unknown code is refused."""
from __future__ import annotations

import functools
import importlib
import types

import form_checks
import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from rope_ext.compat import diffusers as compat  # noqa: E402
from rope_ext.integrations import _diffusers_forms, _engine  # noqa: E402
from rope_ext.integrations import diffusers as rope_diffusers  # noqa: E402

B, S, H, D = 2, 5, 3, 12
rand = form_checks.rand


@pytest.fixture(autouse=True)
def nothing_patched():
    """Each test starts and ends with diffusers' own code (a leaked patch would make a test compare
    rope_ext with itself)."""
    assert rope_diffusers.patched_models() == []
    yield
    assert rope_diffusers.patched_models() == []


def _original_of(fn: rope_diffusers.RopeFunction):
    """diffusers' own function for a site (an inner function rebuilt from its method's code)."""
    module = importlib.import_module(fn.module)
    if fn.kind == "inline":  # the statement the processor writes, with the file's own helper
        helper = module._rotate_half
        return lambda x, cos, sin: x * cos + helper(x) * sin
    if fn.kind != "inner":
        return getattr(module, fn.name)
    cls, method, inner = fn.name.split(".")
    code = _engine.inner_code(getattr(getattr(module, cls), method), inner)
    return types.FunctionType(code, module.__dict__, inner)


def _one_site_per_fingerprint():
    seen = {}
    for name, report in rope_diffusers.survey().items():
        for fn in report.functions:
            if fn.kind in ("function", "inner", "inline") and fn.form is not None:
                key = _engine.fingerprint(*_function_nodes(name, "_rotate_half" if fn.kind == "inline" else fn.name))
                seen.setdefault(key, (f"{name}.{fn.name}", fn))
    return dict(seen.values())


def _function_nodes(name, qualname):
    tree, _ = rope_diffusers._parsed(name)
    return _engine.module_definitions(tree), dict(_engine.function_defs(tree))[qualname]


SITES = _one_site_per_fingerprint()


def _complex(*shape, dtype, gen):
    real = rand(*shape, dtype=torch.float64, gen=gen)
    imag = rand(*shape, dtype=torch.float64, gen=gen)
    return torch.complex(real, imag).to(torch.complex128 if dtype == torch.float64 else torch.complex64)


def _inputs(sig, x_dtype, t_dtype, gen, variant):
    """(args, indices of the differentiable args) for a call of one signature."""
    def x(*shape):
        return rand(*shape, dtype=x_dtype, gen=gen)

    def t(*shape):
        return rand(*shape, dtype=t_dtype, gen=gen)

    if sig == "diffusers":
        if variant == "complex":
            return (x(B, S, H, D), _complex(B, S, D // 2, dtype=t_dtype, gen=gen), False), (0,)
        unbind, seq = variant
        xs = x(B, S, H, D) if seq == 1 else x(B, H, S, D)
        return (xs, (t(S, D), t(S, D)), True, unbind, seq), (0,)
    if sig == "qwen":
        if variant == "complex":
            return (x(B, S, H, D), _complex(S, D // 2, dtype=t_dtype, gen=gen), False), (0,)
        return (x(B, H, S, D), (t(S, D), t(S, D)), True, variant), (0,)
    if sig == "complex as given":
        return (x(B, S, H, D), _complex(S, 1, D // 2, dtype=t_dtype, gen=gen)), (0,)
    if sig == "complex unsqueeze(2)":
        return (x(B, S, H, D), _complex(B, S, D // 2, dtype=t_dtype, gen=gen)), (0,)
    if sig == "complex, permuted x":  # Sana-WM's (B, H, D, S) x is a transposed view of (B, H, S, D)
        return (x(B, H, S, D).transpose(-1, -2), _complex(S, D // 2, dtype=t_dtype, gen=gen)), (0,)
    if sig == "strided cos/sin":
        return (x(B, S, H, D), t(1, S, 1, D), t(1, S, 1, D)), (0, 1, 2)
    if sig == "cat(cos, sin), strided":
        return (x(B, S, H, D), t(B, S, 2 * D)), (0, 1)
    if sig == "mochi":
        return (x(B, S, H, D), t(S, H, D // 2), t(S, H, D // 2)), (0, 1, 2)
    if sig == "angles, prefix":
        return (x(B, S, H, D), t(B, S, 1, D // 2)), (0, 1)
    if sig == "angles, last rows":
        return (x(B, S, H, D), t(S + 2, D // 2)), (0, 1)
    if sig == "2x2 matrices, q and k":
        return (x(B, S, H, D), x(B, S, H, D), t(B, S, 1, D // 2, 2, 2)), (0, 1, 2)
    if sig == "2x2 matrices, to x's device":
        return (x(B, S, H, D), t(B, S, 1, D // 2, 2, 2)), (0, 1)
    if sig == "2x2 matrices":
        return (x(B, S, H, D), t(S, 1, D // 2, 2, 2)), (0, 1)
    if sig == "(cos, sin) viewed":
        return (x(B, S, H, D), x(B, S, H, D), (t(S, D), t(S, D))), (0, 1)
    if sig == "(cos, sin) batched":
        return (x(B, S, H, D), x(B, S, H, D), (t(B, S, D), t(B, S, D))), (0, 1)
    if sig == "(cos, sin) per row":
        return (x(B, S, H, D), (t(S, D), t(S, D))), (0,)
    if sig == "flattened heads":
        return (x(B, S, H * D), (t(B, S, H * D), t(B, S, H * D))), (0,)
    if sig == "split, half tables":
        if variant == "flat":
            return (x(B, S, H * D), (t(B, H, S, D // 2), t(B, H, S, D // 2))), (0,)
        return (x(B, H, S, D), (t(B, H, S, D // 2), t(B, H, S, D // 2))), (0,)
    if sig in ("cos, sin in x's dtype",):
        return (x(B, S, H, D), t(S, D // 2), t(S, D // 2)), (0, 1, 2)
    if sig == "(cos, sin) in x's dtype":
        return (x(B, S, H, D), (t(S, D // 2), t(S, D // 2))), (0,)
    if sig == "allegro":
        d = variant
        pos = [torch.randint(0, 7, (B, S), generator=gen) for _ in range(3)]
        widths = [c.shape[-1] for c in torch.empty(d).chunk(3)]
        return (x(B, H, S, d), tuple((t(7, w), t(7, w)) for w in widths), pos), (0,)
    if sig == "inline x * cos + rotate_half(x) * sin":
        return (x(B, S, H, D), t(1, S, 1, D), t(1, S, 1, D)), (0, 1, 2)
    if sig == "grid loop":  # tokens (f, h, w) grids of two samples, padded to 14 tokens; 6 pairs split 2/2/2
        grids = torch.tensor([[2, 2, 3], [1, 3, 3]])
        return (x(B, 14, H, D), grids, _complex(5, D // 2, dtype=t_dtype, gen=gen), variant), (0,)
    raise AssertionError(f"no inputs for signature {sig!r}")


VARIANTS = {
    "diffusers": [(-1, 1), (-1, 2), (-2, 1), (-2, 2), "complex"],
    "qwen": [-1, -2, "complex"],
    "split, half tables": ["4d", "flat"],
    "allegro": [12, 16],
    "grid loop": [1, 2],  # time_stride
}
DTYPES = {
    "f32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16-f32-tables": (torch.bfloat16, torch.float32),
    "f64": (torch.float64, torch.float64),
}
CASES = [(key, v) for key, fn in SITES.items() for v in VARIANTS.get(fn.form.signature, [None])]

# Forms whose originals round differently from a multiply-add per term: complex multiplies (torch
# may fuse a product and a sum) and addcmul_ (LTX-2's split form). They are held to the rounding
# bound, not to bit equality.
_NOT_BITWISE = {"complex as given", "complex unsqueeze(2)", "complex, permuted x", "split, half tables"}


def _tensors(args):
    for a in args:
        if isinstance(a, (tuple, list)):
            yield from _tensors(a)
        elif isinstance(a, torch.Tensor):
            yield a


def _leaves(args, diff):
    """args with the tensors of the differentiable positions made leaves requiring grad."""
    def prep(a, grad):
        if isinstance(a, (tuple, list)):
            return type(a)(prep(t, grad) for t in a)
        if isinstance(a, torch.Tensor) and (a.dtype.is_floating_point or a.dtype.is_complex):
            return a.clone().requires_grad_(grad and a.dtype.is_floating_point)
        return a
    return [prep(a, i in diff) for i, a in enumerate(args)]


@pytest.mark.parametrize("dtypes", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("key,variant", CASES)
def test_form_matches_diffusers(key, variant, dtypes):
    """rope_ext's function against diffusers' own on the same inputs: the same output dtypes and
    shapes, outputs and input gradients within one rounding of diffusers' function run on the
    inputs widened to float64 (where the form narrows to float32 itself, float32's roundings,
    which the bound's 2^-20 term covers), and bit-identical float32/float64 results where the
    original rounds the same products and sums."""
    fn = SITES[key]
    original, ours = _original_of(fn), fn.replacement
    form = fn.form
    x_dtype, t_dtype = dtypes
    gen = torch.Generator().manual_seed(0)
    args, diff = _inputs(form.signature, x_dtype, t_dtype, gen, variant)
    args = _leaves(args, diff)
    wide = form_checks.wide(args)
    truth_fn = original
    if form.signature in _TABLES_IN_X_DTYPE:  # the form rounds its tables to x's dtype: so does the truth
        if form.signature == "angles, prefix":
            truth_fn = functools.partial(_angles_prefix_truth, x_dtype=x_dtype)
        else:
            wide = [wide[0]] + [_rounded_leaf(a, x_dtype) for a in wide[1:]]
    ref = form_checks.outputs(original(*args))
    got = form_checks.outputs(ours(*args))
    truth = form_checks.outputs(truth_fn(*wide))
    inputs = [t for i in diff for t in _tensors([args[i]]) if t.requires_grad]
    wide_inputs = [t for i in diff for t in _tensors([wide[i]]) if t.requires_grad]
    got_grads = torch.autograd.grad(form_checks.loss(got), inputs, allow_unused=True)
    truth_grads = torch.autograd.grad(form_checks.loss(truth), wide_inputs, allow_unused=True)
    assert len(got) == len(ref) == len(truth)
    for g, r, t in zip(got, ref, truth, strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape
        form_checks.within_rounding(g, t, g.dtype)
        if g.dtype in (torch.float32, torch.float64) and form.signature not in _NOT_BITWISE and variant != "complex":
            assert torch.equal(g, r), f"differs from diffusers by up to {(g - r).abs().max().item():.3g}"
        elif g.dtype == torch.float64:
            # float64 results of the forms above: within a few float64 roundings of diffusers' own, which
            # tells a float64 computation from a float32 one (2^-24 apart) and x narrowed from not
            bound = 8 * torch.finfo(torch.float64).eps * r.detach().abs().max()
            assert (g - r).abs().max() <= bound, f"differs from diffusers by {(g - r).abs().max().item():.3g}"
    x_max = max(t.abs().max().item() for t in _tensors(args[:2]) if t.dtype.is_floating_point)
    x_numel = next(_tensors(args)).numel()
    for g, t, i in zip(got_grads, truth_grads, inputs, strict=True):
        assert (g is None) == (t is None)
        if g is None:
            continue
        # a table's gradient is summed in 16 bits where the table is 16-bit or is cast to x's 16-bit dtype
        summed_in = i.dtype if i.dtype.itemsize == 2 else x_dtype if form.signature in _TABLES_IN_X_DTYPE else None
        if summed_in is not None and summed_in.itemsize == 2 and i.numel() < x_numel:
            _within_summation(g, t, i, x_numel, x_max, summed_in)
        else:
            form_checks.within_rounding(g, t, i.dtype)


# Forms that cast their tables to x's dtype before the rotation (ERNIE-Image's angles, MiniMax's
# tables): their float64 truth takes the tables rounded so too.
_TABLES_IN_X_DTYPE = {"angles, prefix", "cos, sin in x's dtype", "(cos, sin) in x's dtype"}


def _rounded_leaf(a, dtype):
    """A float64 leaf holding a's values rounded to dtype (tuples element by element)."""
    if isinstance(a, (tuple, list)):
        return type(a)(_rounded_leaf(t, dtype) for t in a)
    return a.detach().to(dtype).double().requires_grad_(a.requires_grad)


def _angles_prefix_truth(x, angles, x_dtype):
    """ERNIE-Image's rotation written out in float64: cos and sin of the angles rounded to x's dtype
    rotate the first angles.shape[-1] columns, half-split (the cast passes gradients through)."""
    r = angles.shape[-1]
    cos, sin = angles.cos().to(x_dtype).double(), angles.sin().to(x_dtype).double()
    head, rest = x[..., :r], x[..., r:]
    first, second = head.chunk(2, dim=-1)
    return torch.cat((head * cos + torch.cat((-second, first), dim=-1) * sin, rest), dim=-1)


def _within_summation(got, truth, table, x_numel, x_max, dtype):
    """A 16-bit table's gradient (or one cast to 16-bit x's dtype) sums, over the dims the table
    broadcasts along, 16-bit products of
    the output gradient (|w| <= 1) and x or R(x) (at most x_max; the angle forms' derivatives
    multiply by |sin|, |cos| <= 1, and add two such terms). Each of the n = 2 x.numel() /
    table.numel() products rounds with relative error eps, so the sum is off by at most
    n eps x_max, and its last rounding adds eps |truth|."""
    eps = torch.finfo(dtype).eps
    n = 2 * -(-x_numel // table.numel())
    got, truth = got.detach().double(), truth.detach().double()
    bad = (got - truth).abs() > eps * truth.abs() + n * eps * x_max
    assert not bad.any(), f"{int(bad.sum())} gradient entries off by up to {(got - truth).abs().max().item():.3g}"


def test_compat_is_diffusers_shared_function_everywhere():
    """rope_ext.compat.diffusers.apply_rotary_emb is the shared form's replacement; its errors name
    the argument."""
    assert SITES["embeddings.apply_rotary_emb"].replacement is compat.apply_rotary_emb
    x = torch.randn(B, H, S, D)
    tables = (torch.randn(S, D), torch.randn(S, D))
    with pytest.raises(ValueError, match="sequence_dim must be 1 or 2, got 3"):
        compat.apply_rotary_emb(x, tables, sequence_dim=3)
    with pytest.raises(ValueError, match="use_real_unbind_dim must be -1 or -2, got 0"):
        compat.apply_rotary_emb(x, tables, use_real_unbind_dim=0)
    with pytest.raises(TypeError, match=r"freqs_cis must be a \(cos, sin\) pair .* got Tensor of length 5"):
        compat.apply_rotary_emb(x, tables[0])
    with pytest.raises(TypeError, match=r"freqs_cis must be a \(cos, sin\) pair .* got float"):
        compat.apply_rotary_emb(x, 1.0)


def test_compat_complex_has_no_complex_op():
    """Lumina's complex freqs_cis is rotated from its real and imaginary parts: no complex multiply
    runs (what Inductor cannot generate code for)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.append((str(func), any(getattr(t, "is_complex", lambda: False)() for t in _tensors(outputs_of(out)))))
            return out

    def outputs_of(out):
        return out if isinstance(out, (tuple, list)) else [out]

    freqs = torch.polar(torch.ones(B, S, D // 2), torch.randn(B, S, D // 2))
    with Ops():
        compat.apply_rotary_emb(torch.randn(B, S, H, D), freqs, use_real=False)
    assert any("rope_ext" in f for f, _ in seen)
    assert not [f for f, complex_out in seen if complex_out], seen


# --- classification and patching ------------------------------------------------------------------


def _files_by_text():
    """Model files that define a RoPE application (or a rotate_half) or import diffusers' shared
    one, found by plain text search (not by the classifier under test)."""
    import os
    import re

    root = os.path.join(os.path.dirname(diffusers.__file__), "models", "transformers")
    found = set()
    for file in os.listdir(root):
        if file.endswith(".py"):
            text = open(os.path.join(root, file), encoding="utf-8").read()
            imports = re.findall(r"from \S*embeddings import (\([^)]*\)|[^\n]*)", text)
            if re.search(r"def _?(apply_\w*(rot|rope)\w*|rope_apply|rotate_half)\(", text) or any(
                    re.search(r"\bapply_rotary_emb\b", i) for i in imports):
                found.add(file[:-3].removeprefix("transformer_"))
    return found


# What each tested diffusers release holds, as its listing showed: the model files with RoPE
# (their own function, or diffusers' shared one imported), those reaching it only through another
# file's processor, block or model, the controlnets, the files refused (0.41.0's QwenImage adds an
# `apply_rotary_emb_qwen_neuron` no form matches), and the forms of the table it has no file of.
RELEASES = {
    "0.42.1": dict(with_rope=51, reached_only=11, refused=set(), lacks=set(),
                   controlnets={"controlnet_cosmos", "controlnet_flux", "controlnet_qwenimage", "controlnet_z_image"}),
    "0.41.0": dict(with_rope=45, reached_only=11, refused={"qwenimage"},
                   lacks={"complex, (B, H, D, S) x", "float32 2x2 matrices"},
                   controlnets={"controlnet_cosmos", "controlnet_flux", "controlnet_z_image"}),
}


def test_every_model_file_is_classified():
    release = RELEASES[diffusers.__version__]  # the releases rope_ext is tested with
    reports = rope_diffusers.survey()
    model_files = {n for n, r in reports.items() if ".transformers." in r.module}
    with_rope = {n for n in model_files if reports[n].functions or "embeddings" in reports[n].reaches}
    assert with_rope == _files_by_text()
    assert len(with_rope) == release["with_rope"]
    for name, report in reports.items():
        for fn in report.functions:
            assert (fn.form is None) != (fn.reason is None), (name, fn)
        assert report.patchable or report.reason, name
    assert {n for n, r in reports.items() if not r.patchable} == release["refused"]
    # the model files that reach RoPE only through another file's classes: processors (CogVideoX's in
    # attention_processor), blocks (HunyuanVideo-Framepack builds HunyuanVideo's), a model (Wan-VACE)
    reached_only = model_files - with_rope
    assert len(reached_only) == release["reached_only"]
    assert {"cogvideox_transformer_3d", "hunyuan_video_framepack", "wan_vace"} <= reached_only
    assert {n for n, r in reports.items() if ".controlnets." in r.module} == release["controlnets"]
    used = {fn.form for r in reports.values() for fn in r.functions}
    assert {f.name for f in set(_diffusers_forms.KNOWN.values()) - used} == release["lacks"]


def test_patch_switches_every_kind_of_site_and_restores():
    import diffusers.models.embeddings as embeddings
    import diffusers.models.transformers.transformer_flux as flux
    import diffusers.models.transformers.transformer_ltx as ltx
    import diffusers.models.transformers.transformer_wan as wan

    stock = (flux.apply_rotary_emb, embeddings.apply_rotary_emb, ltx.apply_rotary_emb,
             wan.WanAttnProcessor.__call__.__code__)
    with rope_diffusers.patch(["flux", "ltx", "wan", "cogvideox_transformer_3d"]) as done:
        # CogVideoX's processor lives in attention_processor (which also exposes Flux's processor)
        assert set(done) == {"flux", "ltx", "wan", "attention_processor", "embeddings", "cogvideox_transformer_3d"}
        assert flux.apply_rotary_emb is compat.apply_rotary_emb
        assert embeddings.apply_rotary_emb is compat.apply_rotary_emb  # CogVideoX's processor imports it when called
        assert ltx.apply_rotary_emb.__module__ == _diffusers_forms.__name__
        assert wan.WanAttnProcessor.__call__.__code__ is not stock[3]
        with rope_diffusers.patch(["flux"]) as inner:
            assert inner == []  # already patched: the outer call keeps it
        assert flux.apply_rotary_emb is compat.apply_rotary_emb
    assert (flux.apply_rotary_emb, embeddings.apply_rotary_emb, ltx.apply_rotary_emb,
            wan.WanAttnProcessor.__call__.__code__) == stock
    assert rope_diffusers.patched_models() == []


def test_a_file_that_fails_to_install_leaves_every_other_switched(monkeypatch):
    """LTX's function was replaced by someone else and Flux's fused processor fails to rewrite
    (forced): patch() of everything switches every other file, Flux's RoPE without its fusion, and
    names both in one warning; strict=True raises."""
    import warnings

    import diffusers.models.transformers.transformer_flux as flux
    import diffusers.models.transformers.transformer_ltx as ltx

    from rope_ext.integrations import _engine, _qk_norm_sites

    real = _qk_norm_sites.rewrite_plan

    def failing(group, *args, **kwargs):
        if group == "flux":
            raise RuntimeError("forced")
        return real(group, *args, **kwargs)

    monkeypatch.setattr(_qk_norm_sites, "rewrite_plan", failing)
    monkeypatch.setattr(ltx, "apply_rotary_emb", lambda x, freqs: x)
    monkeypatch.setattr(_engine, "_warned", set())
    stock = flux.FluxAttnProcessor.__call__.__code__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched = rope_diffusers.patch()
    try:
        reaching_ltx = {n for n in rope_diffusers.survey() if "ltx" in rope_diffusers._closure([n])}
        assert "ltx" in reaching_ltx and not set(patched) & reaching_ltx
        others = {n for n, r in rope_diffusers.survey().items() if r.patchable} - reaching_ltx
        assert set(patched) == others and len(others) >= 50
        # (one warning for them; a release whose code matches no form has had one of its own before)
        refusals = [str(w.message) for w in caught if issubclass(w.category, _engine.RefusedWarning)
                    and "ltx" in str(w.message)]
        assert len(refusals) == 1, refusals
        assert "ltx: transformer_ltx.apply_rotary_emb is" in refusals[0].replace("diffusers.models.transformers.", "")
        assert "flux (qk-norm FluxAttnProcessor.__call__): rope_ext could not rewrite it: RuntimeError: forced" \
            in refusals[0]
        assert flux.apply_rotary_emb is compat.apply_rotary_emb  # Flux's RoPE switched
        assert flux.FluxAttnProcessor.__call__.__code__ is stock  # without the fusion
    finally:
        rope_diffusers.unpatch()
    with pytest.raises(ValueError, match=r"keep their own code: .*ltx: .*\(strict=True: nothing was patched\)"):
        rope_diffusers.patch(strict=True)
    assert rope_diffusers.patched_models() == []


def test_a_file_reaching_rope_unpatches_by_its_name():
    with rope_diffusers.patch(["hunyuan_video_framepack"], qk_norm=False) as done:
        assert done == ["embeddings", "hunyuan_video_framepack"]
        assert rope_diffusers.patched_models() == done
    with rope_diffusers.patch(["hunyuan_video_framepack"]) as done:  # and the fusion in HunyuanVideo's processor
        assert set(done) == {"hunyuan_video", "embeddings", "hunyuan_video_framepack"}
    with rope_diffusers.patch("cogvideox_transformer_3d"):
        assert rope_diffusers.unpatch(["cogvideox_transformer_3d"])[0] == "cogvideox_transformer_3d"
        assert rope_diffusers.patched_models() == []
    with pytest.raises(ValueError, match=r"cannot unpatch \['no_such_model'\]: no model file of that name"):
        rope_diffusers.unpatch("no_such_model")


def test_a_file_imported_while_patched_keeps_diffusers_function():
    """diffusers imports its model files lazily: one first imported while embeddings' shared function
    is switched would bind rope_ext's, and keep it after unpatch; patch() imports them first."""
    import subprocess
    import sys

    code = ("import sys\nfrom rope_ext.integrations import diffusers as d\nfrom rope_ext.compat import diffusers as c\n"
            "d.patch(['hunyuan_video'])\nimport diffusers.models.transformers.transformer_flux as f\n"
            "d.unpatch()\nsys.exit(f.apply_rotary_emb is c.apply_rotary_emb)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_unpatch_keeps_the_holders_a_running_call_needs():
    """A processor already running patched code when another thread unpatches still finds the
    replacement it calls: the module globals the trampolines use stay."""
    import diffusers.models.transformers.transformer_wan as wan

    with rope_diffusers.patch(["wan"]):
        holders = {n: getattr(wan, n) for n in vars(wan) if n.startswith("_rope_ext_")}
    assert holders and all(getattr(wan, n) is f for n, f in holders.items())
    assert not any(n in wan.WanAttnProcessor.__call__.__code__.co_names for n in holders)


def test_compat_takes_what_diffusers_takes():
    """A stacked (2, S, D) tensor as the (cos, sin) pair, and real freqs_cis with use_real=False
    (diffusers multiplies the pairs by it): the same results as diffusers."""
    from diffusers.models.embeddings import apply_rotary_emb as stock

    x, stacked = torch.randn(B, H, S, D), torch.randn(2, S, D)
    assert torch.equal(compat.apply_rotary_emb(x, stacked), stock(x, stacked))
    x, real = torch.randn(B, S, H, D), torch.randn(B, S, D // 2)
    assert torch.equal(compat.apply_rotary_emb(x, real, use_real=False), stock(x, real, use_real=False))


def test_patched_wan_processor_runs_the_op_and_matches():
    """The trampoline in Wan's processor: the processor's own code runs, with rope_ext's function
    in place of its inner one."""
    from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

    torch.manual_seed(0)
    attn = WanAttention(dim=24, heads=2, dim_head=12, processor=WanAttnProcessor())
    x = torch.randn(1, 6, 24)
    angles = torch.randn(1, 6, 1, 6).repeat_interleave(2, dim=-1)
    rotary = (angles.cos(), angles.sin())
    stock = attn(x, rotary_emb=rotary)
    ran = []
    with rope_diffusers.patch(["wan"]), torch.profiler.profile() as prof:
        got = attn(x, rotary_emb=rotary)
    ran = [e.name for e in prof.events() if e.name.startswith("rope_ext::")]
    assert ran
    torch.testing.assert_close(got, stock, rtol=0, atol=1e-6)


def test_patched_inline_rotation_runs_the_op_and_matches():
    """Ideogram 4's processor rotates inline (`query = (query * cos) + (_rotate_half(query) * sin)`):
    those statements become op calls, the rest of the processor runs as written."""
    from diffusers.models.transformers import transformer_ideogram4 as ideogram4

    torch.manual_seed(0)
    attn = ideogram4.Ideogram4Attention(hidden_size=24, num_heads=2)
    x = torch.randn(1, 6, 24)
    angles = torch.randn(1, 6, 6)
    rotary = (torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin())
    stock = attn.processor(attn, x, None, rotary)
    with rope_diffusers.patch(["ideogram4"]), torch.profiler.profile() as prof:
        got = attn.processor(attn, x, None, rotary)
    assert [e.name for e in prof.events() if e.name.startswith("rope_ext::")]
    torch.testing.assert_close(got, stock, rtol=0, atol=1e-6)
    assert torch.equal(attn.processor(attn, x, None, rotary), stock)  # unpatched again


def test_unknown_code_is_refused_by_name(monkeypatch):
    """Wan's inner function with the sine's sign flipped: no tested form computes that."""
    report = rope_diffusers.model_report("wan")
    path, module = rope_diffusers._files()["wan"]
    source = open(path, encoding="utf-8").read().replace("out[..., 1::2] = x1 * sin + x2 * cos",
                                                        "out[..., 1::2] = x2 * cos - x1 * sin")
    assert report.patchable
    import ast

    monkeypatch.setattr(rope_diffusers, "_parsed", lambda name: (ast.parse(source), module))
    for cached in (rope_diffusers.model_report, rope_diffusers._site_table, rope_diffusers._fusion_sites):
        cached.cache_clear()
    try:
        refused = rope_diffusers.model_report("wan")
        assert not refused.patchable and "matches no form rope_ext is tested on" in refused.reason
        refusal = r"cannot patch 'wan': WanAttnProcessor.__call__.apply_rotary_emb: its code"
        with pytest.raises(ValueError, match=refusal):
            rope_diffusers.patch(["wan"])
        assert rope_diffusers.patched_models() == []
    finally:
        monkeypatch.undo()
        for cached in (rope_diffusers.model_report, rope_diffusers._site_table, rope_diffusers._fusion_sites):
            cached.cache_clear()


def test_listing(capsys):
    rope_diffusers.main()
    out = capsys.readouterr().out.splitlines()
    reports = rope_diffusers.survey()
    firsts = [line.split()[:2] for line in out if line and not line.startswith((" ", "diffusers "))
              and not line[0].isdigit()]  # the summary lines
    assert [f for f, _ in firsts] == list(reports)
    assert all(status == ("patched" if reports[f].patchable else "refused") for f, status in firsts)
    assert any("WanAttnProcessor.__call__.apply_rotary_emb: 'wan' form" in line for line in out)
    patched = sum(r.patchable for r in reports.values())
    assert out[-2].endswith(f"{patched} patched, {len(reports) - patched} refused")
