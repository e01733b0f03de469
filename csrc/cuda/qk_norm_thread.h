// The CUDA kernels of qk_norm_rotary, forward and backward: their per-thread work and launch, with
// no CUDA runtime dependency. A sibling of rotary_thread.h, whose row loads and stores (load_pairs,
// store_pairs, load_run), memory policy, access sites and position check it uses, and
// rotary_math.h's rotate_pair: nvcc compiles it into the kernels (rotary_cuda.cu), the host
// compiler into the emulator (csrc/testing/host_emulation.cpp).
//
// A group is what one statistic covers: one head (norm_over="head"), or a token's `group` heads
// (across heads). One row of a block's threads (threadIdx.y) takes a group; its threads
// (threadIdx.x) take the group's items, tx, tx + block_x, ...: an item is a vector of pairs of one
// head, or of its pass-through columns, as in the rotation's launch. Qwen3's heads of 128 bfloat16
// values are 8 items of 16 bytes (16 of 8 bytes with float32 tables), so a block of 256 threads takes
// 32 heads (16); a Wan 14B row across its 40 heads (5,120 values, 640 items) is one row of 256
// threads, taking two or three items each.
//
// Each group is done in two phases with a barrier between them:
//   reduce  every thread sums its items' share, in the compute type: x^2 (forward), d * x_hat
//           (backward), and writes it to shared memory;
//   write   every thread adds its group's shares in thread order (each thread the same sum, with no
//           atomics, so the bits are the same on every run), then reads its items again, from L1 or
//           L2 (the block read them just before), and writes out, or dx.
// A thread's loop over groups runs as many times in every thread of a block, so that all reach each
// barrier. The emulator runs a phase for every thread of a block before the next phase: the order the
// barrier gives on a GPU.
//
// The weights' gradient is deterministic too: a thread adds u * x_hat of its items into its row of
// per-block partial sums (its own cells: no other thread writes them) over every group it takes; after
// the last group, the block adds its rows in order (fold), and a second kernel adds the blocks' sums
// in block order (WeightGradSum). The launch depends on the call's shapes, strides and alignment
// alone (not on the GPU): the same call gives the same bits. (A contiguous tensor and a misaligned
// view of the same values take different vector widths, so their sums may differ in the last bit.)
#pragma once

#include <cmath>
#include <numeric>
#include <optional>

#include "cuda/rotary_thread.h"
#include "stable_tensor.h"

// Loops over a thread's items stay loops on the GPU: unrolled, two items' values would be live at
// once, for a gain the memory-bound kernels would not see.
#if defined(__CUDA_ARCH__)
#define ROPE_EXT_NO_UNROLL _Pragma("unroll 1")
#else
#define ROPE_EXT_NO_UNROLL
#endif

namespace rope_ext::cuda {

// Blocks of a backward launch that computes the weights' gradient: the partial sums are
// kNormGradBlocks * block_y rows of PartialLayout::length() values (the weight's length for
// half-split rows: 10 MiB for Wan's 5,120 columns, 8 MiB for Qwen3's per-head norm).
constexpr int64_t kNormGradBlocks = 512;

// Where the weights' partial sums are kept: a row of `slot` values per item of a group (u * x_hat
// at the item's columns: 2 * kPairs for a vector of pairs, kVec for a pass-through run; the rest
// unused), stored in 16-byte pieces laid out piece-major, so that a warp's consecutive items write
// one contiguous span per piece: offset(item, v) = ((v / piece) * items + item) * piece + v % piece.
// (Laid out by column, the pieces of one lane's item would be 32 bytes apart: half of each sector.)
// WeightGradSum finds each weight column's place with `of_column`.
struct PartialLayout {
  int64_t items = 0;  // a group's items
  int64_t slot = 0, piece = 1;
  int64_t head_dim = 0, rotary_dim = 0, head_items = 0, rot_items = 0, pairs = 1, vec = 1;
  bool interleaved = false;

