"""The form engine the integrations share: recognise a library's RoPE functions from their source,
rebuild them on rope_ext's op, and patch them in and out.

A *form* (:class:`Form`) is what a RoPE function computes: the pairing its rotation uses, how it
reads its tables, which columns it rotates and its dtype rule, plus its calling convention (a
``signature`` key that each integration's table of forms maps to a builder). A function is
recognised by :func:`fingerprint`: a hash of its syntax tree together with the module-level helpers
it calls (so a file whose ``rotate_half`` pairs differently, or turns the other way, gets another
fingerprint), with docstrings, comments, annotations and neutral decorators left out. Each
integration keeps its own table mapping the fingerprints it has tested to forms; any other code is
refused, never patched on a guess.

- ``_hf_forms``: transformers' model files;
- ``_diffusers_forms``: diffusers' model files and its shared ``apply_rotary_emb``;
- ``_timm_forms``: timm's ``apply_rot_embed*`` and EVA's attention.

Every replacement computes ``x * cos + R(x) * sin`` on the tables exactly as given (rope_ext's op
reads one table entry per column, as the eager formula does), so it is exact for any tables, not
only for consistent ones.

Patching (:class:`Patcher`) is a list of attribute assignments per group (a family, a model file),
undone in reverse: a module-level function is replaced in its module; a function defined inside a
method (diffusers' attention processors define theirs in ``__call__``) is replaced by swapping its
code object, inside the method's code, for a trampoline that calls the replacement, so the rest of
the method runs exactly as written.
"""

from __future__ import annotations
import __future__

import ast
import copy
import dataclasses
import dis
import hashlib
import threading
import types

import torch

from rope_ext._ops import _rotate_each

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
        if field == "body" and isinstance(node, ast.FunctionDef) and value and _is_docstring(value[0]):
            value = value[1:]
        if field == "decorator_list":
            value = [d for d in value if not _is_neutral(d)]
        text = _canonical(value)
        if text not in ("[]", "None"):
            parts.append(f"{field}={text}")
    return "(" + " ".join(parts) + ")"


def fingerprint(functions: dict[str, ast.FunctionDef], node: ast.FunctionDef | str) -> str:
    """A short hash of a function (``node``, or ``functions[node]`` for a name) and, recursively, of
    the module-level functions (``functions``: the module's, by name) it names."""
    name = node if isinstance(node, str) else node.name
    seen: set[str] = set()

    def text(fn_name, fn):
        seen.add(fn_name)
        out = _canonical(fn)
        called = sorted({n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in functions} - seen)
        for helper in called:
            if helper not in seen:
                out += f"|{helper}:" + text(helper, functions[helper])
        return out

    return hashlib.sha256(text(name, functions[node] if isinstance(node, str) else node).encode()).hexdigest()[:16]


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


# --- forms ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Form:
    """What one RoPE function computes, in rope_ext's terms.

    Attributes:
        name: a short name for listings.
        signature: the calling convention: a key of the integration's table of builders, which
            turns the call's arguments into tensors and tables for :func:`rotate`.
        interleaved: the pairing of the function's rotation.
        tables: ``"full"``: one entry per rotated column, used as given; ``"first_half"``: the
            first half of a full table gives one angle per pair; ``"half"``: the tables are
            already one angle per pair; ``"complex"``: a complex ``freqs_cis`` per pair (its real
            and imaginary parts are half tables).
        span: which columns rotate: ``"whole"`` head (the table width must equal it),
            ``"prefix"`` (the first table-width columns; the rest pass through) or ``"suffix"``.
        dtype: ``"promote"``: computes and returns in the promotion of x's and the tables' dtypes;
            ``"cast_back"``: computes so, returns x's dtype; ``"float32"``: x cast to float32
            (``x.float()``, which narrows float64 too), computed in the promotion of float32 and
            the tables' dtype, returned in x's dtype; ``"float32_tables"``: the same with the
            tables cast to float32 as well, so always computed in float32; ``"float64"``: x and
            the tables cast to float64 (complex128), returned in x's dtype.
        cast_to_q: k's result is cast to q's dtype too (``original_dtype = q.dtype``).
        returns: a dtype name the result is always cast to (``"bfloat16"``), whatever x's.
        negate_sin: the rotation turns the other way (``cat(x2, -x1)``).
        deinterleave_output: the output lists each pair's first members, then its second ones
            (DeepSeek's MLA ``apply_rotary_pos_emb_interleave``).
    """

    name: str
    signature: str
    interleaved: bool = False
    tables: str = "full"
    span: str = "whole"
    dtype: str = "promote"
    cast_to_q: bool = False
    returns: str | None = None
    negate_sin: bool = False
    deinterleave_output: bool = False

    def describe(self) -> str:
        parts = ["interleaved" if self.interleaved else "half-split"]
        if self.tables != "full":
            parts.append({"first_half": "first-half tables", "half": "half-width tables",
                          "complex": "complex freqs_cis"}[self.tables])
        if self.span != "whole":
            parts.append(f"partial ({self.span})")
        if self.dtype != "promote":
            parts.append({"cast_back": "cast back", "float32": "x in float32, cast back",
                          "float32_tables": "float32 compute, cast back",
                          "float64": "float64 compute, cast back"}[self.dtype]
                         + (" to q's dtype" if self.cast_to_q else ""))
        if self.returns:
            parts.append(f"returns {self.returns}")
        if self.negate_sin:
            parts.append("rotation by -theta")
        if self.deinterleave_output:
            parts.append("de-interleaved output")
        return f"{self.signature}: " + ", ".join(parts)


