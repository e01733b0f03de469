// How the dispatcher's boxed calls reach the rotary ops on torch's stable ABI. The stable ABI calls a
// kernel as fn(stack, num_args, num_outputs), the stack holding one StableIValue per argument (a
// tensor is an owned AtenTensorHandle) and receiving the outputs. torch's TORCH_BOX wraps every
// tensor in a torch::stable::Tensor, a shared_ptr (an allocation each), and hands each output back
// as a second handle (another): 11 allocations and frees on a decode call of rotary_pos_qk, about
// 0.2 us. boxed<fn> borrows the stack's handles for the call and frees them after, and puts the
// outputs' own handles on the stack. Its kernels take TensorRef (and std::optional<TensorRef>,
// bool, double) and return OwnedTensor, a tuple of them, or nothing.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/stableivalue_conversions.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "tensor_arg.h"

namespace rope_ext {

// A tensor argument: the stack's handle, borrowed for the call.
struct TensorRef {
  AtenTensorHandle handle;
};

// A new tensor, owned until boxed<fn> hands it to the caller's stack.
class OwnedTensor {
 public:
  explicit OwnedTensor(AtenTensorHandle h = nullptr) : h_(h) {}
  OwnedTensor(OwnedTensor&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  OwnedTensor& operator=(OwnedTensor&& o) noexcept {
    std::swap(h_, o.h_);
    return *this;
  }
  OwnedTensor(const OwnedTensor&) = delete;
  OwnedTensor& operator=(const OwnedTensor&) = delete;
  ~OwnedTensor() {
    if (h_ != nullptr) aoti_torch_delete_tensor_object(h_);
  }
  AtenTensorHandle get() const { return h_; }
  AtenTensorHandle release() { return std::exchange(h_, nullptr); }

 private:
  AtenTensorHandle h_;
};

namespace detail {

// The input handles of one call, freed when it returns or throws.
struct Borrowed {
  AtenTensorHandle handles[10] = {};
  int n = 0;
  AtenTensorHandle keep(AtenTensorHandle h) {
    if (h != nullptr) handles[n++] = h;
    return h;
  }
  ~Borrowed() {
    for (int i = 0; i < n; ++i) aoti_torch_delete_tensor_object(handles[i]);
  }
};

template <class T>
struct Arg;
template <>
struct Arg<TensorRef> {
  static TensorRef read(StableIValue v, Borrowed& b) {
    return {b.keep(torch::stable::detail::to<AtenTensorHandle>(v))};
  }
};
template <>
struct Arg<std::optional<TensorRef>> {
  static std::optional<TensorRef> read(StableIValue v, Borrowed& b) {
    const std::optional<AtenTensorHandle> h = torch::stable::detail::to<std::optional<AtenTensorHandle>>(v);
    if (!h.has_value()) return std::nullopt;
    return TensorRef{b.keep(*h)};
  }
};
template <>
struct Arg<bool> {
  static bool read(StableIValue v, Borrowed&) { return torch::stable::detail::to<bool>(v); }
};
template <>
struct Arg<double> {
  static double read(StableIValue v, Borrowed&) { return torch::stable::detail::to<double>(v); }
};

template <class R>
struct Outputs {
  static constexpr uint64_t kCount = std::is_void_v<R> ? 0 : 1;
};
template <class... T>
struct Outputs<std::tuple<T...>> {
  static constexpr uint64_t kCount = sizeof...(T);
};
template <class T>
constexpr int kTensorArgs = std::is_same_v<T, TensorRef> || std::is_same_v<T, std::optional<TensorRef>> ? 1 : 0;

template <class R>
void put(StableIValue* stack, R&& r) {
  if constexpr (std::is_same_v<std::decay_t<R>, OwnedTensor>) {
    stack[0] = torch::stable::detail::from(r.release());
  } else {
    std::apply([stack](auto&... t) {
      int i = 0;
      ((stack[i++] = torch::stable::detail::from(t.release())), ...);
    }, r);
  }
}

template <class F>
struct Boxer;
template <class R, class... Args>
struct Boxer<R (*)(Args...)> {
  static constexpr size_t kArgs = sizeof...(Args);
  template <R (*fn)(Args...), size_t... I>
  static void call(StableIValue* stack, uint64_t num_args, uint64_t num_outputs, std::index_sequence<I...>) {
    constexpr uint64_t kOutputs = Outputs<R>::kCount;
    static_assert((0 + ... + kTensorArgs<std::decay_t<Args>>) <= sizeof(Borrowed::handles) / sizeof(AtenTensorHandle),
                  "more tensors than Borrowed holds");
    Borrowed borrowed;
    // (a braced list: the arguments are read in order, and each read handle is kept before the next)
    std::tuple<std::decay_t<Args>...> args{Arg<std::decay_t<Args>>::read(stack[I], borrowed)...};
    ROPE_EXT_CHECK(num_args == sizeof...(Args) && num_outputs == kOutputs, "rope_ext internal error: a schema of ",
                   num_args, " arguments and ", num_outputs, " outputs for a kernel of ", sizeof...(Args), " and ",
                   kOutputs);
    if constexpr (std::is_void_v<R>) {
      std::apply(fn, args);
    } else {
      put(stack, std::apply(fn, args));
    }
  }
};

}  // namespace detail

// fn as a stable-ABI boxed kernel (for StableLibrary::impl).
template <auto fn>
void boxed(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  using F = decltype(fn);
  detail::Boxer<F>::template call<fn>(stack, num_args, num_outputs, std::make_index_sequence<detail::Boxer<F>::kArgs>{});
}

}  // namespace rope_ext
