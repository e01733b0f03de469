"""The CUDA kernels' thread function, run on the CPU over every block and thread of the launch the
CUDA launcher would choose (csrc/testing/host_emulation.cpp). This tests the GPU code path's index
math, bounds, vector/scalar choice and tails on a machine without a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    CONVENTIONS,
    DTYPES,
    LAUNCH_FIELDS,
    LAYOUTS,
    TESTING,
    assert_matches_reference,
    hook_setting,
    make_layout,
    random_tables,
    rope_tables,
)

import rope_ext

ops = torch.ops.rope_ext


def launch(x, cos, sin, interleaved):
    return dict(zip(LAUNCH_FIELDS, TESTING.cuda_launch_config(x, cos, sin, interleaved), strict=True))


# (head_dim, rotary_dim): which path each takes depends on the dtype's 16-byte vector width
# (4 float32, 8 float16/bfloat16, 2 float64): 128/128 and 128/64 split into whole vectors for every
# dtype; 72/40 does not for 16-bit half-split (20 pairs), 36/36 has 18-pair halves, 10/6 is tiny.
DIMS = {"128_full": (128, 128), "128_half": (128, 64), "72_40": (72, 40), "36_full": (36, 36), "10_6": (10, 6)}


def _expect_vector(layout, dtype, table_dtype, interleaved, d, r):
    # 16 bytes of the wider of x and the tables (a table vector is never wider than 16 bytes)
    e = 16 // max(torch.empty((), dtype=t).element_size() for t in (dtype, table_dtype))
    contiguous_rows = layout not in ("strided_cols",)
    aligned = layout not in ("strided_cols",) and (layout != "padded" or (d + 8) % e == 0) and d % e == 0
    widths = (r % e == 0 if interleaved else (r // 2) % e == 0) and (d - r) % e == 0
    return contiguous_rows and aligned and widths


@pytest.mark.parametrize("dims", DIMS.values(), ids=DIMS.keys())
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_emulated_kernel_matches_cpu_and_reference(interleaved, dtype, layout, dims, gen):
    d, r = dims
    x, to_layout = make_layout(layout, 2, 5, 3, d, dtype, gen)
    for table_dtype in {dtype, torch.float32}:
        cos, sin = rope_tables(torch.randint(0, 10**5, (2, 5, 1), generator=gen), r, interleaved, table_dtype)
        if layout == "thd":
            cos, sin = cos.reshape(10, 1, r), sin.reshape(10, 1, r)
        else:
            cos, sin = to_layout(cos), to_layout(sin)
        for conjugate in (False, True):
            out = TESTING.cuda_emulate_rotary(x, cos, sin, interleaved, conjugate)
            assert_matches_reference(out, x, cos, sin, interleaved, conjugate)
            # same roundings as the CPU kernel (no FMA contraction on either): bit-identical
            assert torch.equal(out, rope_ext.rotary(x, cos, sin, interleaved=interleaved, conjugate=conjugate))
        cfg = launch(x, cos, sin, interleaved)
        expect_vec = _expect_vector(layout, dtype, table_dtype, interleaved, d, r)
        assert (cfg["vec"] > 1) == expect_vec, cfg
        # fresh tables: their items are aligned wherever x's are; every layout but strided columns is compact
        assert cfg["table_vec"] == expect_vec and cfg["compact"] == (layout != "strided_cols"), cfg
        assert cfg["block_x"] * cfg["block_y"] <= 256 and cfg["grid_y"] <= 65535


@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_emulated_general_tables_and_broadcasts(dtype, interleaved, gen):
    """Arbitrary tables (c1 != c2), broadcast over batch and heads (stride 0), and a
    misaligned view (offset by one element) that must fall back to the scalar path."""
    x = make_layout("bshd", 3, 4, 5, 64, dtype, gen)[0]
    cos, sin = random_tables((4, 1, 48), torch.float32, gen)
    out = TESTING.cuda_emulate_rotary(x, cos, sin, interleaved, False)
    assert torch.equal(out, rope_ext.rotary(x, cos, sin, interleaved=interleaved))
    buf = torch.zeros(3 * 4 * 5 * 64 + 1, dtype=dtype)
    shifted = buf[1:].view(3, 4, 5, 64)
    shifted.copy_(x)
    assert launch(shifted, cos, sin, interleaved)["vec"] == 1
    assert torch.equal(TESTING.cuda_emulate_rotary(shifted, cos, sin, interleaved, False), out)


def test_emulated_decode_and_many_heads_split_across_blocks(gen):
    """A decode step (one token per row): heads are spread over grid_y blocks."""
    x = make_layout("bhsd", 1, 1, 64, 128, torch.bfloat16, gen)[0]
    cos, sin = rope_tables(torch.tensor([[[1234]]]), 128, False)  # (1, 1, 1, 128)
    cfg = launch(x, cos, sin, False)
    assert cfg["grid_x"] == 1 and cfg["grid_y"] > 1
    assert torch.equal(TESTING.cuda_emulate_rotary(x, cos, sin, False, False), rope_ext.rotary(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_emulated_qk_and_inplace(interleaved, dtype, gen):
    q = make_layout("hf_view", 2, 6, 8, 64, dtype, gen)[0]
    k = make_layout("hf_view", 2, 6, 2, 64, dtype, gen)[0]
    cos, sin = rope_tables(torch.arange(6), 48, interleaved)
    cos_k, sin_k = random_tables((6, 48), dtype, gen)
    expected = rope_ext.rotary_qk(q, k, cos, sin, interleaved=interleaved, cos_k=cos_k, sin_k=sin_k)
    got = TESTING.cuda_emulate_rotary_qk(q, k, cos, sin, interleaved, cos_k, sin_k, False)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])

    for layout in ("qkv_slice", "strided_cols", "padded"):
        x, to_layout = make_layout(layout, 2, 6, 3, 64, dtype, gen)
        c, s = (to_layout(t) for t in rope_tables(torch.arange(6)[None, :, None], 48, interleaved))
        base = x._base if x._base is not None else x
        before = base.clone()
        expected = rope_ext.rotary(x, c, s, interleaved=interleaved)
        TESTING.cuda_emulate_rotary_(x, c, s, interleaved, False)
        assert torch.equal(x, expected)
        outside = torch.ones_like(base, dtype=torch.bool)
        outside.as_strided(x.shape, x.stride(), x.storage_offset() - base.storage_offset()).fill_(False)
        assert torch.equal(base[outside].nan_to_num(7.0), before[outside].nan_to_num(7.0)), layout


def test_emulated_empty_and_single_element_rows(gen):
    x = torch.randn(0, 4, 16)
    c = torch.ones(0, 1, 16)
    assert TESTING.cuda_emulate_rotary(x, c, c, False, False).shape == x.shape
    x = torch.randn(3, 1, 2)
    c, s = random_tables((3, 1, 2), torch.float32, gen)
    assert torch.equal(TESTING.cuda_emulate_rotary(x, c, s, True, False), rope_ext.rotary(x, c, s, interleaved=True))


def test_emulated_bad_input_uses_the_shared_checks():
    with pytest.raises(RuntimeError, match=r"rope_ext.rotary: the rotary dim cos.size\(-1\) must be a positive even"):
        TESTING.cuda_emulate_rotary(torch.zeros(2, 8), torch.ones(2, 3), torch.ones(2, 3), False, False)


# Full tables (rotary, rotary_qk: the HF drop-in) in the layouts users hand them, each as
# (x, cos, sin, CompactIndex expected, vector table loads expected). x is (2, 3, 4, 64) in some layout
# with r = 48: whole vectors for every dtype pairing here, so only the tables decide the gates.
def _full_table_cases(dtype, table_dtype, gen):
    B, S, H, D, r = 2, 3, 4, 64, 48

    def tables(*shape):
        return random_tables(shape, table_dtype, gen)  # c1 != c2 and s1 != s2: the general per-pair matrix

    def offset(t, by):  # t's values in a buffer that starts `by` elements earlier
        buf = torch.zeros(t.numel() + by, dtype=t.dtype)
        buf[by:] = t.flatten()
        return buf[by:].view(t.shape)

    bshd = make_layout("bshd", B, S, H, D, dtype, gen)[0]
    c, s = tables(B, S, 1, r)
    cases = {
        "hf_view_b1sr": (make_layout("hf_view", B, S, H, D, dtype, gen)[0], *(t.transpose(1, 2) for t in (c, s)),
                         True, True),
        "bshd_shared_over_batch": (bshd, *tables(S, 1, r), True, True),
        "thd": (make_layout("thd", B, S, H, D, dtype, gen)[0], *tables(B * S, 1, r), True, True),
        "qkv_slice": (make_layout("qkv_slice", B, S, H, D, dtype, gen)[0], c, s, True, True),
        # one element off: items no longer start on their width
        "misaligned_tables": (bshd, offset(c, 1), offset(s, 1), True, False),
        # rows of r + 1: every other token's items off their width
        "odd_row_stride": (bshd, *(torch.cat((t, t[..., :1]), -1)[..., :r] for t in (c, s)), True, False),
        # cos and sin laid out differently: one set of token strides cannot serve both (PlanIndex)
        "cos_sin_strides_differ": (bshd, c, s.transpose(0, 1).contiguous().transpose(0, 1), False, True),
        "strided_table_columns": (bshd, *(torch.stack((t, t), -1).flatten(-2)[..., ::2] for t in (c, s)), False,
                                  False),
    }
    return cases


FULL_TABLE_DTYPES = {"bf16": (torch.bfloat16, torch.bfloat16), "bf16_f32tables": (torch.bfloat16, torch.float32),
                     "f32": (torch.float32, torch.float32), "f64": (torch.float64, torch.float64)}


@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
@pytest.mark.parametrize("dtypes", FULL_TABLE_DTYPES.values(), ids=FULL_TABLE_DTYPES.keys())
def test_full_tables_compact_index_and_vector_table_loads(dtypes, interleaved, gen):
    """The full-table path's two gates, chosen at run time from the real pointers and strides: CompactIndex
    or PlanIndex (forced too, through the testing knob), vector or scalar table loads. Every side gives
    the CPU op's bits, forward and transpose (conjugate, a runtime flag: (s1, s2) -> (-s2, -s1))."""
    seen = set()
    for name, (x, cos, sin, compact, table_vec) in _full_table_cases(*dtypes, gen).items():
        expected = [rope_ext.rotary(x, cos, sin, interleaved=interleaved, conjugate=conj) for conj in (False, True)]
        assert_matches_reference(expected[1], x, cos, sin, interleaved, True)
        for allow in (True, False):
            before = TESTING.cuda_allow_compact_index(allow)
            try:
                cfg = launch(x, cos, sin, interleaved)
                gates = (cfg["compact"], cfg["table_vec"])
                assert cfg["vec"] > 1 and gates == (compact and allow, table_vec), (name, cfg)
                seen.add(gates)
                for conj, want in zip((False, True), expected, strict=True):
                    assert torch.equal(TESTING.cuda_emulate_rotary(x, cos, sin, interleaved, conj), want), (name, allow)
            finally:
                TESTING.cuda_allow_compact_index(before)
    assert seen == {(0, 0), (0, 1), (1, 0), (1, 1)}


