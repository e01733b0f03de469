"""QK-norm + RoPE fused in a library's attention: the statements that normalize q and k and then
rotate them become one :func:`rope_ext.qk_norm_rotary` call.

What is recognised, from the method's source as the RoPE forms are (``O`` is the attention module:
``self`` in transformers' attention, the ``attn`` argument of a diffusers processor):

    Q = O.<q_norm>(E_q)[.transpose(1, 2)]         # or: if O.<q_norm> is not None: Q = O.<q_norm>(Q)
    K = O.<k_norm>(E_k)[.transpose(1, 2)]         # (or both under one `if cond:`)
    [Q = Q.transpose(1, 2)]                       # layout statements: per head the norm commutes
    [Q = Q.view(hidden_shape).transpose(1, 2)]    #   with them; a view or unflatten to heads makes
    [Q = Q.unflatten(2, (O.heads, -1))]           #   it a norm across all heads of a token
    ...
    Q, K = <rope>(Q, K, ...)                      # or: Q = <rope>(Q, ...) then K = <rope>(K, ...)

The norms are *deferred*: the rewrite drops the two norm calls (``Q = E_q[...]``) and sets a flag;
the RoPE statement, wherever it sits in the method, becomes one call of the fused replacement (norms
and rotation together while the flag is set, the rotation alone once it is not); and before any other
statement that uses Q or K, or a name whose tensor they may share (``x`` of ``Q = O.q_norm(x)``),
the rewrite inserts ``if <flag>: Q, K = <the norms alone>``; ``with`` blocks are not entered (their
context must not wrap norms the code ran outside it). So every path through the method computes what the model's
code computes: a block that reads q in between (Flux's text tokens, OLMoE's ``clamp_``) gets the
norms there, and the RoPE after it runs alone; a path that skips RoPE (a cross-attention) gets the
norms where q is next read. A site is refused only where that cannot hold (a function the method
defines reads q, the RoPE call's tables read it) or where the fused call could never run (q is used
on every path between norm and RoPE).

At each call :func:`fused` checks, per attention instance, what the source cannot say: that the
norms are instances of tested norm classes (:class:`NormForm`) with their code unchanged, no instance
``forward`` and no hooks; that the RoPE function the name holds is the library's or rope_ext's; and
that the dtypes are ones where the fused op returns what the eager code returns (the same dtype, one
rounding instead of several). Where a check fails it runs the model's own norms, then its RoPE
function. All of these are Python checks on types, attributes and dtypes: static under
``torch.compile``.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools

import torch

from rope_ext.integrations._engine import fingerprint, located, method_rewrite_plan, module_definitions
from rope_ext.integrations._rotate import _dtypes, _full_tables

HIDDEN_SHAPE = "hidden_shape = (*input_shape, -1, self.head_dim)"
PENDING = "_rope_ext_qk_norm_pending"  # the local flag: the norms of q and k are still to run
MODES = ("head", "heads_bhsd", "heads_bshd")


@dataclasses.dataclass(frozen=True)
class NormForm:
    """What an RMS norm class computes, in :func:`rope_ext.qk_norm_rotary`'s terms.

    Attributes:
        name: for listings.
        eps: the attribute holding eps.
        weight: the weight's attribute, or None (no weight).
        weight_if: an attribute that says whether the weight is applied (Gemma 3n's ``with_scale``).
        offset: the op's ``weight_offset`` (1.0 for ``(1 + w)``).
        output: the dtype the norm returns: ``"input"`` (x's, the result cast back); ``"promote"``
            (``weight * x_normed.to(x.dtype)``: the promotion of the weight's and x's); ``"weight"``
            (diffusers' RMSNorm: a 16-bit weight's dtype, else float32).
        eps_none: what a None eps means: ``"finfo"``, x's dtype's machine epsilon (torch's RMSNorm).
        bias: an attribute that must be None (a norm with a bias is not this form).
    """

    name: str
    eps: str
    weight: str | None = "weight"
    weight_if: str | None = None
    offset: float = 0.0
    output: str = "input"
    eps_none: str | None = None
    bias: str | None = None

    def describe(self) -> str:
        parts = [f"eps from .{self.eps}"]
        parts.append("no weight" if self.weight is None else
                     ("(1 + w)" if self.offset == 1.0 else "w") + (f" if .{self.weight_if}" if self.weight_if else ""))
        parts.append({"input": "returns x's dtype", "promote": "returns w's and x's promotion",
                      "weight": "returns a 16-bit w's dtype, else float32"}[self.output])
        return f"{self.name}: " + ", ".join(parts)


def norm_fingerprint(definitions: dict, node: ast.ClassDef) -> str:
    """A norm class's fingerprint (``_engine.fingerprint`` of its whole ``class`` block, methods,
    ``__init__`` and helpers it names included), its name left out: the same norm copied into
    another family's file under that family's name is the same form."""
    return fingerprint(definitions, _renamed(node))


def _renamed(node: ast.ClassDef) -> ast.ClassDef:
    out = copy.copy(node)
    out.name = "_"
    return out


# --- the statements ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Site:
    """A fused QK-norm + RoPE in a method.

    Attributes:
        owner: the name of the attention module in the method (``self``, ``attn``).
        q_norm, k_norm: the norms' attributes on it.
        rope: the RoPE function's name.
        pair: q and k rotated by one call each (``Q = rope(Q, ...)``, ``K = rope(K, ...)``) rather
            than by one call for both.
        mode: ``"head"`` (the norm's row is the last dim at the RoPE call), ``"heads_bhsd"`` (across
            all heads of a token, q a ``(B, H, S, D)`` view of ``(B, S, H * D)`` rows) or
            ``"heads_bshd"`` (across heads, q ``(B, S, H, D)``).
    """

    owner: str
    q_norm: str
    k_norm: str
    rope: str
    pair: bool
    mode: str


def _names(node) -> set[str]:
    nodes = node if isinstance(node, list) else [node]
    return {n.id for part in nodes for n in ast.walk(part) if isinstance(n, ast.Name)}


def _text(node) -> str:
    return ast.unparse(node)


def _attr_call(expr, owner: str, attrs) -> ast.Call | None:
    """``<owner>.<attr>(E)`` with attr in attrs, one positional argument and no keywords, or None."""
    if (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and isinstance(expr.func.value, ast.Name)
            and expr.func.value.id == owner and expr.func.attr in attrs and len(expr.args) == 1
            and not expr.keywords and not isinstance(expr.args[0], ast.Starred)):
        return expr
    return None


def _assign(stmt) -> tuple[str, ast.expr] | None:
    """``name = value`` as (name, value), or None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id, stmt.value
    return None


def _is_transpose12(expr) -> bool:
    return (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "transpose"
            and not expr.keywords and [_text(a) for a in expr.args] == ["1", "2"])


_RESHAPES = {"view", "reshape", "unflatten", "flatten", "transpose", "permute", "movedim", "swapaxes", "split",
             "chunk", "unbind", "contiguous"}


def _reshapes(expr) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in _RESHAPES for n in ast.walk(expr))


@dataclasses.dataclass
class _Norm:
    """A norm statement of the method's top level: what it does for one name (or two, guarded)."""

    index: int
    attr: str
    arg: ast.expr | None  # E of Q = O.attr(E); None for the guarded forms (the argument is Q itself)
    transposed: bool = False  # Q = O.attr(E).transpose(1, 2)
    guard: ast.expr | None = None  # `if cond:` around both norms


def _norm_statement(stmt, name: str, owner: str, attrs) -> _Norm | None:
    """stmt as the norm of ``name``: ``name = O.attr(E)[.transpose(1, 2)]``, ``if O.attr is not
    None: name = O.attr(name)``, or ``if cond:`` holding exactly ``name = O.attr(name)`` and the
    other tensor's norm of the same shape (index left 0: the caller sets it)."""
    found = _assign(stmt)
    if found and found[0] == name:
        value, transposed = found[1], False
        if _is_transpose12(value):
            value, transposed = value.func.value, True
        call = _attr_call(value, owner, attrs)
        return _Norm(0, call.func.attr, call.args[0], transposed) if call else None
    if not (isinstance(stmt, ast.If) and not stmt.orelse):
        return None
    inner = [_assign(s) for s in stmt.body]
    calls = {n: _attr_call(v, owner, attrs) for n, v in (i for i in inner if i)}
    if len(inner) != len(calls) or name not in calls or calls[name] is None or _text(calls[name].args[0]) != name:
        return None
    attr = calls[name].func.attr
    if len(inner) == 1 and _text(stmt.test) == f"{owner}.{attr} is not None":
        return _Norm(0, attr, None)  # optional: the call checks for None
    if len(inner) == 2 and all(c is not None and _text(c.args[0]) == n for n, c in calls.items()):
        return _Norm(0, attr, None, guard=stmt.test)
    return None


def _layout(stmt, name: str, owner: str, hidden_shape: bool) -> str | None:
    """A layout statement of name: ``"t"`` (``name = name.transpose(1, 2)``), ``"v"`` (``name =
    name.view(hidden_shape).transpose(1, 2)``) or ``"u"`` (``name = name.unflatten(2, (O.heads,
    -1))``); None for any other statement."""
    found = _assign(stmt)
    if not found or found[0] != name:
        return None
    text = _text(found[1])
    if text == f"{name}.transpose(1, 2)":
        return "t"
    views = (f"{name}.view({shape}).transpose(1, 2)" for shape in ("hidden_shape", "*hidden_shape"))
    if hidden_shape and text in views:
        return "v"
    if text == f"{name}.unflatten(2, ({owner}.heads, -1))":
        return "u"
    return None


def _alias_root(expr, owner: str) -> str | None:
    """The name whose tensor expr may share memory with: ``x`` of ``x``, ``x.view(...)``,
    ``x[...]``, ``x.transpose(1, 2)`` and other method chains on x; None where expr makes a new
    tensor (a call of the attention's own module, ``O.to_q(h)``, or of a function)."""
    while True:
        if isinstance(expr, ast.Name):
            return None if expr.id == owner else expr.id
        if isinstance(expr, ast.Subscript):
            expr = expr.value
        elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and not (
                isinstance(expr.func.value, ast.Name) and expr.func.value.id == owner):
            expr = expr.func.value
        else:
            return None


def _rope_sites(fn, rope_names):
    """Every RoPE statement of fn: ``(block, index, kind, q, k, call)``; kind ``"qk"`` for ``Q, K =
    rope(Q, K, ...)``, ``"pair"`` for ``Q = rope(Q, *rest)`` directly followed by ``K = rope(K,
    *rest)`` with the same rest (its index is the first's)."""
    def rope_call(value):
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in rope_names
                and len(value.args) >= 1 and isinstance(value.args[0], ast.Name)):
            return value
        return None

    found = []
    for block in _blocks(fn):
        for i, stmt in enumerate(block):
            if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)
                    and rope_call(stmt.value) and len(stmt.value.args) >= 2 and isinstance(stmt.value.args[1], ast.Name)
                    and [_text(t) for t in stmt.targets[0].elts] == [_text(a) for a in stmt.value.args[:2]]
                    and stmt.value.args[0].id != stmt.value.args[1].id):
                found.append((block, i, "qk", stmt.value.args[0].id, stmt.value.args[1].id, stmt.value))
            first, second = _assign(stmt), _assign(block[i + 1]) if i + 1 < len(block) else None
            if first and second and rope_call(first[1]) and rope_call(second[1]):
                a, b = first[1], second[1]
                rest_a, rest_b = (_text(ast.Call(c.func, c.args[1:], c.keywords)) for c in (a, b))
                if (first[0] == a.args[0].id and second[0] == b.args[0].id and first[0] != second[0]
                        and rest_a == rest_b):
                    found.append((block, i, "pair", first[0], second[0], a))
    return found


