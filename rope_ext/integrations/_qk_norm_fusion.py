"""QK-norm + RoPE fused in a library's attention: the statements that normalize q and k and then
rotate them become one :func:`rope_ext.qk_norm_rotary` call.

What is recognised (from the method's source, as the RoPE forms are):

    Q = self.<q_norm>(E_q)<.transpose(i, j) ...>          # "head": the norm's row is the head
    K = self.<k_norm>(E_k)<.transpose(i, j) ...>
    ...                                                    # nothing else reads or sets Q or K
    Q2, K2 = <rope function>(Q, K, cos, sin, ...)

or, for a norm across all of a token's heads (OLMo 2, MiniMax-M2, Wan),

    Q = self.<q_norm>(E_q)                                 # "heads": (..., heads * head_dim) rows
    ...
    Q = Q.view(hidden_shape).transpose(1, 2)               # hidden_shape = (*input_shape, -1, self.head_dim)
    Q2, K2 = <rope function>(Q, K, cos, sin, ...)

The rewrite drops the two norm calls (``Q = E_q<.transpose...>``) and turns the RoPE statement into
``Q2, K2 = <holder>(self, "<q_norm>", "<k_norm>", "<mode>", <rope function>, Q, K, cos, sin, ...)``:
the rest of the method runs as written (see ``_engine.method_rewrite_plan``).

At each call :func:`fused` checks, per attention instance, what it cannot see in the source: that
``self.<q_norm>`` and ``self.<k_norm>`` are instances of the norm classes the file defines, with the
tested norm form (:class:`NormForm`), unchanged class code, no instance ``forward`` and no hooks;
that the RoPE function the name holds is the library's or rope_ext's; that the dtypes are ones where
the fused op returns what the eager code returns (the same dtype, one rounding instead of several).
Where any check fails, it runs the model's own code: ``rope(q_norm(Q), k_norm(K), ...)``. All of
these are Python checks on types, attributes and dtypes: static under ``torch.compile``.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools

import torch

from rope_ext.integrations._engine import fingerprint, located, module_definitions, rewrite_each_block
from rope_ext.integrations._rotate import Form, _dtypes, _full_tables

HIDDEN_SHAPE = "hidden_shape = (*input_shape, -1, self.head_dim)"
GUARD = "_rope_ext_qk_norm_on"  # the local a rewrite keeps the norms' condition in


@dataclasses.dataclass(frozen=True)
class NormForm:
    """What an RMS norm class computes, in :func:`rope_ext.qk_norm_rotary`'s terms.

    Attributes:
        name: for listings.
        eps: the attribute holding eps.
        weight: the weight's attribute, or None (no weight).
        weight_if: an attribute that says whether the weight is applied (Gemma 3n's ``with_scale``).
        offset: the op's ``weight_offset`` (1.0 for ``(1 + w)``).
        output: the dtype the norm returns: ``"input"`` (x's, the result cast back), or
            ``"promote"`` (``weight * x_normed.to(x.dtype)``: the promotion of the weight's and x's).
    """

    name: str
    eps: str
    weight: str | None = "weight"
    weight_if: str | None = None
    offset: float = 0.0
    output: str = "input"

    def describe(self) -> str:
        parts = [f"eps from .{self.eps}"]
        parts.append("no weight" if self.weight is None else
                     ("(1 + w)" if self.offset == 1.0 else "w") + (f" if .{self.weight_if}" if self.weight_if else ""))
        parts.append({"input": "returns x's dtype", "promote": "returns w's and x's promotion"}[self.output])
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
    """One fused QK-norm + RoPE in a method: the norm attributes, the RoPE function's name and the
    mode (``"head"`` or ``"heads"``)."""

    q_norm: str
    k_norm: str
    rope: str
    mode: str


def _self_call(expr, attrs) -> ast.Call | None:
    """``self.<attr>(E)`` with attr in attrs, one positional argument and no keywords, or None."""
    if (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and isinstance(expr.func.value, ast.Name)
            and expr.func.value.id == "self" and expr.func.attr in attrs and len(expr.args) == 1
            and not expr.keywords and not isinstance(expr.args[0], ast.Starred)):
        return expr
    return None


def _norm_call(expr, attrs) -> ast.Call | None:
    """The norm call of ``self.<attr>(E)`` followed by ``.transpose(i, j)`` calls (constant dims,
    neither the last), or None."""
    while isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "transpose":
        dims = expr.args
        if (len(dims) != 2 or expr.keywords or not all(isinstance(d, ast.Constant) and isinstance(d.value, int)
                                                      and d.value >= 0 for d in dims)):
            return None
        expr = expr.func.value
    return _self_call(expr, attrs)


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _assigns(stmt, name: str):
    """The value of ``name = value``, or None."""
    if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == name):
        return stmt.value
    return None


def _transposes(value, name: str) -> bool:
    """Whether value is ``name.transpose(i, j)...`` (constant dims, neither the last)."""
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "transpose"
            and _norm_call(value, ()) is None and _chain_root(value) == name)


def _chain_root(value):
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "transpose":
        dims = value.args
        if len(dims) != 2 or value.keywords or not all(isinstance(d, ast.Constant) and isinstance(d.value, int)
                                                      and d.value >= 0 for d in dims):
            return None
        value = value.func.value
    return value.id if isinstance(value, ast.Name) else None


def _guarded_norm(stmt, name: str, attrs):
    """``if <cond>:`` holding exactly the two norm statements (``Q = self.<q_norm>(Q...)``, the
    same for K) and no ``else``: the norm call of name's, or None."""
    if not (isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 2):
        return None
    calls = {}
    for inner in stmt.body:
        if isinstance(inner, ast.Assign) and len(inner.targets) == 1 and isinstance(inner.targets[0], ast.Name):
            calls[inner.targets[0].id] = _norm_call(inner.value, attrs)
    return calls.get(name) if len(calls) == 2 and all(calls.values()) else None


def _source(stmts, i: int, name: str, attrs):
    """How ``name`` was set before statement i: ``(mode, norm statement index, norm call, guarded)``,
    or a reason it is not a fusable norm. Between the norm and statement i, only a reshape to
    heads (``name = name.view(hidden_shape).transpose(1, 2)``, or ``view(*hidden_shape)``: the norm
    is across heads) or, for a norm per head, transposes of other dims (``name = name.transpose(1,
    2)``) may touch it. The norms may sit in an ``if <cond>:`` of their own (GLM-4-MoE's ``if
    self.use_qk_norm:``)."""
    reshape = transposed = None
    for j in range(i - 1, -1, -1):
        if name not in _names(stmts[j]):
            continue
        text = ast.unparse(stmts[j])
        guarded = _guarded_norm(stmts[j], name, attrs)
        value = _assigns(stmts[j], name)
        if value is None and guarded is None:
            return f"{name} is set or read by `{text[:80]}` before the RoPE call"
        if value is not None and reshape is None and text in (f"{name} = {name}.view({shape}).transpose(1, 2)"
                                                              for shape in ("hidden_shape", "*hidden_shape")):
            reshape = j
            continue
        if value is not None and reshape is None and _transposes(value, name):
            transposed = j
            continue
        call = guarded or (_norm_call(value, attrs) if reshape is None else _self_call(value, attrs))
        if call is None or (reshape is not None and _self_call(call, attrs) is not call):
            return f"{name} comes from `{text[:80]}`, not from one of the attention's q/k norms"
        if reshape is not None and transposed is not None:
            return f"{name} is transposed after its reshape to heads"
        if reshape is not None and not any(ast.unparse(s) == HIDDEN_SHAPE for s in stmts[:j]):
            return f"{name} is reshaped by a hidden_shape other than `{HIDDEN_SHAPE}`"
        return ("head" if reshape is None else "heads"), j, call, guarded is not None
    return f"{name} is not set in the RoPE call's block"


def _rope_call(stmt, rope_names):
    """The call of ``Q2, K2 = <rope>(Q, K, ...)`` (or ``Q2, K2 = ...``'s value), or None."""
    if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name)
            and stmt.value.func.id in rope_names):
        return stmt.value
    return None


