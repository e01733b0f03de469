"""The QK-norm + RoPE rewrite: the statements of an attention method that normalize q and k and
then rotate them become one call of a replacement that runs :func:`rope_ext.qk_norm_rotary`.

What is recognised, from the method's source as the RoPE forms are (``O`` is the attention module:
``self`` in transformers' attention, the ``attn`` argument of a diffusers processor):

    Q = O.<q_norm>(E_q)[.transpose(1, 2)]         # or: if O.<q_norm> is not None: Q = O.<q_norm>(Q)
    K = O.<k_norm>(E_k)[.transpose(1, 2)]         # (or both under one `if cond:`; or both `.to(X)`)
    [Q = Q.transpose(1, 2)]                       # layout statements: per head the norm commutes
    [Q = Q.view(hidden_shape).transpose(1, 2)]    #   with them; a view or unflatten to heads makes
    [Q = Q.unflatten(2, (O.heads, -1))]           #   it a norm across all heads of a token
    ...
    Q, K = <rope>(Q, K, ...)                      # or: Q = <rope>(Q, ...) then K = <rope>(K, ...)

or, for partial rotary written out (Phi, Persimmon: the first R columns of each head rotated), the
RoPE call inside the five statements that slice, rotate and join (:class:`_RopeSite`'s ``rotated``)::

    Qr, Qp = (Q[..., :R], Q[..., R:])
    Kr, Kp = (K[..., :R], K[..., R:])
    Qr, Kr = <rope>(Qr, Kr, ...)
    Q = torch.cat((Qr, Qp), dim=-1)
    K = torch.cat((Kr, Kp), dim=-1)

The norms are *deferred*: the rewrite drops the two norm calls (``Q = E_q[...]``) and sets a flag;
the RoPE statement, wherever it sits in the method, becomes one call of the fused replacement (norms
and rotation together while the flag is set, the rotation alone once it is not); and before any other
statement that uses Q or K, or a name whose tensor they may share (``x`` of ``Q = O.q_norm(x)``),
the rewrite inserts ``if <flag>: Q, K = <the norms alone>``; ``with`` blocks are not entered (their
context must not wrap norms the code ran outside it). So every path through the method computes what the model's
code computes: a block that reads q in between (HunyuanVideo's slice of q, OLMoE's ``clamp_``) gets the
norms there, and the RoPE after it runs alone; a path that skips RoPE (a cross-attention) gets the
norms where q is next read. A site is refused only where that cannot hold (a function the method
defines reads q, the RoPE call's tables read it) or where the fused call could never run (q is used
on every path between norm and RoPE).

RoPE written into a slice of q and k in place (CogVideoX's and CogView4's processors: the text
tokens in front, normalized with the image's and not rotated) is one fused call over the whole of q
and k where the norms are still pending, and where the condition k's statement runs under holds;
else the norms alone, if pending, then the two statements as written (:class:`Slice`)::

    Q[:, :, T:] = <rope>(Q[:, :, T:], ...)
    [if <guard>:]
    K[:, :, T:] = <rope>(K[:, :, T:], ...)

A second stream joined to q and k between their norms and RoPE (Flux's double-stream blocks: the
text tokens, normalized by norms of their own, concatenated in front of q and k) is deferred too,
where its four statements are exactly as :class:`Stream` says: with the norms still pending there,
the statements are skipped and a second flag set; the RoPE call then runs one fused call per stream
(each with its slice of the tables) and the model's cat, and any other read of q or k first runs
the norms, the stream's four statements, as written. Where the stream's statements are of any other
shape, the site is fused as before (the norms run before the cat, RoPE after it alone).

This module reads and rewrites a method's syntax tree; nothing here runs at call time. Which methods
are rewritten is not this module's choice: transformers' and diffusers' ``patch()`` rewrite only
those the table of tested fusions lists (``_qk_norm_sites``, ``_qk_norm_table``), and
``tools/qk_norm_table.py`` runs :func:`probe` over a release's source, offline, to propose entries
for it.
"""

from __future__ import annotations

import ast
import copy
import dataclasses

from rope_ext.integrations._engine import located

HIDDEN_SHAPE = "hidden_shape = (*input_shape, -1, self.head_dim)"
PENDING = "_rope_ext_qk_norm_pending"  # the local flag: the norms of q and k are still to run
STREAMS = "_rope_ext_qk_norm_streams"  # and the second stream's norms and cat (set only with PENDING)
MODES = ("head", "heads_bhsd", "heads_bshd", "after", "single", "tuples")


