"""Switch diffusers' diffusion transformers onto rope_ext's fused op.

    from rope_ext.integrations import diffusers as rope_diffusers

    patched = rope_diffusers.patch()            # every model file rope_ext can express
    ...
    rope_diffusers.unpatch()                    # back to diffusers' own functions

    with rope_diffusers.patch(["flux"]):        # or for a block only
        pipe(...)

    python -m rope_ext.integrations.diffusers   # every model file with RoPE, its form, patched or why not

What is patched is decided from the installed diffusers' code, not from a list of names. Each model
file under ``diffusers/models/transformers/`` (and ``embeddings.py``, ``attention_processor.py``) is
parsed; its RoPE functions are fingerprinted with the helpers they call and matched against the forms
rope_ext has been tested on (``_diffusers_forms``); code that matches none is refused by name, with
the reason. The RoPE sites are of four kinds:

- a module-level function (``apply_rotary_emb_qwen``, LTX's ``apply_rotary_emb``): replaced in its
  module;
- a function an attention processor defines inside its ``__call__`` (Wan, Z-Image, Mochi): the
  processor's code gets a trampoline to the replacement in its place, the rest of ``__call__``
  unchanged;
- diffusers' shared ``embeddings.apply_rotary_emb``, bound by name in the files that import it (Flux,
  HunyuanVideo, CogView4, Lumina2, ...): replaced by :func:`rope_ext.compat.diffusers.apply_rotary_emb`
  in each such file, and in ``embeddings`` itself for the processors that import it when called;
- statements ``x = x * cos + _rotate_half(x) * sin`` written inline in a processor's ``__call__``
  (Cosmos 3, Ideogram 4): each becomes one op call, the rest of the method compiled as written
  (the file's ``_rotate_half`` is fingerprinted).

A model file that reaches RoPE only through another file's processor (CogVideoX's processor lives
in ``attention_processor.py``) can be named too: :func:`patch` switches the files it reaches.

A model file's name is its file stem without a leading ``transformer_``: ``"flux"``, ``"wan"``,
``"qwenimage"``, ``"hunyuan_video"``, ``"cogvideox_transformer_3d"``, plus ``"embeddings"`` and
``"attention_processor"``.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import importlib
import os
import re
import threading

from rope_ext.integrations import _diffusers_forms, _engine, _qk_norm_call, _qk_norm_sites, _qk_norm_table, _rotate

__all__ = ["ModelFileReport", "RopeFunction", "model_report", "patch", "patched_models", "survey", "unpatch"]

# The shared functions of diffusers.models.embeddings that model files import by name.
_SHARED = ("apply_rotary_emb", "apply_rotary_emb_allegro")
_ROPE_NAME = re.compile(r"^_?apply_.*(rot|rope)|^rope_apply$")
_ROTATE_HALF = re.compile(r"^_?rotate_half$")


@dataclasses.dataclass(frozen=True)
class RopeFunction:
    """One RoPE site of a diffusers model file.

    Attributes:
        module: the module's import name, e.g. ``diffusers.models.transformers.transformer_wan``.
        name: the function's qualified name in it (``WanAttnProcessor.__call__.apply_rotary_emb``
            for one defined inside a method), or the name it imports the shared function as.
        kind: ``"function"`` (module-level), ``"inner"`` (inside a method), ``"import"`` (the
            shared ``embeddings`` function bound by name) or ``"inline"`` (a method whose
            statements ``x = x * cos + _rotate_half(x) * sin`` do the rotation; ``name`` is the
            method's).
        form: the recognised form, or None.
        reason: why it is refused (None when it has a form).
    """

    module: str
    name: str
    kind: str
    form: _rotate.Form | None
    reason: str | None = None

    @property
    def replacement(self):
        """rope_ext's stand-in for this function (None when refused)."""
        return None if self.form is None else _replacement(self.form)


@dataclasses.dataclass(frozen=True)
class ModelFileReport:
    """A model file's RoPE sites, and the other files whose RoPE its processors call (it is
    patchable when every site, its own and those it reaches, has a form), and its processors that
    normalize q and k and apply RoPE (``qk_norms``: fused, or why not)."""

    name: str
    module: str
    functions: tuple[RopeFunction, ...]
    reaches: tuple[str, ...] = ()
    qk_norms: tuple[_qk_norm_sites.FusionSite, ...] = ()

    @property
    def patchable(self) -> bool:
        return self.reason is None

    @property
    def reason(self) -> str | None:
        """Why it is refused: its refused sites and those of the files it reaches (None when patchable)."""
        refused = []
        for name in _closure([self.name]):
            through = "" if name == self.name else f"through {name}: "
            refused += [f"{through}{f.name}: {f.reason}" for f in model_report(name).functions if f.form is None]
        return "; ".join(refused) or None


_replacement = functools.lru_cache(maxsize=None)(_diffusers_forms.replacement)


def _models_root() -> str:
    import diffusers.models

    return os.path.dirname(diffusers.models.__file__)


@functools.cache
def _files() -> dict[str, tuple[str, str]]:
    """name -> (path, module) for the files scanned: the transformer model files, the controlnets
    built on them, embeddings and attention_processor."""
    root = _models_root()
    files = {n: (os.path.join(root, f"{n}.py"), f"diffusers.models.{n}") for n in ("embeddings", "attention_processor")}
    for sub in ("transformers", "controlnets"):
        folder = os.path.join(root, sub)
        for file in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            if file.endswith(".py") and file != "__init__.py":
                stem, path = file[:-3], os.path.join(folder, file)
                files[stem.removeprefix("transformer_")] = (path, f"diffusers.models.{sub}.{stem}")
    return files


@functools.cache
def _parsed(name: str):
    path, module = _files()[name]
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path), module


