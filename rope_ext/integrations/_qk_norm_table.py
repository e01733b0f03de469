"""The tested fusions: every attention method whose QK-norm + RoPE ``patch()`` fuses, pinned by the
fingerprint of its code (``_engine.fingerprint`` of the method, helpers it names included, its
class's name left out), with the site the rewrite finds in that code. ``patch()`` fuses these and
nothing else; each is run, stock against fused, by a test (tests/test_qk_norm_table.py, with the
releases it holds for). ``tools/qk_norm_table.py`` proposes entries for a release and says what
changed; an entry lands with the test that runs it.

``unfusable``: methods of the tested releases whose parts the fused op takes but whose code the
rewrite cannot fuse (norms after RoPE, q read between norm and RoPE, ...), with why: listed as not
fused, not warned of.
"""

from __future__ import annotations

import dataclasses

from rope_ext.integrations._qk_norm_rewrite import Site


@dataclasses.dataclass(frozen=True)
class Table:
    tested: dict[str, Site]
    unfusable: dict[str, str]


def _self(rope: str = "apply_rotary_pos_emb", mode: str = "head", q: str = "q_norm", k: str = "k_norm") -> Site:
    return Site("self", q, k, rope, False, mode)


# transformers, by release: the fingerprints of the attention methods each release fuses (a release
# that keeps a method's code keeps its fingerprint, and the entry is listed under each), with the
# families that have it (the first one, or the one named in tests/test_qk_norm_fusion.py's CASES,
# is the one the test runs).
# transformers 4.57.6: 11 fusions
_TESTED_4_57_6 = {
    "fa9fcdb5e1cb2e60": _self(),  # apertus
    "e7056947762bea34": _self(),  # doge
    "362ae6823fb338e8": _self(),  # dots1, qwen3, qwen3_moe, qwen3_omni_moe
    "3ad64bf6c5a07c02": _self(),  # exaone4
    "b7e0aa069058403d": _self(mode='heads_bhsd'),  # flex_olmo, olmo2
    "5fe298bcfcba4bb0": _self(),  # gemma3
    "ce54608253cc683e": _self(),  # glm4_moe
    "7b5e9da44be80f83": _self(q='q_layernorm', k='k_layernorm'),  # lfm2
    "219ab88c867c9095": _self(mode='heads_bhsd'),  # olmo3
    "6b49c7faa79af674": _self(),  # qwen3_next
    "7b76a8bdcbb661f6": _self(),  # qwen3_vl, qwen3_vl_moe
}

_UNFUSABLE_4_57_6 = {
    "19cecb1c052cad73": 'q and k are normalized after RoPE (the fused op normalizes first)',  # hunyuan_v1_dense, hunyuan_v1_moe
    "ff9fdf78bfd35482": '`query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).tran` uses query_states, key_states or what their norms read between the norms and RoPE',  # olmoe
}

# transformers 5.23.0: 28 fusions
_TESTED_5_23_0 = {
    "8eaed4dc89b3c45f": _self(),  # afmoe
    "044fa9ade38282d0": _self(),  # apertus, hy_v3
    "f423abae1ff63944": _self(),  # beam
    "7c504a235393e813": _self(),  # doge
    "6a0b53a8f0ea5cde": _self(),  # dots1, mellum, qwen3, qwen3_moe, qwen3_omni_moe
    "58251b738c8cab45": _self('apply_rotary_pos_emb_vision'),  # dots3_note, glm5_next, glm_ocr
    "c54b6a527a582f91": _self(),  # embedding_gemma2
    "13e11c48703e6402": _self(),  # esmfold2
    "62658458c1c3c1a4": _self(),  # exaone4, exaone4_5, exaone_moe, kolibri1
    "eaac37392d73672c": _self(mode='heads_bhsd'),  # flex_olmo, olmo2
    "91dfa55417dfbf42": _self(),  # flint
    "25f22696058be4ad": _self(),  # gemma3, t5gemma2
    "462869bb0b8248bd": _self(),  # glm4_moe
    "cbaf47238380dfba": _self(),  # laguna
    "bf304bc8ecb4f2a1": _self(q='q_layernorm', k='k_layernorm'),  # lfm2, lfm2_moe
    "685ab2923f5aedf7": _self(),  # lfm3
    "e978949773c71f96": _self('apply_rotary_pos_emb_vision'),  # lfm3_vl
    "9ce37dbdfe2127a2": _self(mode='heads_bhsd'),  # minimax_m2
    "79b4a8072e52970e": _self(),  # minimax_m3_vl
    "628a4e43db433975": _self(),  # molmo2
    "6453311944c8615f": _self(),  # neomme
    "57fbce2e07190b3e": _self(mode='heads_bhsd'),  # olmo3
    "5472420d988a96a0": _self(mode='heads_bhsd'),  # olmo_hybrid
    "7e43f14d0a2d3bce": _self(),  # pe_audio, pe_audio_video, pe_video
    "59a6f0a249db2f77": _self(),  # qwen3_5, qwen3_5_moe, qwen3_next
    "85c9fa4d05923c5a": _self(),  # qwen3_vl, qwen3_vl_moe
    "35918306575f5636": _self(),  # step3p7
    "10f286003e64ec80": _self(),  # t5gemma2
}

