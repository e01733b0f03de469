// The C++ API's op functions (include/rope_ext/rope.h), cos_sin_tables among them: calls through
// the dispatcher, so that autograd, the device's kernels and any tracing see the same ops as
// Python's rope_ext.
#include <ATen/core/dispatch/Dispatcher.h>

#include "rope_ext/rope.h"

namespace rope_ext {
namespace {

template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                  bool conjugate) {
  static const auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool)>("rope_ext::rotary");
  return handle.call(x, cos, sin, interleaved, conjugate);
}

std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                             const at::Tensor& sin, bool interleaved,
                                             const std::optional<at::Tensor>& cos_k,
                                             const std::optional<at::Tensor>& sin_k, bool conjugate) {
  static const auto handle =
      op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, bool, const std::optional<at::Tensor>&,
                                            const std::optional<at::Tensor>&, bool)>("rope_ext::rotary_qk");
  return handle.call(q, k, cos, sin, interleaved, cos_k, sin_k, conjugate);
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved, bool conjugate) {
  static const auto handle =
      op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool)>("rope_ext::rotary_");
  handle.call(x, cos, sin, interleaved, conjugate);
}

at::Tensor rotary_pos(const at::Tensor& x, const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                      const at::Tensor& positions, bool interleaved, bool conjugate) {
  static const auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool)>(
          "rope_ext::rotary_pos");
  return handle.call(x, cos_cache, sin_cache, positions, interleaved, conjugate);
}

std::tuple<at::Tensor, at::Tensor> rotary_pos_qk(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                                                 const at::Tensor& positions, bool interleaved, bool conjugate) {
  static const auto handle = op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool)>(
      "rope_ext::rotary_pos_qk");
  return handle.call(q, k, cos_cache, sin_cache, positions, interleaved, conjugate);
}

void rotary_pos_(at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos_cache,
                 const at::Tensor& sin_cache, const at::Tensor& positions, bool interleaved, bool conjugate) {
  static const auto handle =
      op<void(at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              bool, bool)>("rope_ext::rotary_pos_");
  handle.call(q, k, cos_cache, sin_cache, positions, interleaved, conjugate);
}

std::tuple<at::Tensor, at::Tensor> cos_sin_tables(const at::Tensor& positions, const at::Tensor& inv_freq,
                                                  bool interleaved, double scale, at::ScalarType dtype) {
  static const auto handle =
      op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, bool, double,
                                            std::optional<at::ScalarType>)>("rope_ext::cos_sin_tables");
  // The value check needs the data (a device sync), so the API makes it and the op does not:
  // the op is also traced by torch.compile, where positions have no values.
  const at::ScalarType t = positions.scalar_type();
  if (positions.numel() && at::isIntegralType(t, /*includeBool=*/false)) {
    const int64_t least = positions.min().item<int64_t>();
    TORCH_CHECK(least >= 0, "rope_ext.cos_sin_tables: positions must be >= 0, got a minimum of ", least);
  }
  return handle.call(positions, inv_freq, interleaved, scale, dtype);
}

}  // namespace rope_ext