  ROPE_HD int64_t length() const { return items * slot; }
  ROPE_HD int64_t offset(int64_t item, int64_t v) const { return ((v / piece) * items + item) * piece + v % piece; }
  // Weight column c (of head c / head_dim): its item, and its value there (pairs_share's order).
  ROPE_HD int64_t of_column(int64_t c) const {
    const int64_t h = c / head_dim, cc = c - h * head_dim;
    int64_t j, v;
    if (cc < rotary_dim) {
      const int64_t half = rotary_dim / 2;
      const int64_t pair = interleaved ? cc / 2 : (cc < half ? cc : cc - half);
      const int64_t second = interleaved ? cc % 2 : (cc >= half ? 1 : 0);
      j = pair / pairs;
      v = interleaved ? 2 * (pair % pairs) + second : second * pairs + pair % pairs;
    } else {
      j = rot_items + (cc - rotary_dim) / vec;
      v = (cc - rotary_dim) % vec;
    }
    return offset(h * head_items + j, v);
  }
};

struct NormLaunch {
  int64_t grid_x = 0, block_x = 0, block_y = 0;
  int64_t groups = 0;  // statistics: rstd's elements
  int64_t vec = 1, pairs_per_item = 1, rot_items = 0, pass_items = 0;  // per head, as RotaryLaunch's
  int64_t group_items = 0;   // a group's items: (rot_items + pass_items) * group
  int64_t partial_rows = 0;  // backward with the weights' or biases' gradient: grid_x * block_y rows of sums
  PartialLayout partial;     // ... of partial.length() values each
  bool table_vec = false;    // the tables' values of an item in vector loads
  bool weight_vec = false;   // the weight's too
  bool bias_vec = false;     // the bias's too
};

// The launch of a planned call. The vector path (vec_elems of x and the tables, as the rotation's)
// needs contiguous, aligned rows of x, out and grad whose rotary half (or width, interleaved) and
// pass-through width split into whole vectors; the tables and the weight are read as vectors where
// their columns are contiguous and aligned too. `groups` is rstd's size (a group of no heads has a
// NaN statistic, which the kernel writes). `ignore_alignment`: as choose_launch's.
inline NormLaunch choose_norm_launch(const NormPlan& p, int64_t groups, const void* x, const void* out,
                                     const void* grad, const void* cos, const void* sin, const void* weight,
                                     const void* bias, int64_t elem_size, int64_t table_elem_size,
                                     int64_t weight_elem_size, int64_t bias_elem_size, bool interleaved,
                                     bool grad_sums, bool ignore_alignment = false) {
  const auto aligned = [ignore_alignment](const void* p, int64_t bytes) {
    return ignore_alignment || reinterpret_cast<uintptr_t>(p) % bytes == 0;
  };
  NormLaunch L;
  const int64_t half = p.rotary_dim / 2, pass = p.head_dim - p.rotary_dim;
  const int64_t e = kVectorBytes / std::max(elem_size, table_elem_size);  // vec_elems
  bool vec_ok = e >= 2 && (interleaved ? p.rotary_dim % e == 0 : half % e == 0) && pass % e == 0 && p.x_col == 1 &&
                p.out_col == 1 && (grad == nullptr || p.grad_col == 1) && aligned(x, e * elem_size) &&
                aligned(out, e * elem_size) && (grad == nullptr || aligned(grad, e * elem_size));
  for (int d = 0; vec_ok && !ignore_alignment && d < p.rows.ndim; ++d) {
    vec_ok = p.rows.strides[kNormX][d] % e == 0 && p.rows.strides[kNormOut][d] % e == 0 &&
             (grad == nullptr || p.rows.strides[kNormGrad][d] % e == 0);
  }
  L.vec = vec_ok ? e : 1;
  L.pairs_per_item = vec_ok ? (interleaved ? e / 2 : e) : 1;
  L.rot_items = half / L.pairs_per_item;
  L.pass_items = pass / L.vec;
  const int64_t n = p.gathered ? L.pairs_per_item : L.vec;  // table values per item and member
  bool token_strides_ok = true;
  for (int d = 0; d < p.rows.ndim; ++d) {
    token_strides_ok = token_strides_ok && p.rows.strides[kNormCos][d] % n == 0 && p.rows.strides[kNormSin][d] % n == 0;
  }
  L.table_vec = tables_vectorize(p, n, token_strides_ok, cos, sin, table_elem_size, ignore_alignment);
  // A weight's runs start at multiples of the vector width (pairs, second members at half, heads at
  // D, pass-through columns at r); load_run reads them in pieces of at most 16 bytes.
  const auto param_vec = [&](const void* t, int64_t stride, int64_t size) {
    return L.vec > 1 && t != nullptr && stride == 1 &&
           aligned(t, std::min(L.vec, kVectorBytes / std::max<int64_t>(size, 1)) * size);
  };
  L.weight_vec = param_vec(weight, p.weight_stride, weight_elem_size);
  L.bias_vec = param_vec(bias, p.bias_stride, bias_elem_size);
  L.groups = groups;
  L.group_items = (L.rot_items + L.pass_items) * p.group;
  L.block_x = std::clamp<int64_t>(L.group_items, 1, kMaxThreads);
  L.block_y = std::clamp<int64_t>(std::min(groups, kMaxThreads / L.block_x), 1, kMaxThreads);
  const int64_t group_blocks = (groups + L.block_y - 1) / L.block_y;
  L.grid_x = std::clamp<int64_t>(group_blocks, 1, grad_sums ? kNormGradBlocks : kMaxGridX);
  if (grad_sums && p.rows_per_head() && L.grid_x < group_blocks) {
    // A row of parameters per head: a thread row's partial sums serve one head, so every group it
    // takes must be of the same head. Its groups are grid_x * block_y apart: a multiple of the heads.
    // (Where that multiple is more blocks than there are, each block takes one group at most.)
    const int64_t m = p.heads / std::gcd(L.block_y, p.heads);
    L.grid_x = m >= group_blocks ? group_blocks : std::max(m, L.grid_x / m * m);
  }
  L.partial_rows = grad_sums ? L.grid_x * L.block_y : 0;
  const int64_t opmath_size = elem_size == 8 ? 8 : 4;
  L.partial = {L.group_items,        2 * L.vec,   std::min(2 * L.vec, kVectorBytes / opmath_size),
               p.head_dim,           p.rotary_dim, L.rot_items + L.pass_items,
               L.rot_items,          L.pairs_per_item, L.vec,
               interleaved};
  return L;
}

// The thread function of a qk_norm_rotary launch: forward (out and the statistics) or backward (dx
// and the weights' and biases' partial sums). kVec, kGathered: as RotaryThread's. The kernel runs,
// per thread,
//   for it in [0, iterations): reduce(it); barrier; [center(it); barrier;] write(it); barrier
//   fold
// where center runs in a centered forward only (`centers()`, uniform over the launch). Mem: the
// memory policy (DeviceMemory in the kernel).
template <typename scalar_t, typename table_t, bool kInterleaved, int kVec, bool kGathered, bool kBackward, class Mem>
struct NormThread {
  using opmath_t = typename OpMath<scalar_t>::type;
  template <class M>
  using WithMemory = NormThread<scalar_t, table_t, kInterleaved, kVec, kGathered, kBackward, M>;
  static constexpr int kPairs = pairs_per_vec<kVec, kInterleaved>();
  // The shares of a block's threads: two sums each (the second at shares + kMaxThreads).
  static constexpr int kShares = 2 * kMaxThreads;

  NormPlan p;
  const scalar_t* x;
  scalar_t* out;  // dx in the backward
  const scalar_t* grad;
  const table_t* cos;
  const table_t* sin;
  const void* positions;
  const void* weight;  // null: g = 1
  const void* bias;    // null: b = 0
  opmath_t weight_offset, eps;
  opmath_t* rstd;      // the statistics (rstd, or centered (mean, rstd) pairs). Forward: written,
                       // unless null (in place); backward: read
  opmath_t* partial;   // backward, weight gradient: the launch's partial_rows rows (PartialLayout)
  opmath_t* bias_partial;  // backward, bias gradient: as many rows again, the same layout
  int64_t groups, rot_items, group_items;
  int32_t head_items;  // rot_items + pass_items
  PartialLayout layout;
  bool weight_float, bias_float, table_vec, weight_vec, bias_vec;
  bool weight_after;  // g and b applied after the rotation (NormCall::weight_after): a uniform branch
  bool centered;      // LayerNorm (NormCall::centered): a uniform branch
  bool stats_vec;     // centered: each (mean, rstd) pair read and written as one vector (aligned to it)

