"""Drop-in replacements with the signatures of other libraries' RoPE functions.

- :mod:`rope_ext.compat.hf`: transformers' ``apply_rotary_pos_emb`` (and the multimodal form).
- :mod:`rope_ext.compat.flash_attn`: flash-attn's ``apply_rotary_emb``, ``apply_rotary_emb_qkv_``,
  ``apply_rotary_emb_kv_`` and ``RotaryEmbedding`` module.
- :mod:`rope_ext.compat.vllm`: vLLM's ``rotary_embedding`` (in place, positions and a cat(cos, sin) cache).
- :mod:`rope_ext.compat.meta`: Meta's / torchtitan's ``precompute_freqs_cis`` and ``apply_rotary_emb``
  (complex ``freqs_cis``).
- :mod:`rope_ext.compat.mlx`: MLX's ``mx.fast.rope`` on torch tensors.
- :mod:`rope_ext.compat.lucidrains`: lucidrains' ``rotary-embedding-torch`` ``RotaryEmbedding`` and
  ``apply_rotary_emb``.
"""