def fusion_rewrite(rope_names, norm_attrs):
    """(rewrite_block, found, refused): a rewrite (see ``_engine.method_rewrite_plan``) of each
    ``Q2, K2 = <rope>(Q, K, ...)`` statement (rope in rope_names) whose Q and K come from norms
    (``self.<attr>``, attr in norm_attrs) as the module docstring says, in the same block or in an
    ``if`` block it is the top of (``if cond: Q2, K2 = <rope>(...)``: the norms then run alone on
    the other branch). ``found`` lists the :class:`Site` of each one rewritten; ``refused`` says
    why for each RoPE call of q and k that is not (norms after RoPE, other statements between,
    other shapes)."""
    found: list[Site] = []
    refused: list[str] = []
    done: set[int] = set()

    def holder_call(holder, site, mode, rope, args, keywords):
        return ast.Call(func=ast.Name(holder, ast.Load()),
                        args=[ast.Name("self", ast.Load()), ast.Constant(site.q_norm), ast.Constant(site.k_norm),
                              mode, rope, *args], keywords=keywords)

    def match(stmts, i, stmt, before):
        """Site, norm statements' indices and calls for the RoPE statement stmt, whose q and k are
        set in stmts[:i]; ``before``: statements between stmts[i] and stmt (an if's test and body
        above it), which must not touch q or k. A reason where it does not match."""
        call = stmt.value
        args = call.args
        if len(args) < 2 or not all(isinstance(a, ast.Name) for a in args[:2]) or any(
                isinstance(a, ast.Starred) for a in args) or args[0].id == args[1].id:
            return f"`{ast.unparse(stmt)[:80]}` does not rotate two named tensors q and k"
        q, k = args[0].id, args[1].id
        if any(_self_call(n, norm_attrs) for later in stmts[i + 1:] for n in ast.walk(later)):
            return "q and k are normalized after RoPE (the fused op normalizes first)"
        if any({q, k} & _names(b) for b in before):
            return f"{q} or {k} is read between the norms and the RoPE call"
        sources = [_source(stmts, i, q, norm_attrs), _source(stmts, i, k, norm_attrs)]
        reasons = [s for s in sources if isinstance(s, str)]
        if reasons:
            return "; ".join(reasons)
        (q_mode, jq, q_call, q_guard), (k_mode, jk, k_call, k_guard) = sources
        if q_mode != k_mode:
            return f"{q} is normalized per {q_mode}, {k} per {k_mode}"
        if (q_guard or k_guard) and jq != jk:
            return f"{q}'s and {k}'s norms are not under one condition"
        if k in _names(q_call.args[0]) or q in _names(k_call.args[0]):
            return f"the norm of {q} reads {k}, or the other way round"
        site = Site(q_call.func.attr, k_call.func.attr, call.func.id, q_mode)
        return site, ((jq, q_call), (jk, k_call)), (q, k), q_guard

    def rewrite_block(stmts, holder):
        for i, stmt in enumerate(stmts):
            guard = None
            if isinstance(stmt, ast.If) and not isinstance(stmt.body[0], ast.If):
                inner = [(m, s) for m, s in enumerate(stmt.body) if _rope_call(s, rope_names)]
                if len(inner) != 1:
                    continue
                guard, (m, target) = stmt, inner[0]
                before = [stmt.test, *stmt.body[:m]]
            elif _rope_call(stmt, rope_names) is not None and id(stmt) not in done:
                target, before = stmt, []
            else:
                continue
            matched = match(stmts, i, target, before)
            if isinstance(matched, str):
                refused.append(matched)
                continue
            site, norms, (q, k), guarded = matched
            mode = ast.Constant(site.mode)
            if guarded:  # `if cond:` around the norms becomes `<flag> = cond`; the call passes mode or None
                j = norms[0][0]
                stmts[j] = located(ast.parse(f"{GUARD} = {ast.unparse(stmts[j].test)}").body, stmts[j])[0]
                mode = ast.IfExp(ast.Name(GUARD, ast.Load()), mode, ast.Constant(None))
            for j, norm in () if guarded else norms:
                new = _Unwrap(norm).visit(ast.parse(ast.unparse(stmts[j])).body[0])
                stmts[j] = located([new], stmts[j])[0]
            call = target.value
            fused_stmt = located([ast.Assign(targets=target.targets, value=holder_call(
                holder, site, mode, ast.Name(site.rope, ast.Load()), call.args, call.keywords))], target)[0]
            done.add(id(fused_stmt))
            if guard is None:
                stmts[i] = fused_stmt
            else:
                guard.body[m] = fused_stmt
                # the other branch: the norms alone (the holder with no RoPE function)
                norms_only = ast.Assign(targets=[ast.Tuple([ast.Name(q, ast.Store()), ast.Name(k, ast.Store())],
                                                           ast.Store())],
                                        value=holder_call(holder, site, mode, ast.Constant(None),
                                                          [ast.Name(q, ast.Load()), ast.Name(k, ast.Load())], []))
                guard.orelse = located([norms_only], guard) + guard.orelse
            found.append(site)

    return rewrite_block, found, refused