  static NormThread make(const NormCall& c, const NormPlan& plan, const NormLaunch& L, void* partial,
                         void* bias_partial) {
    NormThread t{};
    t.p = plan;
    t.x = c.x.const_data_ptr<scalar_t>();
    t.out = c.out.mutable_data_ptr<scalar_t>();
    t.grad = c.grad != nullptr ? c.grad->const_data_ptr<scalar_t>() : nullptr;
    t.cos = c.cos.const_data_ptr<table_t>();
    t.sin = c.sin.const_data_ptr<table_t>();
    t.positions = c.positions != nullptr ? c.positions->const_data_ptr() : nullptr;
    const bool weighted = c.weight != nullptr && c.weight->defined();
    t.weight = weighted ? c.weight->const_data_ptr() : nullptr;
    t.weight_float = weighted && c.weight->scalar_type() != c.x.scalar_type();
    const bool biased = c.bias != nullptr && c.bias->defined();
    t.bias = biased ? c.bias->const_data_ptr() : nullptr;
    t.bias_float = biased && c.bias->scalar_type() != c.x.scalar_type();
    t.weight_offset = static_cast<opmath_t>(c.weight_offset);
    t.eps = static_cast<opmath_t>(c.eps);
    t.rstd = c.rstd != nullptr ? static_cast<opmath_t*>(const_cast<void*>(c.rstd->const_data_ptr())) : nullptr;
    t.partial = static_cast<opmath_t*>(partial);
    t.bias_partial = static_cast<opmath_t*>(bias_partial);
    t.groups = L.groups;
    t.rot_items = L.rot_items;
    t.group_items = L.group_items;
    t.head_items = static_cast<int32_t>(L.rot_items + L.pass_items);
    t.layout = L.partial;
    t.table_vec = L.table_vec;
    t.weight_vec = L.weight_vec;
    t.bias_vec = L.bias_vec;
    t.weight_after = c.weight_after;
    t.centered = c.centered;
    // (the forward's statistics are a new tensor; the backward's, its caller's: any contiguous one)
    t.stats_vec = reinterpret_cast<uintptr_t>(t.rstd) % (2 * sizeof(opmath_t)) == 0;
    return t;
  }

  // The group loop's length in block g.bx: the same for each of its threads.
  ROPE_HD int64_t iterations(const ThreadCoord& g) const {
    const int64_t blocks = (groups + g.block_y - 1) / g.block_y;
    return g.bx < blocks ? (blocks - 1 - g.bx) / g.grid_x + 1 : 0;
  }

  // Whether each iteration has the center phase (a centered forward: the mean first, then the
  // squares about it).
  ROPE_HD bool centers() const { return !kBackward && centered; }

  // Phase 1 of iteration `it`: this thread's shares of its group's sums, into shares[tid] and
  // shares[kMaxThreads + tid]: sum(x^2), or centered sum(x) (forward); sum(d * x_hat) and, centered,
  // sum(d) (backward). In the backward, its items' terms of the weights' and biases' gradients also
  // go into its partial sums (set at it 0, where a thread without a group writes zeros, so that no
  // partial sum is left unwritten).
  ROPE_HD void reduce(const ThreadCoord& g, int64_t it, opmath_t* shares) const {
    const int64_t n = group_of(g, it);
    Sums sum;
    if (n < groups) {
      const Stats st = saved(g, it, n);
      ROPE_EXT_NO_UNROLL
      for (int64_t item = g.tx; item < group_items; item += g.block_x) {
        Mem::at_item(it, item);
        sum.add(item_share(g, it, n, item, st, !centered));
      }
    } else if (kBackward && it == 0) {
      ROPE_EXT_NO_UNROLL
      for (int64_t item = g.tx; item < group_items; item += g.block_x) {
        Mem::at_item(it, item);
        zero_partials(g, item);
      }
    }
    const int64_t tid = g.ty * g.block_x + g.tx;
    shares[tid] = sum.a;
    shares[kMaxThreads + tid] = sum.b;
  }

  // The center phase (centers()): the group's mean from the first shares, then this thread's share
  // of sum((x - mean)^2) into shares[kMaxThreads + tid].
  ROPE_HD void center(const ThreadCoord& g, int64_t it, opmath_t* shares) const {
    const int64_t n = group_of(g, it);
    if (n >= groups) return;
    Stats st;
    st.mean = total(g, shares) / count();
    opmath_t sum = 0;
    ROPE_EXT_NO_UNROLL
    for (int64_t item = g.tx; item < group_items; item += g.block_x) {
      Mem::at_item(it, item);
      sum += item_share(g, it, n, item, st, true).a;
    }
    shares[kMaxThreads + g.ty * g.block_x + g.tx] = sum;
  }

  // The last phase: the group's sums from every thread's shares, then this thread's items written.
  ROPE_HD void write(const ThreadCoord& g, int64_t it, const opmath_t* shares) const {
    const int64_t n = group_of(g, it);
    if (n >= groups) return;
    const opmath_t first = total(g, shares), second = centered ? total(g, shares + kMaxThreads) : opmath_t(0);
    Stats st;
    if constexpr (!kBackward) {
      st.mean = centered ? first / count() : opmath_t(0);
      const opmath_t var = (centered ? second : first) / count();
      st.inv = opmath_t(1) / std::sqrt(var + eps);  // (a group of no values: NaN)
      if (rstd != nullptr && g.tx == 0) {
        Mem::at_item(it, g.tx);
        if (centered) {  // (one vector store of the pair where its 8 or 16 bytes are aligned)
          const opmath_t pair[2] = {st.mean, st.inv};
          store_run<2, kSiteRstdStore, Mem>(rstd + 2 * n, 1, stats_vec, pair);
        } else {
          Mem::template store<kSiteRstdStore>(rstd + n, st.inv);
        }
      }
    } else {
      st = saved(g, it, n);
      st.m = first / count();
      st.md = second / count();
    }
    ROPE_EXT_NO_UNROLL
    for (int64_t item = g.tx; item < group_items; item += g.block_x) {
      Mem::at_item(it, item);
      item_write(n, item, st);
    }
  }

  // After the last iteration and a barrier (backward, weights' or biases' gradient): the block's
  // block_y rows of partial sums added in row order into its first row, which WeightGradSum reads.
  // (Not with a row of parameters per head: a block's rows serve different heads, and WeightGradSum
  // takes each head's rows from every block.)
  ROPE_HD void fold(const ThreadCoord& g) const {
    if constexpr (kBackward) {
      if (g.block_y == 1 || p.rows_per_head()) return;
      fold_rows<kSitePartialLoad1, kSitePartialStore1>(g, partial);
      fold_rows<kSitePartialLoad2, kSitePartialStore2>(g, bias_partial);
    }
  }

