"""Switch HF transformers models onto rope_ext's fused op.

    from rope_ext.integrations import transformers as rope_hf

    patched = rope_hf.patch()            # every family of the installed transformers rope_ext can express
    ...
    rope_hf.unpatch()                    # back to transformers' own functions

    with rope_hf.patch(["llama"]):       # or for a block only
        model(...)

    python -m rope_ext.integrations.transformers   # every family, its form, patched or why not

Which families are patched is decided from the installed transformers' code, not from a list of
names: each model file's RoPE functions (``apply_rotary_pos_emb``, ``apply_rotary_pos_emb_vision``,
``apply_rotary_pos_emb_interleave``, ``apply_rotary_emb``) are parsed together with the helpers they
call (their own ``rotate_half``) and matched against the forms rope_ext has been tested on (see
``_hf_forms``). A function whose code matches no known form is refused by name, with the reason.

``patch`` replaces the module-level function, which is what the attention layers call, once per layer
and step. With the ``kernels`` package installed transformers turns that function into a small
``nn.Module`` and keeps the original in each attention layer's ``_kernel_funcs``; attention still
calls the module-level name, so the patch reaches it either way. The families' rotary embedding
modules are left alone: they run once per forward, not per layer; use
``rope_ext.RotaryEmbedding.from_hf_config`` where float64-exact tables at long context matter.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import os
import re

from rope_ext.integrations import _engine, _hf_forms, _qk_norm_fusion, _rotate

__all__ = ["FamilyReport", "RopeFunction", "family_report", "patch", "patched_families", "survey", "unpatch"]


@dataclasses.dataclass(frozen=True)
class RopeFunction:
    """One RoPE function of a transformers model file.

    Attributes:
        module: the module's import name, e.g. ``transformers.models.llama.modeling_llama``.
        name: the function's name in it.
        form: the recognised form, or None.
        reason: why it is refused (None when it has a form).
        fingerprint: its code's (see ``_engine.fingerprint``).
    """

    module: str
    name: str
    form: _rotate.Form | None
    reason: str | None = None
    fingerprint: str | None = None

    @property
    def replacement(self):
        """rope_ext's stand-in for this function (None when refused)."""
        return None if self.form is None else _replacement(self.form)


@dataclasses.dataclass(frozen=True)
class FamilyReport:
    """A model family's RoPE functions (it is patchable when every one of them has a form) and its
    attention methods that normalize q and k and apply RoPE (``qk_norms``: fused, or why not)."""

    family: str
    functions: tuple[RopeFunction, ...]
    qk_norms: tuple[_qk_norm_fusion.FusionSite, ...] = ()

    @property
    def patchable(self) -> bool:
        return all(f.form is not None for f in self.functions)

    @property
    def reason(self) -> str | None:
        refused = [f"{f.name}: {f.reason}" for f in self.functions if f.form is None]
        return "; ".join(refused) or None

    @property
    def qk_norm_fused(self) -> bool | None:
        """Whether every QK-norm of the family is fused (None: it has none)."""
        return all(site.fused for site in self.qk_norms) if self.qk_norms else None


_replacement = functools.lru_cache(maxsize=None)(_hf_forms.replacement)


def _classify_file(path: str, module: str) -> tuple[list[RopeFunction], list[_qk_norm_fusion.FusionSite]]:
    with open(path, encoding="utf-8") as f:
        source = f.read()
    if not any(f"def {name}(" in source for name in _hf_forms.ROPE_FUNCTIONS):
        return [], []
    tree = ast.parse(source, filename=path)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    definitions = _engine.module_definitions(tree)
    found = []
    for name in _hf_forms.ROPE_FUNCTIONS:
        if name not in functions:
            continue
        key = _engine.fingerprint(definitions, name)
        form = _hf_forms.KNOWN.get(key)
        reason = None if form else _engine.refusal(key)
        found.append(RopeFunction(module, name, form, reason, key))
    sites = _qk_norm_fusion.find_sites(tree, module, {f.name: f.form for f in found}, _hf_forms.KNOWN_NORMS,
                                       re.compile(_hf_forms.NORM_ATTRIBUTE), _hf_forms.FUSED_TABLES)
    return found, sites


def _models_root() -> str:
    import transformers.models

    return os.path.dirname(transformers.models.__file__)


@functools.cache
def family_report(family: str) -> FamilyReport | None:
    """The RoPE functions of one family of the installed transformers, classified from its source;
    None when it has none (or no such family exists)."""
    folder = os.path.join(_models_root(), family)
    if not family.isidentifier() or not os.path.isdir(folder):
        return None
    functions, sites = [], []
    for file in sorted(os.listdir(folder)):
        if file.startswith("modeling_") and file.endswith(".py"):
            more, more_sites = _classify_file(os.path.join(folder, file), f"transformers.models.{family}.{file[:-3]}")
            functions += more
            sites += more_sites
    return FamilyReport(family, tuple(functions), tuple(sites)) if functions else None


def survey() -> dict[str, FamilyReport]:
    """Every family of the installed transformers with a RoPE function, classified from its source
    (nothing is imported; about 5 s the first time). Keys are the family names (the folders of
    ``transformers.models``, which are the ``config.model_type`` of most), sorted."""
    reports = {}
    for family in sorted(os.listdir(_models_root())):
        report = family_report(family)
        if report is not None:
            reports[family] = report
    return reports


_patcher = _engine.Patcher()