@dataclasses.dataclass(frozen=True)
class Stream:
    """A second stream of queries and keys that a method normalizes by norms of its own and joins to
    q and k between their norms and RoPE, by four statements in a row (Flux's double-stream blocks,
    ``EQ``/``EK`` its text tokens, ``(B, S_text, H, D)``, q and k ``(B, S_img, H, D)``)::

        EQ = O.<q_norm>(EQ)
        EK = O.<k_norm>(EK)
        Q = torch.cat([EQ, Q], dim=<dim>)      # or [Q, EQ] (first False): the same order for K
        K = torch.cat([EK, K], dim=<dim>)

    The RoPE after them rotates the joined sequence by tables of ``S_text + S_img`` rows: fused,
    each stream is one op call with its own norms' weights and its rows of the tables (a view), then
    the model's cat. Taken only where EQ and EK are not read after the cat (the fusion never
    computes the normalized stream alone).

    Attributes:
        q, k: the stream's tensors' names (``encoder_query``, ``encoder_key``).
        q_norm, k_norm: their norms' attributes on the attention module.
        first: the stream comes first in the cat (Flux's text tokens precede the image's).
        dim: the cat's dim, the tensors' sequence dim (1 in ``(B, S, H, D)``).
    """

    q: str
    k: str
    q_norm: str
    k_norm: str
    first: bool
    dim: int


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
            all heads of a token, q a ``(B, H, S, D)`` view of ``(B, S, H * D)`` rows),
            ``"heads_bshd"`` (across heads, q ``(B, S, H, D)``), ``"after"`` (per head, the norms
            right after the RoPE call: see :func:`_fuse_after`), ``"single"`` (per head, each
            tensor normalized and rotated by its own two statements: see :func:`_fuse_single`) or
            ``"tuples"`` (per head, pairs of tensors normalized, then rotated, by tuple statements:
            see :func:`_fuse_tuples`; q_norm and k_norm are the first and last norm they call).
        stream: the second stream joined to q and k before RoPE and fused with them (mode
            ``"head"`` only), or None.
        rotated: for partial rotary written out (the module docstring's five statements), the
            source of R, the columns rotated (``self.rotary_ndims``); else None.
        cast: the norms' results are cast (``Q = O.q_norm(E).to(X)``, ESM-C; ``if O.q_norm is not
            None: Q = O.q_norm(Q).to(dtype=X)``, CogView4): the fused call's fallbacks run the norms
            without that cast, so the rewritten code defers them only where the call's
            ``defers_cast`` says those norms return X, and otherwise runs them, cast, as written.
        sliced: RoPE written into a slice of q and k (:class:`Slice`, mode ``"head"``), or None.
        k_tables: q and k rotated by one call each whose other arguments differ (mode ``"head"``):
            the fused call gets k's as its mode's (``("each", mode, k_args, k_kwargs)``).
    """

    owner: str
    q_norm: str
    k_norm: str
    rope: str
    pair: bool
    mode: str
    stream: Stream | None = None
    rotated: str | None = None
    cast: bool = False
    sliced: Slice | None = None
    k_tables: bool = False


class FusionRefusal:
    """Why a method's QK-norm is not fused: each reason is a subclass (this module's :class:`Unfusable`,
    ``_qk_norm_sites``' others); ``str()`` says it in words. ``warns``: ``patch()`` says it in a
    ``RefusedWarning`` when met (``strict=True`` raises); the others are listed, not warned of: code
    rope_ext knows and leaves alone."""

    warns: bool = False


@dataclasses.dataclass(frozen=True)
class Unfusable(FusionRefusal):
    """Why the rewrite cannot fuse a method: the first of the module docstring's conditions that its
    code fails (a norm after RoPE, q read between the norms and RoPE, ...)."""

    why: str

    def __str__(self) -> str:
        return self.why


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
    cast: ast.expr | None = None  # X of Q = O.attr(E).to(X) (ESM-C's cast to the hidden states' dtype)
    cast_keyword: bool = False  # written .to(dtype=X)


def _norm_statement(stmt, name: str, owner: str, attrs) -> _Norm | None:
    """stmt as the norm of ``name``: ``name = O.attr(E)[.transpose(1, 2)]``, ``if O.attr is not
    None: name = O.attr(name)``, or ``if cond:`` holding exactly ``name = O.attr(name)`` and the
    other tensor's norm of the same shape (index left 0: the caller sets it)."""
    found = _assign(stmt)
    if found and found[0] == name:
        value, transposed, cast = found[1], False, None
        keyword = False
        if _is_transpose12(value):
            value, transposed = value.func.value, True
        else:
            value, cast, keyword = _uncast(value)
        call = _attr_call(value, owner, attrs)
        return _Norm(0, call.func.attr, call.args[0], transposed, cast=cast, cast_keyword=keyword) if call else None
    if not (isinstance(stmt, ast.If) and not stmt.orelse):
        return None
    inner = [_assign(s) for s in stmt.body]
    if len(inner) == 1 and inner[0] and inner[0][0] == name:  # `if O.attr is not None: Q = O.attr(Q)[.to(X)]`
        value, cast, keyword = _uncast(inner[0][1])
        call = _attr_call(value, owner, attrs)
        # (X a name: the rewrite evaluates it whether or not the norm is None, which the model does not)
        if (call is not None and _text(call.args[0]) == name and (cast is None or isinstance(cast, ast.Name))
                and _text(stmt.test) == f"{owner}.{call.func.attr} is not None"):
            return _Norm(0, call.func.attr, None, cast=cast, cast_keyword=keyword)  # optional: the call checks
    calls = {n: _attr_call(v, owner, attrs) for n, v in (i for i in inner if i)}
    if len(inner) != len(calls) or name not in calls or calls[name] is None or _text(calls[name].args[0]) != name:
        return None
    attr = calls[name].func.attr
    if len(inner) == 2 and all(c is not None and _text(c.args[0]) == n for n, c in calls.items()):
        return _Norm(0, attr, None, guard=stmt.test)
    return None


def _uncast(value) -> tuple[ast.expr, ast.expr | None, bool]:
    """(E, X, whether by keyword) for ``E.to(X)`` or ``E.to(dtype=X)``; (value, None, False) for any
    other expression."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "to":
        if len(value.args) == 1 and not value.keywords and not isinstance(value.args[0], ast.Starred):
            return value.func.value, value.args[0], False
        if not value.args and len(value.keywords) == 1 and value.keywords[0].arg == "dtype":
            return value.func.value, value.keywords[0].value, True
    return value, None, False


def _head_dims(fn, owner: str) -> set[str]:
    """The sources that name the attention's head dim: ``O.head_dim``, and a name the method binds at
    its top level to ``O.inner_dim // O.heads`` (LongCat's ``head_dim``), and to nothing else: what a
    view to ``(B, -1, O.heads, D)`` needs for H * D to be the projection's row."""
    binds: dict[str, set[str]] = {}
    for stmt in ast.walk(fn):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(
            stmt, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr, ast.For)) else []
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    binds.setdefault(n.id, set()).add(_text(stmt.value) if isinstance(stmt, ast.Assign) else "")
    local = {name for name, values in binds.items() if values == {f"{owner}.inner_dim // {owner}.heads"}}
    return {f"{owner}.head_dim"} | local


def _layout(stmt, name: str, owner: str, hidden_shape: bool, head_dims=frozenset()) -> str | None:
    """A layout statement of name: ``"t"`` (``name = name.transpose(1, 2)``), ``"v"`` (``name =
    name.view(hidden_shape).transpose(1, 2)``), ``"u"`` (``name = name.unflatten(2, (O.heads,
    -1))``, or ``name.view(B, -1, O.heads, D)`` with D one of ``head_dims``: see :func:`_head_dims`)
    or ``"r"`` (``name = name.reshape(B, S,
    O.<heads>, O.head_dim).transpose(1, 2)``: rows of a head kept, Chameleon's after its norms of
    ``(B * S, H, D)`` rows); None for any other statement."""
    found = _assign(stmt)
    if not found or found[0] != name:
        return None
    text = _text(found[1])
    if text == f"{name}.transpose(1, 2)":
        return "t"
    value = found[1]
    if _is_transpose12(value) and isinstance(value.func.value, ast.Call):
        inner = value.func.value
        if (isinstance(inner.func, ast.Attribute) and inner.func.attr == "reshape" and _text(inner.func.value) == name
                and len(inner.args) == 4 and not inner.keywords and _text(inner.args[3]) == f"{owner}.head_dim"
                and _text(inner.args[2]).startswith(f"{owner}.")):
            return "r"
    views = (f"{name}.view({shape}).transpose(1, 2)" for shape in ("hidden_shape", "*hidden_shape"))
    if hidden_shape and text in views:
        return "v"
    if text == f"{name}.unflatten(2, ({owner}.heads, -1))":
        return "u"
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "view"
            and _text(value.func.value) == name and len(value.args) == 4 and not value.keywords
            and _text(value.args[1]) == "-1" and _text(value.args[2]) == f"{owner}.heads"
            and _text(value.args[3]) in head_dims and name not in _names(value.args)):
        return "u"  # (name.view(B, -1, O.heads, D), LongCat's: a row's H * D values split into heads, as unflatten)
    return None