 private:
  // A thread's sums over its items (Sums::add), and what a group's items are computed with: mean and
  // inv (rstd) for x_hat = (x - mean) * inv (mean 0 without centering: x - 0 is x), and in the
  // backward's write phase m = mean(d * x_hat) and md = mean(d) (0 without centering).
  struct Sums {
    opmath_t a = 0, b = 0;
    ROPE_HD void add(const Sums& o) { a += o.a, b += o.b; }
  };
  struct Stats {
    opmath_t mean = 0, inv = 0, m = 0, md = 0;
  };

  ROPE_HD opmath_t count() const { return static_cast<opmath_t>(p.group * p.head_dim); }
  // The sum of the block row's shares in thread order.
  ROPE_HD opmath_t total(const ThreadCoord& g, const opmath_t* shares) const {
    opmath_t sum = 0;
    ROPE_EXT_NO_UNROLL
    for (int64_t j = 0; j < g.block_x; ++j) sum += shares[g.ty * g.block_x + j];
    return sum;
  }
  // The backward's saved statistics of group n (mean 0 without centering); nothing in the forward.
  ROPE_HD Stats saved(const ThreadCoord& g, int64_t it, int64_t n) const {
    Stats st;
    if constexpr (kBackward) {
      Mem::at_item(it, g.tx);
      if (centered) {
        opmath_t pair[2];
        load_run<2, kSiteRstdLoad, Mem>(rstd + 2 * n, 1, stats_vec, pair);
        st.mean = pair[0], st.inv = pair[1];
      } else {
        st.inv = Mem::template load<kSiteRstdLoad>(rstd + n);
      }
    }
    return st;
  }

  template <int kLoad, int kStore>
  ROPE_HD void fold_rows(const ThreadCoord& g, opmath_t* sums) const {
    if (sums == nullptr) return;
    const int64_t w = layout.length(), threads = g.block_x * g.block_y;
    opmath_t* rows = sums + g.bx * g.block_y * w;
    int64_t step = 0;
    for (int64_t col = g.tx + g.ty * g.block_x; col < w; col += threads, ++step) {
      Mem::at_item(step, g.tx);
      opmath_t acc = 0;
      for (int64_t r = 0; r < g.block_y; ++r) acc += Mem::template load<kLoad>(rows + r * w + col);
      Mem::template store<kStore>(rows + col, acc);
    }
  }

  ROPE_HD int64_t group_of(const ThreadCoord& g, int64_t it) const { return (g.bx + it * g.grid_x) * g.block_y + g.ty; }

  // Where an item is: its index in its head, the first column of its row's slice of a parameter of
  // a row per head (the row's head in the group across heads, its head per head with a row each:
  // NormPlan::heads; 0 with one row for every head), and (with offsets) the row's offsets. An item
  // is a vector of pairs (j < rot_items) or a run of kVec pass-through columns; each kind has its
  // own code path below, so that only its own values are live. (The slice's column, not the row:
  // one 64-bit value more here spills the 16-bit backward on sm_120, whose launch bounds cap it at
  // 128 registers.)
  struct Item {
    int32_t param_col, j;  // (a parameter's length and a head's items are below 2^31: the plan checks)
    int64_t off[5];
  };
  ROPE_HD Item locate(int64_t n, int64_t item, bool offsets = true) const {
    Item a;
    const int32_t i = static_cast<int32_t>(item);  // (group_items < 2^31: plan_norm_call checks)
    const int32_t h = i / head_items;
    a.j = i - h * head_items;
    // (a 32-bit remainder: a 64-bit one's register sequence spills the 16-bit backward on sm_120)
    const int32_t ph = p.group > 1 ? h
                       : p.rows_per_head() ? static_cast<int32_t>(static_cast<uint32_t>(n) % static_cast<uint32_t>(p.heads))
                                           : 0;
    a.param_col = ph * static_cast<int32_t>(p.head_dim);
    if (offsets) p.rows.offsets(n * p.group + h, a.off);
    return a;
  }
  ROPE_HD int64_t half() const { return p.rotary_dim / 2; }
  ROPE_HD int64_t pair0(const Item& a) const { return a.j * kPairs; }
  ROPE_HD int64_t run_col(const Item& a) const { return p.rotary_dim + (a.j - rot_items) * kVec; }
  // The weight's (bias's) first column for item a's row.
  ROPE_HD int64_t weight_base(const Item& a) const { return p.weight_len > p.head_dim ? a.param_col : 0; }
  ROPE_HD int64_t bias_base(const Item& a) const { return p.bias_len > p.head_dim ? a.param_col : 0; }
  // The thread's row of partial sums of the weights' (biases') gradient.
  ROPE_HD opmath_t* partial_row(const ThreadCoord& g, opmath_t* sums) const {
    return sums + (g.bx * g.block_y + g.ty) * layout.length();
  }
  static constexpr int kSlot = 2 * kVec;
  static constexpr int kPiece = kSlot < kVectorBytes / static_cast<int>(sizeof(opmath_t))
                                    ? kSlot : kVectorBytes / static_cast<int>(sizeof(opmath_t));
  // An item's slot of partial sums, read or written piece by piece (layout.piece == kPiece).
  template <int kSite>
  ROPE_HD void load_slot(const ThreadCoord& g, opmath_t* sums, int64_t item, opmath_t (&v)[kSlot]) const {
    const opmath_t* row = partial_row(g, sums);
    for (int q = 0; q < kSlot; q += kPiece) {
      opmath_t w[kPiece];
      load_run<kPiece, kSite, Mem>(row + layout.offset(item, q), 1, true, w);
      for (int e = 0; e < kPiece; ++e) v[q + e] = w[e];
    }
  }
  template <int kSite>
  ROPE_HD void store_slot(const ThreadCoord& g, opmath_t* sums, int64_t item, const opmath_t (&v)[kSlot]) const {
    opmath_t* row = partial_row(g, sums);
    for (int q = 0; q < kSlot; q += kPiece) {
      opmath_t w[kPiece];
      for (int e = 0; e < kPiece; ++e) w[e] = v[q + e];
      store_run<kPiece, kSite, Mem>(row + layout.offset(item, q), 1, true, w);
    }
  }
  // An item's terms added into its slot of the weights' (kBias: the biases') partial sums: the pairs'
  // (t1 at the first members, t2 at the second, in PartialLayout::of_column's order), or a run's.
  template <bool kBias>
  ROPE_HD void add_pair_terms(const ThreadCoord& g, int64_t it, int64_t item, const opmath_t (&t1)[kPairs],
                              const opmath_t (&t2)[kPairs]) const {
    constexpr int kLoad = kBias ? kSitePartialLoad2 : kSitePartialLoad1;
    constexpr int kStore = kBias ? kSitePartialStore2 : kSitePartialStore1;
    opmath_t* const sums = kBias ? bias_partial : partial;
    opmath_t v[kSlot] = {};
    if (it > 0) load_slot<kLoad>(g, sums, item, v);
    for (int j = 0; j < kPairs; ++j) {
      v[kInterleaved ? 2 * j : j] += t1[j];
      v[kInterleaved ? 2 * j + 1 : kPairs + j] += t2[j];
    }
    store_slot<kStore>(g, sums, item, v);
  }
  template <bool kBias>
  ROPE_HD void add_run_terms(const ThreadCoord& g, int64_t it, int64_t item, const opmath_t (&t)[kVec]) const {
    constexpr int kLoad = kBias ? kSitePartialLoad2 : kSitePartialLoad1;
    constexpr int kStore = kBias ? kSitePartialStore2 : kSitePartialStore1;
    opmath_t* const sums = kBias ? bias_partial : partial;
    opmath_t v[kSlot] = {};
    if (it > 0) load_slot<kLoad>(g, sums, item, v);
    for (int j = 0; j < kVec; ++j) v[j] += t[j];
    store_slot<kStore>(g, sums, item, v);
  }

