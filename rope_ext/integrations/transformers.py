"""Switch HF transformers models onto rope_ext's fused op.

    from rope_ext.integrations import transformers as rope_hf

    patched = rope_hf.patch()            # every supported family the installed transformers has
    ...
    rope_hf.unpatch()                    # back to transformers' own functions

    with rope_hf.patch(["llama"]):       # or for a block only
        model(...)

``patch`` replaces each family's module-level ``apply_rotary_pos_emb`` (what its attention layers
call, once per layer and step) with rope_ext's one-call ``rotary_qk``. The families' rotary
embedding modules are left as they are: they run once per forward, not per layer, so replacing
them does not pay; use ``rope_ext.RotaryEmbedding.from_hf_config`` where float64-exact tables
at long context matter.
"""
from __future__ import annotations

import importlib
import inspect
import threading

from rope_ext._ops import rotary, rotary_qk

__all__ = ["SUPPORTED", "patch", "unpatch", "patched_families"]


def _hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` on rope_ext: half-split
    pairs, partial rotary when ``cos.shape[-1] < head_dim`` (GPT-NeoX), one op call for q and k."""
    return rotary_qk(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))


def _gptj_apply_rotary_pos_emb(tensor, sin, cos):
    """GPT-J's ``apply_rotary_pos_emb(tensor, sin, cos)``: tensor (batch, seq, heads, rotary_dim),
    half-width sin/cos (batch, seq, rotary_dim/2), interleaved pairs."""
    full_cos = cos.repeat_interleave(2, dim=-1)[:, :, None, :]
    full_sin = sin.repeat_interleave(2, dim=-1)[:, :, None, :]
    return rotary(tensor, full_cos, full_sin, interleaved=True)


# family -> (replacement, the parameter names transformers' function must have)
_HF_PARAMS = ("q", "k", "cos", "sin", "unsqueeze_dim")
SUPPORTED = {
    "llama": (_hf_apply_rotary_pos_emb, _HF_PARAMS),
    "mistral": (_hf_apply_rotary_pos_emb, _HF_PARAMS),
    "qwen2": (_hf_apply_rotary_pos_emb, _HF_PARAMS),
    "qwen3": (_hf_apply_rotary_pos_emb, _HF_PARAMS),
    "phi3": (_hf_apply_rotary_pos_emb, _HF_PARAMS),
    "gemma": (_hf_apply_rotary_pos_emb, _HF_PARAMS),
    "gemma2": (_hf_apply_rotary_pos_emb, _HF_PARAMS),
    "gpt_neox": (_hf_apply_rotary_pos_emb, _HF_PARAMS),
    "qwen2_vl": (_hf_apply_rotary_pos_emb, _HF_PARAMS),  # M-RoPE tables are recomposed by HF's rotary embedding
    "gptj": (_gptj_apply_rotary_pos_emb, ("tensor", "sin", "cos")),
}

_lock = threading.Lock()
_originals: dict[str, tuple[object, object]] = {}  # family -> (modeling module, original function)


class Patched(list):
    """The families a :func:`patch` call switched; as a context manager, unpatches them on exit."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        unpatch(list(self))
        return False


def _modeling_module(family):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _family_names(model_types) -> list[str]:
    """A family name or an iterable of them, as a list of str."""
    if isinstance(model_types, str):
        return [model_types]
    if isinstance(model_types, (list, tuple, set, frozenset)) and all(isinstance(f, str) for f in model_types):
        return list(model_types)
    raise TypeError(
        f"rope_ext: model_types must be a family name, a list of them or None, got {type(model_types).__name__}"
    )


def patch(model_types=None) -> Patched:
    """Switch transformers model families onto rope_ext.

    Args:
        model_types: family names (``config.model_type``), or None for every supported family
            the installed transformers has. See :data:`SUPPORTED`.

    Returns:
        The families patched by this call (a list, usable as a context manager).

    Raises:
        ValueError: a requested family is not supported, is missing from the installed
            transformers, or its ``apply_rotary_pos_emb`` no longer has the signature rope_ext
            replaces. Nothing is patched then: all checks run before any change.
    """
    explicit = model_types is not None
    families = list(SUPPORTED) if model_types is None else _family_names(model_types)
    unknown = [f for f in families if f not in SUPPORTED]
    if unknown:
        raise ValueError(f"rope_ext: cannot patch {unknown}: supported transformers families are {sorted(SUPPORTED)}")
    plan = []
    for family in families:
        try:
            module = _modeling_module(family)
        except ImportError as e:
            if explicit:
                raise ValueError(f"rope_ext: the installed transformers has no {family!r} model ({e})") from e
            continue
        replacement, params = SUPPORTED[family]
        current = _originals.get(family, (None, getattr(module, "apply_rotary_pos_emb", None)))[1]
        found = tuple(inspect.signature(current).parameters) if callable(current) else None
        if found != params:
            raise ValueError(f"rope_ext: transformers' {family} apply_rotary_pos_emb has parameters {found}, "
                             f"expected {params}; this transformers version is not supported for {family!r}")
        plan.append((family, module, replacement))
    done = Patched()
    with _lock:
        for family, module, replacement in plan:
            if family not in _originals:
                _originals[family] = (module, module.apply_rotary_pos_emb)
            module.apply_rotary_pos_emb = replacement
            done.append(family)
    return done


def unpatch(model_types=None) -> list[str]:
    """Restore transformers' own functions for the given families (default: all patched ones)."""
    with _lock:
        named = list(_originals) if model_types is None else _family_names(model_types)
        families = [f for f in named if f in _originals]
        for family in families:
            module, original = _originals.pop(family)
            module.apply_rotary_pos_emb = original
    return families


def patched_families() -> list[str]:
    """The families currently switched to rope_ext."""
    return list(_originals)

