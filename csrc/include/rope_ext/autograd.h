// The C++ API's autograd, included by rope_ext/rope.h (not for direct use). Header-only: it
// compiles against the program's own LibTorch, so that librope_ext.so can stay on torch's stable
// ABI, which has no autograd (issue 37). Python registers the same formulas (rope_ext/_autograd.py).
//
// Each op function of rope.h calls its op below autograd when no graph is recorded (no grad mode,
// or nothing requires grad), and otherwise applies one of the torch::autograd::Functions here,
// whose forward calls the op below autograd and whose backward is written with ops.
//
// The formulas. out = x*c + R(x)*s on the rotary columns (conjugate: out = x*c - R(x*s)), so
//   dx   = rotary(g, c, s, conjugate=not conjugate)     (the transposed map, same kernel)
//   dcos = g * x
//   dsin = g * R(x)          (forward)     or     R(g) * x     (conjugate)
// on the first r columns, summed back to cos/sin's broadcast shape. x is saved only when cos
// or sin needs a gradient; otherwise the backward keeps nothing but cos and sin. Everything is
// written with ops (and symbolic sizes), so double backward and tracing go through it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>

#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "rope_ext/errors.h"
#include "rope_ext/version.h"

// Defined in librope_ext.so: the one symbol of the library these headers call, so that a program's
// link keeps the library (even with --as-needed), whose loading registers the ops. Its version.
extern "C" __attribute__((visibility("default"))) const char* rope_ext_library_version();