def _blocks(fn):
    """Every statement list of fn, its own body first; not those of functions or classes it defines."""
    stack = [fn]
    while stack:
        node = stack.pop(0)
        lists = [getattr(node, f, None) for f in ("body", "orelse", "finalbody")]
        lists += [h.body for h in getattr(node, "handlers", ())]
        for stmts in lists:
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                yield stmts
                stack += [s for s in stmts if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def _top_index(fn, block, i) -> int:
    """The index in fn.body of the statement holding block[i]."""
    target = block[i]
    for j, stmt in enumerate(fn.body):
        if stmt is target or any(n is target for n in ast.walk(stmt)):
            return j
    raise AssertionError("statement not in the function")


def _header(stmt) -> list | None:
    """The expressions a compound statement evaluates before its blocks (None: not one whose
    blocks the rewrite enters)."""
    if isinstance(stmt, (ast.If, ast.While)):
        return [stmt.test]
    if isinstance(stmt, ast.For):
        return [stmt.target, stmt.iter]
    return None  # not `with`: its context (no_grad, autocast) must not wrap norms the code ran outside it


def fusion_rewrite(fn: ast.FunctionDef, owner: str, rope_names, norm_attrs, holder: str) -> Site | str:
    """Rewrite fn (edited in place) so that its q/k norms (``<owner>.<attr>``, attr in norm_attrs)
    are deferred to its RoPE calls (``rope_names``), as the module docstring says; the fused call is
    ``<holder>(owner, q_norm, k_norm, mode or None, rope or None, Q, K, *rope's other arguments)``.
    Returns the :class:`Site`, or the reason there is none (fn is then unchanged in what it runs)."""
    sites = _rope_sites(fn, rope_names)
    if not sites:
        return "no RoPE call of two tensors (Q, K = rope(Q, K, ...), or one call each) that keeps their names"
    # the tensors the norms normalize (QwenImage rotates its text tokens too, normalized by other norms)
    normalized = {name for stmt in fn.body for name in _names(stmt)
                  if _norm_statement(stmt, name, owner, norm_attrs) is not None}
    keys = {(kind, q, k, call.func.id) for _, _, kind, q, k, call in sites}
    keys = {key for key in keys if {key[1], key[2]} <= normalized} or keys
    if len(keys) != 1:
        return "its RoPE calls rotate different tensors or call different functions"
    (kind, q, k, rope), = keys
    sites = [site for site in sites if (site[2], site[3], site[4], site[5].func.id) == (kind, q, k, rope)]
    first_top = min(_top_index(fn, block, i) for block, i, *_ in sites)
    norms = {}
    for name in (q, k):
        for j in range(first_top - 1, -1, -1):
            norm = _norm_statement(fn.body[j], name, owner, norm_attrs)
            if norm is not None:
                norm.index = j
                norms[name] = norm
                break
        else:
            if any(_norm_statement(s, name, owner, norm_attrs) for s in fn.body[first_top:]):
                return "q and k are normalized after RoPE (the fused op normalizes first)"
            return f"{name} is not normalized by {owner}.<{'|'.join(sorted(norm_attrs))}> before its RoPE call"
    nq, nk = norms[q], norms[k]
    if (nq.guard is None) != (nk.guard is None) or (nq.guard is not None and nq.index != nk.index):
        return "q's and k's norms are not under one condition"
    lo, hi = sorted((nq.index, nk.index))
    # what the deferred norms read: q and k, and a tensor they may share memory with (q = O.q_norm(x)
    # makes q hold x's tensor until the norm runs: x read or changed, in place or through another
    # name, means the norms run first)
    roots = {_alias_root(n.arg, owner) for n in (nq, nk) if n.arg is not None} - {None}
    watch = {q, k} | roots
    if any(watch & _names(s) for s in fn.body[lo + 1:hi]):
        return f"{q}, {k} or what their norms read is used between their two norms"
    (first, first_name), (later, _) = sorted(((nq, q), (nk, k)), key=lambda pair: pair[0].index)
    if later.arg is not None and first.index != later.index and (
            {first_name, _alias_root(first.arg, owner) if first.arg is not None else None} & _names(later.arg)):
        return f"the second norm reads {first_name} or what its norm reads"
    closures = [n for n in ast.walk(fn) if isinstance(n, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef))
                and n is not fn and watch & _names(n)]
    if closures:
        return f"a function the method defines reads {', '.join(sorted(watch & _names(closures[0])))}"
    for _, _, _, _, _, call in sites:
        if watch & _names(call.args[2 if kind == "qk" else 1:] + [w.value for w in call.keywords]):
            return f"its RoPE call's tables read {q}, {k} or what their norms read"
    # the layout statements right after the norms
    hidden_shape = any(_text(s) == HIDDEN_SHAPE for s in fn.body[:lo])
    layouts, j = {q: [], k: []}, hi + 1
    while j < first_top:
        stmt = fn.body[j]
        kinds = {name: _layout(stmt, name, owner, hidden_shape) for name in (q, k)}
        hit = [name for name, what in kinds.items() if what]
        if hit:
            layouts[hit[0]].append((j, kinds[hit[0]]))
        elif watch & _names(stmt):
            break
        j += 1
    mode = _mode(nq, nk, [w for _, w in layouts[q]], [w for _, w in layouts[k]])
    if mode not in MODES:
        return mode
    skip = {id(fn.body[i]) for name in (q, k) for i, _ in layouts[name]}
    for stmt in fn.body[hi + 1:first_top]:  # on every path between the norms and RoPE: never fused
        header = _header(stmt)
        if id(stmt) not in skip and watch & _names(stmt) and (header is None or any(
                watch & _names(n) for n in header)):
            return f"`{_text(stmt)[:80]}` uses {q}, {k} or what their norms read between the norms and RoPE"
    site = Site(owner, nq.attr, nk.attr, rope, kind == "pair", mode)
    if not _apply(fn, site, q, k, nq, nk, sites, skip, watch, holder):
        return f"every path to its RoPE call reads {q} or {k} after their norms"
    return site


