"""RotaryEmbedding on its cache: every position mode is one rotary_pos_qk call that gathers rows of
cos_cache/sin_cache, with results bit-identical to rotary_qk on the tables cos_sin() builds; no host
sync in a forward (checked with the profiler); the cache grows in eager mode up to
max_cache_positions, past which a call builds its own tables."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from conftest import CONVENTIONS, HostCopySpy, randn

import rope_ext

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}

SYNC_OPS = {"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero"}


def table_path(rope, q, k, position_ids, bhsd=True):
    """rotary_qk on the full-form tables the module's cos_sin() builds: the pre-cache path."""
    cos, sin = rope.cos_sin(position_ids)  # (B, S, r)
    unsq = 1 if bhsd else 2
    return rope_ext.rotary_qk(q, k, cos.unsqueeze(unsq), sin.unsqueeze(unsq), interleaved=rope.interleaved)


@pytest.mark.parametrize("scaling", SCALINGS.values(), ids=SCALINGS.keys())
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_every_position_mode_equals_the_table_path(interleaved, scaling, gen):
    rope = rope_ext.RotaryEmbedding(32, 5e5, interleaved=interleaved, rotary_dim=24, scaling=scaling,
                                    max_position_embeddings=256, layout="bhsd")
    assert rope._cache_kind == "static"
    B, S = 2, 6
    q, k = randn(B, 4, S, 32, dtype=torch.bfloat16, gen=gen), randn(B, 2, S, 32, dtype=torch.bfloat16, gen=gen)
    offsets = torch.tensor([5, 100])
    modes = {
        "default": ({}, torch.arange(S).expand(B, S)),
        "int_offset": (dict(offset=17), torch.arange(17, 17 + S).expand(B, S)),
        "row_offsets": (dict(offset=offsets), offsets[:, None] + torch.arange(S)),
        "position_ids": (dict(position_ids=torch.randint(0, 256, (B, S), generator=gen)), None),
    }
    for name, (kwargs, pos) in modes.items():
        pos = kwargs.get("position_ids", pos)
        got = rope(q, k, **kwargs)
        want = table_path(rope, q, k, pos)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
    # packed sequences: positions restart at each start
    cu = torch.tensor([0, 2, 2, 7])
    pq, pk = randn(7, 4, 32, gen=gen), randn(7, 2, 32, gen=gen)
    pos = torch.tensor([0, 1, 0, 1, 2, 3, 4])
    got = rope(pq, pk, cu_seqlens=cu)
    cos, sin = rope.cos_sin(pos)
    want = rope_ext.rotary_qk(pq, pk, cos[:, None], sin[:, None], interleaved=interleaved)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_growing_off_the_cpu_keeps_the_old_buffers_alive(device):
    """A CUDA graph captured before the cache grows keeps reading the old buffers' addresses: off the
    CPU (meta stands in for a GPU here) the module keeps them alive, holding the same tensors; on the
    CPU, where no graph can hold them, it lets them go."""
    rope = rope_ext.RotaryEmbedding(64, layout="bshd", max_position_embeddings=16, device=device)
    q = torch.empty(1, 4, 2, 64, device=device)
    first = (rope.cos_cache, rope.sin_cache, rope._steps)
    rope(q, q, offset=100)  # past the cache: grows it to 104 rows
    second = (rope.cos_cache, rope.sin_cache, rope._steps)
    rope.ensure_positions(1000)
    assert rope.cos_cache.shape == (1000, 32) and second[0].shape == (104, 32)
    kept = [tuple(id(t) for t in old) for old in rope._retired_caches]
    assert kept == ([tuple(map(id, first)), tuple(map(id, second))] if device == "meta" else [])

def _profile(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()]


def _longrope(r: int, original: int) -> dict:
    """A longrope configuration with distinct per-frequency short and long factors."""
    n = r // 2
    return {"rope_type": "longrope", "original_max_position_embeddings": original,
            "short_factor": [1.0 + i / n for i in range(n)], "long_factor": [2.0 + 3 * i / n for i in range(n)]}


