// Runs the CUDA kernel's thread function (csrc/cuda/rotary_thread.h) on the CPU, over every block
// and thread of the launch choose_launch picks for the input: the GPU code path, tested where there
// is no GPU. The checks and the plan are librope_ext.so's own (rotary_plan.h), so these ops have
// the semantics of the real ones and the same tests and references apply.
#include "testing/testing.h"

#include <optional>
#include <vector>

#include "cuda/rotary_thread.h"
#include "rotary_ops.h"

namespace rope_ext::testing {
namespace {

using cuda::RotaryLaunch;

// Whether gathered calls may use CompactIndex (as the CUDA launcher does wherever the layout allows);
// the tests turn it off to run every layout through PlanIndex too.
bool g_allow_compact = true;

cuda::CallLaunch plan(const RotaryCall& c) { return cuda::plan_call(c, g_allow_compact); }

void run_emulated(const RotaryCall& c) {
  if (c.out.numel() == 0 && (c.k_out == nullptr || c.k_out->numel() == 0)) return;
  const cuda::CallLaunch cl = plan(c);
  const RotaryLaunch& L = cl.launch;
  cuda::dispatch_thread(c, L, [&]<class Thread>() {
    const Thread t = Thread::make(c, cl);
    for (int64_t bx = 0; bx < L.grid_x; ++bx)
      for (int64_t by = 0; by < L.grid_y; ++by)
        for (int64_t ty = 0; ty < L.block_y; ++ty)
          for (int64_t tx = 0; tx < L.block_x; ++tx) t({bx, by, tx, ty, L.grid_x, L.grid_y, L.block_x, L.block_y});
  });
}

std::vector<int64_t> as_list(const RotaryLaunch& L) {
  return {L.grid_x,    L.grid_y,     L.block_x,   L.block_y, L.vec, L.pairs_per_item,
          L.rot_items, L.pass_items, L.table_vec, L.compact};
}

// [grid_x, grid_y, block_x, block_y, vec, pairs_per_item, rot_items, pass_items, table_vec, compact]
std::vector<int64_t> launch_config(const at::Tensor& x, const at::Tensor& cos,
                                   const at::Tensor& sin, bool interleaved) {
  check_rotary_args("rope_ext_testing.cuda_launch_config", x, cos, sin);
  at::Tensor out = at::empty_like(x);
  return as_list(plan({x, out, cos, sin, nullptr, nullptr, nullptr, interleaved}).launch);
}

// The same for rotary_pos_qk(q, k, ...) (k optional), out of place.
std::vector<int64_t> pos_launch_config(const at::Tensor& q, const std::optional<at::Tensor>& k,
                                       const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                                       const at::Tensor& positions, bool interleaved) {
  const char* op = "rope_ext_testing.cuda_pos_launch_config";
  check_rotary_pos_args(op, q, cos_cache, sin_cache, positions, "q");
  at::Tensor q_out = at::empty_like(q);
  if (!k.has_value()) {
    return as_list(plan({q, q_out, cos_cache, sin_cache, &positions, nullptr, nullptr, interleaved}).launch);
  }
  check_rotary_pos_args(op, *k, cos_cache, sin_cache, positions, "k");
  check_qk_args(op, q, *k, positions, "positions", 0);
  at::Tensor k_out = at::empty_like(*k);
  return as_list(
      plan({q, q_out, cos_cache, sin_cache, &positions, &*k, &k_out, interleaved}).launch);
}

}  // namespace

bool allow_compact_index(bool allow) {
  const bool previous = g_allow_compact;
  g_allow_compact = allow;
  return previous;
}

std::vector<int64_t> compact_token_offsets(int64_t t, int64_t inner, const std::vector<int64_t>& strides) {
  TORCH_CHECK(strides.size() == 6, "rope_ext_testing.cuda_compact_token_offsets: strides must hold 6 values ",
              "(x outer, x inner, out outer, out inner, positions outer, positions inner), got ", strides.size());
  TORCH_CHECK(t >= 0 && inner > 0, "rope_ext_testing.cuda_compact_token_offsets: needs t >= 0 and inner > 0, got t ",
              t, " and inner ", inner);
  cuda::CompactIndex ix;
  ix.inner = inner;
  ix.tok[0][0][0] = strides[0];
  ix.tok[0][0][1] = strides[1];
  ix.tok[0][1][0] = strides[2];
  ix.tok[0][1][1] = strides[3];
  ix.pos[0] = strides[4];
  ix.pos[1] = strides[5];
  int64_t off[4] = {};
  ix.token<0>(t, off);
  return {off[kX], off[kOut], off[kCos], off[kSin]};
}

void register_cuda_emulation(torch::Library& m) {
  using Ops = RotaryOps<&run_emulated>;
  m.impl("cuda_emulate_rotary", &Ops::rotary);
  m.impl("cuda_emulate_rotary_qk", &Ops::rotary_qk);
  m.impl("cuda_emulate_rotary_", &Ops::rotary_);
  m.impl("cuda_emulate_rotary_pos", &Ops::rotary_pos);
  m.impl("cuda_emulate_rotary_pos_qk", &Ops::rotary_pos_qk);
  m.impl("cuda_emulate_rotary_pos_", &Ops::rotary_pos_);
  m.impl("cuda_launch_config", &launch_config);
  m.impl("cuda_pos_launch_config", &pos_launch_config);

}

}  // namespace rope_ext::testing
