"""Forward results of rope_ext.rotary against the float64 reference, over the full matrix of
conventions x dtypes x layouts x rotary fractions x table broadcasts."""
from __future__ import annotations

import pytest
import torch
from conftest import (
    CONVENTIONS,
    DTYPES,
    LAYOUTS,
    assert_matches_reference,
    make_layout,
    randn,
    random_tables,
    rope_tables,
    tolerance,
)

import rope_ext
from rope_ext import reference

B, S, H, D = 2, 7, 3, 72

# r values for D = 72. 72 and 36 run the vector body (16 pairs per step for float32/16-bit
# on AVX2, 32 on AVX-512) and a scalar tail; 8 is tail-only.
ROTARY_DIMS = {"full": 72, "half": 36, "small": 8}

# How cos/sin broadcast, in canonical (B, S, 1, r) terms:
#   shared:    (1, S, 1, r)  one table for the batch (the default position_ids)
#   per_batch: (B, S, 1, r)  per-row positions (left padding)
#   expanded:  (1, S, 1, r).expand(B, ...)  stride-0 batch dim
#   strided:   (B, S, 1, r) slice of a wider table: non-unit column stride
TABLE_BROADCASTS = ["shared", "per_batch", "expanded", "strided"]
TABLE_DTYPES = {"x_dtype": None, "float32": torch.float32}


def _tables(kind, r, interleaved, dtype, gen):
    pos = torch.randint(0, 4096, (B, S), generator=gen)
    if kind == "shared":
        return rope_tables(torch.arange(S)[None, :, None], r, interleaved, dtype)
    if kind == "per_batch":
        return rope_tables(pos[:, :, None], r, interleaved, dtype)
    if kind == "expanded":
        c, s = rope_tables(torch.arange(S)[None, :, None], r, interleaved, dtype)
        return c.expand(B, S, 1, r), s.expand(B, S, 1, r)
    if kind == "strided":
        c, s = rope_tables(pos[:, :, None], 2 * r, interleaved, dtype)
        return c[..., ::2], s[..., ::2]
    raise AssertionError(kind)


@pytest.mark.parametrize("table_kind", TABLE_BROADCASTS)
@pytest.mark.parametrize("rotary", ROTARY_DIMS.values(), ids=ROTARY_DIMS.keys())
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_matches_reference(interleaved, dtype, layout, rotary, table_kind, gen):
    x, to_layout = make_layout(layout, B, S, H, D, dtype, gen)
    for table_dtype in (dtype, torch.float32):
        cos, sin = _tables(table_kind, rotary, interleaved, table_dtype, gen)
        if layout == "thd":  # packed tokens carry their own row of the table
            cos, sin = cos.expand(B, S, 1, rotary), sin.expand(B, S, 1, rotary)
        cos, sin = to_layout(cos), to_layout(sin)
        x_before = x.clone()
        out = rope_ext.rotary(x, cos, sin, interleaved=interleaved)
        assert_matches_reference(out, x, cos, sin, interleaved)
        assert torch.equal(out[..., rotary:], x[..., rotary:]), "pass-through columns changed"
        assert torch.equal(x, x_before), "x was modified"
        assert out.stride() == torch.empty_like(x).stride()
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


OUTPUT_LAYOUTS = {
    "contiguous": lambda t: t,
    "permuted": lambda t: t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3),
    "odd_stride_on_a_size_1_dim": lambda t: t[:1].as_strided((1,) + t.shape[1:], (7,) + t.stride()[1:]),
    "sliced_cols": lambda t: t[..., :8],
    "sliced_and_permuted": lambda t: t.transpose(1, 2)[:, 1:],
    "expanded": lambda t: t[:, :1].expand(t.shape),
}


