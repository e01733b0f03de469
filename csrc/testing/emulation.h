// The CUDA emulator's parts that its two files share (host_emulation.cpp: the rotation's kernels,
// the launch and traffic records; host_emulation_qk_norm.cpp: qk_norm_rotary's kernels): the memory
// policy every emulated load and store goes through, the traffic model's recorder and the switches
// the tests set. The two files are compiled apart because the emulated kernels are the testing
// library's longest compiles (the sanitized build's above all), which one file made a serial tail
// of the build.
//
// Every load and store of the thread function goes through EmulatedMemory here (the kernel's
// DeviceMemory is a plain dereference), which
//  - refuses any address not aligned to its access width: a GPU faults on a misaligned vector
//    access, x86 does not, so without this check the emulator would pass what a GPU cannot run;
//  - when recording (cuda_record_traffic), groups the accesses of each warp (32 consecutive threads
//    of a block in CUDA's linear order, tx + ty * block_x) by instruction instance (access site and
//    loop iteration) as a GPU coalesces them, and counts the bytes each instance needs against the
//    32-byte sectors it touches.
#pragma once

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdio>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

#include "cuda/rotary_thread.h"
#include "rotary_ops.h"

namespace rope_ext::testing::emulation {

// Whether calls may use CompactIndex (as the CUDA launcher does wherever the layout allows);
// the tests turn it off to run every layout through PlanIndex too.
extern bool g_allow_compact;
// Whether launches take vector loads regardless of alignment (where the widths allow): only to show
// that EmulatedMemory's alignment check fires.
extern bool g_ignore_alignment;
extern int64_t g_checked_accesses;  // accesses whose alignment EmulatedMemory checked

constexpr int kSites = 2 * cuda::kSiteCount;  // rotate_row's and copy_row's sites exist once per operand
constexpr int64_t kSectorBytes = 32;
constexpr int64_t kMaxAccessBytes = 16;  // the widest load/store instruction of sm_80 to sm_90

const char* site_name(int site);
bool is_store(int site);

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

extern std::optional<TrafficRecorder> g_traffic;  // recording while set

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

// The emulator's memory policy for the thread functions (rotary_thread.h, qk_norm_thread.h).
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

}  // namespace rope_ext::testing::emulation