def qk_launches(q, k, cos, sin, interleaved):
    """The launches rotary_qk(q, k, cos, sin) makes (shared tables), as cuda_launch_config's dicts."""
    flat = TESTING.cuda_qk_launch_config(q, k, cos, sin, interleaved)
    n = len(LAUNCH_FIELDS)
    assert len(flat) % n == 0, flat
    return [dict(zip(LAUNCH_FIELDS, flat[i:i + n], strict=True)) for i in range(0, len(flat), n)]


def covers(cfg, tokens, heads):
    """Whether a launch has one block column per token and just enough head groups for `heads`."""
    return cfg["grid_x"] == tokens and cfg["block_y"] * (cfg["grid_y"] - 1) < heads <= cfg["block_y"] * cfg["grid_y"]


def test_full_tables_rotary_qk_gqa_hf_view(gen):
    """The transformers patch's call: rotary_qk on HF's (B, H, S, D) views, 32/8 heads, (B, 1, S, D) tables
    in x's dtype. One launch covers q's 32 heads and k's 8 with CompactIndex and vector table loads, and
    gives the CPU op's bits."""
    q = make_layout("hf_view", 2, 5, 32, 128, torch.bfloat16, gen)[0]
    k = make_layout("hf_view", 2, 5, 8, 128, torch.bfloat16, gen)[0]
    cos, sin = (t.unsqueeze(1) for t in rope_tables(torch.arange(5).expand(2, 5), 128, False, torch.bfloat16))
    [cfg] = qk_launches(q, k, cos, sin, False)
    assert (cfg["vec"], cfg["table_vec"], cfg["compact"]) == (8, 1, 1) and covers(cfg, 10, 40), cfg
    got = TESTING.cuda_emulate_rotary_qk(q, k, cos, sin, False, None, None, False)
    want = rope_ext.rotary_qk(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _qk_shared_table_cases(dtype, table_dtype, interleaved, d, r, gen):
    """rotary_qk's shared-table calls in the layouts users hand them: name -> (q, k, cos, sin, tokens, heads
    under CompactIndex, tokens, heads under PlanIndex). B=2, S=5; heads GQA 32/8, MQA 4/1, 3/3 and a q of
    one head under k's three. Tables are general (c1 != c2), in `table_dtype`."""
    B, S = 2, 5

    def tables(*shape):
        return random_tables((*shape, r), table_dtype, gen)

    def shifted(t):  # t's values one element past an aligned start: the vector path is off
        buf = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
        return buf.copy_(t)

    cases = {}
    for hq, hk in ((32, 8), (4, 1), (3, 3), (1, 3)):
        h = hq + hk
        tag = f"{hq}/{hk}"
        q, to_layout = make_layout("bshd", B, S, hq, d, dtype, gen)
        k = make_layout("bshd", B, S, hk, d, dtype, gen)[0]
        cases[f"bshd {tag}"] = (q, k, *tables(B, S, 1), B * S, h, B * S, h)
        # (S, 1, r) tables shared over the batch: CompactIndex folds the batch into tokens, PlanIndex keeps
        # it a head dim of each operand
        cases[f"bshd {tag} tables shared over batch"] = (q, k, *tables(S, 1), B * S, h, S, B * h)
        cases[f"bshd {tag} k misaligned"] = (q, shifted(k), *tables(B, S, 1), B * S, h, B * S, h)
        q, to_layout = make_layout("hf_view", B, S, hq, d, dtype, gen)
        k = make_layout("hf_view", B, S, hk, d, dtype, gen)[0]
        cases[f"hf_view {tag}"] = (q, k, *(to_layout(t) for t in tables(B, S, 1)), B * S, h, B * S, h)
        cases[f"hf_view {tag} (S, r) tables"] = (q, k, *tables(S), B * S, h, S, B * h)
        q = make_layout("thd", B, S, hq, d, dtype, gen)[0]
        k = make_layout("thd", B, S, hk, d, dtype, gen)[0]
        cases[f"thd {tag}"] = (q, k, *tables(B * S, 1), B * S, h, B * S, h)
    # q and k as slices of one fused (B, S, Hq + 2 Hk, D) projection, and a contiguous (B, H, S, D)
    qkv = torch.randn(B, S, 32 + 2 * 8, d, generator=gen).to(dtype)
    cases["qkv_slice 32/8"] = (qkv[:, :, :32], qkv[:, :, 32:40], *tables(B, S, 1), B * S, 40, B * S, 40)
    c, s = tables(B, 1, S)
    cases["bhsd 32/8"] = (make_layout("bhsd", B, S, 32, d, dtype, gen)[0], make_layout("bhsd", B, S, 8, d, dtype,
                          gen)[0], c, s, B * S, 40, B * S, 40)
    return cases


# (head_dim, rotary_dim): full rotary, partial rotary, and 72/40, whose 20-pair halves take the scalar
# path for 16-bit half-split (and the vector path elsewhere)
QK_DIMS = {"64_full": (64, 64), "64_partial": (64, 32), "72_40": (72, 40)}


@pytest.mark.parametrize("dims", QK_DIMS.values(), ids=QK_DIMS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_rotary_qk_shared_tables_one_launch(interleaved, dtype, dims, gen):
    """rotary_qk with tables q and k share (no cos_k/sin_k) is one launch covering q's heads and then
    k's, with either row index, on the vector path where both operands allow it and the scalar path
    where either does not; the emulated kernel gives the CPU op's bits, forward and transpose."""
    d, r = dims
    for table_dtype in {dtype, torch.float32}:
        # 16 bytes of the wider of x and the tables (a table vector is never wider than 16 bytes)
        ev = 16 // max(torch.empty((), dtype=t).element_size() for t in (dtype, table_dtype))
        widths = (r % ev == 0 if interleaved else (r // 2) % ev == 0) and (d - r) % ev == 0
        for name, (q, k, cos, sin, *counts) in _qk_shared_table_cases(dtype, table_dtype, interleaved, d, r,
                                                                       gen).items():
            expected = [rope_ext.rotary_qk(q, k, cos, sin, interleaved=interleaved, conjugate=conj)
                        for conj in (False, True)]
            for allow in (True, False):
                with hook_setting("cuda_allow_compact_index", allow):
                    [cfg] = qk_launches(q, k, cos, sin, interleaved)
                    tokens, heads = counts[:2] if allow else counts[2:]
                    assert cfg["compact"] == allow and covers(cfg, tokens, heads), (name, allow, cfg)
                    assert (cfg["vec"] > 1) == (widths and "misaligned" not in name), (name, cfg)
                    for conj, want in zip((False, True), expected, strict=True):
                        got = TESTING.cuda_emulate_rotary_qk(q, k, cos, sin, interleaved, None, None, conj)
                        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (name, allow, conj)
        # the CPU op itself against the float64 formula (the emulator matches it bit for bit above)
        assert_matches_reference(expected[1][1], k, cos, sin, interleaved, True)


@pytest.mark.parametrize("compact", [True, False], ids=["CompactIndex", "PlanIndex"])
def test_rotary_qk_one_thread_walks_from_q_heads_into_k_heads(compact, gen):
    """A launch with more heads than its grid covers (1,100 tokens fill the grid's columns, so one head
    group; 250 + 10 heads against its block_y threads, 128 here): each thread's head loop steps by
    block_y, and some cross from q's heads into k's (thread 122: q's 122, then k's head 0). Full
    tables, bfloat16, D = 16; every head bit-identical to the CPU op."""
    q = torch.randn(1, 1100, 250, 16, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 1100, 10, 16, generator=gen).to(torch.bfloat16)
    cos, sin = random_tables((1100, 1, 16), torch.float32, gen)
    with hook_setting("cuda_allow_compact_index", compact):
        [cfg] = qk_launches(q, k, cos, sin, False)
        step = cfg["grid_y"] * cfg["block_y"]
        assert step < 260 and any(h < 250 <= h + step * n < 260 for h in range(step) for n in (1, 2)), cfg
        got = TESTING.cuda_emulate_rotary_qk(q, k, cos, sin, False, None, None, False)
    want = rope_ext.rotary_qk(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rotary_qk_launches_as_the_op_makes_them(gen):
    """The emulated rotary_qk makes the launches cuda_qk_launch_config reports: one for q and k with
    shared tables; one per tensor with k's own tables (the kernel has one pair of table pointers) or
    with head dims that differ (a launch's items cover one row width)."""
    q = make_layout("bshd", 2, 5, 8, 64, torch.float32, gen)[0]
    k = make_layout("bshd", 2, 5, 2, 64, torch.float32, gen)[0]
    cos, sin = random_tables((2, 5, 1, 48), torch.float32, gen)
    cos_k, sin_k = random_tables((5, 1, 48), torch.float32, gen)
    k_wide = make_layout("bshd", 2, 5, 2, 96, torch.float32, gen)[0]
    calls = {
        "shared": ((q, k, cos, sin, False, None, None, False), 1),
        "k's own tables": ((q, k, cos, sin, False, cos_k, sin_k, False), 2),
        "head dims differ": ((q, k_wide, cos, sin, False, None, None, False), 2),
    }
    for name, (args, n) in calls.items():
        with hook_setting("cuda_record_launches", True):
            got = TESTING.cuda_emulate_rotary_qk(*args)
            made = TESTING.cuda_launches()
        want = rope_ext.rotary_qk(args[0], args[1], args[2], args[3], cos_k=args[5], sin_k=args[6])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
        assert len(made) == n * len(LAUNCH_FIELDS), (name, made)
        if args[5] is None:
            assert made == TESTING.cuda_qk_launch_config(*args[:4], False), name
    [one] = qk_launches(q, k, cos, sin, False)
    assert covers(one, 10, 10), one
    with hook_setting("cuda_record_launches", True):
        TESTING.cuda_emulate_rotary_pos_qk(q, k, cos[0, :, 0, :24], sin[0, :, 0, :24], torch.arange(5)[:, None],
                                           False, False)
        assert len(TESTING.cuda_launches()) == len(LAUNCH_FIELDS)  # rotary_pos_qk: one launch, as before
    with pytest.raises(RuntimeError, match=r"cuda_launches: not recording"):
        TESTING.cuda_launches()


def test_rotary_qk_one_launch_checks_k_alignment_too(gen):
    """k's rows go through the one launch's vector accesses: with alignment ignored, a k one element off
    its 16-byte boundary (q aligned) is refused at k's first load, as a GPU would fault on it."""
    q = make_layout("bshd", 2, 3, 4, 64, torch.bfloat16, gen)[0]
    k_aligned = make_layout("bshd", 2, 3, 2, 64, torch.bfloat16, gen)[0]
    k = torch.empty(k_aligned.numel() + 1, dtype=k_aligned.dtype)[1:].view(k_aligned.shape).copy_(k_aligned)
    cos, sin = rope_tables(torch.arange(3)[None, :, None], 64, False, torch.bfloat16)
    assert qk_launches(q, k, cos, sin, False)[0]["vec"] == 1
    with ignoring_alignment():
        assert qk_launches(q, k, cos, sin, False)[0]["vec"] == 8
        with pytest.raises(RuntimeError, match=r"misaligned 16-byte load .* access site k\.x1"):
            TESTING.cuda_emulate_rotary_qk(q, k, cos, sin, False, None, None, False)
        got = TESTING.cuda_emulate_rotary_qk(q, k_aligned, cos, sin, False, None, None, False)
    want = rope_ext.rotary_qk(q, k_aligned, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    "t, inner",
    [
        (12345, 7),  # the 32-bit division
        ((1 << 32) - 1, 65537),  # the largest t it takes
        (1 << 32, 3),  # t past 32 bits: the 64-bit division
        ((1 << 40) + 12345, 1 << 33),  # inner past 32 bits too
        (5, (1 << 32) + 1),  # only inner past 32 bits
        ((1 << 62) + 999, (1 << 31) + 11),  # every quotient bit of the bitwise 64-bit division
    ],
)
def test_compact_index_token_offsets_on_both_sides_of_the_32_bit_division(t, inner):
    """CompactIndex::token splits token t into (t // inner, t % inner) with a 32-bit division when
    both fit in 32 bits; only launches of 2^32 tokens take the 64-bit side, so a hook calls it
    directly. The reference is Python's exact integer arithmetic."""
    strides = [1 << 20, 3, 5 << 16, 7, 11, 13]
    o, i = divmod(t, inner)
    expected = [o * strides[0] + i * strides[1], o * strides[2] + i * strides[3], o * strides[4] + i * strides[5]]
    expected.append(expected[-1])
    assert TESTING.cuda_compact_token_offsets(t, inner, strides) == expected


# --- the emulator's memory checks and traffic model (csrc/testing/host_emulation.cpp) -----------

TRAFFIC_FIELDS = ("ld_needed", "ld_sectors", "st_needed", "st_sectors", "ld_distinct", "st_distinct",
                  "ld_instructions", "st_instructions", "ld_lanes", "st_lanes")


def ignoring_alignment():
    """Launches take vector loads wherever the widths allow, whatever the alignment (a testing knob)."""
    return hook_setting("cuda_ignore_alignment", True)


def recorded_traffic(fn, *args):
    """fn(*args) with the emulator recording: (its result, the totals, {site: (needed, sector bytes, instructions)})."""
    TESTING.cuda_record_traffic(True)
    try:
        result = fn(*args)
        totals = dict(zip(TRAFFIC_FIELDS, TESTING.cuda_traffic(), strict=True))
        names, flat = TESTING.cuda_traffic_by_site()
    finally:
        TESTING.cuda_record_traffic(False)
    return result, totals, {n: tuple(flat[3 * i:3 * i + 3]) for i, n in enumerate(names)}


def test_emulator_refuses_misaligned_vector_accesses(gen):
    """A GPU faults on a 16-byte access that is not 16-byte aligned; x86 does not. The launch never
    chooses one (it falls back to scalar loads), so the knob that ignores alignment forces one, and the
    emulator must refuse it, naming the access; aligned vector accesses pass the same check."""
    x = make_layout("bshd", 2, 3, 4, 64, torch.bfloat16, gen)[0]
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape)  # 2 bytes past a 16-byte boundary
    shifted.copy_(x)
    cos, sin = rope_tables(torch.arange(3)[None, :, None], 64, False, torch.bfloat16)
    checked = TESTING.cuda_checked_accesses()
    assert torch.equal(TESTING.cuda_emulate_rotary(x, cos, sin, False, False), rope_ext.rotary(x, cos, sin))
    # every access is checked: at least the output's 16-byte stores, and x's loads
    assert TESTING.cuda_checked_accesses() - checked >= 2 * x.numel() // 8
    assert launch(shifted, cos, sin, False)["vec"] == 1
    assert torch.equal(TESTING.cuda_emulate_rotary(shifted, cos, sin, False, False), rope_ext.rotary(x, cos, sin))
    with ignoring_alignment():
        assert launch(shifted, cos, sin, False)["vec"] == 8
        with pytest.raises(RuntimeError, match=r"misaligned 16-byte load at 0x[0-9a-f]+ \(2 bytes past a 16-byte "
                                               r"boundary\), access site q\.x1: a GPU faults on it"):
            TESTING.cuda_emulate_rotary(shifted, cos, sin, False, False)
        # gathered caches: x aligned, the caches one element off, so only the vector table load is misaligned
        cache = torch.randn(2 * 16 * 32 + 1, generator=gen).to(torch.bfloat16)[1:].view(2, 16, 32)
        pos = torch.randint(0, 16, (2, 3, 1), generator=gen)
        assert TESTING.cuda_pos_launch_config(x, None, cache[0], cache[1], pos, False)[LAUNCH_FIELDS.index("table_vec")]
        with pytest.raises(RuntimeError, match=r"misaligned 16-byte load .* access site q\.cos1"):
            TESTING.cuda_emulate_rotary_pos(x, cache[0], cache[1], pos, False, False)
    assert launch(shifted, cos, sin, False)["vec"] == 1  # the knob is off again


def test_traffic_model_counts_bytes_and_sectors(gen):
    """The recorder against what can be worked out by hand. Every output byte is stored once, in
    whole sectors (a contiguous output); x is read at least once. With the scalar path on columns of
    stride 2 (float32, 32 pairs per row: one warp per head row), each warp's load of x's first members
    needs 32 x 4 bytes spread over 256 bytes: efficiency exactly 1/2; the contiguous output's stores 1."""
    x = make_layout("bshd", 2, 3, 4, 64, torch.float32, gen)[0]
    cos, sin = rope_tables(torch.arange(3)[None, :, None], 64, False, torch.float32)
    out, t, _ = recorded_traffic(TESTING.cuda_emulate_rotary, x, cos, sin, False, False)
    assert torch.equal(out, rope_ext.rotary(x, cos, sin))
    nbytes = x.numel() * 4
    assert t["st_needed"] == t["st_sectors"] == t["st_distinct"] == nbytes
    assert t["ld_needed"] >= nbytes and t["ld_distinct"] == nbytes + 2 * cos.numel() * 4

    strided, _ = make_layout("strided_cols", 2, 3, 4, 64, torch.float32, gen)
    assert launch(strided, cos, sin, False)["vec"] == 1 and launch(strided, cos, sin, False)["block_x"] == 32
    out, t, sites = recorded_traffic(TESTING.cuda_emulate_rotary, strided, cos, sin, False, False)
    assert torch.equal(out, rope_ext.rotary(strided, cos, sin))
    rows = 2 * 3 * 4
    assert sites["q.x1"] == (rows * 32 * 4, rows * 256, rows) and sites["q.x2"] == sites["q.x1"]
    assert sites["q.out1"] == (rows * 32 * 4, rows * 32 * 4, rows)
    assert t["st_needed"] == t["st_sectors"] == nbytes


def test_traffic_rotary_qk_reads_the_tables_once(gen):
    """With shared tables, rotary_qk's one launch reads each token's cos and sin once for q's heads and
    k's, where rotary(q) and rotary(k) read them once each. Float32, D = r = 64, half-split: 8 items of 4
    pairs per row, so q's 3 heads and k's 1 fill one 32-thread warp (block 8 x 4), whose loads of a
    token's table values are one read of them. The expected bytes follow from the shapes: q, k and the
    tables each read once, in whole 32-byte sectors (rows of 256 bytes)."""
    B, S, D = 2, 16, 64
    q = make_layout("bshd", B, S, 3, D, torch.float32, gen)[0]
    k = make_layout("bshd", B, S, 1, D, torch.float32, gen)[0]
    cos, sin = random_tables((B, S, 1, D), torch.float32, gen)
    [cfg] = qk_launches(q, k, cos, sin, False)
    assert (cfg["block_x"], cfg["block_y"], cfg["grid_y"]) == (8, 4, 1), cfg
    table_read = B * S * 2 * D * 4  # cos and sin: r float32 values each per token
    qk_bytes = (q.numel() + k.numel()) * 4
    (got_q, got_k), one, _ = recorded_traffic(TESTING.cuda_emulate_rotary_qk, q, k, cos, sin, False, None, None,
                                              False)
    want = rope_ext.rotary_qk(q, k, cos, sin)
    assert torch.equal(got_q, want[0]) and torch.equal(got_k, want[1])
    alone = [recorded_traffic(TESTING.cuda_emulate_rotary, x, cos, sin, False, False)[1] for x in (q, k)]
    assert one["ld_needed"] == one["ld_sectors"] == qk_bytes + table_read
    assert sum(t["ld_needed"] for t in alone) == sum(t["ld_sectors"] for t in alone) == qk_bytes + 2 * table_read
    # stores do not change: q and k written once either way
    assert one["st_sectors"] == sum(t["st_sectors"] for t in alone) == qk_bytes


def test_the_sanitizer_cases_reach_every_cuda_kernel(capsys, monkeypatch):
    """make gpu-check's sanitize step runs tests/gpu_kernel_cases.py under compute-sanitizer, which
    must launch every kernel template: its cases reach all 224, by the launcher's own choice."""
    import gpu_kernel_cases

    monkeypatch.setattr("sys.argv", ["gpu_kernel_cases.py", "--device", "cpu"])
    assert gpu_kernel_cases.main() == 0
    assert "224 of 224 kernels reached" in capsys.readouterr().out