def _mode(nq: _Norm, nk: _Norm, lq: list, lk: list) -> str:
    """The site's mode from its norms and layout statements, or a reason."""
    if lq != lk:
        return "q and k are reshaped differently after their norms"
    heads = [w for w in lq if w in "vu"]
    if not heads:
        return "head"
    if len(heads) > 1 or nq.transposed or nk.transposed or "t" in lq:
        return "q is transposed as well as reshaped to heads after its norm"
    if any(n.arg is None or _reshapes(n.arg) for n in (nq, nk)):
        return "a norm across heads whose input is not the projection's flat rows"
    return "heads_bhsd" if heads[0] == "v" else "heads_bshd"


def _apply(fn, site: Site, q, k, nq: _Norm, nk: _Norm, sites, skip, watch, holder) -> int:
    """The rewrite of fusion_rewrite; returns how many RoPE statements became fused calls."""
    # the RoPE statements themselves, before step 1 moves the top level's indices
    targets = [(block[i], block[i + 1] if kind == "pair" else None, kind, call) for block, i, kind, _, _, call in sites]
    def parse(text, at):
        return located(ast.parse(text).body, at)

    norms_call = (f"{q}, {k} = {holder}({site.owner}, {site.q_norm!r}, {site.k_norm!r}, {site.mode!r}, None, "
                  f"{q}, {k})")
    materialize = f"if {PENDING}:\n    {norms_call}\n    {PENDING} = False"
    # 1. the norms: dropped, the flag set
    if nq.guard is not None:
        fn.body[nq.index] = parse(f"{PENDING} = {_text(nq.guard)}", fn.body[nq.index])[0]
    else:
        for n, name in ((nq, q), (nk, k)):
            old = fn.body[n.index]
            if n.arg is None:  # `if O.attr is not None: Q = O.attr(Q)`: the call checks for None
                fn.body[n.index] = parse("pass", old)[0]
            else:
                fn.body[n.index] = parse(f"{name} = {_text(n.arg)}" + (".transpose(1, 2)" if n.transposed else ""),
                                         old)[0]
        last = max(nq.index, nk.index)
        fn.body[last:last + 1] = [fn.body[last], *parse(f"{PENDING} = True", fn.body[last])]
        skip = skip | {id(fn.body[last + 1])}
    # 2. the RoPE statements
    replaced = {}
    for stmt, second, kind, call in targets:
        rest = ", ".join([_text(a) for a in call.args[2 if kind == "qk" else 1:]] + [_text(w) for w in call.keywords])
        fused_call = (f"{q}, {k} = {holder}({site.owner}, {site.q_norm!r}, {site.k_norm!r}, "
                      f"{site.mode!r} if {PENDING} else None, {site.rope}, {q}, {k}" + (f", {rest})" if rest else ")"))
        replaced[id(stmt)] = parse(fused_call, stmt)
        if second is None:
            replaced[id(stmt)] += parse(f"{PENDING} = False", stmt)
        else:
            replaced[id(second)] = parse(f"{PENDING} = False", second)

    # 3. every other statement after the norms that reads or sets q or k, or changes what the norms
    #    read: the norms alone first, if still pending (inside compound statements whose header is clean)
    emitted = []

    def touches(node) -> bool:
        return bool(watch & _names(node))

    def process(stmts):
        out = []
        for stmt in stmts:
            header = _header(stmt)
            if id(stmt) in replaced:
                out += replaced[id(stmt)]
                emitted.append(id(stmt))
            elif id(stmt) in skip or not touches(stmt):
                out.append(stmt)
            elif header is not None and not any(touches(n) for n in header):
                for field in ("body", "orelse"):
                    if getattr(stmt, field, None):
                        setattr(stmt, field, process(getattr(stmt, field)))
                out.append(stmt)
            else:
                out += parse(materialize, stmt) + [stmt]
        return out

    start = max(nq.index, nk.index) + 1
    fn.body[start:] = process(fn.body[start:])
    return sum(1 for stmt, *_ in targets if id(stmt) in emitted)

