"""Argument checks shared by the Python entry points. Each raises with the argument's name and what
was expected; the op's own tensor checks live in C++ (csrc/rotary_plan.cpp)."""

from __future__ import annotations

import math

import torch

_INT64_MAX = 2**63 - 1


def _got(value) -> str:
    return "None" if value is None else type(value).__name__


def require_tensor(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"rope_ext: {name} must be a Tensor, got {_got(value)}")
    return value


def require_float_tensor(value, name: str) -> torch.Tensor:
    """A real floating-point tensor (float16, bfloat16, float32 or float64)."""
    require_tensor(value, name)
    if not value.dtype.is_floating_point:
        raise TypeError(f"rope_ext: {name} must be a floating-point tensor, got {value.dtype}")
    return value


def require_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"rope_ext: {name} must be a bool, got {value!r}")
    return value


def require_number(value, name: str, *, positive: bool = True) -> float:
    """A finite real Python number (bool excluded), > 0 when positive."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"rope_ext: {name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"rope_ext: {name} must be > 0, got {value!r}")
    return float(value)


def require_int_list(value, name: str, *, length: int | None = None) -> list[int]:
    """A list or tuple of positive ints (of the given length)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"rope_ext: {name} must be a list of ints, got {value!r}")
    if length is not None and len(value) != length:
        raise ValueError(f"rope_ext: {name} must have {length} entries, got {list(value)}")
    if any(v <= 0 for v in value):
        raise ValueError(f"rope_ext: {name} entries must be positive, got {list(value)}")
    return list(value)


def require_int64_span(start: int, length: int, name: str) -> None:
    """Positions start .. start + length - 1 must fit in int64."""
    if start + max(length - 1, 0) > _INT64_MAX:
        raise ValueError(
            f"rope_ext: {name} = {start} puts positions past the int64 maximum 2**63 - 1 "
            f"(with {length} tokens per sequence)"
        )
