"""rotary_pos, rotary_pos_qk, rotary_pos_: RoPE by positions, gathering rows of half-width caches
inside the kernel, on the CPU kernel and on the CUDA thread function run by host emulation.

The references are independent of the kernel: the caches are built in float64 from the angles, and
each result is compared with the float64 formula (rope_ext.reference.rotary_reference) on full-width
tables gathered by plain indexing; and, bit for bit, with rotary() on those tables, which performs
the same roundings."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo.testing
from conftest import (
    CONVENTIONS,
    DTYPES,
    LAUNCH_FIELDS,
    TESTING,
    assert_matches_reference,
    cpu_thresholds,
    hook_setting,
    inv_freq,
    make_layout,
    path_counts,
    path_counts_since,
    randn,
    random_tables,
)

import rope_ext

ops = torch.ops.rope_ext
MAX_POS = 50
# (head_dim, rotary_dim): full, partial, and widths that do not split into whole 16-byte vectors
DIMS = {"64_full": (64, 64), "64_half": (64, 32), "72_40": (72, 40), "10_6": (10, 6)}


def caches(r: int, dtype=torch.float32, max_pos: int = MAX_POS, base: float = 10000.0):
    """Half-width (max_pos, r/2) cos/sin of p * theta_i, angles in float64."""
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq(r, base)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def full_tables(cos_cache, sin_cache, positions, interleaved):
    """The full-form tables rotary() takes, gathered in plain PyTorch: positions.shape + (r,)."""
    c, s = cos_cache[positions.long()], sin_cache[positions.long()]
    if interleaved:
        return c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
    return torch.cat((c, c), -1), torch.cat((s, s), -1)


# Per layout (conftest.LAYOUTS, B=2, S=5, H=3): positions in the shape a user passes, broadcasting
# against x.shape[:-1], drawn from (B, S) token positions.
def positions_for(layout: str, pos_bs: torch.Tensor) -> torch.Tensor:
    if layout in ("bhsd", "hf_view"):
        return pos_bs[:, None, :]  # (B, 1, S)
    if layout == "thd":
        return pos_bs.reshape(-1, 1)  # (T, 1)
    return pos_bs[:, :, None]  # (B, S, 1)


def plan_index_only():
    """In the block, emulated gathered calls address rows through PlanIndex (any layout) where the
    CUDA launcher would use CompactIndex (rotary_thread.h), so that both index types see every case."""
    return hook_setting("cuda_allow_compact_index", False)


def emulate_both_indexes(emulate, *args):
    """`emulate(*args)` with the index the launcher picks and with PlanIndex; asserts they agree."""
    out = emulate(*args)
    with plan_index_only():
        again = emulate(*args)
    pairs = zip(out, again, strict=True) if isinstance(out, tuple) else [(out, again)]
    assert all(torch.equal(a, b) for a, b in pairs)
    return out


def check_both_backends(x, cc, sc, pos, interleaved, conjugate):
    """The CPU op and the emulated CUDA thread (with either row index) equal the float64 reference
    and rotary() on the gathered tables (bit for bit: same roundings); returns the CPU result."""
    out = ops.rotary_pos(x, cc, sc, pos, interleaved, conjugate)
    cos, sin = full_tables(cc, sc, pos, interleaved)
    assert_matches_reference(out, x, cos, sin, interleaved, conjugate)
    assert torch.equal(out, rope_ext.rotary(x, cos, sin, interleaved=interleaved, conjugate=conjugate))
    emulated = emulate_both_indexes(TESTING.cuda_emulate_rotary_pos, x, cc, sc, pos, interleaved, conjugate)
    assert torch.equal(emulated, out)
    return out


@pytest.mark.parametrize("dims", DIMS.values(), ids=DIMS.keys())
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "hf_view", "qkv_slice", "padded", "strided_cols", "thd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_matches_reference_every_layout_dtype_and_width(interleaved, dtype, layout, dims, gen):
    d, r = dims
    x, _ = make_layout(layout, 2, 5, 3, d, dtype, gen)
    pos = positions_for(layout, torch.randint(0, MAX_POS, (2, 5), generator=gen))
    for cache_dtype in {dtype, torch.float32}:
        cc, sc = caches(r, cache_dtype)
        for conjugate in (False, True):
            check_both_backends(x, cc, sc, pos, interleaved, conjugate)
        check_both_backends(x, cc, sc, pos.int(), interleaved, False)


POSITION_FORMS = {
    # name: (x shape, positions)
    "seq_only_bhsd": ((2, 3, 5, 16), torch.tensor([4, 0, 9, 9, 1])),
    "per_row_bshd": ((2, 5, 3, 16), torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])[:, :, None]),
    "scalar": ((2, 5, 3, 16), torch.tensor(17)),
    "packed": ((7, 3, 16), torch.tensor([0, 1, 2, 0, 1, 0, 5])[:, None]),
    "per_head": ((2, 5, 3, 16), torch.arange(15).view(5, 3)),  # a position per (token, head)
    "expanded": ((2, 5, 3, 16), torch.tensor([3]).expand(5)[:, None]),
}


@pytest.mark.parametrize("form", POSITION_FORMS.values(), ids=POSITION_FORMS.keys())
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_position_forms(interleaved, form, gen):
    shape, pos = form
    x = randn(*shape, gen=gen)
    cc, sc = caches(12)
    check_both_backends(x, cc, sc, pos, interleaved, False)


def test_int_offset_along_seq_dim(gen):
    x = randn(2, 3, 6, 16, gen=gen)  # (B, H, S, D)
    cc, sc = caches(16)
    expected = ops.rotary_pos(x, cc, sc, torch.arange(4, 10), False, False)
    assert torch.equal(rope_ext.rotary_pos(x, cc, sc, 4, seq_dim=-2), expected)
    xs = x.transpose(1, 2)  # (B, S, H, D)
    assert torch.equal(rope_ext.rotary_pos(xs, cc, sc, 4, seq_dim=1), expected.transpose(1, 2))
    with pytest.raises(TypeError, match="an int offset as positions needs seq_dim"):
        rope_ext.rotary_pos(x, cc, sc, 4)
    with pytest.raises(ValueError, match="seq_dim must index one of x's leading dims"):
        rope_ext.rotary_pos(x, cc, sc, 4, seq_dim=-1)


def test_general_cache_strides_and_vllm_cat_cache(gen):
    """Caches as views: the halves of vLLM's cat(cos, sin) (row stride r), a transposed buffer
    (column stride != 1) and a misaligned one. The CUDA thread loads a whole item of the cache at a
    time only where columns are contiguous and aligned (table_vec)."""
    x = randn(3, 4, 2, 64, dtype=torch.bfloat16, gen=gen)
    pos = torch.randint(0, MAX_POS, (3, 4, 1), generator=gen)
    cc, sc = caches(64)
    cat = torch.cat((cc, sc), -1)
    views = {
        "cat_halves": (cat[:, :32], cat[:, 32:], True),
        "transposed": (cc.t().contiguous().t(), sc.t().contiguous().t(), False),
        "misaligned": (torch.cat((torch.zeros(1), cc.flatten()))[1:].view_as(cc), sc, False),
    }
    expected = check_both_backends(x, cc, sc, pos, False, False)
    for name, (c, s, table_vec) in views.items():
        assert torch.equal(check_both_backends(x, c, s, pos, False, False), expected), name
        cfg = TESTING.cuda_pos_launch_config(x, None, c, s, pos, False)
        # bfloat16 x with float32 caches: vectors of 4 elements, so that an item's 4 cache values are 16 bytes
        assert cfg[4] == 4 and cfg[8] == int(table_vec), (name, cfg)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_qk_one_call_gqa_mqa_and_layouts(interleaved, dtype, gen):
    cc, sc = caches(48)
    cases = {
        "gqa_hf_view": (
            make_layout("hf_view", 2, 6, 8, 64, dtype, gen)[0],
            make_layout("hf_view", 2, 6, 2, 64, dtype, gen)[0],
            torch.randint(0, MAX_POS, (2, 1, 6), generator=gen),
        ),
        "mqa_bshd": (
            make_layout("bshd", 2, 6, 4, 64, dtype, gen)[0],
            make_layout("bshd", 2, 6, 1, 64, dtype, gen)[0],
            torch.randint(0, MAX_POS, (2, 6, 1), generator=gen),
        ),
        "scalar_path_k": (
            make_layout("bshd", 2, 6, 4, 64, dtype, gen)[0],
            make_layout("strided_cols", 2, 6, 4, 64, dtype, gen)[0],
            torch.randint(0, MAX_POS, (6, 1), generator=gen),
        ),
    }
    for name, (q, k, pos) in cases.items():
        q_out, k_out = rope_ext.rotary_pos_qk(q, k, cc, sc, pos, interleaved=interleaved)
        assert torch.equal(q_out, ops.rotary_pos(q, cc, sc, pos, interleaved, False)), name
        assert torch.equal(k_out, ops.rotary_pos(k, cc, sc, pos, interleaved, False)), name
        eq, ek = emulate_both_indexes(TESTING.cuda_emulate_rotary_pos_qk, q, k, cc, sc, pos, interleaved, False)
        assert torch.equal(eq, q_out) and torch.equal(ek, k_out), name
        cfg = TESTING.cuda_pos_launch_config(q, k, cc, sc, pos, interleaved)
        expect_vec = name != "scalar_path_k"
        assert (cfg[4] > 1) == expect_vec, (name, cfg)  # one launch: the vector path needs both


def index_cases(gen):
    """name: (q, k or None, positions, (cos_cache, sin_cache), CompactIndex expected, tokens, heads).
    Tokens and heads are the launch's, once CompactIndex has folded outer broadcast dims into tokens."""
    cc, sc = caches(16)
    cat = torch.cat((cc, sc), -1)
    bshd = randn(2, 5, 3, 16, gen=gen)

    def pos(*shape):
        return torch.randint(0, MAX_POS, shape, generator=gen)

    return {
        # (B, S, H, D) under (S,) positions: the batch becomes a token dim, H the head dim
        "bshd_seq_positions": (bshd, None, pos(5, 1), (cc, sc), True, 10, 3),
        "gqa_bshd_seq_positions": (bshd, randn(2, 5, 1, 16, gen=gen), pos(5, 1), (cc, sc), True, 10, 4),
        # (B, H, S, D) under (B, 1, S): two token dims that do not collapse, heads between them
        "bhsd_per_row": (randn(2, 3, 5, 16, gen=gen), None, pos(2, 1, 5), (cc, sc), True, 10, 3),
        "packed": (randn(7, 3, 16, gen=gen), None, pos(7, 1), (cc, sc), True, 7, 3),
        # a position per (S, H): tokens S and H collapse, the batch is the head dim
        "per_head": (bshd, None, pos(5, 3), (cc, sc), True, 15, 2),
        "no_head_dim": (randn(2, 5, 16, gen=gen), None, pos(2, 5), (cc, sc), True, 10, 1),
        # q with one head where k has three: that dim is k's head dim, not a token dim
        "one_q_head_bshd": (randn(2, 5, 1, 16, gen=gen), randn(2, 5, 3, 16, gen=gen), pos(5, 1), (cc, sc), True, 10, 4),
        "one_q_head_bhsd": (randn(2, 1, 5, 16, gen=gen), randn(2, 3, 5, 16, gen=gen), pos(2, 1, 5), (cc, sc), True, 10,
                            4),
        # q's tokens collapse and k's do not: the index collapses what every operand allows
        "k_tokens_apart": (bshd, randn(5, 2, 1, 16, gen=gen).transpose(0, 1), pos(2, 5, 1), (cc, sc), True, 10, 4),
        # PlanIndex: three token dims that do not collapse, strided columns, two cache row strides
        "three_token_dims": (randn(2, 3, 5, 16, gen=gen).transpose(1, 2), None, pos(2, 5, 3), (cc, sc), False, 30, 1),
        "strided_columns": (randn(2, 5, 3, 32, gen=gen)[..., ::2], None, pos(5, 1), (cc, sc), False, 5, 6),
        "cache_row_strides_differ": (bshd, None, pos(5, 1), (cc, cat[:, 8:]), False, 5, 6),
    }


