"""Where QK-norm + RoPE is fused: the attention methods of a library's files that normalize q and
k and apply RoPE (:class:`FusionSite`), fused or refused, each refusal a :class:`FusionRefusal`.
A transformers attention method or a diffusers processor is fused only where the table of tested
fusions (``_qk_norm_table``) lists its code's fingerprint (:func:`lookup`, :func:`judge_by`); the
rewrite's own analysis (``_qk_norm_rewrite.probe``) runs offline, in ``tools/qk_norm_table.py``.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import hashlib
from typing import ClassVar

from rope_ext.integrations._engine import fingerprint, method_rewrite_plan, module_definitions
from rope_ext.integrations._qk_norm_call import NormForm
from rope_ext.integrations._qk_norm_rewrite import FusionRefusal, Site, _attr_call, fusion_rewrite
from rope_ext.integrations._qk_norm_table import Table


def norm_fingerprint(definitions: dict, node: ast.ClassDef) -> str:
    """A norm class's fingerprint (``_engine.fingerprint`` of its whole ``class`` block, methods,
    ``__init__`` and helpers it names included), its name left out: the same norm copied into
    another family's file under that family's name is the same form."""
    return fingerprint(definitions, _renamed(node))


def _renamed(node: ast.ClassDef) -> ast.ClassDef:
    out = copy.copy(node)
    out.name = "_"
    return out


# --- why a method is not fused ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Untested(FusionRefusal):
    """The method's code (or its norm classes) is not among the tested fusions: a release the table
    does not know, or an edited model file. ``patch()`` switches its RoPE alone and says so."""

    fingerprint: str
    warns: ClassVar[bool] = True

    def __str__(self) -> str:
        return (f"its code (fingerprint {self.fingerprint}) is not among the tested fusions; fusing it "
                "untested could change the model's results, so its norms and RoPE run unfused")


@dataclasses.dataclass(frozen=True)
class Unsupported(FusionRefusal):
    """A part the fused op does not stand in for: a norm class of no tested form, a RoPE function
    that is refused or whose tables the op does not take."""

    why: str

    def __str__(self) -> str:
        return self.why


@dataclasses.dataclass(frozen=True)
class Known(FusionRefusal):
    """Code the table records as not fused, with the reason the analysis gave when the table was
    made (its norms or RoPE not of a tested form, or an :class:`Unfusable` condition)."""

    why: str

    def __str__(self) -> str:
        return self.why


@dataclasses.dataclass(frozen=True)
class NotInstalled(FusionRefusal):
    """A listed fusion that failed its checks at install: its norm class replaced by another
    library, its method no longer the file's."""

    why: str
    warns: ClassVar[bool] = True

    def __str__(self) -> str:
        return f"rope_ext could not rewrite it: {self.why}"


def lookup(table: Table, key: str) -> Site | FusionRefusal:
    """The site the table lists for a method's fingerprint (see :func:`find_sites`), or the
    refusal: code the table records as not fused (:class:`Known`), or code it does not list
    (:class:`Untested`)."""
    if key in table.tested:
        return table.tested[key]
    if key in table.unfusable:
        return Known(table.unfusable[key])
    return Untested(key)


def judge_by(table: Table, key: str, unsupported: Unsupported | None) -> Site | FusionRefusal:
    """A site's fusion as the table says (:func:`lookup`), the judge ``patch()`` uses (see
    :func:`find_sites`). Code the table does not list is refused as untested even where its norms or
    RoPE are of no tested form (a new release's LayerNorm, or its RMS norm changed: which, no test
    has seen); a listed one whose parts are refused here keeps that refusal."""
    found = lookup(table, key)
    return unsupported if unsupported is not None and not isinstance(found, FusionRefusal) else found


