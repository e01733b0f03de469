// The QK-norm + RoPE ops (qk_norm_rotary and its backward), written once for every backend as
// rotary_ops.h writes the rotation's: argument checks, output allocation, and calls into a backend's
// `run`, which computes what a NormCall describes for checked arguments.
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "rotary_plan.h"
#include "stable_tensor.h"

#include <torch/csrc/stable/library.h>

namespace rope_ext {

template <NormRunFn run>
struct QkNormOps {
  using T = TensorRef;
  using OptT = std::optional<TensorRef>;
  using Four = std::tuple<OwnedTensor, OwnedTensor, OwnedTensor, OwnedTensor>;
  using Three = std::tuple<OwnedTensor, OwnedTensor, OwnedTensor>;

  static TensorArg read_optional(const OptT& t) { return t.has_value() ? read_arg(*t) : TensorArg{}; }

  // The compute dtype, which the statistics and the weights' and biases' gradients are kept in.
  static ScalarType stat_dtype(const TensorArg& x) {
    return x.scalar_type() == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  }

  // Row-major with no gaps (dims of one element aside): the kernels index rstd by group number.
  static bool contiguous(const TensorArg& t) {
    if (t.numel() == 0) return true;  // (as ATen's is_contiguous: an empty tensor's strides do not matter)
    int64_t expected = 1;
    for (int64_t d = t.dim() - 1; d >= 0; --d) {
      if (t.size(d) == 1) continue;
      if (t.stride(d) != expected) return false;
      expected *= t.size(d);
    }
    return true;
  }

  static Output new_stat(const TensorArg& x, bool across_heads, bool centered) {
    const std::vector<int64_t> shape = norm_stat_shape(x, across_heads, centered);
    return new_contiguous(Dims{shape.data(), static_cast<int64_t>(shape.size())}, stat_dtype(x), x.device());
  }

  // How a call normalizes, past its tensors: the arguments every forward form takes alike.
  struct NormForm {
    double eps, weight_offset;
    bool across_heads, interleaved, weight_after, centered;
  };

  // q and k of a forward call, read (writable, in place) and through every check the forms share.
  struct QkArgs {
    TensorArg q, k, cos, sin, q_weight, k_weight, q_bias, k_bias, pos;  // pos: undefined without positions
    bool gathered;
    const TensorArg* positions() const { return gathered ? &pos : nullptr; }
  };

  static QkArgs read_qk(const char* op, const T& q, const T& k, const OptT& q_weight, const OptT& k_weight,
                        const OptT& q_bias, const OptT& k_bias, const T& cos, const T& sin,
                        const TensorRef* positions, const NormForm& f, bool writes) {
    QkArgs a{read_arg(q, writes),     read_arg(k, writes),     read_arg(cos),
             read_arg(sin),           read_optional(q_weight), read_optional(k_weight),
             read_optional(q_bias),   read_optional(k_bias),
             positions != nullptr ? read_arg(*positions) : TensorArg{}, positions != nullptr};
    check_qk_norm_args(op, a.q, {&a.q_weight, &a.q_bias, "q_weight", "q_bias"}, a.cos, a.sin, a.positions(), f.eps,
                       f.weight_offset, f.across_heads, "q");
    check_qk_norm_args(op, a.k, {&a.k_weight, &a.k_bias, "k_weight", "k_bias"}, a.cos, a.sin, a.positions(), f.eps,
                       f.weight_offset, f.across_heads, "k");
    if (a.gathered) {
      check_qk_args(op, a.q, a.k, a.pos, "positions", 0);
    } else {
      check_qk_args(op, a.q, a.k, a.cos);
    }
    return a;
  }

  // The forward of one tensor into out (x itself, in place), keeping its statistics where given.
  static void run_one(const char* op, const TensorArg& x, const TensorArg& out, const TensorArg& weight,
                      const TensorArg& bias, const TensorArg& cos, const TensorArg& sin, const TensorArg* positions,
                      const TensorArg* stats, const NormForm& f) {
    // (Named, not braced in the call: nvcc's front end misreads a braced argument to a function
    // pointer template parameter.)
    const NormCall call{x,       out,     &weight, cos,  sin,    stats,          positions,
                        nullptr, nullptr, f.eps,   f.weight_offset, f.across_heads, f.interleaved, op,
                        f.weight_after, &bias, nullptr, f.centered};
    run(call);
  }

  // The forward of q and of k into q_out and k_out (q and k themselves, in place), keeping their
  // statistics where given.
  static void run_qk(const char* op, const QkArgs& a, const TensorArg& q_out, const TensorArg& k_out,
                     const TensorArg* q_stats, const TensorArg* k_stats, const NormForm& f) {
    run_one(op, a.q, q_out, a.q_weight, a.q_bias, a.cos, a.sin, a.positions(), q_stats, f);
    run_one(op, a.k, k_out, a.k_weight, a.k_bias, a.cos, a.sin, a.positions(), k_stats, f);
  }