def launch_config(*args):
    return dict(zip(LAUNCH_FIELDS, TESTING.cuda_pos_launch_config(*args), strict=True))


@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_cuda_index_choice_and_both_indexes(interleaved, gen):
    """The launcher addresses rows with CompactIndex (kernel parameters under 256 bytes) wherever the
    layout collapses to two token dims and one head dim, and with PlanIndex otherwise; both agree with
    the CPU op, and the launch covers the tokens and heads each index counts."""
    for name, (q, k, pos, (cc, sc), compact, tokens, heads) in index_cases(gen).items():
        cfg = launch_config(q, k, cc, sc, pos, interleaved)
        assert cfg["compact"] == compact, (name, cfg)
        assert cfg["grid_x"] == tokens, (name, cfg)
        assert cfg["block_y"] * (cfg["grid_y"] - 1) < heads <= cfg["block_y"] * cfg["grid_y"], (name, cfg)
        with plan_index_only():
            assert not launch_config(q, k, cc, sc, pos, interleaved)["compact"], name
        if k is None:
            got = (emulate_both_indexes(TESTING.cuda_emulate_rotary_pos, q, cc, sc, pos, interleaved, False),)
            expected = (ops.rotary_pos(q, cc, sc, pos, interleaved, False),)
        else:
            got = emulate_both_indexes(TESTING.cuda_emulate_rotary_pos_qk, q, k, cc, sc, pos, interleaved, False)
            expected = ops.rotary_pos_qk(q, k, cc, sc, pos, interleaved, False)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), name