def site_key(method_key: str, norms: list[tuple[str, str]]) -> str:
    """A fusion site's fingerprint: its method's (``_engine.fingerprint``, the helpers it names
    included) with each q/k norm attribute and what ``__init__`` binds it to (a norm class's
    :func:`norm_fingerprint`, or the binding's text): the same method code with other norms (one
    family's ``nn.Identity()``, another's RMS norm) is another site."""
    text = method_key + "".join(f"|{attr}={bound}" for attr, bound in sorted(norms))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class FusionSite:
    """A method of a library's file that normalizes q and k and applies RoPE (``Class.method``).

    Attributes:
        module: the module's import name.
        method: ``Class.method``.
        norms: ``(attribute, class name)`` of each q/k norm the class binds (transformers), or ()
            where the norms' classes are checked only at run time (diffusers' processors).
        norm_form: the norms' :class:`NormForm` (None when refused, or checked at run time).
        site: what the rewrite fuses (None when refused).
        refusal: why it is not fused (None when it is).
        fingerprint: the site's (:func:`site_key`: its method's code and its norm classes), the table's key.
    """

    module: str
    method: str
    norms: tuple[tuple[str, str], ...]
    norm_form: NormForm | None
    site: Site | None
    refusal: FusionRefusal | None = None
    fingerprint: str | None = None

    @property
    def fused(self) -> bool:
        return self.site is not None

    @property
    def reason(self) -> str | None:
        return None if self.refusal is None else str(self.refusal)

    def refused(self, refusal: FusionRefusal) -> FusionSite:
        return dataclasses.replace(self, norm_form=None, site=None, refusal=refusal)


def _method(cls: ast.ClassDef, name: str):
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _norm_bindings(init: ast.FunctionDef, attribute) -> dict[str, set[str]]:
    """attribute name -> what ``__init__`` binds ``self.<attribute>`` to: a class name, or the text
    of another expression (each branch of ``A(...) if cond else B(...)`` on its own)."""
    out: dict[str, set[str]] = {}
    for stmt in ast.walk(init):
        if not isinstance(stmt, ast.Assign):
            continue
        for target in stmt.targets:
            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
                    and attribute.match(target.attr)):
                choice = isinstance(stmt.value, ast.IfExp)
                for value in (stmt.value.body, stmt.value.orelse) if choice else (stmt.value,):
                    name = value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None
                    out.setdefault(target.attr, set()).add(name or ast.unparse(value))
    return out


# How an ``__init__`` binds a norm attribute to no norm at all (Qwen3-Omni-MoE's Code2Wav attention:
# ``self.q_norm = nn.Identity()``): an attention whose q/k norms are all such normalizes neither.
_IDENTITY = frozenset({"nn.Identity()", "torch.nn.Identity()", "Identity"})


def torch_norm(bound: str, torch_norms: dict):
    """The (class, NormForm) of a binding to one of torch's norm classes (``nn.LayerNorm(...)``, a
    name of ``torch_norms``), or None."""
    callee = bound.split("(", 1)[0] if bound.endswith(")") else None
    return torch_norms.get(callee)


