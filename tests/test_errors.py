"""Bad input gets a clear error naming the argument, from the real kernel (eager) and from
the fake kernel (torch.compile / export), never a crash or a silently wrong result."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import rope_ext

X = torch.randn(2, 5, 4, 16)
COS = torch.randn(5, 1, 16)


def _t(*shape, dtype=torch.float32):
    return torch.ones(*shape, dtype=dtype)


# name -> (x, cos, sin, message regex)
BAD_CALLS = {
    "odd_rotary_dim": (X, _t(5, 1, 7), _t(5, 1, 7), r"the rotary dim cos.size\(-1\) must be a positive even number, got 7"),
    "zero_rotary_dim": (X, _t(5, 1, 0), _t(5, 1, 0), r"the rotary dim cos.size\(-1\) must be a positive even number, got 0"),
    "rotary_dim_exceeds_head_dim": (X, _t(5, 1, 18), _t(5, 1, 18), r"the rotary dim cos.size\(-1\) = 18 exceeds the head dim x.size\(-1\) = 16"),
    "cos_sin_shape_mismatch": (X, _t(5, 1, 16), _t(1, 1, 16), r"cos and sin must have the same shape"),
    "cos_sin_dtype_mismatch": (X, _t(5, 1, 16), _t(5, 1, 16, dtype=torch.float64), r"cos and sin must have the same dtype"),
    "not_broadcastable": (X, _t(4, 1, 16), _t(4, 1, 16), r"cos and sin of shape \[4, 1, 16\] do not broadcast against x.shape\[:-1\] \+ \(rotary_dim,\) = \[2, 5, 4, 16\]"),
    "tables_of_higher_rank": (X[0], _t(2, 5, 1, 16), _t(2, 5, 1, 16), r"cos and sin of shape \[2, 5, 1, 16\] do not broadcast"),
    "integer_x": (X.long(), COS, COS, r"x must be float32, float64, float16 or bfloat16, got Long"),
    "complex_x": (X.to(torch.complex64), COS, COS, r"x must be float32, float64, float16 or bfloat16, got ComplexFloat"),
    "bool_x": (X.bool(), COS, COS, r"x must be float32, float64, float16 or bfloat16, got Bool"),
    "table_dtype_neither_x_nor_float32": (X.half(), COS.bfloat16(), COS.bfloat16(), r"cos and sin must have x's dtype \(Half\) or float32, got BFloat16"),
    "float64_tables_for_float32_x": (X, COS.double(), COS.double(), r"cos and sin must have x's dtype \(Float\) or float32, got Double"),
    "zero_dim_x": (torch.tensor(1.0), COS, COS, r"x must have at least one dimension"),
    "zero_dim_tables": (X, torch.tensor(1.0), torch.tensor(1.0), r"cos and sin must have at least one dimension"),
    "tables_on_other_device": (X, COS.to("meta"), COS.to("meta"), r"x, cos and sin must be on the same device, got x on cpu, cos on meta"),
}

# x is float but the printed dtype names depend on the path: c10 prints "Long", torch "torch.int64".
_FAKE_ALIASES = {"Long": "torch.int64", "ComplexFloat": "torch.complex64", "Bool": "torch.bool", "Half": "torch.float16",
                 "BFloat16": "torch.bfloat16", "Float": "torch.float32", "Double": "torch.float64"}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_call_eager(name):
    x, cos, sin, msg = BAD_CALLS[name]
    with pytest.raises(RuntimeError, match=f"rope_ext.rotary: {msg}"):
        rope_ext.rotary(x, cos, sin)


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_call_fake(name):
    x, cos, sin, msg = BAD_CALLS[name]
    for c10_name, torch_name in _FAKE_ALIASES.items():
        msg = msg.replace(rf"\({c10_name}\)", rf"\({torch_name}\)").replace(f"got {c10_name}", f"got {torch_name}")
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    x, cos, sin = (mode.from_tensor(t) for t in (x, cos, sin))
    with mode, pytest.raises(RuntimeError, match=f"rope_ext.rotary: {msg}"):
        rope_ext.rotary(x, cos, sin)


NON_TENSOR_CALLS = {
    "x_str": (("x", COS, COS), r"argument 'x'"),
    "cos_list": ((X, [1.0] * 16, COS), r"argument 'cos'"),
    "x_none": ((None, COS, COS), r"x must be a Tensor, got None"),
    "sin_none": ((X, COS, None), r"sin must be a Tensor, got None"),
}


@pytest.mark.parametrize("name", NON_TENSOR_CALLS)
def test_non_tensor_argument_is_named(name):
    args, msg = NON_TENSOR_CALLS[name]
    with pytest.raises((RuntimeError, TypeError), match=msg):
        rope_ext.rotary(*args)


def test_bad_calls_leave_no_partial_state():
    """After every rejected call a good call still gives the right answer (no corrupted
    global state, e.g. a cached kernel choice)."""
    for x, cos, sin, _ in BAD_CALLS.values():
        with pytest.raises(RuntimeError):
            rope_ext.rotary(x, cos, sin)
    c, s = torch.ones(5, 1, 16), torch.zeros(5, 1, 16)
    assert torch.equal(rope_ext.rotary(X, c, s), X)


@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, torch.uint16, torch.complex64])
def test_the_kernel_names_any_dtype_it_refuses(dtype):
    """Every dtype reaches rope_ext's own check, by its c10 name, also those torch's stable ABI of 2.10
    cannot translate (float8_e8m0fnu): the library reads dtype codes itself."""
    name = {torch.float8_e8m0fnu: "Float8_e8m0fnu", torch.uint16: "UInt16", torch.complex64: "ComplexFloat"}[dtype]
    x = torch.zeros(2, 8).to(dtype)
    c = torch.ones(8)
    with pytest.raises(RuntimeError, match=rf"^rope_ext.rotary: x must be float32, float64, float16 or bfloat16, got {name}$"):
        torch.ops.rope_ext.rotary(x, c, c)
    pos = torch.zeros(2, dtype=torch.int64).to(dtype) if dtype != torch.float8_e8m0fnu else torch.zeros(2).to(dtype)
    with pytest.raises(RuntimeError, match=rf"positions must be int32 or int64, got {name}$"):
        torch.ops.rope_ext.rotary_pos(torch.zeros(2, 8), torch.ones(4, 4), torch.ones(4, 4), pos)


# --- errors with a type of their own -------------------------------------------------------------------


def _outside_calls():
    """Each op by position, called with position 5 of a 4-row cache: (name, call)."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 1, 8, generator=gen)
    cache = torch.randn(4, 4, generator=gen)
    pos = torch.tensor([0, 5, 1]).unsqueeze(-1)
    w = torch.ones(8)
    return {
        "rotary_pos": lambda: rope_ext.rotary_pos(q, cache, cache, pos),
        "rotary_pos (autograd)": lambda: rope_ext.rotary_pos(q.clone().requires_grad_(), cache, cache, pos),
        "rotary_pos_qk": lambda: rope_ext.rotary_pos_qk(q, k, cache, cache, pos),
        "rotary_pos_": lambda: rope_ext.rotary_pos_(q.clone(), k.clone(), cache, cache, pos),
        "qk_norm_rotary_pos": lambda: rope_ext.qk_norm_rotary_pos(q, k, w, w, cache, cache, pos, eps=1e-6),
        "qk_norm_rotary_pos (autograd)": lambda: rope_ext.qk_norm_rotary_pos(q, k, w.clone().requires_grad_(), w,
                                                                             cache, cache, pos, eps=1e-6),
        "qk_norm_rotary_pos_": lambda: rope_ext.qk_norm_rotary_pos_(q.clone(), k.clone(), w, w, cache, cache, pos,
                                                                   eps=1e-6),
    }