namespace rope_ext {

/// A position outside the cos/sin cache of rotary_pos, rotary_pos_qk or rotary_pos_ (on the CPU,
/// where every position is checked before anything is written). A c10::IndexError; msg() is the
/// library's message without the prefix that carried the type (rope_ext/errors.h), naming the
/// position, its index in positions.flatten() and the cache's rows.
class PositionOutsideCache : public c10::IndexError {
 public:
  using c10::IndexError::IndexError;
};

namespace detail {

// The op `name` (e.g. "rope_ext::rotary"), for a call site's static handle.
template <class Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  const std::string library = rope_ext_library_version();
  TORCH_CHECK(library == ROPE_EXT_VERSION, "rope_ext: these headers are version ", ROPE_EXT_VERSION,
              ", the librope_ext loaded is ", library, "; build and run against one release");
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// op.call(args...), with the library's errors given to C++ callers as LibTorch's own: c10::Error,
// or the rope_ext type the message's prefix names (rope_ext/errors.h), the prefix removed and the
// rest of the message unchanged. The library is built on torch's stable ABI, whose kernels raise
// std::runtime_error with the message alone.
template <class Signature, class... Args>
decltype(auto) call(const c10::TypedOperatorHandle<Signature>& op, Args&&... args) {
  try {
    return op.call(std::forward<Args>(args)...);
  } catch (const std::runtime_error& e) {
    const c10::SourceLocation at{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
    const std::string what = e.what();
    constexpr std::string_view outside = ROPE_EXT_POSITION_OUTSIDE_CACHE;
    if (what.compare(0, outside.size(), outside) == 0) throw PositionOutsideCache(at, what.substr(outside.size()));
    throw c10::Error(at, what);
  }
}

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

inline Tensor call_rotary(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved, bool conjugate) {
  static const auto op = op_handle<Tensor(const Tensor&, const Tensor&, const Tensor&, bool, bool)>("rope_ext::rotary");
  return detail::call(op, x, cos, sin, interleaved, conjugate);
}

inline std::tuple<Tensor, Tensor> call_rotary_qk(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                          bool interleaved, const std::optional<Tensor>& cos_k,
                                          const std::optional<Tensor>& sin_k, bool conjugate) {
  static const auto op = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool,
                                            const std::optional<Tensor>&, const std::optional<Tensor>&, bool)>("rope_ext::rotary_qk");
  return detail::call(op, q, k, cos, sin, interleaved, cos_k, sin_k, conjugate);
}

// The op functions with autograd, defined below: each backward calls them, so that its own
// graph is recorded when it runs under create_graph (double backward).
inline Tensor rotary_autograd(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved, bool conjugate);
inline std::tuple<Tensor, Tensor> rotary_qk_autograd(const Tensor& q, const Tensor& k, const Tensor& cos, const Tensor& sin,
                                              bool interleaved, const std::optional<Tensor>& cos_k,
                                              const std::optional<Tensor>& sin_k, bool conjugate);
inline Tensor rotary_pos_autograd(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                           bool interleaved, bool conjugate);
inline std::tuple<Tensor, Tensor> rotary_pos_qk_autograd(const Tensor& q, const Tensor& k, const Tensor& cos,
                                                  const Tensor& sin, const Tensor& positions, bool interleaved,
                                                  bool conjugate);

inline bool any_requires_grad(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (t->defined() && t->requires_grad()) return true;
  }
  return false;
}

// R(v) over v's whole last dim (rope_ext/reference.py's rotate).
inline Tensor rotate(const Tensor& v, bool interleaved) {
  if (interleaved) {
    const Tensor x1 = v.slice(-1, 0, c10::nullopt, 2);
    const Tensor x2 = v.slice(-1, 1, c10::nullopt, 2);
    return at::stack({x2.neg(), x1}, -1).flatten(-2);
  }
  const auto halves = v.chunk(2, -1);
  return at::cat({halves[1].neg(), halves[0]}, -1);
}

// (dcos, dsin) of one rotary call at cos's (broadcast) shape and dtype; undefined where not needed.
inline std::pair<Tensor, Tensor> table_grads(const Tensor& grad, const Tensor& x, const Tensor& cos, bool interleaved,
                                      bool conjugate, bool need_cos, bool need_sin) {
  const c10::SymInt r = cos.sym_size(-1);
  const auto dtype = at::promote_types(x.scalar_type(), cos.scalar_type());
  const Tensor g = grad.narrow_symint(-1, 0, r).to(dtype);
  const Tensor xr = x.narrow_symint(-1, 0, r).to(dtype);
  Tensor dcos, dsin;
  if (need_cos) dcos = at::sum_to(g * xr, cos.sym_sizes()).to(cos.scalar_type());
  if (need_sin) {
    const Tensor ds = conjugate ? rotate(g, interleaved) * xr : g * rotate(xr, interleaved);
    dsin = at::sum_to(ds, cos.sym_sizes()).to(cos.scalar_type());
  }
  return {dcos, dsin};
}

inline Tensor add_defined(const Tensor& a, const Tensor& b) {
  return !a.defined() ? b : !b.defined() ? a : a + b;
}

struct RotaryFunction : torch::autograd::Function<RotaryFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& cos, const Tensor& sin,
                        bool interleaved, bool conjugate) {
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["conjugate"] = conjugate;
    const bool tables_need_grad = cos.requires_grad() || sin.requires_grad();
    ctx->save_for_backward({cos, sin, tables_need_grad ? x : Tensor()});
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_rotary(x, cos, sin, interleaved, conjugate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &cos = saved[0], &sin = saved[1], &x = saved[2];
    const bool interleaved = ctx->saved_data["interleaved"].toBool();
    const bool conjugate = ctx->saved_data["conjugate"].toBool();
    const Tensor& g = grads[0];
    Tensor dx, dcos, dsin;
    if (ctx->needs_input_grad(0)) dx = rotary_autograd(g, cos, sin, interleaved, !conjugate);
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) {
      std::tie(dcos, dsin) =
          table_grads(g, x, cos, interleaved, conjugate, ctx->needs_input_grad(1), ctx->needs_input_grad(2));
    }
    return {dx, dcos, dsin, Tensor(), Tensor()};
  }
};