def _imports_shared(node: ast.ImportFrom) -> list[str]:
    """The shared embeddings functions an import statement binds (by their local names)."""
    if not (node.module or "").endswith("embeddings"):
        return []
    return [a.asname or a.name for a in node.names if a.name in _SHARED]


def _sites(name: str) -> tuple[list[RopeFunction], set[str]]:
    """A file's own RoPE sites, and the classes (by name) whose methods use RoPE."""
    tree, module = _parsed(name)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    definitions = _engine.module_definitions(tree)
    sites, rope_classes = [], set()
    defs = list(_engine.function_defs(tree))
    for qualname, node in defs:
        depth = qualname.count(".")
        is_method_inner = depth == 2 and not isinstance(functions.get(qualname.split(".")[0]), ast.FunctionDef)
        if not _ROPE_NAME.match(node.name) or not (depth == 0 or is_method_inner):
            continue
        key = _engine.fingerprint(definitions, node)
        form = _diffusers_forms.KNOWN.get(key)
        sites.append(RopeFunction(module, qualname, "function" if depth == 0 else "inner", form,
                                  None if form else _engine.refusal(key)))
        if depth:
            rope_classes.add(qualname.split(".")[0])
    shared_names = {n for node in tree.body if isinstance(node, ast.ImportFrom) for n in _imports_shared(node)}
    for local in sorted(shared_names):
        sites.append(RopeFunction(module, local, "import", _shared_form(local), None))
    # rotation written inline in methods (`q = q * cos + _rotate_half(q) * sin`), with only a
    # rotate_half helper at module level
    for helper in (n for n in functions if _ROTATE_HALF.match(n)):
        key = _engine.fingerprint(definitions, helper)
        helper_form = _diffusers_forms.KNOWN.get(key)
        for qualname, node in defs:
            if qualname.count(".") != 1 or not any(isinstance(c, ast.Name) and c.id == helper for c in ast.walk(node)):
                continue
            reason = None if helper_form else _engine.refusal(key, f"its helper {helper}'s code")
            if helper_form and not _inline_rotations(node, helper):
                reason = f"it calls {helper} outside statements of the form x = x * cos + {helper}(x) * sin"
            sites.append(RopeFunction(module, qualname, "inline", None if reason else helper_form, reason))
            rope_classes.add(qualname.split(".")[0])
    module_level = {s.name for s in sites if s.kind in ("function", "import")}
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    for node in classes:
        for inner in ast.walk(node):
            uses = isinstance(inner, ast.Name) and inner.id in module_level
            imports = isinstance(inner, ast.ImportFrom) and _imports_shared(inner)
            if uses or imports:
                rope_classes.add(node.name)
                break
    # and, transitively, the classes that use those (a transformer block holding a RoPE processor)
    grew = True
    while grew:
        grew = False
        for node in classes:
            if node.name not in rope_classes and any(isinstance(n, ast.Name) and n.id in rope_classes
                                                     for n in ast.walk(node)):
                rope_classes.add(node.name)
                grew = True
    return sites, rope_classes


