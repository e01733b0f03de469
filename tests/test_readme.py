"""The README's and docs/'s Python examples run as written and do what they say, and their links
point at files in the repository."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import rope_ext

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(page: Path = README):
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)


RANK_BLOCK = "# on each rank, after torch.distributed.init_process_group\n"

# What a distributed block takes as given, here for a one-process gloo group (rank 0 of 1): the names
# docs/distributed.md's examples use (its first paragraph lists them).
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


# docs/integrations.md's "Use with timm" example needs timm, which needs torchvision and so torch 2.14.1: it runs in
# tests/test_timm_integration.py (cuda-check's venv).
TIMM_BLOCK = "from rope_ext.integrations import timm as rope_timm\n"


# The pages with Python examples; the others (C++, benchmarks, contributing) have none to run, and the
# development log's measurement scripts are records of what was run (fenced as `py`, not `python`).
RUNNABLE = ["README.md", "api.md", "distributed.md", "drop-ins.md", "integrations.md"]


def test_the_pages_with_examples_are_the_expected_ones():
    assert sorted(p.name for p in PAGES if _blocks(p)) == sorted(RUNNABLE)
    for page in PAGES:  # a Python block fenced otherwise would go untested
        fences = set(re.findall(r"^```(\S+)$", page.read_text(), re.M))
        assert not fences & {"py", "python3", "pycon", "ipython"} or page.name == "devlog.md", (page.name, fences)


@pytest.mark.parametrize("page", [p for p in PAGES if p.name in RUNNABLE], ids=lambda p: p.name)
def test_every_example_runs(page):
    """Each page's examples run in order in one namespace, as a reader would paste them (the
    distributed ones apart: test_distributed_examples_run; timm's: tests/test_timm_integration.py)."""
    blocks = [b for b in _blocks(page) if not b.startswith(RANK_BLOCK) and TIMM_BLOCK not in b]
    assert blocks or page.name == "distributed.md", f"{page.name} lost its examples"
    scope: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{page.name} example {i}", "exec"), scope)


def test_the_readme_answers_on_one_screen():
    """At most 200 lines, with install, the one-line switch and the speed among its first sections."""
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    sections = re.findall(r"^## (.*)$", text, re.M)
    assert sections[:3] == ["Install", "Use with transformers, diffusers and timm", "Performance"], sections


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_point_into_the_repository(page):
    """Every relative link of a page names a file of this repository (and a heading of it, where it
    names one); no path leads outside it."""
    for target in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
        path, anchor = target
        if path.startswith(("http://", "https://")):
            continue
        resolved = (page.parent / path).resolve() if path else page
        assert ROOT in resolved.parents and resolved.is_file(), (page.name, path)
        if anchor:  # (the headings outside code blocks, where '#' starts comments)
            prose = re.sub(r"^```.*?^```", "", resolved.read_text(), flags=re.M | re.S)
            headings = re.findall(r"^#+ (.*)$", prose, re.M)
            slugs = {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, (page.name, path, anchor)
    assert "../shared" not in page.read_text(), page.name


def test_distributed_examples_run():
    """Each distributed example runs on rank 0 of a one-process gloo group, from a fresh prelude
    (tests/test_distributed.py and tests/test_dtensor.py run the same calls on 2 processes), and the
    rope_ext calls in it see what the example says: DTensors for the tensor-parallel one."""
    import torch.distributed as dist
    from conftest import RopeOpSpy

    from rope_ext.integrations import transformers as rope_hf

    pytest.importorskip("transformers")
    blocks = [b for b in _blocks(ROOT / "docs" / "distributed.md") if b.startswith(RANK_BLOCK)]
    assert len(blocks) == 3, "docs/distributed.md has a DDP, a context-parallel and a tensor-parallel example"
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port to race for
    try:
        for i, block in enumerate(blocks):
            scope: dict = {}
            exec(RANK_PRELUDE, scope)
            before = set(rope_hf.patched_families())
            try:
                with RopeOpSpy() as spy:
                    exec(compile(block, f"docs/distributed.md example {i}", "exec"), scope)
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


def test_tables_by_hand_run_and_match_reference():
    """docs/api.md's first example: tables built by hand, the op, autograd."""
    scope: dict = {}
    exec(compile(_blocks(ROOT / "docs" / "api.md")[0], "docs/api.md example 0", "exec"), scope)
    q, q_rot, cos, sin = scope["q"], scope["q_rot"], scope["cos"], scope["sin"]
    assert q_rot.shape == q.shape and q_rot.dtype == q.dtype and q.grad is not None
    expected = rope_ext.reference.rotary_reference(q.detach().double(), cos.double(), sin.double())
    torch.testing.assert_close(q_rot.detach().double(), expected, atol=1e-5, rtol=2**-8)
