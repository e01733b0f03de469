"""rope_ext.compat.vllm.rotary_embedding against a reference written from vLLM's documented
semantics (its forward_native): for the token at position p, cos, sin = cache[p].chunk(2); per
head, NeoX pairs (i, i + rot/2) and GPT-J pairs (2i, 2i + 1) rotate as
(x1 cos - x2 sin, x2 cos + x1 sin); columns past rot_dim are untouched; query and key change in
place."""

from __future__ import annotations

import pytest
import torch
from conftest import CONVENTIONS, inv_freq, randn, tolerance

from rope_ext.compat.vllm import rotary_embedding


def vllm_cache(max_pos: int, rot: int, dtype) -> torch.Tensor:
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq(rot)
    return torch.cat((angles.cos(), angles.sin()), -1).to(dtype)


def vllm_reference(positions, x, head_size, cache, is_neox):
    """float64, from the formula above; x is (*tokens, heads * head_size)."""
    x = x.double().unflatten(-1, (-1, head_size))
    rot = cache.shape[-1]
    cos, sin = cache.double()[positions].chunk(2, -1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # over heads
    r = x[..., :rot]
    x1, x2 = (r[..., : rot // 2], r[..., rot // 2 :]) if is_neox else (r[..., 0::2], r[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rotated = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
    return torch.cat((rotated, x[..., rot:]), -1).flatten(-2)


CASES = {
    # name: (positions shape, heads q, heads k, head_size, rot_dim)
    "flat_tokens_full": ((7,), 4, 2, 64, 64),
    "flat_tokens_partial": ((7,), 4, 1, 128, 64),
    "batched_partial": ((2, 5), 3, 3, 80, 32),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("neox", CONVENTIONS.values(), ids=["gptj", "neox"])
def test_matches_vllm_semantics_in_place(neox, case, dtype, gen):
    is_neox = not neox  # CONVENTIONS maps to interleaved: neox is its negation
    shape, hq, hk, head_size, rot = case
    positions = torch.randint(0, 300, shape, generator=gen)
    q = randn(*shape, hq * head_size, dtype=dtype, gen=gen)
    k = randn(*shape, hk * head_size, dtype=dtype, gen=gen)
    for cache_dtype in {dtype, torch.float32}:
        cache = vllm_cache(300, rot, cache_dtype)
        q1, k1 = q.clone(), k.clone()
        want_q = vllm_reference(positions, q, head_size, cache, is_neox)
        want_k = vllm_reference(positions, k, head_size, cache, is_neox)
        assert rotary_embedding(positions, q1, k1, head_size, cache, is_neox) is None
        torch.testing.assert_close(q1.double(), want_q, **tolerance(dtype))
        torch.testing.assert_close(k1.double(), want_k, **tolerance(dtype))
        # pass-through columns are the input's bits
        tail = q.unflatten(-1, (hq, head_size))[..., rot:]
        assert torch.equal(q1.unflatten(-1, (hq, head_size))[..., rot:], tail)


def test_fused_qkv_split_heads_and_strided_rows(gen):
    positions = torch.tensor([3, 0, 9, 9])
    cache = vllm_cache(16, 32, torch.float32)
    qkv = randn(4, 3 * 2 * 32, gen=gen)  # fused qkv projection: q is a strided slice
    q, k = qkv[:, : 2 * 32], qkv[:, 2 * 32 : 4 * 32]  # vLLM's split of its fused projection
    want_q, want_k = (vllm_reference(positions, t, 32, cache, True) for t in (q, k))
    v = qkv[:, 4 * 32 :].clone()
    rotary_embedding(positions, q, k, 32, cache, True)
    torch.testing.assert_close(qkv[:, : 2 * 32].double(), want_q, **tolerance(torch.float32))
    torch.testing.assert_close(qkv[:, 2 * 32 : 4 * 32].double(), want_k, **tolerance(torch.float32))
    assert torch.equal(qkv[:, 4 * 32 :], v)
    q3 = randn(4, 2, 32, gen=gen)  # (tokens, heads, head_size)
    want = vllm_reference(positions, q3.flatten(-2), 32, cache, False).unflatten(-1, (2, 32))
    rotary_embedding(positions, q3, None, 32, cache, False)
    torch.testing.assert_close(q3.double(), want, **tolerance(torch.float32))


def test_bad_inputs():
    cache = vllm_cache(8, 16, torch.float32)
    q = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="position 8 .* is outside the cache, whose 8 rows"):
        rotary_embedding(torch.tensor([0, 1, 8, 2]), q, None, 16, cache, True)
    with pytest.raises(ValueError, match="query.shape\\[-1\\] = 32 is not a multiple of head_size = 12"):
        rotary_embedding(torch.arange(4), q, None, 12, cache, True)
    with pytest.raises(ValueError, match="cos_sin_cache must be \\(max_position, rotary_dim\\) with an even"):
        rotary_embedding(torch.arange(4), q, None, 16, cache[:, :5], True)
    with pytest.raises(ValueError, match="query must be \\(\\*positions.shape"):
        rotary_embedding(torch.arange(3), q, None, 16, cache, True)
    q_t = torch.randn(32, 4).t()  # column-major: heads are still views of the caller's memory
    want = vllm_reference(torch.arange(4), q_t, 16, cache, True)
    rotary_embedding(torch.arange(4), q_t, None, 16, cache, True)
    torch.testing.assert_close(q_t.double(), want, **tolerance(torch.float32))
