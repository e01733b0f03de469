"""The form engine the integrations share: recognise a library's RoPE functions from their source,
and patch their replacements in and out. Pure Python (no torch import), so that its tests run under
every Python rope_ext supports without a build; the math the replacements share is ``_rotate``.

A *form* (``_rotate.Form``) is what a RoPE function computes: the pairing its rotation uses, how it
reads its tables, which columns it rotates and its dtype rule, plus its calling convention. A
function is recognised by :func:`fingerprint`: a hash of its syntax tree together with the
module-level helpers and values it names (so a file whose ``rotate_half`` pairs differently, or
turns the other way, gets another fingerprint), with docstrings, comments, annotations and neutral
decorators left out. Each integration keeps its own table mapping the fingerprints it has tested to
forms; any other code is refused, never patched on a guess.

- ``_hf_forms``: transformers' model files;
- ``_diffusers_forms``: diffusers' model files and its shared ``apply_rotary_emb``;
- ``_timm_forms``: timm's ``apply_rot_embed*`` and EVA's attention.

Patching (:class:`Patcher`) is a list of attribute assignments per group (a family, a model file),
undone in reverse, each followed by :func:`forget_compiled` so that compiled models see it:

- a module-level function is replaced in its module;
- a function defined inside a method (diffusers' attention processors define theirs in
  ``__call__``) is replaced by swapping its code object, inside the method's code, for a
  trampoline that calls the replacement (:func:`trampoline_plan`), so the rest of the method runs
  exactly as written;
- statements of a method are rewritten (:func:`method_rewrite_plan`), the method recompiled from its
  file's source inside its class's blocks and checked to match the running code first.

Generated code has a source: tracebacks, ``inspect`` and debuggers show the trampoline, or the file's
text with the rewritten statements in place (``<rope_ext rewrite: path>``).
"""

from __future__ import annotations
import __future__

import ast
import copy
import dis
import hashlib
import linecache
import sys
import threading
import types
import warnings

# --- fingerprints ---------------------------------------------------------------------------------

_SKIPPED_FIELDS = frozenset(
    ("ctx", "type_comment", "kind", "returns", "annotation", "type_params", "lineno", "col_offset", "end_lineno",
     "end_col_offset")
)
# Decorators that leave what a function computes alone (transformers' hook for the `kernels`
# package); any other decorator is part of the fingerprint.
_NEUTRAL_DECORATORS = frozenset({"use_kernel_forward_from_hub"})


def _is_neutral(decorator) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Name) and target.id in _NEUTRAL_DECORATORS


