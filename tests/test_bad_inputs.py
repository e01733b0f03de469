"""The bad-input matrix: every public entry point of rope_ext, called wrongly, raises a clear error.

Each case in CASES is one bad call (a short Python snippet) against rope_ext.rotary / rotary_qk /
rotary_, RotaryEmbedding (constructor, forward, cos_sin), the HF and flash-attn drop-ins,
rope_ext.positions, rope_ext.scaling and rope_ext.integrations.transformers. Together they cover
wrong ranks, shapes and devices; integer, complex and mismatched dtypes; odd and oversized rotary
dims; negative, too-large, NaN and Inf positions; mismatched cu_seqlens; non-tensor arguments;
wrong scaling keys and values. A case passes only if its call raises the expected exception type
with a message matching its pattern, which names the argument and says what was expected.

Every call runs in a process of its own, so a segfault or abort in a kernel fails that case, with
its signal and stderr, instead of killing the run. To keep this cheap, one helper interpreter
imports torch and rope_ext and builds the inputs once, then forks one child per case (a fork costs
milliseconds; a fresh interpreter importing torch costs seconds). Each child starts from that same
state, never from another case's. test_harness_fails_crashes_and_silent_calls checks that the
harness turns a crash, a silent success, a wrong exception type and a vague message into
failures; test_valid_versions_of_the_calls_work runs the unmodified inputs the cases are built
from, so each bad call differs from a working call only by what it gets wrong.
"""

from __future__ import annotations

import re
import signal
from typing import NamedTuple

import isolated
import pytest
from isolated import Outcome

# Names every case can use; each is a valid input of the function it feeds.
PRELUDE = """
import math
import torch
import rope_ext
from rope_ext import positions as P
from rope_ext.compat.flash_attn import apply_rotary_emb
from rope_ext.integrations import transformers as rope_hf
from rope_ext.scaling import RopeSchedule, parse_scaling

NAN, INF = float("nan"), float("inf")
X = torch.randn(2, 5, 4, 16)                                # rotary: (batch, seqlen, heads, head_dim)
COS, SIN = torch.ones(5, 1, 16), torch.zeros(5, 1, 16)      # tables for X
Q, K = torch.randn(2, 4, 5, 16), torch.randn(2, 1, 5, 16)   # (batch, heads, seqlen, head_dim), GQA
TCOS, TSIN = torch.ones(5, 16), torch.zeros(5, 16)          # tables for Q and K
HCOS, HSIN = torch.ones(2, 5, 16), torch.zeros(2, 5, 16)    # HF's (batch, seqlen, rotary_dim)
MCOS, MSIN = torch.ones(3, 2, 5, 16), torch.zeros(3, 2, 5, 16)  # M-RoPE (3, batch, seqlen, head_dim)
FX = torch.randn(2, 6, 4, 16)                               # flash-attn: (batch, seqlen, heads, head_dim)
FCOS, FSIN = torch.ones(64, 8), torch.zeros(64, 8)          # flash-attn: (seqlen_ro, rotary_dim / 2)
PQ, PK = torch.randn(10, 4, 16), torch.randn(10, 1, 16)     # packed (total_tokens, heads, head_dim)
PX = torch.randn(10, 4, 16)
CU = torch.tensor([0, 4, 10], dtype=torch.int32)            # cu_seqlens of PQ, PK and PX
POS = torch.arange(5).expand(2, 5)                          # (batch, seqlen) position_ids
INV = 10000.0 ** -(torch.arange(0, 16, 2, dtype=torch.float64) / 16)  # (rotary_dim / 2,) inv_freq
rope = rope_ext.RotaryEmbedding(16, layout="bhsd")
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
"""