# --- where they are (transformers) ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FusionSite:
    """A method of a model file that normalizes q and k and applies RoPE (``Class.method``).

    Attributes:
        module: the module's import name.
        method: ``Class.method``.
        norms: ``(attribute, class name)`` of each q/k norm the class binds (transformers), or ()
            where the norms' classes are checked only at run time (diffusers' processors).
        norm_form: the norms' :class:`NormForm` (None when refused, or checked at run time).
        site: what the rewrite fuses (None when refused).
        reason: why it is not fused (None when it is).
    """

    module: str
    method: str
    norms: tuple[tuple[str, str], ...]
    norm_form: NormForm | None
    site: Site | None
    reason: str | None = None

    @property
    def fused(self) -> bool:
        return self.site is not None


def _method(cls: ast.ClassDef, name: str):
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _norm_bindings(init: ast.FunctionDef, attribute) -> dict[str, set[str]]:
    """attribute name -> what ``__init__`` binds ``self.<attribute>`` to: a class name, or the text
    of another expression."""
    out: dict[str, set[str]] = {}
    for stmt in ast.walk(init):
        if not isinstance(stmt, ast.Assign):
            continue
        for target in stmt.targets:
            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
                    and attribute.match(target.attr)):
                value = stmt.value
                name = value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None
                out.setdefault(target.attr, set()).add(name or ast.unparse(value))
    return out