def _inline_rotation(stmt, helper: str):
    """(target, x, cos, sin) names when stmt is ``target = x * cos + helper(x) * sin`` (parentheses
    aside), else None."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    v = stmt.value
    if not (isinstance(v, ast.BinOp) and isinstance(v.op, ast.Add)
            and all(isinstance(t, ast.BinOp) and isinstance(t.op, ast.Mult) for t in (v.left, v.right))):
        return None
    (x, cos), (call, sin) = (v.left.left, v.left.right), (v.right.left, v.right.right)
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == helper
            and len(call.args) == 1 and not call.keywords and all(isinstance(n, ast.Name) for n in (x, cos, sin)
                                                                   + tuple(call.args))):
        return None
    if call.args[0].id != x.id:
        return None
    return stmt.targets[0].id, x.id, cos.id, sin.id


def _inline_rotations(method: ast.FunctionDef, helper: str) -> int:
    """How many statements of method rotate inline through helper; 0 when helper is also called
    anywhere else (that code could not be rewritten, so the method is refused)."""
    rotations = [s for s in ast.walk(method) if isinstance(s, ast.stmt) and _inline_rotation(s, helper)]
    calls = [c for c in ast.walk(method) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
             and c.func.id == helper]
    return len(rotations) if len(calls) == len(rotations) else 0


def _shared_form(local: str) -> _rotate.Form | None:
    """The form of the embeddings function an import binds (None when embeddings' code is refused)."""
    report = next((f for f in _site_table("embeddings")[0] if f.name in _SHARED and f.name == local), None)
    return None if report is None else report.form


@functools.cache
def _site_table(name: str):
    return _sites(name)


def _reaches(name: str) -> tuple[str, ...]:
    """The other files whose RoPE-using classes, or embeddings' shared function imported when
    called, this file's code uses."""
    tree, _ = _parsed(name)
    found = set()
    users = {other: _site_table(other)[1] for other in _files() if other != name}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if _imports_shared(node) and node not in tree.body:
            found.add("embeddings")  # imported inside a function: reaches embeddings' own binding
        source = (node.module or "").rsplit(".", 1)[-1].removeprefix("transformer_")
        if source in users and any(a.name in users[source] for a in node.names if a.name != "*"):
            found.add(source)
    return tuple(sorted(found - {name}))


@functools.cache
def model_report(name: str) -> ModelFileReport | None:
    """The RoPE sites of one model file of the installed diffusers, classified from its source;
    None when it has none and reaches none (or no such file exists)."""
    if not name.isidentifier() or name not in _files():
        return None
    sites, _ = _site_table(name)
    reaches = _reaches(name)
    if not sites and not reaches:
        return None
    return ModelFileReport(name, _parsed(name)[1], tuple(sites), reaches, _fusion_sites(name))


def survey() -> dict[str, ModelFileReport]:
    """Every model file of the installed diffusers with a RoPE site or reaching one, classified from
    its source (nothing is imported), by name."""
    return {n: r for n in _files() if (r := model_report(n)) is not None}


# --- QK-norm + RoPE -----------------------------------------------------------------------------------

_QK_NORM = re.compile(r"^norm_[qk]$|^[qk]_norm$")


def _processor_ropes(name: str, qualname: str, fn: ast.FunctionDef) -> dict:
    """The RoPE functions a processor method can call by name -> their forms: the file's own and
    imported ones, the method's inner ones, and embeddings' shared one imported inside it."""
    own = _site_table(name)[0]
    ropes = {f.name: f.form for f in own if f.kind in ("function", "import")}
    ropes.update({f.name.rsplit(".", 1)[1]: f.form for f in own
                  if f.kind == "inner" and f.name.rsplit(".", 1)[0] == qualname})
    for node in ast.walk(fn):
        if isinstance(node, ast.ImportFrom):
            ropes.update({local: _shared_form(local) for local in _imports_shared(node)})
    inline = [f.form for f in own if f.kind == "inline" and f.name == qualname]
    if inline:  # (its inline statements, read as calls of _INLINE_ROPE: see _as_calls)
        ropes[_INLINE_ROPE] = inline[0]
    return ropes


def _table_judge(key: str, unsupported, *_):
    """A processor's fusion as diffusers' table says (``_qk_norm_sites.judge_by``)."""
    return _qk_norm_sites.judge_by(_qk_norm_table.DIFFUSERS, key, unsupported)


@functools.cache
def _fusion_sites(name: str, judge=_table_judge) -> tuple[_qk_norm_sites.FusionSite, ...]:
    """The processors (``Class.__call__(self, attn, ...)``) of a file that call ``attn.norm_q`` /
    ``norm_k`` (or ``q_norm`` / ``k_norm``) and a RoPE function, fused or with the reason not, as
    ``judge`` says (see ``_qk_norm_sites.find_sites``): at ``patch()`` time the table of tested
    fusions, offline (tools/qk_norm_table.py) the rewrite's own analysis. The key is the processor
    method's fingerprint (its norms' classes are the attention module's, checked at each call)."""
    tree, module = _parsed(name)
    definitions = _engine.module_definitions(tree)
    inline = {f.name for f in _site_table(name)[0] if f.kind == "inline"}
    sites = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__call__"):
            if len(fn.args.args) < 2:
                continue
            owner, qualname = fn.args.args[1].arg, f"{cls.name}.__call__"
            attrs = {n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call)
                     and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                     and n.func.value.id == owner and _QK_NORM.match(n.func.attr)}
            key = _qk_norm_sites.site_key(_engine.fingerprint(definitions, fn), [])  # (of the code as written)
            ropes = _processor_ropes(name, qualname, fn)
            fn = _as_calls(name, qualname, fn)  # (inline RoPE statements as calls of _INLINE_ROPE)
            called = {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                      and n.func.id in ropes}
            if not attrs or not (called or qualname in inline):
                continue
            site = _qk_norm_sites.FusionSite(module, qualname, (), None, None, fingerprint=key)
            # the RoPE functions a fused call can stand in for; the others' calls run as written, the
            # norms before them (LTX-2's split form, beside its interleaved one under another rope_type)
            fusable = {rope for rope in called if ropes[rope] is not None
                       and ropes[rope].signature in _diffusers_forms.FUSED_TABLES}
            reason = None
            for rope in sorted(called - fusable):
                form = ropes[rope]
                if reason is None and not fusable:
                    reason = (f"{rope} is refused" if form is None else
                              f"{rope}'s signature ({form.signature}) has no fused call yet")
            found = judge(key, _qk_norm_sites.Unsupported(reason) if reason else None, fn, owner, fusable or called,
                          attrs)
            sites.append(site.refused(found) if isinstance(found, _qk_norm_sites.FusionRefusal)
                         else dataclasses.replace(site, site=found))
    return tuple(sites)


