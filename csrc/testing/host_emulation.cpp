// Runs the CUDA kernel's thread function (csrc/cuda/rotary_thread.h) on the CPU, over every block
// and thread of the launch choose_launch picks for the input: the GPU code path, tested where there
// is no GPU. The checks and the plan are librope_ext.so's own (rotary_plan.h), so these ops have
// the semantics of the real ones and the same tests and references apply.
#include "testing/testing.h"

#include <vector>

#include "cuda/rotary_thread.h"
#include "rotary_ops.h"

namespace rope_ext::testing {
namespace {

using cuda::RotaryLaunch;

void run_emulated(const at::Tensor& x, at::Tensor& out, const at::Tensor& cos,
                  const at::Tensor& sin, bool interleaved, bool conjugate) {
  if (out.numel() == 0) return;
  const RotaryPlan plan = make_rotary_plan(x, out, cos, sin);
  const RotaryLaunch L =
      cuda::choose_launch(plan, x.element_size(), interleaved, x.const_data_ptr(), out.const_data_ptr());
  cuda::dispatch_thread(x, cos, conjugate, interleaved, L.vec, [&]<class Thread>() {
    const Thread t = Thread::make(plan, x, out, cos, sin);
    for (int64_t bx = 0; bx < L.grid_x; ++bx)
      for (int64_t by = 0; by < L.grid_y; ++by)
        for (int64_t ty = 0; ty < L.block_y; ++ty)
          for (int64_t tx = 0; tx < L.block_x; ++tx) t(bx, by, tx, ty, L);
  });
}

// [grid_x, grid_y, block_x, block_y, vec, pairs_per_item, rot_items, pass_items]
std::vector<int64_t> launch_config(const at::Tensor& x, const at::Tensor& cos,
                                   const at::Tensor& sin, bool interleaved) {
  check_rotary_args("rope_ext_testing.cuda_launch_config", x, cos, sin);
  const at::Tensor out = at::empty_like(x);
  const RotaryLaunch L = cuda::choose_launch(make_rotary_plan(x, out, cos, sin), x.element_size(),
                                             interleaved, x.const_data_ptr(), out.const_data_ptr());
  return {L.grid_x, L.grid_y, L.block_x, L.block_y, L.vec, L.pairs_per_item, L.rot_items, L.pass_items};
}

}  // namespace

void register_cuda_emulation(torch::Library& m) {
  using Ops = RotaryOps<&run_emulated>;
  m.impl("cuda_emulate_rotary", &Ops::rotary);
  m.impl("cuda_emulate_rotary_qk", &Ops::rotary_qk);
  m.impl("cuda_emulate_rotary_", &Ops::rotary_);
  m.impl("cuda_launch_config", &launch_config);
}

}  // namespace rope_ext::testing
