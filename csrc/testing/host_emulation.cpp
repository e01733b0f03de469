// Runs the CUDA kernel's thread function (csrc/cuda/rotary_thread.h) on the CPU, over every block
// and thread of the launch choose_launch picks for the input: the GPU code path, tested where there
// is no GPU. The checks and the plan are librope_ext.so's own (rotary_plan.h), so these ops have
// the semantics of the real ones and the same tests and references apply.
//
// Every load and store of the thread function goes through EmulatedMemory here (the kernel's
// DeviceMemory is a plain dereference), which
//  - refuses any address not aligned to its access width: a GPU faults on a misaligned vector
//    access, x86 does not, so without this check the emulator would pass what a GPU cannot run;
//  - when recording (cuda_record_traffic), groups the accesses of each warp (32 consecutive threads
//    of a block in CUDA's linear order, tx + ty * block_x) by instruction instance (access site and
//    loop iteration) as a GPU coalesces them, and counts the bytes each instance needs against the
//    32-byte sectors it touches.
#include "testing/testing.h"

#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdio>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

#include "cuda/qk_norm_thread.h"
#include "cuda/rotary_thread.h"
#include "qk_norm_ops.h"
#include "rotary_ops.h"

namespace rope_ext::testing {
namespace {

using cuda::RotaryLaunch;

// Whether calls may use CompactIndex (as the CUDA launcher does wherever the layout allows);
// the tests turn it off to run every layout through PlanIndex too.
bool g_allow_compact = true;
// Whether launches take vector loads regardless of alignment (where the widths allow): only to show
// that EmulatedMemory's alignment check fires.
bool g_ignore_alignment = false;

cuda::CallLaunch plan(const RotaryCall& c) { return cuda::plan_call(c, g_allow_compact, g_ignore_alignment); }

constexpr int kSites = 2 * cuda::kSiteCount;  // rotate_row's and copy_row's sites exist once per operand
constexpr int64_t kSectorBytes = 32;
constexpr int64_t kMaxAccessBytes = 16;  // the widest load/store instruction of sm_80 to sm_90

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

// The traffic model's record: per access site, the bytes the warps' instructions needed (distinct
// bytes, so lanes reading one value count it once), the bytes of the 32-byte sectors they touched,
// and how many warp-level instructions that took; and the distinct sectors over the recording.
class TrafficRecorder {
 public:
  struct SiteTotals {
    int64_t needed = 0, sector_bytes = 0, instructions = 0, lane_accesses = 0;
  };

  void begin_thread(const cuda::ThreadCoord& g) {
    const int64_t tid = g.tx + g.ty * g.block_x;
    const std::tuple<int64_t, int64_t, int64_t> warp{g.bx, g.by, tid / 32};
    if (warp != warp_) flush();
    warp_ = warp;
    tx_ = g.tx;
    block_x_ = g.block_x;
  }

  // The token and item loops of the thread function: an instruction instance is a site within one
  // iteration of both (the item loop's iteration, not its item, which differs between lanes).
  void at_item(int64_t token, int64_t item) {
    token_ = token;
    iteration_ = (item - tx_) / block_x_;
    counts_.fill(0);
  }

  void record(int site, const void* p, int64_t bytes) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    const int count = counts_[site]++;  // the site's instance within this iteration (loops over j)
    for (int64_t off = 0; off < bytes; off += kMaxAccessBytes) {
      pending_.push_back({site, token_, iteration_, count, static_cast<int>(off / kMaxAccessBytes), a + off,
                          std::min(kMaxAccessBytes, bytes - off)});
    }
  }

  // Totals the current warp's instructions.
  void flush() {
    std::sort(pending_.begin(), pending_.end());
    for (size_t i = 0; i < pending_.size();) {
      size_t j = i;
      int64_t needed = 0, sectors = 0;
      uintptr_t covered = 0;  // bytes below this address are counted
      uintptr_t last_sector = UINTPTR_MAX;
      auto& unique = is_store(pending_[i].site) ? store_sectors_ : load_sectors_;
      for (; j < pending_.size() && pending_[j].same_instruction(pending_[i]); ++j) {
        const Access& x = pending_[j];
        const uintptr_t lo = std::max(covered, x.addr), hi = x.addr + x.bytes;
        if (hi > lo) needed += static_cast<int64_t>(hi - lo);
        covered = std::max(covered, hi);
        for (uintptr_t s = x.addr / kSectorBytes; s <= (hi - 1) / kSectorBytes; ++s) {
          if (last_sector != UINTPTR_MAX && s <= last_sector) continue;
          last_sector = s;
          ++sectors;
          unique.insert(s);
        }
      }
      SiteTotals& t = sites_[pending_[i].site];
      t.needed += needed;
      t.sector_bytes += sectors * kSectorBytes;
      t.instructions += 1;
      t.lane_accesses += static_cast<int64_t>(j - i);
      i = j;
    }
    pending_.clear();
  }

  const std::array<SiteTotals, kSites>& sites() const { return sites_; }
  int64_t unique_sector_bytes(bool store) const {
    return static_cast<int64_t>((store ? store_sectors_ : load_sectors_).size()) * kSectorBytes;
  }

