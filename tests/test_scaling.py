"""rope_ext.scaling and RotaryEmbedding.from_hf_config against the installed transformers: the
inverse frequencies and attention factor of every rope_type (ROPE_INIT_FUNCTIONS), the runtime
rule of the two length-dependent types, LlamaRotaryEmbedding's cos/sin tables, config
validation and the legacy ``type`` key. Every expected value comes from transformers."""
from __future__ import annotations

import copy
import math
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # set before transformers loads: these tests never download

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import cpp_api, randn  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

import rope_ext  # noqa: E402
from rope_ext.scaling import RopeSchedule  # noqa: E402

U32 = 2.0**-24  # float32 unit roundoff: |fl(x) - x| <= U32 * |x|
MAX_POS = 2048  # config.max_position_embeddings
ORIGINAL = 512  # original_max_position_embeddings of yarn / longrope / llama3 (MAX_POS / 4)


def _longrope_short(n):  # rescale factors per frequency, as a function of n = rotary_dim / 2
    return [1.0 + 0.5 * i / n for i in range(n)]


def _longrope_long(n):
    return [1.0 + 15.0 * (i / n) ** 2 for i in range(n)]


# rope_parameters without rope_theta / partial_rotary_factor (added per test). Callables are
# filled in with rotary_dim / 2 (longrope's per-frequency lists).
SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn_mscale_betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL,
                          "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                              "attention_factor": 0.8},
    "yarn_no_truncate": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                         "truncate": False},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
                 "short_factor": _longrope_short, "long_factor": _longrope_long},
    "longrope_factor_attention": {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
                                  "short_factor": _longrope_short, "long_factor": _longrope_long,
                                  "factor": 16.0, "attention_factor": 1.3},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    # no band between the two (transformers warns; vLLM accepts it)
    "llama3_equal_factors": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": ORIGINAL},
}
BASES = {"base1e4": 1e4, "base5e5": 5e5, "base1e6": 1e6}
# (head_dim, partial_rotary_factor). 96 and 48 are not powers of two, so HF's float32 exponent
# 2i/d is rounded: that exercises the ln(base) term of the tolerance below.
GEOMETRIES = {"hd128": (128, 1.0), "hd128_partial0.5": (128, 0.5), "hd96": (96, 1.0), "hd96_partial0.5": (96, 0.5)}


def _params(name: str, base: float, head_dim: int, partial: float) -> dict:
    """A fresh rope_parameters dict (transformers mutates the one it is given)."""
    n = int(head_dim * partial) // 2
    params = {k: (v(n) if callable(v) else copy.deepcopy(v)) for k, v in SCALINGS[name].items()}
    params["rope_theta"] = base
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    return params


def _llama_config(params: dict, head_dim: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=MAX_POS, rope_parameters=copy.deepcopy(params))


def _hf_init(config: LlamaConfig, seq_len=None) -> tuple[torch.Tensor, float]:
    """transformers' (inv_freq, attention_factor) for the config's rope_type."""
    rope_type = config.rope_parameters["rope_type"]
    if rope_type != "default":
        return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    if config.rope_parameters.get("partial_rotary_factor", 1.0) == 1.0:
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    # Llama's own default ignores partial_rotary_factor (Llama rotates whole heads); GPT-NeoX's
    # is the same formula on int(head_dim * partial_rotary_factor) dims.
    return GPTNeoXRotaryEmbedding.compute_default_rope_parameters(config)


def _inv_freq_rtol(base: float, params: dict | None = None) -> float:
    """Relative distance allowed between HF's float32 inv_freq and rope_ext's float64 one.

    HF computes x = fl32(2i / d) (relative error <= U32; exact when d is a power of two), then
    fl32(base ** x) and 1 / that. Perturbing the exponent by x * delta multiplies base ** x by
    base ** (x * delta) ~ 1 + x * ln(base) * delta, and 0 <= x < 1: at most ln(base) * U32. pow
    (~1 ulp = 2 U32), the reciprocal (U32), rounding a non-float32 base (dynamic's grown base:
    x * U32 <= U32) and the few extra float32 products and sums of positive terms of yarn,
    longrope and llama3 add a handful more: 6 * U32 in all. rope_ext's float64 value is exact to
    ~2^-52. So the two differ by at most (ln(base) + 6) * U32, relative, except where a type's
    formula amplifies relative errors:

    - llama3's medium band returns theta * (1/f + s * (1 - 1/f)) with s = (orig * theta / 2pi - l) / (h - l),
      itself linear in theta: d ln(out) / d ln(theta) = 1 + (1 - 1/f) (s + l/(h-l)) / (1/f + s (1 - 1/f)),
      monotonic in s, so at most K = 1 + max((f - 1) l, (1 - 1/f) h) / (h - l) (s = 0 or 1):
      Llama 3.1's f=8, l=1, h=4 gives K = 10/3. Every relative error above is multiplied by K.
      With l = h there is no medium band.
    - yarn blends theta / f and theta with the float32 ramp weight r = (i - low) / (high - low)
      and its complement (each within ~U32 of exact); out = theta (1 - r (1 - 1/f)) >= theta / f
      moves by theta (1 - 1/f) |dr|, i.e. up to (f - 1) * 2 U32 relative.
    """
    return _float32_rtol(math.log(base), params)


