"""Switch timm's RoPE vision transformers onto rope_ext's fused op.

    from rope_ext.integrations import timm as rope_timm

    patched = rope_timm.patch()          # timm's RoPE functions and prefix-token attention
    ...
    rope_timm.unpatch()                  # back to timm's own code

    with rope_timm.patch():              # or for a block only
        model(images)

    python -m rope_ext.integrations.timm   # each function and method, its form, patched or why not

What is patched is decided from the installed timm's code: ``timm.layers.pos_embed_sincos``'s
``apply_rot_embed``, ``apply_rot_embed_list`` and ``apply_rot_embed_cat`` (with the helpers they
call, ``rot`` and ``rope_rotate_half``), and the attention methods that rotate only the tokens after
the prefix tokens (``timm.models.eva.EvaAttention.forward``: EVA-02, DINOv3; and
``timm.layers.attention.AttentionRope.forward``: the RoPE and RoPE-Mixed ViTs, NaFlexViT), are
parsed and matched against the forms rope_ext has been tested on (see ``_timm_forms``). Code that
matches no tested form is refused by name, with the reason.

- A function is replaced in ``timm.layers.pos_embed_sincos`` (where timm's rotary embedding modules
  call it) and in every timm module that imported it by name (``timm.layers``, ``timm.models.eva``,
  ``timm.models.vision_transformer_sam``, ...), wherever that name is still timm's own function.
- An attention method keeps its code except the two statements that concatenate the prefix tokens
  with the rotated rest of q and k: they become one op call on q and k whole, as strided views,
  with no concatenation (see ``_timm_forms.prefix_rewrite``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import os
import sys

from rope_ext.integrations import _engine, _rotate, _timm_forms

__all__ = ["RopeCode", "main", "patch", "patched_names", "survey", "unpatch"]

_SINCOS = "timm.layers.pos_embed_sincos"


@dataclasses.dataclass(frozen=True)
class RopeCode:
    """One RoPE function or prefix-token attention method of the installed timm.

    Attributes:
        name: the key ``patch`` takes: the function's name (``"apply_rot_embed_cat"``) or the
            method's qualified name (``"EvaAttention.forward"``).
        module: the module whose file defines it, e.g. ``timm.layers.pos_embed_sincos``.
        qualname: its qualified name in that module.
        form: the recognised form, or None.
        reason: why it is refused (None when it has a form).
    """

    name: str
    module: str
    qualname: str
    form: _rotate.Form | None
    reason: str | None = None

    @property
    def is_method(self) -> bool:
        return "." in self.qualname


_replacement = functools.lru_cache(maxsize=None)(_timm_forms.replacement)


def _source_path(module: str) -> str | None:
    """The file of a timm module, without importing it (the tests point this at other files)."""
    spec = importlib.util.find_spec(module)
    return spec.origin if spec is not None else None


def _parse(module: str):
    path = _source_path(module)
    if path is None or not os.path.isfile(path):
        return None, None, {}
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    return path, tree, _engine.module_definitions(tree)


def _classify(module: str, qualname: str, node, definitions) -> RopeCode:
    name = qualname.split(".", 1)[1] if qualname.count(".") > 1 else qualname
    if node is None:
        return RopeCode(name, module, qualname, None, "not found in the installed timm")
    key = _engine.fingerprint(definitions, node)
    form = _timm_forms.KNOWN.get(key)
    reason = None if form else _engine.refusal(key)
    return RopeCode(name, module, qualname, form, reason)


@functools.cache
def survey() -> dict[str, RopeCode]:
    """timm's RoPE functions and prefix-token attention methods, classified from the installed
    source, by the key :func:`patch` takes."""
    found = {}
    _, _, functions = _parse(_SINCOS)
    for name in _timm_forms.ROPE_FUNCTIONS:
        found[name] = _classify(_SINCOS, name, functions.get(name), functions)
    cat = found["apply_rot_embed_cat"]
    for module, qualname in _timm_forms.PREFIX_METHODS:
        _, tree, functions = _parse(module)
        defs = dict(_engine.function_defs(tree)) if tree is not None else {}
        code = _classify(module, qualname, defs.get(qualname), functions)
        if code.form is not None and cat.form is None:
            # the rewrite computes what rope_ext's apply_rot_embed_cat does: only right where
            # timm's computes the same
            code = dataclasses.replace(code, form=None, reason="the apply_rot_embed_cat it calls is refused")
        elif code.form is not None:  # and in the dtype that one returns
            code = dataclasses.replace(code, form=dataclasses.replace(code.form, dtype=cat.form.dtype))
        found[code.name] = code
    return found


def _importers(name: str, *functions) -> list[str]:
    """The timm modules that bind ``name`` to one of ``functions``: every timm file that
    mentions it is imported first (so none imports it later, after the patch), then sys.modules is
    read."""
    import timm

    root = os.path.dirname(timm.__file__)
    for folder, _, files in os.walk(root):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            with open(path, encoding="utf-8") as f:
                if name not in f.read():
                    continue
            parts = os.path.relpath(path[:-3], os.path.dirname(root)).split(os.sep)
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if module not in sys.modules:
                try:
                    importlib.import_module(module)
                except ImportError:  # a model file needing an optional package: nothing to patch there
                    continue
    return sorted(m for m, mod in list(sys.modules.items())
                  if (m == "timm" or m.startswith("timm.")) and mod is not None
                  and any(getattr(mod, name, None) is f for f in functions))


_patcher = _engine.Patcher()


def _plan_function(code: RopeCode):
    module = importlib.import_module(code.module)
    current = _patcher.original(code.name, module, code.name, None)
    if not _engine.defined_here(current, module, code.name):
        raise ValueError(f"rope_ext: cannot patch {code.name!r}: {code.module}.{code.name} is {current!r}, "
                         "not the function its file defines (was it replaced by another patch?)")
    replacement = _replacement(code.form)
    return [(code.name, sys.modules[m], code.name, replacement) for m in _importers(code.name, current)]


def _plan_method(code: RopeCode):
    module = importlib.import_module(code.module)
    sincos = importlib.import_module(_SINCOS)
    cat = getattr(module, "apply_rot_embed_cat", None)
    timm_cat = _patcher.original("apply_rot_embed_cat", sincos, "apply_rot_embed_cat")
    if cat is not timm_cat and cat is not _replacement(survey()["apply_rot_embed_cat"].form):
        raise ValueError(f"rope_ext: cannot patch {code.name!r}: {code.module}.apply_rot_embed_cat is {cat!r}, "
                         "neither timm's function nor rope_ext's")
    path, tree, _ = _parse(code.module)
    node = dict(_engine.function_defs(tree))[code.qualname]
    rewrite_block, found = _timm_forms.prefix_rewrite()
    try:
        plan = _engine.method_rewrite_plan(code.name, module, code.qualname, node, _engine.per_block(rewrite_block),
                                           _replacement(code.form), _patcher)
    except ValueError as e:
        raise ValueError(f"rope_ext: cannot patch {code.name!r}: {e}") from None
    if len(found) != 1:
        raise ValueError(f"rope_ext: cannot patch {code.name!r}: {code.qualname} holds the prefix-token "
                         f"concatenation of q and k {len(found)} times, not once")
    return plan


def patch(names=None, *, strict: bool = False) -> _engine.Patched:
    """Switch timm's RoPE onto rope_ext.

    Args:
        names: keys of :func:`survey` (``"apply_rot_embed_cat"``, ``"EvaAttention.forward"``, ...),
            or None for every one the installed timm has that rope_ext can express; the others
            (code that matches no tested form, or, found at run time, is not its file's own)
            keep timm's code, named in a ``_engine.RefusedWarning`` once per process, and the
            rest is switched all the same.
        strict: with ``names=None``, make a refused one an error instead of a warning.

    Returns:
        The keys this call switched (a list, usable as a context manager, which unpatches them on
        exit); those an earlier call patched stay with that call.

    Raises:
        ValueError: a requested name is unknown or refused (its code matches no tested form), or
            the code found at run time is not the one in its file (someone else replaced it).
            Nothing is patched then: all checks run before any change.
    """
    codes = survey()
    refused = {}  # name -> why, warned (or with strict raised) together once the plan is made
    if names is None:
        refused = {n: c.reason for n, c in codes.items() if c.form is None}
        chosen = [n for n, c in codes.items() if c.form is not None]
    else:
        chosen = _engine.group_names(names, "names")
    plan = []
    for name in chosen:
        code = codes.get(name)
        if code is None:
            raise ValueError(f"rope_ext: cannot patch {name!r}: not one of timm's RoPE functions or methods "
                             f"rope_ext knows ({', '.join(codes)})")
        if code.form is None:
            raise ValueError(f"rope_ext: cannot patch {name!r}: {code.reason}")
        try:
            plan += _plan_method(code) if code.is_method else _plan_function(code)
        except Exception as e:  # noqa: BLE001  (with names=None, any failure refuses that one alone)
            if names is not None:
                raise
            refused[name] = _engine.failure(e).removeprefix(f"rope_ext: cannot patch {name!r}: ")
    _engine.refuse("timm", refused, strict)
    return _patcher.apply(plan, unpatch)


def unpatch(names=None) -> list[str]:
    """Restore timm's own code for the given keys (default: all patched ones)."""
    return _patcher.restore(None if names is None else _engine.group_names(names, "names"))


def patched_names() -> list[str]:
    """The keys currently switched to rope_ext."""
    return _patcher.groups()


def _describe(form: _rotate.Form) -> str:
    return f"'{form.name}' form ({form.describe()}; half=True: half-split)"


def _bound_in(code: RopeCode) -> list[str]:
    """The timm modules whose name ``code.name`` is the function (timm's, or rope_ext's while
    patched): where ``patch`` replaces it (a patchable function's ``in ...`` in the listing)."""
    sincos = importlib.import_module(_SINCOS)
    return _importers(code.name, _patcher.original(code.name, sincos, code.name), _replacement(code.form))


def main() -> None:
    """Print each of timm's RoPE functions and prefix-token methods: its form, patched or why not."""
    import timm

    codes = survey()
    width = max(len(f"{c.module}.{c.qualname}") for c in codes.values())
    for code in codes.values():
        status = "patched" if code.form else "refused"
        detail = _describe(code.form) if code.form else code.reason
        print(f"{code.module + '.' + code.qualname:<{width}}  {status}  {detail}")
        if code.form and not code.is_method:
            print(f"{'':<{width}}           in {', '.join(_bound_in(code))}")
    n = sum(c.form is not None for c in codes.values())
    print(f"\ntimm {timm.__version__}: {len(codes)} RoPE functions and methods; {n} patched, {len(codes) - n} refused")


if __name__ == "__main__":
    main()
