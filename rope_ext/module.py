"""``RotaryEmbedding``: RoPE as an nn.Module, for both conventions, partial rotary, every way of
giving positions, HF's rope-scaling types, xPos and multimodal M-RoPE."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from rope_ext import positions as P
from rope_ext._autograd import below_autograd
from rope_ext._errors import PositionOutsideCache, raise_typed
from rope_ext._ops import (
    _any_requires_grad,
    _compiling,
    _grad_enabled,
    _rotary_pos_qk,
    _rotary_pos_qk_graph,
    _rotary_pos_qk_kernel,
    qk_norm_rotary,
    qk_norm_rotary_pos,
    rotary_qk,
)
from rope_ext._sharding import is_dtensor, replicated_like
from rope_ext._torch_private import assert_async
from rope_ext._validate import require_bool, require_int_list, require_number, require_tensor
from rope_ext.qk_norm import QKNorm
from rope_ext.scaling import RopeSchedule

__all__ = ["RotaryEmbedding"]

LAYOUTS = ("bhsd", "bshd")
# transformers model types whose RoPE always pairs (2i, 2i + 1): rotate_every_two, the complex
# freqs_cis form, or apply_rotary_pos_emb_interleave called unconditionally; their configs carry no
# flag for it. (Configs with rotary_interleaved or rope_interleave say it themselves.)
INTERLEAVED_MODEL_TYPES = frozenset({
    "gptj", "codegen", "deepseek_v2", "llama4", "llama4_text", "deepseek_v32", "longcat_flash", "bailing_hybrid",
    "glm_moe_dsa", "axk2", "mistral_large4", "mistral_large4_text", "dots3_note", "dots3_note_text",
})
# transformers model types whose M-RoPE interleaves its sections' frequencies (Qwen3-VL and later),
# which RotaryEmbedding does not implement: from_hf_config refuses them rather than build chunked
# sections.
INTERLEAVED_MROPE_MODEL_TYPES = frozenset({
    "qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe", "qwen3_vl_moe_text", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen3_omni_moe", "qwen3_omni_moe_text", "qwen3_omni_moe_thinker",
    "qwen3_omni_moe_talker_text", "cohere_compass", "cohere_compass_text",
})
# transformers model types whose text rotary embedding uses M-RoPE with mrope_section [16, 24, 24]
# when the config gives none.
DEFAULT_MROPE_MODEL_TYPES = frozenset({
    "qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_5_omni_text", "qwen2_5_omni_thinker",
    "qwen2_5_omni_talker", "paddleocr_vl", "paddleocr_vl_text",
})


class _Positions(NamedTuple):
    """One forward call's positions, however they were given (forward's step 2)."""

    #: integer positions: (*streams, S) or (*streams, B or 1, S), packed (*streams, T); M-RoPE's
    #: streams = (3,), one row per stream. None for a window.
    tensor: torch.Tensor | None
    #: (start, S) for an int offset: positions start .. start + S - 1, the same for every row.
    window: tuple[int, int] | None = None
    #: where the positions (tensor, or the window's) take the axis of q's heads, to broadcast over
    #: q.shape[:-1]: -2 in "bhsd" ((B, 1, S), M-RoPE's (3, B, 1, S)), -1 in "bshd" ((B, S, 1), (S, 1))
    #: and packed ((T, 1)); None for "bhsd"'s (S,) and (1, S) (M-RoPE's (3, S), (3, 1, S)) and
    #: windows, which broadcast as they are.
    head_axis: int | None = None
    #: whether tensor is the caller's position_ids (every layer of a step passes the same: see _reuse)
    given: bool = False
    #: how many cache rows the positions need at least, known without reading them: a window's
    #: start + S, per-row offsets' S. None: unknown.
    needed: int | None = None
    #: (least, most) position, once read (CPU positions only: a forward never waits for a device)
    extent: tuple[int, int] | None = None


#: Where one forward call's cos and sin come from (forward's step 3), as the op call takes them:
#: (cos, sin, rows, cos_k, sin_k). The cache, with rows set (rotary_pos_qk on cos_cache and
#: sin_cache), or full tables for the call (rotary_qk; rows None), with xPos's own for k. (A plain
#: tuple: a NamedTuple costs a decode step 0.3 us more.)
_Source = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


class RotaryEmbedding(nn.Module):
    """Rotary positional embedding for queries and keys, computed by one fused op call.

    Args:
        dim: head dim D of q and k.
        base: theta base (``rope_theta``); theta_i = base^(-2i/r).
        interleaved: pairing convention. False: half-split (i, i + r/2), as HF/GPT-NeoX/Llama.
            True: (2i, 2i + 1), as GPT-J/RoFormer/Meta.
        rotary_dim: r, the number of rotated columns (even, <= dim); the rest pass through.
        partial_rotary_factor: alternative to rotary_dim: r = int(dim * factor), as in HF.
        scaling: HF ``rope_scaling`` / ``rope_parameters`` dict (``rope_type`` default, linear,
            dynamic, yarn, longrope, llama3 or proportional, with that type's keys); see
            :mod:`rope_ext.scaling`.
        max_position_embeddings: the model's context length (used by the scaling types).
        layout: required, keyword. ``"bhsd"``: q, k are (batch, heads, seqlen, D), HF's layout;
            ``"bshd"``: (batch, seqlen, heads, D), flash-attn's. Packed inputs (cu_seqlens) are
            always (total_tokens, heads, D). There is no default: with as many q as k heads the
            two layouts have the same shapes, and the wrong one rotates along the head axis
            without an error. (:meth:`from_hf_config` takes ``"bhsd"``, HF attention's layout.)
        xpos_scale_base: enables xPos (Sun et al., 2022): q is scaled by zeta^((n - c) / scale_base)
            and k by zeta^(-(n - c) / scale_base), zeta_i = (2i + 0.4 r) / (1.4 r), c = xpos_center.
            q . k then carries zeta^((m - n) / scale_base), whatever c. None: off.
        xpos_center: c above, a fixed position, the same for every call, so keys cached at one
            step and queries of a later one stay consistent. Default: ``max_position_embeddings //
            2``, or ``xpos_reach(float32)`` if that is smaller (so position 0 stays in reach). The
            scales must stay inside the float range: positions more than :meth:`xpos_reach` from
            c are refused (about 55 scale_base for float32 and bfloat16 q and k; 4.4 scale_base
            for float16, whose range is smaller: set xpos_center near the positions you use).
        mrope_section: multimodal M-RoPE (Qwen2-VL): frequencies split into sections
            [temporal, height, width] (summing to r/2), each driven by its own row of
            (3, B, S) position_ids.
        device: where the frequency buffers live.
        dtype: accepted for nn.Module-constructor compatibility. Tables are always float32
            (angles float64), whatever the module's dtype; ``.to(torch.bfloat16)`` does not
            degrade them.

    The frequency buffers are non-persistent (not in ``state_dict``) and recomputed from the
    configuration when the module moves, so meta-device init + ``to_empty`` gives correct tables.
    Under torch.compile, forward reads no Python state (eager calls remember the previous call's
    positions view, see ``_reuse``): it does not recompile on new lengths or positions.
    """

    def __init__(
        self,
        dim: int,
        base: float = 10000.0,
        *,
        interleaved: bool = False,
        rotary_dim: int | None = None,
        partial_rotary_factor: float | None = None,
        scaling: dict | None = None,
        max_position_embeddings: int = 2048,
        layout: str | None = None,
        xpos_scale_base: float | None = None,
        xpos_center: int | None = None,
        mrope_section: list[int] | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"rope_ext.RotaryEmbedding: dim must be a positive int, got {dim!r}")
        if rotary_dim is not None and partial_rotary_factor is not None:
            raise ValueError("rope_ext.RotaryEmbedding: give rotary_dim or partial_rotary_factor, not both")
        proportional = isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "proportional"
        if proportional and partial_rotary_factor is not None:
            raise ValueError(
                "rope_ext.RotaryEmbedding: with rope_type 'proportional', partial_rotary_factor belongs in scaling: "
                "it sets how many pairs turn, not how many columns rotate"
            )
        if (scaling and "partial_rotary_factor" in scaling and partial_rotary_factor is None and rotary_dim is None
                and not proportional):
            partial_rotary_factor = scaling["partial_rotary_factor"]
        require_bool(interleaved, "interleaved")
        if partial_rotary_factor is not None:
            require_number(partial_rotary_factor, "partial_rotary_factor")
            if not 0 < partial_rotary_factor <= 1:
                raise ValueError(
                    f"rope_ext.RotaryEmbedding: partial_rotary_factor must be in (0, 1], got {partial_rotary_factor!r}"
                )
            rotary_dim = int(dim * partial_rotary_factor)
        rotary_dim = dim if rotary_dim is None else rotary_dim
        if (
            isinstance(rotary_dim, bool)
            or not isinstance(rotary_dim, int)
            or not 0 < rotary_dim <= dim
            or rotary_dim % 2
        ):
            raise ValueError(
                f"rope_ext.RotaryEmbedding: rotary_dim must be an even int in (0, dim={dim}], got {rotary_dim!r}"
            )
        if layout is None:
            raise TypeError(
                "rope_ext.RotaryEmbedding: give layout='bhsd' for q, k of shape (batch, heads, seqlen, head_dim) "
                "(HF) or layout='bshd' for (batch, seqlen, heads, head_dim) (flash-attn). It has no default: "
                "with as many q as k heads both have the same shapes, and the wrong one would silently rotate "
                "along the head axis"
            )
        if layout not in LAYOUTS:
            raise ValueError(f"rope_ext.RotaryEmbedding: layout must be one of {LAYOUTS}, got {layout!r}")
        if xpos_scale_base is not None:
            require_number(xpos_scale_base, "xpos_scale_base")
        if xpos_center is not None and (isinstance(xpos_center, bool) or not isinstance(xpos_center, int)
                                        or xpos_scale_base is None):
            raise ValueError(
                f"rope_ext.RotaryEmbedding: xpos_center must be an int, given with xpos_scale_base; got {xpos_center!r}"
            )
        if mrope_section is not None and xpos_scale_base is not None:
            raise ValueError("rope_ext.RotaryEmbedding: xPos and M-RoPE cannot be combined")
        if mrope_section is not None and sum(require_int_list(mrope_section, "mrope_section")) != rotary_dim // 2:
            raise ValueError(
                f"rope_ext.RotaryEmbedding: mrope_section must be positive sizes summing to "
                f"rotary_dim/2 = {rotary_dim // 2}, got {mrope_section!r}"
            )

        self.dim, self.rotary_dim, self.interleaved, self.layout = dim, rotary_dim, interleaved, layout
        self.max_position_embeddings = int(max_position_embeddings)
        self.xpos_scale_base = xpos_scale_base
        if xpos_center is None and xpos_scale_base is not None:  # the middle of the context, or as near as
            # float32's range lets position 0 stay in reach
            xpos_center = min(self.max_position_embeddings // 2, P.xpos_reach(xpos_scale_base, torch.float32))
        self.xpos_center = xpos_center
        self.mrope_section = None if mrope_section is None else tuple(int(s) for s in mrope_section)
        self.schedule = RopeSchedule.from_config(
            scaling, base=base, rotary_dim=rotary_dim, max_position_embeddings=max_position_embeddings
        )
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        # Device-resident inputs of the per-call tables, built once here so that a forward copies
        # nothing from the host: longrope's long frequencies, and M-RoPE's stream of each frequency.
        self.register_buffer("_inv_freq_long", torch.empty(0, dtype=torch.float64), persistent=False)
        self.register_buffer("_mrope_stream", torch.empty(0, dtype=torch.int64), persistent=False)
        # Half-width (positions, r/2) float32 tables that forward gathers from (rotary_pos_qk), and
        # arange(positions) for int offsets (a slice of it is a view: no kernel per call).
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self.register_buffer("_steps", torch.empty(0, dtype=torch.int64), persistent=False)
        self._cache_kind = self._kind_of_cache()  # (the configuration never changes after construction)
        self._retired_caches: list[tuple[torch.Tensor, ...]] = []  # (see _build_cache)
        self._init_buffers(torch.get_default_device() if device is None else torch.device(device))

    @classmethod
    def from_hf_config(
        cls, config, *, layout: str = "bhsd", device=None, layer_type: str | None = None
    ) -> RotaryEmbedding:
        """Builds the module of a transformers ``PretrainedConfig`` (head_dim, rope_theta,
        rope_scaling / rope_parameters, partial_rotary_factor, max_position_embeddings,
        mrope_section), with the model's pairing: interleaved for GPT-J and CodeGen, and for a config
        with ``rotary_interleaved=True`` or ``rope_interleave=True`` (DeepSeek-V3, GLM-4-MoE-Lite,
        Mistral 4 and others, whose attention then calls ``apply_rotary_pos_emb_interleave``);
        half-split otherwise.

        layer_type: for configs whose rope_parameters are given per layer type (Gemma 3's
        ``full_attention`` and ``sliding_attention``), the type whose parameters to use (one of
        ``config.layer_types``); required there, and ignored by configs with one set."""
        params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        if params and all(isinstance(v, dict) for v in params.values()):  # one set per layer type
            if layer_type not in params:
                raise ValueError(
                    f"rope_ext.RotaryEmbedding.from_hf_config: this config's rope_parameters are given per layer "
                    f"type ({', '.join(sorted(params))}): pass layer_type= one of them, got {layer_type!r}"
                )
            params = dict(params[layer_type])
            per_layer = getattr(config, "per_layer_config", None)
            if per_layer is not None:  # Gemma 4: sizes such as head_dim differ per layer type too
                config = per_layer[layer_type]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = params.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
        model_type = getattr(config, "model_type", None)
        mrope = params.pop("mrope_section", None)
        if mrope is None and model_type in DEFAULT_MROPE_MODEL_TYPES:
            mrope = [16, 24, 24]  # what these models' rotary embeddings fall back to in transformers
        if params.pop("mrope_interleaved", False) or model_type in INTERLEAVED_MROPE_MODEL_TYPES:
            raise ValueError(
                f"rope_ext.RotaryEmbedding.from_hf_config: interleaved M-RoPE (model type {model_type!r}) is not "
                "supported yet; building chunked sections instead would rotate image and video tokens wrongly"
            )
        if params.get("rope_type") == "proportional":  # the share of turning pairs, kept in scaling
            partial = None
            params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
        else:
            partial = params.pop("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
        rotary_dim = getattr(config, "rotary_dim", None) if partial is None else None
        if (
            "original_max_position_embeddings" not in params
            and hasattr(config, "original_max_position_embeddings")
            and params.get("rope_type", params.get("type")) in ("llama3", "yarn", "longrope")
        ):
            params["original_max_position_embeddings"] = config.original_max_position_embeddings
        return cls(
            head_dim,
            base,
            rotary_dim=rotary_dim,
            partial_rotary_factor=partial,
            scaling=params or None,
            max_position_embeddings=config.max_position_embeddings,
            layout=layout,
            mrope_section=mrope,
            interleaved=bool(getattr(config, "rotary_interleaved", False))
            or bool(getattr(config, "rope_interleave", False))  # DeepSeek-V3 and its kin (MLA), default True
            or model_type in INTERLEAVED_MODEL_TYPES,
            device=device,
        )

    # -- buffers ---------------------------------------------------------------------------

    def _init_buffers(self, device):
        self.inv_freq = self.schedule.inv_freq(device=device)  # float64 (r/2,)
        long = self.schedule.inv_freq_long
        self._inv_freq_long = torch.tensor(() if long is None else long, dtype=torch.float64, device=device)
        # M-RoPE: frequency j follows the stream (temporal, height, width) of the section it falls in.
        sections = self.mrope_section or ()
        self._mrope_stream = torch.tensor([i % 3 for i, s in enumerate(sections) for _ in range(s)], dtype=torch.int64,
                                          device=device)
        self._build_cache(max(self._cached_positions(), self.max_position_embeddings), device)

    def _kind_of_cache(self) -> str | None:
        """How forward gathers from cos_cache/sin_cache (rows of float32 cos/sin, one per position):
        - "static": rows 0..n-1 of the one set of frequencies;
        - "longrope": rows 0..switch-1 hold the short frequencies and rows switch..switch+n-1 the long
          ones (switch = original_max_position_embeddings); a call whose largest position reaches
          switch reads the long rows (its positions shifted on the device: no host sync);
        - "dynamic": rows 0..max_position_embeddings-1 of the base frequencies, exact for every call
          whose positions all fall below max_position_embeddings (past it, NTK's frequencies depend on
          the call's length, and the call builds its tables; device positions, which cannot be read
          without a sync, always do);
        - None (M-RoPE mixes three position streams, xPos scales q and k apart): per-call tables,
          still one op call on q and k."""
        if self.mrope_section is not None or self.xpos_scale_base is not None:
            return None
        return self.schedule.rope_type if self.schedule.rope_type in ("dynamic", "longrope") else "static"

    def _cached_positions(self) -> int:
        """How many positions the cache covers (0 before it is built), from the buffer forward reads."""
        rows = self._buffers["cos_cache"].shape[0]
        return max(0, rows - self.schedule.switch_len) if self._cache_kind == "longrope" else rows

    def ensure_positions(self, n: int) -> None:
        """Makes the cache cover positions 0..n-1 (eager). forward grows it by itself for int
        offsets; position tensors are never read (that would wait for the device), so a position
        past the cache is the op's error (a RuntimeError on the CPU naming it, a device-side assert
        on CUDA) unless this was called first. (Dynamic NTK's cache stays at
        max_position_embeddings: calls past it build their tables.)"""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"rope_ext.RotaryEmbedding.ensure_positions: n must be an int >= 0, got {n!r}")
        if self._cache_kind in ("static", "longrope") and n > self._cached_positions():
            self._build_cache(n, self.inv_freq.device, grow=True)

    def _build_cache(self, n: int, device, grow: bool = False) -> None:
        """cos_cache, sin_cache covering positions 0..n-1 (see _kind_of_cache): cos/sin of
        p * theta_i (angles in float64) times the attention factor, rounded once to float32; and
        _steps = arange(rows)."""
        kind = self._cache_kind
        if kind is None:
            return
        old = (self._buffers["cos_cache"], self._buffers["sin_cache"], self._buffers["_steps"])
        if grow and old[0].numel() and old[0].device.type != "cpu":
            # Off the CPU, a CUDA graph captured earlier holds these buffers' addresses: freeing them
            # would let a replay read whatever the allocator puts there next. Growing for a call at
            # least doubles the cache, so those kept add up to less than the current buffers (more
            # only if ensure_positions is called in many small steps).
            self._retired_caches.append(old)
        # Ordinary tensors even when grown under inference_mode, so that training can use them later.
        with torch.inference_mode(False), torch.no_grad():
            inv = self.inv_freq.to(device)
            if kind == "dynamic":
                angles = torch.arange(self.max_position_embeddings, dtype=torch.float64, device=device)[:, None] * inv
            elif kind == "longrope":
                inv_long = self._inv_freq_long.to(device)
                positions = torch.arange(max(n, self.schedule.switch_len), dtype=torch.float64, device=device)[:, None]
                angles = torch.cat((positions[: self.schedule.switch_len] * inv, positions[:n] * inv_long))
            else:
                angles = torch.arange(n, dtype=torch.float64, device=device)[:, None] * inv
            self.cos_cache = (angles.cos() * self.attention_factor).float()
            self.sin_cache = (angles.sin() * self.attention_factor).float()
            self._steps = torch.arange(angles.shape[0], dtype=torch.int64, device=device)

    #: The most positions the cache grows to (64 MiB of float32 tables at rotary_dim 128), unless
    #: max_position_embeddings is larger. Positions past it are rotated with tables built for the
    #: call (exact float64 angles at any position), as are all positions of the non-cached types.
    max_cache_positions = 1 << 17

    def _cache_covers(self, needed: int) -> bool:
        """Whether the cache covers positions < needed, growing it if allowed (eager only: under
        torch.compile the buffers are fixed; positions past them are the op's bounds error, and an
        int offset's window past them fails to trace). The dynamic type's never grows: past
        max_position_embeddings its frequencies change with the length; and compiled, it always
        builds its tables (choosing by the length would guard on it and recompile)."""
        dynamic = self._cache_kind == "dynamic"
        if torch.compiler.is_compiling():
            return not dynamic
        rows = self._cached_positions()
        if needed <= rows:
            return True
        if dynamic or needed > max(self.max_cache_positions, self.max_position_embeddings):
            return False
        self._build_cache(min(max(needed, 2 * rows), max(self.max_cache_positions, self.max_position_embeddings)),
                          self.inv_freq.device, grow=True)
        return True

    def _apply(self, fn, recurse=True):
        # .to(dtype), .half(), to_empty(): keep the frequencies float64 and exact by rebuilding
        # them from the configuration on whatever device fn moved them to.
        super()._apply(fn, recurse)
        # (a graph captured before a move or cast holds the replaced inv_freq too: nothing to keep)
        self._retired_caches = []
        self._init_buffers(self.inv_freq.device)
        return self

    @property
    def attention_factor(self) -> float:
        return self.schedule.attention_factor

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, rotary_dim={self.rotary_dim}, interleaved={self.interleaved}, "
            f"rope_type={self.schedule.rope_type!r}, layout={self.layout!r}"
        )

    # -- tables ----------------------------------------------------------------------------

    def cos_sin(self, position_ids: torch.Tensor, *, dtype=torch.float32):
        """HF-format tables for the given positions: ``(cos, sin)`` of shape
        ``position_ids.shape + (rotary_dim,)`` (for M-RoPE, position_ids is (3, B, S), or text
        positions (B, S) or (S,) that drive all three streams, and the tables are (B, S, rotary_dim)),
        attention factor applied, full form for this module's
        convention. Like HF's ``XxxRotaryEmbedding(x, position_ids)``, with float32 tables by
        default (pass ``dtype=x.dtype`` for HF's cast).
        """
        P.check_positions(position_ids)
        return self._cos_sin(self._streams(position_ids, text_dims=2), dtype)

    def _streams(self, position_ids, text_dims, batch=None):
        """M-RoPE's (3, ...) position streams. Text positions drive all three streams alike, as in
        transformers: (B, S) or (S,) (packed: (T,); text_dims = their most dims), or (1, B, S). Stream
        positions: (3, B, S), (3, 1, S), packed (3, T); and (3, S) shared by a batch of `batch` != 3.
        (3, S) is ambiguous when the batch may be 3 (a batch of 3 rows of text, or three streams):
        refused. Other modules' positions are returned as they are."""
        if self.mrope_section is None or position_ids is None:
            return position_ids
        d = position_ids.dim()
        if d == text_dims + 1 and position_ids.shape[0] == 1:
            return position_ids.expand(3, *position_ids.shape[1:])
        if d > text_dims:
            return position_ids
        if d == 2 and position_ids.shape[0] == 3:
            if batch is not None and batch != 3:
                return position_ids  # three streams shared by the batch
            raise ValueError(
                f"rope_ext.RotaryEmbedding: with mrope_section, position_ids of shape {tuple(position_ids.shape)} are "
                "ambiguous (three streams, or text positions of 3 rows): pass streams as (3, 1, S) or (3, B, S), "
                "text positions as (1, B, S)"
            )
        return position_ids.unsqueeze(0).expand(3, *position_ids.shape)

    def _cos_sin(self, position_ids, dtype=torch.float32):
        """cos_sin for checked position_ids."""
        inv = self._inv_freq_for(position_ids)
        if self.mrope_section is None:
            return P._tables(
                position_ids, inv, interleaved=self.interleaved, scale=self.attention_factor, dtype=dtype
            )
        if position_ids.dim() < 1 or position_ids.shape[0] != 3:
            raise ValueError(
                f"rope_ext.RotaryEmbedding: with mrope_section, position_ids must have shape "
                f"(3, batch, seqlen), got {tuple(position_ids.shape)}"
            )
        stream = self._mrope_stream.to(position_ids.device)
        cos, sin = P._tables(
            position_ids, inv, interleaved=False, scale=self.attention_factor, dtype=torch.float64
        )  # (3, B, S, r): the two halves repeat
        half = self.rotary_dim // 2
        idx = stream.view(1, *([1] * (cos.dim() - 2)), half).expand(1, *cos.shape[1:-1], half)
        c, s = cos[..., :half].gather(0, idx)[0], sin[..., :half].gather(0, idx)[0]
        if self.interleaved:
            c, s = c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
        else:
            c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
        return c.to(dtype), s.to(dtype)

    def _inv_freq_for(self, position_ids):
        if self.schedule.rope_type in ("dynamic", "longrope"):
            device = position_ids.device
            return self.schedule.scale(self.inv_freq.to(device), self._inv_freq_long.to(device),
                                       position_ids.max() if position_ids.numel() else None)
        return self.inv_freq.to(position_ids.device)

    # -- forward: 1. check the call, 2. resolve its positions, 3. pick its tables, 4. one op call --

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        offset: int | torch.Tensor = 0,
        cu_seqlens: torch.Tensor | None = None,
        norm: QKNorm | None = None,
    ):
        """Rotate q and k (first RMS-normalized by ``norm``, in the same op call, when it is given).

        Args:
            q, k: ``(B, H, S, D)`` for layout ``"bhsd"``, ``(B, S, H, D)`` for ``"bshd"``, or packed
                ``(T, H, D)`` when cu_seqlens is given. k may have fewer heads (GQA/MQA).
            position_ids: explicit positions, ``(B, S)`` or ``(S,)``. For M-RoPE, ``(3, B, S)`` (or
                ``(3, 1, S)``; packed ``(3, T)``): one row per stream; text positions of the plain
                shapes drive all three streams, as in transformers.
                Default: ``offset + arange(S)``.
            offset: int, or ``(B,)`` tensor of per-row offsets: the number of cached tokens when
                decoding with a KV cache. Not combined with position_ids.
            cu_seqlens: ``(N+1,)`` cumulative sequence lengths of packed q/k; positions restart
                at each sequence start (plus ``offset[j]`` if offset is a ``(N,)`` tensor).
            norm: a :class:`rope_ext.QKNorm` holding the model's q and k norm weights: q and k are
                normalized and rotated by one op (qk_norm_rotary_pos; qk_norm_rotary where the
                call builds its tables), as the model's norms then its RoPE would, with gradients to
                the weights. Not with xPos (whose k tables differ from q's).

        Returns:
            ``(q_out, k_out)``, rotated, with q's and k's shapes, dtypes and layouts.

        Cost: one op call on q and k (rotary_pos_qk), which gathers each token's row of
        ``cos_cache``/``sin_cache`` in the kernel; calls the cache cannot serve (dynamic NTK past
        ``max_position_embeddings``, compiled or on device positions; xPos; M-RoPE) build their
        tables and make one rotary_qk call. Nothing in it reads device tensor values or waits for
        the device: the kernel checks every position against the cache. The cache covers
        ``max_position_embeddings`` positions; in eager mode it grows (up to
        ``max_cache_positions``, then the call builds its own tables) for int offsets and for CPU
        positions past it. On a GPU, size it for the positions you pass (``max_position_embeddings``
        or :meth:`ensure_positions`): a position past it is a device-side assert.

        DTensors: q and k may be DTensors (tensor parallel over heads, sequence parallel over
        tokens). Shapes are then the global ones, and so are the default positions: a q sharded
        over the sequence is rotated by its tokens' global positions. The module's tables and
        positions, the same on every rank, enter the op as replicated DTensors.
        """
        if norm is not None:
            self._check_norm(norm, cu_seqlens)
        at = self._positions(q, k, position_ids, offset, cu_seqlens)  # steps 1 and 2
        source = self._source(q, at)  # step 3
        try:
            return self._op(q, k, source, norm)  # step 4
        except PositionOutsideCache:  # (costs nothing unless raised)
            if not self._can_read(at):
                raise
            # The CPU kernel refused a position past the cache (it checks them all before writing
            # anything): read the positions, then grow the cache for them or build their tables.
            return self._op(q, k, self._source(q, self._read(at)), norm)

    def _check_norm(self, norm, cu_seqlens) -> None:
        if not isinstance(norm, QKNorm):
            raise TypeError(f"rope_ext.RotaryEmbedding: norm must be a rope_ext.QKNorm, got {type(norm).__name__}")
        if self.xpos_scale_base is not None:
            raise ValueError("rope_ext.RotaryEmbedding: norm cannot be combined with xPos (k's tables differ from q's)")
        if norm.norm_over == "heads" and self.layout == "bhsd" and cu_seqlens is None:
            raise ValueError(
                "rope_ext.RotaryEmbedding: a norm across heads needs the heads at dim -2 of q and k: layout 'bshd' "
                "(or packed q and k), not 'bhsd'"
            )

    def _positions(self, q, k, position_ids, offset, cu_seqlens) -> _Positions:
        """Steps 1 and 2 of forward: every argument checked, once, and every way of giving positions
        (position_ids, an int offset, per-row offsets, packed cu_seqlens, M-RoPE's streams) resolved
        into one _Positions. Reads no device values (device cu_seqlens are checked on the device)."""
        require_tensor(q, "q")
        require_tensor(k, "k")
        streams = () if self.mrope_section is None else (3,)
        if position_ids is not None:
            P.require_int_tensor(position_ids, "position_ids")
            if not (isinstance(offset, int) and offset == 0):
                raise ValueError("rope_ext.RotaryEmbedding: give position_ids or offset, not both")
            if self._cache_kind is None and P._readable(position_ids):  # (the cache's kernel checks them)
                P.check_positions(position_ids)  # their sign, for tables
        if cu_seqlens is not None:  # packed q, k (T, H, D)
            if q.dim() != 3:
                raise ValueError(
                    f"rope_ext.RotaryEmbedding: with cu_seqlens, q and k must be packed (T, H, D), "
                    f"got q of shape {tuple(q.shape)}"
                )
            T = q.shape[0]
            if position_ids is None:  # restarting at each sequence's start (plus its offset)
                positions = P.packed_positions(cu_seqlens, T, offset, name="offset")
                return _Positions(self._streams(positions, 1), head_axis=-1)
            P.check_cu_seqlens(cu_seqlens, T)
            positions = self._streams(position_ids, 1)
            if P._validating() and tuple(positions.shape) != (*streams, T):
                raise ValueError(
                    f"rope_ext.RotaryEmbedding: position_ids of packed q must have shape {(*streams, T)}, "
                    f"got {tuple(positions.shape)}"
                )
            return _Positions(positions, head_axis=-1, given=True)
        if q.dim() != 4:
            raise ValueError(
                f"rope_ext.RotaryEmbedding: q must be 4-D ({'B, H, S, D' if self.layout == 'bhsd' else 'B, S, H, D'}"
                f" for layout {self.layout!r}), got shape {tuple(q.shape)}"
            )
        bhsd = self.layout == "bhsd"
        shape = q.shape
        B, S = shape[0], shape[2] if bhsd else shape[1]
        if position_ids is None:
            P._check_offsets(offset, B, S, "offset", "(batch,)")
            if isinstance(offset, int):  # positions offset .. offset + S - 1, known without a tensor
                # (positional on the decode paths: keywords cost a NamedTuple a tenth of a microsecond more)
                return _Positions(None, (offset, S), None if bhsd else -1, False, offset + S)
            # per-row offsets: (B, S), each row from an offset >= 0 (checked): S rows at least
            positions = offset.to(device=q.device, dtype=torch.int64).unsqueeze(1) + self._arange(S, q.device)
            if streams:  # the same positions drive the three streams (B may be 3: no _streams here)
                positions = positions.unsqueeze(0).expand(3, *positions.shape)
            return _Positions(positions, head_axis=-2 if bhsd else -1, needed=S)
        positions = self._streams(position_ids, 2, batch=B) if streams else position_ids
        # Checked in eager only: comparing symbolic sizes would add guards while tracing (the op
        # checks the broadcast there, naming cos/sin).
        if P._validating() and positions.shape not in (((S,), (1, S), (B, S)) if not streams else
                                                       ((*streams, S), (*streams, 1, S), (*streams, B, S))):
            expected = f"{(3, B, S)} or {(3, 1, S)} (streams), or {(B, S)} or {(S,)} (text)" if streams else \
                f"{(B, S)} or {(S,)}"
            raise ValueError(
                f"rope_ext.RotaryEmbedding: position_ids must have shape {expected} for q of shape "
                f"{tuple(q.shape)}, got {tuple(position_ids.shape)}"
            )
        if not bhsd:
            return _Positions(positions, None, -1, True)
        batched = positions.dim() - len(streams) == 2 and positions.shape[-2] != 1
        return _Positions(positions, None, -2 if batched else None, True)

    def _source(self, q, at: _Positions) -> _Source:
        """Step 3 of forward: where the call's cos and sin come from.
        - The cache (rotary_pos_qk on cos_cache/sin_cache at the positions' rows), for the cached
          kinds (see _kind_of_cache), when it covers the positions: known (an int offset's window,
          positions read) and covered, growing it in eager mode if needed; or not known, and then
          checked against it by the kernel (for dynamic NTK, only positions it can refuse without a
          sync: CPU ones; forward reads them when it does).
        - Otherwise tables built for the call (rotary_qk): M-RoPE, xPos, dynamic NTK past
          max_position_embeddings or on device positions, positions past max_cache_positions.
        A DTensor q's positions are read first when they can be: each rank's kernel checks only its
        share of them, so a position past the cache would send the ranks different ways."""
        kind = self._cache_kind
        if kind is None:
            return self._tables(q, at)
        if at.needed is not None and not self._cache_covers(at.needed):  # (grown if it may be)
            return self._tables(q, at)
        buffers = self._buffers  # (read after _cache_covers, which may grow the cache)
        if at.window is not None:  # an int offset: views of _steps, remembered from the last call
            start, S = at.window
            if self._long_rows(start + S):
                start += self.schedule.switch_len
            steps = buffers["_steps"]  # (replaced, with the cache, whenever the cache is)
            return self._reuse(steps, (start, S), lambda: (buffers["cos_cache"], buffers["sin_cache"],
                                                           self._shaped(steps[start : start + S], at.head_axis),
                                                           None, None))
        if (at.extent is None and type(q) is not torch.Tensor and is_dtensor(q)
                and type(at.tensor) is torch.Tensor and P._readable(at.tensor) and at.tensor.numel()):
            at = self._read(at)
        if at.extent is not None:  # read: the cache covers them, grown if needed, or tables
            if not self._cache_covers(at.extent[1] + 1):
                return self._tables(q, at)
        elif kind == "dynamic" and not P._readable(at.tensor):  # the kernel could not refuse them
            return self._tables(q, at)
        cos_cache, sin_cache = buffers["cos_cache"], buffers["sin_cache"]
        # The caller's position_ids with a view or longrope's rows to make: made once a step, as every
        # layer of a model passes the same (see _reuse; keyed on the cache too, which may have grown
        # since, and on the head axis: a 1-D tensor takes none in a 4-D "bhsd" call, -1 packed).
        if at.given and (at.head_axis is not None or kind == "longrope"):
            return self._reuse(at.tensor, (id(cos_cache), at.head_axis), lambda: (
                cos_cache, sin_cache, self._rows(self._shaped(at.tensor, at.head_axis)), None, None), versioned=True)
        rows = at.tensor if at.head_axis is None else at.tensor.unsqueeze(at.head_axis)
        return cos_cache, sin_cache, self._rows(rows) if kind == "longrope" else rows, None, None

    def _tables(self, q, at: _Positions) -> _Source:
        """Full cos/sin tables for the call's positions (rotary_qk), shaped like the positions plus
        rotary_dim, so that they broadcast over q's heads; xPos's scaled one way for q and the other
        for k."""
        if at.window is not None:
            start, S = at.window
            positions = self._shaped(self._streams(torch.arange(start, start + S, device=q.device), 2), at.head_axis)
        else:
            positions = self._shaped(at.tensor, at.head_axis)
        cos, sin = self._cos_sin(positions)
        if self.xpos_scale_base is None:
            return cos, sin, None, None, None
        scale = self._xpos_scale(positions, q.dtype)
        return cos * scale, sin * scale, None, cos / scale, sin / scale

    def _op(self, q, k, source: _Source, norm: QKNorm | None = None):
        """Step 4 of forward: the one op call. A DTensor q gets the module's tables and rows as
        DTensors replicated on its mesh (the same on every rank)."""
        cos, sin, rows, cos_k, sin_k = source
        if type(q) is not torch.Tensor:
            cos, sin, rows, cos_k, sin_k = (None if t is None else replicated_like(q, t)[0] for t in source)
        if norm is not None:
            kw = dict(eps=norm.eps, weight_offset=norm.weight_offset, norm_over=norm.norm_over,
                      interleaved=self.interleaved)
            q_weight, k_weight = norm.q_weight, norm.k_weight
            if type(q) is not torch.Tensor:  # plain weights enter a DTensor q's op replicated
                q_weight, k_weight = (None if w is None else replicated_like(q, w)[0] for w in (q_weight, k_weight))
            if rows is not None:
                return qk_norm_rotary_pos(q, k, q_weight, k_weight, cos, sin, rows, **kw)
            return qk_norm_rotary(q, k, q_weight, k_weight, cos, sin, **kw)
        if rows is not None:  # (rope_ext.rotary_pos_qk's lines, inline: a Python frame less per decode step)
            try:
                if _compiling():
                    return _rotary_pos_qk(q, k, cos, sin, rows, self.interleaved, False)
                if _grad_enabled() and _any_requires_grad(q, k, cos, sin):
                    return _rotary_pos_qk_graph(q, k, cos, sin, rows, self.interleaved, False)
                with below_autograd():
                    return _rotary_pos_qk_kernel(q, k, cos, sin, rows, self.interleaved, False)
            except RuntimeError as error:
                raise_typed(error)
                raise
        return rotary_qk(q, k, cos, sin, interleaved=self.interleaved, cos_k=cos_k, sin_k=sin_k)

    @staticmethod
    def _can_read(at: _Positions) -> bool:
        """Whether forward may read positions the CPU kernel refused (PositionOutsideCache) and
        try again: positions not read yet, on the CPU, in eager mode. On a device, sizing the cache
        is the caller's part (max_position_embeddings, ensure_positions): a position past it is the
        kernel's device-side assert, and reading device positions would wait for the device."""
        return at.tensor is not None and at.extent is None and P._readable(at.tensor) and at.tensor.numel() > 0

    def _read(self, at: _Positions) -> _Positions:
        """at with its extent read from its positions (readable: see _can_read), and
        negative positions refused by name."""
        least, most = P.extremes(at.tensor)
        if least < 0:
            raise ValueError(f"rope_ext: position_ids must be >= 0, got a minimum of {least}")
        return at._replace(extent=(least, most))

    @staticmethod
    def _shaped(positions: torch.Tensor, head_axis: int | None) -> torch.Tensor:
        """positions with the axis of q's heads (see _Positions.head_axis), to broadcast over q.shape[:-1]."""
        return positions if head_axis is None else positions.unsqueeze(head_axis)

    def _arange(self, n: int, device) -> torch.Tensor:
        """arange(n) on the device: a view of _steps when it is long enough and there (eager: no
        kernel), else a new tensor."""
        steps = self._buffers["_steps"]
        if not torch.compiler.is_compiling() and steps.shape[0] >= n and steps.device == device:
            return steps.narrow(0, 0, n)
        return torch.arange(n, device=device)

    def _reuse(self, source, key, make, *, versioned=False):
        """make(), or the previous call's result if it came from the same tensor `source` (by
        identity) with the same key and, if `versioned`, the same version counter. Every layer of a
        model calls its rotary module with the same positions in a step; the views and tensors built
        from them (~3 us each in eager) are then built once per step rather than once per layer. They
        are views of `source` or, keyed on its version counter, computed from it (longrope's rows),
        so in-place updates through torch are seen (writes that bypass the version counter, through
        .data or DLPack, are not, for longrope). Eager and outside inference_mode only (inference
        tensors have no version counter, and must not reach a later training call)."""
        if torch.compiler.is_compiling() or (source.is_cuda and torch.cuda.is_current_stream_capturing()):
            # (under CUDA graph capture a memo would bake in rows computed from the warm-up's
            # positions, and a later eager call would free the tensor the graph reads)
            return make()
        last = self.__dict__.get("_last_rows")
        if last is not None and last[0] is source and last[1] == key:  # (never an inference tensor)
            if not versioned or last[2] == source._version:
                return last[3]
        rows = make()
        if not torch.is_inference_mode_enabled() and not source.is_inference():
            version = source._version if versioned else None
            self.__dict__["_last_rows"] = (source, key, version, rows)  # (past nn.Module.__setattr__)
        return rows

    def _long_rows(self, length: int) -> bool:
        """Whether a call of this length reads longrope's long rows."""
        return self._cache_kind == "longrope" and length > self.schedule.switch_len

    def _rows(self, positions):
        """The cache rows of a positions tensor: longrope's long rows (positions + switch_len) when the
        largest position reaches switch_len, computed on the device; negative positions are left as
        they are, for the kernel to refuse. The positions themselves for the other kinds."""
        if self._cache_kind != "longrope" or positions.numel() == 0:
            return positions
        switch = self.schedule.switch_len
        long = positions.amax() >= switch
        return torch.where(positions >= 0, positions + long * switch, positions)

    def xpos_reach(self, dtype: torch.dtype = torch.float32) -> int:
        """How far from xpos_center a position may be, for q and k of this dtype: the scales
        ``zeta ** (+-(n - c) / scale_base)`` stay within ``2 ** +-100`` (float16: ``2 ** +-8``)."""
        return P.xpos_reach(self.xpos_scale_base, dtype)

    def _xpos_scale(self, position_ids, dtype):
        """zeta_i^((n - c) / scale_base) in the tables' full form, computed in float64; positions
        farther than xpos_reach from the centre are refused (on the device for device positions:
        no host sync)."""
        distance = position_ids - self.xpos_center
        reach = self.xpos_reach(dtype)
        message = (
            f"rope_ext.RotaryEmbedding: with xPos (xpos_scale_base={self.xpos_scale_base}) positions must be within "
            f"{reach} of xpos_center={self.xpos_center} for {dtype} q and k (xPos's scales stay within "
            f"2^+-{P.xpos_bits(dtype)})"
        )
        if P._readable(position_ids):
            if distance.numel() and max(-(extent := P.extremes(distance))[0], extent[1]) > reach:
                raise ValueError(f"{message}; got positions {extent[0] + self.xpos_center} to "
                                 f"{extent[1] + self.xpos_center}. Set xpos_center nearer them, or a larger "
                                 "xpos_scale_base")
        else:
            assert_async((distance.abs() <= reach).all(), message)
        r = self.rotary_dim
        zeta = (torch.arange(0, r, 2, dtype=torch.float64, device=position_ids.device) + 0.4 * r) / (1.4 * r)
        scale = zeta ** (distance.to(torch.float64)[..., None] / self.xpos_scale_base)
        scale = scale.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((scale, scale), dim=-1)
        return scale.to(torch.float32)