def _float32_rtol(log_term, params: dict | None):
    """_inv_freq_rtol with ln(base) replaced by log_term, a bound on x * ln(base) (float, or a
    tensor of one bound per frequency)."""
    rtol = (log_term + 6) * U32
    params = params or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "llama3" and params["high_freq_factor"] > params["low_freq_factor"]:  # (else no band)
        f, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        rtol *= 1 + max((f - 1) * low, (1 - 1 / f) * high) / (high - low)
    elif rope_type == "yarn":
        rtol += (params["factor"] - 1) * 2 * U32
    return rtol


def _dynamic_base_bound(base: float, factor: float, seq_len: int) -> float:
    """An upper bound of dynamic NTK's grown base, base * (factor * L / max - (factor - 1)) ** (d / (d - 2)),
    for d >= 4 (d / (d - 2) <= 2): what ln(base) in the tolerance must cover."""
    return base * max(1.0, factor * seq_len / MAX_POS) ** 2


def _assert_inv_freq_close(ours: torch.Tensor, hf: torch.Tensor, rtol: float):
    assert ours.dtype == torch.float64 and ours.shape == hf.shape
    torch.testing.assert_close(ours, hf.double(), rtol=rtol, atol=0)


# -- 1. inv_freq and attention factor of every type, base and geometry --------------------------


@pytest.mark.parametrize("geometry", GEOMETRIES.values(), ids=GEOMETRIES.keys())
@pytest.mark.parametrize("base", BASES.values(), ids=BASES.keys())
@pytest.mark.parametrize("name", SCALINGS)
def test_inv_freq_and_attention_factor_match_transformers(name, base, geometry):
    head_dim, partial = geometry
    params = _params(name, base, head_dim, partial)
    config = _llama_config(params, head_dim)
    hf_inv, hf_attention = _hf_init(config)

    schedule = RopeSchedule.from_config(
        params, base=base, rotary_dim=int(head_dim * partial), max_position_embeddings=MAX_POS
    )
    _assert_inv_freq_close(schedule.inv_freq(), hf_inv, _inv_freq_rtol(base, params))
    assert schedule.attention_factor == pytest.approx(hf_attention, rel=1e-12, abs=0)

    # The same through the module built from the transformers config (it reads head_dim,
    # partial_rotary_factor and rope_parameters from the config itself).
    rope = rope_ext.RotaryEmbedding.from_hf_config(config)
    assert rope.rotary_dim == int(head_dim * partial)
    _assert_inv_freq_close(rope.inv_freq, hf_inv, _inv_freq_rtol(base, params))
    assert rope.attention_factor == pytest.approx(hf_attention, rel=1e-12, abs=0)


PROPORTIONAL = {"proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.25},
                "proportional_factor": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0}}


@pytest.mark.parametrize("geometry", [GEOMETRIES["hd128"], GEOMETRIES["hd96_partial0.5"]], ids=["hd128", "hd96_p0.5"])
@pytest.mark.parametrize("base", [1e4, 5e5], ids=["base1e4", "base5e5"])
@pytest.mark.parametrize("name", [*SCALINGS, *PROPORTIONAL])
def test_frequencies_of_python_and_cpp_agree(name, base, geometry, monkeypatch):
    """The schedules exist twice: in Python (rope_ext.scaling, what the package runs) and in the C++
    API's header (rope_ext/frequencies.h, called through the test hook rope_ext_testing::rope_frequencies).
    The same float64 operations in the same order: the same bits, and the same numbers beside them."""
    head_dim, partial = geometry
    d = int(head_dim * partial)
    params = _params(name, base, head_dim, partial) if name in SCALINGS else dict(PROPORTIONAL[name])
    calls = []
    real = rope_ext.scaling._frequencies
    monkeypatch.setattr(rope_ext.scaling, "_frequencies", lambda *a, **kw: calls.append((a, kw)) or real(*a, **kw))
    s = RopeSchedule.from_config(params, base=base, rotary_dim=d, max_position_embeddings=MAX_POS)
    (args, kwargs), = calls
    inv, long, attention, switch, factor = cpp_api().rope_frequencies(*args, **kwargs)
    assert torch.equal(torch.tensor(s.inv_freq_base, dtype=torch.float64), inv)
    if s.inv_freq_long is None:
        assert long.numel() == 0
    else:
        assert torch.equal(torch.tensor(s.inv_freq_long, dtype=torch.float64), long)
    assert (s.attention_factor, s.switch_len, s.factor) == (attention, switch, factor)