def _rows_of_heads(fn, norm: _Norm, owner: str) -> bool:
    """Whether the norm's input was bound, last before the norm at the top level, by a reshape or
    view to rows of a head (``E = E.reshape(-1, O.heads, O.head_dim)``, Chameleon's): what a layout
    statement "r" after the norms needs (the reshape to (B, S, H, D) then keeps each row a head's)."""
    name = norm.arg.id if isinstance(norm.arg, ast.Name) else None
    for stmt in reversed(fn.body[:norm.index]):
        found = _assign(stmt)
        if found is None or found[0] != name:
            continue
        value = found[1]
        return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                and value.func.attr in ("reshape", "view") and not value.keywords and len(value.args) >= 2
                and _text(value.args[-1]) == f"{owner}.head_dim")
    return False


def _aliases(stmts, roots: set, owner: str) -> set:
    """The names stmts (what runs before the norms) bind to a tensor that may share memory with one
    of roots (``z = x``, ``z = x.view(...)``, and names bound to those in turn): a change through one
    of them after the first norm changes what the deferred norms read."""
    found = set()
    assigns = [n for stmt in stmts for n in ast.walk(stmt) if isinstance(n, (ast.Assign, ast.NamedExpr))]
    while True:
        more = set()
        for n in assigns:
            root = _alias_root(n.value, owner)
            if root in roots | found:
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                more |= {name for t in targets for name in _names(t)} - roots - found
        if not more:
            return found
        found |= more


def _fresh_input(stmt, names, watch, owner: str) -> bool:
    """Whether stmt, between the two norms, only makes the second norm's input (one of ``names``)
    anew: ``N = E`` where E is a new tensor (``_alias_root`` None: MiniMax-M3-VL's indexer's ``idx_k =
    self.k_proj(h).view(...)``), reads no ``watch`` name and changes nothing in place (no call of a
    method ending in ``_``). The second norm runs after it in both orders and the first norm's input
    cannot share the new tensor's memory, so deferring the first norm past it changes nothing. Any
    other statement that reads a watched name (a view of x changed in place, ``k = q``) is not."""
    found = _assign(stmt)
    if found is None or found[0] not in names:
        return False
    value = found[1]
    return (_alias_root(value, owner) is None and not (watch & _names(value)) and not any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr.endswith("_")
        for n in ast.walk(value)))


# The methods that make a view or reshaped copy of a tensor, and write nothing.
_SHAPE_METHODS = frozenset({"view", "reshape", "transpose", "flatten", "unflatten", "permute", "contiguous"})


def _reshaped_input(stmt, name: str, watch, owner: str) -> bool:
    """Whether stmt, between the two norms, only reshapes the second norm's input under its own
    name: ``N = N.reshape(...)`` (Chameleon's ``key_states = key_states.reshape(-1, H, D)``), a chain of
    shape methods whose arguments read no ``watch`` name. It writes nothing and rebinds only N, which
    the second norm reads after it in both orders, so deferring the first norm past it changes
    nothing."""
    found = _assign(stmt)
    if found is None or found[0] != name:
        return False
    value = found[1]
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _SHAPE_METHODS:
        if any(watch & _names(a) for a in (*value.args, *(kw.value for kw in value.keywords))):
            return False
        value = value.func.value
    return isinstance(value, ast.Name) and value.id == name and value is not found[1]


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


@dataclasses.dataclass(frozen=True)
class _RopeSite:
    """A RoPE statement of a method: ``block[index:index + span]``.

    Attributes:
        kind: ``"qk"`` for ``Q, K = rope(Q, K, ...)``; ``"pair"`` for ``Q = rope(Q, *rest)``
            directly followed by ``K = rope(K, *rest)`` with the same rest (span 2).
        q, k: the tensors rotated: for ``rotated``, Q and K, the names the slices are taken of.
        call: the RoPE call (q's, for a pair).
        rotated: the source of R where the call is the middle of partial rotary written out (the
            module docstring's five statements, span 5; kind ``"qk"``); else None.
        sliced: for kind ``"slice"`` (:func:`_slice_pair`), the :class:`Slice`; else None.
        k_call: for a ``"pair"`` whose two calls' other arguments differ (LTX-2's ``key_rotary_emb
            if key_rotary_emb is not None else query_rotary_emb``), k's call; else None.
    """

    block: list
    index: int
    kind: str
    q: str
    k: str
    call: ast.Call
    rotated: str | None = None
    sliced: Slice | None = None
    k_call: ast.Call | None = None

    @property
    def span(self) -> int:
        return 5 if self.rotated is not None else 2 if self.kind in ("pair", "slice") else 1

    @property
    def tables(self) -> list:
        """The calls' other arguments: their tables (and options)."""
        calls = [self.call] if self.k_call is None else [self.call, self.k_call]
        return [e for c in calls for e in c.args[2 if self.kind == "qk" else 1:] + [w.value for w in c.keywords]]


@dataclasses.dataclass(frozen=True)
class Slice:
    """RoPE written into a slice of q and of k in place (CogView4's, CogVideoX's processors: the text
    tokens in front of the image's, normalized with them and not rotated)::

        Q[:, :, T:, :] = rope(Q[:, :, T:, :], ...)
        [if <guard>:]                              # (CogVideoX: not in cross-attention)
        K[:, :, T:, :] = rope(K[:, :, T:, :], ...)

    the index every ``:`` but one ``T:``, the same for both, the two calls' other arguments the same.

    Attributes:
        dim: the position of ``T:`` in the index, the dim of q whose rows from T on are rotated.
        start: the source of T.
        guard: the source of the condition k's statement runs under, or None.
    """

    dim: int
    start: str
    guard: str | None = None