@pytest.mark.parametrize("emulated", ["cpu", "cuda_emulated", "cuda_emulated_plan_index"])
def test_inplace_q_and_k_touch_nothing_else(emulated, gen):
    inplace = ops.rotary_pos_ if emulated == "cpu" else TESTING.cuda_emulate_rotary_pos_
    index = plan_index_only() if emulated == "cuda_emulated_plan_index" else contextlib.nullcontext()
    with index:
        _check_inplace_q_and_k(inplace, gen)


def _check_inplace_q_and_k(inplace, gen):
    cc, sc = caches(40)
    for layout in ("qkv_slice", "padded", "strided_cols", "bshd"):
        q, _ = make_layout(layout, 2, 6, 3, 64, torch.float16, gen)
        k, _ = make_layout(layout, 2, 6, 3, 64, torch.float16, gen)
        pos = torch.randint(0, MAX_POS, (2, 6, 1), generator=gen)
        expected = ops.rotary_pos_qk(q, k, cc, sc, pos, False, False)
        bases = [t._base if t._base is not None else t for t in (q, k)]
        before = [b.clone() for b in bases]
        inplace(q, k, cc, sc, pos, False, False)
        assert torch.equal(q, expected[0]) and torch.equal(k, expected[1]), layout
        for t, base, old in zip((q, k), bases, before, strict=True):
            outside = torch.ones_like(base, dtype=torch.bool)
            outside.as_strided(t.shape, t.stride(), t.storage_offset() - base.storage_offset()).fill_(False)
            assert torch.equal(base[outside].nan_to_num(7.0), old[outside].nan_to_num(7.0)), layout
    q = randn(2, 6, 3, 64, gen=gen)
    expected = ops.rotary_pos(q, cc, sc, torch.arange(6)[:, None], False, True)
    inplace(q, None, cc, sc, torch.arange(6)[:, None], False, True)
    assert torch.equal(q, expected)


