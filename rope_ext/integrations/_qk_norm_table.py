"""The tested fusions: every attention method (transformers) and processor (diffusers) whose
QK-norm + RoPE ``patch()`` fuses, pinned by the fingerprint of its code (``_qk_norm_sites.site_key``:
the method with the helpers it names, its class's name left out, and, in transformers, the norm
classes its ``__init__`` binds), with the site the rewrite finds in that code. ``patch()`` fuses
these and nothing else; each is run, stock against fused, by a test (tests/test_qk_norm_fusion.py
and tests/test_diffusers_qk_norm.py, in the releases that have it). ``tools/qk_norm_table.py``
proposes entries for a release and says what changed; an entry lands with the test that runs it.

``unfusable``: the other methods of the tested releases that normalize q and k and apply RoPE, with
why they are not fused, as the analysis said when the table was made (a norm class of no tested
RMS form, norms after RoPE, q read between norm and RoPE, ...): listed, not warned of. A method in
neither dict is code no test has run: ``patch()`` says so, with its fingerprint.
"""

from __future__ import annotations

import dataclasses

from rope_ext.integrations._qk_norm_rewrite import Site, Slice, Stream


@dataclasses.dataclass(frozen=True)
class Table:
    tested: dict[str, Site]
    unfusable: dict[str, str]


def _self(rope: str = "apply_rotary_pos_emb", mode: str = "head", q: str = "q_norm", k: str = "k_norm",
          rotated: str | None = None, cast: bool = False) -> Site:
    # (q and k in calls of their own: mode "single")
    return Site("self", q, k, rope, mode == "single", mode, rotated=rotated, cast=cast)


# transformers, by release: the fingerprints of the attention methods each release fuses (a release
# that keeps a method's code keeps its fingerprint, and the entry is listed under each), with the
# families that have it (the first one, or the one named in tests/test_qk_norm_fusion.py's CASES,
# is the one the test runs).
# transformers 4.57.6: 17 fusions
_TESTED_4_57_6 = {
    "f8bb98c7dc479833": _self(),  # apertus
    "7d34dbfe2ef8c949": _self(),  # chameleon
    "3edbd5d3c736dcc7": _self(),  # cohere
    "466ef967e569269f": _self(),  # doge
    "03862be8e6b256d8": _self(),  # dots1, qwen3, qwen3_moe, qwen3_omni_moe
    "2c9ca879a34c4a04": _self(),  # exaone4
    "2bff8037f77037f6": _self(mode='heads_bhsd'),  # flex_olmo, olmo2
    "3ac485fb6c021336": _self(),  # gemma3
    "0fb56587dc6147bd": _self(),  # glm4_moe
    "5cbc7d39a9fb2404": _self(mode='after', q='query_layernorm', k='key_layernorm'),  # hunyuan_v1_dense, hunyuan_v1_moe
    "8a3fc0fcf2b48db0": _self(q='q_layernorm', k='k_layernorm'),  # lfm2
    "377b3b287f6f66c5": _self(mode='heads_bhsd'),  # olmo3
    "71fc001ae52ca00a": _self(q='q_layernorm', k='k_layernorm', rotated='self.rotary_ndims'),  # persimmon
    "45afaea47331119e": _self(q='q_layernorm', k='k_layernorm', rotated='self.rotary_ndims'),  # phi
    "180dd1ee02ec7469": _self(),  # qwen3_next
    "568d35f4f67aa49a": _self(),  # qwen3_vl, qwen3_vl_moe
    "c0fa07245d827bcc": _self(q='q_layernorm', k='k_layernorm', rotated='self.rotary_ndims'),  # stablelm
}

_UNFUSABLE_4_57_6 = {
    "e550c0d97b3105f1": "self.k_norm's class Gemma3nRMSNorm (fingerprint bf9746660b7d7006) matches no tested norm form",  # gemma3n
    "a8d22eeb98df352d": "apply_rotary_pos_emb's signature (qk, tables by position_ids) has no fused call yet",  # idefics
    "54f346c30ac6bc3d": '`query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).tran` uses query_states, key_states or what their norms read between the norms and RoPE',  # olmoe
}