def _slice_target(stmt, rope_call):
    """(name, the index's source, dim, start, call) where stmt is ``N[IDX] = rope(N[IDX], ...)`` with
    IDX as :class:`Slice` says; else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Subscript)):
        return None
    target, call = stmt.targets[0], stmt.value
    if not (isinstance(target.value, ast.Name) and isinstance(target.slice, ast.Tuple) and rope_call(call)):
        return None
    cuts = [i for i, e in enumerate(target.slice.elts) if not (
        isinstance(e, ast.Slice) and e.lower is None and e.upper is None and e.step is None)]
    if len(cuts) != 1:
        return None
    cut = target.slice.elts[cuts[0]]
    if not (isinstance(cut, ast.Slice) and cut.lower is not None and cut.upper is None and cut.step is None):
        return None
    first = call.args[0]
    if not (isinstance(first, ast.Subscript) and _text(first) == _text(target)):
        return None
    if any(isinstance(a, ast.Starred) for a in call.args) or target.value.id in _names([cut.lower]):
        return None
    return target.value.id, _text(target.slice), cuts[0], _text(cut.lower), call


def _slice_pair(block, i: int, rope_call):
    """The :class:`_RopeSite` of kind ``"slice"`` at block[i] (:class:`Slice`'s statements), or None."""
    first = _slice_target(block[i], rope_call)
    if first is None or i + 1 >= len(block):
        return None
    after, guard = block[i + 1], None
    if isinstance(after, ast.If) and not after.orelse and len(after.body) == 1:
        after, guard = after.body[0], _text(block[i + 1].test)
    second = _slice_target(after, rope_call)
    if second is None:
        return None
    (q, index, dim, start, call), (k, index_k, _, _, call_k) = first, second
    rest = [_text(ast.Call(c.func, c.args[1:], c.keywords)) for c in (call, call_k)]
    if q == k or index != index_k or rest[0] != rest[1]:
        return None
    if guard is not None and not _plain_guard(block[i + 1].test):
        return None
    return _RopeSite(block, i, "slice", q, k, call, sliced=Slice(dim, start, guard))


_GUARD_NODES = (ast.UnaryOp, ast.Not, ast.BoolOp, ast.And, ast.Or, ast.Compare, ast.Eq, ast.NotEq, ast.Is, ast.IsNot,
                ast.Attribute, ast.Name, ast.Constant, ast.Load)


def _plain_guard(test) -> bool:
    """Whether a condition reads the attention module's attributes and constants alone, by ``not``,
    ``and``, ``or`` and comparisons (CogVideoX's ``not attn.is_cross_attention``): one the rewrite may
    evaluate twice, and before q's statement rather than after it. Its names are checked against the
    owner by the caller (:func:`fusion_rewrite` refuses any that reads q, k or what their norms read)."""
    return all(isinstance(n, _GUARD_NODES) for n in ast.walk(test))


def _partial_rotary(block, i: int, qr: str, kr: str):
    """(Q, K, R's source, the slices' four names) where block[i] (``Qr, Kr = rope(Qr, Kr, ...)``) is
    the middle of partial rotary written out, the module docstring's five statements exactly; else
    None."""
    if i < 2 or i + 2 >= len(block):
        return None
    names, cut = [], None
    for stmt, rot in zip(block[i - 2:i], (qr, kr), strict=True):
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)
                and isinstance(stmt.value, ast.Tuple) and len(stmt.targets[0].elts) == 2 == len(stmt.value.elts)):
            return None
        (a, b), (lo, hi) = stmt.targets[0].elts, stmt.value.elts
        if not (isinstance(a, ast.Name) and isinstance(b, ast.Name) and a.id == rot and isinstance(lo, ast.Subscript)
                and isinstance(lo.value, ast.Name) and isinstance(lo.slice, ast.Tuple) and len(lo.slice.elts) == 2):
            return None
        name, index = lo.value.id, lo.slice.elts[1]
        if not (isinstance(index, ast.Slice) and index.lower is None and index.upper is not None and not index.step):
            return None
        r = _text(index.upper)
        if (_text(lo) != f"{name}[..., :{r}]" or _text(hi) != f"{name}[..., {r}:]" or name in (a.id, b.id)
                or (cut is not None and r != cut)):
            return None
        cut = r
        names.append((name, b.id))
    (q, qp), (k, kp) = names
    cats = [_assign(s) for s in block[i + 1:i + 3]]
    if not all(cats) or [c[0] for c in cats] != [q, k] or len({q, k, qr, kr, qp, kp}) != 6:
        return None
    if [_text(c[1]) for c in cats] != [f"torch.cat(({qr}, {qp}), dim=-1)", f"torch.cat(({kr}, {kp}), dim=-1)"]:
        return None
    if ({q, k, qr, kr, qp, kp} | _names(ast.parse(cut))) & _names(block[i].value.args[2:] + [
            w.value for w in block[i].value.keywords]):  # (the tables read none of them)
        return None
    return q, k, cut, {qr, kr, qp, kp}


def _read_elsewhere(fn, stmts, names: set) -> bool:
    """Whether a statement of fn other than stmts (nor one holding them) reads or binds one of names."""
    inside = {id(n) for stmt in stmts for n in ast.walk(stmt)}
    return any(isinstance(n, ast.Name) and n.id in names and id(n) not in inside for n in ast.walk(fn))


def _rope_sites(fn, rope_names) -> list[_RopeSite]:
    """Every RoPE statement of fn (:class:`_RopeSite`)."""
    def rope_call(value, named=True):
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in rope_names
                and len(value.args) >= 1 and (isinstance(value.args[0], ast.Name) or not named)):
            return value
        return None

    found = []
    for block in _blocks(fn):
        for i, stmt in enumerate(block):
            sliced = _slice_pair(block, i, lambda value: rope_call(value, named=False))
            if sliced is not None:
                found.append(sliced)
            if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)
                    and rope_call(stmt.value) and len(stmt.value.args) >= 2 and isinstance(stmt.value.args[1], ast.Name)
                    and [_text(t) for t in stmt.targets[0].elts] == [_text(a) for a in stmt.value.args[:2]]
                    and stmt.value.args[0].id != stmt.value.args[1].id):
                q, k = stmt.value.args[0].id, stmt.value.args[1].id
                partial = _partial_rotary(block, i, q, k)
                if partial is not None and _read_elsewhere(fn, block[i - 2:i + 3], partial[3]):
                    partial = None  # (the fused call binds none of the slices' names)
                if partial is not None:
                    found.append(_RopeSite(block, i - 2, "qk", partial[0], partial[1], stmt.value, partial[2]))
                else:
                    found.append(_RopeSite(block, i, "qk", q, k, stmt.value))
            first, second = _assign(stmt), _assign(block[i + 1]) if i + 1 < len(block) else None
            if first and second and rope_call(first[1]) and rope_call(second[1]):
                a, b = first[1], second[1]
                rest_a, rest_b = (_text(ast.Call(c.func, c.args[1:], c.keywords)) for c in (a, b))
                plain = (a.func.id == b.func.id and not any(isinstance(x, ast.Starred) for x in b.args)
                         and all(w.arg for w in b.keywords))  # (k's own arguments are passed on as written)
                if (first[0] == a.args[0].id and second[0] == b.args[0].id and first[0] != second[0]
                        and (rest_a == rest_b or plain)):
                    found.append(_RopeSite(block, i, "pair", first[0], second[0], a,
                                           k_call=None if rest_a == rest_b else b))
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