def test_inplace_refuses_grad_overlap_and_bumps_versions(gen):
    cc, sc = caches(16)
    pos = torch.arange(4)[:, None]
    q, k = randn(4, 2, 16, gen=gen), randn(4, 2, 16, gen=gen)
    v_q, v_k = q._version, k._version
    assert rope_ext.rotary_pos_(q, k, cc, sc, pos) == (q, k)
    assert q._version > v_q and k._version > v_k
    with pytest.raises(RuntimeError, match=r"rope_ext.rotary_pos_: k requires grad, .*Use rope_ext.rotary_pos"):
        rope_ext.rotary_pos_(q, k.clone().requires_grad_(), cc, sc, pos)
    with pytest.raises(RuntimeError, match="rope_ext.rotary_pos_: q shares memory with k"):
        rope_ext.rotary_pos_(q, q[:, :1], cc, sc, pos)
    with pytest.raises(RuntimeError, match="rope_ext.rotary_pos_: q has elements that share memory"):
        rope_ext.rotary_pos_(q[:, :1].expand(4, 2, 16), None, cc, sc, pos)
    with torch.no_grad():
        rope_ext.rotary_pos_(q.clone().requires_grad_(), None, cc, sc, pos)
    # one buffer under two storages (two from_numpy of one array): the same memory, refused
    array = randn(8, 2, 16, gen=gen).numpy()
    q2, k2 = torch.from_numpy(array)[:4], torch.from_numpy(array)[2:6]
    assert q2.untyped_storage().data_ptr() == k2.untyped_storage().data_ptr()
    assert not q2.untyped_storage()._cdata == k2.untyped_storage()._cdata  # (two storages)
    with pytest.raises(RuntimeError, match="rope_ext.rotary_pos_: q shares memory with k"):
        rope_ext.rotary_pos_(q2, k2, cc, sc, pos)
    rope_ext.rotary_pos_(q2, torch.from_numpy(array)[4:], cc, sc, pos)  # the same array, apart
    # rows of one buffer split between q and k, through two storages: the rows' places are read
    # from their addresses (storage offsets differ between the storages)
    rows = randn(4, 32, gen=gen).numpy()
    whole, half = torch.from_numpy(rows), torch.from_numpy(rows[:, 16:])
    first, second = whole[:, :16].unflatten(-1, (1, 16)), half.unflatten(-1, (1, 16))
    with pytest.raises(RuntimeError, match="rope_ext.rotary_pos_: q shares memory with k"):
        rope_ext.rotary_pos_(whole[:, 16:].unflatten(-1, (1, 16)), second, cc, sc, pos)
    rope_ext.rotary_pos_(first, second, cc, sc, pos)  # the two halves of each row: apart