@functools.cache
def _fused_norms(name: str) -> dict:
    """norm class -> (NormForm, forward): the q/k norm classes the fused op may stand in for in the
    processors of file ``name``: torch's RMSNorm and LayerNorm, and the classes of diffusers'
    normalization module and of the file itself whose code is of a tested form (``_diffusers_forms.KNOWN_NORMS``, by the
    fingerprint of the class block: a release that changes one is not fused)."""
    import torch
    from diffusers.models import normalization

    norms = {torch.nn.RMSNorm: (_diffusers_forms.TORCH_RMS_NORM, torch.nn.RMSNorm.forward),
             torch.nn.LayerNorm: (_qk_norm_call.TORCH_LAYER_NORM, torch.nn.LayerNorm.forward)}
    for module in (normalization, importlib.import_module(_files()[name][1])):
        tree = ast.parse(open(module.__file__, encoding="utf-8").read())
        definitions = _engine.module_definitions(tree)
        for node in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            form = _diffusers_forms.KNOWN_NORMS.get(_qk_norm_sites.norm_fingerprint(definitions, node))
            cls = getattr(module, node.name, None)
            code = getattr(getattr(cls, "forward", None), "__code__", None)
            if form is not None and code is not None and code.co_filename == module.__file__:
                norms[cls] = (form, cls.forward)
    return norms