# -- 2. dynamic and longrope: frequencies for the sequence length --------------------------------

# Lengths L = largest position + 1 on both sides of each type's switch: dynamic grows its base
# once L > max_position_embeddings, longrope takes long_factor once L > original_max.
LENGTHS = {
    "dynamic": [100, MAX_POS - 1, MAX_POS, MAX_POS + 1, 3 * MAX_POS],
    "longrope": [100, ORIGINAL, ORIGINAL + 1, MAX_POS, 3 * MAX_POS],
}
LENGTH_CASES = [(name, seq_len) for name, lengths in LENGTHS.items() for seq_len in lengths]
LENGTH_GEOMETRIES = {k: GEOMETRIES[k] for k in ("hd128", "hd96_partial0.5")}
LENGTH_BASE = 5e5


@pytest.mark.parametrize("geometry", LENGTH_GEOMETRIES.values(), ids=LENGTH_GEOMETRIES.keys())
@pytest.mark.parametrize("name,seq_len", LENGTH_CASES, ids=[f"{n}-L{L}" for n, L in LENGTH_CASES])
def test_length_dependent_inv_freq_matches_transformers(name, seq_len, geometry):
    head_dim, partial = geometry
    params = _params(name, LENGTH_BASE, head_dim, partial)
    config = _llama_config(params, head_dim)
    schedule = RopeSchedule.from_config(
        params, base=LENGTH_BASE, rotary_dim=int(head_dim * partial), max_position_embeddings=MAX_POS
    )
    hf_inv, hf_attention = _hf_init(config, seq_len=seq_len)
    base_bound = _dynamic_base_bound(LENGTH_BASE, params["factor"], seq_len) if name == "dynamic" else LENGTH_BASE

    got = schedule.inv_freq(torch.tensor(seq_len - 1))
    _assert_inv_freq_close(got, hf_inv, _inv_freq_rtol(base_bound, params))
    assert schedule.attention_factor == pytest.approx(hf_attention, rel=1e-12, abs=0)

    # The test's lengths really straddle the switch: transformers' frequencies past it differ
    # from its short-sequence ones (else the comparison above could not tell the two apart).
    switch = MAX_POS if name == "dynamic" else ORIGINAL
    hf_short, _ = _hf_init(config, seq_len=1)
    assert torch.equal(hf_inv, hf_short) == (seq_len <= switch)


@pytest.mark.parametrize("name,seq_len", LENGTH_CASES, ids=[f"{n}-L{L}" for n, L in LENGTH_CASES])
def test_length_dependent_inv_freq_of_python_and_cpp_agree(name, seq_len):
    """The per-call rule exists twice: in Python (RopeSchedule.inv_freq, traced by torch.compile)
    and in C++ (the C++ API's inv_freq_for, called through the test hook
    rope_ext_testing::inv_freq_for). Same formula, same float64 operations: the same bits."""
    head_dim, partial = LENGTH_GEOMETRIES["hd128"]
    params = _params(name, LENGTH_BASE, head_dim, partial)
    s = RopeSchedule.from_config(params, base=LENGTH_BASE, rotary_dim=head_dim, max_position_embeddings=MAX_POS)
    max_position = torch.tensor(seq_len - 1)
    long = None if s.inv_freq_long is None else torch.tensor(s.inv_freq_long, dtype=torch.float64)
    cpp = cpp_api().inv_freq_for(
        torch.tensor(s.inv_freq_base, dtype=torch.float64), long, s.rope_type, s.base, s.rotary_dim, s.switch_len,
        s.factor, seq_len - 1,
    )
    assert torch.equal(cpp, s.inv_freq(max_position))


# -- 3. module tables against LlamaRotaryEmbedding -----------------------------------------------

# scaling name -> sequence length L of the batch (positions < L < 4096). dynamic and longrope
# run on both sides of their switch (MAX_POS and ORIGINAL respectively).
MODULE_CASES = {
    "default": ("default", 4000),
    "linear": ("linear", 4000),
    "yarn": ("yarn", 4000),
    "yarn_mscale_betas": ("yarn_mscale_betas", 4000),
    "llama3": ("llama3", 4000),
    "dynamic_short_prompt": ("dynamic", 1500),
    "dynamic_long_prompt": ("dynamic", 4000),
    "longrope_short_prompt": ("longrope", 500),
    "longrope_long_prompt": ("longrope", 4000),
}
MODULE_BASE, MODULE_HEAD_DIM = 5e5, 128


