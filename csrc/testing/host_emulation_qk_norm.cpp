// Runs qk_norm_rotary's CUDA kernels (csrc/cuda/qk_norm_thread.h) on the CPU, over every block and
// thread of the launch plan_norm_call picks, through the memory policy and traffic model of
// emulation.h: host_emulation.cpp's counterpart for the QK-norm ops, compiled apart from it (and
// its backward's threads apart again: host_emulation_qk_norm_backward.cpp).
#include "testing/testing.h"

#include <torch/csrc/stable/library.h>

#include "qk_norm_ops.h"
#include "testing/emulated_norm.h"

namespace rope_ext::testing {

namespace emulation {
template void emulate_norm_threads<false>(const NormCall&, const cuda::NormCallLaunch&, const cuda::NormScratch&);
}  // namespace emulation

namespace {

using namespace emulation;

// qk_norm_rotary's kernels (qk_norm_thread.h) over their launch, as rotary_cuda.cu's run_norm_cuda
// launches them: the thread functions (emulated_norm.h: the forward's here, the backward's in
// host_emulation_qk_norm_backward.cpp), then the weights' gradient summed over the blocks.
void run_norm_emulated(const NormCall& c) {
  const cuda::NormCallLaunch cl = cuda::plan_norm_call(c, g_ignore_alignment);
  const cuda::NormScratch partial = cuda::norm_scratch(c, cl.launch);
  if (c.grad != nullptr) {
    emulate_norm_threads<true>(c, cl, partial);
  } else {
    emulate_norm_threads<false>(c, cl, partial);
  }
  cuda::dispatch_weight_grad_sum(c, cl, partial, [&](const auto& sum, int64_t grid) {
    const auto t = sum.template with_memory<EmulatedMemory>();
    const int64_t block = cuda::kMaxThreads;
    for (int64_t bx = 0; bx < grid; ++bx)
      for (int64_t tx = 0; tx < block; ++tx) {
        const cuda::ThreadCoord g{bx, 0, tx, 0, grid, 1, block, 1};
        if (g_traffic) g_traffic->begin_thread(g);
        t(g);
      }
    if (g_traffic) g_traffic->flush();
  });
}

// qk_norm_rotary's launch for x (the forward, or the backward with x as its gradient):
// [grid_x, block_x, block_y, groups, vec, pairs_per_item, rot_items, pass_items, group_items,
//  partial_rows, table_vec, weight_vec]
std::vector<int64_t> norm_launch_config(const StableTensor& x_, const std::optional<StableTensor>& weight_,
                                        const StableTensor& cos_, const StableTensor& sin_,
                                        const std::optional<StableTensor>& positions_, bool across_heads,
                                        bool interleaved, bool backward) {
  const char* op = "rope_ext_testing.cuda_norm_launch_config";
  const TensorArg x = read_arg(x_), cos = read_arg(cos_), sin = read_arg(sin_);
  const TensorArg w = weight_ ? read_arg(*weight_) : TensorArg{};
  const TensorArg pos = positions_ ? read_arg(*positions_) : TensorArg{};
  const TensorArg* positions = positions_ ? &pos : nullptr;
  check_qk_norm_args(op, x, {&w, nullptr}, cos, sin, positions, 0.0, 0.0, across_heads, "x");
  const ScalarType stat = x.scalar_type() == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  const Output out = new_like(x_.get(), x);
  const std::vector<int64_t> shape = norm_stat_shape(x, across_heads, false);
  const Output rstd = new_contiguous(Dims{shape.data(), static_cast<int64_t>(shape.size())}, stat, x.device());
  const int64_t n = w.defined() ? w.size(0) : 0;
  const Output dweight = new_contiguous(Dims{&n, 1}, stat, x.device());
  const NormCall c{x,   out.arg, &w, cos, sin, &rstd.arg, positions, backward ? &x : nullptr,
                   backward && w.defined() ? &dweight.arg : nullptr, 0.0, 0.0, across_heads, interleaved, op};
  const cuda::NormLaunch L = cuda::plan_norm_call(c, g_ignore_alignment).launch;
  return {L.grid_x,    L.block_x,    L.block_y,     L.groups,       L.vec,       L.pairs_per_item,
          L.rot_items, L.pass_items, L.group_items, L.partial_rows, L.table_vec, L.weight_vec};
}

}  // namespace
}  // namespace rope_ext::testing

// The emulated QK-norm ops and their launch configuration, as CPU kernels of librope_ext_testing.so's
// schemas (testing_ops.cpp defines them).
STABLE_TORCH_LIBRARY_IMPL(rope_ext_testing, CPU, m) {
  rope_ext::register_qk_norm_ops<&rope_ext::testing::run_norm_emulated>(m, "cuda_emulate_");
  m.impl("cuda_norm_launch_config", TORCH_BOX(&rope_ext::testing::norm_launch_config));
}