@functools.cache
def _fused_call(name: str, method: str, allowed, form, pair: bool):
    """One replacement per processor for the process's life: a call already running it when
    another thread unpatches still finds it (as the trampolines' holders)."""
    call = _qk_norm_call.fused(_fused_norms(name), allowed, _diffusers_forms.FUSED_TABLES[form.signature](form),
                               pair=pair)
    call.__qualname__ = f"fused_qk_norm_rope[{method}]"
    return call


def _fusion_plan(name: str, site: _qk_norm_sites.FusionSite, module, plan: list) -> list:
    """The rewrite of one processor's norms and RoPE calls into fused calls. Where the RoPE function
    is the method's own inner one, the rewritten code keeps the trampoline ``plan`` gave it."""
    rope = site.site.rope
    node = dict(_engine.function_defs(_parsed(name)[0]))[site.method]
    form = _processor_ropes(name, site.method, node)[rope]
    inner = any(f.kind == "inner" and f.name == f"{site.method}.{rope}" for f in model_report(name).functions)
    allowed, bound = None, []
    if rope == _INLINE_ROPE:  # RoPE written inline: the fused code calls rope_ext's function by this name
        allowed = (_replacement(form),)
        bound = [(name, module, _INLINE_ROPE, _replacement(form))]
    elif not inner:
        stock = getattr(module, rope, None)
        allowed = (stock, _replacement(form)) if stock is not None else None
        if stock is None:  # imported when called: embeddings' function, or rope_ext's stand-in for it
            embeddings = importlib.import_module("diffusers.models.embeddings")
            allowed = (_patcher.original("embeddings", embeddings, rope), _replacement(form))
    call = _fused_call(name, site.method, allowed, form, site.site.pair)
    fused = bound + _qk_norm_sites.rewrite_plan(name, module, node, site, call, _patcher,
                                                lambda fn: _as_calls(name, site.method, fn, in_place=True))
    method = _engine.resolve(module, site.method)
    trampolined = [v for g, o, a, v in plan if o is method and a == "__code__"]
    if inner and trampolined:  # the RoPE patch's trampoline, in the fused code too
        fused[-1] = (*fused[-1][:3], _engine.with_inner(fused[-1][3], rope, _engine.inner_code(trampolined[-1], rope)))
    return fused


_patcher = _engine.Patcher()


def _closure(names) -> list[str]:
    """The files named and, transitively, the files they reach."""
    out: list[str] = []
    todo = list(names)
    while todo:
        name = todo.pop(0)
        if name in out:
            continue
        out.append(name)
        report = model_report(name)
        todo += list(report.reaches) if report else []
    return out