@pytest.mark.parametrize("case", MODULE_CASES)
def test_module_tables_match_llama_rotary_embedding(case):
    name, seq_len = MODULE_CASES[case]
    params = _params(name, MODULE_BASE, MODULE_HEAD_DIM, 1.0)
    config = _llama_config(params, MODULE_HEAD_DIM)
    # Two rows: every 4th position up to L - 1 (the batch's maximum, which the length-dependent
    # types key on), and half of those.
    row = torch.arange(seq_len - 1, -1, -4).flip(0)
    position_ids = torch.stack([row, row // 2])

    hf = LlamaRotaryEmbedding(config)
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), position_ids)
    rope = rope_ext.RotaryEmbedding.from_hf_config(config)
    cos, sin = rope.cos_sin(position_ids)
    assert cos.dtype == sin.dtype == hf_cos.dtype == torch.float32
    assert cos.shape == sin.shape == hf_cos.shape == (2, row.numel(), MODULE_HEAD_DIM)

    # Bound on |ours - HF| per table entry, with A = the attention factor, theta_i = rope_ext's
    # (exact) inverse frequency and pos the entry's position:
    # - HF's angle fl32(pos * theta32_i): theta32_i is off by rtol_i relative (_inv_freq_rtol with
    #   x * ln(base) bounded by -ln(theta_i): every type only divides the default base ** -x by
    #   factors >= 1, and dynamic's base ** -x is theta_i itself), the product is rounded once
    #   (U32 relative), so the angle is off by up to pos * theta_i * (rtol_i + U32); cos and sin
    #   are 1-Lipschitz, and scaled by A.
    # - then HF's float32 cos/sin (<= 1 ulp <= 2 U32 for values <= 1), its float32 product by A
    #   (U32 * A) and rope_ext's single rounding of its float64 value (U32 * A): 4 U32 * max(1, A).
    # rope_ext's own float64 angles are exact to float32 precision. At the largest angle here
    # (pos ~ 4000, theta = 1) that is ~ 4000 * 7 U32 ~ 1.7e-3.
    theta = rope.schedule.inv_freq(position_ids.max())
    assert (theta <= 1).all()
    rtol = _float32_rtol(-theta.log(), params)
    angle_error = position_ids[..., None].double() * (theta * (rtol + U32))
    bound = max(1.0, rope.attention_factor) * (torch.cat((angle_error, angle_error), dim=-1) + 4 * U32)
    for ours, theirs in ((cos, hf_cos), (sin, hf_sin)):
        excess = (ours.double() - theirs.double()).abs() / bound
        assert excess.max() <= 1, f"|rope_ext - HF| up to {excess.max().item():.3g} x the bound"

    # The attention factor is applied: it is HF's, and position 0's cos (= 1 unscaled) is it.
    assert rope.attention_factor == pytest.approx(hf.attention_scaling, rel=1e-12, abs=0)
    assert cos.abs().max().item() == pytest.approx(hf.attention_scaling, rel=U32, abs=0)
    assert hf_cos.abs().max().item() == pytest.approx(hf.attention_scaling, rel=U32, abs=0)


def test_yarn_module_scales_its_tables():
    """yarn's attention factor (> 1 here) scales both tables: cos at position 0 and the amplitude
    sqrt(cos^2 + sin^2) at every position equal transformers' attention_scaling."""
    config = _llama_config(_params("yarn", MODULE_BASE, MODULE_HEAD_DIM, 1.0), MODULE_HEAD_DIM)
    hf_attention = LlamaRotaryEmbedding(config).attention_scaling
    assert hf_attention > 1.0
    cos, sin = rope_ext.RotaryEmbedding.from_hf_config(config).cos_sin(torch.arange(64))
    assert cos[0].tolist() == [pytest.approx(hf_attention, rel=U32)] * MODULE_HEAD_DIM
    assert (cos.square() + sin.square()).sqrt().max().item() == pytest.approx(hf_attention, rel=4 * U32)


# -- 4. bad configs name the key ------------------------------------------------------------------

BAD_DIM = 64  # rotary_dim of the bad-config cases: longrope lists need 32 entries
_LONGROPE_OK = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}
_LLAMA3_OK = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}