# transformers 5.23.0: 47 fusions
_TESTED_5_23_0 = {
    "91e1bf1cafd7aa2a": _self(),  # afmoe
    "fef913fe49b2cd0b": _self(),  # apertus, hy_v3
    "23d8c295bdbc1c7e": _self(),  # beam
    "abfd41862cd0f2cc": _self(),  # chameleon
    "6e184945cf0dcc49": _self(),  # cohere
    "09801e1befe74b43": _self(mode='single'),  # diffusion_gemma
    "1c82661758b0b0ad": _self(mode='single'),  # diffusion_gemma
    "f2c837dd790a3c07": _self(),  # doge
    "a86973a5d1e54fb8": _self(),  # dots1, mellum, qwen3, qwen3_moe, qwen3_omni_moe
    "6fefda21aa25ebc5": _self('apply_rotary_pos_emb_vision'),  # dots3_note, glm5_next, glm_ocr
    "a5d6ed5bf39c4642": _self(),  # embedding_gemma2
    "42b6a0ea04cf0a35": _self(mode='heads_bhsd', cast=True),  # esmc
    "73890f696863d802": _self(),  # esmfold2
    "7bd9ec760404c3ef": _self(),  # exaone4, exaone4_5, exaone_moe, kolibri1
    "29271ecfd23c7880": _self(mode='heads_bhsd'),  # flex_olmo, olmo2
    "557334c6cc2f9458": _self(),  # flint
    "5ba8ec04fc8390dc": _self(),  # gemma3, t5gemma2
    "6c72696ac3f95ee4": _self(mode='single'),  # gemma3n
    "3fbe4a8e128254d1": _self(mode='single'),  # gemma4, gemma4_unified
    "005d1a2988569304": _self(),  # glm4_moe
    "857ab43f0d54a138": _self(mode='after', q='query_layernorm', k='key_layernorm'),  # hunyuan_v1_dense, hunyuan_v1_moe
    "663366a9f5fb585c": _self(mode='after', q='query_layernorm', k='key_layernorm'),  # hunyuan_vl
    "4f4611d27c5626e9": _self(),  # laguna
    "c9a25efcd35dbac3": _self(q='q_layernorm', k='k_layernorm'),  # lfm2, lfm2_moe
    "3324b74a38f17d5e": _self(),  # lfm3
    "aeea0f09ba8da3e1": _self('apply_rotary_pos_emb_vision'),  # lfm3_vl
    "32d0eb57954ce253": _self(mode='heads_bhsd'),  # minimax_m2
    "ba77ed43407ad115": _self(),  # minimax_m3_vl
    "958ff91a25bb938d": _self(),  # minimax_m3_vl
    "e6b4b8a4fef8537d": _self(),  # molmo2
    "eeae7f5e57cd0d27": _self(mode='after'),  # nanochat
    "3b6455d17d124f85": _self(),  # nemotron3_5_transcribe
    "966261e93ebea29f": _self(),  # neomme
    "db5b2322241bbc71": _self(mode='heads_bhsd'),  # olmo3
    "762d4c07a2ca71f6": _self(mode='heads_bhsd'),  # olmo_hybrid
    "d2e464e35f0c7d5c": _self(mode='heads_bhsd'),  # olmoe
    "a9326ced2f28758d": _self(),  # pe_audio, pe_audio_video, pe_video
    "c9d5bd83ec44a079": _self(q='q_layernorm', k='k_layernorm', rotated='self.rotary_ndims'),  # persimmon
    "ea63844489bbd024": _self(q='q_layernorm', k='k_layernorm', rotated='self.rotary_ndims'),  # phi
    "8abec6633e3eb670": _self(),  # qwen3_5, qwen3_5_moe, qwen3_next
    "d6782bb92034c344": _self(),  # qwen3_vl, qwen3_vl_moe
    "330b1172813d42c6": _self(),  # qwen4_exp
    "affbf731f406b07a": _self(),  # sapiens2
    "13e2d0e7e6486a44": _self(q='q_layernorm', k='k_layernorm', rotated='self.rotary_ndims'),  # stablelm
    "91ef87389aa8bc84": _self(),  # step3p7
    "790f7c80b55a5e38": _self(),  # t5gemma2
    "22925477930e9fe8": _self(mode='after'),  # timesfm2_5
}

_UNFUSABLE_5_23_0 = {
    "5fb6db5b2575af1e": 'q_rot is not normalized by self.<k_norm> before its RoPE call',  # axk2, deepseek_v32
    "1335617521965374": 'q_rot is not normalized by self.<k_norm> before its RoPE call',  # dots3_note, glm_moe_dsa
    "be7e5a4fd2310a04": 'q_rot is not normalized by self.<k_norm> before its RoPE call',  # hy_v4
    "3a878b44e2256eda": 'q and k are normalized after RoPE, not directly after its one call',  # idefics
    "b0a6eb9720a86307": "apply_rotary_pos_emb_interleave's signature (qk, k optional) has no fused call yet",  # mistral_large4
    "f4188a857579ffda": "apply_rotary_pos_emb's signature (qk, q on the last rows) has no fused call yet",  # muse_glimmer_assistant
    "1d9ae95bbcdd25b2": 'q and k are normalized and rotated one at a time, but not as one norm-then-RoPE pair each that holds every RoPE call',  # qwen4_exp
}

