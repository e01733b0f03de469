"""The README's Python examples run as written and do what they say."""
from __future__ import annotations

import re
from pathlib import Path

import torch

import rope_ext

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def test_every_example_runs():
    """The examples run in order in one namespace, as a reader would paste them."""
    blocks = _blocks()
    assert len(blocks) >= 4, "README lost its examples"
    scope: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README example {i}", "exec"), scope)


def test_quick_start_runs_and_matches_reference():
    scope: dict = {}
    exec(compile(_blocks()[0], "README quick start", "exec"), scope)
    q, q_rot, cos, sin = scope["q"], scope["q_rot"], scope["cos"], scope["sin"]
    assert q_rot.shape == q.shape and q_rot.dtype == q.dtype and q.grad is not None
    expected = rope_ext.reference.rotary_reference(q.detach().double(), cos.double(), sin.double())
    torch.testing.assert_close(q_rot.detach().double(), expected, atol=1e-5, rtol=2**-8)
