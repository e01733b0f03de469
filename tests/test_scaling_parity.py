"""rope_ext.scaling against transformers' own ROPE_INIT_FUNCTIONS, and RotaryEmbedding.from_hf_config
against transformers' LlamaRotaryEmbedding."""
from __future__ import annotations

import math
import os

import pytest
import torch

import rope_ext
from rope_ext.scaling import RopeSchedule

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")  # a test dependency: pinned in pyproject's extras
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

HEAD_DIM, MAX_POS = 128, 8192

SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                              "attention_factor": 0.8},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 4096,
                 "short_factor": [1.0 + i / 64 for i in range(64)], "long_factor": [1.0 + i / 8 for i in range(64)]},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 2048},
}
BASES = [1e4, 5e5, 1e6]
PARTIAL = {"full": 1.0, "half": 0.5}


def _hf_config(scaling, base, partial):
    params = {k: (v[: int(len(v) * partial)] if isinstance(v, list) else v) for k, v in scaling.items()}
    params.update(rope_theta=base, partial_rotary_factor=partial)
    return LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=MAX_POS,
                       rope_parameters=params), params


def _hf_init(config, seq_len=None):
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        dim = int(HEAD_DIM * config.rope_parameters.get("partial_rotary_factor", 1.0))
        inv = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv, 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)


def _inv_freq_rtol(base):
    # HF computes base ** (2i/d) in float32: the exponent is rounded (relative 2^-24), which
    # scales the result by up to ln(base) * 2^-24; pow, the reciprocal and (yarn, longrope,
    # llama3) a few more float32 multiplies and adds add at most ~6 ulps. rope_ext's float64
    # value, rounded, is the exact one; so the two differ by at most (ln(base) + 6) * 2^-24.
    return (math.log(base) + 6) * 2.0**-24


@pytest.mark.parametrize("partial", PARTIAL.values(), ids=PARTIAL.keys())
@pytest.mark.parametrize("base", BASES, ids=str)
@pytest.mark.parametrize("name", SCALINGS)
def test_inv_freq_and_attention_factor_match_transformers(name, base, partial):
    config, params = _hf_config(SCALINGS[name], base, partial)
    rotary_dim = int(HEAD_DIM * partial)
    ours = RopeSchedule.from_config(params, base=base, rotary_dim=rotary_dim, max_position_embeddings=MAX_POS)
    hf_inv, hf_attention = _hf_init(config)
    assert ours.inv_freq().shape == hf_inv.shape
    torch.testing.assert_close(ours.inv_freq(), hf_inv.double(), rtol=_inv_freq_rtol(base), atol=0)
    assert ours.attention_factor == pytest.approx(hf_attention, rel=1e-12)


@pytest.mark.parametrize("seq_len", [100, MAX_POS, 3 * MAX_POS], ids=str)
@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_length_dependent_types_follow_hf_runtime_rule(name, seq_len):
    """dynamic: the base grows once L > max_position_embeddings; longrope: long factors once
    L > original_max_position_embeddings. L = largest position + 1."""
    config, params = _hf_config(SCALINGS[name], 5e5, 1.0)
    ours = RopeSchedule.from_config(params, base=5e5, rotary_dim=HEAD_DIM, max_position_embeddings=MAX_POS)
    hf_inv, _ = _hf_init(config, seq_len=seq_len)
    got = ours.inv_freq(torch.tensor(seq_len - 1))
    torch.testing.assert_close(got, hf_inv.double(), rtol=_inv_freq_rtol(5e5), atol=0)
    if seq_len > MAX_POS:  # and it really changed
        assert not torch.allclose(got, ours.inv_freq(torch.tensor(10)))


@pytest.mark.parametrize("name", ["default", "linear", "yarn", "llama3", "dynamic", "longrope"])
def test_module_tables_match_llama_rotary_embedding(name):
    config, _ = _hf_config(SCALINGS[name], 5e5, 1.0)
    length = 3 * MAX_POS if name in ("dynamic", "longrope") else 3000  # past the switch for those two
    pos = torch.arange(0, length, 7)[None]
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), pos)
    rope = rope_ext.RotaryEmbedding.from_hf_config(config)
    cos, sin = rope.cos_sin(pos)
    # HF rounds each angle pos * inv_freq to float32 (and inv_freq itself, see above): an
    # angle error up to pos * inv_freq * (2^-24 + rtol), which moves cos/sin by as much
    # (times the attention factor), plus one float32 rounding of each table value.
    max_angle = pos.max().item() * rope.inv_freq.max().item()
    atol = (max_angle * (2.0**-24 + _inv_freq_rtol(5e5)) + 2.0**-24) * max(1.0, rope.attention_factor)
    torch.testing.assert_close(cos, hf_cos, atol=atol, rtol=0)
    torch.testing.assert_close(sin, hf_sin, atol=atol, rtol=0)
    if rope.attention_factor != 1.0:
        assert cos.abs().max().item() == pytest.approx(rope.attention_factor, rel=1e-6)


def test_legacy_type_key():
    ours = RopeSchedule.from_config({"type": "linear", "factor": 2.0}, base=1e4, rotary_dim=64,
                                    max_position_embeddings=2048)
    plain = RopeSchedule.from_config(None, base=1e4, rotary_dim=64, max_position_embeddings=2048)
    torch.testing.assert_close(ours.inv_freq(), plain.inv_freq() / 2)


BAD_SCALINGS = {
    "unknown_type": ({"rope_type": "ntk-by-parts"}, ValueError, r"scaling\['rope_type'\] must be one of"),
    "unknown_key": ({"rope_type": "linear", "factor": 2.0, "fctor": 3}, ValueError, r"keys \['fctor'\]"),
    "missing_key": ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, ValueError,
                    r"needs \['low_freq_factor'\]"),
    "zero_factor": ({"rope_type": "linear", "factor": 0.0}, ValueError,
                    r"scaling\['factor'\] must be a finite positive"),
    "nan_factor": ({"rope_type": "dynamic", "factor": float("nan")}, ValueError, r"scaling\['factor'\]"),
    "factor_below_one": ({"rope_type": "linear", "factor": 0.5}, ValueError, r"scaling\['factor'\] must be >= 1"),
    "string_factor": ({"rope_type": "linear", "factor": "2"}, ValueError, r"scaling\['factor'\]"),
    "short_factor_length": ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 32},
                            ValueError, r"scaling\['short_factor'\] must be a list of rotary_dim/2 = 32"),
    "llama3_band_order": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
                          ValueError, r"low_freq_factor.*must be <"),
    "not_a_dict": ("linear", TypeError, "scaling must be a dict"),
}


@pytest.mark.parametrize("name", BAD_SCALINGS)
def test_bad_scaling_names_the_key(name):
    scaling, exc, msg = BAD_SCALINGS[name]
    with pytest.raises(exc, match=msg):
        RopeSchedule.from_config(scaling, base=1e4, rotary_dim=64, max_position_embeddings=2048)


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