def fusion_rewrite(fn: ast.FunctionDef, owner: str, rope_names, norm_attrs, holder: str) -> Site | Unfusable:
    """Rewrite fn (edited in place) so that its q/k norms (``<owner>.<attr>``, attr in norm_attrs)
    are deferred to its RoPE calls (``rope_names``), as the module docstring says; the fused call is
    ``<holder>(owner, q_norm, k_norm, mode or None, rope or None, Q, K, *rope's other arguments)``.
    Returns the :class:`Site`, or the :class:`Unfusable` that says why there is none (fn is then
    unchanged in what it runs)."""
    sites = _rope_sites(fn, rope_names)
    if not sites:
        tuples = _fuse_tuples(fn, owner, rope_names, norm_attrs, holder)
        return tuples if tuples is not None else _fuse_single(fn, owner, rope_names, norm_attrs, holder)
    # the tensors the norms normalize (QwenImage rotates its text tokens too, normalized by other norms)
    normalized = {name for stmt in fn.body for name in _names(stmt)
                  if _norm_statement(stmt, name, owner, norm_attrs) is not None}
    def key(site):
        return site.kind, site.q, site.k, site.call.func.id, site.rotated, site.sliced, site.k_call is not None
    keys = {key(site) for site in sites}
    keys = {each for each in keys if {each[1], each[2]} <= normalized} or keys
    if len(keys) != 1:
        return Unfusable("its RoPE calls rotate different tensors or call different functions")
    (kind, q, k, rope, rotated, sliced, k_tables), = keys
    sites = [site for site in sites if key(site) == (kind, q, k, rope, rotated, sliced, k_tables)]
    first_top = min(_top_index(fn, site.block, site.index) for site in sites)
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
                return _fuse_after(fn, owner, sites, q, k, norm_attrs, holder)
            return Unfusable(f"{name} is not normalized by {owner}.<{'|'.join(sorted(norm_attrs))}> "
                             "before its RoPE call")
    nq, nk = norms[q], norms[k]
    if (nq.guard is None) != (nk.guard is None) or (nq.guard is not None and nq.index != nk.index):
        return Unfusable("q's and k's norms are not under one condition")
    lo, hi = sorted((nq.index, nk.index))
    if (nq.cast is None) != (nk.cast is None) or (nq.cast is not None and (
            hi != lo + 1 or _text(nq.cast) != _text(nk.cast) or nq.cast_keyword != nk.cast_keyword
            or {q, k} & _names(nq.cast))):
        return Unfusable("q's and k's norms are not cast alike, in two statements in a row")
    # what the deferred norms read: q and k, and a tensor they may share memory with (q = O.q_norm(x)
    # makes q hold x's tensor until the norm runs: x read or changed, in place or through another
    # name bound to it before or after, means the norms run first)
    roots = {_alias_root(n.arg, owner) for n in (nq, nk) if n.arg is not None} - {None}
    watch = {q, k} | roots | _aliases(fn.body[:lo], roots, owner)
    (first, first_name), (later, later_name) = sorted(((nq, q), (nk, k)), key=lambda pair: pair[0].index)
    if any(watch & _names(s) and not _fresh_input(s, {later_name, _alias_root(later.arg, owner)}, watch, owner)
           and not _reshaped_input(s, later_name, watch, owner) for s in fn.body[lo + 1:hi]):
        return Unfusable(f"{q}, {k} or what their norms read is used between their two norms")
    if later.arg is not None and first.index != later.index and (
            {first_name, _alias_root(first.arg, owner) if first.arg is not None else None} & _names(later.arg)):
        return Unfusable(f"the second norm reads {first_name} or what its norm reads")
    closures = [n for n in ast.walk(fn) if isinstance(n, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef))
                and n is not fn and watch & _names(n)]
    if closures:
        return Unfusable(f"a function the method defines reads {', '.join(sorted(watch & _names(closures[0])))}")
    for rope_site in sites:
        if watch & _names(rope_site.tables):
            return Unfusable(f"its RoPE call's tables read {q}, {k} or what their norms read")
    if sliced is not None and (watch & (_names(ast.parse(sliced.start)) | _names(ast.parse(sliced.guard or "0")))
                               or _names(ast.parse(sliced.guard or "0")) - {owner}):
        return Unfusable(f"the slice it rotates reads {q}, {k} or what their norms read, or the condition k's "
                         f"rotation runs under reads more than {owner}'s attributes")
    # the layout statements right after the norms
    hidden_shape = any(_text(s) == HIDDEN_SHAPE for s in fn.body[:lo])
    head_dims = _head_dims(fn, owner)
    # (a compound statement whose header does not read q or k is crossed: OLMoE's `if clip_qkv:`
    # block, which then gets the norms alone, in the norms' own layout, before its first use of q)
    layouts, j = {q: [], k: []}, hi + 1
    while j < first_top:
        stmt = fn.body[j]
        kinds = {name: _layout(stmt, name, owner, hidden_shape, head_dims) for name in (q, k)}
        hit = [name for name, what in kinds.items() if what]
        header = _header(stmt)
        if hit:
            layouts[hit[0]].append((j, kinds[hit[0]]))
        elif watch & _names(stmt) and (header is None or any(watch & _names(n) for n in header)
                                       or layouts[q] or layouts[k]):  # (crossed only before any layout)
            break
        j += 1
    flat = all(_flat_input(fn, n, name, owner) for n, name in ((nq, q), (nk, k)))
    mode = _mode(nq, nk, [w for _, w in layouts[q]], [w for _, w in layouts[k]], flat)
    if isinstance(mode, Unfusable):
        return mode
    if any(w == "r" for _, w in layouts[q]) and not all(_rows_of_heads(fn, n, owner) for n in (nq, nk)):
        return Unfusable("a reshape to heads after norms whose rows were not a head's")
    skip = {id(fn.body[i]) for name in (q, k) for i, _ in layouts[name]}
    stream = None
    if mode == "head" and not (layouts[q] or layouts[k]) and nq.guard is None and not (nq.transposed or nk.transposed):
        stream = _stream(fn, owner, q, k, hi, first_top)
    joined = {id(stmt) for stmt in stream[1]} if stream else set()  # (deferred with the norms)
    for stmt in fn.body[hi + 1:first_top]:  # on every path between the norms and RoPE: never fused
        header = _header(stmt)
        if id(stmt) not in skip | joined and watch & _names(stmt) and (header is None or any(
                watch & _names(n) for n in header)):
            return Unfusable(f"`{_text(stmt)[:80]}` uses {q}, {k} or what their norms read between the norms and RoPE")
    if rotated is not None and (mode != "head" or stream):
        return Unfusable("partial rotary written out after norms across heads, or with a second stream")
    if sliced is not None and (mode != "head" or stream):
        return Unfusable("RoPE written into a slice after norms across heads, or with a second stream")
    if k_tables and (mode != "head" or stream):
        return Unfusable("q and k rotated by tables of their own, after norms across heads or with a second stream")
    site = Site(owner, nq.attr, nk.attr, rope, kind in ("pair", "slice"), mode, stream and stream[0], rotated,
                nq.cast is not None, sliced, k_tables)
    reshaped = min((i for name in (q, k) for i, _ in layouts[name]), default=hi)  # the first layout statement
    if not _apply(fn, site, q, k, nq, nk, sites, skip, watch, holder, reshaped, stream and stream[1]):
        return Unfusable(f"every path to its RoPE call reads {q} or {k} after their norms")
    return site


def _stream_norm(expr, owner: str, name: str) -> str | None:
    """attr where expr is ``<owner>.<attr>(name)`` and attr names a norm (holds ``norm``), else None."""
    attr = expr.func.attr if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) else ""
    call = _attr_call(expr, owner, {attr}) if "norm" in attr else None
    return attr if call is not None and _text(call.args[0]) == name else None


