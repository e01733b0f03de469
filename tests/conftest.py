"""Shared test parameters, tolerances and input factories for rope_ext."""
from __future__ import annotations

import pytest
import torch

import rope_ext  # noqa: F401  (loads the ops)
from rope_ext import reference

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
CONVENTIONS = {"halfsplit": False, "interleaved": True}

# --- tolerances ----------------------------------------------------------------------------
#
# The kernels compute each output as x1*c1 -/+ x2*s1 in the math type (float32; float64 for
# float64 x) and round once to x's dtype. Tests compare with the same formula evaluated in
# float64 on the same (already rounded) inputs, so the only errors are:
#   math:  at most 3 roundings of the math type on terms bounded by |x| * |table|.
#          Test inputs keep |x| <= 8 (randn clipped) and |cos|, |sin| <= 1, so the error is at
#          most 3 * u_math * (8 + 8) = 48 * u_math.                            -> atol
#   store: one rounding to x's dtype, at most half an ulp: u_out * |out|.    -> rtol
# u is the unit roundoff: 2^-24 (float32), 2^-53 (float64), 2^-11 (float16), 2^-8 (bfloat16).
# float16's subnormal range adds an absolute error below 2^-25, inside atol.
_UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.float16: 2.0**-11,
                  torch.bfloat16: 2.0**-8}
_MATH_TYPE = {torch.float64: torch.float64}  # everything else computes in float32


def tolerance(dtype: torch.dtype) -> dict:
    u_math = _UNIT_ROUNDOFF[_MATH_TYPE.get(dtype, torch.float32)]
    return {"atol": 48 * u_math, "rtol": _UNIT_ROUNDOFF[dtype]}


X_BOUND = 8.0  # |x| bound the tolerances assume


def assert_matches_reference(out, x, cos, sin, interleaved, conjugate=False):
    """out == rotary(x, cos, sin) computed in float64, within out.dtype's tolerance."""
    expected = reference.rotary_reference(x.double(), cos.double(), sin.double(), interleaved, conjugate)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, **tolerance(x.dtype))


# --- inputs --------------------------------------------------------------------------------


def randn(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).clamp(-X_BOUND, X_BOUND).to(dtype)


def inv_freq(r: int, base: float = 10000.0) -> torch.Tensor:
    """theta_i = base^(-2i/r), i < r/2, in float64."""
    return base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)


def rope_tables(positions: torch.Tensor, r: int, interleaved: bool, dtype=torch.float32, base=10000.0):
    """Full-form (cos, sin) of shape positions.shape + (r,) for real RoPE angles."""
    angles = positions.to(torch.float64)[..., None] * inv_freq(r, base)
    cos, sin = reference.angles_to_cos_sin(angles, interleaved)
    return cos.to(dtype), sin.to(dtype)


def random_tables(shape, dtype=torch.float32, gen=None):
    """Arbitrary (cos, sin) in [-1, 1] with unequal entries within a pair: exercises the
    general per-pair matrix [[c1, -s1], [s2, c2]], not only rotations."""
    c = torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1
    s = torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1
    return c.to(dtype), s.to(dtype)


# Layouts of a (B, S, H, D) batch of heads, as users hand them to a RoPE op. Each returns
# (x, to_layout), where to_layout maps a canonical (B, S, 1, r)-broadcastable table to the
# layout's dim order, so cos/sin broadcast against x the way a user would build them.
def _bshd(t):
    return t.contiguous()


def _make_bshd(src):
    return src.clone(), _bshd


def _make_bhsd(src):
    return src.transpose(1, 2).contiguous(), lambda t: t.transpose(1, 2)


def _make_hf_view(src):  # HF: (B,H,S,D) view over (B,S,H,D) projection output
    return src.clone().transpose(1, 2), lambda t: t.transpose(1, 2)


def _make_qkv_slice(src):  # q = qkv[:, :, 1] of a packed (B, S, 3, H, D) buffer
    B, S, H, D = src.shape
    qkv = torch.zeros(B, S, 3, H, D, dtype=src.dtype)
    qkv[:, :, 1] = src
    return qkv[:, :, 1], _bshd


def _make_padded(src):  # rows padded to a wider stride (vLLM's padded-shape case)
    B, S, H, D = src.shape
    buf = torch.full((B, S, H, D + 8), float("nan"), dtype=src.dtype)
    buf[..., :D] = src
    return buf[..., :D], _bshd


def _make_strided_cols(src):  # last-dim stride 2: exercises the scalar path
    buf = torch.zeros(*src.shape[:-1], 2 * src.shape[-1], dtype=src.dtype)
    buf[..., ::2] = src
    return buf[..., ::2], _bshd


def _make_thd(src):  # packed tokens (T, H, D)
    return src.reshape(-1, *src.shape[2:]).clone(), lambda t: t.reshape(-1, *t.shape[2:])


LAYOUTS = {
    "bshd": _make_bshd,
    "bhsd": _make_bhsd,
    "hf_view": _make_hf_view,
    "qkv_slice": _make_qkv_slice,
    "padded": _make_padded,
    "strided_cols": _make_strided_cols,
    "thd": _make_thd,
}


def make_layout(name: str, B: int, S: int, H: int, D: int, dtype, gen=None):
    return LAYOUTS[name](randn(B, S, H, D, dtype=dtype, gen=gen))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)
