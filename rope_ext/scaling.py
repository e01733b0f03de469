"""RoPE frequency schedules: the inverse frequencies theta_i and attention factor of each of HF's
``rope_type`` values, from a config dict in HF's ``rope_scaling`` / ``rope_parameters`` form.

Everything is computed in float64 from the published formulas (HF computes in float32, and ours are
within a few float32 ulps of HF's), in the same operations as the C++ API's header
(rope_ext/frequencies.h), whose bits tests/test_scaling.py compares with these.
A :class:`RopeSchedule` holds the static part; the two position-dependent types, ``dynamic`` and
``longrope``, are resolved per call by :meth:`RopeSchedule.inv_freq` from the largest position in
the batch, as pure tensor math (no Python state, no host sync, nothing for torch.compile to
recompile on).

=========  ===================================================================================
type       what it does (keys besides ``rope_type``, ``rope_theta``, ``partial_rotary_factor``)
=========  ===================================================================================
default    theta_i = base^(-2i/d)
linear     theta_i / factor (position interpolation)                          ``factor``
dynamic    NTK: base grows with the sequence length L > max_position_embeddings:
           base * (factor * L / max_pos - (factor - 1))^(d / (d - 2))          ``factor``
yarn       per-frequency blend of interpolation and extrapolation with a linear ramp between
           the beta_fast / beta_slow correction dims, and attention factor 0.1 ln(factor) + 1
           (or the mscale / mscale_all_dim ratio)   ``factor``, ``original_max_position_embeddings``,
           ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``attention_factor``, ``truncate``
longrope   theta_i / ext_i, ext = long_factor if L > original_max_position_embeddings else
           short_factor; attention factor sqrt(1 + ln(factor) / ln(original_max))
           ``short_factor``, ``long_factor``, ``factor``, ``original_max_position_embeddings``,
           ``attention_factor``
llama3     wavelengths above original_max / low_freq_factor divided by factor, below
           original_max / high_freq_factor kept, smooth in between  ``factor``, ``low_freq_factor``,
           ``high_freq_factor``, ``original_max_position_embeddings``
proportional  Gemma 4: every column is paired (i, i + d/2), but only the first
           floor(partial_rotary_factor * d / 2) pairs turn, at theta_i / factor; the others get
           frequency 0 and pass unrotated. Here partial_rotary_factor does not shorten the
           rotated width.                                                     ``factor``
=========  ===================================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["RopeSchedule", "ROPE_TYPES", "parse_scaling"]

_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
# Keys each type accepts beyond _COMMON, and those it requires.
_KEYS = {
    "default": (set(), set()),
    "linear": ({"factor"}, {"factor"}),
    "dynamic": ({"factor", "original_max_position_embeddings"}, {"factor"}),
    "yarn": (
        {
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        },
        set(),
    ),
    "longrope": (
        {"short_factor", "long_factor", "factor", "original_max_position_embeddings", "attention_factor"},
        {"short_factor", "long_factor"},
    ),
    "llama3": (
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
        {"factor", "low_freq_factor", "high_freq_factor"},
    ),
    "proportional": ({"factor"}, set()),
}
ROPE_TYPES = tuple(_KEYS)


def _number(cfg: dict, key: str, *, positive=True, default=None) -> float:
    """cfg[key] as a float; a missing key or an explicit None (as HF writes it) means `default`."""
    v = cfg.get(key)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(
            f"rope_ext: scaling[{key!r}] must be a finite {'positive ' if positive else ''}number, got {v!r}"
        )
    return float(v)


def parse_scaling(scaling: dict | None) -> tuple[str, dict]:
    """Validates an HF rope_scaling / rope_parameters dict; returns (rope_type, dict)."""
    if scaling is None:
        return "default", {}
    if not isinstance(scaling, dict):
        raise TypeError(
            f"rope_ext: scaling must be a dict in HF's rope_parameters form or None, got {type(scaling).__name__}"
        )
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in _KEYS:
        raise ValueError(f"rope_ext: scaling['rope_type'] must be one of {list(ROPE_TYPES)}, got {rope_type!r}")
    allowed, required = _KEYS[rope_type]
    unknown = set(scaling) - allowed - _COMMON
    if unknown:
        raise ValueError(
            f"rope_ext: scaling has keys {sorted(unknown)} that rope_type {rope_type!r} does not use; "
            f"it accepts {sorted(allowed | _COMMON)}"
        )
    missing = required - set(scaling)
    if missing:
        raise ValueError(f"rope_ext: scaling for rope_type {rope_type!r} needs {sorted(missing)}")
    return rope_type, dict(scaling)


@dataclass(frozen=True)
class RopeSchedule:
    """The frequencies of one RoPE configuration.

    Attributes:
        rope_type: one of :data:`ROPE_TYPES`.
        rotary_dim: d, the number of rotated columns (even).
        inv_freq_base: (d/2,) float64 theta_i for short sequences; for every type but dynamic
            and longrope, the only one.
        inv_freq_long: (d/2,) float64 theta_i beyond ``switch_len`` (longrope), else None.
        attention_factor: multiplies cos and sin (yarn, longrope), else 1.0.
        switch_len: for dynamic, max_position_embeddings; for longrope, the original max.
    """

    rope_type: str
    rotary_dim: int
    base: float
    inv_freq_base: tuple
    inv_freq_long: tuple | None
    attention_factor: float
    switch_len: int
    factor: float

    @classmethod
    def from_config(
        cls, scaling: dict | None, *, base: float, rotary_dim: int, max_position_embeddings: int
    ) -> RopeSchedule:
        rope_type, cfg = parse_scaling(scaling)
        if "rope_theta" in cfg and cfg["rope_theta"] is not None:
            base = _number(cfg, "rope_theta")
        elif isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 0:
            raise ValueError(f"rope_ext: base must be a finite positive number, got {base!r}")
        d = rotary_dim
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0 or d % 2:
            raise ValueError(f"rope_ext: rotary_dim must be a positive even int, got {d!r}")
        if (
            isinstance(max_position_embeddings, bool)
            or not isinstance(max_position_embeddings, int)
            or max_position_embeddings <= 0
        ):
            raise ValueError(
                f"rope_ext: max_position_embeddings must be a positive int, got {max_position_embeddings!r}"
            )
        # The checks here name the config's keys; _frequencies fills in transformers' defaults.
        original = _number(cfg, "original_max_position_embeddings", default=max_position_embeddings)
        if int(original) < 1:  # (a fraction would truncate to 0: a division by zero, or wrong frequencies)
            raise ValueError(
                f"rope_ext: scaling['original_max_position_embeddings'] must be a positive int, got {original!r}"
            )
        if rope_type == "yarn" and base == 1:
            raise ValueError("rope_ext: rope_type 'yarn' needs a base other than 1 (its ramp divides by log(base))")
        args = {
            "original_max_position_embeddings": int(original),
            "truncate": bool(cfg.get("truncate", True)),
        }
        for key in ("factor", "attention_factor", "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor"):
            if cfg.get(key) is not None:
                args[key] = _number(cfg, key)
        for key in ("mscale", "mscale_all_dim"):  # transformers treats 0 as unset
            if cfg.get(key) is not None:
                args[key] = _number(cfg, key, positive=False)
        if rope_type in ("linear", "dynamic", "llama3"):
            factor = _number(cfg, "factor")
            if factor < 1:
                raise ValueError(f"rope_ext: scaling['factor'] must be >= 1 for rope_type {rope_type!r}, got {factor}")
        if rope_type == "dynamic" and d <= 2:
            raise ValueError("rope_ext: dynamic NTK scaling needs rotary_dim > 2")
        if rope_type == "longrope":
            args["short_factor"], args["long_factor"] = (_factors(cfg, k, d) for k in ("short_factor", "long_factor"))
        if rope_type == "llama3":
            low, high = _number(cfg, "low_freq_factor"), _number(cfg, "high_freq_factor")
            if not low <= high:
                raise ValueError(
                    f"rope_ext: scaling['low_freq_factor'] ({low}) must be <= scaling['high_freq_factor'] ({high})"
                )
        if rope_type == "proportional" and cfg.get("partial_rotary_factor") is not None:
            share = _number(cfg, "partial_rotary_factor", positive=False)
            if not 0 <= share <= 1:
                raise ValueError(f"rope_ext: scaling['partial_rotary_factor'] must be in [0, 1], got {share}")
            args["partial_rotary_factor"] = share
        inv, long, attention, switch, factor = _frequencies(rope_type, float(base), d, max_position_embeddings, **args)
        return cls(
            rope_type,
            d,
            float(base),
            tuple(inv.tolist()),
            None if long is None else tuple(long.tolist()),
            attention,
            switch,
            factor,
        )

    def inv_freq(self, max_position: torch.Tensor | None = None, device=None) -> torch.Tensor:
        """theta_i as a float64 (d/2,) tensor, for a batch whose largest position is max_position.

        ``dynamic`` and ``longrope`` depend on it (through L = max_position + 1); the others
        ignore it. max_position may be a 0-dim tensor (no host sync) or None (no long context).
        Builds the frequencies from this schedule's numbers (a host-to-device copy where device is
        not the CPU); a forward uses :meth:`scale` on frequencies already on its device.
        """
        inv = torch.tensor(self.inv_freq_base, dtype=torch.float64, device=device)
        long = None if self.inv_freq_long is None else torch.tensor(self.inv_freq_long, dtype=torch.float64,
                                                                      device=device)
        return self.scale(inv, long, max_position)

    def scale(self, inv: torch.Tensor, inv_long: torch.Tensor | None, max_position: torch.Tensor | None):
        """:meth:`inv_freq` from this schedule's base frequencies ``inv`` and, for longrope, its long
        ones ``inv_long`` (float64 (d/2,) tensors on the call's device): only device arithmetic, no
        host data copied and nothing read back, so a forward stays free of host syncs and can be
        captured in a CUDA graph."""
        if max_position is None or self.rope_type not in ("dynamic", "longrope"):
            return inv
        # Python rather than the C++ API's inv_freq_for: the same formula, but here torch.compile
        # keeps base and factor symbolic (a float argument of a custom op would be specialized).
        # tests/test_scaling.py checks that both give the same numbers.
        length = max_position.to(device=inv.device, dtype=torch.float64) + 1
        if self.rope_type == "longrope":
            return torch.where(length > self.switch_len, inv_long, inv)
        # dynamic NTK (HF's rule): the base grows once L exceeds max_position_embeddings.
        d = self.rotary_dim
        length = length.clamp(min=self.switch_len)
        base = self.base * (self.factor * length / self.switch_len - (self.factor - 1)) ** (d / (d - 2))
        return base ** -(torch.arange(0, d, 2, dtype=torch.float64, device=inv.device) / d)


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _frequencies(rope_type, base, d, max_pos, *, original_max_position_embeddings, truncate=True, factor=None,
                 attention_factor=None, beta_fast=None, beta_slow=None, mscale=None, mscale_all_dim=None,
                 low_freq_factor=None, high_freq_factor=None, short_factor=(), long_factor=(),
                 partial_rotary_factor=None):
    """The numbers of one configuration, whose values the caller has checked:
    (inv_freq, inv_freq_long or None, attention_factor, switch_len, factor), the frequencies as float64
    CPU tensors. transformers' rules and defaults (ROPE_INIT_FUNCTIONS), in the same float64
    operations, in the same order, as the C++ API's rope_frequencies (rope_ext/frequencies.h):
    tests/test_scaling.py compares their bits."""
    original = original_max_position_embeddings
    cpu64 = {"dtype": torch.float64, "device": "cpu"}  # also under a device context (meta-device init)
    exponents = -(torch.arange(0, d, 2, **cpu64) / d)
    inv = torch.pow(base, exponents)
    inv_long, attention, switch = None, 1.0, max_pos
    factor_in_effect = 1.0
    if rope_type == "linear":
        factor_in_effect = factor
        inv = inv / factor
    elif rope_type == "dynamic":
        factor_in_effect = factor
    elif rope_type == "yarn":
        factor_in_effect = factor = factor if factor is not None else max_pos / original
        if attention_factor is not None:
            attention = attention_factor
        else:
            both = (mscale or 0) != 0 and (mscale_all_dim or 0) != 0  # transformers: 0 is unset
            attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if both
                         else _yarn_mscale(factor))
            if not (math.isfinite(attention) and attention > 0):
                raise ValueError("rope_ext.rope_frequencies: the attention factor from mscale and mscale_all_dim "
                                 f"must be a finite positive number, got {attention}")

        def correction_dim(rotations):
            return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = correction_dim(32.0 if beta_fast is None else beta_fast)
        high = correction_dim(1.0 if beta_slow is None else beta_slow)
        if truncate:
            low, high = float(math.floor(low)), float(math.ceil(high))
        low, high = max(low, 0.0), min(high, float(d - 1))
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = ((torch.arange(d // 2, **cpu64) - low) / (high - low)).clamp(0, 1)
        inv = (inv / factor) * ramp + inv * (1 - ramp)
    elif rope_type == "longrope":
        factor_in_effect = factor = factor if factor is not None else max_pos / original
        if attention_factor is not None:
            attention = attention_factor
        elif factor <= 1:
            attention = 1.0
        elif original == 1:
            raise ValueError("rope_ext: rope_type 'longrope' with original_max_position_embeddings 1 needs "
                             "attention_factor (its default divides by log(1))")
        else:
            attention = math.sqrt(1 + math.log(factor) / math.log(original))
        inv_long = inv / torch.tensor(long_factor, **cpu64)
        inv = inv / torch.tensor(short_factor, **cpu64)
        switch = original
    elif rope_type == "llama3":
        factor_in_effect = factor
        low, high, orig = low_freq_factor, high_freq_factor, float(original)
        wavelen = inv.reciprocal() * (2 * math.pi)
        scaled = torch.where(wavelen > orig / low, inv / factor, inv)
        smooth = (wavelen.reciprocal() * orig - low) / (high - low) if high > low else torch.zeros_like(wavelen)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= orig / high) & (wavelen <= orig / low)
        inv = torch.where(medium, smoothed, scaled)
    elif rope_type == "proportional":
        share = 1.0 if partial_rotary_factor is None else partial_rotary_factor
        factor_in_effect = 1.0 if factor is None else factor
        inv = inv / factor_in_effect
        inv[math.floor(share * d / 2):] = 0  # these pairs turn with frequency 0: they pass unrotated
    return inv, inv_long, attention, switch, factor_in_effect


def _factors(cfg, key, d) -> list[float]:
    v = cfg[key]
    if (
        not isinstance(v, (list, tuple))
        or len(v) != d // 2
        or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0 for f in v)
    ):
        raise ValueError(
            f"rope_ext: scaling[{key!r}] must be a list of rotary_dim/2 = {d // 2} positive numbers, "
            f"got {v if not isinstance(v, (list, tuple)) else f'{len(v)} values'}"
        )
    return [float(f) for f in v]
