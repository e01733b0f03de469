"""The README's Python examples run as written and do what they say."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import rope_ext

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


RANK_BLOCK = "# on each rank, after torch.distributed.init_process_group\n"

# What a distributed block takes as given, here for a one-process gloo group (rank 0 of 1): the names
# the README's Distributed section uses.
RANK_PRELUDE = """
import torch
import distributed_workers
import rope_ext
from rope_ext.integrations import transformers as rope_hf

rank, world, device_type = 0, 1, "cpu"
model, ids = distributed_workers.tiny_llama(), distributed_workers.batch()
rope = rope_ext.RotaryEmbedding(32, layout="bshd")
q_local, k_local = torch.randn(2, 8, 4, 32), torch.randn(2, 8, 2, 32)
"""


# The "Use with timm" example needs timm, which needs torchvision and so torch 2.14.1: it runs in
# tests/test_timm_integration.py (cuda-check's venv).
TIMM_BLOCK = "from rope_ext.integrations import timm as rope_timm\n"


def test_every_example_runs():
    """The examples run in order in one namespace, as a reader would paste them (the distributed
    ones apart: test_distributed_examples_run; timm's: tests/test_timm_integration.py)."""
    blocks = [b for b in _blocks() if not b.startswith(RANK_BLOCK) and TIMM_BLOCK not in b]
    assert len(blocks) >= 4, "README lost its examples"
    scope: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README example {i}", "exec"), scope)


def test_distributed_examples_run():
    """Each distributed example runs on rank 0 of a one-process gloo group, from a fresh prelude
    (tests/test_distributed.py and tests/test_dtensor.py run the same calls on 2 processes), and the
    rope_ext calls in it see what the example says: DTensors for the tensor-parallel one."""
    import torch.distributed as dist
    from conftest import RopeOpSpy

    from rope_ext.integrations import transformers as rope_hf

    pytest.importorskip("transformers")
    blocks = [b for b in _blocks() if b.startswith(RANK_BLOCK)]
    assert len(blocks) == 3, "the Distributed section has a DDP, a context-parallel and a tensor-parallel example"
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port to race for
    try:
        for i, block in enumerate(blocks):
            scope: dict = {}
            exec(RANK_PRELUDE, scope)
            before = set(rope_hf.patched_families())
            try:
                with RopeOpSpy() as spy:
                    exec(compile(block, f"README distributed example {i}", "exec"), scope)
            finally:  # an example's own patch() stays its own
                rope_hf.unpatch(sorted(set(rope_hf.patched_families()) - before))
            if "DistributedDataParallel" in block:
                assert isinstance(scope["model"], torch.nn.parallel.DistributedDataParallel)
            elif "offset=start" in block:
                assert spy.names == ["rotary_pos_qk"]
            else:
                assert torch.isfinite(scope["loss"])
                assert spy.calls and all(type(args[0]).__name__ == "DTensor" for _, args in spy.calls)
    finally:
        dist.destroy_process_group()


def test_quick_start_runs_and_matches_reference():
    scope: dict = {}
    exec(compile(_blocks()[0], "README quick start", "exec"), scope)
    q, q_rot, cos, sin = scope["q"], scope["q_rot"], scope["cos"], scope["sin"]
    assert q_rot.shape == q.shape and q_rot.dtype == q.dtype and q.grad is not None
    expected = rope_ext.reference.rotary_reference(q.detach().double(), cos.double(), sin.double())
    torch.testing.assert_close(q_rot.detach().double(), expected, atol=1e-5, rtol=2**-8)