# --- the math every form shares -------------------------------------------------------------------


def _full_tables(form: Form, cos: torch.Tensor, sin: torch.Tensor):
    """cos and sin in the op's full form: one entry per rotated column."""
    if form.tables == "first_half":
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
    if form.tables != "full":
        if form.interleaved:
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        else:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    if form.negate_sin:
        sin = -sin
    return cos, sin


def _dtypes(form: Form, x: torch.Tensor, cos: torch.Tensor, q_dtype: torch.dtype):
    """(the dtype the original computes in, the dtype it returns) for x and these tables."""
    if form.dtype == "float32_tables":
        compute = torch.float32
    elif form.dtype == "float64":
        compute = torch.float64
    elif form.dtype == "float32":
        compute = torch.promote_types(torch.float32, cos.dtype)
    else:
        compute = torch.promote_types(x.dtype, cos.dtype)
    if form.returns:
        return compute, getattr(torch, form.returns)
    if form.dtype == "promote":
        return compute, compute
    return compute, (q_dtype if form.cast_to_q else x.dtype)


def _check_width(form: Form, x: torch.Tensor, width: int):
    if form.span == "whole" and width != x.shape[-1]:
        raise ValueError(
            f"rope_ext: this RoPE form ({form.describe()}) rotates the whole head, so the table width must "
            f"equal the head dim {x.shape[-1]}; got tables of width {width}"
        )
    if width > x.shape[-1]:
        raise ValueError(f"rope_ext: the table width {width} exceeds the head dim {x.shape[-1]}")


def rotate(form: Form, xs, cos, sin, cos_k=None, sin_k=None):
    """The form's result for each tensor in xs (one or two of them; the second takes cos_k/sin_k
    when given), in one op call when both share a dtype. The tables are as the form's ``tables``
    says, and broadcast against each x as the op's do (``x.shape[:-1] + (width,)``)."""
    cos, sin = _full_tables(form, cos, sin)
    if cos_k is not None:
        cos_k, sin_k = _full_tables(form, cos_k, sin_k)
    width = cos.shape[-1]
    jobs = []  # (the op's input, the dtype it computes in, the dtype returned)
    for x in xs:
        original_dtype = x.dtype
        _check_width(form, x, width)
        compute, out_dtype = _dtypes(form, x, cos, xs[0].dtype)
        if form.dtype in ("float32", "float32_tables") and x.dtype == torch.float64:
            x = x.float()  # the original's x.float() rounds float64 x to float32 first
        if form.span == "suffix" and width < x.shape[-1]:
            x = x[..., -width:]
        elif form.span == "prefix" and width < x.shape[-1] and x.dtype != original_dtype:
            x = x[..., :width]  # the pass-through columns keep x's own precision (joined below)
        # the op computes in x's dtype, or in float32 for 16-bit x
        computes = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        direct = out_dtype == x.dtype and compute == computes
        jobs.append((x if direct else x.to(compute), compute, out_dtype))
    outs = _rotate_each([j[0] for j in jobs], [j[1] for j in jobs], cos, sin, cos_k, sin_k,
                        interleaved=form.interleaved)
    results = []
    for original, out, (_, _, out_dtype) in zip(xs, outs, jobs, strict=True):
        out = out.to(out_dtype)
        if form.deinterleave_output:
            out = out.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        if form.span == "suffix" and width < original.shape[-1]:
            out = torch.cat((original[..., :-width], out), dim=-1)
        elif out.shape[-1] < original.shape[-1]:
            out = torch.cat((out, original[..., width:]), dim=-1)
        results.append(out)
    return results


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
        self._undo(list(self))
        return False


# Module globals the engine adds for trampolines and rewritten methods to call: they stay after an
# unpatch, so a call already running in patched code when another thread unpatches still finds them.
HOLDER_PREFIX = "_rope_ext_"


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

    def apply(self, plan, undo) -> Patched:
        """Make each ``(group, obj, attr, value)`` assignment of plan, remembering what was there.
        Returns the groups switched by this call, which ``undo`` (the integration's unpatch) restores."""
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
        return restored

    def groups(self) -> list[str]:
        return list(self._originals)


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
    """The code object of the function ``name`` that method's body defines, or None."""
    code = getattr(method, "__code__", None)
    found = [c for c in (code.co_consts if code else ()) if isinstance(c, types.CodeType) and c.co_name == name]
    return found[0] if len(found) == 1 else None