struct RotaryQKFunction : torch::autograd::Function<RotaryQKFunction> {
  // Tensor inputs, in the order of needs_input_grad: q, k, cos, sin, then cos_k, sin_k if given.
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& cos,
                               const Tensor& sin, bool interleaved, const std::optional<Tensor>& cos_k,
                               const std::optional<Tensor>& sin_k, bool conjugate) {
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["conjugate"] = conjugate;
    const Tensor ck = cos_k.value_or(Tensor()), sk = sin_k.value_or(Tensor());
    const bool q_tables = cos.requires_grad() || sin.requires_grad();
    const bool k_tables = ck.defined() ? (ck.requires_grad() || sk.requires_grad()) : q_tables;
    ctx->save_for_backward({cos, sin, ck, sk, q_tables ? q : Tensor(), k_tables ? k : Tensor()});
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [q_out, k_out] = call_rotary_qk(q, k, cos, sin, interleaved, cos_k, sin_k, conjugate);
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &cos = saved[0], &sin = saved[1], &cos_k = saved[2], &sin_k = saved[3];
    const Tensor &q = saved[4], &k = saved[5];
    const bool interleaved = ctx->saved_data["interleaved"].toBool();
    const bool conjugate = ctx->saved_data["conjugate"].toBool();
    const bool separate = cos_k.defined();
    const bool need_q = ctx->needs_input_grad(0), need_k = ctx->needs_input_grad(1);
    const bool need_cos = ctx->needs_input_grad(2), need_sin = ctx->needs_input_grad(3);
    const bool need_cos_k = separate && ctx->needs_input_grad(4);
    const bool need_sin_k = separate && ctx->needs_input_grad(5);
    const Tensor &gq = grads[0], &gk = grads[1];

    Tensor dq, dk, dcos, dsin, dcos_k, dsin_k;
    if (need_q || need_k) {
      const auto ok = [](const Tensor& t) { return std::optional<Tensor>(t.defined() ? t : Tensor()); };
      std::tie(dq, dk) = rotary_qk_autograd(gq, gk, cos, sin, interleaved, separate ? ok(cos_k) : std::nullopt,
                                        separate ? ok(sin_k) : std::nullopt, !conjugate);
    }
    if (need_cos || need_sin) {
      std::tie(dcos, dsin) = table_grads(gq, q, cos, interleaved, conjugate, need_cos, need_sin);
      if (!separate) {  // k shares q's tables: its contribution adds up
        auto [kc, ks] = table_grads(gk, k, cos, interleaved, conjugate, need_cos, need_sin);
        dcos = add_defined(dcos, kc);
        dsin = add_defined(dsin, ks);
      }
    }
    if (need_cos_k || need_sin_k) {
      std::tie(dcos_k, dsin_k) = table_grads(gk, k, cos_k, interleaved, conjugate, need_cos_k, need_sin_k);
    }
    return {need_q ? dq : Tensor(), need_k ? dk : Tensor(), dcos, dsin, Tensor(), dcos_k, dsin_k, Tensor()};
  }
};

inline Tensor call_rotary_pos(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                       bool interleaved, bool conjugate) {
  static const auto op = op_handle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool, bool)>("rope_ext::rotary_pos");
  return detail::call(op, x, cos, sin, positions, interleaved, conjugate);
}

inline std::tuple<Tensor, Tensor> call_rotary_pos_qk(const Tensor& q, const Tensor& k, const Tensor& cos,
                                              const Tensor& sin, const Tensor& positions, bool interleaved,
                                              bool conjugate) {
  static const auto op = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                               const Tensor&, const Tensor&, bool, bool)>("rope_ext::rotary_pos_qk");
  return detail::call(op, q, k, cos, sin, positions, interleaved, conjugate);
}