# name -> (scaling, exception type, regex the message must match: it names the offending key)
BAD_SCALINGS = {
    "unknown_rope_type": ({"rope_type": "ntk-by-parts", "factor": 2.0}, ValueError,
                          r"\['rope_type'\].*'ntk-by-parts'"),
    "unknown_legacy_type": ({"type": "su", "factor": 2.0}, ValueError, r"\['rope_type'\].*'su'"),
    "unknown_extra_key": ({"rope_type": "linear", "factor": 2.0, "fctor": 3.0}, ValueError, r"'fctor'"),
    "key_of_another_type": ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, ValueError,
                            r"'low_freq_factor'"),
    "llama3_missing_low_freq_factor": ({k: v for k, v in _LLAMA3_OK.items() if k != "low_freq_factor"},
                                       ValueError, r"'low_freq_factor'"),
    "linear_missing_factor": ({"rope_type": "linear"}, ValueError, r"'factor'"),
    "longrope_missing_long_factor": ({k: v for k, v in _LONGROPE_OK.items() if k != "long_factor"}, ValueError,
                                     r"'long_factor'"),
    "zero_factor": ({"rope_type": "linear", "factor": 0.0}, ValueError, r"\['factor'\]"),
    "negative_factor": ({"rope_type": "dynamic", "factor": -2.0}, ValueError, r"\['factor'\]"),
    "nan_factor": ({"rope_type": "linear", "factor": float("nan")}, ValueError, r"\['factor'\]"),
    "inf_factor": ({"rope_type": "yarn", "factor": float("inf")}, ValueError, r"\['factor'\]"),
    "string_factor": ({**_LLAMA3_OK, "factor": "8"}, ValueError, r"\['factor'\]"),
    "bool_factor": ({"rope_type": "linear", "factor": True}, ValueError, r"\['factor'\]"),
    "linear_factor_below_1": ({"rope_type": "linear", "factor": 0.5}, ValueError, r"\['factor'\] must be >= 1"),
    "dynamic_factor_below_1": ({"rope_type": "dynamic", "factor": 0.5}, ValueError, r"\['factor'\] must be >= 1"),
    "llama3_factor_below_1": ({**_LLAMA3_OK, "factor": 0.5}, ValueError, r"\['factor'\] must be >= 1"),
    "zero_rope_theta": ({"rope_type": "default", "rope_theta": 0.0}, ValueError, r"\['rope_theta'\]"),
    "nan_low_freq_factor": ({**_LLAMA3_OK, "low_freq_factor": float("nan")}, ValueError, r"\['low_freq_factor'\]"),
    "negative_yarn_attention_factor": ({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0}, ValueError,
                                       r"\['attention_factor'\]"),
    "string_beta_fast": ({"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"}, ValueError, r"\['beta_fast'\]"),
    "zero_original_max": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}, ValueError,
                          r"\['original_max_position_embeddings'\]"),
    "short_factor_too_short": ({**_LONGROPE_OK, "short_factor": [1.0] * 31}, ValueError,
                               r"\['short_factor'\].*32.*31"),
    "long_factor_too_long": ({**_LONGROPE_OK, "long_factor": [2.0] * 64}, ValueError, r"\['long_factor'\].*32.*64"),
    "long_factor_not_a_list": ({**_LONGROPE_OK, "long_factor": 2.0}, ValueError, r"\['long_factor'\]"),
    "short_factor_zero_entry": ({**_LONGROPE_OK, "short_factor": [1.0] * 31 + [0.0]}, ValueError,
                                r"\['short_factor'\]"),
    "longrope_zero_attention_factor": ({**_LONGROPE_OK, "attention_factor": 0.0}, ValueError,
                                       r"\['attention_factor'\]"),
    "llama3_low_above_high": ({**_LLAMA3_OK, "low_freq_factor": 8.0}, ValueError,
                              r"\['low_freq_factor'\].*\['high_freq_factor'\]"),
    "llama3_null_low_freq_factor": ({**_LLAMA3_OK, "low_freq_factor": None}, ValueError, r"\['low_freq_factor'\]"),
    "yarn_mscale_ratio_negative": ({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": -10.0},
                                   ValueError, r"attention factor from mscale and mscale_all_dim must be a finite "
                                   r"positive number"),
    "original_max_a_fraction": ({**_LLAMA3_OK, "original_max_position_embeddings": 0.5}, ValueError,
                                r"\['original_max_position_embeddings'\] must be a positive int, got 0.5"),
    "yarn_base_one": ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1.0}, ValueError,
                      r"'yarn' needs a base other"),
    "longrope_original_one": ({**_LONGROPE_OK, "original_max_position_embeddings": 1, "factor": 16.0}, ValueError,
                              r"original_max_position_embeddings 1 needs attention_factor"),
    "scaling_is_a_string": ("linear", TypeError, r"scaling must be a dict.*str"),
    "scaling_is_a_list": ([("rope_type", "linear"), ("factor", 2.0)], TypeError, r"scaling must be a dict.*list"),
}
ENTRY_POINTS = {
    "RopeSchedule.from_config": lambda scaling: RopeSchedule.from_config(
        scaling, base=1e4, rotary_dim=BAD_DIM, max_position_embeddings=MAX_POS
    ),
    "RotaryEmbedding": lambda scaling: rope_ext.RotaryEmbedding(
        BAD_DIM, scaling=scaling, max_position_embeddings=MAX_POS
    , layout="bhsd"),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS.values(), ids=ENTRY_POINTS.keys())