def _is_docstring(stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _canonical(node) -> str:
    """The syntax tree as text, without docstrings, annotations, neutral decorators and positions;
    empty fields are left out, so the text is the same across the Python versions rope_ext supports."""
    if isinstance(node, list):
        return "[" + ",".join(_canonical(n) for n in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    parts = [type(node).__name__]
    for field, value in ast.iter_fields(node):
        if field in _SKIPPED_FIELDS:
            continue
        if field == "body" and isinstance(node, (ast.FunctionDef, ast.ClassDef)) and value and _is_docstring(value[0]):
            value = value[1:]
        if field == "decorator_list":
            value = [d for d in value if not _is_neutral(d)]
        text = _canonical(value)
        if text not in ("[]", "None"):
            parts.append(f"{field}={text}")
    return "(" + " ".join(parts) + ")"


def module_definitions(tree: ast.Module) -> dict:
    """What a module's top level binds, by name, for :func:`fingerprint`: each function's
    ``def`` node, and for a name given a value there (``SCALE = 2.0``, ``_ROT = rotate_half``) the
    list of its assignments."""
    out: dict = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for name in {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}:
                previous = out.get(name)
                out[name] = (previous if isinstance(previous, list) else []) + [node]
    return out


def fingerprint(definitions: dict, node: ast.FunctionDef | str) -> str:
    """A short hash of a function (``node``, or ``definitions[node]`` for a name) and, recursively,
    of the module-level functions and values it names (``definitions``: the module's, from
    :func:`module_definitions`). A name the module imports is hashed by name: its own file is
    another module's business."""
    name = node if isinstance(node, str) else node.name
    seen: set[str] = set()

    def text(fn_name, fn):
        seen.add(fn_name)
        out = _canonical(fn)
        nodes = fn if isinstance(fn, list) else [fn]
        named = {n.id for part in nodes for n in ast.walk(part) if isinstance(n, ast.Name) and n.id in definitions}
        for helper in sorted(named - seen):
            if helper not in seen:
                out += f"|{helper}:" + text(helper, definitions[helper])
        return out

    return hashlib.sha256(text(name, definitions[node] if isinstance(node, str) else node).encode()).hexdigest()[:16]


def refusal(key: str, what: str = "its code") -> str:
    """Why code whose fingerprint is ``key`` is not patched."""
    return (f"{what} (fingerprint {key}) matches no form rope_ext is tested on; "
            "patching it on a guess could change the model's results")


def function_defs(tree: ast.Module):
    """Every function a module defines, as (qualified name, node): module-level functions, methods
    (``Class.method``) and functions defined inside them (``Class.method.inner``)."""

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                qualname = prefix + child.name
                if isinstance(child, ast.FunctionDef):
                    yield qualname, child
                yield from walk(child, qualname + ".")
            else:  # a def inside an if, with or try block belongs to the enclosing function
                yield from walk(child, prefix)

    yield from walk(tree, "")


# --- patching -------------------------------------------------------------------------------------

_MISSING = object()


class Patched(list):
    """The groups a ``patch`` call switched; as a context manager, unpatches them on exit."""

    def __init__(self, groups=(), undo=None):
        super().__init__(groups)
        self._undo = undo

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._undo(self)
        return False


# Module globals the engine adds for trampolines and rewritten methods to call: they stay after an
# unpatch, so a call already running in patched code when another thread unpatches still finds them.
HOLDER_PREFIX = "_rope_ext_"


def forget_compiled():
    """Drop what torch.compile has cached, so that compiled models trace the code as patched now.

    Dynamo guards the globals a graph reads (a replaced module-level function is seen), but not the
    code of the methods it inlines: a model compiled before a method's code was rewritten would keep
    its stock graph, and one compiled while patched would keep running rope_ext after an unpatch.
    ``torch.compiler.reset()`` makes every compiled model trace again on its next call (a recompile,
    once per patch or unpatch, never a wrong graph). Without torch imported nothing was compiled."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "compiler"):
        torch.compiler.reset()


class Patcher:
    """The assignments an integration made, by group (a family or model file), so that each can be
    undone. A group patched by an earlier call stays with that call: nesting a ``with patch(...)``
    inside a longer patch leaves the outer one in place."""

    def __init__(self):
        self._lock = threading.Lock()
        self._originals: dict[str, list[tuple[object, str, object]]] = {}

    def original(self, group: str, obj, attr: str, default=_MISSING):
        """What obj.attr held before this patcher changed it (its current value if unchanged)."""
        for o, a, value in self._originals.get(group, ()):
            if o is obj and a == attr:
                return value
        return getattr(obj, attr, default)

    def apply(self, plan, undo, forget: bool = True) -> Patched:
        """Make each ``(group, obj, attr, value)`` assignment of plan, remembering what was there.
        Returns the groups switched by this call, which ``undo`` (the integration's unpatch) restores.
        ``forget=False`` skips :func:`forget_compiled`: for code no compiled graph can hold yet (a
        module patched as it is imported)."""
        done = Patched(undo=undo)
        with self._lock:
            already = set(self._originals)
            for group, obj, attr, value in plan:
                entries = self._originals.setdefault(group, [])
                if all(o is not obj or a != attr for o, a, _ in entries):
                    entries.append((obj, attr, getattr(obj, attr, _MISSING)))
                setattr(obj, attr, value)
                if group not in done and group not in already:
                    done.append(group)
        if plan and forget:
            forget_compiled()
        return done

    def restore(self, groups=None) -> list[str]:
        """Undo the assignments of the given groups (default: all), latest first."""
        with self._lock:
            named = list(self._originals) if groups is None else groups
            restored = [g for g in named if g in self._originals]
            for group in restored:
                for obj, attr, original in reversed(self._originals.pop(group)):
                    if original is not _MISSING:
                        setattr(obj, attr, original)
                    elif not attr.startswith(HOLDER_PREFIX):
                        delattr(obj, attr)
        if restored:
            forget_compiled()
        return restored

    def forget(self, group: str, owned) -> None:
        """Drop, without restoring, what the group changed of the objects ``owned(obj)`` accepts: a
        module run again (``importlib.reload``) holds new objects, the library's own, and restoring
        the old ones would put back code its file no longer has."""
        with self._lock:
            entries = [e for e in self._originals.get(group, ()) if not owned(e[0])]
            if group in self._originals:
                self._originals[group] = entries

    def groups(self) -> list[str]:
        return list(self._originals)


class RefusedWarning(UserWarning):
    """Some of a library's RoPE code keeps running as written: a ``patch()`` skipped the code whose
    fingerprint matches no tested form (most often: the library changed it), or code it could not
    rewrite or install."""


_warned: set = set()


def failure(e: Exception) -> str:
    """An exception as a refusal's reason: a ValueError's message (rope_ext's own refusals), any
    other with its type (a library's code rope_ext failed to read)."""
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


def refusal_text(library: str, refused: dict[str, str]) -> str:
    listed = "; ".join(f"{name}: {why}" for name, why in refused.items())
    return f"rope_ext: {len(refused)} RoPE site(s) of the installed {library} keep their own code: {listed}"


def refuse(library: str, refused: dict[str, str], strict: bool, stacklevel: int = 3) -> None:
    """Say that the code ``refused`` names (name -> why) keeps the library's own: with ``strict`` a
    ValueError, before anything is patched; otherwise a :class:`RefusedWarning` naming those not
    named before in this process with the same reason."""
    if strict and refused:
        raise ValueError(refusal_text(library, refused) + " (strict=True: nothing was patched)")
    new = {name: why for name, why in refused.items() if (library, name, why) not in _warned}
    if new:
        _warned.update((library, name, why) for name, why in new.items())
        warnings.warn(refusal_text(library, new) + " (patch(strict=True) makes this an error)", RefusedWarning,
                      stacklevel=stacklevel + 1)


class ImportWatch:
    """A ``sys.meta_path`` finder that calls ``callback(module)`` right after each module whose
    name ``wanted(name)`` accepts has run its code, before the import statement returns: patching
    there is patching a module nothing has used yet. Other imports pass through at the cost of one
    call of ``wanted``. A failing callback is turned into a warning: an import never fails
    because of rope_ext."""

    def __init__(self, wanted, callback):
        self._wanted = wanted
        self._callback = callback

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        while self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, name, path, target=None):
        if not self._wanted(name):
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AfterExec(spec.loader, self._after)
                return spec
        return None

    def _after(self, module) -> None:
        try:
            self._callback(module)
        except Warning:  # the callback's own warning, made an error by the warnings filters (-W error):
            pass  # it changed nothing before it warned; the import goes on
        except Exception as e:  # noqa: BLE001  (the user's import goes on, with the library's own code)
            try:
                warnings.warn(f"rope_ext: switching {module.__name__} failed and it keeps its own code: "
                              f"{type(e).__name__}: {e}", RefusedWarning, stacklevel=2)
            except Warning:
                pass


class _AfterExec:
    """A module loader that runs the module, then ``after(module)``; the rest of the loader's
    interface (``get_source``, resources) is the wrapped loader's."""

    def __init__(self, loader, after):
        self._loader = loader
        self._after = after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_loader", "_after"):
            raise AttributeError(name)
        return getattr(self._loader, name)


def group_names(groups, what: str) -> list[str]:
    """A name or an iterable of names, as a list of str."""
    if isinstance(groups, str):
        return [groups]
    if isinstance(groups, (list, tuple, set, frozenset)) and all(isinstance(g, str) for g in groups):
        return list(groups)
    raise TypeError(f"rope_ext: {what} must be a name, a list of them or None, got {type(groups).__name__}")


def defined_here(obj, module, name) -> bool:
    """Whether obj is the function the module's file defines under name: the plain function, or
    the ``nn.Module`` transformers' ``kernels`` hook wraps it in (its forward closes over it)."""
    fn = obj
    if not hasattr(fn, "__code__"):
        forward = getattr(type(obj), "forward", None)
        cells = getattr(forward, "__closure__", None) or ()
        fn = next((c.cell_contents for c in cells if getattr(c.cell_contents, "__name__", None) == name), None)
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_name == name and code.co_filename == module.__file__


def resolve(module, qualname: str):
    """The object at a dotted path in module (``Class.method``), or None."""
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if not isinstance(obj, dict) else obj.get(part)
        if obj is None:
            return None
    return obj


def inner_code(method, name: str):
    """The code object of the function ``name`` that method's body (a function or its code)
    defines, or None."""
    code = method if isinstance(method, types.CodeType) else getattr(method, "__code__", None)
    found = [c for c in (code.co_consts if code else ()) if isinstance(c, types.CodeType) and c.co_name == name]
    return found[0] if len(found) == 1 else None


def register_source(filename: str, lines: list[str]):
    """Make ``lines`` the source of code compiled under ``filename`` for tracebacks, ``inspect`` and
    debuggers (linecache keeps an entry with no file time until the process ends)."""
    linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


def trampoline_plan(group: str, module, method, name: str, replacement, patcher: Patcher):
    """The assignments that make ``method``'s inner function ``name`` call ``replacement``: a module
    global holding the replacement, and method's code with the inner function's code object swapped
    for a trampoline's (``def name(*args, **kwargs): return <global>(*args, **kwargs)``), whose
    source is registered as ``<rope_ext trampoline: module.Class.method.name>``. Everything else in
    the method's code stays as written. Raises ValueError where the inner function closes over the
    method's variables (a trampoline could not stand in for it)."""
    original = patcher.original(group, method, "__code__")
    inner = inner_code(original, name)
    if inner is None:
        raise ValueError(f"{method.__qualname__} defines no single inner function {name!r}")
    if inner.co_freevars:
        raise ValueError(f"{method.__qualname__}.{name} closes over {inner.co_freevars}")
    holder = f"{HOLDER_PREFIX}{method.__qualname__.replace('.', '_')}_{name}"
    filename = f"<rope_ext trampoline: {module.__name__}.{method.__qualname__}.{name}>"
    lines = [f"# rope_ext: {name} as {original.co_filename} defines it (line {inner.co_firstlineno}) is replaced;\n",
             f"# calls go to rope_ext's {replacement.__module__}.{replacement.__qualname__}\n",
             f"def {name}(*args, **kwargs):\n",
             f"    return {holder}(*args, **kwargs)\n"]
    namespace: dict = {}
    exec(compile("".join(lines), filename, "exec"), namespace)
    register_source(filename, lines)
    code = namespace[name].__code__
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=inner.co_qualname)
    return [(group, module, holder, replacement), (group, method, "__code__", with_inner(original, name, code))]


def with_inner(code: types.CodeType, name: str, inner: types.CodeType) -> types.CodeType:
    """code with the code object of its inner function ``name`` swapped for inner."""
    old = inner_code(code, name)
    return code.replace(co_consts=tuple(inner if c is old else c for c in code.co_consts))


def rewrite_method(node: ast.FunctionDef, qualname: str, filename: str, original: types.CodeType,
                   rewrite) -> types.CodeType:
    """The code of a method (``node``, as its file ``filename`` defines it, ``qualname`` its
    ``Class.method``) with some of its statements rewritten and everything else as written, line
    numbers included. ``rewrite(fn)`` edits a copy of node in place (:func:`per_block` makes one
    from an edit of each statement list); the new statements take the positions of the ones they
    replace (:func:`located`). The code's file is ``<rope_ext rewrite: filename>``, registered as the file's
    text with the rewritten statements in place of the originals, so tracebacks show what runs.

    The method is compiled inside its class's ``class`` blocks, so that ``super()``, names mangled
    by the class (``self.__x``) and the qualified names of lambdas and inner functions come out as
    in the file. Raises ValueError where the source, compiled so, is not the code that runs now
    (``original``: the file changed since it was imported), or where the rewrite would close over
    other variables than the original."""
    classes = qualname.split(".")[:-1]

    def compiled(fn, name):
        fn.decorator_list = []
        body: list = [fn]
        for cls in reversed(classes):
            body = [ast.ClassDef(name=cls, bases=[], keywords=[], body=body, decorator_list=[],
                                 **({"type_params": []} if "type_params" in ast.ClassDef._fields else {}))]
        module = ast.Module(body=body, type_ignores=[])
        ast.fix_missing_locations(module)
        flags = original.co_flags & __future__.annotations.compiler_flag  # the file's own future import
        code = compile(module, name, "exec", flags=flags, dont_inherit=True)
        for part in classes + [node.name]:
            code = next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == part)
        return code

    baseline = compiled(copy.deepcopy(node), filename)
    if _instructions(baseline) != _instructions(original) or (baseline.co_names, baseline.co_freevars) != (
            original.co_names, original.co_freevars):
        raise ValueError(f"{qualname}'s source, compiled, is not the code that runs "
                         "(the file changed since it was imported?)")
    fn = copy.deepcopy(node)
    before = {id(n) for n in ast.walk(fn)}
    rewrite(fn)
    new = [n for n in ast.walk(fn) if isinstance(n, ast.stmt) and id(n) not in before]
    rewritten = f"<rope_ext rewrite: {filename}>"
    code = compiled(fn, rewritten)
    if code.co_freevars != original.co_freevars:
        raise ValueError(f"{qualname}'s code closes over {original.co_freevars}; a rewrite cannot keep them")
    _REWRITTEN.setdefault(filename, {})[qualname] = new
    register_source(rewritten, _rewritten_lines(linecache.getlines(filename),
                                                [s for stmts in _REWRITTEN[filename].values() for s in stmts]))
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=original.co_qualname)
    return code


# file -> method -> the statements a rewrite put in it: one registered source per file shows them all
_REWRITTEN: dict[str, dict[str, list]] = {}


def per_block(rewrite_block):
    """A rewrite for :func:`method_rewrite_plan` that calls ``rewrite_block(stmts, holder)`` on each
    statement list of the method (every body, ``else`` and ``finally`` block), which it may edit in
    place."""
    return lambda fn, holder: rewrite_each_block(fn, lambda stmts: rewrite_block(stmts, holder))


def rewrite_each_block(fn: ast.FunctionDef, rewrite_block):
    """Call ``rewrite_block(stmts)`` on each statement list of fn (every body, ``else`` and
    ``finally`` block), which it may edit in place."""
    for parent in list(ast.walk(fn)):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(parent, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                rewrite_block(stmts)


def _rewritten_lines(lines: list[str], new: list[ast.stmt]) -> list[str]:
    """A file's lines with the new statements (placed by :func:`located`) written in place of the
    ones they replace, at the same line numbers (later lines of a replaced statement left blank)."""
    lines = list(lines)
    at: dict[int, list[ast.stmt]] = {}
    outermost = [s for s in new if not any(s is not o and s in ast.walk(o) for o in new)]
    for stmt in outermost:
        at.setdefault(stmt.lineno, []).append(stmt)
    for lineno, stmts in sorted(at.items()):
        end = max(s.end_lineno or s.lineno for s in stmts)
        indent = " " * stmts[0].col_offset
        text = indent + "; ".join(ast.unparse(s).replace("\n", "\n" + indent) for s in stmts)
        lines[lineno - 1:end] = [text + "  # rope_ext\n"] + ["\n"] * (end - lineno)
    return lines


def _instructions(code: types.CodeType):
    """code's instructions as what they do: jump targets left out, and the forms the compiler picks
    for one and the same step by the route it compiled (a method call's LOAD_METHOD or LOAD_ATTR in
    3.11) made one."""
    skip = {"CACHE", "PRECALL", "EXTENDED_ARG", "NOP"}

    def arg(i):
        if "JUMP" in i.opname or i.opcode in dis.hasjrel or i.opcode in dis.hasjabs:  # FOR_ITER, SEND too
            return None
        return _instructions(i.argval) if isinstance(i.argval, types.CodeType) else repr(i.argval)

    return [("LOAD_ATTR" if i.opname == "LOAD_METHOD" else i.opname, arg(i))
            for i in dis.get_instructions(code) if i.opname not in skip]


def method_rewrite_plan(group: str, module, qualname: str, node: ast.FunctionDef, rewrite, replacement,
                        patcher: Patcher):
    """The assignments that rewrite a method (``Class.method`` of module, ``node`` as its file
    defines it): ``rewrite(fn, holder)`` edits a copy of node in place (see :func:`rewrite_method`),
    its new statements calling ``replacement`` as the module global ``holder``. Raises ValueError
    where the method found is not the one its file defines."""
    cls_name, method_name = qualname.split(".")
    method = defined_function(getattr(getattr(module, cls_name, None), method_name, None), module, qualname, node,
                              lambda fn: patcher.original(group, fn, "__code__", None))
    original = patcher.original(group, method, "__code__")
    holder = f"{HOLDER_PREFIX}{cls_name}_{method_name}"
    code = rewrite_method(node, qualname, module.__file__, original, lambda fn: rewrite(fn, holder))
    return [(group, module, holder, replacement), (group, method, "__code__", code)]


def defined_function(obj, module, qualname: str, node: ast.FunctionDef,
                     code_of=lambda fn: getattr(fn, "__code__", None)):
    """The function object that runs the code module's file defines as ``qualname`` (``node``):
    ``obj`` itself, or the function beneath the ``functools.wraps`` wrappers the file's decorators
    made of it (transformers 5.24 wraps every attention ``forward`` in ``@deprecate_kwarg``).
    Rewriting that function's code changes what the wrappers run only where each wrapper holds in
    its closure the very function it names as ``__wrapped__`` (so that is what it calls), and
    there are no more wrappers than the file writes decorators (more would be someone else's).
    ``code_of(fn)``: fn's code as its file made it (a patcher's record, where it rewrote it).
    Raises ValueError saying which of these fails."""
    name = qualname.rsplit(".", 1)[-1]
    fn, layers = obj, 0
    while True:
        code = code_of(fn)
        if code is not None and code.co_filename == module.__file__ and code.co_name == name:
            break
        wrapped = getattr(fn, "__wrapped__", None)
        if code is None or wrapped is None:
            raise ValueError(f"{module.__name__}.{qualname} is not the method its file defines "
                             "(was it replaced by another patch?)")
        if not any(_cell_holds(cell, wrapped) for cell in fn.__closure__ or ()):
            raise ValueError(f"{module.__name__}.{qualname} is a wrapper ({code.co_name} of {code.co_filename}) "
                             "that does not hold the function it names as __wrapped__: a rewrite of that "
                             "function might not be what it runs")
        fn, layers = wrapped, layers + 1
    if layers > len(node.decorator_list):
        raise ValueError(f"{module.__name__}.{qualname} is wrapped {layers} times, and its file writes "
                         f"{len(node.decorator_list)} decorators on it (was it wrapped by another patch?)")
    return fn


def _cell_holds(cell, obj) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def located(new_stmts, old: ast.stmt):
    """new_stmts, every node placed at old's position (for tracebacks and line tables)."""
    for stmt in new_stmts:
        for child in ast.walk(stmt):
            ast.copy_location(child, old)
    return new_stmts

# --- listings -------------------------------------------------------------------------------------


def site_text(name: str, form, reason: str | None) -> str:
    """One RoPE function in a listing: its form, or why it is refused."""
    return f"{name}: " + (f"'{form.name}' form ({form.describe()})" if form else reason)


def print_listing(reports: dict, lines) -> int:
    """Print each report (name -> an object with ``patchable``) as its name, ``patched`` or
    ``refused``, and its ``lines(report)``, one per row; returns how many are patchable."""
    width = max((len(n) for n in reports), default=0)
    for name, report in reports.items():
        status = "patched" if report.patchable else "refused"
        for i, line in enumerate(lines(report)):
            print(f"{name if i == 0 else '':<{width}}  {status if i == 0 else '':<7}  {line}")
    return sum(r.patchable for r in reports.values())