def _stream_at(stmts, owner: str, q: str, k: str) -> Stream | None:
    """The :class:`Stream` that the four statements stmts are, or None."""
    parts = [_assign(s) for s in stmts]
    if len(parts) != 4 or not all(parts):
        return None
    (eq, vq), (ek, vk), (tq, cq), (tk, ck) = parts
    aq, ak = _stream_norm(vq, owner, eq), _stream_norm(vk, owner, ek)
    if aq is None or ak is None or len({eq, ek, q, k}) != 4 or (tq, tk) != (q, k):
        return None
    kw = cq.keywords if isinstance(cq, ast.Call) else []
    if not (len(kw) == 1 and kw[0].arg == "dim" and isinstance(kw[0].value, ast.Constant)
            and type(kw[0].value.value) is int):
        return None
    dim = kw[0].value.value
    for first in (True, False):
        pair_q, pair_k = ((eq, q), (ek, k)) if first else ((q, eq), (k, ek))
        if [_text(cq), _text(ck)] == [f"torch.cat([{a}, {b}], dim={dim})" for a, b in (pair_q, pair_k)]:
            return Stream(eq, ek, aq, ak, first, dim)
    return None


def _stream(fn, owner: str, q: str, k: str, hi: int, first_top: int):
    """The second stream (:class:`Stream`) joined to q and k after their norms (fn.body[hi]) and
    before the first top-level statement that holds a RoPE call (fn.body[first_top]), with its four
    statements (a list), or None where there is none the fusion takes: its statements at the top
    level or directly in a top-level ``if`` block (never in a loop: the rewrite follows them in
    the order they run), exactly one such group, and EQ and EK read by no statement after it nor
    by a function the method defines (after the cat, EQ holds the stream unnormalized)."""
    found = []  # (stream, its four statements, the statements that run after them)
    for j in range(hi + 1, first_top):
        if j + 3 < first_top:
            found.append((fn.body[j:j + 4], fn.body[j + 4:]))
        if isinstance(fn.body[j], ast.If):
            for block in (fn.body[j].body, fn.body[j].orelse):
                found += [(block[i:i + 4], block[i + 4:] + fn.body[j + 1:]) for i in range(len(block) - 3)]
    found = [(stream, stmts, after) for stmts, after in found
             if (stream := _stream_at(stmts, owner, q, k)) is not None]
    if len(found) != 1:
        return None
    (stream, stmts, after), = found
    names = {stream.q, stream.k}
    closures = [n for n in ast.walk(fn) if isinstance(n, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef))
                and n is not fn]
    if names & _names(after) or any(names & _names(c) for c in closures):
        return None
    return stream, stmts


def _fuse_after(fn, owner: str, sites, q: str, k: str, norm_attrs, holder) -> Site | Unfusable:
    """The norms after RoPE (NanoChat's ``Q, K = rope(Q, K, ...)`` then ``Q = O.q_norm(Q)`` and
    ``K = O.k_norm(K)``), as one fused call in place of the three statements, mode ``"after"``.

    A rotation keeps each row's sum of squares, so the statistic of the rotated rows is that of the
    rows, where the tables are a rotation's (cos^2 + sin^2 = 1: the call checks the model's RoPE
    type, see ``_qk_norm_call``); the op normalizes first and applies a weight after the rotation
    (``weight_after=True``), which computes the model's order.
    The fused call replaces exactly one RoPE statement (or pair) whose next two statements, in the
    same block, are the two norms of the rotated names themselves."""
    refused = Unfusable("q and k are normalized after RoPE, not directly after its one call")
    if len(sites) != 1 or sites[0].rotated is not None:
        return refused
    block, i, kind, call = sites[0].block, sites[0].index, sites[0].kind, sites[0].call
    first = i + sites[0].span
    norms = {}
    for stmt in block[first:first + 2]:
        for name in (q, k):
            norm = _norm_statement(stmt, name, owner, norm_attrs)
            if (norm is not None and norm.guard is None and not norm.transposed and norm.cast is None
                    and norm.arg is not None and _text(norm.arg) == name):
                norms[name] = norm
    if set(norms) != {q, k}:
        return refused
    site = Site(owner, norms[q].attr, norms[k].attr, call.func.id, kind == "pair", "after")
    rest = ", ".join([_text(a) for a in call.args[2 if kind == "qk" else 1:]] + [_text(w) for w in call.keywords])
    fused_call = (f"{q}, {k} = {holder}({owner}, {site.q_norm!r}, {site.k_norm!r}, 'after', {site.rope}, {q}, {k}"
                  + (f", {rest})" if rest else ")"))
    block[i:first + 2] = located(ast.parse(fused_call).body, block[i])
    return site


def _tuple_norms(stmt, owner: str, norm_attrs):
    """((A, B), (attr_a, attr_b)) where stmt is ``A, B = O.<attr_a>(A), O.<attr_b>(B)``; else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)
            and isinstance(stmt.value, ast.Tuple) and len(stmt.targets[0].elts) == 2 == len(stmt.value.elts)):
        return None
    names = [t.id for t in stmt.targets[0].elts if isinstance(t, ast.Name)]
    calls = [_attr_call(v, owner, norm_attrs) for v in stmt.value.elts]
    if len(names) != 2 or names[0] == names[1] or None in calls or [_text(c.args[0]) for c in calls] != names:
        return None
    return tuple(names), tuple(c.func.attr for c in calls)


def _tuple_ropes(stmt, names, rope_names):
    """The first RoPE call where stmt is ``A, B = <rope>(A, *T), <rope>(B, *T)`` for names (A, B),
    one function and the same other arguments T, which read neither; else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)
            and isinstance(stmt.value, ast.Tuple) and len(stmt.value.elts) == 2
            and [_text(t) for t in stmt.targets[0].elts] == list(names)):
        return None
    calls = stmt.value.elts
    if not all(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in rope_names and c.args
               and _text(c.args[0]) == name and not any(isinstance(a, ast.Starred) for a in c.args)
               for c, name in zip(calls, names, strict=True)):
        return None
    rest = [_text(ast.Call(c.func, c.args[1:], c.keywords)) for c in calls]
    if rest[0] != rest[1] or set(names) & _names(calls[0].args[1:] + [w.value for w in calls[0].keywords]):
        return None
    return calls[0]