// The gradients of the half-width caches (P, r/2) of one rotary_pos call. Per pair i with members
// (a, b) the forward is o_a = x_a c - x_b s, o_b = x_b c + x_a s (s negated for the transpose), so
//   dc_i = g_a x_a + g_b x_b,   ds_i = g_b x_a - g_a x_b   (negated for the transpose),
// summed over the heads (the dims positions broadcast over) and scattered into the rows the
// positions name (accumulating: a position that repeats adds up). Undefined where not needed.
inline std::pair<Tensor, Tensor> cache_grads(const Tensor& grad, const Tensor& x, const Tensor& cos, const Tensor& positions,
                                      bool interleaved, bool conjugate, bool need_cos, bool need_sin) {
  const c10::SymInt half = cos.sym_size(1);
  const auto dtype = at::promote_types(x.scalar_type(), cos.scalar_type());
  const Tensor g = grad.narrow_symint(-1, 0, 2 * half).to(dtype);
  const Tensor xr = x.narrow_symint(-1, 0, 2 * half).to(dtype);
  const auto members = [&](const Tensor& v) -> std::pair<Tensor, Tensor> {
    if (interleaved) return {v.slice(-1, 0, c10::nullopt, 2), v.slice(-1, 1, c10::nullopt, 2)};
    return {v.narrow_symint(-1, 0, half), v.narrow_symint(-1, half, half)};
  };
  const auto [ga, gb] = members(g);
  const auto [xa, xb] = members(xr);
  // positions.shape + (r/2,): the per-token sums, one row per element of positions.
  std::vector<c10::SymInt> per_token(positions.sym_sizes().begin(), positions.sym_sizes().end());
  per_token.push_back(half);
  const Tensor index = positions.flatten();
  const auto scatter = [&](const Tensor& d) {
    const Tensor rows = at::sum_to(d, per_token).reshape_symint({index.sym_size(0), half});
    // new_zeros keeps the zeros the same kind of tensor as rows (a DTensor's too).
    const Tensor zeros = rows.new_zeros_symint(cos.sym_sizes());
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 12
    // Before torch 2.12, DTensor's rule for index_put (prop_index_put) lets the values keep a shard
    // of the indexed dim while it replicates the index, so rows sharded over tokens (positions
    // split with the sequence) fail with a shape mismatch. scatter_add's rule there shards only
    // dims other than the scattered one. The same sums, but on CUDA scatter_add adds with atomics
    // (the order of the sums varies), so only tensor subclasses (the Python key: DTensor) take it.
    if (rows.key_set().has(c10::DispatchKey::Python)) {
      return zeros.scatter_add(0, index.to(at::kLong).unsqueeze(1).expand_symint({index.sym_size(0), half}), rows)
          .to(cos.scalar_type());
    }
#endif
    // index_put with accumulate rather than index_add: the same sums (deterministic: sorted on CUDA),
    // and from torch 2.12 DTensor has a sharding rule for it that replicates the index and the
    // values' indexed dim.
    return at::index_put(zeros, {std::optional<Tensor>(index)}, rows, /*accumulate=*/true).to(cos.scalar_type());
  };
  Tensor dcos, dsin;
  if (need_cos) dcos = scatter(ga * xa + gb * xb);
  if (need_sin) dsin = scatter(conjugate ? ga * xb - gb * xa : gb * xa - ga * xb);
  return {dcos, dsin};
}

struct RotaryPosFunction : torch::autograd::Function<RotaryPosFunction> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& cos, const Tensor& sin,
                        const Tensor& positions, bool interleaved, bool conjugate) {
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["conjugate"] = conjugate;
    const bool caches_need_grad = cos.requires_grad() || sin.requires_grad();
    ctx->save_for_backward({cos, sin, positions, caches_need_grad ? x : Tensor()});
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_rotary_pos(x, cos, sin, positions, interleaved, conjugate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &cos = saved[0], &sin = saved[1], &positions = saved[2], &x = saved[3];
    const bool interleaved = ctx->saved_data["interleaved"].toBool();
    const bool conjugate = ctx->saved_data["conjugate"].toBool();
    const Tensor& g = grads[0];
    Tensor dx, dcos, dsin;
    if (ctx->needs_input_grad(0)) dx = rotary_pos_autograd(g, cos, sin, positions, interleaved, !conjugate);
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) {
      std::tie(dcos, dsin) = cache_grads(g, x, cos, positions, interleaved, conjugate, ctx->needs_input_grad(1),
                                         ctx->needs_input_grad(2));
    }
    return {dx, dcos, dsin, Tensor(), Tensor(), Tensor()};
  }
};