# Every kind of table a forward builds, and every way of giving positions, on the meta device: a
# stand-in for a GPU on which a host-to-device copy (HostCopySpy) or a value read back (an error on
# meta) would be a host sync, and would break CUDA graph capture.
DEVICE_MODULES = {
    **{name: dict(scaling=config) for name, config in SCALINGS.items()},
    "dynamic": dict(scaling={"rope_type": "dynamic", "factor": 2.0}),
    "longrope": dict(scaling=_longrope(64, 64)),
    "proportional": dict(scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0}),
    "xpos": dict(xpos_scale_base=512.0),
    "mrope": dict(mrope_section=[8, 12, 12]),
}


@pytest.mark.parametrize("module", DEVICE_MODULES.values(), ids=DEVICE_MODULES.keys())
def test_forward_on_a_device_copies_nothing_from_the_host(module):
    dev = torch.device("meta")
    rope = rope_ext.RotaryEmbedding(64, layout="bhsd", max_position_embeddings=512, device=dev, **module)
    B, S = 2, 5
    q, k = torch.empty(B, 8, S, 64, device=dev, dtype=torch.bfloat16), torch.empty(B, 2, S, 64, device=dev)
    pq, pk = torch.empty(9, 8, 64, device=dev), torch.empty(9, 2, 64, device=dev)
    positions = torch.zeros(3, B, S, dtype=torch.int64, device=dev) if "mrope_section" in module else \
        torch.zeros(B, S, dtype=torch.int64, device=dev)
    calls = {
        "position_ids": lambda: rope(q, k.bfloat16(), positions),
        "int_offset": lambda: rope(q, k.bfloat16(), offset=100),
        "row_offsets": lambda: rope(q, k.bfloat16(), offset=torch.zeros(B, dtype=torch.int64, device=dev)),
        "cu_seqlens": lambda: rope(pq, pk, cu_seqlens=torch.zeros(3, dtype=torch.int32, device=dev)),
    }
    if "mrope_section" in module:
        del calls["cu_seqlens"]  # (packed M-RoPE sequences take (3, T) stream positions: no cu_seqlens)
    for name, call in calls.items():
        call()  # a first call may build the cache
        with HostCopySpy() as spy:
            out_q, out_k = call()
        assert spy.copies == [], (name, spy.copies)
        assert out_q.device == dev and out_k.device == dev