# transformers 5.24.0: 47 fusions
_TESTED_5_24_0 = {
    "2610de19b1b92456": _self(),  # afmoe
    "35e5e0b49a1f818b": _self(),  # apertus, apertus1p5, hy_v3
    "86acf8a3140e010d": _self(),  # beam
    "5de7e3fa11dc0507": _self(),  # chameleon
    "4db6803a585fa099": _self(),  # cohere
    "dad81ed35a46e4c3": _self(mode='single'),  # diffusion_gemma
    "894fc4c5932226c0": _self(mode='single'),  # diffusion_gemma
    "19e0d80d3c51ee32": _self(),  # doge
    "fddcbad3c1c5b7d1": _self(),  # dots1, mellum, qwen3, qwen3_moe, qwen3_omni_moe
    "6fefda21aa25ebc5": _self('apply_rotary_pos_emb_vision'),  # dots3_note, glm5_next, glm_ocr
    "a5d6ed5bf39c4642": _self(),  # embedding_gemma2
    "f64b2d6cea5f845b": _self(mode='heads_bhsd', cast=True),  # esmc
    "73890f696863d802": _self(),  # esmfold2
    "39ef92dc5a9366db": _self(),  # exaone4, exaone4_5, exaone_moe, kolibri1
    "8ccd7e0dd5590617": _self(mode='heads_bhsd'),  # flex_olmo, olmo2
    "563b6479ffee70e3": _self(),  # flint
    "e6b9913039804dfa": _self(),  # gemma3, t5gemma2
    "eecf660637ac7a26": _self(mode='single'),  # gemma3n
    "0941a374e572fc48": _self(mode='single'),  # gemma4, gemma4_unified
    "1453e93aa1f20e72": _self(),  # glm4_moe
    "97285b70d0da794a": _self(mode='after', q='query_layernorm', k='key_layernorm'),  # hunyuan_v1_dense, hunyuan_v1_moe
    "82f2fc566bc395ff": _self(mode='after', q='query_layernorm', k='key_layernorm'),  # hunyuan_vl
    "3aebbdeb503750c1": _self(),  # laguna
    "19caa7c016683755": _self(q='q_layernorm', k='k_layernorm'),  # lfm2, lfm2_moe
    "d3b73d23916aaf4b": _self(),  # lfm3
    "aeea0f09ba8da3e1": _self('apply_rotary_pos_emb_vision'),  # lfm3_vl
    "0a0895256d2ae369": _self(mode='heads_bhsd'),  # minimax_m2
    "dffe59133ce917d8": _self(),  # minimax_m3_vl
    "1e7b08ac10545d37": _self(),  # minimax_m3_vl
    "591439d1876101f5": _self(),  # molmo2
    "69882c520d639546": _self(mode='after'),  # nanochat
    "3b6455d17d124f85": _self(),  # nemotron3_5_transcribe
    "1ecfda64dd0072d1": _self(),  # neomme
    "976c031b232e2edc": _self(mode='heads_bhsd'),  # olmo3
    "66bba8f758642e0b": _self(mode='heads_bhsd'),  # olmo_hybrid
    "33393082e0b5027c": _self(mode='heads_bhsd'),  # olmoe
    "6f4f689ce5f24ded": _self(),  # pe_audio, pe_audio_video, pe_video
    "e86a120a4ba32161": _self(q='q_layernorm', k='k_layernorm', rotated='self.rotary_ndims'),  # persimmon
    "eda69a0e500223e4": _self(q='q_layernorm', k='k_layernorm', rotated='self.rotary_ndims'),  # phi
    "938af49af01d518d": _self(),  # qwen3_5, qwen3_5_moe, qwen3_next
    "54abb277e234eeda": _self(),  # qwen3_vl, qwen3_vl_moe
    "396ac5e56f2aa100": _self(),  # qwen4_exp
    "affbf731f406b07a": _self(),  # sapiens2
    "4b5178c93db4c65c": _self(q='q_layernorm', k='k_layernorm', rotated='self.rotary_ndims'),  # stablelm
    "a8e098472f625c67": _self(),  # step3p7
    "6dfc7f74f925a53e": _self(),  # t5gemma2
    "493015b25dcc0fcb": _self(mode='after'),  # timesfm2_5
}