struct RotaryPosQKFunction : torch::autograd::Function<RotaryPosQKFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& cos,
                               const Tensor& sin, const Tensor& positions, bool interleaved, bool conjugate) {
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["conjugate"] = conjugate;
    const bool caches_need_grad = cos.requires_grad() || sin.requires_grad();
    ctx->save_for_backward({cos, sin, positions, caches_need_grad ? q : Tensor(), caches_need_grad ? k : Tensor()});
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [q_out, k_out] = call_rotary_pos_qk(q, k, cos, sin, positions, interleaved, conjugate);
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &cos = saved[0], &sin = saved[1], &positions = saved[2], &q = saved[3], &k = saved[4];
    const bool interleaved = ctx->saved_data["interleaved"].toBool();
    const bool conjugate = ctx->saved_data["conjugate"].toBool();
    const bool need_q = ctx->needs_input_grad(0), need_k = ctx->needs_input_grad(1);
    const bool need_cos = ctx->needs_input_grad(2), need_sin = ctx->needs_input_grad(3);
    const Tensor &gq = grads[0], &gk = grads[1];
    Tensor dq, dk, dcos, dsin;
    if (need_q || need_k) std::tie(dq, dk) = rotary_pos_qk_autograd(gq, gk, cos, sin, positions, interleaved, !conjugate);
    if (need_cos || need_sin) {
      std::tie(dcos, dsin) = cache_grads(gq, q, cos, positions, interleaved, conjugate, need_cos, need_sin);
      auto [kc, ks] = cache_grads(gk, k, cos, positions, interleaved, conjugate, need_cos, need_sin);
      dcos = add_defined(dcos, kc);
      dsin = add_defined(dsin, ks);
    }
    return {need_q ? dq : Tensor(), need_k ? dk : Tensor(), dcos, dsin, Tensor(), Tensor(), Tensor()};
  }
};

inline Tensor rotary_pos_autograd(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                           bool interleaved, bool conjugate) {
  if (!at::GradMode::is_enabled() || !any_requires_grad({&x, &cos, &sin})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_rotary_pos(x, cos, sin, positions, interleaved, conjugate);
  }
  return RotaryPosFunction::apply(x, cos, sin, positions, interleaved, conjugate);
}

inline std::tuple<Tensor, Tensor> rotary_pos_qk_autograd(const Tensor& q, const Tensor& k, const Tensor& cos,
                                                  const Tensor& sin, const Tensor& positions, bool interleaved,
                                                  bool conjugate) {
  if (!at::GradMode::is_enabled() || !any_requires_grad({&q, &k, &cos, &sin})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_rotary_pos_qk(q, k, cos, sin, positions, interleaved, conjugate);
  }
  const auto outs = RotaryPosQKFunction::apply(q, k, cos, sin, positions, interleaved, conjugate);
  return {outs[0], outs[1]};
}

// The in-place ops are for inference. Rather than record a wrong (or no) gradient, they refuse
// inputs that need one, and bump the rotated tensors' version counters so that a tensor saved for
// someone else's backward and then rotated in place raises autograd's "modified by an inplace
// operation".
inline void refuse_grad(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> inputs,
                 const char* out_of_place) {
  if (!at::GradMode::is_enabled()) return;
  for (const auto& [name, t] : inputs) {
    TORCH_CHECK(!(t->defined() && t->requires_grad()), op, ": ", name,
                " requires grad, but the in-place op records no gradient. Use ", out_of_place,
                " (out of place) for training, or call it under torch.no_grad() or "
                "torch.inference_mode() (in C++: at::NoGradGuard or c10::InferenceMode)");
  }
}

