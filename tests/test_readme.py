"""The README's Python examples run as written and do what they say."""
from __future__ import annotations

import re
from pathlib import Path

import torch

import rope_ext

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quick_start_runs_and_matches_reference():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert blocks, "README has no python example"
    scope: dict = {}
    exec(compile(blocks[0], "README quick start", "exec"), scope)
    q, q_rot, cos, sin = scope["q"], scope["q_rot"], scope["cos"], scope["sin"]
    assert q_rot.shape == q.shape and q_rot.dtype == q.dtype and q.grad is not None
    expected = rope_ext.reference.rotary_reference(q.detach().double(), cos.double(), sin.double())
    torch.testing.assert_close(q_rot.detach().double(), expected, atol=1e-5, rtol=2**-8)
