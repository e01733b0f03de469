// The schemas of the QK-norm + RoPE ops, in one place: librope_ext.so defines them (ops.cpp), and
// the testing library defines its emulated CUDA ops with the same signatures under names prefixed
// "cuda_emulate_" (csrc/testing/testing_ops.cpp), so that a test calls either alike.
#pragma once

namespace rope_ext {

struct OpSchema {
  const char* name;
  const char* signature;  // from the "(" on
};

// QK-norm + RoPE: for each of q and k, out = rotary(g * x_hat + b, cos, sin) with x_hat = x * rstd,
// rstd = 1 / sqrt(mean(x^2) + eps) over each head's row (x.size(-1) columns) or, across_heads, over
// all of a token's heads (dim -2); g = weight + weight_offset (or 1 without a weight) and b the bias
// (or 0), each (x.size(-1),), or (x.size(-2) * x.size(-1),) across heads. weight_after: out = g *
// rotary(x_hat, cos, sin) + b, the norm of models that normalize after RoPE. centered (LayerNorm):
// x_hat = (x - mean) * rstd, rstd = 1 / sqrt(mean((x - mean)^2) + eps), the mean over the same
// columns. cos/sin as rotary's, shared by q and k. Computed in float32 (float64 for float64 inputs)
// and rounded once. Also returns each row's (or token's) statistics, in the compute dtype, which the
// backward reads: rstd, or centered, (mean, rstd) in a last dim of 2.
inline constexpr OpSchema kQkNormSchemas[] = {
    {"qk_norm_rotary",
     "(Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, Tensor cos, Tensor sin, float eps, "
     "float weight_offset=0., bool across_heads=False, bool interleaved=False, bool weight_after=False, "
     "Tensor? q_bias=None, Tensor? k_bias=None, bool centered=False) -> (Tensor, Tensor, Tensor, Tensor)"},
    // qk_norm_rotary with the tables gathered from half-width caches at positions, as rotary_pos_qk
    // gathers them: the module's path, one call for q and k.
    {"qk_norm_rotary_pos",
     "(Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, Tensor cos_cache, Tensor sin_cache, "
     "Tensor positions, float eps, float weight_offset=0., bool across_heads=False, bool interleaved=False, "
     "bool weight_after=False, Tensor? q_bias=None, Tensor? k_bias=None, bool centered=False) "
     "-> (Tensor, Tensor, Tensor, Tensor)"},
    // qk_norm_rotary of one tensor, for models that rotate q and k in separate calls: (out, stats).
    {"norm_rotary",
     "(Tensor x, Tensor? weight, Tensor cos, Tensor sin, float eps, float weight_offset=0., "
     "bool across_heads=False, bool interleaved=False, bool weight_after=False, Tensor? bias=None, "
     "bool centered=False) -> (Tensor, Tensor)"},
    // In place, for inference (vLLM's fused_qk_norm_rope): q and k overwritten. Refuse inputs that
    // need grad.
    {"qk_norm_rotary_",
     "(Tensor(a!) q, Tensor(b!) k, Tensor? q_weight, Tensor? k_weight, Tensor cos, Tensor sin, float eps, "
     "float weight_offset=0., bool across_heads=False, bool interleaved=False, bool weight_after=False, "
     "Tensor? q_bias=None, Tensor? k_bias=None, bool centered=False) -> ()"},
    {"qk_norm_rotary_pos_",
     "(Tensor(a!) q, Tensor(b!) k, Tensor? q_weight, Tensor? k_weight, Tensor cos_cache, Tensor sin_cache, "
     "Tensor positions, float eps, float weight_offset=0., bool across_heads=False, bool interleaved=False, "
     "bool weight_after=False, Tensor? q_bias=None, Tensor? k_bias=None, bool centered=False) -> ()"},
    // The backward of either, for one of q and k: (dx, dweight, dbias) from the output's gradient, x
    // and the forward's statistics (cos/sin are caches when positions is given); dweight and dbias
    // (the compute dtype, the weight's shape) when weight_grad and bias_grad, else empty. The bias
    // is not an input: no gradient but its own depends on it.
    {"qk_norm_rotary_backward",
     "(Tensor grad, Tensor x, Tensor? weight, Tensor rstd, Tensor cos, Tensor sin, Tensor? positions, "
     "float weight_offset, bool across_heads, bool interleaved, bool weight_grad, bool weight_after=False, "
     "bool centered=False, bool bias_grad=False) -> (Tensor, Tensor, Tensor)"},
};

}  // namespace rope_ext