# The working calls the bad cases are variations of.
GOOD_CALLS = """
rope_ext.rotary(X, COS, SIN)
rope_ext.rotary(X.reshape([1] * 21 + [2, 5, 4, 16]), COS, SIN)
rope_ext.rotary_qk(Q, K, TCOS, TSIN, cos_k=TCOS, sin_k=TSIN)
rope_ext.rotary_qk(Q, torch.randn(2, 1, 5, 16), TCOS[0], TSIN[0])
rope_ext.rotary_(X.clone(), COS, SIN)
rope_ext.rotary_(X.half(), COS, SIN)
rope_ext.apply_rotary_pos_emb(Q, K, HCOS, HSIN)
rope_ext.apply_rotary_pos_emb(Q, K, HCOS, HSIN, unsqueeze_dim=-3)
rope_ext.apply_multimodal_rotary_pos_emb(Q, K, MCOS, MSIN, [4, 2, 2])
apply_rotary_emb(FX, FCOS, FSIN, seqlen_offsets=torch.tensor([0, 58]))
apply_rotary_emb(FX, FCOS.double(), FSIN.double())
apply_rotary_emb(PX, FCOS, FSIN, cu_seqlens=CU, seqlen_offsets=torch.tensor([0, 3]))
P.sequence_positions(2, 4, offset=torch.tensor([0, 3]))
P.sequence_positions(1, 4, offset=2**62)
P.packed_positions(CU, 10, offsets=torch.tensor([1, 2]))
P.cos_sin_tables(torch.tensor([0, 1]), INV)
parse_scaling({"rope_type": "linear", "factor": 2.0})
parse_scaling({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
RopeSchedule.from_config({"rope_type": "linear", "factor": 2.0}, base=1e4, rotary_dim=16, max_position_embeddings=64)
rope_ext.RotaryEmbedding(16, partial_rotary_factor=0.5, xpos_scale_base=512.0, max_position_embeddings=1, layout="bhsd")
rope_ext.RotaryEmbedding(16, layout="bhsd", mrope_section=[4, 2, 2], interleaved=True, scaling=DYNAMIC)
rope_ext.RotaryEmbedding(16, scaling={"rope_type": "yarn", "factor": 4}, layout="bhsd")
rope(Q, K)
rope(Q, K, POS)
rope(Q, K, torch.arange(5))
rope(Q, K, offset=torch.tensor([3, 0]))
rope(Q, K, offset=2**62)
rope(PQ, PK, cu_seqlens=CU, offset=torch.tensor([0, 7]))
rope(PQ, PK, torch.arange(10), cu_seqlens=CU)
rope.cos_sin(POS)
rope_ext.RotaryEmbedding(16, mrope_section=[4, 2, 2], layout="bhsd").cos_sin(POS.expand(3, 2, 5))
"""


class Bad(NamedTuple):
    call: str  # Python, run after PRELUDE
    exc: type[Exception] | tuple[type[Exception], ...]
    pattern: str  # re.search'ed in str(exception): names the argument, says what was expected


AS_TENSOR = (TypeError, ValueError)  # for a Python function given a non-tensor
ANY_CHECK = (TypeError, ValueError, RuntimeError)