  // --- loads of an item's pairs ---
  ROPE_HD void x_pairs(const Item& a, opmath_t (&x1)[kPairs], opmath_t (&x2)[kPairs]) const {
    load_pairs<kVec, kInterleaved, kSiteX1, kSiteX2, Mem>(x + a.off[kNormX], p.x_col, half(), pair0(a), true, x1, x2);
  }
  // g = weight + weight_offset at the pairs (1 without a weight).
  ROPE_HD void gain_pairs(const Item& a, opmath_t (&g1)[kPairs], opmath_t (&g2)[kPairs]) const {
    if (weight == nullptr) {
      for (int j = 0; j < kPairs; ++j) g1[j] = g2[j] = opmath_t(1);
      return;
    }
    if (weight_float) {
      param_pairs<kSiteWeight1, kSiteWeight2>(static_cast<const float*>(weight), weight_base(a), p.weight_stride,
                                              weight_vec, a, g1, g2);
    } else {
      param_pairs<kSiteWeight1, kSiteWeight2>(static_cast<const scalar_t*>(weight), weight_base(a),
                                              p.weight_stride, weight_vec, a, g1, g2);
    }
    for (int j = 0; j < kPairs; ++j) g1[j] += weight_offset, g2[j] += weight_offset;
  }
  // b at the pairs (only read with a bias).
  ROPE_HD void bias_pairs(const Item& a, opmath_t (&b1)[kPairs], opmath_t (&b2)[kPairs]) const {
    if (bias_float) {
      param_pairs<kSiteBias1, kSiteBias2>(static_cast<const float*>(bias), bias_base(a), p.bias_stride, bias_vec,
                                          a, b1, b2);
    } else {
      param_pairs<kSiteBias1, kSiteBias2>(static_cast<const scalar_t*>(bias), bias_base(a), p.bias_stride,
                                          bias_vec, a, b1, b2);
    }
  }
  template <int kSite1, int kSite2, typename W>
  ROPE_HD void param_pairs(const W* w, int64_t base, int64_t stride, bool vec, const Item& a, opmath_t (&v1)[kPairs],
                           opmath_t (&v2)[kPairs]) const {
    load_pairs<kVec, kInterleaved, kSite1, kSite2, Mem>(w + base * stride, stride, half(), pair0(a), vec, v1, v2);
  }
  // The row's table entries at the pairs, as the rotation reads them.
  ROPE_HD void table_pairs(const Item& a, opmath_t (&c1)[kPairs], opmath_t (&s1)[kPairs], opmath_t (&c2)[kPairs],
                           opmath_t (&s2)[kPairs]) const {
    if constexpr (kGathered) {
      const CacheRead read{p.cos_row, p.sin_row, p.cos_col, p.sin_col, p.cache_rows};
      load_cache_rows<kPairs, Mem>(cos, sin, positions, p.positions_int32, a.off[kNormCos], read, pair0(a), table_vec,
                                   c1, s1);
      for (int j = 0; j < kPairs; ++j) c2[j] = c1[j], s2[j] = s1[j];
    } else {
      load_pairs<kVec, kInterleaved, kSiteCos1, kSiteCos2, Mem>(cos + a.off[kNormCos], p.cos_col, half(), pair0(a),
                                                                table_vec, c1, c2);
      load_pairs<kVec, kInterleaved, kSiteSin1, kSiteSin2, Mem>(sin + a.off[kNormSin], p.sin_col, half(), pair0(a),
                                                                table_vec, s1, s2);
    }
  }
  // Backward at the pairs: x_hat = (x - mean) * rstd, and d, the gradient of x_hat: rotary^T(dy) * g,
  // or with the weight after, rotary^T(g * dy). kTerms: also each column's term of the weights'
  // gradient, rotary^T(dy) * x_hat, or with the weight after, dy * rotary(x_hat).
  template <bool kTerms>
  ROPE_HD void grad_pairs(const Item& a, const Stats& st, opmath_t (&d1)[kPairs], opmath_t (&d2)[kPairs],
                          opmath_t (&h1)[kPairs], opmath_t (&h2)[kPairs], opmath_t (&t1)[kPairs],
                          opmath_t (&t2)[kPairs]) const {
    opmath_t y1[kPairs], y2[kPairs], c1[kPairs], s1[kPairs], c2[kPairs], s2[kPairs], g1[kPairs], g2[kPairs];
    load_pairs<kVec, kInterleaved, kSiteGrad1, kSiteGrad2, Mem>(grad + a.off[kNormGrad], p.grad_col, half(), pair0(a),
                                                                true, y1, y2);
    table_pairs(a, c1, s1, c2, s2);
    x_pairs(a, h1, h2);
    gain_pairs(a, g1, g2);
    for (int j = 0; j < kPairs; ++j) {
      h1[j] = (h1[j] - st.mean) * st.inv, h2[j] = (h2[j] - st.mean) * st.inv;
      if (weight_after) {
        if constexpr (kTerms) {
          opmath_t r1, r2;
          rotate_pair<false>(h1[j], h2[j], c1[j], s1[j], c2[j], s2[j], r1, r2);
          t1[j] = y1[j] * r1, t2[j] = y2[j] * r2;
        }
        rotate_pair<true>(y1[j] * g1[j], y2[j] * g2[j], c1[j], s1[j], c2[j], s2[j], d1[j], d2[j]);
      } else {
        opmath_t u1, u2;
        rotate_pair<true>(y1[j], y2[j], c1[j], s1[j], c2[j], s2[j], u1, u2);
        if constexpr (kTerms) t1[j] = u1 * h1[j], t2[j] = u2 * h2[j];
        d1[j] = u1 * g1[j], d2[j] = u2 * g2[j];
      }
    }
  }
  // Each column's term of the biases' gradient at the pairs: rotary^T(dy), or with the weight after,
  // dy. (Its own pass over dy and the tables, which the block read just before: beside grad_pairs'
  // values, 2 * kPairs more would be live, and the 16-bit vector kernels would spill on sm_120.)
  ROPE_HD void bias_terms(const Item& a, opmath_t (&e1)[kPairs], opmath_t (&e2)[kPairs]) const {
    opmath_t c1[kPairs], s1[kPairs], c2[kPairs], s2[kPairs];
    load_pairs<kVec, kInterleaved, kSiteGrad1, kSiteGrad2, Mem>(grad + a.off[kNormGrad], p.grad_col, half(), pair0(a),
                                                                true, e1, e2);
    if (weight_after) return;
    table_pairs(a, c1, s1, c2, s2);
    for (int j = 0; j < kPairs; ++j) {
      const opmath_t y1 = e1[j], y2 = e2[j];  // (rotate_pair's outputs must not alias its inputs)
      rotate_pair<true>(y1, y2, c1[j], s1[j], c2[j], s2[j], e1[j], e2[j]);
    }
  }