_UNFUSABLE_5_24_0 = {
    "4793e9178caadbca": 'q_rot is not normalized by self.<k_norm> before its RoPE call',  # axk2, deepseek_v32
    "e29392e9a934db7e": "self.k_norm's class DoryL2Norm (fingerprint aa1ef494b4fd2dfc) matches no tested norm form",  # dory
    "683afcb13938924b": 'q_rot is not normalized by self.<k_norm> before its RoPE call',  # dots3_note, glm_moe_dsa
    "b2320298c1fd4875": 'q_rot is not normalized by self.<k_norm> before its RoPE call',  # hy_v4
    "a6987fb124adcb92": 'q_rot is not normalized by self.<k_norm> before its RoPE call',  # hy_v4_vl
    "29a39ac3d730fb65": 'q and k are normalized after RoPE, not directly after its one call',  # idefics
    "7fc49f59ea016c4b": "self.k_norm's class LaraMiniRMSNorm (fingerprint 59c26a99fc9b9886) matches no tested norm form",  # lara_mini
    "9024619d2e59486d": "apply_rotary_pos_emb_interleave's signature (qk, k optional) has no fused call yet",  # mistral_large4
    "6675f35171d50baf": "apply_rotary_pos_emb's signature (qk, q on the last rows) has no fused call yet",  # muse_glimmer_assistant
    "1d8908e09df86a96": 'q and k are normalized and rotated one at a time, but not as one norm-then-RoPE pair each that holds every RoPE call',  # qwen4_exp
}

TRANSFORMERS_RELEASES: dict[str, set[str]] = {
    "4.57.6": set(_TESTED_4_57_6), "5.23.0": set(_TESTED_5_23_0), "5.24.0": set(_TESTED_5_24_0)}
TRANSFORMERS = Table(tested={**_TESTED_4_57_6, **_TESTED_5_23_0, **_TESTED_5_24_0},
                     unfusable={**_UNFUSABLE_4_57_6, **_UNFUSABLE_5_23_0, **_UNFUSABLE_5_24_0})


def _attn(rope: str, mode: str = "head", q: str = "norm_q", k: str = "norm_k", pair: bool = True,
          owner: str = "attn", stream: Stream | None = None, cast: bool = False, sliced: Slice | None = None,
          k_tables: bool = False) -> Site:
    return Site(owner, q, k, rope, pair, mode, stream, cast=cast, sliced=sliced, k_tables=k_tables)


# The text stream of Flux's double-stream blocks (and the processors written like them): its own
# norms, concatenated in front of the image tokens along the sequence dim of (B, S, H, D).
_TEXT_FIRST = Stream("encoder_query", "encoder_key", "norm_added_q", "norm_added_k", True, 1)

# The CogVideoX processors' RoPE, written into the image tokens' rows of (B, H, S, D) q and k, behind
# the text's; k's not in cross-attention.
_TEXT_AT_2_UNLESS_CROSS = Slice(2, "text_seq_length", "not attn.is_cross_attention")