@pytest.mark.parametrize("name", BAD_SCALINGS)
def test_bad_scaling_raises_naming_the_key(name, entry):
    scaling, exc, message = BAD_SCALINGS[name]
    with pytest.raises(exc, match=message):
        entry(scaling)


# -- 5. the legacy `type` key ---------------------------------------------------------------------

LEGACY_SCALINGS = {
    "linear": {"type": "linear", "factor": 2.0},
    "dynamic": {"type": "dynamic", "factor": 2.0},
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "llama3": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
}


@pytest.mark.parametrize("name", LEGACY_SCALINGS)
def test_legacy_type_key_is_accepted(name):
    legacy = LEGACY_SCALINGS[name]
    head_dim = 128
    # transformers' own handling of an old config.json: rope_scaling={"type": ...}
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=MAX_POS, rope_scaling=copy.deepcopy(legacy))
    assert config.rope_parameters["rope_type"] == name
    hf_inv, hf_attention = _hf_init(config)

    schedule = RopeSchedule.from_config(legacy, base=1e4, rotary_dim=head_dim, max_position_embeddings=MAX_POS)
    assert schedule.rope_type == name
    _assert_inv_freq_close(schedule.inv_freq(), hf_inv, _inv_freq_rtol(1e4, legacy))
    assert schedule.attention_factor == pytest.approx(hf_attention, rel=1e-12, abs=0)
    modern = {("rope_type" if k == "type" else k): v for k, v in legacy.items()}
    assert schedule == RopeSchedule.from_config(modern, base=1e4, rotary_dim=head_dim, max_position_embeddings=MAX_POS)

    rope = rope_ext.RotaryEmbedding.from_hf_config(config)
    assert rope.schedule.rope_type == name
    _assert_inv_freq_close(rope.inv_freq, hf_inv, _inv_freq_rtol(1e4, legacy))


# -- 6. explicit nulls --------------------------------------------------------------------------

# A key present with value None (JSON null in a config.json) means "use the default" to
# transformers (`beta_fast or 32`, `if factor is None: factor = max_pos / original`, ...).
# rope_ext.scaling reads such a key as given: its fallbacks (`_number(cfg, key, default=...)`)
# apply only when the key is absent, so the yarn beta / factor and longrope factor /
# attention_factor cases below raise "must be a finite positive number, got None" (a rope_ext
# bug: see scaling._number and its callers); the other cases pass.
NULL_SCALINGS = {
    "yarn_beta_fast_null": {**SCALINGS["yarn"], "beta_fast": None},
    "yarn_beta_slow_null": {**SCALINGS["yarn"], "beta_slow": None},
    "yarn_factor_null": {**SCALINGS["yarn"], "factor": None},
    "yarn_attention_factor_null": {**SCALINGS["yarn"], "attention_factor": None},
    "yarn_mscales_null": {**SCALINGS["yarn"], "mscale": None, "mscale_all_dim": None},
    "longrope_factor_null": {**SCALINGS["longrope"], "factor": None},
    "longrope_attention_factor_null": {**SCALINGS["longrope"], "attention_factor": None},
}