CASES = {
    # --- rope_ext.rotary ----------------------------------------------------------------------------
    "rotary_x_is_a_list": Bad(
        "rope_ext.rotary([[1.0] * 16], COS, SIN)",
        RuntimeError,
        r"type 'Tensor' for argument 'x' but instead found type 'list'",
    ),
    "rotary_interleaved_not_a_bool": Bad(
        "rope_ext.rotary(X, COS, SIN, interleaved='no')",
        RuntimeError,
        r"type 'bool' for argument 'interleaved' but instead found type 'str'",
    ),
    "rotary_x_of_rank_26": Bad(
        "rope_ext.rotary(X.reshape([1] * 22 + [2, 5, 4, 16]), COS, SIN)",
        RuntimeError,
        r"rotary: x may have at most 25 dims, got 26",
    ),
    # --- rope_ext.rotary_qk -------------------------------------------------------------------------
    "rotary_qk_complex_q": Bad(
        "rope_ext.rotary_qk(Q.to(torch.complex64), K, TCOS, TSIN)",
        RuntimeError,
        r"rotary_qk: q must be float32, float64, float16 or bfloat16, got ComplexFloat",
    ),
    "rotary_qk_k_on_meta": Bad(
        "rope_ext.rotary_qk(Q, K.to('meta'), TCOS, TSIN)",
        RuntimeError,
        r"rotary_qk: k, cos and sin must be on the same device, got k on meta, cos on cpu",
    ),
    "rotary_qk_k_seqlen_differs": Bad(
        "rope_ext.rotary_qk(Q, torch.randn(2, 1, 6, 16), TCOS[0], TSIN[0])",
        RuntimeError,
        r"q \[2, 4, 5, 16\] and k \[2, 1, 6, 16\] may differ only in the head count",
    ),
    "rotary_qk_sin_k_without_cos_k": Bad(
        "rope_ext.rotary_qk(Q, K, TCOS, TSIN, sin_k=TSIN)",
        RuntimeError,
        r"rotary_qk: cos_k and sin_k must be given together, got only sin_k",
    ),
    "rotary_qk_cos_k_wider_than_k": Bad(
        "rope_ext.rotary_qk(Q, K, TCOS, TSIN, cos_k=torch.ones(5, 18), sin_k=torch.ones(5, 18))",
        RuntimeError,
        r"the rotary dim cos_k.size\(-1\) = 18 exceeds the head dim k.size\(-1\) = 16",
    ),
    # --- rope_ext.rotary_ ---------------------------------------------------------------------------
    "rotary__int64_x": Bad(
        "rope_ext.rotary_(X.long(), COS, SIN)",
        RuntimeError,
        r"rotary_: x must be float32, float64, float16 or bfloat16, got Long",
    ),
    "rotary__float64_tables_for_float16_x": Bad(
        "rope_ext.rotary_(X.half(), COS.double(), SIN.double())",
        RuntimeError,
        r"rotary_: cos and sin must have x's dtype \(Half\) or float32, got Double",
    ),
    "rotary__tables_on_meta": Bad(
        "rope_ext.rotary_(X, COS.to('meta'), SIN.to('meta'))",
        RuntimeError,
        r"rotary_: x, cos and sin must be on the same device, got x on cpu, cos on meta",
    ),
    "rotary__cos_a_strided_window_of_x": Bad(
        "(lambda y: rope_ext.rotary_(y, y[:, 4:20], torch.zeros(5, 16)))(torch.randn(5, 24))",
        RuntimeError,
        r"rotary_: x shares memory with cos; in-place rotation would overwrite it while reading it",
    ),
    "rotary__x_none": Bad("rope_ext.rotary_(None, COS, SIN)", RuntimeError, r"rotary_: x must be a Tensor, got None"),
    # --- rope_ext.apply_rotary_pos_emb (HF) ---------------------------------------------------------
    "hf_int16_q_and_k": Bad(
        "rope_ext.apply_rotary_pos_emb(Q.short(), K.short(), HCOS, HSIN)",
        RuntimeError,
        r"q must be float32, float64, float16 or bfloat16, got Short",
    ),
    "hf_odd_rotary_dim": Bad(
        "rope_ext.apply_rotary_pos_emb(Q, K, HCOS[..., :15], HSIN[..., :15])",
        RuntimeError,
        r"the rotary dim cos.size\(-1\) must be a positive even number, got 15",
    ),
    "hf_tables_for_another_seqlen": Bad(
        "rope_ext.apply_rotary_pos_emb(Q, K, torch.ones(2, 6, 16), torch.zeros(2, 6, 16))",
        RuntimeError,
        r"cos and sin of shape \[2, 1, 6, 16\] do not broadcast against q.shape\[:-1\] \+ \(rotary_dim,\)",
    ),
    "hf_cos_is_a_list": Bad(
        "rope_ext.apply_rotary_pos_emb(Q, K, HCOS.tolist(), HSIN)", AS_TENSOR, r"\bcos must be a (T|t)ensor.*got list"
    ),
    "hf_unsqueeze_dim_out_of_range": Bad(
        "rope_ext.apply_rotary_pos_emb(Q, K, HCOS, HSIN, unsqueeze_dim=5)",
        (ValueError, IndexError),
        r"unsqueeze_dim must be .*got 5",
    ),
    # --- rope_ext.apply_multimodal_rotary_pos_emb ---------------------------------------------------
    "mrope_two_streams": Bad(
        "rope_ext.apply_multimodal_rotary_pos_emb(Q, K, MCOS[:2], MSIN[:2], [4, 2, 2])",
        ValueError,
        r"cos and sin must have shape \(3, batch, seqlen, head_dim\), got \(2, 2, 5, 16\)",
    ),
    "mrope_section_sum_too_big": Bad(
        "rope_ext.apply_multimodal_rotary_pos_emb(Q, K, MCOS, MSIN, [4, 2, 4])",
        ValueError,
        r"mrope_section \[4, 2, 4\] must sum to head_dim/2 = 8",
    ),
    "mrope_section_negative_entry": Bad(
        "rope_ext.apply_multimodal_rotary_pos_emb(Q, K, MCOS, MSIN, [6, -2, 4])",
        ValueError,
        r"mrope_section .*positive",
    ),
    "mrope_section_not_a_list": Bad(
        "rope_ext.apply_multimodal_rotary_pos_emb(Q, K, MCOS, MSIN, 8)",
        AS_TENSOR,
        r"mrope_section must be .*got (8|int)",
    ),
    "mrope_sin_narrower_than_cos": Bad(
        "rope_ext.apply_multimodal_rotary_pos_emb(Q, K, MCOS, MSIN[..., :8], [4, 2, 2])",
        (ValueError, RuntimeError),
        r"cos and sin must have the same shape",
    ),
    # --- rope_ext.compat.flash_attn.apply_rotary_emb ------------------------------------------------
    "flash_x_is_a_list": Bad(
        "apply_rotary_emb(FX.tolist(), FCOS, FSIN)", AS_TENSOR, r"\bx must be a (T|t)ensor.*got list"
    ),
    "flash_tensor_offset_past_the_tables": Bad(
        "apply_rotary_emb(FX, FCOS, FSIN, seqlen_offsets=torch.tensor([0, 59]))",
        RuntimeError,
        r"position 64 \(positions.flatten\(\)\[11\]\) is outside the cache, whose 64 rows",
    ),
    "flash_negative_tensor_offset": Bad(
        "apply_rotary_emb(FX, FCOS, FSIN, seqlen_offsets=torch.tensor([0, -1]))",
        ValueError,
        r"seqlen_offsets must be >= 0",
    ),
    "flash_rotary_dim_wider_than_head_dim": Bad(
        "apply_rotary_emb(FX, torch.ones(64, 12), torch.zeros(64, 12))",
        RuntimeError,
        r"the rotary dim 2 \* cos_cache.size\(1\) = 24 exceeds the head dim x.size\(-1\) = 16",
    ),
    "flash_cu_seqlens_short_of_total": Bad(
        "apply_rotary_emb(PX, FCOS, FSIN, cu_seqlens=torch.tensor([0, 4, 8]))",
        ValueError,
        r"cu_seqlens must start at 0 and end at the token count 10, got 0 and 8",
    ),
    "flash_cu_seqlens_float_with_nan": Bad(
        "apply_rotary_emb(PX, FCOS, FSIN, cu_seqlens=torch.tensor([0.0, NAN, 10.0]))",
        TypeError,
        r"cu_seqlens must be an integer tensor \(int32 or int64\), got torch.float32",
    ),
    "flash_complex_tables": Bad(
        "apply_rotary_emb(FX, FCOS.to(torch.complex64), FSIN.to(torch.complex64))",
        ANY_CHECK,
        r"\bcos\b.* (float|real).*complex",
    ),
    "flash_integer_tables": Bad(
        "apply_rotary_emb(FX, FCOS.long(), FSIN.long())", ANY_CHECK, r"\bcos\b.* float.*(int64|Long)"
    ),
    "flash_sin_narrower_than_cos": Bad(
        "apply_rotary_emb(FX, FCOS, FSIN[:, :4])",
        ValueError,
        r"cos and sin must have the same shape, got \(64, 8\) and \(64, 4\)",
    ),
    "flash_x_on_meta": Bad(
        "apply_rotary_emb(FX.to('meta'), FCOS, FSIN)", ANY_CHECK, r"\bx\b.*\bcos\b.* same device.*meta"
    ),
    # --- rope_ext.positions -------------------------------------------------------------------------
    "sequence_positions_bool_offset": Bad(
        "P.sequence_positions(2, 4, offset=True)",
        TypeError,
        r"offset must be an int or a \(batch,\) integer tensor, got bool",
    ),
    "sequence_positions_offset_2d": Bad(
        "P.sequence_positions(2, 4, offset=torch.tensor([[1], [2]]))",
        ValueError,
        r"offset must have shape \(batch,\) = \(2,\), got \(2, 1\)",
    ),
    "sequence_positions_offset_overflows_int64": Bad(
        "P.sequence_positions(1, 4, offset=2**63 - 2)", (ValueError, OverflowError), r"\boffset\b.*(int64|2\*\*63)"
    ),
    "packed_positions_cu_seqlens_not_from_zero": Bad(
        "P.packed_positions(torch.tensor([1, 4, 10]), 10)",
        ValueError,
        r"cu_seqlens must start at 0 and end at the token count 10, got 1 and 10",
    ),
    "packed_positions_one_entry": Bad(
        "P.packed_positions(torch.tensor([0]), 0)",
        ValueError,
        r"cu_seqlens must have shape \(num_seqs \+ 1,\), got \(1,\)",
    ),
    "packed_positions_offsets_per_token": Bad(
        "P.packed_positions(CU, 10, offsets=torch.zeros(10, dtype=torch.long))",
        ValueError,
        r"offsets must have shape \(num_seqs,\) = \(2,\), got \(10,\)",
    ),
    "cos_sin_tables_nan_positions": Bad(
        "P.cos_sin_tables(torch.tensor([0.0, NAN]), INV)", TypeError, r"\bpositions must be an integer tensor"
    ),
    "cos_sin_tables_negative_positions": Bad(
        "P.cos_sin_tables(torch.tensor([-1, 0]), INV)", ValueError, r"\bpositions must be >= 0"
    ),
    "cos_sin_tables_inv_freq_2d": Bad(
        "P.cos_sin_tables(torch.tensor([0, 1]), INV.reshape(2, 4))",
        ValueError,
        r"inv_freq must be .*(1-D|\(rotary_dim ?/ ?2,\)).*got .*\(2, 4\)",
    ),
    # --- rope_ext.scaling ---------------------------------------------------------------------------
    "parse_scaling_key_of_another_type": Bad(
        "parse_scaling({'rope_type': 'linear', 'factor': 2.0, 'beta_fast': 32})",
        ValueError,
        r"scaling has keys \['beta_fast'\] that rope_type 'linear' does not use; it accepts \[",
    ),
    "parse_scaling_llama3_missing_keys": Bad(
        "parse_scaling({'rope_type': 'llama3', 'factor': 8.0})",
        ValueError,
        r"scaling for rope_type 'llama3' needs \['high_freq_factor', 'low_freq_factor'\]",
    ),
    "parse_scaling_rope_type_is_a_list": Bad(
        "parse_scaling({'rope_type': ['linear'], 'factor': 2.0})",
        ValueError,
        r"scaling\['rope_type'\] must be one of \[.*\], got \['linear'\]",
    ),
    "schedule_linear_factor_below_one": Bad(
        "RopeSchedule.from_config({'rope_type': 'linear', 'factor': 0.5}, base=1e4, rotary_dim=16, "
        "max_position_embeddings=64)",
        ValueError,
        r"scaling\['factor'\] must be >= 1 for rope_type 'linear', got 0.5",
    ),
    "schedule_odd_rotary_dim": Bad(
        "RopeSchedule.from_config(None, base=1e4, rotary_dim=15, max_position_embeddings=64)",
        ValueError,
        r"rotary_dim must be a positive even int, got 15",
    ),
    "module_infinite_dynamic_factor": Bad(
        "rope_ext.RotaryEmbedding(16, scaling={'rope_type': 'dynamic', 'factor': INF}, layout='bhsd')",
        ValueError,
        r"scaling\['factor'\] must be a finite positive number, got inf",
    ),
    "module_yarn_factor_string": Bad(
        "rope_ext.RotaryEmbedding(16, scaling={'rope_type': 'yarn', 'factor': '4'}, layout='bhsd')",
        ValueError,
        r"scaling\['factor'\] must be a finite positive number, got '4'",
    ),
    # --- RotaryEmbedding(...) -----------------------------------------------------------------------
    "module_dim_zero": Bad(
        "rope_ext.RotaryEmbedding(0, layout='bhsd')",
        ValueError,
        r"dim must be a positive int, got 0",
    ),
    "module_max_position_embeddings_zero": Bad(
        "rope_ext.RotaryEmbedding(16, max_position_embeddings=0, layout='bhsd')",
        ValueError,
        r"max_position_embeddings must be a positive int, got 0",
    ),
    "module_partial_rotary_factor_string": Bad(
        "rope_ext.RotaryEmbedding(16, partial_rotary_factor='0.5', layout='bhsd')",
        AS_TENSOR,
        r"partial_rotary_factor must be .*'0.5'",
    ),
    "module_xpos_scale_base_string": Bad(
        "rope_ext.RotaryEmbedding(16, xpos_scale_base='512', layout='bhsd')",
        AS_TENSOR,
        r"xpos_scale_base must be .*'512'",
    ),
    "module_xpos_center_without_xpos": Bad(
        "rope_ext.RotaryEmbedding(16, xpos_center=100, layout='bhsd')",
        ValueError,
        r"xpos_center must be an int, given with xpos_scale_base; got 100",
    ),
    "module_xpos_center_float": Bad(
        "rope_ext.RotaryEmbedding(16, xpos_scale_base=512.0, xpos_center=1.5, layout='bhsd')",
        ValueError,
        r"xpos_center must be an int.*got 1.5",
    ),
    "module_mrope_section_int": Bad(
        "rope_ext.RotaryEmbedding(16, mrope_section=8, layout='bhsd')", AS_TENSOR, r"mrope_section must be .*got 8"
    ),
    "module_interleaved_string": Bad(
        "rope_ext.RotaryEmbedding(16, interleaved='no', layout='bhsd')",
        AS_TENSOR,
        r"interleaved must be a bool, got 'no'",
    ),
    "module_negative_base": Bad(
        "rope_ext.RotaryEmbedding(16, base=-1.0, layout='bhsd')",
        ValueError,
        r"\bbase must be a finite positive number, got -1.0",
    ),
    # --- RotaryEmbedding.forward / cos_sin ----------------------------------------------------------
    "forward_q_3d_without_cu_seqlens": Bad(
        "rope(Q[0], K[0])", ValueError, r"q must be 4-D \(B, H, S, D for layout 'bhsd'\), got shape \(4, 5, 16\)"
    ),
    "forward_q_none": Bad("rope(None, K)", AS_TENSOR, r"\bq must be a (T|t)ensor, got None"),
    "forward_int64_q_and_k": Bad(
        "rope(Q.long(), K.long())",
        RuntimeError,
        r"rotary_pos_qk: q must be float32, float64, float16 or bfloat16, got Long",
    ),
    "forward_k_on_meta": Bad(
        "rope(Q, K.to('meta'))",
        RuntimeError,
        r"k, cos_cache, sin_cache and positions must be on the same device, got k on meta, cos_cache on cpu",
    ),
    "forward_position_ids_list": Bad(
        "rope(Q, K, [0, 1, 2, 3, 4])", TypeError, r"position_ids must be an integer tensor, got list"
    ),
    "forward_position_ids_with_nan": Bad(
        "rope(Q, K, torch.tensor([0.0, 1.0, NAN, 3.0, 4.0]))",
        TypeError,
        r"position_ids must be an integer tensor \(int32 or int64\), got torch.float32",
    ),
    "forward_position_ids_for_another_seqlen": Bad(
        "rope(Q, K, torch.arange(6))", ValueError, r"position_ids .*shape.*\(6,\)"
    ),
    "forward_position_ids_for_another_batch": Bad(
        "rope(Q, K, torch.arange(5).expand(3, 5))",
        ValueError,
        r"position_ids must have shape \(2, 5\) or \(5,\) for q of shape \(2, 4, 5, 16\), got \(3, 5\)",
    ),
    "forward_packed_position_ids_of_another_length": Bad(
        "rope(PQ, PK, torch.arange(9), cu_seqlens=CU)",
        ValueError,
        r"position_ids of packed q must have shape \(10,\), got \(9,\)",
    ),
    "forward_negative_position_ids": Bad(
        "rope(Q, K, POS - 1)", ValueError, r"position_ids must be >= 0, got a minimum of -1"
    ),
    "forward_negative_tensor_offset": Bad(
        "rope(Q, K, offset=torch.tensor([3, -2]))", ValueError, r"offset must be >= 0, got a minimum of -2"
    ),
    "forward_offset_overflows_int64": Bad(
        "rope(Q, K, offset=2**63 - 3)", (ValueError, OverflowError), r"\boffset\b.*(int64|2\*\*63)"
    ),
    "forward_cu_seqlens_with_4d_q": Bad(
        "rope(Q, K, cu_seqlens=CU)", ValueError, r"with cu_seqlens, q and k must be packed \(T, H, D\), got q of shape"
    ),
    "forward_packed_negative_offset": Bad(
        "rope(PQ, PK, cu_seqlens=CU, offset=torch.tensor([0, -1]))", ValueError, r"(?<!_)\boffset must be >= 0"
    ),
    "forward_cu_seqlens_short_of_total_with_position_ids": Bad(
        "rope(PQ, PK, torch.arange(10), cu_seqlens=torch.tensor([0, 4, 8]))", ValueError, r"\bcu_seqlens\b"
    ),
    "cos_sin_inf_positions": Bad(
        "rope.cos_sin(torch.tensor([[0.0, INF]]))",
        TypeError,
        r"position_ids must be an integer tensor \(int32 or int64\), got torch.float32",
    ),
    "cos_sin_mrope_two_streams": Bad(
        "rope_ext.RotaryEmbedding(16, mrope_section=[4, 2, 2], layout='bhsd').cos_sin(POS.expand(2, 2, 5))",
        ValueError,
        r"with mrope_section, position_ids must have shape \(3, batch, seqlen\), got \(2, 2, 5\)",
    ),
    # --- rope_ext.integrations.transformers ---------------------------------------------------------
    "patch_unsupported_family": Bad(
        "rope_hf.patch(['llama', 'bert'])", ValueError, r"cannot patch 'bert': the installed transformers has no model"
    ),
    "patch_model_types_not_a_list": Bad("rope_hf.patch(42)", AS_TENSOR, r"model_types must be .*got int"),
}

