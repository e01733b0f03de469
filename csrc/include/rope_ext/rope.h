// rope_ext's C++ API: fused rotary positional embedding (RoPE) for LibTorch programs.
//
// Link with the CMake package (find_package(rope_ext), target rope_ext::rope_ext). The library
// registers the ops rope_ext::rotary, rotary_qk, rotary_ and rotary_pos* with PyTorch's dispatcher
// when it is loaded; the functions below call them through the dispatcher, so CPU and CUDA tensors
// and torch.compile'd or exported programs all see the same ops as Python's rope_ext. Header-only:
// the functions, their autograd (torch::autograd::grad, double backward; rope_ext/autograd.h) and
// the frequency schedules (rope_ext/frequencies.h) compile against the program's own LibTorch.
//
// Conventions, shared by every function here:
//  - x is (..., head_dim); the rotation acts on its first r = cos.size(-1) columns (the rotary
//    dim, even, at most head_dim) and passes the other head_dim - r columns through.
//  - cos and sin are "full form" tables of width r: column j holds cos/sin of the angle of the
//    pair that column j belongs to. They broadcast against x.shape[:-1] + (r,).
//  - Half-split pairing (interleaved = false; HF / GPT-NeoX / Llama) pairs columns (i, i + r/2);
//    interleaved pairing (GPT-J / RoFormer / Meta) pairs (2i, 2i + 1). For a pair (a, b) at angle
//    t, the output is (a cos t - b sin t, b cos t + a sin t).
//  - conjugate = true applies the transposed rotation (angle -t): the backward of the forward.
//  - x may be float32, float64, float16 or bfloat16; cos/sin have x's dtype or float32. The math
//    runs in float32 (float64 for float64 x) and is rounded once to x's dtype.
//  - Bad arguments raise c10::Error with a message that names the argument.
//
// ROPE_EXT_VERSION (rope_ext/version.h) is the version of these headers. Load one version of
// rope_ext per process: the first copy loaded registers the ops for all, and a copy of another
// version registers nothing and warns when it loads.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "rope_ext/version.h"

namespace rope_ext {

/// Rotates x: `x * cos + R(x) * sin` on the first r = cos.size(-1) columns, the rest copied.
///
/// @param x           (..., head_dim) tensor; any strides.
/// @param cos, sin    full-form tables broadcastable to x.shape[:-1] + (r,), with r even and
///                    r <= head_dim; x's dtype or float32; on x's device.
/// @param interleaved pair (2i, 2i+1) instead of (i, i + r/2).
/// @param conjugate   rotate by -angle (the transpose).
/// @return a new tensor of x's shape, dtype and memory layout.
inline at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                               bool interleaved = false, bool conjugate = false);

/// Rotates q and k in one call: (rotary(q, cos, sin), rotary(k, cos_k, sin_k)).
///
/// @param q      (batch, heads_q, seqlen, head_dim) or any (..., head_dim).
/// @param k      like q; without cos_k/sin_k it may differ from q only in the head count
///               (GQA / MQA) and strides, and must have q's dtype.
/// @param cos, sin    tables for q (and for k unless cos_k/sin_k are given).
/// @param cos_k, sin_k  separate tables for k (both or neither), e.g. for xPos.
/// @return (q_out, k_out), new tensors with q's and k's shapes and layouts.
inline std::tuple<at::Tensor, at::Tensor> rotary_qk(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
    bool interleaved = false, const std::optional<at::Tensor>& cos_k = std::nullopt,
    const std::optional<at::Tensor>& sin_k = std::nullopt, bool conjugate = false);

/// In-place rotary for inference: x = rotary(x, cos, sin). Refuses (c10::Error) when grad mode
/// is on and x, cos or sin requires grad, when x's elements overlap (e.g. expanded views), and
/// when x shares memory with cos or sin.
inline void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                          bool interleaved = false, bool conjugate = false);

/// Rotates x by its tokens' positions, reading their angles from half-width caches inside the
/// kernel: row p of cos_cache / sin_cache holds cos / sin of p * theta_i for pair i. Equal to
/// rotary() with the full-form tables of those rows, without building them.
///
/// @param x           (..., head_dim) tensor; any strides.
/// @param cos_cache, sin_cache  (max_positions, r/2), r = 2 * cos_cache.size(1) <= head_dim; x's
///                    dtype or float32; any strides (e.g. the halves of a cat(cos, sin) cache).
/// @param positions   int32 or int64, broadcastable to x.shape[:-1]: (S, 1) or (B, S, 1) for
///                    (B, S, H, D) x, (S) or (B, 1, S) for (B, H, S, D) x. Each in
///                    [0, max_positions): c10::Error on the CPU, a device-side assert on CUDA.
/// @return a new tensor of x's shape, dtype and memory layout.
inline at::Tensor rotary_pos(const at::Tensor& x, const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                                   const at::Tensor& positions, bool interleaved = false, bool conjugate = false);

/// rotary_pos on q and k in one call (one CUDA launch). k may differ from q only in the head
/// count (positions broadcast along it) and in strides. Caches that require grad get gradients.
inline std::tuple<at::Tensor, at::Tensor> rotary_pos_qk(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& cos_cache,
                                                              const at::Tensor& sin_cache,
                                                              const at::Tensor& positions,
                                                              bool interleaved = false, bool conjugate = false);