def probe(fn: ast.FunctionDef, owner: str, rope_names, norm_attrs) -> Site | str:
    """:func:`fusion_rewrite` on a copy of fn: the site it would fuse, or why not."""
    return fusion_rewrite(copy.deepcopy(fn), owner, rope_names, norm_attrs, "_")


def find_sites(tree: ast.Module, module: str, rope_forms: dict, known_norms: dict, attribute,
               fused_signatures) -> list[FusionSite]:
    """The attention methods (``forward``) of a transformers model file (``tree``, imported as
    ``module``) that call one of their q/k norms (attributes matching ``attribute``, a compiled
    regex, bound in ``__init__``) and one of the file's RoPE functions (``rope_forms``: name ->
    Form, None where refused), fused or with the reason they are not. ``known_norms``: norm
    fingerprint -> NormForm; ``fused_signatures``: the RoPE signatures a fusion can stand in for."""
    definitions = module_definitions(tree)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    sites = []
    for cls in classes.values():
        init, forward = _method(cls, "__init__"), _method(cls, "forward")
        if init is None or forward is None:
            continue
        bindings = _norm_bindings(init, attribute)
        called = {n.func.attr for n in ast.walk(forward) if _attr_call(n, "self", bindings)}
        ropes = {n.func.id for n in ast.walk(forward)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in rope_forms}
        if not called or not ropes:
            continue
        norms = tuple(sorted((attr, "|".join(sorted(bindings[attr]))) for attr in called))
        site = functools.partial(FusionSite, module, f"{cls.name}.forward", norms)
        reason, forms = None, set()
        for attr, bound in norms:
            node = classes.get(bound)
            if node is None:
                reason = f"self.{attr} is {bound}: not an RMS norm class its file defines"
                break
            key = norm_fingerprint(definitions, node)
            if key not in known_norms:
                reason = f"self.{attr}'s class {bound} (fingerprint {key}) matches no tested RMS norm form"
                break
            forms.add(known_norms[key])
        if reason is None and len(forms) != 1:
            reason = "q's and k's norms are of different forms"
        for rope in sorted(ropes):
            form = rope_forms[rope]
            if reason is None and (form is None or form.signature not in fused_signatures):
                reason = (f"{rope} is refused" if form is None else
                          f"{rope}'s signature ({form.signature}) has no fused call yet")
        if reason is not None:
            sites.append(site(None, None, reason))
            continue
        found = probe(forward, "self", ropes, set(called))
        sites.append(site(None, None, found) if isinstance(found, str) else site(forms.pop(), found))
    return sites


