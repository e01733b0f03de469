// Runs the CUDA kernel's thread function (rotary_thread.h) on the CPU, over every block and
// thread of the launch choose_launch picks for the input: the GPU code path, tested where
// there is no GPU. Registered as test hooks (rope_ext::_cuda_emulate_*) with the semantics of
// the real ops, so the same tests and references apply.
#include <torch/library.h>

#include <vector>

#include "cuda/rotary_thread.h"
#include "registration.h"
#include "rotary_ops.h"

namespace rope_ext::cuda {
namespace {

void run_emulated(const at::Tensor& x, at::Tensor& out, const at::Tensor& cos,
                  const at::Tensor& sin, bool interleaved, bool conjugate) {
  if (out.numel() == 0) return;
  const RotaryPlan plan = make_rotary_plan(x, out, cos, sin);
  const RotaryLaunch L =
      choose_launch(plan, x.element_size(), interleaved, x.const_data_ptr(), out.const_data_ptr());
  dispatch_thread(x, cos, conjugate, interleaved, L.vec, [&]<class Thread>() {
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
  check_rotary_args("rope_ext._cuda_launch_config", x, cos, sin);
  const at::Tensor out = at::empty_like(x);
  const RotaryLaunch L = choose_launch(make_rotary_plan(x, out, cos, sin), x.element_size(),
                                       interleaved, x.const_data_ptr(), out.const_data_ptr());
  return {L.grid_x, L.grid_y, L.block_x, L.block_y, L.vec, L.pairs_per_item, L.rot_items, L.pass_items};
}

}  // namespace
}  // namespace rope_ext::cuda

void rope_ext::register_cuda_emulation(torch::Library& m) {
  using Ops = RotaryOps<&cuda::run_emulated>;
  m.impl("_cuda_emulate_rotary", &Ops::rotary);
  m.impl("_cuda_emulate_rotary_qk", &Ops::rotary_qk);
  m.impl("_cuda_emulate_rotary_", &Ops::rotary_);
  m.impl("_cuda_launch_config", &cuda::launch_config);
}