def _plan_site(name: str, fn: RopeFunction, module):
    """The assignments that switch one site; ValueError when the code found is not the file's own."""
    replacement = fn.replacement
    if fn.kind == "function":
        current = _patcher.original(name, module, fn.name, None)
        if not _engine.defined_here(current, module, fn.name):
            raise ValueError(f"{fn.module}.{fn.name} is {current!r}, not the function its model file defines "
                             "(was it replaced by another patch?)")
        return [(name, module, fn.name, replacement)]
    if fn.kind == "import":
        embeddings = importlib.import_module("diffusers.models.embeddings")
        shared = _patcher.original("embeddings", embeddings, fn.name, None)
        current = _patcher.original(name, module, fn.name, None)
        if current is not shared and not (name == "embeddings" and _engine.defined_here(current, module, fn.name)):
            raise ValueError(f"{fn.module}.{fn.name} is {current!r}, not diffusers' embeddings.{fn.name} "
                             "(was it replaced by another patch?)")
        return [(name, module, fn.name, replacement)]
    if fn.kind == "inline":
        return _inline_plan(name, fn, module)
    cls_name, method_name, inner = fn.name.split(".")
    method = getattr(getattr(module, cls_name, None), method_name, None)
    if method is None or not hasattr(method, "__code__") or method.__code__.co_filename != module.__file__:
        raise ValueError(f"{fn.module}.{cls_name}.{method_name} is not the method its model file defines")
    return _engine.trampoline_plan(name, module, method, inner, replacement, _patcher)


def _inline_helper(node: ast.FunctionDef) -> str:
    return next(n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                and _ROTATE_HALF.match(n.func.id))


def _inline_calls(stmts, helper: str, callee: str) -> None:
    """Each statement ``t = x * cos + helper(x) * sin`` of stmts (edited in place) as
    ``t = callee(x, cos, sin)``."""
    for i, stmt in enumerate(stmts):
        names = _inline_rotation(stmt, helper)
        if names:
            target, x, cos, sin = names
            stmts[i] = _engine.located(ast.parse(f"{target} = {callee}({x}, {cos}, {sin})").body, stmt)[0]


def _inline_plan(name: str, fn: RopeFunction, module):
    """A method whose statements ``t = x * cos + _rotate_half(x) * sin`` become
    ``t = <rope_ext's function>(x, cos, sin)``, the rest of its code as written."""
    node = dict(_engine.function_defs(_parsed(name)[0]))[fn.name]
    helper = _inline_helper(node)
    return _engine.method_rewrite_plan(name, module, fn.name, node,
                                       _engine.per_block(lambda stmts, holder: _inline_calls(stmts, helper, holder)),
                                       fn.replacement, _patcher)


# The module global a fused processor whose RoPE is written inline calls for it: its inline
# statements read as calls of this name (``_as_calls``), bound to rope_ext's function for the form.
_INLINE_ROPE = "_rope_ext_inline_rope"


def _as_calls(name: str, qualname: str, fn: ast.FunctionDef, in_place: bool = False) -> ast.FunctionDef:
    """fn, a processor method of file ``name``, with its inline RoPE statements as calls of
    ``_INLINE_ROPE`` (a copy, or fn edited where ``in_place``), where its RoPE is written inline;
    else fn itself."""
    if not any(f.kind == "inline" and f.name == qualname for f in _site_table(name)[0]):
        return fn
    out = fn if in_place else copy.deepcopy(fn)
    helper = _inline_helper(out)
    _engine.rewrite_each_block(out, lambda stmts: _inline_calls(stmts, helper, _INLINE_ROPE))
    return out