def rewrite_plan(group: str, module, node: ast.FunctionDef, site: FusionSite, call, patcher) -> list:
    """The assignments (``_engine.method_rewrite_plan``'s) that rewrite site's method, ``node`` as
    its file defines it, into calls of ``call``. Raises ValueError where the method is not the
    file's, or no longer holds the site it was classified with."""
    found = []

    def rewrite(fn, holder):
        s = site.site
        found.append(fusion_rewrite(fn, s.owner, {s.rope}, {s.q_norm, s.k_norm}, holder))

    plan = method_rewrite_plan(group, module, site.method, node, rewrite, call, patcher)
    if found != [site.site]:
        raise ValueError(f"{site.method} changed since it was classified")
    return plan


def site_text(site: FusionSite) -> str:
    """One fusion site in a listing: fused with what, or why not."""
    if site.fused:
        across = {"head": "each head", "heads_bhsd": "all heads of a token", "heads_bshd": "all heads of a token"}
        what = f"{site.norm_form.describe()}, " if site.norm_form else ""
        return f"qk-norm {site.method}: fused, {what}over {across[site.site.mode]}"
    return f"qk-norm {site.method}: not fused: {site.reason}"


# --- the call ---------------------------------------------------------------------------------------


def _hooked(module) -> bool:
    hooks = torch.nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or hooks._global_backward_hooks or hooks._global_backward_pre_hooks or "forward" in module.__dict__)


