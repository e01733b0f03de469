// The probe's library on libtorch's C++ API (benchmarks/stable_abi_call.py): the same kernel as
// stable.cpp's, registered unboxed, as librope_ext.so's ops are today.
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <tuple>

namespace {

std::tuple<at::Tensor, at::Tensor> unboxed(const at::Tensor& q, const at::Tensor& k, const at::Tensor&,
                                           const at::Tensor&, const at::Tensor& positions, bool, bool) {
  TORCH_CHECK(q.dim() >= 1, "probe: q must have at least one dimension");
  TORCH_CHECK(positions.dim() < q.dim(), "probe: positions must have fewer dims than q");
  return {at::empty_like(q), at::empty_like(k)};
}

}  // namespace

TORCH_LIBRARY(rope_probe_unstable, m) {
  m.def("unboxed(Tensor q, Tensor k, Tensor cos_cache, Tensor sin_cache, Tensor positions, "
        "bool interleaved=False, bool conjugate=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(rope_probe_unstable, CPU, m) { m.impl("unboxed", &unboxed); }