_TIMEOUT_S = 60  # per call


def run_isolated(calls: list[str], outdir) -> list[Outcome]:
    """Runs each call after PRELUDE in a process of its own; one Outcome per call."""
    return isolated.run_isolated(PRELUDE, calls, outdir, _TIMEOUT_S)


def check_outcome(case: Bad, out: Outcome) -> None:
    """Fails, with the details, unless the call raised case.exc with a message matching case.pattern."""
    expected = case.exc if isinstance(case.exc, tuple) else (case.exc,)
    wanted = f"{' or '.join(e.__name__ for e in expected)} matching /{case.pattern}/"
    assert out.exit_code is not None, f"{case.call}: still running after {_TIMEOUT_S} s; expected {wanted}"
    assert out.exit_code == 0 and out.report is not None, (
        f"{case.call}: the process {isolated.how_it_ended(out)} instead of raising {wanted}\n"
        f"stderr:\n{out.stderr[-4000:]}"
    )
    r = out.report
    assert r["raised"], f"{case.call} raised nothing; expected {wanted}\nstderr:\n{out.stderr[-2000:]}"
    assert any(e.__name__ in r["mro"] for e in expected), (
        f"{case.call} raised {r['type']}: {r['message']}\nexpected {wanted}\n{r['traceback']}"
    )
    assert re.search(case.pattern, r["message"]), (
        f"{case.call} raised {r['type']} whose message does not match /{case.pattern}/:\n"
        f"{r['message']}\n{r['traceback']}"
    )


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """name -> Outcome for every collected test_bad_call case, all run by one fork server."""
    calls = {name: case.call for name, case in CASES.items()}
    return isolated.run_collected(request, "test_bad_call", PRELUDE, calls, tmp_path_factory.mktemp("bad_inputs"),
                                  _TIMEOUT_S)