def test_outputs_are_laid_out_as_empty_like():
    """A new output has torch.empty_like(x)'s strides: x's own where x is non-overlapping and dense
    (allocated directly), and empty_like's choice otherwise (made by empty_like itself). Both sides
    of that switch are among the layouts."""
    def is_non_overlapping_and_dense(t):  # c10's rule: the dims of size > 1, by stride, are contiguous
        expected = 1
        dims = [(size, stride) for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1]
        for size, stride in sorted(dims, key=lambda d: d[1]):
            if stride != expected:
                return False
            expected *= size
        return True

    x0 = torch.randn(3, 5, 4, 16)
    dense = set()
    for name, make in OUTPUT_LAYOUTS.items():
        x = make(x0)
        r = x.shape[-1]
        cos, sin = torch.randn(r), torch.randn(r)
        dense.add(is_non_overlapping_and_dense(x))
        out = rope_ext.rotary(x, cos, sin)
        assert out.stride() == torch.empty_like(x).stride(), name
        torch.testing.assert_close(out, rope_ext.reference.rotary_reference(x, cos, sin), rtol=1e-6, atol=1e-6)
        k = make(x0 + 1)
        q_out, k_out = torch.ops.rope_ext.rotary_qk(x, k, cos, sin)
        assert (q_out.stride(), k_out.stride()) == (torch.empty_like(x).stride(), torch.empty_like(k).stride()), name
    assert dense == {True, False}


