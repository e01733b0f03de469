// The probe's stable-ABI library (benchmarks/stable_abi_call.py): rotary_pos_qk's schema, whose
// kernel checks two things and allocates the two outputs, the two ways a stable library can.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <tuple>

using torch::stable::Tensor;

namespace {

// An output with x's sizes and strides (empty_like of a dense x), from the shim's C function:
// no dispatcher call.
Tensor empty_strided_like(const Tensor& x) {
  AtenTensorHandle h = x.get();
  int64_t ndim = 0;
  int64_t *sizes = nullptr, *strides = nullptr;
  int32_t dtype = 0, device_type = 0, device_index = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dim(h, &ndim));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(h, &sizes));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_strides(h, &strides));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(h, &dtype));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(h, &device_type));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(h, &device_index));
  AtenTensorHandle out = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(ndim, sizes, strides, dtype, device_type, device_index, &out));
  return Tensor(out);
}

void check(const Tensor& q, const Tensor& positions) {
  STD_TORCH_CHECK(q.dim() >= 1, "probe: q must have at least one dimension");
  STD_TORCH_CHECK(positions.dim() < q.dim(), "probe: positions must have fewer dims than q");
}

// torch::stable::empty_like: aten::empty_like called through the dispatcher by name.
std::tuple<Tensor, Tensor> by_dispatcher(Tensor q, Tensor k, Tensor, Tensor, Tensor positions, bool, bool) {
  check(q, positions);
  return {torch::stable::empty_like(q), torch::stable::empty_like(k)};
}

std::tuple<Tensor, Tensor> by_shim(Tensor q, Tensor k, Tensor, Tensor, Tensor positions, bool, bool) {
  check(q, positions);
  return {empty_strided_like(q), empty_strided_like(k)};
}

}  // namespace

STABLE_TORCH_LIBRARY(rope_probe_stable, m) {
  m.def("by_dispatcher(Tensor q, Tensor k, Tensor cos_cache, Tensor sin_cache, Tensor positions, "
        "bool interleaved=False, bool conjugate=False) -> (Tensor, Tensor)");
  m.def("by_shim(Tensor q, Tensor k, Tensor cos_cache, Tensor sin_cache, Tensor positions, "
        "bool interleaved=False, bool conjugate=False) -> (Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(rope_probe_stable, CPU, m) {
  m.impl("by_dispatcher", TORCH_BOX(&by_dispatcher));
  m.impl("by_shim", TORCH_BOX(&by_shim));
}