@pytest.mark.parametrize("name", list(_outside_calls()))
def test_a_position_outside_the_cache_is_its_own_type(name):
    """rope_ext.PositionOutsideCache, an IndexError and a RuntimeError, with the kernel's message
    less the prefix that carried the type across the stable ABI."""
    with pytest.raises(rope_ext.PositionOutsideCache) as raised:
        _outside_calls()[name]()
    assert isinstance(raised.value, IndexError) and isinstance(raised.value, RuntimeError)
    op = name.split(" ")[0]
    assert str(raised.value).startswith(f"rope_ext.{op}: position 5 (positions.flatten()[1]) is outside the cache, "
                                        "whose 4 rows hold positions 0 to 3"), str(raised.value)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_the_type_crosses_the_library_as_its_header_says():
    """The raw op's error carries errors.h's prefix (the library's side), the one rope_ext._errors
    reads (the Python side); other errors keep their type and message."""
    from rope_ext import _errors

    header = (Path(__file__).resolve().parents[1] / "csrc" / "include" / "rope_ext" / "errors.h").read_text()
    assert re.search(rf'^#define ROPE_EXT_POSITION_OUTSIDE_CACHE "{re.escape(_errors.POSITION_OUTSIDE_CACHE)}"$',
                     header, re.M)
    cache, pos = torch.zeros(4, 4), torch.tensor([[7]])
    with pytest.raises(RuntimeError) as raised:
        torch.ops.rope_ext.rotary_pos(torch.zeros(1, 1, 8), cache, cache, pos, False, False)
    assert type(raised.value) is RuntimeError
    assert str(raised.value).startswith(_errors.POSITION_OUTSIDE_CACHE + "rope_ext.rotary_pos: position 7 ")
    with pytest.raises(RuntimeError) as raised:  # positions that do not broadcast: not that error
        rope_ext.rotary_pos(torch.zeros(2, 3, 8), cache, cache, torch.zeros(5, 1, dtype=torch.long))
    assert type(raised.value) is RuntimeError and "do not broadcast" in str(raised.value)


def test_the_module_catches_the_type_and_grows_its_cache():
    """RotaryEmbedding reads CPU positions the kernel refused and grows its cache for them (eager);
    the error it catches is the type, not its text."""
    emb = rope_ext.RotaryEmbedding(8, max_position_embeddings=4, layout="bshd")
    q = torch.randn(1, 3, 2, 8, generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([[0, 9, 2]])
    assert emb.cos_cache.shape[0] == 4
    out, _ = emb(q, q, position_ids=pos)
    assert emb.cos_cache.shape[0] >= 10
    # the float64 truth: half-split pairs, theta_i = 10000^(-2i/8)
    angles = pos[..., None].double() * 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    angles = torch.cat((angles, angles), -1)[:, :, None]
    ref = rope_ext.reference.rotary_reference(q.double(), angles.cos(), angles.sin())
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=0)  # float32 tables and products: ~1e-7