def _norm_weight(norm, form: NormForm):
    if form.weight is None or (form.weight_if is not None and not getattr(norm, form.weight_if)):
        return None
    return getattr(norm, form.weight)


def _eps(norm, form: NormForm, x: torch.Tensor):
    eps = getattr(norm, form.eps)
    if eps is None and form.eps_none == "finfo":
        return torch.finfo(x.dtype).eps
    return eps


def _weight_ok(weight, form: NormForm, x: torch.Tensor, n: int) -> bool:
    """Whether the op takes this weight and returns what the norm returns (x's dtype)."""
    if weight is None:
        return True
    if not isinstance(weight, torch.Tensor) or weight.shape != (n,) or weight.device != x.device:
        return False
    if form.output == "promote" and torch.promote_types(weight.dtype, x.dtype) != x.dtype:
        return False
    if form.output == "weight" and weight.dtype != x.dtype:
        return False
    return weight.dtype in (x.dtype, torch.float32)


def norms_alone(module, q_attr, k_attr, mode, q, k):
    """The model's own norms of q and k, in the layout mode says (a norm that is None leaves its
    tensor as it is, as ``if attn.norm_q is not None:`` does)."""
    out = []
    for x, attr in ((q, q_attr), (k, k_attr)):
        norm = getattr(module, attr)
        if norm is None:
            out.append(x)
        elif mode == "heads_bhsd":  # (B, H, S, D), a view of the (B, S, H * D) rows normalized
            out.append(norm(x.transpose(1, 2).flatten(-2)).unflatten(-1, x.shape[-3::2]).transpose(1, 2))
        elif mode == "heads_bshd":
            out.append(norm(x.flatten(-2)).unflatten(-1, x.shape[-2:]))
        else:
            out.append(norm(x))
    return tuple(out)


