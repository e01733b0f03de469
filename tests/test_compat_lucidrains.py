"""rope_ext.compat.lucidrains against the real rotary-embedding-torch 0.9.1 (a test dependency), and
its one deliberate difference (16-bit positions) against a float64 formula.

Tolerances: in float32 both compute the same products and sums on the same float32 angles, so
they agree to a few float32 roundings of the output's magnitude (xPos scales add one rounding per
factor); 16-bit inputs compute in float32 in both and round once to the input's dtype at the end,
so they agree within one unit of that dtype's rounding, except where float32 rounding crossed a
rounding boundary of the 16-bit result (one more unit)."""

from __future__ import annotations

import pytest
import rotary_embedding_torch as lr
import torch
from conftest import RopeOpSpy

from rope_ext.compat import lucidrains as ours


def close(got, ref, dtype=torch.float32, units=8):
    assert got.dtype == ref.dtype and got.shape == ref.shape
    eps = torch.finfo(dtype).eps
    bound = units * eps * max(1.0, ref.detach().abs().max().item())
    torch.testing.assert_close(got, ref, atol=bound, rtol=0)


def pair(**kwargs):
    """The library's module and ours, built with the same arguments."""
    return lr.RotaryEmbedding(**kwargs), ours.RotaryEmbedding(**kwargs)


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


CONFIGS = {
    "lang": dict(dim=32),
    "theta": dict(dim=32, theta=500000),
    "partial": dict(dim=16),  # rotates 16 of the 64 columns
    "pixel": dict(dim=32, freqs_for="pixel", max_freq=64),
    "constant": dict(dim=8, freqs_for="constant", num_freqs=4),
    "interpolate": dict(dim=32, interpolate_factor=4.0),
    "ntk": dict(dim=32, theta_rescale_factor=8.0),
    "custom": dict(dim=32, custom_freqs=torch.linspace(0.01, 1.0, 16)),
    "no-cache": dict(dim=32, cache_if_possible=False),
}


@pytest.mark.parametrize("offset", [0, 7])
@pytest.mark.parametrize("name", CONFIGS)
def test_rotate_queries_or_keys(name, offset):
    ref_mod, our_mod = pair(**CONFIGS[name])
    for shape in ((2, 4, 10, 64), (3, 10, 64)):  # (B, H, n, d) and (B, n, d)
        t = randn(*shape).requires_grad_()
        ref = ref_mod.rotate_queries_or_keys(t, offset=offset)
        got = our_mod.rotate_queries_or_keys(t, offset=offset)
        close(got, ref)
        w = randn(*shape, seed=1)
        (g_ref,) = torch.autograd.grad((ref * w).sum(), t)
        (g_got,) = torch.autograd.grad((got * w).sum(), t)
        close(g_got, g_ref)
    # the second call comes from the cache in both
    close(our_mod.rotate_queries_or_keys(t, offset=offset), ref_mod.rotate_queries_or_keys(t, offset=offset))