def _fuse_tuples(fn, owner: str, rope_names, norm_attrs, holder) -> Site | Unfusable | None:
    """Stable Audio 3's form: in one block, m statements ``A_i, B_i = O.<a_i>(A_i), O.<b_i>(B_i)``
    directly followed by m statements ``A_i, B_i = rope(A_i, ...), rope(B_i, ...)`` in the same
    order (m = 2 for its differential attention, q1 and q2 normalized by q_norm, then k1 and k2 by
    k_norm). Each pair of tensors is one fused call in place of its RoPE statement, its norm
    statement dropped: nothing runs between the norms and RoPE, so nothing is deferred, and the
    norms still run in the model's order (A_1, B_1, A_2, ...), where a fused call falls back to
    them. Fused only where every RoPE call of the method is in such a run, of one function with
    the same other arguments. Returns None where the method has no such run."""
    runs = []  # (block, index of the first norm, [(names, attrs)], [RoPE calls])
    for block in _blocks(fn):
        i = 0
        while i < len(block):
            norms = []
            while i + len(norms) < len(block) and (found := _tuple_norms(block[i + len(norms)], owner, norm_attrs)):
                norms.append(found)
            ropes = [_tuple_ropes(block[i + len(norms) + j], names, rope_names)
                     if i + len(norms) + j < len(block) else None for j, (names, _) in enumerate(norms)]
            names = [n for pair, _ in norms for n in pair]
            if (norms and None not in ropes and len(set(names)) == len(names)  # (the tables read no tensor of the run)
                    and not any(set(names) & _names(c.args[1:] + [w.value for w in c.keywords]) for c in ropes)):
                runs.append((block, i, norms, ropes))
                i += 2 * len(norms)
            else:
                i += max(1, len(norms))
    if not runs:
        return None
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id in rope_names]
    covered = {id(c) for _, _, norms, ropes in runs for c in ropes}
    covered |= {id(stmt.value.elts[1]) for block, i, norms, _ in runs
                for stmt in block[i + len(norms):i + 2 * len(norms)]}
    texts = {_text(ast.Call(c.func, c.args[1:], c.keywords)) for _, _, _, ropes in runs for c in ropes}
    if {id(c) for c in calls} != covered or len(texts) != 1:
        return Unfusable("q and k are normalized and rotated by tuple statements, but not as runs of norms then "
                         "RoPE that hold every RoPE call, of one function with the same tables")
    attrs = list(dict.fromkeys(a for _, _, norms, _ in runs for _, pair in norms for a in pair))
    rope = runs[0][3][0].func.id
    site = Site(owner, attrs[0], attrs[-1], rope, True, "tuples")
    for block, i, norms, ropes in sorted(runs, key=lambda r: -r[1]):  # (later runs first: indices hold)
        new = []
        for ((a, b), (attr_a, attr_b)), call in zip(norms, ropes, strict=True):
            rest = ", ".join([_text(x) for x in call.args[1:]] + [_text(w) for w in call.keywords])
            text = f"{a}, {b} = {holder}({owner}, {attr_a!r}, {attr_b!r}, 'head', {rope}, {a}, {b}"
            new += located(ast.parse(text + (f", {rest})" if rest else ")")).body, block[i + len(norms)])
        block[i:i + 2 * len(norms)] = new
    return site


def _fuse_single(fn, owner: str, rope_names, norm_attrs, holder) -> Site | Unfusable:
    """Gemma 3n's and 4's form: each of q and k normalized and rotated by two statements of its own,
    ``X = O.<norm>(E)`` directly followed by ``X = rope(X, ...)`` (k's in another block: a layer
    that shares another layer's keys has none), each pair one call of the fused replacement for one
    tensor, ``X = holder(O, attr, attr, 'single', rope, E, None, ...)``. Nothing runs between a
    norm and its RoPE, so nothing is deferred. Fused only where every RoPE call of the method is in
    such a pair, the two pairs use two norm attributes (q's first) and one RoPE function."""
    refused = Unfusable("q and k are normalized and rotated one at a time, but not as one norm-then-RoPE "
                        "pair each that holds every RoPE call")
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id in rope_names]
    pairs = []  # (block, index of the norm, name, norm attribute, norm argument, RoPE call)
    for block in _blocks(fn):
        for i in range(len(block) - 1):
            found, rotated = _assign(block[i]), _assign(block[i + 1])
            if not (found and rotated and found[0] == rotated[0]):
                continue
            norm, call = _attr_call(found[1], owner, norm_attrs), rotated[1]
            if (norm is not None and isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id in rope_names and call.args and _text(call.args[0]) == found[0]
                    and not any(isinstance(a, ast.Starred) for a in call.args)):
                pairs.append((block, i, found[0], norm.func.attr, norm.args[0], call))
    if not pairs:
        return Unfusable("no RoPE call of two tensors (Q, K = rope(Q, K, ...), or one call each) that keeps "
                         "their names")
    if len(pairs) != 2 or len(calls) != 2 or {id(p[5]) for p in pairs} != {id(c) for c in calls}:
        return refused
    if pairs[0][3] == pairs[1][3] or pairs[0][5].func.id != pairs[1][5].func.id:
        return refused
    for _, _, name, _, _, call in pairs:  # the tables must not read the tensor the norm would defer
        if name in _names(call.args[1:] + [w.value for w in call.keywords]):
            return refused
    site = Site(owner, pairs[0][3], pairs[1][3], pairs[0][5].func.id, True, "single")
    for block, i, name, attr, arg, call in sorted(pairs, key=lambda p: -p[1]):
        rest = ", ".join([_text(a) for a in call.args[1:]] + [_text(w) for w in call.keywords])
        text = f"{name} = {holder}({owner}, {attr!r}, {attr!r}, 'single', {call.func.id}, {_text(arg)}, None"
        block[i:i + 2] = located(ast.parse(text + (f", {rest})" if rest else ")")).body, block[i])
    return site


def _flat_input(fn, norm: _Norm, name: str, owner: str) -> bool:
    """Whether the norm's input is a projection's rows as made (no reshape): E of ``Q = O.attr(E)``,
    or, for a norm of Q itself (``if cond: Q = O.attr(Q)``), what the last top-level statement
    before it that binds Q binds it to: a call of one of the attention module's own modules
    (LongCat's ``query = attn.to_q(hidden_states)``)."""
    if norm.arg is not None:
        return not _reshapes(norm.arg)
    for stmt in reversed(fn.body[:norm.index]):
        found = _assign(stmt)
        if found is not None and found[0] == name:
            value = found[1]
            return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                    and isinstance(value.func.value, ast.Name) and value.func.value.id == owner)
        if name in _names(stmt):
            return False
    return False


def _mode(nq: _Norm, nk: _Norm, lq: list, lk: list, flat: bool) -> str | Unfusable:
    """The site's mode (one of MODES) from its norms and layout statements, or why there is none;
    flat: both norms' inputs are a projection's rows (:func:`_flat_input`)."""
    if lq != lk:
        return Unfusable("q and k are reshaped differently after their norms")
    heads = [w for w in lq if w in "vu"]
    if not heads:
        return "head"
    if len(heads) > 1 or nq.transposed or nk.transposed or "t" in lq:
        return Unfusable("q is transposed as well as reshaped to heads after its norm")
    if not flat:
        return Unfusable("a norm across heads whose input is not the projection's flat rows")
    return "heads_bhsd" if heads[0] == "v" else "heads_bshd"