/// In-place rotary_pos on q and, when given, k, for inference; refuses what rotary_ refuses, and
/// q and k sharing memory.
inline void rotary_pos_(at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos_cache,
                              const at::Tensor& sin_cache, const at::Tensor& positions, bool interleaved = false,
                              bool conjugate = false);

/// A rope-scaling configuration, the fields of a Hugging Face `rope_scaling` /
/// `rope_parameters` dict. Unset optionals take transformers' defaults where it has one;
/// original_max_position_embeddings defaults to max_position_embeddings, and yarn's and
/// longrope's factor to max_position_embeddings / original_max_position_embeddings.
///
/// rope_type is one of "default", "linear", "dynamic", "yarn", "longrope", "llama3":
///  - linear:  theta_i / factor.
///  - dynamic: NTK: the base grows once the sequence is longer than max_position_embeddings.
///  - yarn:    per-frequency ramp between interpolation and extrapolation (factor, beta_fast = 32,
///             beta_slow = 1, truncate, original_max_position_embeddings) and an attention
///             factor (attention_factor, or from mscale / mscale_all_dim, or 0.1 ln(factor) + 1).
///  - longrope: theta_i / short_factor[i], or / long_factor[i] past original_max_position_embeddings;
///             attention factor sqrt(1 + ln(factor) / ln(original)).
///  - llama3:  long wavelengths divided by factor, short ones kept, smooth in between
///             (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
struct RopeScaling {
  std::string rope_type = "default";
  std::optional<double> factor;
  std::optional<int64_t> original_max_position_embeddings;
  std::optional<double> attention_factor;
  // yarn
  std::optional<double> beta_fast, beta_slow, mscale, mscale_all_dim;
  bool truncate = true;
  // llama3
  std::optional<double> low_freq_factor, high_freq_factor;
  // longrope: rotary_dim / 2 values each
  std::vector<double> short_factor, long_factor;
  // proportional (Gemma 4): the share p of the head whose pairs turn. All rotary_dim columns are
  // paired; the first floor(p * rotary_dim / 2) pairs keep base^(-2i/rotary_dim) (divided by
  // factor, default 1), the others get frequency 0 (they pass unrotated). Default 1.
  std::optional<double> partial_rotary_factor;
};

/// The frequencies of one RoPE configuration, computed in float64.
struct RopeFrequencies {
  std::string rope_type;
  int64_t rotary_dim = 0;
  double base = 0;
  /// (rotary_dim / 2,) float64 CPU tensor: theta_i for sequences within the model's context
  /// (for every type but dynamic and longrope, the only one).
  at::Tensor inv_freq;
  /// longrope: theta_i for sequences longer than switch_len; undefined otherwise.
  at::Tensor inv_freq_long;
  /// multiplies cos and sin (yarn, longrope); 1 otherwise.
  double attention_factor = 1.0;
  /// dynamic: max_position_embeddings; longrope: original_max_position_embeddings.
  int64_t switch_len = 0;
  /// the scaling factor in effect (1 for default).
  double factor = 1.0;
};

/// Computes the frequencies of a configuration, as rope_ext.scaling.RopeSchedule does in Python
/// (the Python package calls this function).
///
/// @param base       rope_theta; theta_i = base^(-2i / rotary_dim) before scaling.
/// @param rotary_dim r, even and positive.
/// @param max_position_embeddings the model's context length.
inline RopeFrequencies rope_frequencies(const RopeScaling& scaling, double base,
                                              int64_t rotary_dim, int64_t max_position_embeddings);

/// theta_i for a batch whose largest position is max_position: (rotary_dim / 2,) float64.
/// Only dynamic and longrope depend on it (through the length max_position + 1); without
/// max_position, or for the other types, this is freqs.inv_freq.
inline at::Tensor inv_freq_for(const RopeFrequencies& freqs,
                                     std::optional<int64_t> max_position = std::nullopt);

/// Full-form (cos, sin) tables for the given positions, as rope_ext.positions.cos_sin_tables.
///
/// @param positions  integer tensor of non-negative positions, any shape P, any device. Checking
///                   that they are non-negative reads their minimum (a device sync on a GPU).
/// @param inv_freq   (r / 2,) floating-point frequencies.
/// @param interleaved full form for the interleaved pairing (each angle twice in a row) instead
///                   of half-split (the r/2 angles, then the same again).
/// @param scale      multiplies both tables (the attention factor).
/// @param dtype      dtype of the result; angles are computed in float64.
/// @return (cos, sin) of shape P + (r,), on positions' device. Add a heads dim (unsqueeze) before
///         passing them to rotary with (batch, heads, seqlen, head_dim) x.
inline std::tuple<at::Tensor, at::Tensor> cos_sin_tables(const at::Tensor& positions,
                                                              const at::Tensor& inv_freq,
                                                              bool interleaved = false,
                                                              double scale = 1.0,
                                                              at::ScalarType dtype = at::kFloat);

}  // namespace rope_ext

#include "rope_ext/autograd.h"     // the op functions above, with their autograd
#include "rope_ext/frequencies.h"  // rope_frequencies, inv_freq_for and cos_sin_tables
