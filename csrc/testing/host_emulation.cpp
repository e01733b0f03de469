// Runs the CUDA kernel's thread function (csrc/cuda/rotary_thread.h) on the CPU, over every block
// and thread of the launch choose_launch picks for the input: the GPU code path, tested where there
// is no GPU. The checks and the plan are librope_ext.so's own (rotary_plan.h), so these ops have
// the semantics of the real ones and the same tests and references apply. qk_norm_rotary's kernels
// are emulated in host_emulation_qk_norm.cpp; the memory policy and the traffic model both use are
// in emulation.h.
#include "testing/testing.h"

#include <torch/csrc/stable/library.h>

#include "testing/emulation.h"

namespace rope_ext::testing {

namespace emulation {

bool g_allow_compact = true;
bool g_ignore_alignment = false;
int64_t g_checked_accesses = 0;
std::optional<TrafficRecorder> g_traffic;

const char* site_name(int site) {
  static constexpr const char* kNames[cuda::kSiteCount] = {
      "position", "cos1",      "sin1",      "cos2",       "sin2",       "x1",          "x2",
      "out1",     "out2",      "pass_in",   "pass_out",   "weight1",    "weight2",     "grad1",
      "grad2",    "rstd_in",   "rstd_out",  "partial_in1", "partial_in2", "partial_out1", "partial_out2",
      "dweight",  "bias1",     "bias2"};
  static const auto names = [] {
    std::array<std::string, kSites> n;
    for (int s = 0; s < kSites; ++s) {
      n[s] = std::string(s < cuda::kSiteCount ? "q." : "k.") + kNames[s % cuda::kSiteCount];
    }
    return n;
  }();
  return names[site].c_str();
}

bool is_store(int site) {
  const int s = site % cuda::kSiteCount;
  return s == cuda::kSiteOut1 || s == cuda::kSiteOut2 || s == cuda::kSitePassStore || s == cuda::kSiteRstdStore ||
         s == cuda::kSitePartialStore1 || s == cuda::kSitePartialStore2 || s == cuda::kSiteWeightGrad;
}

}  // namespace emulation

namespace {

using cuda::RotaryLaunch;
using namespace emulation;

cuda::CallLaunch plan(const RotaryCall& c) { return cuda::plan_call(c, g_allow_compact, g_ignore_alignment); }

std::optional<std::vector<RotaryLaunch>> g_launches;  // the emulated launches, while recording them

void run_emulated(const RotaryCall& c) {
  if (c.out.numel() == 0 && (c.k_out == nullptr || c.k_out->numel() == 0)) return;
  const cuda::CallLaunch cl = plan(c);
  const RotaryLaunch& L = cl.launch;
  if (g_launches) g_launches->push_back(L);
  cuda::dispatch_thread(c, L, [&]<class Thread>() {
    using Emulated = typename Thread::template WithMemory<EmulatedMemory>;
    const Emulated t = Emulated::make(c, cl);
    for (int64_t bx = 0; bx < L.grid_x; ++bx)
      for (int64_t by = 0; by < L.grid_y; ++by)
        for (int64_t ty = 0; ty < L.block_y; ++ty)
          for (int64_t tx = 0; tx < L.block_x; ++tx) {
            const cuda::ThreadCoord g{bx, by, tx, ty, L.grid_x, L.grid_y, L.block_x, L.block_y};
            if (g_traffic) g_traffic->begin_thread(g);
            t(g);
          }
    if (g_traffic) g_traffic->flush();
  });
}

std::vector<int64_t> as_list(const RotaryLaunch& L) {
  return {L.grid_x,    L.grid_y,     L.block_x,   L.block_y, L.vec, L.pairs_per_item,
          L.rot_items, L.pass_items, L.table_vec, L.compact};
}

// [grid_x, grid_y, block_x, block_y, vec, pairs_per_item, rot_items, pass_items, table_vec, compact]
// (Each allocates the outputs the op would, whose addresses the launch's vector widths depend on.)
std::vector<int64_t> launch_config(const StableTensor& x_, const StableTensor& cos_, const StableTensor& sin_,
                                   bool interleaved) {
  const TensorArg x = read_arg(x_), cos = read_arg(cos_), sin = read_arg(sin_);
  check_rotary_args("rope_ext_testing.cuda_launch_config", x, cos, sin);
  const Output out = new_like(x_.get(), x);
  return as_list(plan({x, out.arg, cos, sin, nullptr, nullptr, nullptr, interleaved}).launch);
}

// The launches of rotary_qk(q, k, cos, sin) with shared tables, out of place, 10 values each: one
// covering q's heads and then k's, or one per tensor where rotary_qk_one_call says so (their head
// dims differ).
std::vector<int64_t> qk_launch_config(const StableTensor& q_, const StableTensor& k_, const StableTensor& cos_,
                                      const StableTensor& sin_, bool interleaved) {
  const char* op = "rope_ext_testing.cuda_qk_launch_config";
  const TensorArg q = read_arg(q_), k = read_arg(k_), cos = read_arg(cos_), sin = read_arg(sin_);
  check_rotary_args(op, q, cos, sin, {"q", "cos", "sin"});
  check_rotary_args(op, k, cos, sin, {"k", "cos", "sin"});
  check_qk_args(op, q, k, cos);
  const Output q_out = new_like(q_.get(), q), k_out = new_like(k_.get(), k);
  if (rotary_qk_one_call(q, k, false)) {
    return as_list(plan({q, q_out.arg, cos, sin, nullptr, &k, &k_out.arg, interleaved}).launch);
  }
  std::vector<int64_t> r = as_list(plan({q, q_out.arg, cos, sin, nullptr, nullptr, nullptr, interleaved}).launch);
  const std::vector<int64_t> second =
      as_list(plan({k, k_out.arg, cos, sin, nullptr, nullptr, nullptr, interleaved}).launch);
  r.insert(r.end(), second.begin(), second.end());
  return r;
}

// The same for rotary_pos_qk(q, k, ...) (k optional), out of place.
std::vector<int64_t> pos_launch_config(const StableTensor& q_, const std::optional<StableTensor>& k_,
                                       const StableTensor& cos_cache_, const StableTensor& sin_cache_,
                                       const StableTensor& positions_, bool interleaved) {
  const char* op = "rope_ext_testing.cuda_pos_launch_config";
  const TensorArg q = read_arg(q_), cos_cache = read_arg(cos_cache_), sin_cache = read_arg(sin_cache_);
  const TensorArg positions = read_arg(positions_);
  check_rotary_pos_args(op, q, cos_cache, sin_cache, positions, "q");
  const Output q_out = new_like(q_.get(), q);
  if (!k_.has_value()) {
    return as_list(plan({q, q_out.arg, cos_cache, sin_cache, &positions, nullptr, nullptr, interleaved}).launch);
  }
  const TensorArg k = read_arg(*k_);
  check_rotary_pos_args(op, k, cos_cache, sin_cache, positions, "k");
  check_qk_args(op, q, k, positions, "positions", 0);
  const Output k_out = new_like(k_->get(), k);
  return as_list(plan({q, q_out.arg, cos_cache, sin_cache, &positions, &k, &k_out.arg, interleaved}).launch);
}

}  // namespace

bool allow_compact_index(bool allow) {
  const bool previous = g_allow_compact;
  g_allow_compact = allow;
  return previous;
}

bool ignore_alignment(bool ignore) {
  const bool previous = g_ignore_alignment;
  g_ignore_alignment = ignore;
  return previous;
}

int64_t checked_accesses() { return g_checked_accesses; }

bool record_launches(bool on) {
  const bool previous = g_launches.has_value();
  if (on) {
    g_launches.emplace();
  } else {
    g_launches.reset();
  }
  return previous;
}

std::vector<int64_t> launches() {
  ROPE_EXT_CHECK(g_launches.has_value(), "rope_ext_testing.cuda_launches: not recording; call ",
              "cuda_record_launches(True) before the emulated ops");
  std::vector<int64_t> r;
  for (const RotaryLaunch& L : *g_launches) {
    const std::vector<int64_t> one = as_list(L);
    r.insert(r.end(), one.begin(), one.end());
  }
  return r;
}

bool record_traffic(bool on) {
  const bool previous = g_traffic.has_value();
  if (on) {
    g_traffic.emplace();
  } else {
    g_traffic.reset();
  }
  return previous;
}

std::vector<int64_t> traffic() {
  ROPE_EXT_CHECK(g_traffic.has_value(), "rope_ext_testing.cuda_traffic: not recording; call cuda_record_traffic(True) ",
              "before the emulated ops");
  std::vector<int64_t> r(10, 0);
  for (int s = 0; s < kSites; ++s) {
    const auto& t = g_traffic->sites()[s];
    const int base = is_store(s) ? 1 : 0;
    r[0 + 2 * base] += t.needed;
    r[1 + 2 * base] += t.sector_bytes;
    r[6 + base] += t.instructions;
    r[8 + base] += t.lane_accesses;
  }
  r[4] = g_traffic->unique_sector_bytes(false);
  r[5] = g_traffic->unique_sector_bytes(true);
  return r;
}

std::tuple<std::vector<std::string>, std::vector<int64_t>> traffic_by_site() {
  ROPE_EXT_CHECK(g_traffic.has_value(), "rope_ext_testing.cuda_traffic_by_site: not recording; call ",
              "cuda_record_traffic(True) before the emulated ops");
  std::vector<std::string> names;
  std::vector<int64_t> totals;
  for (int s = 0; s < kSites; ++s) {
    const auto& t = g_traffic->sites()[s];
    if (t.instructions == 0) continue;
    names.emplace_back(site_name(s));
    totals.insert(totals.end(), {t.needed, t.sector_bytes, t.instructions});
  }
  return {names, totals};
}

std::vector<int64_t> compact_token_offsets(int64_t t, int64_t inner, const std::vector<int64_t>& strides) {
  ROPE_EXT_CHECK(strides.size() == 6, "rope_ext_testing.cuda_compact_token_offsets: strides must hold 6 values ",
              "(x outer, x inner, out outer, out inner, positions outer, positions inner), got ", strides.size());
  ROPE_EXT_CHECK(t >= 0 && inner > 0, "rope_ext_testing.cuda_compact_token_offsets: needs t >= 0 and inner > 0, got t ",
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

}  // namespace rope_ext::testing

// The emulated rotation ops and the launch configurations, as CPU kernels of librope_ext_testing.so's
// schemas (testing_ops.cpp defines them).
STABLE_TORCH_LIBRARY_IMPL(rope_ext_testing, CPU, m) {
  rope_ext::register_rotary_ops<&rope_ext::testing::run_emulated>(m, "cuda_emulate_");
  m.impl("cuda_launch_config", TORCH_BOX(&rope_ext::testing::launch_config));
  m.impl("cuda_qk_launch_config", TORCH_BOX(&rope_ext::testing::qk_launch_config));
  m.impl("cuda_pos_launch_config", TORCH_BOX(&rope_ext::testing::pos_launch_config));
}