  // --- loads of an item's pass-through run ---
  ROPE_HD void x_run(const Item& a, opmath_t (&v)[kVec]) const {
    load_run<kVec, kSitePassLoad, Mem>(x + a.off[kNormX] + run_col(a) * p.x_col, p.x_col, kVec > 1, v);
  }
  ROPE_HD void gain_run(const Item& a, opmath_t (&g)[kVec]) const {
    if (weight == nullptr) {
      for (int j = 0; j < kVec; ++j) g[j] = opmath_t(1);
      return;
    }
    const int64_t at = (weight_base(a) + run_col(a)) * p.weight_stride;
    if (weight_float) {
      load_run<kVec, kSiteWeight1, Mem>(static_cast<const float*>(weight) + at, p.weight_stride, weight_vec, g);
    } else {
      load_run<kVec, kSiteWeight1, Mem>(static_cast<const scalar_t*>(weight) + at, p.weight_stride, weight_vec, g);
    }
    for (int j = 0; j < kVec; ++j) g[j] += weight_offset;
  }
  ROPE_HD void bias_run(const Item& a, opmath_t (&b)[kVec]) const {
    const int64_t at = (bias_base(a) + run_col(a)) * p.bias_stride;
    if (bias_float) {
      load_run<kVec, kSiteBias1, Mem>(static_cast<const float*>(bias) + at, p.bias_stride, bias_vec, b);
    } else {
      load_run<kVec, kSiteBias1, Mem>(static_cast<const scalar_t*>(bias) + at, p.bias_stride, bias_vec, b);
    }
  }
  ROPE_HD void u_and_x_hat_run(const Item& a, const Stats& st, opmath_t (&u)[kVec], opmath_t (&h)[kVec]) const {
    load_run<kVec, kSiteGrad1, Mem>(grad + a.off[kNormGrad] + run_col(a) * p.grad_col, p.grad_col, kVec > 1, u);
    x_run(a, h);
    for (int j = 0; j < kVec; ++j) h[j] = (h[j] - st.mean) * st.inv;
  }

  // Phase 1 at it 0 for a thread without a group: zeros in the item's slots of its partial sums.
  ROPE_HD void zero_partials(const ThreadCoord& g, int64_t item) const {
    const opmath_t z[kSlot] = {};
    if (partial != nullptr) store_slot<kSitePartialStore1>(g, partial, item, z);
    if (bias_partial != nullptr) store_slot<kSitePartialStore2>(g, bias_partial, item, z);
  }

  // The item's parts of the group's sums. Forward: sum((x - mean)^2) with `squares`, else sum(x) (the
  // first phase of a centered forward), as Sums::a. Backward: sum(d * x_hat) and sum(d), d as
  // grad_pairs gives it.
  ROPE_HD Sums item_share(const ThreadCoord& g, int64_t it, int64_t n, int64_t item, const Stats& st,
                          bool squares) const {
    const Item a = locate(n, item);
    return a.j < rot_items ? pairs_share(g, it, item, a, st, squares) : run_share(g, it, item, a, st, squares);
  }
  ROPE_HD Sums pairs_share(const ThreadCoord& g, int64_t it, int64_t item, const Item& a, const Stats& st,
                           bool squares) const {
    Sums sum;
    if constexpr (!kBackward) {
      opmath_t x1[kPairs], x2[kPairs];
      x_pairs(a, x1, x2);
      for (int j = 0; j < kPairs; ++j) {
        const opmath_t v1 = x1[j] - st.mean, v2 = x2[j] - st.mean;
        sum.a += squares ? v1 * v1 + v2 * v2 : v1 + v2;
      }
    } else {
      opmath_t d1[kPairs], d2[kPairs], h1[kPairs], h2[kPairs], t1[kPairs], t2[kPairs];
      if (partial != nullptr) {
        grad_pairs<true>(a, st, d1, d2, h1, h2, t1, t2);
        add_pair_terms<false>(g, it, item, t1, t2);
      } else {
        grad_pairs<false>(a, st, d1, d2, h1, h2, t1, t2);
      }
      for (int j = 0; j < kPairs; ++j) sum.a += d1[j] * h1[j] + d2[j] * h2[j], sum.b += d1[j] + d2[j];
      if (bias_partial != nullptr) {
        opmath_t e1[kPairs], e2[kPairs];
        bias_terms(a, e1, e2);
        add_pair_terms<true>(g, it, item, e1, e2);
      }
    }
    return sum;
  }
  ROPE_HD Sums run_share(const ThreadCoord& g, int64_t it, int64_t item, const Item& a, const Stats& st,
                         bool squares) const {
    Sums sum;
    if constexpr (!kBackward) {
      opmath_t v[kVec];
      x_run(a, v);
      for (int j = 0; j < kVec; ++j) {
        const opmath_t c = v[j] - st.mean;
        sum.a += squares ? c * c : c;
      }
    } else {
      opmath_t u[kVec], h[kVec], gn[kVec];
      u_and_x_hat_run(a, st, u, h);
      if (partial != nullptr) {
        opmath_t t[kVec];
        for (int j = 0; j < kVec; ++j) t[j] = u[j] * h[j];
        add_run_terms<false>(g, it, item, t);
      }
      if (bias_partial != nullptr) add_run_terms<true>(g, it, item, u);
      gain_run(a, gn);
      for (int j = 0; j < kVec; ++j) {
        const opmath_t d = u[j] * gn[j];
        sum.a += d * h[j], sum.b += d;
      }
    }
    return sum;
  }

