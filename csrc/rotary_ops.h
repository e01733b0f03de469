// The rotary ops written once for every backend: argument checks, output allocation, and the
// calls into a backend's `run`, which computes what a RotaryCall describes for checked arguments.
// Backends (CPU, CUDA, the CUDA host emulator) differ only in run.
#pragma once

#include <ATen/ops/empty_like.h>

#include <optional>
#include <tuple>

#include "rotary_plan.h"

namespace rope_ext {

// One backend call: out = rotary(x, tables) and, when k is set, k_out = rotary(k, the same
// tables) (rotary_pos_qk, and rotary_qk where q and k share tables: one CUDA launch covers both,
// reading each token's table entries once for q's heads and k's). out may be x and k_out may be k
// (in place).
struct RotaryCall {
  const at::Tensor& x;
  at::Tensor& out;
  const at::Tensor& cos;  // full-form tables (..., r), or half-width caches (P, r/2) with positions
  const at::Tensor& sin;
  const at::Tensor* positions = nullptr;  // set: cos/sin are caches gathered at these positions
  const at::Tensor* k = nullptr;
  at::Tensor* k_out = nullptr;
  bool interleaved = false;
  bool conjugate = false;
  const char* op = "rope_ext";  // for error messages raised while running
};

using RunFn = void (*)(const RotaryCall& call);

// Whether rotary_qk rotates q and k in one backend call (one CUDA launch). Not with k's own tables
// (cos_k/sin_k): the kernel holds one pair of table pointers and reads a token's entries once for
// every head it covers. Nor where q and k differ in head dim (shared full tables allow it): a
// launch's items cover one row width. Each of those cases makes one call per tensor.
inline bool rotary_qk_one_call(const at::Tensor& q, const at::Tensor& k, bool own_k_tables) {
  return !own_k_tables && q.size(-1) == k.size(-1);
}

template <RunFn run>
struct RotaryOps {
  static at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                           bool interleaved, bool conjugate) {
    check_rotary_args("rope_ext.rotary", x, cos, sin);
    at::Tensor out = at::empty_like(x);  // x's memory layout, new storage
    run({x, out, cos, sin, nullptr, nullptr, nullptr, interleaved, conjugate});
    return out;
  }

  static std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& cos, const at::Tensor& sin,
                                                      bool interleaved,
                                                      const std::optional<at::Tensor>& cos_k,
                                                      const std::optional<at::Tensor>& sin_k,
                                                      bool conjugate) {
    TORCH_CHECK(cos_k.has_value() == sin_k.has_value(),
                "rope_ext.rotary_qk: cos_k and sin_k must be given together, got only ",
                cos_k.has_value() ? "cos_k" : "sin_k");
    const at::Tensor& ck = cos_k.has_value() ? *cos_k : cos;
    const at::Tensor& sk = sin_k.has_value() ? *sin_k : sin;
    check_rotary_args("rope_ext.rotary_qk", q, cos, sin, {"q", "cos", "sin"});
    check_rotary_args("rope_ext.rotary_qk", k, ck, sk,
                      cos_k.has_value() ? ArgNames{"k", "cos_k", "sin_k"} : ArgNames{"k", "cos", "sin"});
    check_qk_args("rope_ext.rotary_qk", q, k, cos_k.has_value() ? std::nullopt : std::optional(cos));
    at::Tensor q_out = at::empty_like(q);
    at::Tensor k_out = at::empty_like(k);
    if (rotary_qk_one_call(q, k, cos_k.has_value())) {
      run({q, q_out, cos, sin, nullptr, &k, &k_out, interleaved, conjugate, "rope_ext.rotary_qk"});
    } else {
      run({q, q_out, cos, sin, nullptr, nullptr, nullptr, interleaved, conjugate, "rope_ext.rotary_qk"});
      run({k, k_out, ck, sk, nullptr, nullptr, nullptr, interleaved, conjugate, "rope_ext.rotary_qk"});
    }
    return {q_out, k_out};
  }

  static void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                      bool interleaved, bool conjugate) {
    check_rotary_args("rope_ext.rotary_", x, cos, sin);
    check_inplace_args("rope_ext.rotary_", x, {{"cos", &cos}, {"sin", &sin}});
    run({x, x, cos, sin, nullptr, nullptr, nullptr, interleaved, conjugate});
  }

  static at::Tensor rotary_pos(const at::Tensor& x, const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                               const at::Tensor& positions, bool interleaved, bool conjugate) {
    check_rotary_pos_args("rope_ext.rotary_pos", x, cos_cache, sin_cache, positions);
    at::Tensor out = at::empty_like(x);
    run({x, out, cos_cache, sin_cache, &positions, nullptr, nullptr, interleaved, conjugate, "rope_ext.rotary_pos"});
    return out;
  }

  static std::tuple<at::Tensor, at::Tensor> rotary_pos_qk(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& cos_cache,
                                                          const at::Tensor& sin_cache,
                                                          const at::Tensor& positions, bool interleaved,
                                                          bool conjugate) {
    const char* op = "rope_ext.rotary_pos_qk";
    check_rotary_pos_args(op, q, cos_cache, sin_cache, positions, "q");
    check_rotary_pos_args(op, k, cos_cache, sin_cache, positions, "k");
    check_qk_args(op, q, k, positions, "positions", 0);
    at::Tensor q_out = at::empty_like(q);
    at::Tensor k_out = at::empty_like(k);
    run({q, q_out, cos_cache, sin_cache, &positions, &k, &k_out, interleaved, conjugate, op});
    return {q_out, k_out};
  }

  static void rotary_pos_(at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos_cache,
                          const at::Tensor& sin_cache, const at::Tensor& positions, bool interleaved,
                          bool conjugate) {
    const char* op = "rope_ext.rotary_pos_";
    check_rotary_pos_args(op, q, cos_cache, sin_cache, positions, "q");
    const std::initializer_list<NamedTensor> inputs = {
        {"cos_cache", &cos_cache}, {"sin_cache", &sin_cache}, {"positions", &positions}};
    check_inplace_args(op, q, inputs, "q");
    if (!k.has_value()) {
      run({q, q, cos_cache, sin_cache, &positions, nullptr, nullptr, interleaved, conjugate, op});
      return;
    }
    // The schema marks k mutable, so the optional holds the caller's tensor (a shared handle).
    at::Tensor kt = *k;
    check_rotary_pos_args(op, kt, cos_cache, sin_cache, positions, "k");
    check_qk_args(op, q, kt, positions, "positions", 0);
    check_inplace_args(op, kt, inputs, "k");
    check_inplace_args(op, q, {{"k", &kt}}, "q");
    run({q, q, cos_cache, sin_cache, &positions, &kt, &kt, interleaved, conjugate, op});
  }
};

}  // namespace rope_ext