def test_seq_before_head_dim():
    ref_mod, our_mod = pair(dim=32, seq_before_head_dim=True)
    t = randn(2, 10, 4, 64)  # (B, n, H, d)
    close(our_mod.rotate_queries_or_keys(t, offset=3), ref_mod.rotate_queries_or_keys(t, offset=3))
    ref_mod, our_mod = pair(dim=32)
    close(our_mod.rotate_queries_or_keys(t, seq_dim=-3), ref_mod.rotate_queries_or_keys(t, seq_dim=-3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_within_one_rounding(dtype):
    """Up to 256 positions 16-bit positions are exact, so the library and rope_ext agree; both
    compute in float32 and round once."""
    ref_mod, our_mod = pair(dim=64)
    t = randn(2, 4, 200, 64, dtype=dtype)
    close(our_mod.rotate_queries_or_keys(t, offset=50), ref_mod.rotate_queries_or_keys(t, offset=50), dtype, units=1)


def test_16_bit_positions_stay_exact():
    """The deliberate difference: the library rounds bfloat16 positions (position 1001 becomes
    1000), rope_ext keeps them; its result is the float64 formula rounded once."""
    _, our_mod = pair(dim=64)
    t = randn(1, 2, 1100, 64, dtype=torch.bfloat16)
    got = our_mod.rotate_queries_or_keys(t)
    angles = torch.arange(1100, dtype=torch.float64)[:, None] * our_mod.freqs.double().repeat_interleave(2)
    x = t.double()
    rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    expected = x * angles.cos() + rot * angles.sin()
    close(got.double(), expected, torch.bfloat16, units=1)
    ref_mod = lr.RotaryEmbedding(dim=64)
    assert (ref_mod.rotate_queries_or_keys(t).double() - expected).abs().max() > 0.1  # what the library gives


def test_xpos_queries_and_keys_in_one_op_call():
    ref_mod, our_mod = pair(dim=32, use_xpos=True, xpos_scale_base=64)
    q, k = randn(2, 4, 24, 32).requires_grad_(), randn(2, 4, 24, 32, seed=1).requires_grad_()
    ref = ref_mod.rotate_queries_and_keys(q, k)
    with RopeOpSpy() as count:
        got = our_mod.rotate_queries_and_keys(q, k)
    assert count.names == ["rotary_qk"]
    for g, r in zip(got, ref, strict=True):
        close(g, r)
    loss = lambda qk: (qk[0] * randn(*q.shape, seed=2)).sum() + (qk[1] * randn(*k.shape, seed=3)).sum()  # noqa: E731
    for g, r in zip(torch.autograd.grad(loss(got), (q, k)), torch.autograd.grad(loss(ref), (q, k)), strict=True):
        close(g, r)
    with pytest.raises(ValueError, match="rotate queries and keys together"):
        our_mod.rotate_queries_or_keys(q)


@pytest.mark.parametrize("xpos", [False, True])
def test_rotate_queries_with_cached_keys(xpos):
    ref_mod, our_mod = pair(dim=32, use_xpos=xpos)
    q, k = randn(1, 4, 3, 32), randn(1, 4, 11, 32, seed=1)
    for offset in (0, 2):
        ref = ref_mod.rotate_queries_with_cached_keys(q, k, offset=offset)
        got = our_mod.rotate_queries_with_cached_keys(q, k, offset=offset)
        for g, r in zip(got, ref, strict=True):
            close(g, r)


@pytest.mark.parametrize("freqs_for", ["lang", "pixel"])
def test_axial_freqs(freqs_for):
    ref_mod, our_mod = pair(dim=16, freqs_for=freqs_for, cache_if_possible=False)
    for dims in ((4, 6), (2, 3, 5)):
        close(our_mod.get_axial_freqs(*dims), ref_mod.get_axial_freqs(*dims))
        offsets = tuple(range(1, len(dims) + 1))
        close(our_mod.get_axial_freqs(*dims, offsets=offsets), ref_mod.get_axial_freqs(*dims, offsets=offsets))
    # 2-D RoPE for an image: (B, H, W, heads?, d) rotated with the module-level function
    freqs = ref_mod.get_axial_freqs(4, 6)  # (4, 6, 32)
    x = randn(2, 4, 6, 48)
    close(ours.apply_rotary_emb(our_mod.get_axial_freqs(4, 6), x), lr.apply_rotary_emb(freqs, x))


@pytest.mark.parametrize("start_index", [0, 8])
def test_module_level_apply(start_index):
    freqs = lr.RotaryEmbedding(dim=16)(torch.arange(12).float())  # (12, 16) angles
    t = randn(2, 3, 10, 40)  # 2-D angles align with t's last 10 positions
    scale = 0.5 + randn(12, 16, seed=4).abs()
    for s in (1.0, 0.75, scale[-10:]):
        close(ours.apply_rotary_emb(freqs, t, start_index=start_index, scale=s),
              lr.apply_rotary_emb(freqs, t, start_index=start_index, scale=s))
    rotations = randn(10, 4)
    ranges = torch.tensor([1.0, 2.0])
    close(ours.apply_learned_rotations(rotations, t, freq_ranges=ranges),
          lr.apply_learned_rotations(rotations, t, freq_ranges=ranges))
    with pytest.raises(ValueError, match="needs a feature dim of at least 48"):
        ours.apply_rotary_emb(freqs, t, start_index=32)


def test_learned_freq_gets_its_gradient():
    ref_mod, our_mod = pair(dim=32, learned_freq=True)
    assert our_mod.freqs.requires_grad
    t = randn(2, 4, 10, 32)
    w = randn(2, 4, 10, 32, seed=1)
    (g_ref,) = torch.autograd.grad((ref_mod.rotate_queries_or_keys(t) * w).sum(), ref_mod.freqs)
    (g_got,) = torch.autograd.grad((our_mod.rotate_queries_or_keys(t) * w).sum(), our_mod.freqs)
    close(g_got, g_ref, units=64)  # a sum over 800 products per frequency


def test_state_dict_and_forward_interchange():
    ref_mod = lr.RotaryEmbedding(dim=32, learned_freq=True)
    with torch.no_grad():
        ref_mod.freqs.mul_(1.5)
    our_mod = ours.RotaryEmbedding(dim=32, learned_freq=True)
    assert our_mod.state_dict().keys() == ref_mod.state_dict().keys()
    our_mod.load_state_dict(ref_mod.state_dict())
    pos = torch.arange(9).float()
    close(our_mod(pos), ref_mod(pos))


def test_xpos_length_past_the_float_range_is_refused():
    """The library centres xPos on the call's n positions; far enough out its scales overflow (k
    turns inf). Here lengths past 2 * xpos_reach + 1 (scales past 2^+-100, float16 2^+-8) are
    refused, and the longest accepted one is finite."""
    from rope_ext.positions import xpos_reach

    _, our_mod = pair(dim=16, use_xpos=True, xpos_scale_base=8)
    reach = xpos_reach(8, torch.float32)
    for dtype, n in ((torch.float32, 2 * reach + 1), (torch.float16, 2 * xpos_reach(8, torch.float16) + 1)):
        q = randn(1, 1, n, 16, dtype=dtype)
        q_out, k_out = our_mod.rotate_queries_and_keys(q, q)
        assert torch.isfinite(q_out).all() and torch.isfinite(k_out).all()
        q = randn(1, 1, n + 1, 16, dtype=dtype)
        limit = rf"beyond xPos's limit for {dtype} \(scales within 2\^\+-\d+\): an exponent"
        with pytest.raises(ValueError, match=limit):
            our_mod.rotate_queries_and_keys(q, q)
    ref_mod = lr.RotaryEmbedding(dim=16, use_xpos=True, xpos_scale_base=8)
    q = randn(1, 1, 4 * reach, 16)
    assert not torch.isfinite(ref_mod.rotate_queries_and_keys(q, q)[1]).all()  # what the library gives


def test_xpos_cached_keys_checks_the_query_exponent():
    """With cached keys the library centres q's exponent on q_len // 2 while q's positions sit at the
    end of k: one query after k_len keys has power ~ k_len / scale_base, twice k's."""
    from rope_ext.positions import xpos_reach

    _, our_mod = pair(dim=16, use_xpos=True, xpos_scale_base=8)
    reach = xpos_reach(8, torch.float32)
    k = randn(1, 1, reach + 1, 16)
    q_out, k_out = our_mod.rotate_queries_with_cached_keys(randn(1, 1, 1, 16), k)  # q at distance reach
    assert torch.isfinite(q_out).all() and (q_out != 0).all() and torch.isfinite(k_out).all()
    with pytest.raises(ValueError, match="an exponent 443 positions from its centre"):
        our_mod.rotate_queries_with_cached_keys(randn(1, 1, 1, 16), randn(1, 1, reach + 2, 16))


def test_results_do_not_depend_on_earlier_calls():
    """The library's caches answer by length: a 10-token xPos call after a 40-token one reuses the
    40-token scales, and axial angles with offsets poison its angle cache. rope_ext gives what a
    fresh library module gives, whatever came before."""
    ref_mod, our_mod = pair(dim=16, use_xpos=True, xpos_scale_base=32)
    for n in (40, 10):
        q, k = randn(1, 2, n, 16), randn(1, 2, n, 16, seed=1)
        got = our_mod.rotate_queries_and_keys(q, k)
        fresh = lr.RotaryEmbedding(dim=16, use_xpos=True, xpos_scale_base=32).rotate_queries_and_keys(q, k)
        stale = ref_mod.rotate_queries_and_keys(q, k)
        for g, f in zip(got, fresh, strict=True):
            close(g, f)
    assert (stale[0] - fresh[0]).abs().max() > 0.1  # the library's second call reused the first's scales

    ref_mod, our_mod = pair(dim=16)
    uncached = lr.RotaryEmbedding(dim=16, cache_if_possible=False)
    close(our_mod.get_axial_freqs(4, 6, offsets=(3, 5)), uncached.get_axial_freqs(4, 6, offsets=(3, 5)))
    t = randn(1, 2, 6, 16)
    close(our_mod.rotate_queries_or_keys(t), uncached.rotate_queries_or_keys(t))


def test_loading_new_frequencies_refreshes_the_angles():
    a, b = ours.RotaryEmbedding(dim=16), ours.RotaryEmbedding(dim=16, theta=100)
    t = randn(1, 2, 6, 16)
    a.rotate_queries_or_keys(t)  # fills a's cache
    a.load_state_dict(b.state_dict())
    close(a.rotate_queries_or_keys(t), b.rotate_queries_or_keys(t))


def test_non_negative_seq_dim_counts_from_the_front():
    ref_mod, our_mod = pair(dim=16)
    t = randn(2, 3, 7, 16)
    close(our_mod.rotate_queries_or_keys(t, seq_dim=2), ref_mod.rotate_queries_or_keys(t, seq_dim=2))
    t = randn(2, 7, 3, 16)  # (the library reshapes its angles only for seq_dim == -3 itself)
    close(our_mod.rotate_queries_or_keys(t, seq_dim=1), ref_mod.rotate_queries_or_keys(t, seq_dim=-3))
    with pytest.raises(ValueError, match=r"seq_dim must be the dim 2 or 3 from the end of t \(of 4 dims\), got 3"):
        our_mod.rotate_queries_or_keys(t, seq_dim=3)