  // Forward: out = rotary(x_hat * g + b), or g * rotary(x_hat) + b. Backward: dx = rstd * ((d - md) -
  // x_hat * m), d as grad_pairs gives it (u * g at the pass-through columns, where the order does not
  // matter).
  ROPE_HD void item_write(int64_t n, int64_t item, const Stats& st) const {
    const Item a = locate(n, item);
    if (a.j < rot_items) {
      pairs_write(a, st);
    } else {
      run_write(a, st);
    }
  }
  ROPE_HD void pairs_write(const Item& a, const Stats& st) const {
    opmath_t o1[kPairs], o2[kPairs];
    if constexpr (!kBackward) {
      opmath_t x1[kPairs], x2[kPairs], c1[kPairs], s1[kPairs], c2[kPairs], s2[kPairs], g1[kPairs], g2[kPairs];
      opmath_t b1[kPairs] = {}, b2[kPairs] = {};
      gain_pairs(a, g1, g2);
      if (bias != nullptr) bias_pairs(a, b1, b2);
      x_pairs(a, x1, x2);
      table_pairs(a, c1, s1, c2, s2);
      for (int j = 0; j < kPairs; ++j) {
        const opmath_t h1 = (x1[j] - st.mean) * st.inv, h2 = (x2[j] - st.mean) * st.inv;
        if (weight_after) {
          rotate_pair<false>(h1, h2, c1[j], s1[j], c2[j], s2[j], o1[j], o2[j]);
          o1[j] = o1[j] * g1[j], o2[j] = o2[j] * g2[j];
          if (bias != nullptr) o1[j] = o1[j] + b1[j], o2[j] = o2[j] + b2[j];
        } else {
          opmath_t y1 = h1 * g1[j], y2 = h2 * g2[j];
          if (bias != nullptr) y1 = y1 + b1[j], y2 = y2 + b2[j];
          rotate_pair<false>(y1, y2, c1[j], s1[j], c2[j], s2[j], o1[j], o2[j]);
        }
      }
    } else {
      opmath_t d1[kPairs], d2[kPairs], h1[kPairs], h2[kPairs], t1[kPairs], t2[kPairs];
      grad_pairs<false>(a, st, d1, d2, h1, h2, t1, t2);
      for (int j = 0; j < kPairs; ++j) {
        o1[j] = st.inv * ((d1[j] - st.md) - h1[j] * st.m);
        o2[j] = st.inv * ((d2[j] - st.md) - h2[j] * st.m);
      }
    }
    store_pairs<kVec, kInterleaved, kSiteOut1, kSiteOut2, Mem>(out + a.off[kNormOut], p.out_col, half(), pair0(a),
                                                               true, o1, o2);
  }
  ROPE_HD void run_write(const Item& a, const Stats& st) const {
    opmath_t gn[kVec], o[kVec];
    gain_run(a, gn);
    if constexpr (!kBackward) {
      x_run(a, o);
      for (int j = 0; j < kVec; ++j) o[j] = (o[j] - st.mean) * st.inv * gn[j];
      if (bias != nullptr) {
        opmath_t b[kVec];
        bias_run(a, b);
        for (int j = 0; j < kVec; ++j) o[j] = o[j] + b[j];
      }
    } else {
      opmath_t u[kVec], h[kVec];
      u_and_x_hat_run(a, st, u, h);
      for (int j = 0; j < kVec; ++j) o[j] = st.inv * ((u[j] * gn[j] - st.md) - h[j] * st.m);
    }
    store_run<kVec, kSitePassStore, Mem>(out + a.off[kNormOut] + run_col(a) * p.out_col, p.out_col, kVec > 1, o);
  }
};

// The weights' gradient: column j the sum, in block order, of the blocks' folded partial sums (rows
// b * row_step, b < blocks, each of layout.length() values), at the column's place in the layout;
// zeros where there are none. With a row of parameters per head (heads > 0: NormPlan::rows_per_head),
// column j of head h = j / head_dim is the sum of the unfolded rows h, h + heads, ... below `blocks`
// (the launch's thread rows, each serving head row % heads), at column j - h * head_dim's place. One
// thread per column.
template <typename opmath_t, class Mem>
struct WeightGradSum {
  const opmath_t* partial;
  opmath_t* dweight;
  int64_t columns, blocks, row_step;
  PartialLayout layout;
  int64_t heads = 0;

  // The same sum with another memory policy (the host emulator's).
  template <class M>
  WeightGradSum<opmath_t, M> with_memory() const {
    return {partial, dweight, columns, blocks, row_step, layout, heads};
  }