def patch(model_types=None, *, strict: bool = False, qk_norm: bool = True) -> _engine.Patched:
    """Switch transformers model families onto rope_ext.

    Args:
        model_types: family names (``config.model_type``, e.g. ``"llama"``), or None for every
            family of the installed transformers whose RoPE rope_ext can express (see
            :func:`survey`; this imports those families' model files, a few seconds in all).
            Families refused then (code that matches no tested form, most often a transformers
            release that changed it) keep transformers' code, named in a
            ``_engine.RefusedWarning`` once per process.
        strict: with ``model_types=None``, make a refused family an error instead of a warning.
        qk_norm: also fuse each attention's q/k RMS norms into its RoPE call, one
            :func:`rope_ext.qk_norm_rotary` call for q and k, where the family's ``qk_norms``
            say it is fused (Qwen3, Gemma 3, OLMo 2, ...; see the listing). Each call checks that
            the attention's norms are still the file's classes, unhooked, and runs transformers'
            own code where they are not.

    Returns:
        The families this call switched (a list, usable as a context manager, which unpatches
        them on exit); families an earlier call patched stay with that call, so nesting a
        ``with patch(...)`` inside a longer patch leaves the outer one in place.

    Raises:
        ValueError: a requested family (with ``strict``, any family) has no RoPE function in the
            installed transformers, or one of its functions is refused (its code matches no tested
            form), or the function found at run time is not the one in its model file (someone else
            replaced it). Nothing is patched then: all checks run before any change.
    """
    if model_types is None:
        reports = survey()
        refused = {f: r.reason for f, r in reports.items() if not r.patchable}
        families = _engine.patchable_or_warn("transformers", refused, [f for f in reports if f not in refused], strict)
    else:
        families = _engine.group_names(model_types, "model_types")
    plan = []
    for family in families:
        report = family_report(family)
        if report is None:
            raise ValueError(
                f"rope_ext: cannot patch {family!r}: the installed transformers has no model family of that name "
                "with a RoPE function (run `python -m rope_ext.integrations.transformers` for the list)"
            )
        if not report.patchable:
            raise ValueError(f"rope_ext: cannot patch {family!r}: {report.reason}")
        for fn in report.functions:
            module = importlib.import_module(fn.module)
            current = _patcher.original(family, module, fn.name, None)
            if not _engine.defined_here(current, module, fn.name):
                raise ValueError(
                    f"rope_ext: cannot patch {family!r}: {fn.module}.{fn.name} is {current!r}, not the function "
                    "its model file defines (was it replaced by another patch?)"
                )
            plan.append((family, module, fn.name, fn.replacement))
        if qk_norm and family not in _patcher.groups():  # a family an earlier call patched stays as it made it
            for site in report.qk_norms:
                if site.fused:
                    plan += _fusion_plan(family, report, site)
    return _patcher.apply(plan, unpatch)


@functools.cache
def _fused_call(module: str, method: str, norms: tuple, ropes: tuple, form, pair: bool):
    """One replacement per attention method for the process's life (see ``_engine.HOLDER_PREFIX``)."""
    call = _qk_norm_fusion.fused(dict(norms), ropes, _hf_forms.FUSED_TABLES[form.signature](form), pair=pair)
    call.__qualname__ = f"fused_qk_norm_rope[{method}]"
    return call


def _fusion_plan(family: str, report: FamilyReport, site: _qk_norm_fusion.FusionSite) -> list:
    """The rewrite of one attention method's norms and RoPE call into one fused call; [] where its
    norm classes are no longer the file's (another library replaced them: its norms then run as
    that library made them, with rope_ext's RoPE)."""
    module = importlib.import_module(site.module)
    norms = {}
    for _, cls_name in site.norms:
        cls = getattr(module, cls_name, None)
        forward = getattr(cls, "forward", None)
        if getattr(getattr(forward, "__code__", None), "co_filename", None) != module.__file__:
            return []
        norms[cls] = (site.norm_form, forward)
    fn = next(f for f in report.functions if f.module == site.module and f.name == site.site.rope)
    ropes = (_patcher.original(family, module, fn.name), fn.replacement)
    call = _fused_call(site.module, site.method, tuple(norms.items()), ropes, fn.form, site.site.pair)
    with open(module.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=module.__file__)
    node = dict(_engine.function_defs(tree))[site.method]
    try:
        return _qk_norm_fusion.rewrite_plan(family, module, node, site, call, _patcher)
    except ValueError as e:
        raise ValueError(f"rope_ext: cannot patch {family!r}: {e}") from None


def unpatch(model_types=None) -> list[str]:
    """Restore transformers' own functions for the given families (default: all patched ones)."""
    return _patcher.restore(None if model_types is None else _engine.group_names(model_types, "model_types"))


def patched_families() -> list[str]:
    """The families currently switched to rope_ext."""
    return _patcher.groups()


def main() -> None:
    """Print every family of the installed transformers with its RoPE form, patched or why not, and
    its QK-norms, fused or why not."""
    import transformers

    reports = survey()
    patched = _engine.print_listing(
        reports, lambda report: [_engine.site_text(fn.name, fn.form, fn.reason) for fn in report.functions]
        + [_qk_norm_fusion.site_text(site) for site in report.qk_norms])
    with_norms = [r for r in reports.values() if r.qk_norms]
    print(f"\ntransformers {transformers.__version__}: {len(reports)} families with RoPE; "
          f"{patched} patched, {len(reports) - patched} refused")
    print(f"{len(with_norms)} normalize q and k with a module of their attention and apply RoPE: "
          f"{sum(bool(r.qk_norm_fused) for r in with_norms)} fused in every attention, "
          f"{sum(r.qk_norm_fused is False and any(s.fused for s in r.qk_norms) for r in with_norms)} in some, "
          f"{sum(not any(s.fused for s in r.qk_norms) for r in with_norms)} in none")


if __name__ == "__main__":
    main()