def patch(models=None, *, strict: bool = False, qk_norm: bool = True) -> _engine.Patched:
    """Switch diffusers model files onto rope_ext.

    Args:
        models: model file names (see the module docstring; ``python -m rope_ext.integrations.diffusers``
            lists them), or None for every file of the installed diffusers whose RoPE rope_ext can
            express. A file that reaches RoPE through another file's processor switches that file.
            Files refused then (code that matches no tested form, or, found at run time, is not
            the file's own) keep diffusers' code, named in a ``_engine.RefusedWarning`` once per
            process; the other files are switched all the same. So does a processor whose QK-norm
            fusion rope_ext fails to rewrite, named or not: its file's RoPE is switched without it.
        strict: with ``models=None``, make a refused file or fusion an error instead of a warning.
        qk_norm: also fuse each processor's q/k norms into its RoPE calls, one
            :func:`rope_ext.qk_norm_rotary` call for q and k, where the file's ``qk_norms`` say it
            is fused (Flux, Wan, QwenImage, HunyuanVideo, LTX, CogVideoX, ...; see the listing).
            Each call checks that the attention's norms are torch's RMSNorm or LayerNorm, or a
            diffusers norm class of a tested form (RMSNorm, MochiRMSNorm, Krea2RMSNorm), unhooked,
            and runs diffusers' own code where they are not.

    Returns:
        The files this call switched, and the files named that reach RoPE only through them (a
        list, usable as a context manager, which unpatches them on exit; ``unpatch`` takes either
        name); files an earlier call patched stay with that call.

    Raises:
        ValueError: a named file has no RoPE site in the installed diffusers, or one of its sites
            (or of the files it reaches) is refused, or the code found at run time is not the
            file's own; with ``strict``, any refusal. Nothing is patched then: all checks run
            before any change.
    """
    refused = {}  # name -> why, warned (or with strict raised) together once the plan is made
    if models is None:
        reports = survey()
        refused = {n: r.reason for n, r in reports.items() if not r.patchable}
        names = [n for n, r in reports.items() if r.patchable]
    else:
        names = _engine.group_names(models, "models")
    plan, closures = [], {}
    for requested in names:
        report = model_report(requested)
        if report is None:
            raise ValueError(
                f"rope_ext: cannot patch {requested!r}: the installed diffusers has no model file of that name with "
                "a RoPE function (run `python -m rope_ext.integrations.diffusers` for the list)"
            )
        if not report.patchable:
            raise ValueError(f"rope_ext: cannot patch {requested!r}: {report.reason}")
        try:
            more, lost = _plan_requested(requested, qk_norm, plan)
        except Exception as e:  # noqa: BLE001  (with models=None, any failure refuses that file alone)
            if models is not None:
                raise
            refused[requested] = _engine.failure(e).removeprefix(f"rope_ext: cannot patch {requested!r}: ")
            continue
        plan += more
        refused.update(lost)
        closures[requested] = _closure([requested])
    _engine.refuse("diffusers", refused, strict)
    if any("embeddings" in closure for closure in closures.values()):
        _import_binders()
    done = _patcher.apply(plan, unpatch)
    with _aliases_lock:
        for requested, closure in closures.items():
            switched = [g for g in closure if g in done]
            if requested not in done and switched and requested not in _aliases:
                _aliases[requested] = switched
                done.append(requested)
    return done