def trampoline_plan(group: str, module, method, name: str, replacement, patcher: Patcher):
    """The assignments that make ``method``'s inner function ``name`` call ``replacement``: a module
    global holding the replacement, and method's code with the inner function's code object swapped
    for a trampoline's (``def name(*args, **kwargs): return <global>(*args, **kwargs)``). Everything
    else in the method's code stays as written. Raises ValueError where the inner function closes
    over the method's variables (a trampoline could not stand in for it)."""
    original = patcher.original(group, method, "__code__")
    inner = inner_code(types.SimpleNamespace(__code__=original), name)
    if inner is None:
        raise ValueError(f"{method.__qualname__} defines no single inner function {name!r}")
    if inner.co_freevars:
        raise ValueError(f"{method.__qualname__}.{name} closes over {inner.co_freevars}")
    holder = f"{HOLDER_PREFIX}{method.__qualname__.replace('.', '_')}_{name}"
    namespace: dict = {}
    exec(f"def {name}(*args, **kwargs):\n    return {holder}(*args, **kwargs)\n", namespace)
    code = namespace[name].__code__
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=inner.co_qualname)
    consts = tuple(code if c is inner else c for c in original.co_consts)
    return [(group, module, holder, replacement), (group, method, "__code__", original.replace(co_consts=consts))]



def rewrite_method(node: ast.FunctionDef, filename: str, original: types.CodeType, rewrite_block) -> types.CodeType:
    """The code of a method (``node``, as its file defines it) with some of its statements
    rewritten and everything else as written, line numbers included. ``rewrite_block(stmts)``
    edits one statement list of the method in place (every body, ``else`` and ``finally`` block);
    the new statements take the positions of the ones they replace. Raises ValueError where the
    rewritten code would close over other variables than the original (``original``: the method's
    code now)."""
    def compiled(fn):
        fn.decorator_list = []
        module = ast.Module(body=[fn], type_ignores=[])
        ast.fix_missing_locations(module)
        flags = original.co_flags & __future__.annotations.compiler_flag  # the file's own future import
        out = compile(module, filename, "exec", flags=flags, dont_inherit=True)
        return next(c for c in out.co_consts if isinstance(c, types.CodeType) and c.co_name == node.name)

    # The source as parsed must compile to the code that runs: not so where the file changed since
    # it was imported, or the method needs its class's scope (super(), name mangling of self.__x).
    baseline = compiled(copy.deepcopy(node))
    if _instructions(baseline) != _instructions(original) or (baseline.co_names, baseline.co_freevars) != (
            original.co_names, original.co_freevars):
        raise ValueError(f"{node.name}'s source, compiled alone, is not the code that runs "
                         "(the file changed since it was imported, or the method needs its class's scope)")
    fn = copy.deepcopy(node)
    for parent in list(ast.walk(fn)):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(parent, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                rewrite_block(stmts)
    code = compiled(fn)
    if code.co_freevars != original.co_freevars:
        raise ValueError(f"{node.name}'s code closes over {original.co_freevars}; a rewrite cannot keep them")
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=original.co_qualname)
    return code


def _instructions(code: types.CodeType):
    """code's instructions as what they do: jump offsets left out, and the forms the compiler picks
    for one and the same step by the route it compiled (a method call's LOAD_METHOD or LOAD_ATTR in
    3.11) made one."""
    skip = {"CACHE", "PRECALL", "EXTENDED_ARG", "NOP"}

    def arg(i):
        if "JUMP" in i.opname:
            return None
        return _instructions(i.argval) if isinstance(i.argval, types.CodeType) else repr(i.argval)

    return [("LOAD_ATTR" if i.opname == "LOAD_METHOD" else i.opname, arg(i))
            for i in dis.get_instructions(code) if i.opname not in skip]


def method_rewrite_plan(group: str, module, qualname: str, node: ast.FunctionDef, rewrite_block, replacement,
                        patcher: Patcher):
    """The assignments that rewrite a method (``Class.method`` of module, ``node`` as its file
    defines it) by ``rewrite_block`` (see :func:`rewrite_method`), whose new statements call
    ``replacement`` as the module global this returns as its last element's name. Raises
    ValueError where the method found is not the one its file defines."""
    cls_name, method_name = qualname.split(".")
    method = getattr(getattr(module, cls_name, None), method_name, None)
    original = patcher.original(group, method, "__code__", None)
    if original is None or original.co_filename != module.__file__ or original.co_name != method_name:
        raise ValueError(f"{module.__name__}.{qualname} is not the method its file defines "
                         "(was it replaced by another patch?)")
    holder = f"{HOLDER_PREFIX}{cls_name}_{method_name}"
    code = rewrite_method(node, module.__file__, original, lambda stmts: rewrite_block(stmts, holder))
    return [(group, module, holder, replacement), (group, method, "__code__", code)]


def located(new_stmts, old: ast.stmt):
    """new_stmts, every node placed at old's position (for tracebacks and line tables)."""
    for stmt in new_stmts:
        for child in ast.walk(stmt):
            ast.copy_location(child, old)
    return new_stmts

# --- listings -------------------------------------------------------------------------------------


def site_text(name: str, form: Form | None, reason: str | None) -> str:
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