@pytest.mark.parametrize("rotary", ROTARY_DIMS.values(), ids=ROTARY_DIMS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
@pytest.mark.parametrize("layout", ["bshd", "strided_cols"])
def test_conjugate_general_tables(layout, interleaved, dtype, rotary, gen):
    """Both directions with arbitrary tables (c1 != c2, s1 != s2 within a pair)."""
    x, _ = make_layout(layout, B, S, H, D, dtype, gen)
    cos, sin = random_tables((B, S, 1, rotary), torch.float32, gen)
    for conjugate in (False, True):
        out = rope_ext.rotary(x, cos, sin, interleaved=interleaved, conjugate=conjugate)
        assert_matches_reference(out, x, cos, sin, interleaved, conjugate)


@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_conjugate_is_transpose(interleaved, gen):
    """<rotary(x), y> == <x, rotary(y, conjugate=True)> for any tables: the adjoint."""
    x, y = randn(4, 5, 2, 16, dtype=torch.float64, gen=gen), randn(4, 5, 2, 16, dtype=torch.float64, gen=gen)
    cos, sin = random_tables((4, 5, 1, 12), torch.float64, gen)
    lhs = (rope_ext.rotary(x, cos, sin, interleaved=interleaved) * y).sum()
    rhs = (x * rope_ext.rotary(y, cos, sin, interleaved=interleaved, conjugate=True)).sum()
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_conjugate_undoes_rotation(interleaved, gen):
    x = randn(3, 9, 4, 64, dtype=torch.float64, gen=gen)
    cos, sin = rope_tables(torch.arange(9)[:, None] * 1000, 64, interleaved, torch.float64)
    y = rope_ext.rotary(x, cos, sin, interleaved=interleaved)
    back = rope_ext.rotary(y, cos, sin, interleaved=interleaved, conjugate=True)
    torch.testing.assert_close(back, x, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_relative_position_property(interleaved, gen):
    """After rotation <q_m, k_n> depends only on m - n: RoPE's defining property."""
    d = 64
    q, k = randn(d, dtype=torch.float64, gen=gen), randn(d, dtype=torch.float64, gen=gen)

    def score(m, n):
        cm, sm = rope_tables(torch.tensor(m), d, interleaved, torch.float64)
        cn, sn = rope_tables(torch.tensor(n), d, interleaved, torch.float64)
        qm = rope_ext.rotary(q, cm, sm, interleaved=interleaved)
        kn = rope_ext.rotary(k, cn, sn, interleaved=interleaved)
        return torch.dot(qm, kn)

    for m, n in [(5, 2), (100, 40), (4000, 1234)]:
        base = score(m, n)
        for shift in (1, 17, 10_000):
            torch.testing.assert_close(score(m + shift, n + shift), base, rtol=1e-10, atol=1e-10)
    # and it really depends on the offset, not a constant
    assert abs(score(5, 2).item() - score(9, 2).item()) > 1e-3


REFERENCE_FORMS = {
    "rotate": reference.rotary_reference,
    "complex": reference.rotary_complex,
    "pairs_loop": reference.rotary_pairs_loop,
}


@pytest.mark.parametrize("conjugate", [False, True])
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
@pytest.mark.parametrize("form", REFERENCE_FORMS.values(), ids=REFERENCE_FORMS.keys())
def test_reference_forms_agree_with_op(form, interleaved, conjugate, gen):
    x = randn(2, 5, 3, 20, dtype=torch.float64, gen=gen)
    cos, sin = rope_tables(torch.randint(0, 1000, (2, 5, 1), generator=gen), 12, interleaved, torch.float64)
    expected = rope_ext.rotary(x, cos, sin, interleaved=interleaved, conjugate=conjugate)
    torch.testing.assert_close(form(x, cos, sin, interleaved, conjugate), expected, rtol=1e-13, atol=1e-13)


def test_reference_forms_agree_with_hf_rotate_half_formula(gen):
    """rotary_reference is HF's q * cos + rotate_half(q) * sin, written independently here."""
    q = randn(2, 4, 6, 32, dtype=torch.float64, gen=gen)  # (B, H, S, D)
    cos, sin = rope_tables(torch.arange(6), 32, False, torch.float64)
    hf = q * cos + torch.cat((-q[..., 16:], q[..., :16]), dim=-1) * sin
    torch.testing.assert_close(reference.rotary_reference(q, cos, sin), hf, rtol=0, atol=0)


def test_interleaved_is_permuted_halfsplit(gen):
    """interleaved(x) == P^-1 halfsplit(P x) with P the even/odd de-interleave that HF's
    checkpoint conversion applies: the two conventions are one rotation in two orders."""
    x = randn(3, 5, 2, 16, dtype=torch.float64, gen=gen)
    r = 16
    perm = torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))
    inv = torch.argsort(perm)
    cos_i, sin_i = rope_tables(torch.arange(5)[:, None], r, True, torch.float64)
    cos_h, sin_h = rope_tables(torch.arange(5)[:, None], r, False, torch.float64)
    inter = rope_ext.rotary(x, cos_i, sin_i, interleaved=True)
    half = rope_ext.rotary(x[..., perm], cos_h, sin_h, interleaved=False)[..., inv]
    torch.testing.assert_close(inter, half, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("shape", [(0, 4, 2, 16), (2, 0, 2, 16), (2, 4, 0, 16), (0, 16)], ids=str)
def test_empty(shape):
    x = torch.randn(shape)
    cos = torch.ones(*shape[:-1][:1], *([1] * (len(shape) - 2)), 8)
    out = rope_ext.rotary(x, cos, cos)
    assert out.shape == x.shape and out.numel() == 0


def test_single_token_decode_shape(gen):
    x = randn(4, 32, 1, 128, dtype=torch.bfloat16, gen=gen)  # (B, H, S=1, D)
    cos, sin = rope_tables(torch.tensor([[517], [3], [9000], [0]])[:, None], 128, False)
    assert_matches_reference(rope_ext.rotary(x, cos, sin), x, cos, sin, False)


def test_expanded_x(gen):
    """x with a stride-0 dim (one head broadcast to 4) gives a dense output."""
    x = randn(2, 5, 1, 24, gen=gen).expand(2, 5, 4, 24)
    cos, sin = rope_tables(torch.arange(5)[:, None], 24, False)
    out = rope_ext.rotary(x, cos, sin)
    assert_matches_reference(out, x, cos, sin, False)
    assert 0 not in out.stride()


def test_float64_x_with_float32_tables_computes_in_float64(gen):
    x = randn(3, 4, 2, 16, dtype=torch.float64, gen=gen)
    cos, sin = rope_tables(torch.arange(4)[:, None] * 977, 16, False, torch.float32)
    out = rope_ext.rotary(x, cos, sin)
    torch.testing.assert_close(out, reference.rotary_reference(x, cos.double(), sin.double()),
                               **tolerance(torch.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16bit_rounds_once(dtype, gen):
    """16-bit output equals the float64 result rounded once: no intermediate 16-bit rounding.
    Rounding twice (e.g. x*cos in bf16, then the sum) breaks this for a sizable fraction."""
    x = randn(64, 8, 128, dtype=dtype, gen=gen)
    cos, sin = rope_tables(torch.randint(0, 100_000, (64, 1), generator=gen), 128, False)
    out = rope_ext.rotary(x, cos, sin)
    exact = reference.rotary_reference(x.double(), cos.double(), sin.double())
    # A float32 result within 48 u_fp32 of exact rounds to the same 16-bit value as exact
    # except within that distance of a rounding boundary: a vanishing fraction of elements.
    mismatch = (out != exact.to(dtype)).double().mean().item()
    assert mismatch < 1e-3, mismatch