@pytest.mark.parametrize("name", CASES)
def test_bad_call(name, outcomes):
    check_outcome(CASES[name], outcomes[name])


def test_harness_fails_crashes_and_silent_calls(tmp_path):
    """The harness reports a crash as a failure of its own case (not of the run), and fails a call
    that raises nothing, the wrong type, or a message that does not match."""
    case = Bad("...", ValueError, r"x must be >= 0, got -1")
    calls = {
        "segfault": "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
        "abort": "import os; os.abort()",
        "silent": "rope_ext.rotary(X, COS, SIN)",
        "wrong_type": "raise TypeError('x must be >= 0, got -1')",
        "vague_message": "raise ValueError('bad value')",
        "expected": "raise ValueError('rope_ext: x must be >= 0, got -1')",
    }
    got = dict(zip(calls, run_isolated(list(calls.values()), tmp_path), strict=True))
    assert got["segfault"].exit_code == -signal.SIGSEGV and got["abort"].exit_code == -signal.SIGABRT
    assert got["silent"].report == {"raised": False}
    for name in ("segfault", "abort", "silent", "wrong_type", "vague_message"):
        with pytest.raises(AssertionError):
            check_outcome(case, got[name])
    check_outcome(case, got["expected"])


def test_valid_versions_of_the_calls_work():
    """The inputs the cases start from are valid, so each case fails only by what it changes."""
    ns: dict = {}
    exec(PRELUDE, ns)
    for call in GOOD_CALLS.strip().splitlines():
        exec(call, ns)
