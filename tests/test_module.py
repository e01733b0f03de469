"""rope_ext.RotaryEmbedding: positions, offsets, packing, precision, dtype/device moves,
torch.compile, xPos and M-RoPE, against float64 references and the real transformers package."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch._dynamo.testing
from conftest import CONVENTIONS, cpp_api, inv_freq, randn, tolerance

import rope_ext
from rope_ext import reference

os.environ.setdefault("HF_HUB_OFFLINE", "1")

D, BASE = 64, 10000.0


def _truth(x, positions, interleaved, rotary_dim=D, base=BASE, layout="bhsd"):
    """float64 ground truth: tables from float64 angles, the reference formula."""
    angles = positions.to(torch.float64)[..., None] * inv_freq(rotary_dim, base)
    cos, sin = reference.angles_to_cos_sin(angles, interleaved)  # (B, S, r)
    cos, sin = (cos[:, None], sin[:, None]) if layout == "bhsd" else (cos[:, :, None], sin[:, :, None])
    return reference.rotary_reference(x.double(), cos, sin, interleaved)


@pytest.mark.parametrize("rotary_dim", [D, 32], ids=["full", "partial"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_forward_matches_float64_truth(interleaved, dtype, layout, rotary_dim, gen):
    m = rope_ext.RotaryEmbedding(D, BASE, interleaved=interleaved, rotary_dim=rotary_dim, layout=layout)
    shape_q, shape_k = ((2, 4, 9, D), (2, 2, 9, D)) if layout == "bhsd" else ((2, 9, 4, D), (2, 9, 2, D))
    q, k = randn(*shape_q, dtype=dtype, gen=gen), randn(*shape_k, dtype=dtype, gen=gen)
    pos = torch.arange(9).expand(2, 9)
    q_out, k_out = m(q, k)
    torch.testing.assert_close(
        q_out.double(), _truth(q, pos, interleaved, rotary_dim, layout=layout), **tolerance(dtype)
    )
    torch.testing.assert_close(
        k_out.double(), _truth(k, pos, interleaved, rotary_dim, layout=layout), **tolerance(dtype)
    )


def test_layouts_agree(gen):
    q, k = randn(2, 4, 7, D, gen=gen), randn(2, 1, 7, D, gen=gen)
    a = rope_ext.RotaryEmbedding(D, layout="bhsd")(q, k)
    b = rope_ext.RotaryEmbedding(D, layout="bshd")(q.transpose(1, 2), k.transpose(1, 2))
    assert torch.equal(a[0], b[0].transpose(1, 2)) and torch.equal(a[1], b[1].transpose(1, 2))


@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_step_by_step_decode_equals_full_pass(interleaved, gen):
    """Prefill 5 tokens, then decode one at a time with offset = cached length: bit-identical."""
    m = rope_ext.RotaryEmbedding(D, interleaved=interleaved, layout="bhsd")
    q, k = randn(2, 4, 12, D, dtype=torch.bfloat16, gen=gen), randn(2, 2, 12, D, dtype=torch.bfloat16, gen=gen)
    full_q, full_k = m(q, k)
    pre_q, pre_k = m(q[:, :, :5], k[:, :, :5])
    assert torch.equal(pre_q, full_q[:, :, :5]) and torch.equal(pre_k, full_k[:, :, :5])
    for t in range(5, 12):
        step_q, step_k = m(q[:, :, t : t + 1], k[:, :, t : t + 1], offset=t)
        assert torch.equal(step_q, full_q[:, :, t : t + 1]) and torch.equal(step_k, full_k[:, :, t : t + 1])


def test_per_batch_offsets_and_left_padding(gen):
    """Row b decoding at its own cache length, and left-padded rows via position_ids, each
    equal the row run alone."""
    m = rope_ext.RotaryEmbedding(D, layout="bhsd")
    q, k = randn(3, 4, 1, D, gen=gen), randn(3, 2, 1, D, gen=gen)
    offsets = torch.tensor([0, 17, 4000])
    out_q, out_k = m(q, k, offset=offsets)
    for b in range(3):
        rq, rk = m(q[b : b + 1], k[b : b + 1], offset=int(offsets[b]))
        assert torch.equal(out_q[b : b + 1], rq) and torch.equal(out_k[b : b + 1], rk)

    # left padding: row 0 has 2 pad tokens, its real tokens take positions 0..4
    q, k = randn(2, 4, 7, D, gen=gen), randn(2, 2, 7, D, gen=gen)
    pos = torch.tensor([[0, 0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6]])
    out_q, _ = m(q, k, pos)
    alone_q, _ = m(q[:1, :, 2:], k[:1, :, 2:])
    assert torch.equal(out_q[:1, :, 2:], alone_q)


def test_packed_sequences_equal_one_by_one(gen):
    """cu_seqlens with zero-length and length-1 sequences; positions restart at each start."""
    m = rope_ext.RotaryEmbedding(D, layout="bshd")
    cu = torch.tensor([0, 3, 3, 4, 9])
    q, k = randn(9, 4, D, gen=gen), randn(9, 2, D, gen=gen)
    out_q, out_k = m(q, k, cu_seqlens=cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        if e > s:
            rq, rk = m(q[None, s:e], k[None, s:e])
            assert torch.equal(out_q[s:e], rq[0]) and torch.equal(out_k[s:e], rk[0])


# Positions where float32 angle math is known to break (LESSONS: gpt-neox #1003 and others).
LONG_POSITIONS = [0, 1, 255, 256, 2047, 2048, 2049, 4095, 15962, 48039, 65536, 131071, 1_048_575]


@pytest.mark.parametrize("base", [1e4, 5e5, 1e6], ids=str)
def test_precision_at_long_positions(base, gen):
    m = rope_ext.RotaryEmbedding(128, base, layout="bhsd")
    pos = torch.tensor(LONG_POSITIONS)
    cos, sin = m.cos_sin(pos)
    angles = pos.double()[:, None] * inv_freq(128, base)
    exact_cos, exact_sin = reference.angles_to_cos_sin(angles)
    # one float32 rounding of a value in [-1, 1]: at most 2^-25 absolute, at every position
    assert (cos.double() - exact_cos).abs().max() <= 2**-25
    assert (sin.double() - exact_sin).abs().max() <= 2**-25
    q = randn(1, 2, len(LONG_POSITIONS), 128, dtype=torch.bfloat16, gen=gen)
    q_out, _ = m(q, q, pos[None])
    torch.testing.assert_close(q_out.double(), _truth(q, pos[None], False, 128, base), **tolerance(torch.bfloat16))


def test_tables_ignore_autocast_tf32_and_module_dtype(gen):
    m = rope_ext.RotaryEmbedding(
        D, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    , layout="bhsd")
    pos = torch.arange(0, 300_000, 997)[None]
    ref = m.cos_sin(pos)
    tf32 = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under = m.cos_sin(pos)
    finally:
        torch.set_float32_matmul_precision(tf32)
    m16 = m.to(torch.bfloat16)
    assert m16.inv_freq.dtype == torch.float64
    for a, b in zip((*under, *m16.cos_sin(pos)), (*ref, *ref), strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    m.half().double()  # round trips through 16-bit types lose nothing: buffers are rebuilt
    assert torch.equal(m.cos_sin(pos)[0], ref[0])


def test_meta_init_then_to_empty_and_state_dict(gen):
    with torch.device("meta"):
        m = rope_ext.RotaryEmbedding(D, 5e5, scaling={"rope_type": "linear", "factor": 2.0}, layout="bhsd")
    assert m.inv_freq.is_meta
    m = m.to_empty(device="cpu")
    ref = rope_ext.RotaryEmbedding(D, 5e5, scaling={"rope_type": "linear", "factor": 2.0}, layout="bhsd")
    pos = torch.arange(50)[None]
    assert torch.equal(m.cos_sin(pos)[0], ref.cos_sin(pos)[0])
    assert len(m.state_dict()) == 0  # frequencies are not persistent: checkpoints stay HF-compatible


def test_compile_fullgraph_no_recompile_over_lengths(gen):
    m = rope_ext.RotaryEmbedding(
        D, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=16, layout="bhsd"
    )
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(m, fullgraph=True, dynamic=True, backend=counter)
    for s in (5, 9, 20, 33):  # crosses max_position_embeddings: dynamic NTK changes the base
        q, k = randn(1, 2, s, D, gen=gen), randn(1, 1, s, D, gen=gen)
        for a, b in zip(compiled(q, k), m(q, k), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


@pytest.mark.parametrize("center", [None, 0, 30])
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_xpos(interleaved, center, gen):
    """q scaled by zeta^((n - c)/base), k by zeta^(-(n - c)/base), c = xpos_center (default
    max_position_embeddings // 2): the score picks up zeta^((m-n)/base) and stays a function of m - n."""
    scale_base, r = 512.0, D
    m = rope_ext.RotaryEmbedding(D, interleaved=interleaved, xpos_scale_base=scale_base, xpos_center=center,
                                 layout="bhsd")
    assert m.xpos_center == (1024 if center is None else center)
    q, k = randn(1, 1, 40, D, dtype=torch.float64, gen=gen), randn(1, 1, 40, D, dtype=torch.float64, gen=gen)
    q_out, k_out = m(q, k)
    pos = torch.arange(40)
    zeta = (torch.arange(0, r, 2, dtype=torch.float64) + 0.4 * r) / (1.4 * r)
    scale = zeta ** ((pos.double()[:, None] - m.xpos_center) / scale_base)
    scale = scale.repeat_interleave(2, -1) if interleaved else torch.cat((scale, scale), -1)
    plain_q, plain_k = rope_ext.RotaryEmbedding(D, interleaved=interleaved, layout="bhsd")(q, k)
    tol = {"atol": 1e-6, "rtol": 1e-6}  # tables are float32: one rounding of cos*scale
    torch.testing.assert_close(q_out, plain_q * scale, **tol)
    torch.testing.assert_close(k_out, plain_k / scale, **tol)


def _xpos_scores(m, q, k, pos):
    q_out, k_out = m(q, k, pos[None])
    return q_out.double() @ k_out.double().transpose(-1, -2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_xpos_stays_finite_and_relative_far_out(dtype, gen):
    """Issue 19: with the exponent on n alone, k overflowed float32 past position ~36,000 (head dim
    64, scale_base 512) and the scores were NaN. Centred, every position within xpos_reach of the
    centre gives finite q and k, and the scores of a window far out equal those of the same window
    near the centre (they depend on m - n only), within the dtype's rounding of q . k."""
    m = rope_ext.RotaryEmbedding(64, xpos_scale_base=512.0, xpos_center=40000, layout="bhsd")
    reach = m.xpos_reach(dtype)
    assert reach == int((8 if dtype == torch.float16 else 100) * math.log(2) / math.log(3.5) * 512)
    q, k = randn(1, 2, 8, 64, gen=gen).to(dtype), randn(1, 2, 8, 64, gen=gen).to(dtype)
    for start in (40000 - reach, 40000 + reach - 7):  # both ends of the window
        q_out, k_out = m(q, k, torch.arange(start, start + 8)[None])
        assert torch.isfinite(q_out).all() and torch.isfinite(k_out).all()
    # the same relative scores: near the centre, and far out, computed with the plain rotation
    # of the same positions, so only the xPos factor is in question
    plain = rope_ext.RotaryEmbedding(64, layout="bhsd")
    for start in (40000, 40000 + reach - 7):
        pos = torch.arange(start, start + 8)
        got = _xpos_scores(m, q, k, pos)
        q_p, k_p = plain(q.double(), k.double(), pos[None])
        zeta = (torch.arange(0, 64, 2, dtype=torch.float64) + 0.4 * 64) / (1.4 * 64)
        rel = zeta ** ((pos[:, None, None] - pos[None, :, None]).double() / 512.0)  # (m, n, i)
        rel = torch.cat((rel, rel), -1)
        want = torch.einsum("bhmd,bhnd,mnd->bhmn", q_p, k_p, rel)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(got, want, atol=64 * 4 * eps * 8, rtol=0)  # 64 products of |.| <~ 4..8


def test_xpos_refuses_positions_out_of_reach(gen):
    m = rope_ext.RotaryEmbedding(64, xpos_scale_base=512.0, layout="bhsd")
    reach = m.xpos_reach(torch.float32)
    q, k = randn(1, 2, 4, 64, gen=gen), randn(1, 2, 4, 64, gen=gen)
    m(q, k, offset=1024 + reach - 3)  # the last position in reach
    for kwargs in (dict(offset=1024 + reach - 2), dict(position_ids=torch.tensor([[0, 1, 2, 40000]]))):
        with pytest.raises(ValueError, match=rf"positions must be within {reach} of xpos_center=1024 for "
                                             r"torch.float32 .*Set xpos_center nearer them"):
            m(q, k, **kwargs)
    # float16's range is smaller: a position fine for float32 is refused for float16
    reach16 = m.xpos_reach(torch.float16)
    with pytest.raises(ValueError, match=rf"within {reach16} of xpos_center=1024 for torch.float16"):
        m(q.half(), k.half(), offset=1024 + m.xpos_reach(torch.float16))


def test_xpos_default_center_keeps_position_0_in_reach(gen):
    """A long context (131072) with scale_base 512: its middle is farther from 0 than float32's
    reach, so the default centre is the reach itself and the first positions still work."""
    m = rope_ext.RotaryEmbedding(64, xpos_scale_base=512.0, max_position_embeddings=131072, layout="bhsd")
    assert m.xpos_center == m.xpos_reach(torch.float32) < 65536
    q, k = randn(1, 2, 10, 64, gen=gen), randn(1, 2, 10, 64, gen=gen)
    q_out, k_out = m(q, k)
    assert torch.isfinite(q_out).all() and torch.isfinite(k_out).all()


def test_xpos_check_on_the_device_path(gen):
    """Where positions are not read on the host (device tensors, compiled graphs) the range check
    is a device-side assert, no host sync; compiled on the CPU it raises when the graph runs."""
    m = rope_ext.RotaryEmbedding(64, xpos_scale_base=512.0, layout="bhsd")
    compiled = torch.compile(m, fullgraph=True)
    q, k = randn(1, 2, 4, 64, gen=gen), randn(1, 2, 4, 64, gen=gen)
    ok = torch.arange(4)[None]
    for a, b in zip(compiled(q, k, ok), m(q, k, ok), strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(RuntimeError, match="positions must be within"):
        compiled(q, k, torch.tensor([[0, 1, 2, 40000]]))


def test_mrope_matches_transformers_qwen2_vl(gen):
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

    section = [4, 6, 6]
    cfg = Qwen2VLConfig(
        text_config=dict(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section},
        )
    ).text_config
    pos = torch.stack([torch.arange(12), torch.arange(12) // 4, torch.arange(12) % 4])[:, None].expand(3, 2, 12)
    q, k = randn(2, 4, 12, 32, gen=gen), randn(2, 2, 12, 32, gen=gen)
    cos, sin = hf.Qwen2VLRotaryEmbedding(cfg)(q, pos)
    hf_q, hf_k = hf.apply_rotary_pos_emb(q, k, cos, sin)

    m = rope_ext.RotaryEmbedding.from_hf_config(cfg)
    assert m.mrope_section == tuple(section)
    ours_q, ours_k = m(q, k, pos)
    # HF: float32 angles for positions < 12 (exact products of small ints and float32
    # inv_freq, so the only extra error is HF's float32 inv_freq and cos: a few ulps)
    torch.testing.assert_close(ours_q, hf_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_k, hf_k, atol=1e-5, rtol=1e-5)

    # the transformers-4 signature: per-stream (3, B, S, D) tables, recomposed by section
    angles = pos.double()[..., None] * inv_freq(32, 1e6)
    cos3, sin3 = reference.angles_to_cos_sin(angles)
    old_q, old_k = rope_ext.apply_multimodal_rotary_pos_emb(q, k, cos3.float(), sin3.float(), section)
    torch.testing.assert_close(old_q, hf_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(old_k, hf_k, atol=1e-5, rtol=1e-5)


def test_mrope_text_positions_and_qwen2_vl_default_section(gen):
    """A Qwen2-VL config without mrope_section gets transformers' [16, 24, 24]; text-only positions
    ((B, S), (S,), none, packed (T,)) drive the three streams alike, as transformers' rotary
    embedding does (it expands them to (3, B, S)), and equal plain RoPE."""
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

    cfg = Qwen2VLConfig(
        text_config=dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    ).text_config
    m = rope_ext.RotaryEmbedding.from_hf_config(cfg)
    assert m.mrope_section == (16, 24, 24)
    q, k = randn(2, 2, 5, 128, gen=gen), randn(2, 1, 5, 128, gen=gen)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    cos, sin = hf.Qwen2VLRotaryEmbedding(cfg)(q, pos)  # (B, S): text positions
    hf_q, hf_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    ours = m(q, k, pos)
    torch.testing.assert_close(ours[0], hf_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[1], hf_k, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(ours, m(q, k, pos[None].expand(3, 2, 5)), strict=True))
    plain = rope_ext.RotaryEmbedding(128, 1e6, layout="bhsd")
    assert all(torch.equal(a, b) for a, b in zip(m(q, k), plain(q, k), strict=True))  # default positions
    assert all(torch.equal(a, b) for a, b in zip(m(q, k, pos[0]), plain(q, k, pos[0]), strict=True))  # (S,)
    pq, pk = randn(5, 2, 128, gen=gen), randn(5, 1, 128, gen=gen)
    cu = torch.tensor([0, 2, 5])
    assert all(torch.equal(a, b) for a, b in zip(m(pq, pk, cu_seqlens=cu), plain(pq, pk, cu_seqlens=cu), strict=True))
    for a, b in zip(m.cos_sin(pos), plain.cos_sin(pos), strict=True):
        assert torch.equal(a, b)


def test_mrope_stream_and_text_shapes_are_never_confused(gen):
    """(3, S) positions are three streams shared by a batch of B != 3 (as before text positions were
    accepted); with a batch of 3 they could be either, and are refused naming both spellings; (1, B, S)
    is always text."""
    m = rope_ext.RotaryEmbedding(16, mrope_section=[4, 2, 2], layout="bhsd")
    streams = torch.stack([torch.arange(5), torch.arange(5) // 2, torch.arange(5) % 2])  # (3, S)
    q2, k2 = randn(2, 2, 5, 16, gen=gen), randn(2, 1, 5, 16, gen=gen)
    for a, b in zip(m(q2, k2, streams), m(q2, k2, streams[:, None]), strict=True):
        assert torch.equal(a, b)
    q3, k3 = randn(3, 2, 5, 16, gen=gen), randn(3, 1, 5, 16, gen=gen)
    with pytest.raises(ValueError, match=r"ambiguous .*\(3, 1, S\) or \(3, B, S\), text positions as \(1, B, S\)"):
        m(q3, k3, streams)
    with pytest.raises(ValueError, match="ambiguous"):
        m.cos_sin(streams)
    text = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [2, 3, 4, 5, 6]])
    for a, b in zip(m(q3, k3, text[None]), m(q3, k3, text[None].expand(3, 3, 5)), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"must have shape \(3, 2, 5\) or \(3, 1, 5\) \(streams\), or \(2, 5\)"):
        m(q2, k2, torch.zeros(3, 3, 5, dtype=torch.int64))


def test_from_hf_config_pairing_of_flagless_interleaved_families_and_interleaved_mrope():
    """Families that always rotate interleaved pairs without a config flag (the complex freqs_cis of
    DeepSeek-V2 and Llama 4) get interleaved modules; interleaved M-RoPE (Qwen3-VL) is refused rather
    than built as chunked sections."""
    from transformers import DeepseekV2Config, Llama4TextConfig, Qwen3VLConfig

    small = dict(vocab_size=64, hidden_size=64, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1)
    assert rope_ext.RotaryEmbedding.from_hf_config(DeepseekV2Config(**small, qk_rope_head_dim=16)).interleaved
    assert rope_ext.RotaryEmbedding.from_hf_config(Llama4TextConfig(**small, head_dim=32)).interleaved
    qwen3 = Qwen3VLConfig(text_config=dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)).text_config
    with pytest.raises(ValueError, match="interleaved M-RoPE .*'qwen3_vl_text'.* not supported"):
        rope_ext.RotaryEmbedding.from_hf_config(qwen3)


MODULE_BAD = {
    "odd_rotary_dim": (dict(dim=64, rotary_dim=31), ValueError, "rotary_dim must be an even int"),
    "rotary_dim_too_big": (dict(dim=64, rotary_dim=66), ValueError, "rotary_dim must be an even int"),
    "both_partial_args": (dict(dim=64, rotary_dim=32, partial_rotary_factor=0.5), ValueError, "not both"),
    "bad_partial_factor": (dict(dim=64, partial_rotary_factor=1.5), ValueError, "partial_rotary_factor"),
    "bad_layout": (dict(dim=64, layout="sbhd"), ValueError, "layout must be one of"),
    "no_layout": (dict(dim=64, layout=None), TypeError, "give layout='bhsd'"),
    "bad_mrope_section": (dict(dim=64, mrope_section=[8, 8, 8]), ValueError, "mrope_section must be positive sizes"),
    "unknown_rope_type": (dict(dim=64, scaling={"rope_type": "ntk-by-parts"}), ValueError, "rope_type"),
    "zero_base": (dict(dim=64, base=0.0), ValueError, r"base must be a finite positive number, got 0.0"),
}


@pytest.mark.parametrize("name", MODULE_BAD)
def test_module_bad_arguments(name):
    kwargs, exc, msg = MODULE_BAD[name]
    with pytest.raises(exc, match=msg):
        rope_ext.RotaryEmbedding(**{"layout": "bhsd", **kwargs})


FORWARD_BAD = {
    "offset_and_position_ids": (
        dict(position_ids=torch.zeros(2, 5, dtype=torch.long), offset=3),
        ValueError,
        "position_ids or offset, not both",
    ),
    "negative_offset": (dict(offset=-1), ValueError, "offset must be >= 0"),
    "float_position_ids": (dict(position_ids=torch.zeros(2, 5)), TypeError, "position_ids must be an integer tensor"),
    "negative_position_ids": (dict(position_ids=torch.full((2, 5), -3)), ValueError, "position_ids must be >= 0"),
    "offset_wrong_length": (dict(offset=torch.tensor([1, 2, 3])), ValueError, r"shape \(batch,\) = \(2,\)"),
    "float_offset": (dict(offset=1.5), TypeError, "offset must be an int"),
}


@pytest.mark.parametrize("name", FORWARD_BAD)
def test_forward_bad_arguments(name):
    kwargs, exc, msg = FORWARD_BAD[name]
    m = rope_ext.RotaryEmbedding(16, layout="bhsd")
    with pytest.raises(exc, match=msg):
        m(torch.zeros(2, 2, 5, 16), torch.zeros(2, 1, 5, 16), **kwargs)


PACKED_BAD = {
    "not_ending_at_total": (torch.tensor([0, 2, 4]), "must start at 0 and end at the token count 5"),
    "decreasing": (torch.tensor([0, 3, 2, 5]), "non-decreasing"),
    "float": (torch.tensor([0.0, 5.0]), "cu_seqlens must be an integer tensor"),
    "2d": (torch.tensor([[0, 5]]), r"cu_seqlens must have shape \(num_seqs \+ 1,\)"),
}


@pytest.mark.parametrize("name", PACKED_BAD)
def test_packed_bad_cu_seqlens(name):
    cu, msg = PACKED_BAD[name]
    m = rope_ext.RotaryEmbedding(16, layout="bhsd")
    with pytest.raises((ValueError, TypeError), match=msg):
        m(torch.zeros(5, 2, 16), torch.zeros(5, 1, 16), cu_seqlens=cu)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
def test_cos_sin_tables_match_the_formula_and_the_cpp_api(interleaved):
    """rope_ext.positions.cos_sin_tables against cos/sin of position * theta computed here in float64,
    and bit for bit against the C++ API's cos_sin_tables (rope_ext/frequencies.h, through the test
    hook rope_ext_testing::cos_sin_tables): the same float64 operations in both."""
    pos = torch.tensor([[0, 3, 7, 100000]])
    inv = inv_freq(16, BASE)
    cos, sin = rope_ext.positions.cos_sin_tables(pos, inv, interleaved=interleaved, scale=0.5, dtype=torch.float64)
    angles = pos.double()[..., None] * inv.double()
    full = angles.repeat_interleave(2, -1) if interleaved else torch.cat([angles, angles], -1)
    torch.testing.assert_close(cos, 0.5 * full.cos(), rtol=0, atol=1e-15)
    torch.testing.assert_close(sin, 0.5 * full.sin(), rtol=0, atol=1e-15)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        ours = rope_ext.positions.cos_sin_tables(pos, inv, interleaved=interleaved, scale=0.5, dtype=dtype)
        cpp = cpp_api().cos_sin_tables(pos, inv, interleaved, 0.5, dtype)
        assert all(torch.equal(a, b) for a, b in zip(ours, cpp, strict=True))
