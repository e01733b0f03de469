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
  using T = TensorRef;
  using OptT = std::optional<TensorRef>;

  static OwnedTensor rotary(const T& x_, const T& cos_, const T& sin_, bool interleaved, bool conjugate) {
    const TensorArg x = read_arg(x_), cos = read_arg(cos_), sin = read_arg(sin_);
    check_rotary_args("rope_ext.rotary", x, cos, sin);
    Output out = new_like(x_.handle, x);  // x's memory layout, new storage
    run({x, out.arg, cos, sin, nullptr, nullptr, nullptr, interleaved, conjugate});
    return std::move(out.tensor);
  }

  static std::tuple<OwnedTensor, OwnedTensor> rotary_qk(const T& q_, const T& k_, const T& cos_, const T& sin_, bool interleaved,
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
    Output q_out = new_like(q_.handle, q), k_out = new_like(k_.handle, k);
    if (rotary_qk_one_call(q, k, own_k)) {
      run({q, q_out.arg, cos, sin, nullptr, &k, &k_out.arg, interleaved, conjugate, op});
    } else {
      run({q, q_out.arg, cos, sin, nullptr, nullptr, nullptr, interleaved, conjugate, op});
      run({k, k_out.arg, ck, sk, nullptr, nullptr, nullptr, interleaved, conjugate, op});
    }
    return {std::move(q_out.tensor), std::move(k_out.tensor)};
  }

  static void rotary_(const T& x_, const T& cos_, const T& sin_, bool interleaved, bool conjugate) {
    const TensorArg x = read_arg(x_, true), cos = read_arg(cos_), sin = read_arg(sin_);
    check_rotary_args("rope_ext.rotary_", x, cos, sin);
    check_inplace_args("rope_ext.rotary_", x, {{"cos", &cos}, {"sin", &sin}});
    run({x, x, cos, sin, nullptr, nullptr, nullptr, interleaved, conjugate});
  }

  static OwnedTensor rotary_pos(const T& x_, const T& cos_cache_, const T& sin_cache_, const T& positions_, bool interleaved,
                      bool conjugate) {
    const char* op = "rope_ext.rotary_pos";
    const TensorArg x = read_arg(x_), cc = read_arg(cos_cache_), sc = read_arg(sin_cache_);
    const TensorArg positions = read_arg(positions_);
    check_rotary_pos_args(op, x, cc, sc, positions);
    Output out = new_like(x_.handle, x);
    run({x, out.arg, cc, sc, &positions, nullptr, nullptr, interleaved, conjugate, op});
    return std::move(out.tensor);
  }

  static std::tuple<OwnedTensor, OwnedTensor> rotary_pos_qk(const T& q_, const T& k_, const T& cos_cache_, const T& sin_cache_,
                                        const T& positions_, bool interleaved, bool conjugate) {
    const char* op = "rope_ext.rotary_pos_qk";
    const TensorArg q = read_arg(q_), k = read_arg(k_), cc = read_arg(cos_cache_), sc = read_arg(sin_cache_);
    const TensorArg positions = read_arg(positions_);
    check_rotary_pos_args(op, q, cc, sc, positions, "q");
    check_rotary_pos_args(op, k, cc, sc, positions, "k");
    check_qk_args(op, q, k, positions, "positions", 0);
    Output q_out = new_like(q_.handle, q), k_out = new_like(k_.handle, k);
    run({q, q_out.arg, cc, sc, &positions, &k, &k_out.arg, interleaved, conjugate, op});
    return {std::move(q_out.tensor), std::move(k_out.tensor)};
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
  m.impl((prefix + "rotary").c_str(), &boxed<&Ops::rotary>);
  m.impl((prefix + "rotary_qk").c_str(), &boxed<&Ops::rotary_qk>);
  m.impl((prefix + "rotary_").c_str(), &boxed<&Ops::rotary_>);
  m.impl((prefix + "rotary_pos").c_str(), &boxed<&Ops::rotary_pos>);
  m.impl((prefix + "rotary_pos_qk").c_str(), &boxed<&Ops::rotary_pos_qk>);
  m.impl((prefix + "rotary_pos_").c_str(), &boxed<&Ops::rotary_pos_>);
}

}  // namespace rope_ext