def fused(norms: dict, ropes: tuple | None, tables_of, pair: bool):
    """The replacement a fusion's rewritten method calls: ``call(module, q_attr, k_attr, mode, rope,
    q, k, *args, **kwargs)``, where ``rope(q, k, *args, **kwargs)`` (``pair``: ``rope(q, ...)`` and
    ``rope(k, ...)``) is the model's RoPE call, mode None means the norms already ran (or are off),
    and rope None means the norms alone.

    Args:
        norms: norm class -> (its :class:`NormForm`, its ``forward`` as patched): the classes whose
            instances the fused op may stand in for.
        ropes: the functions the RoPE name may hold for the fused op to stand in for it (the
            library's and rope_ext's), or None where the rewritten method defines it itself.
        tables_of: ``tables_of(x, *args, **kwargs)`` -> ``(Form, cos, sin)`` for the RoPE call's
            arguments (cos and sin as ``_rotate.rotate`` takes them for x), or None where the call's
            tables are not ones the fused op takes.
    """
    from rope_ext import _ops

    def rotated(rope, q, k, args, kwargs):
        if pair:
            return rope(q, *args, **kwargs), rope(k, *args, **kwargs)
        return rope(q, k, *args, **kwargs)

    def plan(module, q_attr, k_attr, mode, rope, q, k, args, kwargs):
        """The op's arguments, or None where the model's own code must run."""
        if ropes is not None and rope not in ropes:
            return None
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.dtype != k.dtype:
            return None
        if q.dim() != k.dim() or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return None
        qn, kn = getattr(module, q_attr), getattr(module, k_attr)
        found = []
        for norm in (qn, kn):
            entry = norms.get(type(norm))
            if entry is None or type(norm).forward is not entry[1] or _hooked(norm):
                return None
            if entry[0].bias is not None and getattr(norm, entry[0].bias) is not None:
                return None
            found.append(entry[0])
        norm_form = found[0]
        eps = _eps(qn, norm_form, q)
        if found[1] != norm_form or _eps(kn, norm_form, k) != eps or eps is None:
            return None
        tables = tables_of(q, *args, **kwargs)
        if tables is None:
            return None
        form, cos, sin = tables
        if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)) or cos.dtype != sin.dtype:
            return None
        compute, out = _dtypes(form, q, cos, q.dtype)
        if out != q.dtype or compute not in (q.dtype, torch.float32) or cos.dtype not in (q.dtype, torch.float32):
            return None
        if form.span == "suffix" or form.deinterleave_output or form.deinterleave_input or form.returns:
            return None
        cos, sin = _full_tables(form, cos, sin)
        width, head_dim = cos.shape[-1], q.shape[-1]
        if width > head_dim or (form.span == "whole" and width != head_dim) or width % 2 or cos.device != q.device:
            return None
        if mode == "heads_bhsd":  # the op normalizes across dims -2 and -1: the (B, S, H, D) view
            if q.dim() != 4 or cos.dim() != 4:
                return None
            q, k, cos, sin = q.transpose(1, 2), k.transpose(1, 2), cos.transpose(1, 2), sin.transpose(1, 2)
        wq, wk = _norm_weight(qn, norm_form), _norm_weight(kn, norm_form)
        across = mode != "head"
        if across and (wq is None or wk is None):  # the weights' size is what shows the norm's row
            return None
        rows = (lambda x: x.shape[-2] * x.shape[-1]) if across else (lambda x: x.shape[-1])
        if not (_weight_ok(wq, norm_form, q, rows(q)) and _weight_ok(wk, norm_form, k, rows(k))):
            return None
        return q, k, wq, wk, cos, sin, dict(eps=float(eps), weight_offset=norm_form.offset,
                                            norm_over="heads" if across else "head", interleaved=form.interleaved)

    def call(module, q_attr, k_attr, mode, rope, q, k, *args, **kwargs):
        if rope is None:  # the norms alone
            return norms_alone(module, q_attr, k_attr, mode, q, k)
        if mode is None:  # the norms already ran, or the model's condition turned them off
            return rotated(rope, q, k, args, kwargs)
        op_args = plan(module, q_attr, k_attr, mode, rope, q, k, args, kwargs)
        if op_args is None:  # the model's own code
            q, k = norms_alone(module, q_attr, k_attr, mode, q, k)
            return rotated(rope, q, k, args, kwargs)
        *tensors, options = op_args
        q_out, k_out = _ops.qk_norm_rotary(*tensors, **options)
        if mode == "heads_bhsd":
            q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
        return q_out, k_out

    return call