class _Unwrap(ast.NodeTransformer):
    """Replaces the norm call (compared by its text) with its argument."""

    def __init__(self, call):
        self.text = ast.unparse(call)

    def visit_Call(self, node):
        if ast.unparse(node) == self.text:
            return node.args[0]
        return self.generic_visit(node)


# --- where they are ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FusionSite:
    """A method of a model file that normalizes q and k and applies RoPE (``Class.method``).

    Attributes:
        module: the module's import name.
        method: ``Class.method``.
        norms: ``(attribute, class name)`` of each norm the method calls.
        norm_form: the norms' :class:`NormForm` (None when refused).
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


def find_sites(tree: ast.Module, module: str, rope_forms: dict, known_norms: dict, attribute,
               fused_signatures) -> list[FusionSite]:
    """The methods of a model file (``tree``, imported as ``module``) that call one of its q/k
    norms (attributes matching ``attribute``, a compiled regex) and one of its RoPE functions
    (``rope_forms``: name -> Form, None where refused), fused or with the reason they are not.
    ``known_norms``: norm fingerprint -> NormForm; ``fused_signatures``: the RoPE signatures a
    fusion can stand in for."""
    definitions = module_definitions(tree)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    sites = []
    for cls in classes.values():
        init, forward = _method(cls, "__init__"), _method(cls, "forward")
        if init is None or forward is None:
            continue
        bindings = _norm_bindings(init, attribute)
        called = {n.func.attr for n in ast.walk(forward) if _self_call(n, bindings)}
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
        rewrite_block, found, refused = fusion_rewrite(ropes, set(called))
        rewrite_each_block(copy.deepcopy(forward), lambda stmts, rb=rewrite_block: rb(stmts, "_"))
        if refused or not found:
            sites.append(site(None, None, "; ".join(refused) or "no RoPE call of two normalized tensors"))
        elif len({(f.rope, f.mode) for f in found}) != 1:
            sites.append(site(None, None, "it fuses more than one RoPE function or mode"))
        else:
            sites.append(site(forms.pop(), found[0]))
    return sites


def site_text(site: FusionSite) -> str:
    """One fusion site in a listing: fused with what, or why not."""
    if site.fused:
        across = "each head" if site.site.mode == "head" else "all heads of a token"
        return f"qk-norm {site.method}: fused, {site.norm_form.describe()}, over {across}"
    return f"qk-norm {site.method}: not fused: {site.reason}"


# --- the call ---------------------------------------------------------------------------------------


def _hooked(module) -> bool:
    hooks = torch.nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or hooks._global_forward_hooks
                or hooks._global_forward_pre_hooks or "forward" in module.__dict__)


def _norm_weight(norm, form: NormForm):
    if form.weight is None or (form.weight_if is not None and not getattr(norm, form.weight_if)):
        return None
    return getattr(norm, form.weight)


def _weight_ok(weight, form: NormForm, x: torch.Tensor, n: int) -> bool:
    if weight is None:
        return True
    if not isinstance(weight, torch.Tensor) or weight.shape != (n,) or weight.device != x.device:
        return False
    if form.output == "promote" and torch.promote_types(weight.dtype, x.dtype) != x.dtype:
        return False
    return weight.dtype in (x.dtype, torch.float32)


def fused(form: Form, norms: dict, ropes: tuple, args_of):
    """The replacement a fusion's holder calls, for a RoPE function of form ``form`` whose calls
    ``args_of(*args, **kwargs)`` turns into ``(cos, sin, unsqueeze_dim)``. ``norms``: norm
    attribute -> (the norm class its file defines, its :class:`NormForm`, its class's forward as
    patched); ``ropes``: the RoPE functions the name may hold for the fused path to stand in for
    it (the library's own and rope_ext's replacement)."""
    from rope_ext._ops import qk_norm_rotary

    def plan(module, q_attr, k_attr, mode, rope, q, k, cos, sin, unsqueeze_dim):
        """The op's arguments, or None where the model's own code must run."""
        if rope not in ropes or not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
            return None
        qn, kn = getattr(module, q_attr), getattr(module, k_attr)
        found = []
        for norm, attr in ((qn, q_attr), (kn, k_attr)):
            cls, norm_form, forward = norms[attr]
            if type(norm) is not cls or cls.forward is not forward or _hooked(norm):
                return None
            found.append(norm_form)
        if found[0] != found[1] or getattr(qn, found[0].eps) != getattr(kn, found[0].eps):
            return None
        norm_form = found[0]
        if q.dtype != k.dtype or q.dim() != k.dim() or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return None
        if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)) or cos.dtype != sin.dtype:
            return None
        compute, out = _dtypes(form, q, cos, q.dtype)
        if out != q.dtype or compute not in (q.dtype, torch.float32) or cos.dtype not in (q.dtype, torch.float32):
            return None
        if form.span == "suffix" or form.deinterleave_output or form.returns:
            return None
        cos, sin = _full_tables(form, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))
        width, head_dim = cos.shape[-1], q.shape[-1]
        if width > head_dim or (form.span == "whole" and width != head_dim) or width % 2:
            return None
        if mode == "heads":
            # q is (B, H, S, D), a view of the (B, S, H * D) rows the model normalizes
            if unsqueeze_dim != 1 or q.dim() != 4:
                return None
            q, k, cos, sin = q.transpose(1, 2), k.transpose(1, 2), cos.transpose(1, 2), sin.transpose(1, 2)
        wq, wk = _norm_weight(qn, norm_form), _norm_weight(kn, norm_form)
        rows = (lambda x: x.shape[-2] * x.shape[-1]) if mode == "heads" else (lambda x: x.shape[-1])
        if not (_weight_ok(wq, norm_form, q, rows(q)) and _weight_ok(wk, norm_form, k, rows(k))):
            return None
        return q, k, wq, wk, cos, sin, dict(eps=float(getattr(qn, norm_form.eps)), weight_offset=norm_form.offset,
                                            norm_over=mode, interleaved=form.interleaved)

    def call(module, q_attr, k_attr, mode, rope, q, k, *args, **kwargs):
        if mode is None:  # the model's condition turned its norms off
            return (q, k) if rope is None else rope(q, k, *args, **kwargs)
        op_args = None if rope is None else plan(module, q_attr, k_attr, mode, rope, q, k, *args_of(*args, **kwargs))
        if op_args is None:  # the model's own code (with rope None: the norms alone)
            qn, kn = getattr(module, q_attr), getattr(module, k_attr)
            if mode == "heads":
                q = qn(q.transpose(1, 2).flatten(-2)).unflatten(-1, q.shape[-3::2]).transpose(1, 2)
                k = kn(k.transpose(1, 2).flatten(-2)).unflatten(-1, k.shape[-3::2]).transpose(1, 2)
            else:
                q, k = qn(q), kn(k)
            return (q, k) if rope is None else rope(q, k, *args, **kwargs)
        *tensors, options = op_args
        q_out, k_out = qk_norm_rotary(*tensors, **options)
        if mode == "heads":
            q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
        return q_out, k_out

    return call
