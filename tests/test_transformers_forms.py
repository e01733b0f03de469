"""Each RoPE form rope_ext recognises in transformers' model files, against transformers' own function
of that form: outputs, output dtypes and gradients, on random tables that need not be consistent
(rope_ext reads one table entry per column, as the eager formula does), in float64, float32,
float16 and bfloat16, with float32 tables for bfloat16 and float64 inputs (where the forms' dtype
rules differ), and in both layouts.
Also: every family of the installed transformers is classified, and code that matches no tested
form is refused."""
from __future__ import annotations

import importlib
import inspect
import itertools
import sys
import warnings

import form_checks
import pytest
import torch

from rope_ext.integrations import _engine, _hf_forms
from rope_ext.integrations import transformers as rope_hf
from rope_ext.integrations._rotate import Form

T = pytest.importorskip("transformers")

B, S, HQ, HK, D = 2, 5, 4, 2, 16


def _one_family_per_fingerprint():
    """One function per fingerprint the installed transformers has with a form: every code that
    maps to a form is compared with its own original, even where two codes map to one form."""
    seen = {}
    for family, report in rope_hf.survey().items():
        for fn in report.functions:
            if fn.form is not None:
                seen.setdefault(fn.fingerprint, (f"{family}.{fn.name}", fn.form))
    return dict(seen.values())


FORMS = _one_family_per_fingerprint()


_rand = form_checks.rand


def _table_width(form, head):
    """The table width a form's caller passes: a partial form rotates half the head here."""
    rotated = head // 2 if form.span != "whole" else head
    return rotated // 2 if form.tables == "half" else rotated