_UNFUSABLE_5_23_0 = {
    "47c765c731895ba7": 'q and k are normalized after RoPE (the fused op normalizes first)',  # hunyuan_v1_dense, hunyuan_v1_moe
    "2ca0d72f13ff4c52": 'q and k are normalized after RoPE (the fused op normalizes first)',  # hunyuan_vl
    "4cfb407ffa7de969": 'q and k are normalized after RoPE (the fused op normalizes first)',  # idefics
    "98bb62732e03c886": 'idx_q, idx_k or what their norms read is used between their two norms',  # minimax_m3_vl
    "b6a9b9ab4a6e7231": 'q and k are normalized after RoPE (the fused op normalizes first)',  # nanochat
    "218a58a768467f3c": '`query_states = query_states.view(*hidden_shape).transpose(1, 2)` uses query_states, key_states or what their norms read between the norms and RoPE',  # olmoe
    "7d12af72d06206f8": 'q and k are normalized after RoPE (the fused op normalizes first)',  # timesfm2_5
}

# transformers 5.24.0: 28 fusions
_TESTED_5_24_0 = {
    "e14b35e66237a87b": _self(),  # afmoe
    "3e4b21ef01a575c9": _self(),  # apertus, apertus1p5, hy_v3
    "3934a1e2e7bd4789": _self(),  # beam
    "35b92b837fbf93ae": _self(),  # doge
    "5af78178f31fe4d3": _self(),  # dots1, mellum, qwen3, qwen3_moe, qwen3_omni_moe
    "58251b738c8cab45": _self('apply_rotary_pos_emb_vision'),  # dots3_note, glm5_next, glm_ocr
    "c54b6a527a582f91": _self(),  # embedding_gemma2
    "13e11c48703e6402": _self(),  # esmfold2
    "2026749a4288cab8": _self(),  # exaone4, exaone4_5, exaone_moe, kolibri1
    "b5cd899206d85125": _self(mode='heads_bhsd'),  # flex_olmo, olmo2
    "dd03ee86231f23b8": _self(),  # flint
    "7b227fc0819f4ba8": _self(),  # gemma3, t5gemma2
    "ebfd11c14e118e85": _self(),  # glm4_moe
    "7f36c6ec8da57e5f": _self(),  # laguna
    "b5fa1b21a3ef3592": _self(q='q_layernorm', k='k_layernorm'),  # lfm2, lfm2_moe
    "5dbcb5d6590a8289": _self(),  # lfm3
    "e978949773c71f96": _self('apply_rotary_pos_emb_vision'),  # lfm3_vl
    "23d8a767a29abf63": _self(mode='heads_bhsd'),  # minimax_m2
    "b06141119d450e28": _self(),  # minimax_m3_vl
    "7a6eab4ff7ad00f0": _self(),  # molmo2
    "4388c0380d022619": _self(),  # neomme
    "5ae95fee9eeeb7be": _self(mode='heads_bhsd'),  # olmo3
    "8af04e3dfd02623b": _self(mode='heads_bhsd'),  # olmo_hybrid
    "75f971324b54aacb": _self(),  # pe_audio, pe_audio_video, pe_video
    "c6a520ccd2efa591": _self(),  # qwen3_5, qwen3_5_moe, qwen3_next
    "f03f70e5b1dcb251": _self(),  # qwen3_vl, qwen3_vl_moe
    "5fdbe83dc32b2579": _self(),  # step3p7
    "571cd2183bd4a445": _self(),  # t5gemma2
}

_UNFUSABLE_5_24_0 = {
    "6035e3b25954c76c": 'q and k are normalized after RoPE (the fused op normalizes first)',  # hunyuan_v1_dense, hunyuan_v1_moe
    "e0facf8f12b9262f": 'q and k are normalized after RoPE (the fused op normalizes first)',  # hunyuan_vl
    "eb1af0e18b9cbd0f": 'q and k are normalized after RoPE (the fused op normalizes first)',  # idefics
    "d293077a23c3596c": 'idx_q, idx_k or what their norms read is used between their two norms',  # minimax_m3_vl
    "526997a1700c08b8": 'q and k are normalized after RoPE (the fused op normalizes first)',  # nanochat
    "ca33447daef1b67c": '`query_states = query_states.view(*hidden_shape).transpose(1, 2)` uses query_states, key_states or what their norms read between the norms and RoPE',  # olmoe
    "9a0cd6fa6905bd88": 'q and k are normalized after RoPE (the fused op normalizes first)',  # timesfm2_5
}

TRANSFORMERS_RELEASES: dict[str, set[str]] = {
    "4.57.6": set(_TESTED_4_57_6), "5.23.0": set(_TESTED_5_23_0), "5.24.0": set(_TESTED_5_24_0)}
TRANSFORMERS = Table(tested={**_TESTED_4_57_6, **_TESTED_5_23_0, **_TESTED_5_24_0},
                     unfusable={**_UNFUSABLE_4_57_6, **_UNFUSABLE_5_23_0, **_UNFUSABLE_5_24_0})