def find_sites(tree: ast.Module, module: str, rope_forms: dict, known_norms: dict, attribute,
               fused_signatures, judge, torch_norms: dict | None = None) -> list[FusionSite]:
    """The attention methods (``forward``) of a transformers model file (``tree``, imported as
    ``module``) that call one of their q/k norms (attributes matching ``attribute``, a compiled
    regex, bound in ``__init__``, not all to ``nn.Identity()``) and one of the file's RoPE functions
    (``rope_forms``: name -> Form, None where refused), fused or with the reason they are not.

    Args:
        known_norms: norm fingerprint -> NormForm.
        torch_norms: the names of torch's norm classes a binding may call (``nn.LayerNorm``) ->
            (class, NormForm).
        fused_signatures: the RoPE signatures a fusion can stand in for.
        judge: ``judge(fingerprint, unsupported, node, owner, ropes, norm_attrs)`` -> the method's
            :class:`Site`, or a :class:`FusionRefusal`; ``fingerprint`` is :func:`site_key`'s;
            ``unsupported`` is None where the method's norms and RoPE are of forms the fused op
            takes, else an :class:`Unsupported` saying why not. At ``patch()`` time the table's word
            (:func:`lookup`), offline the rewrite's own analysis.
    """
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
        if not called or not ropes or all(bindings[attr] <= _IDENTITY for attr in called):
            continue
        # (a norm that may be bound to nn.Identity() as well, where the model turns QK-norm off, is
        # judged by its class: an Identity instance fails the fused call's check of the norm's class,
        # and the model's code runs)
        norms = tuple(sorted((attr, "|".join(sorted(bindings[attr] - _IDENTITY or bindings[attr]))) for attr in called))
        norm_keys = {attr: norm_fingerprint(definitions, classes[bound]) if bound in classes else bound
                     for attr, bound in norms}
        key = site_key(fingerprint(definitions, forward), list(norm_keys.items()))
        site = FusionSite(module=module, method=f"{cls.name}.forward", norms=norms, norm_form=None, site=None,
                          fingerprint=key)
        reason, forms = None, set()
        for attr, bound in norms:
            external = torch_norm(bound, torch_norms or {})
            if external is not None:
                forms.add(external[1])
                continue
            if bound not in classes:
                reason = f"self.{attr} is {bound}: not a norm class its file defines or a tested torch one"
                break
            if norm_keys[attr] not in known_norms:
                reason = (f"self.{attr}'s class {bound} (fingerprint {norm_keys[attr]}) matches no tested "
                          "norm form")
                break
            forms.add(known_norms[norm_keys[attr]])
        if reason is None and len(forms) != 1:
            reason = "q's and k's norms are of different forms"
        for rope in sorted(ropes):
            form = rope_forms[rope]
            if reason is None and (form is None or form.signature not in fused_signatures):
                reason = (f"{rope} is refused" if form is None else
                          f"{rope}'s signature ({form.signature}) has no fused call yet")
        found = judge(key, None if reason is None else Unsupported(reason), forward, "self", ropes, set(called))
        if isinstance(found, Site) and found.cast and not next(iter(forms)).casts_to_x:
            found = Unsupported("its norms' results are cast, and its norm class does not return x's dtype on every "
                                "path (the fused call's fallbacks run the norms without the cast)")
        sites.append(site.refused(found) if isinstance(found, FusionRefusal) else
                     dataclasses.replace(site, norm_form=forms.pop(), site=found))
    return sites


def rewrite_plan(group: str, module, node: ast.FunctionDef, site: FusionSite, call, patcher,
                 prepare=lambda fn: fn) -> list:
    """The assignments (``_engine.method_rewrite_plan``'s) that rewrite site's method, ``node`` as
    its file defines it, into calls of ``call``; ``prepare(fn)`` edits the copy first, as the site
    was classified on (diffusers' inline RoPE statements read as calls). Raises ValueError where
    the method is not the file's, or no longer holds the site it was classified with."""
    found = []

    def rewrite(fn, holder):
        prepare(fn)
        s = site.site
        found.append(fusion_rewrite(fn, s.owner, {s.rope}, {s.q_norm, s.k_norm}, holder))

    plan = method_rewrite_plan(group, module, site.method, node, rewrite, call, patcher)
    if found != [site.site]:  # the site classified (from the table, for transformers) is what the rewrite finds
        raise ValueError(f"{site.method} does not hold the site it was classified with: the rewrite found {found}")
    return plan


def site_text(site: FusionSite) -> str:
    """One fusion site in a listing: fused with what, or why not."""
    if site.fused:
        across = {"head": "each head", "heads_bhsd": "all heads of a token", "heads_bshd": "all heads of a token",
                  "after": "each head, after RoPE", "single": "each head, q and k in calls of their own",
                  "tuples": "each head, pairs of tensors normalized, then rotated, by tuple statements"}
        what = f"{site.norm_form.describe()}, " if site.norm_form else ""
        stream = site.site.stream
        joined = "" if stream is None else (
            f"; with the {stream.q}/{stream.k} stream it joins {'in front of' if stream.first else 'after'} q and k "
            f"({site.site.owner}.{stream.q_norm}/{stream.k_norm}), each with its rows of the tables")
        rotated = site.site.rotated
        partial = "" if rotated is None else f", its first {rotated} columns rotated (sliced and joined)"
        sliced = site.site.sliced
        if sliced is not None:
            partial += (f", RoPE written into the rows of dim {sliced.dim} from {sliced.start} on"
                        + (f" (k's where {sliced.guard})" if sliced.guard else ""))
        return f"qk-norm {site.method}: fused, {what}over {across[site.site.mode]}{partial}{joined}"
    return f"qk-norm {site.method}: not fused: {site.reason}"