@pytest.mark.parametrize("scaling", ["default", "longrope"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_forward_is_one_op_call_without_host_sync(layout, scaling, gen):
    """Positions from position_ids, cu_seqlens and offsets: no item/_local_scalar_dense/is_nonzero
    (each a device round trip on a GPU) and exactly one rope_ext op. longrope chooses between its
    short and long rows on the device."""
    config = None if scaling == "default" else _longrope(64, 64)
    rope = rope_ext.RotaryEmbedding(64, layout=layout, max_position_embeddings=512, scaling=config)
    B, S = 2, 5
    shape_q, shape_k = ((B, 8, S, 64), (B, 2, S, 64)) if layout == "bhsd" else ((B, S, 8, 64), (B, S, 2, 64))
    q, k = randn(*shape_q, gen=gen), randn(*shape_k, gen=gen)
    pq, pk = randn(9, 8, 64, gen=gen), randn(9, 2, 64, gen=gen)
    calls = {
        "position_ids": lambda: rope(q, k, torch.randint(0, 512, (B, S), generator=gen)),
        "cu_seqlens": lambda: rope(pq, pk, cu_seqlens=torch.tensor([0, 4, 9])),
        "cu_seqlens_offsets": lambda: rope(pq, pk, cu_seqlens=torch.tensor([0, 4, 9]), offset=torch.tensor([3, 7])),
        "int_offset": lambda: rope(q, k, offset=100),
        "row_offsets": lambda: rope(q, k, offset=torch.tensor([3, 9])),
    }
    for name, call in calls.items():
        call()  # the cache is built; a second call is the steady state
        events = _profile(call)
        assert not SYNC_OPS & set(events), (name, sorted(SYNC_OPS & set(events)))
        ours = [e for e in events if e.startswith("rope_ext::")]
        assert ours == ["rope_ext::rotary_pos_qk"], (name, ours)


def test_cache_grows_in_eager_and_past_the_cap_builds_tables(gen):
    rope = rope_ext.RotaryEmbedding(16, max_position_embeddings=32, layout="bhsd")
    q, k = randn(1, 2, 4, 16, gen=gen), randn(1, 2, 4, 16, gen=gen)
    assert rope.cos_cache.shape == (32, 8)
    got = rope(q, k, offset=40)  # grows (doubles)
    assert rope.cos_cache.shape == (64, 8)
    want = table_path(rope, q, k, torch.arange(40, 44)[None])
    assert torch.equal(got[0], want[0])
    got = rope(q, k, torch.tensor([[100, 3, 5, 7]]))  # CPU position_ids are read: grows
    assert rope.cos_cache.shape == (128, 8)
    rope.max_cache_positions = 128  # the knob: past it, a call builds its own tables
    for kwargs, pos in ((dict(offset=500), torch.arange(500, 504)[None]),
                        (dict(position_ids=torch.tensor([[900, 0, 1, 2]])), torch.tensor([[900, 0, 1, 2]]))):
        before = _profile(lambda kwargs=kwargs: rope(q, k, **kwargs))
        assert rope.cos_cache.shape == (128, 8)
        assert [e for e in before if e.startswith("rope_ext::")].count("rope_ext::rotary_qk") == 1
        got, want = rope(q, k, **kwargs), table_path(rope, q, k, pos)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_cache_survives_moves_and_dtype_changes(gen):
    rope = rope_ext.RotaryEmbedding(16, max_position_embeddings=32, layout="bhsd")
    q, k = randn(1, 2, 4, 16, gen=gen), randn(1, 2, 4, 16, gen=gen)
    want = rope(q, k, offset=3)
    rope.to(torch.bfloat16)
    assert rope.cos_cache.dtype == torch.float32 and rope.cos_cache.shape == (32, 8)
    got = rope(q, k, offset=3)
    assert torch.equal(got[0], want[0])
    meta = rope_ext.RotaryEmbedding(16, max_position_embeddings=32, device="meta", layout="bhsd").to_empty(device="cpu")
    got = meta(q, k, offset=3)
    assert torch.equal(got[0], want[0])
    assert "cos_cache" not in rope.state_dict()


def test_compile_sees_a_fixed_buffer_and_does_not_recompile(gen):
    rope = rope_ext.RotaryEmbedding(16, max_position_embeddings=64, layout="bhsd")
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(rope, fullgraph=True, dynamic=True, backend=counter)
    for s in (3, 5, 9, 17):
        q, k = randn(2, 2, s, 16, gen=gen), randn(2, 1, s, 16, gen=gen)
        pos = torch.randint(0, 64, (2, s), generator=gen)
        got, want = compiled(q, k, pos), rope(q, k, pos)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert counter.frame_count == 1
    q = randn(1, 1, 2, 16, gen=gen)
    with pytest.raises(RuntimeError, match="is outside the cache, whose 64 rows"):
        compiled(q, q, torch.tensor([[1, 64]]))
    assert rope.cos_cache.shape == (64, 8)


def test_layout_is_required_and_names_both_choices():
    with pytest.raises(TypeError, match=r"give layout='bhsd' .* or layout='bshd'.*silently rotate along the head axis"):
        rope_ext.RotaryEmbedding(64)
    # what a default would have hidden: MHA q, k in (B, S, H, D) read as (B, H, S, D)
    q = torch.randn(1, 6, 4, 64)
    right = rope_ext.RotaryEmbedding(64, layout="bshd")(q, q)[0]
    wrong = rope_ext.RotaryEmbedding(64, layout="bhsd")(q, q)[0]
    assert not torch.allclose(right, wrong)
    assert torch.equal(right.transpose(1, 2), rope_ext.RotaryEmbedding(64, layout="bhsd")(*[q.transpose(1, 2)] * 2)[0])


def test_ensure_positions_sizes_the_cache_for_device_positions(gen):
    rope = rope_ext.RotaryEmbedding(16, layout="bshd", max_position_embeddings=8)
    rope.ensure_positions(300)
    assert rope.cos_cache.shape == (300, 8)
    q = randn(1, 3, 2, 16, gen=gen)
    pos = torch.tensor([[299, 0, 150]])
    events = _profile(lambda: rope(q, q, pos))
    assert [e for e in events if e.startswith("rope_ext::")] == ["rope_ext::rotary_pos_qk"]
    want = table_path(rope, q, q, pos, bhsd=False)
    assert torch.equal(rope(q, q, pos)[0], want[0])
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        rope.ensure_positions(-1)


def test_buffers_are_what_forward_reads(gen):
    """forward reads the registered buffers themselves: export lifts them as buffers (moved by
    .to()), functional_call's replacements are honoured."""
    m = rope_ext.RotaryEmbedding(32, layout="bshd", max_position_embeddings=16)
    q, k = randn(1, 4, 2, 32, gen=gen), randn(1, 4, 1, 32, gen=gen)
    ep = torch.export.export(m, (q, k), kwargs={"position_ids": torch.arange(4)[None]})
    assert not ep.graph_signature.lifted_tensor_constants
    assert {"cos_cache", "sin_cache"} <= set(ep.graph_signature.buffers)
    gm = ep.module().to("meta")
    out = gm(q.to("meta"), k.to("meta"), position_ids=torch.arange(4, device="meta")[None])
    assert out[0].device.type == "meta"
    z = torch.zeros_like(m.cos_cache)
    swapped = torch.func.functional_call(m, {"cos_cache": z, "sin_cache": z}, (q, k))
    assert swapped[0].abs().max() == 0


def test_cache_grown_under_inference_mode_serves_training(gen):
    m = rope_ext.RotaryEmbedding(16, layout="bhsd", max_position_embeddings=8)
    q = randn(1, 2, 4, 16, gen=gen)
    with torch.inference_mode():
        m(q, q, offset=20)  # grows the cache
    assert not m.cos_cache.is_inference()
    x = q.clone().requires_grad_()
    out = m(x, x, offset=20)
    out[0].sum().backward()
    assert x.grad is not None


def test_tensor_offsets_past_the_cache_grow_it(gen):
    m = rope_ext.RotaryEmbedding(16, layout="bshd", max_position_embeddings=8)
    q = randn(2, 12, 2, 16, gen=gen)  # 12 tokens: more than the 8 rows
    offsets = torch.tensor([0, 3])
    got = m(q, q, offset=offsets)
    want = table_path(m, q, q, offsets[:, None] + torch.arange(12), bhsd=False)
    assert torch.equal(got[0], want[0])


def test_values_are_read_without_numpy(gen, monkeypatch):
    """torch does not require numpy: the CPU checks that read positions, offsets and cu_seqlens
    work without it (and record no aten::item)."""

    def no_numpy(self, *args, **kwargs):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    m = rope_ext.RotaryEmbedding(16, layout="bhsd", max_position_embeddings=8)
    q = randn(2, 2, 3, 16, gen=gen)
    m(q, q, torch.tensor([[1, 2, 30], [0, 1, 2]]))  # past the cache: read, then grown
    assert m.cos_cache.shape[0] >= 31
    with pytest.raises(ValueError, match="position_ids must be >= 0, got a minimum of -2"):
        m(q, q, torch.tensor([[1, -2, 3], [0, 1, 2]]))
    with pytest.raises(ValueError, match="offset must be >= 0"):
        m(q, q, offset=torch.tensor([1, -1]))
    pq = randn(5, 2, 16, gen=gen)
    m(pq, pq, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        m(pq, pq, cu_seqlens=torch.tensor([0, 3, 2, 5]))
    with pytest.raises(ValueError, match="position_ids must be >= 0"):
        m.cos_sin(torch.tensor([[-1, 0]]))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("interleaved", CONVENTIONS.values(), ids=CONVENTIONS.keys())
def test_length_dependent_types_read_the_right_rows(interleaved, layout, gen):
    """longrope keeps short and long rows and reads the long ones when the call's largest position
    reaches original_max_position_embeddings (64); dynamic NTK reads its cache while every position
    is below max_position_embeddings (256), and past it builds tables for the call's length. Each
    call equals the tables cos_sin() builds for its positions (checked against transformers in
    test_scaling.py), bit for bit, and the cache calls are one rotary_pos_qk."""
    B, S = 2, 6
    bhsd = layout == "bhsd"
    q = randn(*((B, 4, S, 32) if bhsd else (B, S, 4, 32)), dtype=torch.bfloat16, gen=gen)
    k = randn(*((B, 2, S, 32) if bhsd else (B, S, 2, 32)), dtype=torch.bfloat16, gen=gen)
    pos = torch.arange(S)
    calls = {
        # name: (kwargs, the positions as (B, S), reads the cache)
        "short_offset": (dict(offset=10), (10 + pos).expand(B, S), True),
        "offset_across_switch": (dict(offset=60), (60 + pos).expand(B, S), True),
        "short_position_ids": (dict(position_ids=torch.randint(0, 64, (B, S), generator=gen)), None, True),
        "long_position_ids": (dict(position_ids=torch.randint(0, 256, (B, S), generator=gen)), None, True),
        "row_offsets_one_long": (dict(offset=torch.tensor([5, 100])), torch.tensor([[5], [100]]) + pos, True),
        "past_max_positions": (dict(offset=290), (290 + pos).expand(B, S), False),
        "position_ids_past_max": (dict(position_ids=torch.tensor([[0, 1, 2, 3, 4, 300]])), None, False),
    }
    for scaling in ("longrope", "dynamic"):
        config = _longrope(24, 64) if scaling == "longrope" else {"rope_type": "dynamic", "factor": 2.0}
        rope = rope_ext.RotaryEmbedding(32, 5e5, interleaved=interleaved, rotary_dim=24, scaling=config,
                                        max_position_embeddings=256, layout=layout)
        assert rope._cache_kind == scaling
        for name, (kwargs, positions, cached) in calls.items():
            positions = kwargs.get("position_ids", positions)
            events = _profile(lambda kwargs=kwargs, rope=rope: rope(q, k, **kwargs))
            ours = [e for e in events if e.startswith("rope_ext::")]
            # longrope grows its long rows past 256 positions; dynamic NTK builds tables there (its CPU
            # positions are tried on the cache first: the op refuses them before writing anything)
            if cached or scaling == "longrope":
                assert ours == ["rope_ext::rotary_pos_qk"], (scaling, name, ours)
            else:
                assert ours[-1] == "rope_ext::rotary_qk", (scaling, name, ours)
            got, want = rope(q, k, **kwargs), table_path(rope, q, k, positions, bhsd)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (scaling, name)
        with pytest.raises(ValueError, match="position_ids must be >= 0"):  # not a short row read silently
            rope(q, k, torch.tensor([[-1, 0, 1, 2, 3, 100]]))


def test_longrope_cache_layout_and_dynamic_on_device_positions(gen):
    """longrope's cache: switch_len short rows, then the long rows, which grow; dynamic NTK's stays at
    max_position_embeddings. Positions it could not read without a sync (here, under torch.compile,
    as device tensors would be) build tables without consulting the cache."""
    rope = rope_ext.RotaryEmbedding(32, scaling=_longrope(32, 64), max_position_embeddings=256, layout="bhsd")
    assert rope.cos_cache.shape == (64 + 256, 16)
    rope.ensure_positions(1000)
    assert rope.cos_cache.shape == (64 + 1000, 16)
    short, long = rope.cos_sin(torch.tensor([[5]])), rope.cos_sin(torch.tensor([[5, 64]]))
    assert torch.equal(rope.cos_cache[5], short[0][0, 0, :16])
    assert torch.equal(rope.cos_cache[64 + 5], long[0][0, 0, :16])
    dyn = rope_ext.RotaryEmbedding(32, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=256,
                                   layout="bhsd")
    dyn.ensure_positions(1000)
    assert dyn.cos_cache.shape == (256, 16)
    q, k = randn(1, 2, 4, 32, gen=gen), randn(1, 2, 4, 32, gen=gen)
    compiled = torch.compile(dyn, fullgraph=True, backend="eager")
    for pos in (torch.tensor([[0, 1, 2, 3]]), torch.tensor([[0, 1, 2, 700]])):
        compiled(q, k, pos)
        ours = [e for e in _profile(lambda pos=pos: compiled(q, k, pos)) if e.startswith("rope_ext::")]
        assert "rope_ext::rotary_pos_qk" not in ours and ours[-1] == "rope_ext::rotary_qk", ours
        got, want = compiled(q, k, pos), table_path(dyn, q, k, pos)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_forward_under_inference_mode_then_training(layout, gen):
    """Positions made under inference_mode (which have no version counter) and positions reused
    from an inference_mode call by a training call: both work, and gradients flow."""
    bhsd = layout == "bhsd"
    q = randn(*((2, 4, 3, 32) if bhsd else (2, 3, 4, 32)), gen=gen)
    k = randn(*((2, 2, 3, 32) if bhsd else (2, 3, 2, 32)), gen=gen)
    for config in (None, _longrope(32, 64)):
        rope = rope_ext.RotaryEmbedding(32, scaling=config, max_position_embeddings=256, layout=layout)
        pos = torch.tensor([[0, 1, 2], [70, 71, 72]])
        with torch.inference_mode():
            made_inside = torch.tensor([[0, 1, 2], [70, 71, 72]])
            for p in (made_inside, pos, torch.tensor([5, 6, 7]), torch.tensor([[5, 6, 7]])):
                got, want = rope(q, k, p), table_path(rope, q, k, p.expand(2, 3), bhsd)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            rope(q, k, offset=torch.tensor([3, 9]))
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        out = rope(qg, kg, pos)  # pos was last seen under inference_mode
        (out[0].sum() + out[1].sum()).backward()
        assert qg.grad is not None and kg.grad is not None


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_positions_reused_across_calls_follow_in_place_updates(layout, gen):
    """The module reuses the positions view (and longrope's rows) of the previous call when given the
    same tensor or offset again, as every layer of a model does in a step: a tensor updated in place
    between calls (a decode loop's position_ids.add_(1)) is still read afresh, and so is a new
    offset."""
    bhsd = layout == "bhsd"
    B, S = 2, 3
    q = randn(*((B, 4, S, 32) if bhsd else (B, S, 4, 32)), gen=gen)
    k = randn(*((B, 2, S, 32) if bhsd else (B, S, 2, 32)), gen=gen)
    for config in (None, _longrope(32, 64)):
        rope = rope_ext.RotaryEmbedding(32, scaling=config, max_position_embeddings=256, layout=layout)
        pos = torch.tensor([[0, 1, 2], [10, 11, 12]])
        for _ in range(3):  # short rows, then long ones (positions past 64) for longrope
            for _layer in range(2):
                got, want = rope(q, k, pos), table_path(rope, q, k, pos, bhsd)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), pos
            pos.add_(40)
        for offset in (5, 6, 70, 70):
            got, want = rope(q, k, offset=offset), table_path(rope, q, k, (offset + torch.arange(S)).expand(B, S), bhsd)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), offset


FORWARD_MODULES = {**DEVICE_MODULES, "static": {}}


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("module", FORWARD_MODULES.values(), ids=FORWARD_MODULES.keys())
def test_forward_is_one_pass(module, layout, gen):
    """forward's steps each run once per call, whatever the way of giving positions and the table
    source: _positions (the checks, and the positions resolved into one description), _source (the
    cache's rows or tables for the call), _op (one rope_ext op); and no second route re-resolves
    or re-checks them. The calls' results are checked against the table path elsewhere in this file
    and in test_module.py."""
    rope = rope_ext.RotaryEmbedding(64, layout=layout, max_position_embeddings=512, **module)
    B, S = 2, 5
    shape_q, shape_k = ((B, 8, S, 64), (B, 2, S, 64)) if layout == "bhsd" else ((B, S, 8, 64), (B, S, 2, 64))
    q, k = randn(*shape_q, gen=gen), randn(*shape_k, gen=gen)
    pq, pk = randn(9, 8, 64, gen=gen), randn(9, 2, 64, gen=gen)
    mrope = "mrope_section" in module
    calls = {
        "position_ids": lambda: rope(q, k, torch.randint(0, 512, (3, B, S) if mrope else (B, S), generator=gen)),
        "int_offset": lambda: rope(q, k, offset=100),
        "row_offsets": lambda: rope(q, k, offset=torch.tensor([3, 9])),
        "int_offset_past_the_cache": lambda: rope(q, k, offset=600),
    }
    if not mrope:
        calls["cu_seqlens"] = lambda: rope(pq, pk, cu_seqlens=torch.tensor([0, 4, 9]), offset=torch.tensor([3, 7]))
        calls["position_ids_past_the_cache"] = lambda: rope(q, k, torch.tensor([[4000] * S] * B))  # (past 1024)
    steps = ("_positions", "_source", "_op", "_streams", "_read")
    for name, call in calls.items():
        counts = dict.fromkeys(steps, 0)
        originals = {step: getattr(rope, step) for step in steps}

        def counted(step, counts=counts, originals=originals):
            def run(*args, **kwargs):
                counts[step] += 1
                return originals[step](*args, **kwargs)
            return run

        for step in steps:
            rope.__dict__[step] = counted(step)
        try:
            events = _profile(call)
        finally:
            for step in steps:
                del rope.__dict__[step]
        ops = [e for e in events if e.startswith("rope_ext::") and e != "rope_ext::cos_sin_tables"]
        # CPU position_ids past the cache: the kernel refuses them before writing anything, forward
        # reads them, and steps 3 and 4 run again on what was read (the cache grown, or tables)
        refused = name == "position_ids_past_the_cache" and rope._cache_kind is not None
        # (the profiler may or may not record the refused call)
        assert ops and ops[:-1] in ([["rope_ext::rotary_pos_qk"], []] if refused else [[]]), (name, ops)
        assert counts["_positions"] == 1, (name, counts)
        assert counts["_source"] == counts["_op"] == 1 + refused, (name, counts)
        # (read once at most: for the refusal, or for the sign of positions that tables are built for)
        assert counts["_read"] == 1 if refused else counts["_read"] <= 1, (name, counts)
        assert counts["_streams"] <= 1, (name, counts)


def test_row_offsets_make_the_cache_cover_their_length_on_a_device():
    """Per-row offsets are >= 0, so a call of S tokens needs S cache rows at least: the cache grows
    to them before the kernel runs (on a GPU, a position past it would be a device-side assert),
    and past max_cache_positions the call builds its tables. The meta device stands in for a GPU."""
    dev = torch.device("meta")
    rope = rope_ext.RotaryEmbedding(64, layout="bhsd", max_position_embeddings=512, device=dev)
    q, k = torch.empty(2, 4, 700, 64, device=dev), torch.empty(2, 2, 700, 64, device=dev)
    offsets = torch.zeros(2, dtype=torch.int64, device=dev)
    events = _profile(lambda: rope(q, k, offset=offsets))
    assert rope.cos_cache.shape[0] >= 700
    assert [e for e in events if e.startswith("rope_ext::rotary")] == ["rope_ext::rotary_pos_qk"]
    rope.max_cache_positions = 0  # (the cache never grows past max_position_embeddings, 512, now)
    q, k = torch.empty(2, 4, 2000, 64, device=dev), torch.empty(2, 2, 2000, 64, device=dev)
    events = _profile(lambda: rope(q, k, offset=offsets))
    assert rope.cos_cache.shape[0] < 2000
    assert [e for e in events if e.startswith("rope_ext::rotary")] == ["rope_ext::rotary_qk"]


@pytest.mark.parametrize("first", ["4-D", "packed"])
def test_longrope_rows_remembered_per_head_axis(first, gen):
    """The same 1-D position_ids in a 4-D "bhsd" call (rows (S,)) and in a packed call (rows (T, 1)):
    longrope's remembered rows of one call are never handed to the other."""
    rope = rope_ext.RotaryEmbedding(64, layout="bhsd", max_position_embeddings=512, scaling=_longrope(64, 64))
    T = 7
    pos = torch.arange(T) + 60  # crosses the switch at 64: the long rows
    q4, k4 = randn(1, 2, T, 64, gen=gen), randn(1, 2, T, 64, gen=gen)
    qp, kp = randn(T, T, 64, gen=gen), randn(T, 2, 64, gen=gen)  # as many heads as tokens
    calls = {"4-D": lambda: rope(q4, k4, pos), "packed": lambda: rope(qp, kp, pos, cu_seqlens=torch.tensor([0, T]))}
    want = {"4-D": table_path(rope, q4, k4, pos[None]),
            "packed": table_path(rope, qp.unsqueeze(0), kp.unsqueeze(0), pos[None], bhsd=False)}
    for name in (first, *(n for n in calls if n != first)):
        got = calls[name]()
        for a, b in zip(got, want[name], strict=True):
            torch.testing.assert_close(a, b.reshape(a.shape), rtol=0, atol=0)


def test_mrope_row_offsets_with_a_batch_of_three(gen):
    """M-RoPE with per-row offsets and B = 3: text positions drive the three streams, as an int
    offset's do (a (3, S) tensor of them is not taken for three streams)."""
    rope = rope_ext.RotaryEmbedding(64, layout="bhsd", mrope_section=[8, 12, 12])
    q, k = randn(3, 4, 5, 64, gen=gen), randn(3, 2, 5, 64, gen=gen)
    got = rope(q, k, offset=torch.tensor([2, 2, 2]))
    want = rope(q, k, offset=2)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    pos = torch.arange(2, 7).expand(3, 3, 5)  # the streams as (3, B, S)
    for a, b in zip(got, rope(q, k, pos), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("numel", [1, 256, 257, 5000])
def test_extremes_read_both_ways(numel, gen):
    """positions.extremes reads a tensor of up to 256 values with tolist, larger ones with aminmax:
    both give the tensor's min and max, for any shape and either integer dtype."""
    from rope_ext import positions as P

    for dtype in (torch.int64, torch.int32):
        t = torch.randint(-1000, 1 << 30, (numel,), generator=gen).to(dtype)
        t = t.view(numel // 2, 2).t() if numel % 2 == 0 else t  # a non-contiguous view too
        assert P.extremes(t) == (int(t.min()), int(t.max()))
