"""The form engine's pure-Python part (rope_ext/integrations/_engine.py): fingerprints, method
rewrites, trampolines, the sources registered for generated code, and the patcher.

It needs neither torch nor a build: the file is loaded on its own, so that `make engine-pythons`
runs these tests under each Python rope_ext supports (3.10 and 3.13 beside the suite's 3.11), as
a plain script (`python tests/test_engine.py`) where pytest is not installed. The engine reads
CPython's code objects, whose layout changes between versions; these tests are what holds it there.
"""
from __future__ import annotations

import ast
import functools
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


_DECORATED = """
import functools

def renames(old, new):  # transformers 5.24's @deprecate_kwarg, in short: a functools.wraps wrapper
    def wrapper(func):
        @functools.wraps(func)
        def wrapped(*args, **kwargs):
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return func(*args, **kwargs)
        return wrapped
    return wrapper

class Attn:
    @renames("v", "y")
    def forward(self, y, scale=10):
        squares = [i * i for i in range(3)]
        inner = lambda t: t - 5
        y = y * scale + inner(sum(squares))
        return y
"""


def _rewrite(module, node, patcher=None):
    patcher = patcher or engine.Patcher()
    return patcher, engine.method_rewrite_plan("attn", module, "Attn.forward", node, engine.per_block(_rewrite_y),
                                               lambda y, s: -y * s, patcher)


def _refused(module, node, words: str):
    try:
        _rewrite(module, node)
    except ValueError as e:
        assert words in str(e), str(e)
    else:
        raise AssertionError(f"rewritten, not refused ({words})")


def test_a_decorated_method_is_rewritten_beneath_its_wrapper(tmp_path):
    """The class attribute is the decorator's wrapper; the file's function is its __wrapped__,
    which the wrapper calls: its code is rewritten, and the wrapper still runs around it."""
    module, tree = _module_from(tmp_path, "engine_case_decorated", _DECORATED)
    node = dict(engine.function_defs(tree))["Attn.forward"]
    wrapper = module.Attn.forward
    patcher, plan = _rewrite(module, node)
    assert [(obj, attr) for _, obj, attr, _ in plan][1] == (wrapper.__wrapped__, "__code__")
    patcher.apply(plan, undo=None)
    try:
        assert module.Attn.forward is wrapper
        assert module.Attn().forward(3) == -30 and module.Attn().forward(v=3) == -30  # the wrapper renames v
    finally:
        patcher.restore()
    assert module.Attn().forward(v=1) == 10


def test_wrappers_that_are_not_exact_are_refused_by_name(tmp_path):
    module, tree = _module_from(tmp_path, "engine_case_wrapped", _DECORATED)
    node = dict(engine.function_defs(tree))["Attn.forward"]
    wrapper = module.Attn.forward
    # a wrapper naming the file's function as __wrapped__ but calling a copy of it
    copy_of = type(wrapper.__wrapped__)(wrapper.__wrapped__.__code__, module.__dict__)

    def calls_a_copy(*args, **kwargs):
        return copy_of(*args, **kwargs)

    calls_a_copy.__wrapped__ = wrapper.__wrapped__
    module.Attn.forward = calls_a_copy
    _refused(module, node, "does not hold the function it names as __wrapped__")
    # one more wrapper than the file writes decorators (someone else's)
    module.Attn.forward = functools.wraps(wrapper)(lambda *a, **k: wrapper(*a, **k))
    _refused(module, node, "is wrapped 2 times, and its file writes 1 decorators on it")
    module.Attn.forward = lambda self, y: y
    _refused(module, node, "is not the method its file defines")


def test_import_watch_runs_after_the_module_and_only_for_names_it_wants(tmp_path):
    (tmp_path / "watched_pkg").mkdir()
    (tmp_path / "watched_pkg" / "__init__.py").write_text("")
    for name in ("mod_a", "mod_b", "mod_c"):
        (tmp_path / "watched_pkg" / f"{name}.py").write_text(f"VALUE = {name!r}\n")
    seen = []

    def callback(module):
        seen.append((module.__name__, module.VALUE))
        if module.__name__.endswith("mod_c"):
            raise RuntimeError("a failing switch")

    watch = engine.ImportWatch(lambda name: name in ("watched_pkg.mod_a", "watched_pkg.mod_c"), callback)
    sys.path.insert(0, str(tmp_path))
    watch.install()
    try:
        import importlib
        import warnings

        importlib.import_module("watched_pkg.mod_a")
        importlib.import_module("watched_pkg.mod_b")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert importlib.import_module("watched_pkg.mod_c").VALUE == "mod_c"  # the import goes on
        assert seen == [("watched_pkg.mod_a", "mod_a"), ("watched_pkg.mod_c", "mod_c")]
        assert len(caught) == 1 and "switching watched_pkg.mod_c failed" in str(caught[0].message)
        del sys.modules["watched_pkg.mod_c"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # -W error: the warning raises, and the import still goes on
            assert importlib.import_module("watched_pkg.mod_c").VALUE == "mod_c"
        assert inspect.getsource(sys.modules["watched_pkg.mod_a"]) == "VALUE = 'mod_a'\n"
    finally:
        watch.remove()
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("watched_pkg")]:
            del sys.modules[name]
    assert watch not in sys.meta_path


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
        engine.refuse("lib-test", refused, strict=False)
        engine.refuse("lib-test", refused, strict=False)  # said once per process
        engine.refuse("lib-test", {**refused, "fam_c": "another reason"}, strict=False)  # the new one alone
    assert len(caught) == 2 and all(issubclass(w.category, engine.RefusedWarning) for w in caught)
    assert "fam_a: its code (fingerprint 0123)" in str(caught[0].message)
    assert "1 RoPE site(s)" in str(caught[1].message) and "fam_c: another reason" in str(caught[1].message)
    try:
        engine.refuse("lib-test", refused, strict=True)
    except ValueError as e:
        assert "fam_a" in str(e) and "nothing was patched" in str(e)
    else:
        raise AssertionError("strict=True did not raise")
    engine.refuse("lib-test", {}, strict=True)


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