 private:
  struct Access {
    int site;
    int64_t token, iteration;
    int count, chunk;
    uintptr_t addr;
    int64_t bytes;
    bool operator<(const Access& o) const {
      return std::tie(site, token, iteration, count, chunk, addr) <
             std::tie(o.site, o.token, o.iteration, o.count, o.chunk, o.addr);
    }
    bool same_instruction(const Access& o) const {
      return site == o.site && token == o.token && iteration == o.iteration && count == o.count && chunk == o.chunk;
    }
  };
  std::tuple<int64_t, int64_t, int64_t> warp_{-1, -1, -1};
  int64_t tx_ = 0, block_x_ = 1, token_ = 0, iteration_ = 0;
  std::array<int, kSites> counts_{};
  std::vector<Access> pending_;
  std::array<SiteTotals, kSites> sites_{};
  std::unordered_set<uintptr_t> load_sectors_, store_sectors_;
};

std::optional<TrafficRecorder> g_traffic;  // recording while set
int64_t g_checked_accesses = 0;          // accesses whose alignment EmulatedMemory checked
std::optional<std::vector<RotaryLaunch>> g_launches;  // the emulated launches, while recording them

template <class V>
void check_aligned(const V* p, int site) {
  ++g_checked_accesses;
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a % sizeof(V) == 0) return;
  char address[32];
  std::snprintf(address, sizeof(address), "0x%" PRIxPTR, a);
  ROPE_EXT_CHECK(false, "rope_ext CUDA emulation: misaligned ", sizeof(V), "-byte ", is_store(site) ? "store" : "load",
              " at ", address, " (", a % sizeof(V), " bytes past a ", sizeof(V), "-byte boundary), access site ",
              site_name(site), ": a GPU faults on it (cudaErrorMisalignedAddress); the launch chose a vector ",
              "width its pointers or strides do not allow");
}

// The emulator's memory policy for RotaryThread (rotary_thread.h).
struct EmulatedMemory {
  static void at_item(int64_t token, int64_t item) {
    if (g_traffic) g_traffic->at_item(token, item);
  }
  template <int kSite, class V>
  static V load(const V* p) {
    check_aligned(p, kSite);
    if (g_traffic) g_traffic->record(kSite, p, sizeof(V));
    return *p;
  }
  template <int kSite, class V>
  static void store(V* p, const V& v) {
    check_aligned(p, kSite);
    if (g_traffic) g_traffic->record(kSite, p, sizeof(V));
    *p = v;
  }
};

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

// qk_norm_rotary's kernels (qk_norm_thread.h) over their launch, as rotary_cuda.cu's run_norm_cuda
// launches them: per block, each iteration's reduce phase for every thread, then its write phase (the
// order the kernel's barriers give), then the fold; then the weights' gradient summed over the blocks.
void run_norm_emulated(const NormCall& c) {
  const cuda::NormCallLaunch cl = cuda::plan_norm_call(c, g_ignore_alignment);
  const cuda::NormLaunch& L = cl.launch;
  const cuda::NormScratch partial = cuda::norm_scratch(c, L);
  const auto each_thread = [&](int64_t bx, auto&& f) {
    for (int64_t ty = 0; ty < L.block_y; ++ty)
      for (int64_t tx = 0; tx < L.block_x; ++tx) {
        const cuda::ThreadCoord g{bx, 0, tx, ty, L.grid_x, 1, L.block_x, L.block_y};
        if (g_traffic) g_traffic->begin_thread(g);
        f(g);
      }
    if (g_traffic) g_traffic->flush();  // (the phases are different instructions, even within one warp)
  };
  if (L.groups > 0) {
    cuda::dispatch_norm_thread(c, L, [&]<class Thread>() {
      using Emulated = typename Thread::template WithMemory<EmulatedMemory>;
      using opmath_t = typename Thread::opmath_t;
      const Emulated t = Emulated::make(c, cl.plan, L, partial.weight, partial.bias);
      std::vector<opmath_t> shares(Emulated::kShares);
      for (int64_t bx = 0; bx < L.grid_x; ++bx) {
        const int64_t iterations = t.iterations({bx, 0, 0, 0, L.grid_x, 1, L.block_x, L.block_y});
        for (int64_t it = 0; it < iterations; ++it) {
          each_thread(bx, [&](const cuda::ThreadCoord& g) { t.reduce(g, it, shares.data()); });
          if (t.centers()) each_thread(bx, [&](const cuda::ThreadCoord& g) { t.center(g, it, shares.data()); });
          each_thread(bx, [&](const cuda::ThreadCoord& g) { t.write(g, it, shares.data()); });
        }
        each_thread(bx, [&](const cuda::ThreadCoord& g) { t.fold(g); });
      }
    });
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

// The emulated ops and the launch configurations, as CPU kernels of librope_ext_testing.so's
// schemas (testing_ops.cpp defines them).
STABLE_TORCH_LIBRARY_IMPL(rope_ext_testing, CPU, m) {
  rope_ext::register_rotary_ops<&rope_ext::testing::run_emulated>(m, "cuda_emulate_");
  rope_ext::register_qk_norm_ops<&rope_ext::testing::run_norm_emulated>(m, "cuda_emulate_");
  m.impl("cuda_launch_config", TORCH_BOX(&rope_ext::testing::launch_config));
  m.impl("cuda_qk_launch_config", TORCH_BOX(&rope_ext::testing::qk_launch_config));
  m.impl("cuda_pos_launch_config", TORCH_BOX(&rope_ext::testing::pos_launch_config));
  m.impl("cuda_norm_launch_config", TORCH_BOX(&rope_ext::testing::norm_launch_config));
}