inline void bump(const Tensor& t) {
  if (t.defined() && !t.is_inference()) torch::autograd::impl::bump_version(t);
}

inline void rotary_pos_inplace_autograd(at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
                                 const at::Tensor& sin, const at::Tensor& positions, bool interleaved,
                                 bool conjugate) {
  const Tensor kt = k.value_or(Tensor());
  refuse_grad("rope_ext.rotary_pos_", {{"q", &q}, {"k", &kt}, {"cos_cache", &cos}, {"sin_cache", &sin}},
              "rope_ext.rotary_pos");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = op_handle<void(at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, bool, bool)>("rope_ext::rotary_pos_");
    detail::call(op, q, k, cos, sin, positions, interleaved, conjugate);
  }
  bump(q);
  bump(kt);
}

// Without a graph to record (no grad mode, or nothing requires grad) the op runs directly.
inline Tensor rotary_autograd(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved, bool conjugate) {
  if (!at::GradMode::is_enabled() || !any_requires_grad({&x, &cos, &sin})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_rotary(x, cos, sin, interleaved, conjugate);
  }
  return RotaryFunction::apply(x, cos, sin, interleaved, conjugate);
}

inline std::tuple<Tensor, Tensor> rotary_qk_autograd(const Tensor& q, const Tensor& k, const Tensor& cos,
                                              const Tensor& sin, bool interleaved,
                                              const std::optional<Tensor>& cos_k,
                                              const std::optional<Tensor>& sin_k, bool conjugate) {
  const Tensor ck = cos_k.value_or(Tensor()), sk = sin_k.value_or(Tensor());
  if (!at::GradMode::is_enabled() || !any_requires_grad({&q, &k, &cos, &sin, &ck, &sk})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_rotary_qk(q, k, cos, sin, interleaved, cos_k, sin_k, conjugate);
  }
  const auto outs = RotaryQKFunction::apply(q, k, cos, sin, interleaved, cos_k, sin_k, conjugate);
  return {outs[0], outs[1]};
}

inline void rotary_inplace_autograd(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                             bool interleaved, bool conjugate) {
  refuse_grad("rope_ext.rotary_", {{"x", &x}, {"cos", &cos}, {"sin", &sin}}, "rope_ext.rotary");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = op_handle<void(at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool)>("rope_ext::rotary_");
    detail::call(op, x, cos, sin, interleaved, conjugate);
  }
  bump(x);
}

}  // namespace detail
}  // namespace rope_ext


namespace rope_ext {

inline at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                         bool conjugate) {
  return detail::rotary_autograd(x, cos, sin, interleaved, conjugate);
}

inline std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                    const at::Tensor& sin, bool interleaved,
                                                    const std::optional<at::Tensor>& cos_k,
                                                    const std::optional<at::Tensor>& sin_k, bool conjugate) {
  return detail::rotary_qk_autograd(q, k, cos, sin, interleaved, cos_k, sin_k, conjugate);
}

inline void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved, bool conjugate) {
  detail::rotary_inplace_autograd(x, cos, sin, interleaved, conjugate);
}

inline at::Tensor rotary_pos(const at::Tensor& x, const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                             const at::Tensor& positions, bool interleaved, bool conjugate) {
  return detail::rotary_pos_autograd(x, cos_cache, sin_cache, positions, interleaved, conjugate);
}

inline std::tuple<at::Tensor, at::Tensor> rotary_pos_qk(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                                                        const at::Tensor& positions, bool interleaved,
                                                        bool conjugate) {
  return detail::rotary_pos_qk_autograd(q, k, cos_cache, sin_cache, positions, interleaved, conjugate);
}

inline void rotary_pos_(at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos_cache,
                        const at::Tensor& sin_cache, const at::Tensor& positions, bool interleaved, bool conjugate) {
  detail::rotary_pos_inplace_autograd(q, k, cos_cache, sin_cache, positions, interleaved, conjugate);
}

}  // namespace rope_ext