  // (q_out, k_out, q_stats, k_stats); cos/sin are full-form tables, or half-width caches gathered at
  // `positions` when it is set (qk_norm_rotary_pos).
  static Four out_of_place(const char* op, const T& q_, const T& k_, const OptT& q_weight, const OptT& k_weight,
                           const OptT& q_bias, const OptT& k_bias, const T& cos, const T& sin,
                           const TensorRef* positions, const NormForm& f) {
    const QkArgs a = read_qk(op, q_, k_, q_weight, k_weight, q_bias, k_bias, cos, sin, positions, f, false);
    Output q_out = new_like(q_.handle, a.q), k_out = new_like(k_.handle, a.k);
    Output q_stats = new_stat(a.q, f.across_heads, f.centered), k_stats = new_stat(a.k, f.across_heads, f.centered);
    run_qk(op, a, q_out.arg, k_out.arg, &q_stats.arg, &k_stats.arg, f);
    return {std::move(q_out.tensor), std::move(k_out.tensor), std::move(q_stats.tensor), std::move(k_stats.tensor)};
  }

  static Four qk_norm_rotary(const T& q, const T& k, const OptT& q_weight, const OptT& k_weight, const T& cos,
                             const T& sin, double eps, double weight_offset, bool across_heads, bool interleaved,
                             bool weight_after, const OptT& q_bias, const OptT& k_bias, bool centered) {
    return out_of_place("rope_ext.qk_norm_rotary", q, k, q_weight, k_weight, q_bias, k_bias, cos, sin, nullptr,
                        {eps, weight_offset, across_heads, interleaved, weight_after, centered});
  }

  static Four qk_norm_rotary_pos(const T& q, const T& k, const OptT& q_weight, const OptT& k_weight,
                                 const T& cos_cache, const T& sin_cache, const T& positions, double eps,
                                 double weight_offset, bool across_heads, bool interleaved, bool weight_after,
                                 const OptT& q_bias, const OptT& k_bias, bool centered) {
    return out_of_place("rope_ext.qk_norm_rotary_pos", q, k, q_weight, k_weight, q_bias, k_bias, cos_cache,
                        sin_cache, &positions, {eps, weight_offset, across_heads, interleaved, weight_after, centered});
  }

  // In place, for inference: q and k overwritten with their (q_out, k_out); no statistics are kept.
  // Every check of the out-of-place op, and q and k must store each element once and share no
  // memory with each other or any input.
  static void in_place(const char* op, const T& q, const T& k, const OptT& q_weight, const OptT& k_weight,
                       const OptT& q_bias, const OptT& k_bias, const T& cos, const T& sin,
                       const TensorRef* positions, const NormForm& f) {
    const QkArgs a = read_qk(op, q, k, q_weight, k_weight, q_bias, k_bias, cos, sin, positions, f, true);
    const char* nc = a.gathered ? "cos_cache" : "cos";
    const char* ns = a.gathered ? "sin_cache" : "sin";
    for (const auto& [x, name] : {std::pair{&a.q, "q"}, std::pair{&a.k, "k"}}) {
      check_inplace_args(op, *x, {{nc, &a.cos}, {ns, &a.sin}, {"positions", &a.pos}, {"q_weight", &a.q_weight},
                                  {"k_weight", &a.k_weight}, {"q_bias", &a.q_bias}, {"k_bias", &a.k_bias}}, name);
    }
    check_inplace_args(op, a.q, {{"k", &a.k}}, "q");
    run_qk(op, a, a.q, a.k, nullptr, nullptr, f);
  }

  static void qk_norm_rotary_(const T& q, const T& k, const OptT& q_weight, const OptT& k_weight, const T& cos,
                              const T& sin, double eps, double weight_offset, bool across_heads, bool interleaved,
                              bool weight_after, const OptT& q_bias, const OptT& k_bias, bool centered) {
    in_place("rope_ext.qk_norm_rotary_", q, k, q_weight, k_weight, q_bias, k_bias, cos, sin, nullptr,
             {eps, weight_offset, across_heads, interleaved, weight_after, centered});
  }

  static void qk_norm_rotary_pos_(const T& q, const T& k, const OptT& q_weight, const OptT& k_weight,
                                  const T& cos_cache, const T& sin_cache, const T& positions, double eps,
                                  double weight_offset, bool across_heads, bool interleaved, bool weight_after,
                                  const OptT& q_bias, const OptT& k_bias, bool centered) {
    in_place("rope_ext.qk_norm_rotary_pos_", q, k, q_weight, k_weight, q_bias, k_bias, cos_cache, sin_cache,
             &positions, {eps, weight_offset, across_heads, interleaved, weight_after, centered});
  }