@pytest.mark.parametrize("bad", [MAX_POS, -1, 2**40], ids=["one_past", "negative", "huge"])
def test_positions_outside_the_cache_raise_and_never_read(bad, gen):
    cc, sc = caches(16)
    x = randn(2, 4, 2, 16, gen=gen)
    pos = torch.tensor([[0, 1, 2, 3], [4, bad, 6, 7]])[:, :, None]
    msg = rf"rope_ext.rotary_pos: position {bad} \(positions.flatten\(\)\[5\]\) is outside the cache, "
    msg += rf"whose {MAX_POS} rows hold positions 0 to {MAX_POS - 1}"
    with pytest.raises(RuntimeError, match=msg):
        ops.rotary_pos(x, cc, sc, pos, False, False)
    # in place: refused before anything is written
    before = x.clone()
    with pytest.raises(RuntimeError, match="is outside the cache"):
        rope_ext.rotary_pos_(x, x.clone(), cc, sc, pos)
    assert torch.equal(x, before)
    # the CUDA thread's own check (a device-side assert on a GPU) fires in the emulation
    with pytest.raises(RuntimeError, match=rf"^rope_ext.PositionOutsideCache: position {bad} is outside the cache"):
        TESTING.cuda_emulate_rotary_pos(x, cc, sc, pos, False, False)
    if bad >= 0 and bad < 2**31:
        with pytest.raises(RuntimeError, match="is outside the cache"):
            ops.rotary_pos(x, cc, sc, pos.int(), False, False)


def _strided_positions(form: str, bad: int | None = None) -> torch.Tensor:
    """(2, 4) positions in a strided form, with `bad` planted in one place if given."""
    if form == "transposed":
        base = torch.arange(8).reshape(4, 2)
        if bad is not None:
            base[3, 0] = bad
        return base.t()
    if form == "expanded":
        row = torch.arange(4)
        if bad is not None:
            row[2] = bad
        return row[None].expand(2, 4)
    wide = torch.arange(16).reshape(2, 8)
    if bad is not None:
        wide[1, 4] = bad
    return wide[:, ::2]


@pytest.mark.parametrize("form", ["transposed", "expanded", "sliced"])
def test_positions_are_checked_in_place_through_their_strides(form, gen):
    """The CPU reads positions through their strides, without a copy, in positions.flatten()'s order:
    a strided tensor of valid positions gives the result of its contiguous copy, and the first bad
    position is named by its index in the flattened tensor."""
    cc, sc = caches(16)
    x = randn(2, 4, 2, 16, gen=gen)
    pos = _strided_positions(form)
    assert not pos.is_contiguous()
    assert torch.equal(ops.rotary_pos(x, cc, sc, pos[..., None], False, False),
                       ops.rotary_pos(x, cc, sc, pos.contiguous()[..., None], False, False))
    bad = _strided_positions(form, MAX_POS)
    first = int((bad.flatten() >= MAX_POS).nonzero()[0])
    assert first == {"transposed": 3, "expanded": 2, "sliced": 6}[form]
    msg = rf"position {MAX_POS} \(positions.flatten\(\)\[{first}\]\) is outside the cache"
    with pytest.raises(RuntimeError, match=msg):
        ops.rotary_pos(x, cc, sc, bad[..., None], False, False)


def test_cpu_paths_walks_and_streaming(gen):
    """Both walks (token-major, head-major with head and token splits), the parallel grain and
    streaming stores, reached on small tensors by lowering the thresholds."""
    cc, sc = caches(64, torch.bfloat16)
    x_bhsd = randn(2, 8, 40, 64, dtype=torch.bfloat16, gen=gen)  # head-major storage
    pos = torch.randint(0, MAX_POS, (2, 1, 40), generator=gen)
    cos, sin = full_tables(cc, sc, pos, False)
    expected = rope_ext.rotary(x_bhsd, cos, sin)
    settings = [
        dict(),
        dict(tile_tokens=3, min_heads_per_thread=1, grain_elements=64),
        dict(tile_tokens=7, min_heads_per_thread=100, grain_elements=64),
        dict(streaming_bytes=0),
    ]
    # The head split's gate is heads / threads >= min_heads_per_thread: on two threads, 8 heads reach
    # both sides of it, whatever the machine's core count (16 cores give a token split at 1).
    threads = torch.get_num_threads()
    for th in settings:
        torch.set_num_threads(2)
        try:
            with cpu_thresholds(**th):
                before = path_counts()
                out = ops.rotary_pos(x_bhsd, cc, sc, pos, False, False)
                counts = path_counts_since(before)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(out, expected), th
        if "min_heads_per_thread" in th:
            split = "head_split_walks" if th["min_heads_per_thread"] == 1 else "token_split_walks"
            assert counts[split] == 1, (th, counts)
        if th.get("streaming_bytes") == 0 and ops.cpu_kernel_isa() != "DEFAULT":
            assert counts["streamed_rows"] > 0, counts


def test_empty_inputs():
    cc, sc = caches(8, max_pos=0)
    x = torch.randn(0, 4, 8)
    assert ops.rotary_pos(x, cc, sc, torch.zeros(0, 1, dtype=torch.long), False, False).shape == x.shape
    q, k = ops.rotary_pos_qk(x, x[:, :1], cc, sc, torch.zeros(0, 1, dtype=torch.long), False, False)
    assert q.shape == (0, 4, 8) and k.shape == (0, 1, 8)


