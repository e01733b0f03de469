// The rotary ops written once for every backend, on torch's stable ABI: argument checks, output
// allocation, and the calls into a backend's `run`, which computes what a RotaryCall describes for
// checked arguments. Backends (CPU, CUDA, the CUDA host emulator) differ only in run. Each tensor
// is read once (read_arg); everything after that works on TensorArgs.
#pragma once

#include <optional>
#include <string>
#include <tuple>

#include "rotary_plan.h"
#include "stable_tensor.h"

#include <torch/csrc/stable/library.h>

namespace rope_ext {

template <RunFn run>
struct RotaryOps {
  using T = StableTensor;
  using OptT = std::optional<StableTensor>;

  static T rotary(const T& x_, const T& cos_, const T& sin_, bool interleaved, bool conjugate) {
    const TensorArg x = read_arg(x_), cos = read_arg(cos_), sin = read_arg(sin_);
    check_rotary_args("rope_ext.rotary", x, cos, sin);
    T out_ = new_like(x_, x);  // x's memory layout, new storage
    const TensorArg out = read_arg(out_, true);
    run({x, out, cos, sin, nullptr, nullptr, nullptr, interleaved, conjugate});
    return out_;
  }

  static std::tuple<T, T> rotary_qk(const T& q_, const T& k_, const T& cos_, const T& sin_, bool interleaved,
                                    const OptT& cos_k_, const OptT& sin_k_, bool conjugate) {
    const char* op = "rope_ext.rotary_qk";
    ROPE_EXT_CHECK(cos_k_.has_value() == sin_k_.has_value(), op, ": cos_k and sin_k must be given together, got only ",
                   cos_k_.has_value() ? "cos_k" : "sin_k");
    const bool own_k = cos_k_.has_value();
    const TensorArg q = read_arg(q_), k = read_arg(k_), cos = read_arg(cos_), sin = read_arg(sin_);
    const TensorArg ck = own_k ? read_arg(*cos_k_) : cos, sk = own_k ? read_arg(*sin_k_) : sin;
    check_rotary_args(op, q, cos, sin, {"q", "cos", "sin"});
    check_rotary_args(op, k, ck, sk, own_k ? ArgNames{"k", "cos_k", "sin_k"} : ArgNames{"k", "cos", "sin"});
    check_qk_args(op, q, k, own_k ? std::nullopt : std::optional(cos));
    T q_out_ = new_like(q_, q), k_out_ = new_like(k_, k);
    const TensorArg q_out = read_arg(q_out_, true), k_out = read_arg(k_out_, true);
    if (rotary_qk_one_call(q, k, own_k)) {
      run({q, q_out, cos, sin, nullptr, &k, &k_out, interleaved, conjugate, op});
    } else {
      run({q, q_out, cos, sin, nullptr, nullptr, nullptr, interleaved, conjugate, op});
      run({k, k_out, ck, sk, nullptr, nullptr, nullptr, interleaved, conjugate, op});
    }
    return {q_out_, k_out_};
  }

  static void rotary_(const T& x_, const T& cos_, const T& sin_, bool interleaved, bool conjugate) {
    const TensorArg x = read_arg(x_, true), cos = read_arg(cos_), sin = read_arg(sin_);
    check_rotary_args("rope_ext.rotary_", x, cos, sin);
    check_inplace_args("rope_ext.rotary_", x, {{"cos", &cos}, {"sin", &sin}});
    run({x, x, cos, sin, nullptr, nullptr, nullptr, interleaved, conjugate});
  }

  static T rotary_pos(const T& x_, const T& cos_cache_, const T& sin_cache_, const T& positions_, bool interleaved,
                      bool conjugate) {
    const char* op = "rope_ext.rotary_pos";
    const TensorArg x = read_arg(x_), cc = read_arg(cos_cache_), sc = read_arg(sin_cache_);
    const TensorArg positions = read_arg(positions_);
    check_rotary_pos_args(op, x, cc, sc, positions);
    T out_ = new_like(x_, x);
    const TensorArg out = read_arg(out_, true);
    run({x, out, cc, sc, &positions, nullptr, nullptr, interleaved, conjugate, op});
    return out_;
  }

  static std::tuple<T, T> rotary_pos_qk(const T& q_, const T& k_, const T& cos_cache_, const T& sin_cache_,
                                        const T& positions_, bool interleaved, bool conjugate) {
    const char* op = "rope_ext.rotary_pos_qk";
    const TensorArg q = read_arg(q_), k = read_arg(k_), cc = read_arg(cos_cache_), sc = read_arg(sin_cache_);
    const TensorArg positions = read_arg(positions_);
    check_rotary_pos_args(op, q, cc, sc, positions, "q");
    check_rotary_pos_args(op, k, cc, sc, positions, "k");
    check_qk_args(op, q, k, positions, "positions", 0);
    T q_out_ = new_like(q_, q), k_out_ = new_like(k_, k);
    const TensorArg q_out = read_arg(q_out_, true), k_out = read_arg(k_out_, true);
    run({q, q_out, cc, sc, &positions, &k, &k_out, interleaved, conjugate, op});
    return {q_out_, k_out_};
  }

  static void rotary_pos_(const T& q_, const OptT& k_, const T& cos_cache_, const T& sin_cache_,
                          const T& positions_, bool interleaved, bool conjugate) {
    const char* op = "rope_ext.rotary_pos_";
    const TensorArg q = read_arg(q_, true), cc = read_arg(cos_cache_), sc = read_arg(sin_cache_);
    const TensorArg positions = read_arg(positions_);
    check_rotary_pos_args(op, q, cc, sc, positions, "q");
    const std::initializer_list<NamedTensor> inputs = {
        {"cos_cache", &cc}, {"sin_cache", &sc}, {"positions", &positions}};
    check_inplace_args(op, q, inputs, "q");
    if (!k_.has_value()) {
      run({q, q, cc, sc, &positions, nullptr, nullptr, interleaved, conjugate, op});
      return;
    }
    const TensorArg k = read_arg(*k_, true);
    check_rotary_pos_args(op, k, cc, sc, positions, "k");
    check_qk_args(op, q, k, positions, "positions", 0);
    check_inplace_args(op, k, inputs, "k");
    check_inplace_args(op, q, {{"k", &k}}, "q");
    run({q, q, cc, sc, &positions, &k, &k, interleaved, conjugate, op});
  }
};

// Registers RotaryOps<run> as the kernels of one dispatch key (registration.h), under the ops'
// names with `prefix` (the host emulator's are rope_ext_testing::cuda_emulate_*).
template <RunFn run>
void register_rotary_ops(torch::stable::detail::StableLibrary& m, const std::string& prefix = "") {
  using Ops = RotaryOps<run>;
  m.impl((prefix + "rotary").c_str(), TORCH_BOX(&Ops::rotary));
  m.impl((prefix + "rotary_qk").c_str(), TORCH_BOX(&Ops::rotary_qk));
  m.impl((prefix + "rotary_").c_str(), TORCH_BOX(&Ops::rotary_));
  m.impl((prefix + "rotary_pos").c_str(), TORCH_BOX(&Ops::rotary_pos));
  m.impl((prefix + "rotary_pos_qk").c_str(), TORCH_BOX(&Ops::rotary_pos_qk));
  m.impl((prefix + "rotary_pos_").c_str(), TORCH_BOX(&Ops::rotary_pos_));
}

}  // namespace rope_ext
