"""Patching and unpatching take effect in models torch.compile has already compiled.

Dynamo guards the globals a graph reads but not the code of the methods it inlines, so a method
rewrite (timm's EVA attention, diffusers' Cosmos 3 and Ideogram 4 statements, the QK-norm fusions)
was invisible to a model compiled before ``patch()``, and a model compiled while patched kept the
rewrite after ``unpatch()``. The engine's patcher now drops what compile cached on each change."""
from __future__ import annotations

import ast
import importlib.util
import sys
import textwrap

import torch

from rope_ext.integrations import _engine

_SOURCE = """
import torch


def scale(x):
    return x * 2


class Inner(torch.nn.Module):
    def forward(self, x):
        y = x + 1
        return scale(y)


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x) - 1
"""


def _module(tmp_path):
    path = tmp_path / "patch_compile_case.py"
    path.write_text(textwrap.dedent(_SOURCE))
    spec = importlib.util.spec_from_file_location("patch_compile_case", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module, ast.parse(path.read_text())


def _rewrite(stmts, holder):
    for i, stmt in enumerate(stmts):
        if ast.unparse(stmt) == "y = x + 1":
            stmts[i] = _engine.located(ast.parse(f"y = {holder}(x)").body, stmt)[0]


def _plans(module, tree, patcher):
    node = dict(_engine.function_defs(tree))["Inner.forward"]
    return {
        "method rewrite": _engine.method_rewrite_plan("m", module, "Inner.forward", node, _engine.per_block(_rewrite),
                                                      lambda x: x + 100, patcher),
        "module function": [("m", module, "scale", lambda x: x * 3)],
    }


def test_patch_and_unpatch_reach_compiled_models(tmp_path):
    module, tree = _module(tmp_path)
    x = torch.zeros(3)
    stock = {"method rewrite": 1.0, "module function": 1.0}
    patched = {"method rewrite": 199.0, "module function": 2.0}
    for kind in stock:
        patcher = _engine.Patcher()
        before = torch.compile(module.Outer(), backend="eager", fullgraph=True)
        assert before(x)[0].item() == stock[kind]
        patcher.apply(_plans(module, tree, patcher)[kind], undo=None)
        try:
            during = torch.compile(module.Outer(), backend="eager", fullgraph=True)
            # compiled before the patch: runs the patched code now
            assert before(x)[0].item() == patched[kind], kind
            assert during(x)[0].item() == patched[kind], kind
        finally:
            patcher.restore()
        # compiled while patched: back to the stock code
        assert during(x)[0].item() == stock[kind], kind
        assert before(x)[0].item() == stock[kind], kind


def test_the_rewrite_is_missed_without_the_reset(tmp_path, monkeypatch):
    """The failure the reset prevents, shown: without it a compiled model keeps its stock graph."""
    module, tree = _module(tmp_path)
    monkeypatch.setattr(_engine, "forget_compiled", lambda: None)
    torch.compiler.reset()
    x = torch.zeros(3)
    compiled = torch.compile(module.Outer(), backend="eager", fullgraph=True)
    assert compiled(x)[0].item() == 1.0
    patcher = _engine.Patcher()
    patcher.apply(_plans(module, tree, patcher)["method rewrite"], undo=None)
    try:
        assert module.Outer()(x)[0].item() == 199.0  # eager sees the rewrite
        assert compiled(x)[0].item() == 1.0  # the compiled model does not
    finally:
        patcher.restore()
        torch.compiler.reset()