def _inputs(form, x_dtype, table_dtype, layout, gen, k_dtype=None):
    """(args, kwargs, names of the differentiable args) for a call of this form's signature."""
    sig = form.signature
    w = _table_width(form, D)
    if sig in ("qk", "qk+position_ids", "qk, k optional", "q, k=None", "qk, q on the last rows", "x", "x+position_ids",
               "qk, tables by position_ids"):
        sq = 3 if sig == "qk, q on the last rows" else S
        shape = (lambda h, s: (B, h, s, D)) if layout == "bhsd" else (lambda h, s: (B, s, h, D))
        q, k = _rand(*shape(HQ, sq), dtype=x_dtype, gen=gen), _rand(*shape(HK, S), dtype=k_dtype or x_dtype, gen=gen)
        cos, sin = _rand(B, S, w, dtype=table_dtype, gen=gen), _rand(B, S, w, dtype=table_dtype, gen=gen)
        kw = {"unsqueeze_dim": 1 if layout == "bhsd" else 2}
        if sig.startswith("x"):
            return (q, cos, sin), kw, (0,)
        if sig == "qk, tables by position_ids":  # tables of 9 positions, rows gathered per token
            positions = torch.randint(0, 9, (B, S), generator=gen)
            cos, sin = (_rand(9, w, dtype=table_dtype, gen=gen) for _ in range(2))
            return (q, k, cos, sin, positions), kw, (0, 1)
        return (q, k, cos, sin), kw, (0, 1)
    if sig == "x, rows of 4-D tables":  # tables for S + 3 positions, of which the first S apply
        x = _rand(B, HQ, S, D, dtype=x_dtype, gen=gen)
        cos, sin = (_rand(1, 1, S + 3, w, dtype=table_dtype, gen=gen) for _ in range(2))
        return (x, cos, sin), {}, (0,)
    if sig == "vision, angles":  # x (1, S, H, D); float32 angles (S, D/2), as the model's, of a long context's size
        x = _rand(1, S, HQ, D, dtype=x_dtype, gen=gen)
        return (x, _rand(S, D // 2, dtype=torch.float32, gen=gen) * 1000), {}, (0,)
    if sig == "gptj":
        t = _rand(B, S, HQ, D, dtype=x_dtype, gen=gen)
        sin, cos = (_rand(B, S, D // 2, dtype=table_dtype, gen=gen) for _ in range(2))
        return (t, sin, cos), {}, (0,)
    if sig in ("vision", "vision, 2-D tables"):
        q, k = _rand(S, HQ, D, dtype=x_dtype, gen=gen), _rand(S, HQ, D, dtype=x_dtype, gen=gen)
        return (q, k, _rand(S, w, dtype=table_dtype, gen=gen), _rand(S, w, dtype=table_dtype, gen=gen)), {}, (0, 1)
    if sig == "qk, prefix tokens pass":
        q, k = _rand(B, HQ, S + 2, D, dtype=x_dtype, gen=gen), _rand(B, HQ, S + 2, D, dtype=x_dtype, gen=gen)
        return (q, k, _rand(S, w, dtype=table_dtype, gen=gen), _rand(S, w, dtype=table_dtype, gen=gen)), {}, (0, 1)
    if sig.startswith("complex"):
        bshd = sig.startswith("complex (B, S")
        q = _rand(*((B, S, HQ, D) if bshd else (B, HQ, S, D)), dtype=x_dtype, gen=gen)
        k = _rand(*((B, S, HK, D) if bshd else (B, HK, S, D)), dtype=x_dtype, gen=gen)
        freqs = torch.complex(_rand(B, S, D // 2, dtype=torch.float32, gen=gen),
                              _rand(B, S, D // 2, dtype=torch.float32, gen=gen))
        return (q, k, freqs), {}, (0, 1)
    if sig == "qkv + position_ids":
        qkv = [_rand(B, HQ, S, D, dtype=x_dtype, gen=gen) for _ in range(3)]
        positions = torch.randint(0, 9, (B, S), generator=gen)
        cos, sin = (_rand(9, w, dtype=table_dtype, gen=gen) for _ in range(2))
        return (*qkv, cos, sin, positions), {}, (0, 1, 2)
    raise AssertionError(f"no inputs for signature {sig!r}")


def _original(key):
    family, name = key.split(".")
    report = rope_hf.survey()[family]
    fn = next(f for f in report.functions if f.name == name)
    assert rope_hf.patched_families() == []
    return getattr(importlib.import_module(fn.module), name), fn.replacement


_outputs, _loss, _wide, _within_rounding = (form_checks.outputs, form_checks.loss, form_checks.wide,
                                          form_checks.within_rounding)


# Signatures with an unsqueeze_dim take both layouts (except the one slicing rows along dim -2).
_TWO_LAYOUTS = {"qk", "qk+position_ids", "qk, k optional", "q, k=None", "x", "x+position_ids",
                "qk, tables by position_ids"}
CASES = [(key, layout) for key, form in FORMS.items()
         for layout in (("bhsd", "bshd") if form.signature in _TWO_LAYOUTS else ("bhsd",))]


DTYPES = {  # (x, tables): the models' own pairs, and float32 tables for narrower or wider x
    "f32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "f16": (torch.float16, torch.float16),
    "f64": (torch.float64, torch.float64),
    "bf16-f32-tables": (torch.bfloat16, torch.float32),
    "f64-f32-tables": (torch.float64, torch.float32),
}


@pytest.mark.parametrize("dtypes", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("key,layout", CASES)
def test_form_matches_transformers(key, layout, dtypes):
    _check(key, layout, *dtypes)


@pytest.mark.parametrize("key", [key for key, form in FORMS.items()
                                 if form.signature in _TWO_LAYOUTS - {"x", "x+position_ids"}])
def test_form_with_q_and_k_of_different_dtypes(key):
    """Not what transformers' models do, but where the forms' dtype rules differ most: some cast
    both results to q's dtype, some each to its own, some return the promoted dtype."""
    _check(key, "bhsd", torch.float32, torch.float32, k_dtype=torch.bfloat16)


def _check(key, layout, x_dtype, table_dtype, k_dtype=None):
    """rope_ext's function against transformers' own, on the same inputs: the same output dtypes and
    shapes, and outputs and input gradients within one rounding of transformers' function run on
    the inputs widened to float64 (its formula in float64 arithmetic, except where the form itself
    narrows to float32, as x.float() does: then float32's roundings, which the bound's 2^-20 term
    covers). Where the result is float32 or float64, rope_ext rounds the same products and sums as
    transformers does, in the same dtype, so the outputs are bit-identical; that is what holds the
    dtype rules (a form computed in another dtype would differ in the last bits). The complex forms
    are the exception: torch's complex multiply may fuse a product and a sum (it does on the tail
    of a vector, with AVX2), so they are held to the rounding bound only."""
    form = FORMS[key]
    original, ours = _original(key)
    gen = torch.Generator().manual_seed(0)
    args, kwargs, diff = _inputs(form, x_dtype, table_dtype, layout, gen, k_dtype)
    args = [a.clone().requires_grad_(i in diff and a.dtype.is_floating_point) for i, a in enumerate(args)]
    wide = [_wide(a) for a in args]
    ref = _outputs(original(*args, **kwargs))
    got = _outputs(ours(*args, **kwargs))
    truth = _outputs(original(*wide, **kwargs))
    got_grads = torch.autograd.grad(_loss(got), [args[i] for i in diff])
    truth_grads = torch.autograd.grad(_loss(truth), [wide[i] for i in diff])
    assert len(got) == len(ref) == len(truth)
    for g, r, t in zip(got, ref, truth, strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape
        _within_rounding(g, t, g.dtype)
        if g.dtype in (torch.float32, torch.float64) and form.tables != "complex":
            assert torch.equal(g, r), f"differs from transformers by up to {(g - r).abs().max().item():.3g}"
    for g, t in zip(got_grads, truth_grads, strict=True):
        _within_rounding(g, t, g.dtype)


# --- classification -----------------------------------------------------------------------------


def _families_by_text():
    """The families whose torch model files define a RoPE function, found by plain text search (not
    by the classifier under test); 4.x's TensorFlow and Flax files (``modeling_tf_*``,
    ``modeling_flax_*``) are not torch's."""
    import os

    import transformers.models

    root = os.path.dirname(transformers.models.__file__)
    found = set()
    for family in os.listdir(root):
        folder = os.path.join(root, family)
        if not os.path.isdir(folder):
            continue
        for file in os.listdir(folder):
            if file.startswith("modeling_") and file.endswith(".py") and not file.startswith(("modeling_tf_",
                                                                                             "modeling_flax_")):
                with open(os.path.join(folder, file), encoding="utf-8") as f:
                    text = f.read()
                if any(f"\ndef {name}(" in text for name in _hf_forms.ROPE_FUNCTIONS):
                    found.add(family)
    return found


def test_every_family_is_classified():
    """On the releases rope_ext is tested with (4.57.6, 5.23.0, 5.24.0) every family's RoPE has a
    form, and every fingerprint of the table is one the releases have: 4.x's table (KNOWN_4X) the
    4.57.6 run's, the rest exactly the 5.x runs'. So FORMS, run under each release, tests each."""
    reports = rope_hf.survey()
    assert set(reports) == _families_by_text()
    for family, report in reports.items():
        for fn in report.functions:
            assert (fn.form is None) != (fn.reason is None), (family, fn)
    refused = {family: report.reason for family, report in reports.items() if not report.patchable}
    assert not refused, refused
    found = {fn.fingerprint for r in reports.values() for fn in r.functions}
    if T.__version__.startswith("4."):
        assert set(_hf_forms.KNOWN_4X) <= found <= set(_hf_forms.KNOWN)
    else:
        assert found == set(_hf_forms.KNOWN) - set(_hf_forms.KNOWN_4X)


_FAKE_NAMES = itertools.count()


def _fake_family(tmp_path, monkeypatch, rotate_half_body, decorator=""):
    """A models folder with one family ``fakefam<n>`` (a new name each time, so that
    family_report's cache never holds another's) whose model file is llama's RoPE with the given
    rotate_half body; the classifier reads that folder instead of the installed transformers', and
    it imports as ``transformers.models.fakefam<n>.modeling_fakefam<n>``."""
    import transformers.models

    name = f"fakefam{next(_FAKE_NAMES)}"
    folder = tmp_path / name
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / f"modeling_{name}.py").write_text(
        "import torch\n\n"
        "def rotate_half(x):\n"
        f"    {rotate_half_body}\n\n"
        f"{decorator}"
        "def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):\n"
        '    """docstrings and comments do not count"""\n'
        "    cos = cos.unsqueeze(unsqueeze_dim)\n"
        "    sin = sin.unsqueeze(unsqueeze_dim)\n"
        "    q_embed = (q * cos) + (rotate_half(q) * sin)  # a comment\n"
        "    k_embed = (k * cos) + (rotate_half(k) * sin)\n"
        "    return q_embed, k_embed\n"
    )
    monkeypatch.setattr(rope_hf, "_models_root", lambda: str(tmp_path))
    monkeypatch.setattr(transformers.models, "__path__", [*transformers.models.__path__, str(tmp_path)])
    return rope_hf.survey()[name]


@pytest.fixture
def fake_family(tmp_path, monkeypatch):
    """_fake_family(tmp_path / folder, ...), the fake modules imported forgotten after the test."""
    yield lambda *args, folder=".", **kwargs: _fake_family(tmp_path / folder, monkeypatch, *args, **kwargs)
    for name in [m for m in sys.modules if m.startswith("transformers.models.fakefam")]:
        del sys.modules[name]


def _import(report):
    return importlib.import_module(report.functions[0].module)


_LLAMA = Form("llama", "qk")


def test_llama_form_written_afresh_is_recognised(fake_family):
    report = fake_family("x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n"
                         "    return torch.cat((-x2, x1), dim=-1)")
    assert report.patchable and report.functions[0].form == _LLAMA


_LLAMA_ROTATE_HALF = ("x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n"
                      "    return torch.cat((-x2, x1), dim=-1)")


def test_same_text_different_helpers_are_different_forms(fake_family):
    """llama's apply_rotary_pos_emb text with blt's rotate_half (interleaved pairs) and with
    nanochat's (the rotation by -theta), as those families' files write them, are other forms."""
    blt = fake_family("# Split and rotate. Note that this function is different from e.g. Llama.\n"
                      "    x1 = x[..., ::2]\n    x2 = x[..., 1::2]\n"
                      "    rot_x = torch.stack([-x2, x1], dim=-1).flatten(-2)\n    return rot_x", folder="blt")
    nanochat = fake_family('"""Rotates half the hidden dims of the input with flipped signs for NanoChat."""\n'
                           "    x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n"
                           "    return torch.cat((x2, -x1), dim=-1)", folder="nanochat")
    assert blt.functions[0].form == Form("blt", "qk", interleaved=True)
    assert nanochat.functions[0].form == Form("nanochat", "qk", negate_sin=True)


def test_decorators_count_except_the_kernels_hook(fake_family):
    """transformers' use_kernel_forward_from_hub leaves the maths alone; any other decorator (here
    an autocast, which would change the dtype) makes the code unknown."""
    hook = fake_family(_LLAMA_ROTATE_HALF, folder="a",
                       decorator='@use_kernel_forward_from_hub("rotary_pos_emb")\n')
    assert hook.functions[0].form == _LLAMA
    other = fake_family(_LLAMA_ROTATE_HALF, folder="b",
                        decorator='@torch.autocast("cpu", dtype=torch.bfloat16)\n')
    assert other.functions[0].form is None


def test_a_family_is_switched_when_its_module_is_imported(fake_family):
    """patch() before the module exists switches it as it is imported (the hook), the returned list
    grows, and unpatch() restores it and takes the hook out."""
    report = fake_family(_LLAMA_ROTATE_HALF)
    patched = rope_hf.patch()
    try:
        assert report.family not in patched and rope_hf._watch in sys.meta_path
        module = _import(report)
        assert patched[-1] == report.family
        assert module.apply_rotary_pos_emb is report.functions[0].replacement
        assert module.__loader__.get_source(module.__name__).startswith("import torch")  # the loader's own
    finally:
        assert report.family in rope_hf.unpatch(patched)
    assert module.apply_rotary_pos_emb.__module__ == module.__name__
    assert rope_hf._watch not in sys.meta_path


def test_unknown_code_is_refused_by_name(fake_family, monkeypatch):
    # rotate_half scaled by 2: no tested form computes that
    report = fake_family("x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n"
                         "    return torch.cat((-2 * x2, x1), dim=-1)")
    name = report.family
    assert not report.patchable
    assert "matches no form rope_ext is tested on" in report.reason
    with pytest.raises(ValueError, match=rf"cannot patch '{name}': apply_rotary_pos_emb: its code \(fingerprint"):
        rope_hf.patch([name])
    assert rope_hf.patched_families() == []
    # patching everything leaves it stock, and says so when it is imported, once (or refuses at once,
    # with strict=True)
    monkeypatch.setattr(_engine, "_warned", set())
    with rope_hf.patch() as patched:
        with pytest.warns(_engine.RefusedWarning, match=r"1 RoPE site\(s\) of the installed transformers keep their "
                          rf"own code: {name}: apply_rotary_pos_emb: its code \(fingerprint"):
            module = _import(report)
        assert name not in patched and module.apply_rotary_pos_emb.__module__ == module.__name__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with rope_hf.patch() as patched:  # imported already: refused at once, and not said again
            assert name not in patched
    with pytest.raises(ValueError, match=rf"keep their own code: {name}: .* \(strict=True: nothing was patched\)"):
        rope_hf.patch(strict=True)
    assert rope_hf._watch not in sys.meta_path
    # with warnings made errors (-W error) the refusal is an error of patch(), which then switches and
    # keeps nothing; and an import the hook refuses still succeeds
    monkeypatch.setattr(_engine, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(_engine.RefusedWarning):
            rope_hf.patch()
        assert rope_hf._watch not in sys.meta_path and rope_hf.patched_families() == []
        del sys.modules[report.functions[0].module]
        monkeypatch.setattr(_engine, "_warned", set())
        with rope_hf.patch():
            module = _import(report)  # refused by the hook: its warning is an error, the import is not
        assert module.apply_rotary_pos_emb.__module__ == module.__name__


def test_a_module_run_again_is_classified_again(fake_family, tmp_path):
    """importlib.reload of a switched module whose file changed: switched afresh from the new
    code, or (as here, code no form matches) left stock and no longer held; unpatch puts back the
    module's own function, not the one from before the reload."""
    import time

    report = fake_family(_LLAMA_ROTATE_HALF)
    path = tmp_path / report.family / f"modeling_{report.family}.py"
    with rope_hf.patch() as patched:
        module = _import(report)
        assert report.family in patched and module.apply_rotary_pos_emb is report.functions[0].replacement
        path.write_text(path.read_text() + "\n\ndef helper():\n    return 1\n")  # still llama's form
        importlib.reload(module)
        assert module.apply_rotary_pos_emb is report.functions[0].replacement and module.helper() == 1
        time.sleep(0.01)
        path.write_text(path.read_text().replace("torch.cat((-x2, x1), dim=-1)", "torch.cat((-2 * x2, x1), dim=-1)"))
        with pytest.warns(_engine.RefusedWarning, match=rf"{report.family}: apply_rotary_pos_emb: its code"):
            importlib.reload(module)
        assert module.apply_rotary_pos_emb.__module__ == module.__name__  # the new file's own
        assert report.family not in rope_hf.patched_families()
    assert module.apply_rotary_pos_emb.__module__ == module.__name__
    assert "-2 * x2" in inspect.getsource(module.rotate_half)


def test_a_list_from_an_earlier_call_restores_only_what_that_call_holds():
    from transformers.models.llama import modeling_llama

    first = rope_hf.patch(["llama"])
    assert rope_hf.unpatch("llama") == ["llama"]
    second = rope_hf.patch(["llama"])
    try:
        assert first == second == ["llama"]
        assert rope_hf.unpatch(first) == []  # llama is the second call's now
        assert modeling_llama.apply_rotary_pos_emb.__module__ == "rope_ext.integrations._hf_forms"
    finally:
        assert rope_hf.unpatch(second) == ["llama"]
    assert rope_hf.patched_families() == []


def test_listing(capsys):
    """`python -m rope_ext.integrations.transformers`: one block per family, its status, each
    function's form, and a count that agrees with survey()."""
    rope_hf.main()
    out = capsys.readouterr().out.splitlines()
    reports = rope_hf.survey()
    firsts = [line.split()[:2] for line in out if line and not line.startswith((" ", "transformers "))
              and not line[0].isdigit()]  # the summary lines

    assert [f for f, _ in firsts] == list(reports)
    assert all(status == ("patched" if reports[f].patchable else "refused") for f, status in firsts)
    assert any("apply_rotary_pos_emb_interleave: 'deepseek mla" in line for line in out)
    patched = sum(r.patchable for r in reports.values())
    assert out[-2].endswith(f"{len(reports)} families with RoPE; {patched} patched, {len(reports) - patched} refused")