  // One tensor (models that normalize and rotate q and k in separate calls): (out, stats), what either
  // half of qk_norm_rotary computes, checked and named as "x", "weight" and "bias". Its backward is
  // qk_norm_rotary_backward's.
  static std::tuple<OwnedTensor, OwnedTensor> norm_rotary(const T& x_, const OptT& weight, const T& cos_,
                                                          const T& sin_, double eps, double weight_offset,
                                                          bool across_heads, bool interleaved, bool weight_after,
                                                          const OptT& bias, bool centered) {
    const char* op = "rope_ext.norm_rotary";
    const TensorArg x = read_arg(x_), w = read_optional(weight), b = read_optional(bias);
    const TensorArg cos = read_arg(cos_), sin = read_arg(sin_);
    check_qk_norm_args(op, x, {&w, &b}, cos, sin, nullptr, eps, weight_offset, across_heads, "x");
    Output out = new_like(x_.handle, x), stats = new_stat(x, across_heads, centered);
    run_one(op, x, out.arg, w, b, cos, sin, nullptr, &stats.arg,
            {eps, weight_offset, across_heads, interleaved, weight_after, centered});
    return {std::move(out.tensor), std::move(stats.tensor)};
  }

  // (dx, dweight, dbias): dweight (dbias) in the compute dtype, of the weight's shape, when
  // weight_grad (bias_grad); else empty. The bias itself is not an input: it moves no gradient but
  // its own, whose length is the weight's (check_qk_norm_args), or without a weight x.size(-1), or
  // x.size(-2) * x.size(-1) across heads.
  static Three qk_norm_rotary_backward(const T& grad_, const T& x_, const OptT& weight_, const T& rstd_,
                                       const T& cos_, const T& sin_, const OptT& positions_, double weight_offset,
                                       bool across_heads, bool interleaved, bool weight_grad, bool weight_after,
                                       bool centered, bool bias_grad) {
    const char* op = "rope_ext.qk_norm_rotary_backward";
    const TensorArg grad = read_arg(grad_), x = read_arg(x_), rstd = read_arg(rstd_);
    const TensorArg cos = read_arg(cos_), sin = read_arg(sin_), w = read_optional(weight_);
    const TensorArg pos = read_optional(positions_);
    const TensorArg* positions = pos.defined() ? &pos : nullptr;
    check_qk_norm_args(op, x, {&w, nullptr}, cos, sin, positions, 0.0, weight_offset, across_heads, "x");
    ROPE_EXT_CHECK(grad.defined() && grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type() &&
                       grad.device() == x.device(),
                   op, ": grad must have x's shape ", x.sizes(), ", dtype ", x.scalar_type(), " and device ",
                   x.device(), ", got ", grad.defined() ? str(grad.sizes(), " ", grad.scalar_type(), " on ",
                                                              grad.device()) : std::string("None"));
    const std::vector<int64_t> shape = norm_stat_shape(x, across_heads, centered);
    const Dims stat{shape.data(), static_cast<int64_t>(shape.size())};
    ROPE_EXT_CHECK(rstd.defined() && rstd.sizes() == stat && rstd.scalar_type() == stat_dtype(x) &&
                       rstd.device() == x.device() && contiguous(rstd),
                   op, ": rstd must be the forward's statistics: contiguous, of shape ", stat, ", ", stat_dtype(x),
                   " on ", x.device());
    ROPE_EXT_CHECK(!weight_grad || w.defined(), op, ": weight_grad=True needs a weight");
    Output dx = new_like(x_.handle, x);
    const int64_t width = w.defined() ? w.size(0) : across_heads ? x.size(-2) * x.size(-1) : x.size(-1);
    const int64_t nw = weight_grad ? width : 0, nb = bias_grad ? width : 0;
    Output dweight = new_contiguous(Dims{&nw, 1}, stat_dtype(x), x.device());
    Output dbias = new_contiguous(Dims{&nb, 1}, stat_dtype(x), x.device());
    const NormCall call{x,   dx.arg, &w, cos, sin, &rstd, positions, &grad, weight_grad ? &dweight.arg : nullptr,
                        0.0, weight_offset, across_heads, interleaved, op, weight_after, nullptr,
                        bias_grad ? &dbias.arg : nullptr, centered};
    run(call);
    return {std::move(dx.tensor), std::move(dweight.tensor), std::move(dbias.tensor)};
  }
};

template <NormRunFn run>
void register_qk_norm_ops(torch::stable::detail::StableLibrary& m, const std::string& prefix = "") {
  using Ops = QkNormOps<run>;
  m.impl((prefix + "qk_norm_rotary").c_str(), &boxed<&Ops::qk_norm_rotary>);
  m.impl((prefix + "qk_norm_rotary_pos").c_str(), &boxed<&Ops::qk_norm_rotary_pos>);
  m.impl((prefix + "qk_norm_rotary_").c_str(), &boxed<&Ops::qk_norm_rotary_>);
  m.impl((prefix + "qk_norm_rotary_pos_").c_str(), &boxed<&Ops::qk_norm_rotary_pos_>);
  m.impl((prefix + "qk_norm_rotary_backward").c_str(), &boxed<&Ops::qk_norm_rotary_backward>);
  m.impl((prefix + "norm_rotary").c_str(), &boxed<&Ops::norm_rotary>);
}

}  // namespace rope_ext