  ROPE_HD void operator()(const ThreadCoord& g) const {
    const int64_t col = g.bx * g.block_x + g.tx;
    if (col >= columns) return;
    const int64_t h = heads > 0 ? col / layout.head_dim : 0;
    const int64_t first = heads > 0 ? h : 0, step = heads > 0 ? heads : row_step;
    const int64_t count = heads > 0 ? (blocks > h ? (blocks - h + heads - 1) / heads : 0) : blocks;
    const int64_t at = count > 0 ? layout.of_column(col - h * layout.head_dim) : 0;
    opmath_t acc = 0;
    for (int64_t b = 0; b < count; ++b) {
      Mem::at_item(b, g.tx);
      acc += Mem::template load<kSitePartialLoad1>(partial + (first + b * step) * layout.length() + at);
    }
    Mem::at_item(count, g.tx);
    Mem::template store<kSiteWeightGrad>(dweight + col, acc);
  }
};

// A planned NormCall: its plan and launch (shared by the CUDA launcher and the host emulator).
struct NormCallLaunch {
  NormPlan plan;
  NormLaunch launch;
};

inline NormCallLaunch plan_norm_call(const NormCall& c, bool ignore_alignment = false) {
  NormCallLaunch r;
  r.plan = make_norm_plan(c.x, c.out, c.params(), c.cos, c.sin, c.positions, c.grad, c.across_heads);
  const bool weighted = c.weight != nullptr && c.weight->defined();
  const bool biased = c.bias != nullptr && c.bias->defined();
  // A forward's statistics include those of groups of no heads (NaN); otherwise the plan's groups. (A
  // centered call keeps two statistics a group.)
  const int64_t groups =
      c.grad == nullptr && c.rstd != nullptr ? c.rstd->numel() / (c.centered ? 2 : 1) : r.plan.num_groups();
  r.launch = choose_norm_launch(r.plan, groups, c.x.const_data_ptr(), c.out.const_data_ptr(),
                                c.grad != nullptr ? c.grad->const_data_ptr() : nullptr, c.cos.const_data_ptr(),
                                c.sin.const_data_ptr(), weighted ? c.weight->const_data_ptr() : nullptr,
                                biased ? c.bias->const_data_ptr() : nullptr, c.x.element_size(),
                                c.cos.element_size(), weighted ? c.weight->element_size() : 0,
                                biased ? c.bias->element_size() : 0, c.interleaved,
                                c.dweight != nullptr || c.dbias != nullptr, ignore_alignment);
  ROPE_EXT_CHECK(r.launch.group_items < (int64_t{1} << 31), c.op, ": a group of ", r.launch.group_items,
                 " vectors is more than the CUDA kernel indexes (2^31)");
  ROPE_EXT_CHECK(std::max(r.plan.weight_len, r.plan.bias_len) < (int64_t{1} << 31), c.op, ": a weight or bias of ",
                 std::max(r.plan.weight_len, r.plan.bias_len), " values is more than the CUDA kernel indexes (2^31)");
  ROPE_EXT_CHECK(!r.plan.rows_per_head() || r.plan.num_rows() < (int64_t{1} << 32), c.op, ": ", r.plan.num_rows(),
                 " rows with a row of weights per head is more than the CUDA kernel indexes (2^32)");
  return r;
}

// A launch's scratch for the partial sums of the weights' and the biases' gradients, from torch's
// allocator (none without them): `weight` and `bias` are null, or their parts of the tensor's.
struct NormScratch {
  std::optional<Output> tensor;
  void* weight = nullptr;
  void* bias = nullptr;
};

inline NormScratch norm_scratch(const NormCall& c, const NormLaunch& L) {
  NormScratch s;
  const int64_t part = L.partial_rows * L.partial.length();
  const int64_t size = part * ((c.dweight != nullptr) + (c.dbias != nullptr));
  if (size == 0) return s;
  const ScalarType stat = c.x.scalar_type() == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  s.tensor.emplace(new_contiguous(Dims{&size, 1}, stat, c.x.device()));
  char* data = static_cast<char*>(s.tensor->arg.mutable_data_ptr());
  const int64_t part_bytes = part * (stat == ScalarType::Double ? 8 : 4);
  if (c.dweight != nullptr) s.weight = data, data += part_bytes;
  if (c.dbias != nullptr) s.bias = data;
  return s;
}

// For each of the weights' and the biases' gradients a call computes: f(sum, grid) with its
// WeightGradSum over its part of the scratch (in the compute type) and the grid of 1-D blocks of
// kMaxThreads it takes, one thread per column.
template <typename F>
void dispatch_weight_grad_sum(const NormCall& c, const NormCallLaunch& cl, const NormScratch& scratch, F&& f) {
  const NormLaunch& L = cl.launch;
  const bool per_head = cl.plan.rows_per_head();
  const int64_t columns = per_head ? cl.plan.weight_len : cl.plan.group * cl.plan.head_dim;
  const auto with = [&]<typename opmath_t>(std::type_identity<opmath_t>) {
    for (const auto& [partial, sum] : {std::pair{scratch.weight, c.dweight}, std::pair{scratch.bias, c.dbias}}) {
      if (sum == nullptr) continue;
      const int64_t blocks = L.groups == 0 ? 0 : per_head ? L.partial_rows : L.grid_x;
      const WeightGradSum<opmath_t, DeviceMemory> t{static_cast<const opmath_t*>(partial),
                                                    static_cast<opmath_t*>(sum->mutable_data_ptr()), columns,
                                                    blocks, L.block_y, L.partial, per_head ? cl.plan.heads : 0};
      f(t, std::max<int64_t>((columns + kMaxThreads - 1) / kMaxThreads, 1));
    }
  };
  c.x.scalar_type() == ScalarType::Double ? with(std::type_identity<double>{}) : with(std::type_identity<float>{});
}

// Calls f.template operator()<Thread>() with the NormThread type of a planned call: x's dtype, the
// tables' (x's or float32), interleaved, the vector width, full or gathered tables, forward or
// backward (the launcher and the emulator instantiate the same set).
template <typename F>
void dispatch_norm_thread(const NormCall& c, const NormLaunch& L, F&& f) {
  dispatch_dtypes(c.x.scalar_type(), c.cos.scalar_type(), c.op, [&]<typename scalar_t, typename table_t>() {
    constexpr int kV = vec_elems<scalar_t, table_t>();
    const auto by_vec = [&](auto inter, auto gathered, auto backward) {
      constexpr bool kI = decltype(inter)::value, kG = decltype(gathered)::value, kB = decltype(backward)::value;
      if (L.vec == 1) {
        f.template operator()<NormThread<scalar_t, table_t, kI, 1, kG, kB, DeviceMemory>>();
      } else {
        f.template operator()<NormThread<scalar_t, table_t, kI, kV, kG, kB, DeviceMemory>>();
      }
    };
    const auto by_direction = [&](auto inter, auto gathered) {
      c.grad != nullptr ? by_vec(inter, gathered, std::true_type{}) : by_vec(inter, gathered, std::false_type{});
    };
    const auto by_tables = [&](auto inter) {
      c.positions != nullptr ? by_direction(inter, std::true_type{}) : by_direction(inter, std::false_type{});
    };
    c.interleaved ? by_tables(std::true_type{}) : by_tables(std::false_type{});
  });
}

}  // namespace rope_ext::cuda