def _plan_requested(requested: str, qk_norm: bool, plan: list) -> tuple[list, dict[str, str]]:
    """The assignments that switch one named file and the files it reaches (``plan``: this call's
    before them, whose trampolines a fused processor keeps), and the fused processors whose rewrite
    failed (``"<file> (qk-norm <method>)"`` -> why: they keep diffusers' norms, the file's RoPE is
    switched all the same). Raises ValueError where a RoPE site is not the file's own."""
    more, lost = [], {}
    for name in _closure([requested]):
        sites = model_report(name).functions
        fusions = [f for f in model_report(name).qk_norms if f.fused] if qk_norm else []
        module = importlib.import_module(model_report(name).module) if sites or fusions else None
        for fn in sites:
            try:
                more += _plan_site(name, fn, module)
            except ValueError as e:
                raise ValueError(f"rope_ext: cannot patch {requested!r}: {e}") from None
        if qk_norm:  # code the table of tested fusions does not list: its norms and RoPE stay diffusers'
            lost.update({f"{name} (qk-norm {s.method})": s.reason for s in model_report(name).qk_norms
                         if s.refusal is not None and s.refusal.warns})
        for site in fusions if name not in _patcher.groups() else ():  # an earlier call's patch stays as it is
            try:
                more += _fusion_plan(name, site, module, plan + more)
            except Exception as e:  # noqa: BLE001  (a failed rewrite refuses that fusion alone)
                lost[f"{name} (qk-norm {site.method})"] = str(_qk_norm_sites.NotInstalled(_engine.failure(e)))
    return more, lost


def _import_binders() -> None:
    """Import every scanned file that binds embeddings' shared function by name, before embeddings'
    own binding is switched: one imported while it is switched would bind rope_ext's function, and
    keep it after an unpatch."""
    for report in survey().values():
        if any(fn.kind == "import" for fn in report.functions):
            importlib.import_module(report.module)


# names patched only as what they reach -> the files their patch call switched
_aliases: dict[str, list[str]] = {}
_aliases_lock = threading.Lock()


def unpatch(models=None) -> list[str]:
    """Restore diffusers' own functions for the given model files (default: all patched ones); a
    file that reaches RoPE through others restores those its patch call switched.

    Raises:
        ValueError: a name is not a model file with RoPE of the installed diffusers.
    """
    if models is None:
        with _aliases_lock:
            aliases = list(_aliases)
            _aliases.clear()
        return aliases + _patcher.restore()
    names = _engine.group_names(models, "models")
    unknown = [n for n in names if model_report(n) is None]
    if unknown:
        raise ValueError(f"rope_ext: cannot unpatch {unknown}: no model file of that name with RoPE in the installed "
                         "diffusers (run `python -m rope_ext.integrations.diffusers` for the list)")
    with _aliases_lock:
        aliases = [n for n in names if n in _aliases]
        groups = [g for n in names for g in (_aliases.pop(n) if n in _aliases else [n])]
    restored = _patcher.restore(list(dict.fromkeys(groups)))
    with _aliases_lock:  # aliases whose files are all restored now
        for alias in [a for a, files in _aliases.items() if not set(files) & set(_patcher.groups())]:
            del _aliases[alias]
    return aliases + restored


def patched_models() -> list[str]:
    """The model files currently switched to rope_ext, and those named in a patch call that reach
    RoPE through them."""
    with _aliases_lock:
        return _patcher.groups() + list(_aliases)


def main() -> None:
    """Print every model file of the installed diffusers with RoPE: its sites' forms, patched or why
    not, and its processors' QK-norms, fused or why not."""
    import diffusers

    reports = survey()

    def lines(report):
        out = [_engine.site_text(fn.name, fn.form, fn.reason) for fn in report.functions]
        out += [_qk_norm_sites.site_text(site) for site in report.qk_norms]
        return out + ([f"through {', '.join(report.reaches)}"] if report.reaches else [])

    patched = _engine.print_listing(reports, lines)
    own = sum(1 for r in reports.values() if any(f.kind != "import" for f in r.functions))
    print(f"\ndiffusers {diffusers.__version__}: {len(reports)} model files with RoPE ({own} with their own "
          f"function); {patched} patched, {len(reports) - patched} refused")
    with_norms = [r for r in reports.values() if r.qk_norms]
    fused = [r for r in with_norms if any(site.fused for site in r.qk_norms)]
    print(f"{len(with_norms)} have processors that normalize q and k and apply RoPE; {len(fused)} fuse them in at "
          "least one (where the norms are of a tested form and the tables ones the op takes)")


if __name__ == "__main__":
    main()