@pytest.mark.parametrize("name", NULL_SCALINGS)
def test_explicit_null_means_default_as_in_transformers(name):
    head_dim, base = 128, 1e4
    params = {k: (v(head_dim // 2) if callable(v) else v) for k, v in NULL_SCALINGS[name].items()}
    params["rope_theta"] = base
    config = _llama_config(params, head_dim)
    hf_inv, hf_attention = _hf_init(config)

    try:
        schedule = RopeSchedule.from_config(params, base=base, rotary_dim=head_dim, max_position_embeddings=MAX_POS)
    except ValueError as e:
        pytest.fail(f"rope_ext rejects a config transformers accepts (a null means the default there): {e}")
    # (a null yarn factor defaults to max_pos / original, which the tolerance's yarn term needs)
    rtol_params = {**params, "factor": params.get("factor") or MAX_POS / ORIGINAL}
    _assert_inv_freq_close(schedule.inv_freq(), hf_inv, _inv_freq_rtol(base, rtol_params))
    assert schedule.attention_factor == pytest.approx(hf_attention, rel=1e-12, abs=0)


def test_from_hf_config_gptj_is_interleaved_and_matches_its_tables():
    """GPT-J's config has no pairing flag: the model type decides. Its sin/cos table
    (create_sinusoidal_positions) must equal ours in half-width form."""
    from transformers import GPTJConfig
    from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions

    config = GPTJConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=256)
    rope = rope_ext.RotaryEmbedding.from_hf_config(config)
    assert rope.interleaved and rope.rotary_dim == 8 and rope.dim == 16
    sincos = create_sinusoidal_positions(256, 8)  # (positions, [sin(4), cos(4)]), float32 angles
    cos, sin = rope.cos_sin(torch.arange(256))
    # HF's float32 angle pos * inv_freq: error up to 255 * 2^-24 rad (+ rounding of the table)
    torch.testing.assert_close(cos[:, ::2], sincos[:, 4:], atol=300 * 2.0**-24, rtol=0)
    torch.testing.assert_close(sin[:, ::2], sincos[:, :4], atol=300 * 2.0**-24, rtol=0)


@pytest.mark.parametrize("rope_interleave", [True, False])
def test_from_hf_config_honours_deepseek_v3_rope_interleave(rope_interleave):
    """DeepSeek-V3 (rope_interleave defaults to True) rotates interleaved pairs with HF's
    apply_rotary_pos_emb_interleave; with rope_interleave=False, half-split with apply_rotary_pos_emb.
    q k^T from the module equals HF's within float32 rounding (it differed by up to 57 when the flag
    was ignored)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    config = DeepseekV3Config(vocab_size=64, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                              qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16,
                              q_lora_rank=None, max_position_embeddings=4096, rope_interleave=rope_interleave)
    rope = rope_ext.RotaryEmbedding.from_hf_config(config)
    assert rope.interleaved == rope_interleave and rope.dim == 16
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 6, 16, generator=g) * 4, torch.randn(1, 2, 6, 16, generator=g) * 4
    position_ids = torch.tensor([[0, 1, 2, 500, 2000, 4000]])
    cos, sin = ds.DeepseekV3RotaryEmbedding(config)(q, position_ids)
    apply = ds.apply_rotary_pos_emb_interleave if rope_interleave else ds.apply_rotary_pos_emb
    hq, hk = apply(q, k, cos, sin)
    oq, ok = rope(q, k, position_ids)
    # HF's float32 angles at positions up to 4000 (~4000 * 2^-23 rad), times |q| |k| * 16 terms
    torch.testing.assert_close(oq @ ok.transpose(-1, -2), hq @ hk.transpose(-1, -2), atol=0.05, rtol=1e-4)
    # HF's interleave variant returns the rotated pairs de-interleaved (firsts, then seconds): the
    # same vectors with their columns permuted alike in q and k, which attention cannot tell apart
    order = torch.cat((torch.arange(0, 16, 2), torch.arange(1, 16, 2))) if rope_interleave else torch.arange(16)
    torch.testing.assert_close(oq[..., order], hq, atol=4e-3, rtol=0)
    torch.testing.assert_close(ok[..., order], hk, atol=4e-3, rtol=0)


def test_from_hf_config_per_layer_type_parameters_of_gemma3():
    """Gemma 3 gives rope_parameters per layer type (sliding: default, theta 1e4; full: linear x8,
    theta 1e6): layer_type chooses, and each module's tables match transformers' for that type. A
    missing or unknown layer_type is refused naming the types."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = Gemma3TextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
    )
    hf = Gemma3RotaryEmbedding(config)
    position_ids = torch.tensor([[0, 3, 100, 1000, 4000]])
    x = torch.zeros(1, dtype=torch.float32)
    for layer_type in ("sliding_attention", "full_attention"):
        rope = rope_ext.RotaryEmbedding.from_hf_config(config, layer_type=layer_type)
        hf_cos, hf_sin = hf(x, position_ids, layer_type)
        cos, sin = rope.cos_sin(position_ids)
        # HF's float32 angles at positions up to 4000: ~4000 * 2^-23 rad
        torch.testing.assert_close(cos, hf_cos, atol=1e-3, rtol=0)
        torch.testing.assert_close(sin, hf_sin, atol=1e-3, rtol=0)
    sliding = rope_ext.RotaryEmbedding.from_hf_config(config, layer_type="sliding_attention")
    full = rope_ext.RotaryEmbedding.from_hf_config(config, layer_type="full_attention")
    assert not torch.allclose(sliding.cos_sin(position_ids)[0], full.cos_sin(position_ids)[0])
    for bad in (None, "global"):
        with pytest.raises(ValueError, match=r"per layer type \(full_attention, sliding_attention\): pass layer_type"):
            rope_ext.RotaryEmbedding.from_hf_config(config, layer_type=bad)


@pytest.mark.parametrize("factor", [1.0, 8.0])
@pytest.mark.parametrize("share", [0.25, 0.3, 0.5, 1.0, 0.0])
@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_proportional_inv_freq_matches_transformers(head_dim, share, factor):
    """Gemma 4's proportional RoPE: every pair (i, i + d/2) of the head, the first
    int(share * d // 2) turning at base^(-2i/d) / factor, the others not at all (0 exactly)."""
    params = {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": share, "factor": factor}
    hf_inv, hf_attention = ROPE_INIT_FUNCTIONS["proportional"](_llama_config(params, head_dim), "cpu")
    schedule = RopeSchedule.from_config(params, base=1e6, rotary_dim=head_dim, max_position_embeddings=MAX_POS)
    ours = schedule.inv_freq()
    turning = int(share * head_dim // 2)
    assert (ours[turning:] == 0).all() and (ours[:turning] > 0).all() and ours.shape == (head_dim // 2,)
    _assert_inv_freq_close(ours, hf_inv, _inv_freq_rtol(1e6))
    assert schedule.attention_factor == hf_attention == 1.0
    # the module rotates the whole head (partial_rotary_factor does not shorten it)
    rope = rope_ext.RotaryEmbedding(head_dim, scaling=params, layout="bhsd")
    assert rope.rotary_dim == head_dim


def test_from_hf_config_gemma4_proportional_matches_transformers(gen):
    """Gemma 4: sliding layers use default RoPE on head_dim, full-attention layers proportional RoPE
    (a quarter of the pairs turn) on global_head_dim; from_hf_config(layer_type=...) takes each
    type's head dim and parameters, and q rotated by it equals transformers' (Gemma 4 rotates q and
    k one at a time with apply_rotary_pos_emb(x, cos, sin))."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4 import modeling_gemma4 as hf

    config = Gemma4TextConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
                              max_position_embeddings=4096, layer_types=["sliding_attention", "full_attention"])
    embedding = hf.Gemma4TextRotaryEmbedding(config)
    position_ids = torch.tensor([[0, 3, 100, 1000, 4000]])
    for layer_type, head_dim in (("sliding_attention", 16), ("full_attention", 32)):
        rope = rope_ext.RotaryEmbedding.from_hf_config(config, layer_type=layer_type)
        assert rope.dim == rope.rotary_dim == head_dim
        x = randn(1, 2, 5, head_dim, gen=gen)
        hf_cos, hf_sin = embedding(x, position_ids, layer_type)
        cos, sin = rope.cos_sin(position_ids)
        torch.testing.assert_close(cos, hf_cos, atol=1e-3, rtol=0)  # HF's float32 angles up to 4000 rad
        torch.testing.assert_close(sin, hf_sin, atol=1e-3, rtol=0)
        q, _ = rope(x, x, position_ids)
        torch.testing.assert_close(q, hf.apply_rotary_pos_emb(x, hf_cos, hf_sin), atol=4e-3, rtol=0)
    full = rope_ext.RotaryEmbedding.from_hf_config(config, layer_type="full_attention")
    assert full.schedule.rope_type == "proportional" and (full.inv_freq[4:] == 0).all()


def test_proportional_refusals():
    with pytest.raises(ValueError, match="partial_rotary_factor belongs in scaling"):
        rope_ext.RotaryEmbedding(32, partial_rotary_factor=0.25, scaling={"rope_type": "proportional"}, layout="bhsd")
    with pytest.raises(ValueError, match=r"partial_rotary_factor'\] must be in \[0, 1\], got 1.5"):
        rope_ext.RotaryEmbedding(32, scaling={"rope_type": "proportional", "partial_rotary_factor": 1.5},
                                 layout="bhsd")


def test_dynamic_ntk_is_stateless_where_transformers_keeps_state():
    """The difference the README documents: after a longer call past max_position_embeddings, a
    shorter call still past it gets its own length's frequencies here (as from a fresh module),
    while transformers' module reuses the longer call's."""
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    x, long, short = torch.zeros(1), torch.arange(4096)[None], torch.arange(2048)[None]
    rope, fresh = rope_ext.RotaryEmbedding.from_hf_config(config), rope_ext.RotaryEmbedding.from_hf_config(config)
    q = torch.randn(1, 2, 4096, 128, generator=torch.Generator().manual_seed(0))
    rope(q, q, long)  # the longer call first
    assert torch.equal(rope.cos_sin(short)[0], fresh.cos_sin(short)[0])
    assert torch.equal(rope(q[:, :, :2048], q[:, :, :2048], short)[0], fresh(q[:, :, :2048], q[:, :, :2048], short)[0])
    hf = LlamaRotaryEmbedding(config)
    hf(x, long)
    stateful, stateless = hf(x, short)[0], LlamaRotaryEmbedding(config)(x, short)[0]
    ours = fresh.cos_sin(short)[0]
    assert (ours - stateless).abs().max() < 2e-4  # HF's float32 angles at positions < 2048
    assert (ours - stateful).abs().max() > 1.0  # the documented difference
