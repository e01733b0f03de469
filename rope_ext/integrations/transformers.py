"""Switch HF transformers models onto rope_ext's fused op.

    from rope_ext.integrations import transformers as rope_hf

    patched = rope_hf.patch()            # every family of the installed transformers rope_ext can express,
    ...                                  # switched as its modeling module is imported
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
import sys
import threading

from rope_ext.integrations import _engine, _hf_forms, _qk_norm_call, _qk_norm_sites, _qk_norm_table, _rotate

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
    qk_norms: tuple[_qk_norm_sites.FusionSite, ...] = ()

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


def _modeling_file(file: str) -> bool:
    """A model file of torch code: ``modeling_*.py``, without 4.x's TensorFlow (``modeling_tf_``)
    and Flax (``modeling_flax_``) twins, which torch models never run."""
    return file.startswith("modeling_") and file.endswith(".py") and not file.startswith(("modeling_tf_",
                                                                                         "modeling_flax_"))


def _stamp(path: str) -> tuple[int, int]:
    """What tells one version of a file from another: its modification time and size."""
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size


@functools.cache
def _tree(path: str, stamp: tuple[int, int]) -> ast.Module | None:
    """The file's syntax tree (None where it defines no RoPE function), parsed once per version of
    the file: classifying it and rewriting its methods read the same tree."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    if not any(f"def {name}(" in source for name in _hf_forms.ROPE_FUNCTIONS):
        return None
    return ast.parse(source, filename=path)


@functools.cache
def _classify_file(path: str, module: str, stamp: tuple[int, int]) -> tuple[tuple, tuple]:
    """(RoPE functions, fusion sites) of one version of a model file (``stamp``: see _stamp)."""
    tree = _tree(path, stamp)
    if tree is None:
        return (), ()
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
    return tuple(found), tuple(_fusion_sites(tree, module, found, _table_judge))


def _table_judge(key: str, unsupported, *_):
    """A method's fusion as transformers' table says (``_qk_norm_sites.judge_by``)."""
    return _qk_norm_sites.judge_by(_qk_norm_table.TRANSFORMERS, key, unsupported)


def _fusion_sites(tree: ast.Module, module: str, functions, judge) -> list:
    """The file's attention methods that normalize q and k and apply RoPE (``_qk_norm_sites.find_sites``
    with this library's norms and RoPE functions), each as ``judge`` says."""
    return _qk_norm_sites.find_sites(tree, module, {f.name: f.form for f in functions}, _hf_forms.KNOWN_NORMS,
                                     re.compile(_hf_forms.NORM_ATTRIBUTE), _hf_forms.FUSED_TABLES, judge,
                                     _hf_forms.TORCH_NORMS)


def _models_root() -> str:
    import transformers.models

    return os.path.dirname(transformers.models.__file__)


def family_report(family: str) -> FamilyReport | None:
    """The RoPE functions of one family of the installed transformers, classified from its source
    (each version of a file once: a file edited since is classified again); None when it has none
    (or no such family exists). A model file rope_ext fails to read or classify is a refused
    function (named by its file) with the failure as its reason."""
    folder = os.path.join(_models_root(), family)
    if not family.isidentifier() or not os.path.isdir(folder):
        return None
    functions, sites = [], []
    for file in sorted(os.listdir(folder)):
        if _modeling_file(file):
            module, path = f"transformers.models.{family}.{file[:-3]}", os.path.join(folder, file)
            try:
                more, more_sites = _classify_file(path, module, _stamp(path))
            except Exception as e:  # noqa: BLE001  (a file written for another Python, a classifier bug)
                more = [RopeFunction(module, file, None, f"rope_ext could not classify it: {_engine.failure(e)}")]
                more_sites = []
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


# --- switching families as their modeling modules are imported ---------------------------------------
#
# ``patch()`` classifies and switches only the families whose modeling modules are imported already;
# the others are switched by an import hook right after their module runs, before the importer gets
# it. A cold ``patch()`` costs what the imported families cost, not the ~200 families' imports.

_patcher = _engine.Patcher()
_MODULE = re.compile(r"transformers\.models\.(\w+)\.(modeling_\w+)")


@dataclasses.dataclass(eq=False)
class _Request:
    """What one ``patch()`` call asked for: ``families`` (None: every family), less those unpatched
    by name since; ``switched`` is the list it returned: the families it holds."""

    families: set | None
    qk_norm: bool
    switched: _engine.Patched
    excluded: set = dataclasses.field(default_factory=set)

    def wants(self, family: str) -> bool:
        return family not in self.excluded and (self.families is None or family in self.families)


# Guards _requests and _holders. The import hook's callback takes it while its module's import lock
# is held, so nothing imports while holding it, but torch.compiler.reset() on unpatch, which may
# import torch._dynamo the first time (no modeling module: no cycle).
_lock = threading.RLock()
_requests: list[_Request] = []  # the calls still waiting for some family's import, oldest first
_holders: dict[str, _Request] = {}  # family -> the call that switched it (it switches the family's later modules)


def _family_of(name: str) -> str | None:
    match = _MODULE.fullmatch(name)
    return match[1] if match and _modeling_file(match[2] + ".py") else None


def _watched(name: str) -> bool:
    family = _family_of(name)
    return family is not None and (family in _holders or any(r.wants(family) for r in _requests))


def _plan(family: str, modules: dict, qk_norm: bool) -> tuple[list, FamilyReport | None]:
    """The assignments that switch the given imported modeling modules of a family (name ->
    module), and the family's report as installing them leaves it: a function found replaced at run
    time is refused there, and so is a fused method whose rewrite fails (the family's RoPE is
    switched without it), each with the reason. Nothing is assigned."""
    report = family_report(family)
    if report is None or not report.patchable:
        return [], report
    plan, functions, sites = [], list(report.functions), list(report.qk_norms)
    for i, fn in enumerate(functions):
        if fn.module in modules:
            module = modules[fn.module]
            current = _patcher.original(family, module, fn.name, None)
            if _engine.defined_here(current, module, fn.name):
                plan.append((family, module, fn.name, fn.replacement))
            else:
                functions[i] = dataclasses.replace(fn, form=None, reason=(
                    f"{fn.module}.{fn.name} is {current!r}, not the function its model file defines "
                    "(was it replaced by another patch?)"))
    report = dataclasses.replace(report, functions=tuple(functions))
    if not report.patchable:
        return [], report
    for i, site in enumerate(sites):
        if qk_norm and site.fused and site.module in modules:
            try:
                plan += _fusion_plan(family, report, site, modules[site.module])
            except Exception as e:  # noqa: BLE001  (any failure to rewrite one method refuses that method)
                sites[i] = site.refused(_qk_norm_sites.NotInstalled(_engine.failure(e)))
    return plan, dataclasses.replace(report, qk_norms=tuple(sites))


def _refusals(family: str, report: FamilyReport, qk_norm: bool) -> dict[str, str]:
    """What is refused of a family, as installing it leaves it (see :func:`_plan`): the family, or
    (``qk_norm``) the attention methods whose refusal warns: code the table of tested fusions does
    not list, a listed fusion that failed at install."""
    if not report.patchable:
        return {family: report.reason}
    return {f"{family} (qk-norm {s.method})": s.reason for s in report.qk_norms
            if qk_norm and s.refusal is not None and s.refusal.warns}


def _switch(request: _Request, modules: dict[str, dict], forget: bool, named: bool = False) -> None:
    """Switch the given imported modules (family -> {name: module}) for request, ``_lock`` held,
    each family as installing it allows. The refusals are said first (a warning; with ``named``, a
    refused family is a ValueError), so that where the warnings filters make that an error nothing
    has changed."""
    plans, refused = {}, {}
    for family, names in modules.items():
        plan, report = _plan(family, names, request.qk_norm)
        if report is None:
            continue
        if named and not report.patchable:
            raise ValueError(f"rope_ext: cannot patch {family!r}: {report.reason}")
        refused.update(_refusals(family, report, request.qk_norm))
        if report.patchable:
            plans[family] = plan
        elif _holders.get(family) is not None:  # switched, then its file edited and run again: now refused
            _holders.pop(family)
            _patcher.restore([family])
    _engine.refuse("transformers", refused, strict=False, stacklevel=4)
    for family in plans:
        holder = _holders.setdefault(family, request)
        if family not in holder.switched:
            holder.switched.append(family)
    _patcher.apply([a for plan in plans.values() for a in plan], unpatch, forget=forget)


def _imported(module) -> None:
    """The import hook's callback: switch the module's family where a patch() call wants it. A
    module run again (``importlib.reload``) is switched afresh: what was switched of its old objects
    is forgotten, and a file edited since is classified again."""
    family = _family_of(module.__name__)
    with _lock:
        request = _holders.get(family) or next((r for r in _requests if r.wants(family)), None)
        if request is None:
            return
        name = module.__name__
        _patcher.forget(family, lambda obj: obj is module or getattr(obj, "__module__", None) == name)
        _switch(request, {family: {name: module}}, forget=False)
        _prune()


_watch = _engine.ImportWatch(_watched, _imported)


def _prune() -> None:
    """Drop the calls that wait for nothing more, and the hook once nothing waits (``_lock`` held)."""
    _requests[:] = [r for r in _requests if r.families is None or any(r.wants(f) and f not in _holders
                                                                    for f in r.families)]
    if _requests or _holders:
        _watch.install()
    else:
        _watch.remove()


def _imported_modules(wanted) -> dict[str, dict]:
    """family -> {name: module} of its modeling modules imported now, for the families ``wanted``
    accepts. A module still running its code (another thread imports it) is left to the hook."""
    out: dict[str, dict] = {}
    for name, module in list(sys.modules.items()):
        family = _family_of(name)
        if family is not None and module is not None and wanted(family):
            if not getattr(getattr(module, "__spec__", None), "_initializing", False):
                out.setdefault(family, {})[name] = module
    return out


def installed_report(family: str, qk_norm: bool = True) -> FamilyReport | None:
    """The family's report as ``patch()`` would leave it: :func:`family_report`, with its modeling
    modules imported and each function and fused method checked as installing them checks (a
    function someone else replaced, a method whose rewrite fails, a module that fails to import:
    refused, with the reason). Nothing is patched."""
    report = family_report(family)
    if report is None or not report.patchable:
        return report
    modules = {}
    for name in sorted({fn.module for fn in report.functions} | {s.module for s in report.qk_norms}):
        try:
            modules[name] = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001  (an optional package it needs is not installed, say)
            functions = tuple(dataclasses.replace(fn, form=None, reason=f"{name} fails to import: "
                                                  f"{_engine.failure(e)}") if fn.module == name else fn
                              for fn in report.functions)
            return dataclasses.replace(report, functions=functions)
    with _lock:
        return _plan(family, modules, qk_norm)[1]


def patch(model_types=None, *, strict: bool = False, qk_norm: bool = True) -> _engine.Patched:
    """Switch transformers model families onto rope_ext.

    A family is switched at once where its modeling module is imported already, and otherwise right
    after it is imported (an import hook), before any model of it exists; each family's code is
    classified from its source (see :func:`family_report`) when it is switched. So ``patch()``
    before building a model costs no imports, and a model built afterwards runs rope_ext.

    Args:
        model_types: family names (``config.model_type``, e.g. ``"llama"``), or None for every
            family of the installed transformers whose RoPE rope_ext can express. A family refused
            then (code that matches no tested form, most often a transformers release that changed
            it, or a function found replaced) keeps transformers' code, named in a
            ``_engine.RefusedWarning`` once per process when it is met; so does an attention
            method that normalizes q and k whose code is not among the tested fusions
            (``_qk_norm_table``; named by its fingerprint), or whose fusion rope_ext fails to
            install, its family's RoPE switched all the same.
        strict: make any refusal an error instead, found before anything is patched: the families
            named (every family, with ``model_types=None``) are classified and their modeling
            modules imported now (seconds, for all of them).
        qk_norm: also fuse each attention's q/k RMS norms into its RoPE call, one
            :func:`rope_ext.qk_norm_rotary` call for q and k, where the family's ``qk_norms``
            say it is fused (Qwen3, Gemma 3, OLMo 2, ...; see the listing): only code the table
            of tested fusions lists, each entry run against stock by rope_ext's tests. Each call checks that
            the attention's norms are still the file's classes, unhooked, and runs transformers'
            own code where they are not.

    Returns:
        The families this call switched: a list that grows as further modeling modules are
        imported. As a context manager it unpatches them on exit, and the call stops switching
        families. A family an earlier call switched or waits for stays with that call, so nesting
        a ``with patch(...)`` inside a longer patch leaves the outer one in place. A switch of
        code already imported, and an unpatch, call ``torch.compiler.reset()`` (every compiled
        model recompiles once; see ``_engine.forget_compiled``); a switch at import does not.

    Raises:
        ValueError: a requested family has no RoPE function in the installed transformers, or one of
            its functions is refused, or (imported already) is not the function its model file
            defines; with ``strict``, any refusal. Nothing is patched then.
    """
    families = None if model_types is None else _engine.group_names(model_types, "model_types")
    for family in families or ():
        report = family_report(family)
        if report is None:
            raise ValueError(
                f"rope_ext: cannot patch {family!r}: the installed transformers has no model family of that name "
                "with a RoPE function (run `python -m rope_ext.integrations.transformers` for the list)"
            )
        if not report.patchable:
            raise ValueError(f"rope_ext: cannot patch {family!r}: {report.reason}")
    if strict:
        refused = {}
        for family in survey() if families is None else families:
            refused.update(_refusals(family, installed_report(family, qk_norm), qk_norm))
        _engine.refuse("transformers", refused, strict=True)
    request = _Request(None if families is None else set(families), qk_norm, _engine.Patched(undo=unpatch))
    request.switched.request = request
    with _lock:
        # the hook first: a module imported from now on is the hook's, one imported before is switched here
        _requests.append(request)
        _watch.install()
        try:
            _switch(request, _imported_modules(lambda f: request.wants(f) and f not in _holders), forget=True,
                    named=families is not None)
        except BaseException:  # a refused family named, or a warning made an error: nothing was switched
            _requests.remove(request)
            raise
        finally:
            _prune()
    return request.switched


@functools.cache
def _fused_call(module: str, method: str, norms: tuple, ropes: tuple, form, pair: bool):
    """One replacement per attention method for the process's life (see ``_engine.HOLDER_PREFIX``)."""
    call = _qk_norm_call.fused(dict(norms), ropes, _hf_forms.FUSED_TABLES[form.signature](form), pair=pair)
    call.__qualname__ = f"fused_qk_norm_rope[{method}]"
    return call


def _fusion_plan(family: str, report: FamilyReport, site: _qk_norm_sites.FusionSite, module) -> list:
    """The rewrite of one attention method's norms and RoPE call into one fused call. Raises
    ValueError where its norm classes are no longer the file's (another library replaced them),
    or the method is not the file's."""
    norms = {}
    for _, cls_name in site.norms:
        external = _qk_norm_sites.torch_norm(cls_name, _hf_forms.TORCH_NORMS)
        if external is not None:  # torch's class, whose forward must be torch's own
            cls = external[0]
            forward = cls.forward
            if getattr(forward, "__module__", None) != cls.__module__:
                raise ValueError(f"{cls!r}'s forward is {forward!r}, not torch's (replaced by another library?)")
            norms[cls] = (site.norm_form, forward)
            continue
        cls = getattr(module, cls_name, None)
        forward = getattr(cls, "forward", None)
        if getattr(getattr(forward, "__code__", None), "co_filename", None) != module.__file__:
            raise ValueError(f"{site.module}.{cls_name} is {cls!r} with forward {forward!r}, not the norm class "
                             "its file defines (replaced by another library?)")
        norms[cls] = (site.norm_form, forward)
    fn = next(f for f in report.functions if f.module == site.module and f.name == site.site.rope)
    ropes = (_patcher.original(family, module, fn.name), fn.replacement)
    call = _fused_call(site.module, site.method, tuple(norms.items()), ropes, fn.form, site.site.pair)
    node = dict(_engine.function_defs(_tree(module.__file__, _stamp(module.__file__))))[site.method]
    return _qk_norm_sites.rewrite_plan(family, module, node, site, call, _patcher)


def unpatch(model_types=None) -> list[str]:
    """Restore transformers' own code for the given families (default: every family), which later
    imports then leave alone too. Given the list a ``patch()`` returned: the families of it that call
    still holds (not those unpatched since and switched by a later call), and the call stops
    switching families at import. Returns the families restored."""
    with _lock:
        request = getattr(model_types, "request", None)
        if model_types is None:
            _requests.clear()
            names = list(_holders)
        elif request is not None:
            if request in _requests:
                _requests.remove(request)
            names = [f for f in list(request.switched) if _holders.get(f) is request]
        else:
            names = _engine.group_names(model_types, "model_types")
            for r in _requests:
                r.excluded.update(names)
        for family in names:
            _holders.pop(family, None)
        restored = _patcher.restore(names)
        _prune()
    return restored


def patched_families() -> list[str]:
    """The families currently switched to rope_ext."""
    return _patcher.groups()


def main() -> None:
    """Print every family of the installed transformers with its RoPE form, patched or why not, and
    its QK-norms, fused or why not: what ``patch()`` does, its checks at install included (this
    imports every family's modeling modules: seconds)."""
    import transformers

    reports = {family: installed_report(family) for family in survey()}
    patched = _engine.print_listing(
        reports, lambda report: [_engine.site_text(fn.name, fn.form, fn.reason) for fn in report.functions]
        + [_qk_norm_sites.site_text(site) for site in report.qk_norms])
    with_norms = [r for r in reports.values() if r.qk_norms]
    print(f"\ntransformers {transformers.__version__}: {len(reports)} families with RoPE; "
          f"{patched} patched, {len(reports) - patched} refused")
    print(f"{len(with_norms)} normalize q and k with a module of their attention and apply RoPE: "
          f"{sum(bool(r.qk_norm_fused) for r in with_norms)} fused in every attention, "
          f"{sum(r.qk_norm_fused is False and any(s.fused for s in r.qk_norms) for r in with_norms)} in some, "
          f"{sum(not any(s.fused for s in r.qk_norms) for r in with_norms)} in none")


if __name__ == "__main__":
    main()
