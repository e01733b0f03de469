// The three rotary ops written once for every backend: argument checks, output allocation,
// and the calls into a backend's `run`, which computes out = rotary(x, cos, sin) for checked
// arguments (out may be x). Backends (CPU, CUDA, the CUDA host emulator) differ only in run.
#pragma once

#include <ATen/ops/empty_like.h>

#include <optional>
#include <tuple>

#include "rotary_plan.h"

namespace rope_ext {

using RunFn = void (*)(const at::Tensor& x, at::Tensor& out, const at::Tensor& cos,
                       const at::Tensor& sin, bool interleaved, bool conjugate);

template <RunFn run>
struct RotaryOps {
  static at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                           bool interleaved, bool conjugate) {
    check_rotary_args("rope_ext.rotary", x, cos, sin);
    at::Tensor out = at::empty_like(x);  // x's memory layout, new storage
    run(x, out, cos, sin, interleaved, conjugate);
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
    run(q, q_out, cos, sin, interleaved, conjugate);
    run(k, k_out, ck, sk, interleaved, conjugate);
    return {q_out, k_out};
  }

  static void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                      bool interleaved, bool conjugate) {
    check_rotary_args("rope_ext.rotary_", x, cos, sin);
    check_inplace_args("rope_ext.rotary_", x, cos, sin);
    run(x, x, cos, sin, interleaved, conjugate);
  }
};

}  // namespace rope_ext