# diffusers 0.42.1: the processors' ``__call__`` fingerprints (``site_key`` of the method alone: the
# norms are the attention module's, whose classes each call checks), with the files and processor
# classes that have them. Each fusion is run by tests/test_diffusers_qk_norm.py: a whole tiny model
# (Flux, Wan, HunyuanVideo, LTX, QwenImage) or the processor on its file's attention module
# (tests/diffusers_processor_cases_*.py). Other releases keep the entries whose code they keep.
_DIFFUSERS_TESTED_0_42_1 = {
    "36c739d6fbadf7be": _attn('apply_rotary_emb'),  # ace_step_transformer:AceStepAttnProcessor2_0
    "d425efddccb5d211": _attn('apply_rotary_emb', stream=_TEXT_FIRST),  # bria:BriaAttnProcessor, longcat_image:LongCatImageAttnProcessor, ovis_image:OvisImageAttnProcessor
    "aaaafc737fe908c0": _attn('apply_rotary_emb', stream=_TEXT_FIRST),  # bria_fibo:BriaFiboAttnProcessor
    "4a2560e0e763f04c": _attn('apply_rotary_emb'),  # bria_fibo2:BriaFibo2AttnProcessor
    "9263cfee897f624e": _attn('apply_rotary_emb', mode='heads_bshd'),  # chronoedit:WanAttnProcessor, wan:WanAttnProcessor, wan_animate:WanAttnProcessor
    "5becaccfaa3962d9": _attn('apply_rotary_emb'),  # controlnet_z_image:ZSingleStreamAttnProcessor, z_image:ZSingleStreamAttnProcessor
    "56bf61bc2b95dee3": _attn('apply_rotary_emb'),  # cosmos:CosmosAttnProcessor2_0
    "2522107f4713f73c": _attn('apply_rotary_emb'),  # cosmos:CosmosAttnProcessor2_5
    "2ea8861cec81a84d": _attn('apply_rotary_emb'),  # ernie_image:ErnieImageSingleStreamAttnProcessor
    "0cc7f80a710d8328": _attn('apply_rotary_emb', stream=_TEXT_FIRST),  # flux:FluxAttnProcessor
    "dac2e3e82b6d95c9": _attn('apply_rotary_emb', stream=_TEXT_FIRST),  # flux2:Flux2AttnProcessor
    "deb8a41f4403ff01": _attn('apply_rotary_emb', stream=_TEXT_FIRST),  # flux2:Flux2KVAttnProcessor
    "24406c3920a8d8df": _attn('apply_rotary_emb'),  # flux2:Flux2KVParallelSelfAttnProcessor
    "ad7f4b9234b354f0": _attn('apply_rotary_emb'),  # flux2:Flux2ParallelSelfAttnProcessor
    "d5456c34176c1258": _attn('apply_rotary_emb'),  # flux3:Flux3AttnProcessor
    "5f148aaca32978da": _attn('apply_rotary_emb_transposed', mode='heads_bshd'),  # helios:HeliosAttnProcessor
    "29210d9f51cda445": _attn('apply_rotary_emb'),  # hunyuan_video:HunyuanVideoAttnProcessor2_0, hunyuanimage:HunyuanImageAttnProcessor
    "09781992021a5869": _attn('apply_rotary_emb'),  # hunyuan_video15:HunyuanVideo15AttnProcessor2_0
    "38ec24b57eb70740": _attn('apply_rotary_emb'),  # ltx:LTXVideoAttnProcessor
    "9b41e70faaf263a5": _attn('apply_rotary_emb'),  # lumina2:Lumina2AttnProcessor2_0
    "9402c3d39b309ca7": _attn('_apply_rotary_emb'),  # minimax_h3:MiniMaxH3AttnProcessor
    "9e873de6ab8eb81d": _attn('apply_rotary_emb'),  # motif_video:MotifVideoAttnProcessor2_0
    "dba512cd2371bf31": _attn('_apply_rotary_emb_nucleus'),  # nucleusmoe_image:NucleusMoEAttnProcessor2_0
    "92784ec38876b13d": _attn('apply_rope'),  # prx:PRXAttnProcessor2_0
    "89828fa417a6dc97": _attn('apply_rotary_emb_qwen'),  # qwenimage:QwenDoubleStreamAttnProcessor2_0
    "e2dbac4a15db0071": _attn('apply_rotary_emb', mode='heads_bshd'),  # skyreels_v2:SkyReelsV2AttnProcessor
    "2c01df61fa9c6108": _attn('apply_rotary_emb'),  # attention_processor:MochiAttnProcessor2_0
    "0a6d5d8c65b531de": _attn('apply_rotary_emb'),  # krea2:Krea2AttnProcessor
    "79caa365091d7d25": _attn('apply_rotary_emb', sliced=_TEXT_AT_2_UNLESS_CROSS),  # attention_processor:CogVideoXAttnProcessor2_0
    "1da22b5fab3feb24": _attn('apply_rotary_emb', sliced=_TEXT_AT_2_UNLESS_CROSS),  # attention_processor:FusedCogVideoXAttnProcessor2_0
    "ae75b073a9b83238": _attn('apply_rotary_emb', cast=True, sliced=Slice(2, 'text_seq_length')),  # cogview4:CogView4AttnProcessor
    "53d3e11cde96988c": _attn('apply_rotary_emb', cast=True, sliced=Slice(2, 'text_seq_length')),  # cogview4:CogView4TrainingAttnProcessor
    "8dcd921f57c02e4c": _attn('apply_rotary_emb', sliced=Slice(2, 'encoder_hidden_states.shape[1]', 'not attn.is_cross_attention')),  # easyanimate:EasyAnimateAttnProcessor2_0
    "2dcc9964c23ca448": _attn('apply_rotary_emb', cast=True, sliced=Slice(1, 'text_seq_length')),  # glm_image:GlmImageAttnProcessor
    "ab9566f0cb67aefe": _attn('_rope_ext_inline_rope'),  # ideogram4:Ideogram4AttnProcessor (its RoPE written inline)
    "fbdbe28da7940038": _attn('_apply_rotary_partial', mode='tuples', q='q_norm', k='k_norm'),  # stable_audio3:StableAudio3SelfAttnProcessor
    "3735e6ca5897c9f1": _attn('apply_interleaved_rotary_emb', k_tables=True),  # ltx2:LTX2AudioVideoAttnProcessor, sana_wm_refiner:SanaWMLTX2AudioVideoAttnProcessor
    "70f44aaf8e458702": _attn('apply_interleaved_rotary_emb'),  # sana_wm_refiner:SanaWMLTX2RefinerAttnProcessor
    "8cd73c611d4fb30b": _attn('_apply_rotary_emb', mode='heads_bshd', q='q_norm', k='k_norm'),  # longcat_audio_dit:AudioDiTSelfAttnProcessor
}
_DIFFUSERS_UNFUSABLE_0_42_1 = {
    "94eaa9513f1c9a0f": "apply_rotary_emb's signature (complex as given) has no fused call yet",  # anyflow:AnyFlowAttnProcessor, anyflow_far:AnyFlowAttnProcessor
    "97ce1c816c662ef2": "apply_rotary_emb's signature (complex as given) has no fused call yet",  # anyflow_far:AnyFlowCausalAttnProcessor
    "733689e73b1f7c2b": 'no RoPE call of two tensors (Q, K = rope(Q, K, ...), or one call each) that keeps their names',  # attention_processor:FusedHunyuanAttnProcessor2_0
    "dc1e514456349b40": 'no RoPE call of two tensors (Q, K = rope(Q, K, ...), or one call each) that keeps their names',  # attention_processor:HunyuanAttnProcessor2_0
    "4eff0013f8a2021c": 'no RoPE call of two tensors (Q, K = rope(Q, K, ...), or one call each) that keeps their names',  # attention_processor:LuminaAttnProcessor2_0
    "53e21922e0121cce": 'no RoPE call of two tensors (Q, K = rope(Q, K, ...), or one call each) that keeps their names',  # attention_processor:PAGCFGHunyuanAttnProcessor2_0
    "b5167208ea8af061": 'no RoPE call of two tensors (Q, K = rope(Q, K, ...), or one call each) that keeps their names',  # attention_processor:PAGHunyuanAttnProcessor2_0
    "9bcf10a568f7f4f5": 'no RoPE call of two tensors (Q, K = rope(Q, K, ...), or one call each) that keeps their names',  # attention_processor:StableAudioAttnProcessor2_0
    "58d439e72c20950c": '`k_und_for_gen = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not` uses q_und, k_und or what their norms read between the norms and RoPE',  # cosmos3:Cosmos3AttnProcessor
    "f888cadc21cfe778": '`ip_query = query` uses query, key or what their norms read between the norms and RoPE',  # flux:FluxIPAdapterAttnProcessor
    "99a59536cdc0c22c": 'no RoPE call of two tensors (Q, K = rope(Q, K, ...), or one call each) that keeps their names',  # longcat_audio_dit:AudioDiTCrossAttnProcessor
    "b234b60b686c7b19": 'query is not normalized by attn.<norm_k|norm_q> before its RoPE call',  # ltx2:LTX2PerturbedAttnProcessor, sana_wm_refiner:SanaWMLTX2PerturbedAttnProcessor
    "c84a5cb7a5e34b50": 'no RoPE call of two tensors (Q, K = rope(Q, K, ...), or one call each) that keeps their names',  # motif_video:MotifVideoCrossAttnProcessor2_0
    "ba11435838dcc90a": 'no RoPE call of two tensors (Q, K = rope(Q, K, ...), or one call each) that keeps their names',  # sana_video:SanaLinearAttnProcessor3_0
    "c38d7882685877ba": "rope_apply's signature (grid loop) has no fused call yet",  # wan_animate_2:WanAnimate2AttnProcessor
}

DIFFUSERS_RELEASES: dict[str, set[str]] = {"0.42.1": set(_DIFFUSERS_TESTED_0_42_1)}
DIFFUSERS = Table(tested=_DIFFUSERS_TESTED_0_42_1, unfusable=_DIFFUSERS_UNFUSABLE_0_42_1)