BAD = {
    "positions_float": (
        lambda x, c, s, p: (x, c, s, p.float()),
        r"positions must be int32 or int64, got (Float|torch.float32)",
    ),
    "positions_shape": (lambda x, c, s, p: (x, c, s, p.view(4, 2)), r"positions of shape \[4, 2\] do not broadcast"),
    "cache_1d": (lambda x, c, s, p: (x, c[0], s[0], p), r"cos_cache must be 2-D"),
    "cache_shapes": (lambda x, c, s, p: (x, c, s[:, :4], p), r"cos_cache and sin_cache must have the same shape"),
    "cache_dtypes": (lambda x, c, s, p: (x, c, s.double(), p), "cos_cache and sin_cache must have the same dtype"),
    "cache_dtype": (
        lambda x, c, s, p: (x, c.double(), s.double(), p),
        r"cos_cache and sin_cache must have x's dtype \((Float|torch.float32)\) or float32",
    ),
    "too_wide": (
        lambda x, c, s, p: (x[..., :8], c, s, p),
        r"the rotary dim 2 \* cos_cache.size\(1\) = 16 exceeds the head dim x.size\(-1\) = 8",
    ),
    "x_int": (lambda x, c, s, p: (x.int(), c, s, p), "x must be float32, float64, float16 or bfloat16, got"),
    "zero_width": (
        lambda x, c, s, p: (x, c[:, :0], s[:, :0], p),
        r"cos_cache.size\(1\) = rotary_dim / 2 must be positive",
    ),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_arguments_name_what_was_wrong(case, device):
    """The C++ checks and the fake kernel's (torch.compile, meta) say the same thing."""
    make, msg = case
    cc, sc = caches(16)
    args = make(torch.randn(2, 4, 3, 16), cc, sc, torch.arange(8).view(2, 4, 1))
    args = [a.to(device) for a in args]
    with pytest.raises(RuntimeError, match=f"rope_ext.rotary_pos: {msg}"):
        ops.rotary_pos(*args, False, False)


def test_qk_shape_mismatch():
    cc, sc = caches(16)
    with pytest.raises(RuntimeError, match="may differ only in the head count"):
        ops.rotary_pos_qk(
            torch.randn(2, 4, 3, 16), torch.randn(1, 4, 1, 16), cc, sc, torch.arange(4)[:, None], False, False
        )
    with pytest.raises(RuntimeError, match="positions of shape .* do not broadcast against k.shape"):
        ops.rotary_pos_qk(
            torch.randn(2, 4, 3, 16), torch.randn(2, 5, 3, 16), cc, sc, torch.arange(4)[:, None], False, False
        )
    with pytest.raises(RuntimeError, match="q and k must have the same dtype"):
        ops.rotary_pos_qk(
            torch.randn(4, 3, 16), torch.randn(4, 3, 16).double(), cc, sc, torch.arange(4)[:, None], False, False
        )


# --- autograd -------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
@pytest.mark.parametrize("conjugate", [False, True], ids=["fwd", "conj"])
def test_gradcheck_and_gradgradcheck_with_cache_grads(interleaved, conjugate, gen):
    """Repeated positions make the cache gradient a real scatter-add; partial rotary."""
    x = randn(2, 4, 3, 10, dtype=torch.float64, gen=gen).requires_grad_()
    k = randn(2, 4, 1, 10, dtype=torch.float64, gen=gen).requires_grad_()
    cc, sc = (t.requires_grad_() for t in random_tables((6, 4), torch.float64, gen))
    pos = torch.tensor([[0, 3, 3, 5], [1, 0, 3, 2]])[:, :, None]

    def single(x, cc, sc):
        return ops.rotary_pos(x, cc, sc, pos, interleaved, conjugate)

    def qk(x, k, cc, sc):
        return ops.rotary_pos_qk(x, k, cc, sc, pos, interleaved, conjugate)

    assert torch.autograd.gradcheck(single, (x, cc, sc))
    assert torch.autograd.gradgradcheck(single, (x, cc, sc))
    assert torch.autograd.gradcheck(qk, (x, k, cc, sc))
    assert torch.autograd.gradgradcheck(qk, (x, k, cc, sc))


def test_grads_equal_autograd_through_the_pure_pytorch_form(gen):
    """Gradients of q, k and the (learned) caches equal autograd through gather + rotate_half."""
    q = randn(2, 5, 4, 16, gen=gen).requires_grad_()
    k = randn(2, 5, 2, 16, gen=gen).requires_grad_()
    cc, sc = (t.requires_grad_() for t in caches(12))
    pos = torch.randint(0, 8, (2, 5, 1), generator=gen)

    def ref(t):
        c, s = full_tables(cc, sc, pos, False)
        return rope_ext.reference.rotary_reference(t, c, s, False)

    g2 = torch.Generator().manual_seed(7)
    wq, wk = randn(*q.shape, gen=g2), randn(*k.shape, gen=g2)
    out = ops.rotary_pos_qk(q, k, cc, sc, pos, False, False)
    got = torch.autograd.grad((out[0] * wq).sum() + (out[1] * wk).sum(), (q, k, cc, sc))
    want = torch.autograd.grad((ref(q) * wq).sum() + (ref(k) * wk).sum(), (q, k, cc, sc))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_backward_saves_no_activation_for_constant_caches(gen):
    """Only the caches and positions are kept for backward unless the caches need gradients."""
    x = randn(3, 2, 8, gen=gen).requires_grad_()
    cc, sc = caches(8)
    pos = torch.arange(3)[:, None]
    for call in (
        lambda: ops.rotary_pos(x, cc, sc, pos, False, False),
        lambda: ops.rotary_pos_qk(x, x[:, :1], cc, sc, pos, False, False),
    ):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            call()
        assert {t.data_ptr() for t in saved if t.numel()} == {cc.data_ptr(), sc.data_ptr(), pos.data_ptr()}


# --- registration quality: opcheck, compile, export ----------------------------------------


def _opcheck_samples():
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for interleaved in (False, True):
            cc, sc = caches(8, dtype)
            x = randn(2, 5, 3, 16, dtype=dtype, gen=gen).transpose(1, 2)  # HF view, partial rotary
            pos = torch.randint(0, MAX_POS, (2, 1, 5), generator=gen)
            yield ops.rotary_pos.default, (x, cc, sc, pos, interleaved, False)
            k = randn(2, 5, 1, 16, dtype=dtype, gen=gen).transpose(1, 2)
            yield ops.rotary_pos_qk.default, (x, k, cc, sc, pos.int(), interleaved, True)
            yield ops.rotary_pos_.default, (x.clone(), k.clone(), cc, sc, pos, interleaved, False)
    cc, sc = (t.requires_grad_() for t in caches(8))
    x = randn(4, 2, 8, gen=gen).requires_grad_()
    yield ops.rotary_pos.default, (x, cc, sc, torch.tensor([0, 2, 2, 1])[:, None], False, False)
    yield (
        ops.rotary_pos_qk.default,
        (x, x.detach()[:, :1].clone().requires_grad_(), cc, sc, torch.tensor([0, 2, 2, 1])[:, None], True, False),
    )


@pytest.mark.parametrize(
    "op,args", list(_opcheck_samples()), ids=lambda a: a._opname if hasattr(a, "_opname") else None
)
def test_opcheck(op, args):
    torch.library.opcheck(op, args)


def _block(q, k, cc, sc, pos):
    q, k = rope_ext.rotary_pos_qk(q, k, cc, sc, pos)
    return (q @ k.transpose(-1, -2)).softmax(-1)


def test_compile_dynamic_fullgraph_no_recompile_per_length(gen):
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_block, fullgraph=True, dynamic=True, backend=counter)
    cc, sc = caches(16)
    for s in (5, 8, 13, 21):
        q = randn(1, 2, s, 16, gen=gen).requires_grad_()
        k = randn(1, 1, s, 16, gen=gen)
        pos = torch.arange(3, 3 + s)
        out = compiled(q, k, cc, sc, pos)
        torch.testing.assert_close(out, _block(q, k, cc, sc, pos))
        (g,) = torch.autograd.grad(out.sum(), q)
        (g_ref,) = torch.autograd.grad(_block(q, k, cc, sc, pos).sum(), q)
        torch.testing.assert_close(g, g_ref)
    assert counter.frame_count == 1