def _apply(fn, site: Site, q, k, nq: _Norm, nk: _Norm, sites, skip, watch, holder, reshaped: int,
           stream_stmts=None) -> int:
    """The rewrite of fusion_rewrite; returns how many RoPE statements became fused calls. Norms
    materialized at a top-level statement before fn.body[reshaped] (the first layout statement: a
    block the layout scan crossed) run in the norms' own layout, q and k not yet reshaped: mode
    "head", the norm modules' plain call. stream_stmts: the four statements of site.stream."""
    # the RoPE statements themselves, and the statements before the first layout one, before step 1
    # moves the top level's indices
    unreshaped = {id(stmt) for stmt in fn.body[:reshaped]}
    targets = [(each.block[each.index], each.block[each.index + 1:each.index + each.span], each) for each in sites]
    stream = site.stream
    # the stream's statements as the model writes them: what runs where they cannot be deferred
    stream_text = "".join(f"\n{_text(stmt)}" for stmt in stream_stmts or ())

    def parse(text, at):
        return located(ast.parse(text).body, at)

    def indent(text, by="    "):
        return text.replace("\n", "\n" + by)

    def materialize(mode):
        call = f"{q}, {k} = {holder}({site.owner}, {site.q_norm!r}, {site.k_norm!r}, {mode!r}, None, {q}, {k})"
        text = f"if {PENDING}:\n    {call}\n    {PENDING} = False"
        if stream is not None:  # then the stream's norms and the cat, as written (set only with PENDING)
            text += f"\n    if {STREAMS}:" + indent(stream_text, " " * 8) + f"\n        {STREAMS} = False"
        return text
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
        pending = "True"
        if nq.cast is not None:  # deferred where the cast changes nothing: the fused call's norms (which do
            cast = _text(nq.cast)  # not cast) return its dtype, as the call's defers_cast says; else run here
            def written(n, name):
                text = f"{name} = {site.owner}.{n.attr}({name}).to({'dtype=' if n.cast_keyword else ''}{cast})"
                return text if n.arg is not None else f"if {site.owner}.{n.attr} is not None:\n    {text}"
            in_order = sorted(((nq, q), (nk, k)), key=lambda p: p[0].index)
            pending = (f"{holder}.defers_cast({site.owner}, {site.q_norm!r}, {site.k_norm!r}, {q}, {k}, {cast})"
                       f"\nif not {PENDING}:" + indent("".join("\n" + written(n, name) for n, name in in_order)))
        flags = parse(f"{PENDING} = {pending}" + (f"\n{STREAMS} = False" if stream is not None else ""),
                      fn.body[last])
        fn.body[last:last + 1] = [fn.body[last], *flags]
        skip = skip | {id(f) for f in flags}
    # 2. the RoPE statements
    replaced = {}
    for stmt, others, rope_site in targets:
        call = rope_site.call
        rest = ", ".join([_text(a) for a in call.args[2 if rope_site.kind == "qk" else 1:]]
                         + [_text(w) for w in call.keywords])
        fused_call = (f"{q}, {k} = {holder}({site.owner}, {site.q_norm!r}, {site.k_norm!r}, "
                      f"{site.mode!r} if {PENDING} else None, {site.rope}, {q}, {k}" + (f", {rest})" if rest else ")"))
        if site.k_tables:  # k's call's other arguments, in the mode
            kc = rope_site.k_call
            k_args = "".join(f"{_text(a)}, " for a in kc.args[1:])
            k_kwargs = ", ".join(f"{w.arg!r}: {_text(w.value)}" for w in kc.keywords)
            fused_call = (f"{q}, {k} = {holder}({site.owner}, {site.q_norm!r}, {site.k_norm!r}, "
                          f"('each', {site.mode!r} if {PENDING} else None, ({k_args}), {{{k_kwargs}}}), {site.rope}, "
                          f"{q}, {k}" + (f", {rest})" if rest else ")"))
        if site.sliced is not None:  # the fused call where the norms are pending (and k is rotated), else
            spec = site.sliced  # the norms alone if pending, then the statements as written
            written = "".join(f"\n{_text(each)}" for each in [stmt, *others])
            cond = PENDING if spec.guard is None else f"{PENDING} and ({spec.guard})"
            fused_call = (f"if {cond}:\n    {q}, {k} = {holder}({site.owner}, {site.q_norm!r}, {site.k_norm!r}, "
                          f"('slice', {spec.dim}, {spec.start}), {site.rope}, {q}, {k}"
                          + (f", {rest})" if rest else ")")
                          + "\nelse:" + indent("\n" + materialize(site.mode) + written))
        if site.rotated is not None:  # the five statements as written, where the norms already ran
            written = "".join(f"\n{_text(each)}" for each in [stmt, *others])
            fused_call = (f"if {PENDING}:\n    {q}, {k} = {holder}({site.owner}, {site.q_norm!r}, {site.k_norm!r}, "
                          f"('partial', {site.rotated}), {site.rope}, {q}, {k}" + (f", {rest})" if rest else ")")
                          + "\nelse:" + indent(written))
        if stream is not None:  # the two streams deferred: each fused with its own norms, then the cat
            attrs = ((site.q_norm, stream.q_norm), (site.k_norm, stream.k_norm))
            two = (f"{q}, {k} = {holder}({site.owner}, {attrs[0]!r}, {attrs[1]!r}, "
                   f"('two_stream', {stream.dim}, {stream.first}), {site.rope}, ({q}, {stream.q}), ({k}, {stream.k})"
                   + (f", {rest})" if rest else ")"))
            fused_call = f"if {STREAMS}:\n    {two}\n    {STREAMS} = False\nelse:\n    {fused_call}"
        replaced[id(stmt)] = parse(fused_call, stmt) + parse(f"{PENDING} = False", stmt)
        replaced.update({id(each): [] for each in others})
    if stream is not None:  # the stream's four statements: deferred while the norms are
        replaced[id(stream_stmts[0])] = parse(f"if {PENDING}:\n    {STREAMS} = True\nelse:" + indent(stream_text),
                                              stream_stmts[0])
        replaced.update({id(stmt): [] for stmt in stream_stmts[1:]})

    # 3. every other statement after the norms that reads or sets q or k, or changes what the norms
    #    read: the norms alone first, if still pending (inside compound statements whose header is clean)
    emitted = []

    def touches(node) -> bool:
        return bool(watch & _names(node))

    def process(stmts, mode=None):  # mode: the materialized norms' (None at the top level: by position)
        out = []
        for stmt in stmts:
            header = _header(stmt)
            here = mode or ("head" if id(stmt) in unreshaped else site.mode)
            if id(stmt) in replaced:
                out += replaced[id(stmt)]
                emitted.append(id(stmt))
            elif id(stmt) in skip or not touches(stmt):
                out.append(stmt)
            elif header is not None and not any(touches(n) for n in header):
                for field in ("body", "orelse"):
                    if getattr(stmt, field, None):
                        setattr(stmt, field, process(getattr(stmt, field), here))
                out.append(stmt)
            else:
                out += parse(materialize(here), stmt) + [stmt]
        return out

    start = max(nq.index, nk.index) + 1
    fn.body[start:] = process(fn.body[start:])
    return sum(1 for stmt, *_ in targets if id(stmt) in emitted)


def probe(fn: ast.FunctionDef, owner: str, rope_names, norm_attrs) -> Site | Unfusable:
    """:func:`fusion_rewrite` on a copy of fn: the site it would fuse, or why not."""
    return fusion_rewrite(copy.deepcopy(fn), owner, rope_names, norm_attrs, "_")
