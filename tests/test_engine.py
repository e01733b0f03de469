"""The form engine's pure-Python part (rope_ext/integrations/_engine.py): fingerprints, method
rewrites, trampolines, the sources registered for generated code, and the patcher.

It needs neither torch nor a build: the file is loaded on its own, so that `make engine-pythons`
runs these tests under each Python rope_ext supports (3.10 and 3.13 beside the suite's 3.11), as
a plain script (`python tests/test_engine.py`) where pytest is not installed. The engine reads
CPython's code objects, whose layout changes between versions; these tests are what holds it there.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import linecache
import pathlib
import sys
import tempfile
import textwrap
import traceback

ENGINE_PATH = pathlib.Path(__file__).resolve().parent.parent / "rope_ext" / "integrations" / "_engine.py"


def _load_engine():
    spec = importlib.util.spec_from_file_location("_rope_ext_engine_alone", ENGINE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


engine = _load_engine()


def _module_from(tmp_path, name: str, source: str):
    """A module imported from a file written in tmp_path (as a library's model file is)."""
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module, ast.parse(path.read_text(), filename=str(path))


# --- fingerprints ---------------------------------------------------------------------------------


def _key(source: str, name: str = "f") -> str:
    tree = ast.parse(textwrap.dedent(source))
    return engine.fingerprint(engine.module_definitions(tree), name)


def test_fingerprint_ignores_docstrings_comments_and_annotations():
    plain = _key("def f(x):\n    return g(x) * 2\ndef g(x):\n    return -x\n")
    dressed = _key('def f(x: "T") -> "T":\n    """doc"""\n    return g(x) * 2  # c\ndef g(x):\n    return -x\n')
    assert plain == dressed


def test_fingerprint_follows_helpers_and_module_values():
    """A helper's body and a module-level value the function reads are part of its fingerprint;
    before, a value was hashed by name only."""
    base = _key("SCALE = 2\ndef f(x):\n    return g(x) * SCALE\ndef g(x):\n    return -x\n")
    assert base != _key("SCALE = 3\ndef f(x):\n    return g(x) * SCALE\ndef g(x):\n    return -x\n")
    assert base != _key("SCALE = 2\ndef f(x):\n    return g(x) * SCALE\ndef g(x):\n    return x\n")
    # a value reassigned later in the file counts too; an unrelated one does not
    assert base != _key("SCALE = 2\nSCALE = 4\ndef f(x):\n    return g(x) * SCALE\ndef g(x):\n    return -x\n")
    assert base == _key("SCALE = 2\nOTHER = 5\ndef f(x):\n    return g(x) * SCALE\ndef g(x):\n    return -x\n")
    # a value naming a helper follows it
    via = "def f(x):\n    return ROT(x)\nROT = g\ndef g(x):\n    return {}\n"
    assert _key(via.format("-x")) != _key(via.format("x"))


# --- method rewrites ------------------------------------------------------------------------------

_CLASS = """
    class Base:
        def forward(self, x):
            return x


    class Attn(Base):
        __private = 10

        def forward(self, x):
            scale = (lambda v: v * 1)(self.__private)        # a lambda, and a name the class mangles
            squares = [i * i for i in range(3)]                 # a comprehension
            def inner(v):                                       # an inner def
                return v + 1
            y = super().forward(x)                              # super()
            y = y * scale + inner(sum(squares))
            return y
"""


def _rewrite_y(stmts, holder):
    """`y = y * scale + inner(sum(squares))` -> `y = <holder>(y, scale)`."""
    for i, stmt in enumerate(stmts):
        if isinstance(stmt, ast.Assign) and ast.unparse(stmt) == "y = y * scale + inner(sum(squares))":
            stmts[i] = engine.located(ast.parse(f"y = {holder}(y, scale)").body, stmt)[0]


def _attn(tmp_path):
    module, tree = _module_from(tmp_path, "engine_case_attn", _CLASS)
    node = dict(engine.function_defs(tree))["Attn.forward"]
    return module, node


def test_rewrite_of_a_method_with_lambda_comprehension_inner_def_super_and_mangling(tmp_path):
    """Compiled inside its class's block, the method's source matches the running code on every
    Python version (on 3.10 a lambda's qualified name is a constant of the method's code; super()
    needs the class cell; self.__private is mangled by the class), so it is rewritten, not refused."""
    module, node = _attn(tmp_path)
    assert module.Attn().forward(1) == 10 + 6
    patcher = engine.Patcher()
    plan = engine.method_rewrite_plan("attn", module, "Attn.forward", node, engine.per_block(_rewrite_y),
                                      lambda y, s: -y * s, patcher)
    patcher.apply(plan, undo=None)
    try:
        assert module.Attn().forward(3) == -30
    finally:
        patcher.restore()
    assert module.Attn().forward(1) == 16


def test_a_method_changed_since_import_is_refused(tmp_path):
    module, node = _attn(tmp_path)
    changed = ast.parse(textwrap.dedent(_CLASS).replace("v + 1", "v + 2"))
    node = dict(engine.function_defs(changed))["Attn.forward"]
    try:
        engine.method_rewrite_plan("attn", module, "Attn.forward", node, engine.per_block(_rewrite_y), abs,
                                   engine.Patcher())
    except ValueError as e:
        assert "is not the code that runs" in str(e)
    else:
        raise AssertionError("a method whose file changed since import was rewritten")


def _traceback_of(fn, *args) -> list[traceback.FrameSummary]:
    try:
        fn(*args)
    except ZeroDivisionError as e:
        return traceback.extract_tb(e.__traceback__)
    raise AssertionError("no error raised")


def test_a_rewritten_method_shows_the_code_that_runs(tmp_path):
    """Tracebacks and inspect show the rewritten statement, at the line of the one it replaces,
    under a file name that says it is rope_ext's rewrite of that file."""
    module, node = _attn(tmp_path)
    patcher = engine.Patcher()
    patcher.apply(engine.method_rewrite_plan("attn", module, "Attn.forward", node, engine.per_block(_rewrite_y),
                                             lambda y, s: y / 0, patcher), undo=None)
    try:
        frame = _traceback_of(module.Attn().forward, 1)[1]
        assert frame.filename == f"<rope_ext rewrite: {module.__file__}>"
        line = next(i + 1 for i, t in enumerate(linecache.getlines(module.__file__)) if "inner(sum(squares))" in t)
        assert frame.lineno == line and "_rope_ext_Attn_forward(y, scale)" in frame.line
        source = inspect.getsource(module.Attn.forward)
        assert "y = _rope_ext_Attn_forward(y, scale)  # rope_ext" in source and "inner(sum(squares))" not in source
        assert "def inner(v):" in source  # the rest as the file has it
    finally:
        patcher.restore()
    assert module.Attn.forward.__code__.co_filename == module.__file__


def test_a_trampoline_shows_its_source(tmp_path):
    module, _ = _module_from(tmp_path, "engine_case_processor", """
        class Processor:
            def __call__(self, x):
                def apply_rope(v, scale):
                    return v * scale
                return apply_rope(x, 2)
    """)

    def replacement(v, scale):
        return v / 0

    patcher = engine.Patcher()
    patcher.apply(engine.trampoline_plan("proc", module, module.Processor.__call__, "apply_rope", replacement,
                                         patcher), undo=None)
    try:
        frames = _traceback_of(module.Processor(), 1)
        trampoline = frames[2]
        assert trampoline.filename == "<rope_ext trampoline: engine_case_processor.Processor.__call__.apply_rope>"
        assert trampoline.line == "return _rope_ext_Processor___call___apply_rope(*args, **kwargs)"
        assert frames[3].name == "replacement"
    finally:
        patcher.restore()
    assert module.Processor()(1) == 2


# --- the patcher ----------------------------------------------------------------------------------


def test_patcher_restores_in_reverse_and_keeps_an_outer_patch():
    target = type("Target", (), {"a": 1})
    patcher = engine.Patcher()
    first = patcher.apply([("g1", target, "a", 2), ("g1", target, "b", 3)], undo=None)
    assert first == ["g1"] and (target.a, target.b) == (2, 3)
    inner = patcher.apply([("g1", target, "a", 4)], undo=None)
    assert inner == [] and target.a == 4  # g1 stays with the first call
    assert patcher.restore(["g1"]) == ["g1"]
    assert target.a == 1 and not hasattr(target, "b")
    assert patcher.restore() == []


def test_refused_names_warn_once_or_raise_when_strict():
    import warnings

    refused = {"fam_a": "its code (fingerprint 0123) matches no form"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine.patchable_or_warn("lib-test", refused, ["fam_b"], strict=False) == ["fam_b"]
        engine.patchable_or_warn("lib-test", refused, ["fam_b"], strict=False)
    assert len(caught) == 1 and issubclass(caught[0].category, engine.RefusedWarning)
    assert "fam_a: its code (fingerprint 0123)" in str(caught[0].message)
    try:
        engine.patchable_or_warn("lib-test", refused, ["fam_b"], strict=True)
    except ValueError as e:
        assert "fam_a" in str(e) and "nothing was patched" in str(e)
    else:
        raise AssertionError("strict=True did not raise")
    assert engine.patchable_or_warn("lib-test", {}, ["fam_b"], strict=True) == ["fam_b"]


def test_engine_imports_no_torch():
    """The engine stays pure Python, so that these tests run under any Python without a build."""
    tree = ast.parse(ENGINE_PATH.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"torch", "rope_ext"}, imported


if __name__ == "__main__":  # without pytest: every test, each in a fresh folder
    tests = [(n, f) for n, f in list(globals().items()) if n.startswith("test_") and callable(f)]
    for name, test in tests:
        with tempfile.TemporaryDirectory() as folder:
            args = [pathlib.Path(folder)] if "tmp_path" in inspect.signature(test).parameters else []
            test(*args)
        print(f"ok  {name}")
    print(f"{len(tests)} engine tests passed under Python {sys.version.split()[0]}")