def test_export_holds_the_op(gen):
    class Rope(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cc, sc = caches(16)
            self.register_buffer("cc", cc)
            self.register_buffer("sc", sc)

        def forward(self, q, k, pos):
            return rope_ext.rotary_pos_qk(q, k, self.cc, self.sc, pos, interleaved=True)

    q, k, pos = randn(2, 6, 4, 16, gen=gen), randn(2, 6, 2, 16, gen=gen), torch.arange(12).view(2, 6, 1)
    seq = torch.export.Dim("seq", min=2, max=MAX_POS // 2)
    ep = torch.export.export(Rope(), (q, k, pos), dynamic_shapes=({1: seq}, {1: seq}, {1: seq}))
    assert ops.rotary_pos_qk.default in {n.target for n in ep.graph.nodes if n.op == "call_function"}
    for a, b in zip(ep.module()(q, k, pos), Rope()(q, k, pos), strict=True):
        assert torch.equal(a, b)


def test_q_and_k_need_the_same_head_dim():
    """One launch sizes its work by the head dim: q and k must share it (the CPU and the emulated
    CUDA thread refuse alike, and so does the fake kernel)."""
    cc, sc = caches(16)
    pos = torch.arange(3)[:, None]
    for device in ("cpu", "meta"):
        q, k = torch.randn(3, 2, 64, device=device), torch.randn(3, 1, 128, device=device)
        with pytest.raises(RuntimeError, match=r"rope_ext.rotary_pos_qk: q and k must have the same head dim"):
            ops.rotary_pos_qk(q, k, cc.to(device), sc.to(device), pos.to(device), False, False)
    with pytest.raises(RuntimeError, match=r"q and k must have the same head dim"):
        TESTING.cuda_emulate_rotary_pos_qk(torch.randn(3, 2, 128), torch.randn(3, 1, 64), cc, sc, pos, False, False)
    with pytest.raises(RuntimeError, match=r"rope_ext.rotary_pos_: q and k must have the same head dim"):
        ops.rotary_pos_(torch.randn(3, 2, 64), torch.randn(3, 1, 128), cc, sc, pos, False, False)


def test_inplace_q_and_k_split_from_one_fused_buffer(gen):
    """vLLM's q and k are column slices of one (tokens, (Hq + 2 Hk) * D) qkv buffer: their byte ranges
    interleave but no element is shared, so in place is allowed; views that do share are refused."""
    cc, sc = caches(32)
    qkv = randn(5, (4 + 2 * 2) * 32, gen=gen)
    q, k, v = (t.unflatten(-1, (-1, 32)) for t in qkv.split([4 * 32, 2 * 32, 2 * 32], -1))
    pos = torch.randint(0, MAX_POS, (5, 1), generator=gen)
    want = ops.rotary_pos_qk(q, k, cc, sc, pos, False, False)
    v_before = v.clone()
    for inplace in (ops.rotary_pos_, TESTING.cuda_emulate_rotary_pos_):
        qq, kk = qkv.clone().split([4 * 32, 2 * 32, 2 * 32], -1)[:2]
        qq, kk = qq.unflatten(-1, (-1, 32)), kk.unflatten(-1, (-1, 32))
        inplace(qq, kk, cc, sc, pos, False, False)
        assert torch.equal(qq, want[0]) and torch.equal(kk, want[1])
    assert torch.equal(v, v_before)
    overlapping = qkv.unflatten(-1, (-1, 32))[:, 1:3]  # heads 1-2: inside q's heads 0-3
    with pytest.raises(RuntimeError, match="q shares memory with k"):
        ops.rotary_pos_(q, overlapping, cc, sc, pos, False, False)


def _random_view(shape, head_dim, pad, gen):
    """A tensor of `shape` + (head_dim,) whose leading dims are stored in a random order, with rows
    padded by `pad` elements (so that neither dims nor rows need be contiguous)."""
    order = torch.randperm(len(shape), generator=gen).tolist()
    base = torch.randn(*[shape[i] for i in order], head_dim + pad, generator=gen)[..., :head_dim]
    return base.permute(*[order.index(i) for i in range(len(shape))], len(shape))


@pytest.mark.parametrize("seed", range(24))
def test_random_layouts_agree_on_cpu_and_both_cuda_indexes(seed):
    """q and k of random sizes (1 included), storage orders and row padding, with a head count that
    may differ in a random dim and positions that broadcast along random dims: the CPU op, and the
    emulated CUDA thread with CompactIndex (where the layout allows) and with PlanIndex, agree bit for
    bit."""
    gen = torch.Generator().manual_seed(seed)

    def draw(n):
        return int(torch.randint(0, n, (1,), generator=gen))

    lead = [draw(3) + 1 for _ in range(3)]
    k_lead = list(lead)
    heads_dim = draw(3)
    k_lead[heads_dim] = draw(3) + 1
    d = (8, 12, 16)[draw(3)]
    q = _random_view(lead, d, draw(2) * 4, gen)
    k = _random_view(k_lead, d, draw(2) * 4, gen)
    pos_shape = [n if draw(2) else 1 for n in lead]
    pos_shape[heads_dim] = 1  # positions broadcast along the dim where q and k differ
    pos = torch.randint(0, MAX_POS, pos_shape[draw(2):], generator=gen)  # sometimes of lower rank
    cc, sc = caches(2 * (draw(d // 2) + 1))
    for interleaved in (False, True):
        expected = ops.rotary_pos_qk(q, k, cc, sc, pos, interleaved, False)
        got = emulate_both_indexes(TESTING.cuda_emulate_rotary_pos_qk, q, k, cc, sc, pos, interleaved, False)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), (lead, k_lead, pos_shape)
