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
  int64_t partial_rows = 0;  // backward with the weights' gradient: grid_x * block_y rows of sums
  PartialLayout partial;     // ... of partial.length() values each
  bool table_vec = false;    // the tables' values of an item in vector loads
  bool weight_vec = false;   // the weight's too
};

// The launch of a planned call. The vector path (vec_elems of x and the tables, as the rotation's)
// needs contiguous, aligned rows of x, out and grad whose rotary half (or width, interleaved) and
// pass-through width split into whole vectors; the tables and the weight are read as vectors where
// their columns are contiguous and aligned too. `groups` is rstd's size (a group of no heads has a
// NaN statistic, which the kernel writes). `ignore_alignment`: as choose_launch's.
inline NormLaunch choose_norm_launch(const NormPlan& p, int64_t groups, const void* x, const void* out,
                                     const void* grad, const void* cos, const void* sin, const void* weight,
                                     int64_t elem_size, int64_t table_elem_size, int64_t weight_elem_size,
                                     bool interleaved, bool weight_grad, bool ignore_alignment = false) {
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
  L.weight_vec = L.vec > 1 && weight != nullptr && p.weight_stride == 1 &&
                 aligned(weight, std::min(L.vec, kVectorBytes / std::max<int64_t>(weight_elem_size, 1)) *
                                     weight_elem_size);
  L.groups = groups;
  L.group_items = (L.rot_items + L.pass_items) * p.group;
  L.block_x = std::clamp<int64_t>(L.group_items, 1, kMaxThreads);
  L.block_y = std::clamp<int64_t>(std::min(groups, kMaxThreads / L.block_x), 1, kMaxThreads);
  const int64_t group_blocks = (groups + L.block_y - 1) / L.block_y;
  L.grid_x = std::clamp<int64_t>(group_blocks, 1, weight_grad ? kNormGradBlocks : kMaxGridX);
  L.partial_rows = weight_grad ? L.grid_x * L.block_y : 0;
  const int64_t opmath_size = elem_size == 8 ? 8 : 4;
  L.partial = {L.group_items,        2 * L.vec,   std::min(2 * L.vec, kVectorBytes / opmath_size),
               p.head_dim,           p.rotary_dim, L.rot_items + L.pass_items,
               L.rot_items,          L.pairs_per_item, L.vec,
               interleaved};
  return L;
}

// The thread function of a qk_norm_rotary launch: forward (out, rstd) or backward (dx and the
// weights' partial sums). kVec, kGathered: as RotaryThread's. The kernel runs, per thread,
//   for it in [0, iterations): reduce(it); barrier; write(it); barrier
//   fold
// Mem: the memory policy (DeviceMemory in the kernel).
template <typename scalar_t, typename table_t, bool kInterleaved, int kVec, bool kGathered, bool kBackward, class Mem>
struct NormThread {
  using opmath_t = typename OpMath<scalar_t>::type;
  template <class M>
  using WithMemory = NormThread<scalar_t, table_t, kInterleaved, kVec, kGathered, kBackward, M>;
  static constexpr int kPairs = pairs_per_vec<kVec, kInterleaved>();

  NormPlan p;
  const scalar_t* x;
  scalar_t* out;  // dx in the backward
  const scalar_t* grad;
  const table_t* cos;
  const table_t* sin;
  const void* positions;
  const void* weight;  // null: g = 1
  opmath_t weight_offset, eps;
  opmath_t* rstd;      // forward: written, unless null (in place); backward: read
  opmath_t* partial;   // backward, weight gradient: the launch's partial_rows rows (PartialLayout)
  int64_t groups, rot_items, group_items;
  int32_t head_items;  // rot_items + pass_items
  PartialLayout layout;
  bool weight_float, table_vec, weight_vec;
  bool weight_after;  // g applied after the rotation (NormCall::weight_after): a uniform branch

  static NormThread make(const NormCall& c, const NormPlan& plan, const NormLaunch& L, void* partial) {
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
    t.weight_offset = static_cast<opmath_t>(c.weight_offset);
    t.eps = static_cast<opmath_t>(c.eps);
    t.rstd = c.rstd != nullptr ? static_cast<opmath_t*>(const_cast<void*>(c.rstd->const_data_ptr())) : nullptr;
    t.partial = static_cast<opmath_t*>(partial);
    t.groups = L.groups;
    t.rot_items = L.rot_items;
    t.group_items = L.group_items;
    t.head_items = static_cast<int32_t>(L.rot_items + L.pass_items);
    t.layout = L.partial;
    t.table_vec = L.table_vec;
    t.weight_vec = L.weight_vec;
    t.weight_after = c.weight_after;
    return t;
  }

  // The group loop's length in block g.bx: the same for each of its threads.
  ROPE_HD int64_t iterations(const ThreadCoord& g) const {
    const int64_t blocks = (groups + g.block_y - 1) / g.block_y;
    return g.bx < blocks ? (blocks - 1 - g.bx) / g.grid_x + 1 : 0;
  }

  // Phase 1 of iteration `it`: this thread's share of its group's sum, into shares[tid]. In the
  // backward, its items' u * x_hat also go into its partial sums (set at it 0, where a thread
  // without a group writes zeros, so that no partial sum is left unwritten).
  ROPE_HD void reduce(const ThreadCoord& g, int64_t it, opmath_t* shares) const {
    const int64_t n = group_of(g, it);
    opmath_t sum = 0;
    if (n < groups) {
      ROPE_EXT_NO_UNROLL
      for (int64_t item = g.tx; item < group_items; item += g.block_x) {
        Mem::at_item(it, item);
        sum += item_share(g, it, n, item);
      }
    } else if (kBackward && partial != nullptr && it == 0) {
      ROPE_EXT_NO_UNROLL
      for (int64_t item = g.tx; item < group_items; item += g.block_x) {
        Mem::at_item(it, item);
        zero_partials(g, item);
      }
    }
    shares[g.ty * g.block_x + g.tx] = sum;
  }

  // Phase 2: the group's sum from every thread's share, then this thread's items written.
  ROPE_HD void write(const ThreadCoord& g, int64_t it, const opmath_t* shares) const {
    const int64_t n = group_of(g, it);
    if (n >= groups) return;
    opmath_t total = 0;
    ROPE_EXT_NO_UNROLL
    for (int64_t j = 0; j < g.block_x; ++j) total += shares[g.ty * g.block_x + j];
    const opmath_t count = static_cast<opmath_t>(p.group * p.head_dim);
    if constexpr (!kBackward) {
      const opmath_t inv = opmath_t(1) / std::sqrt(total / count + eps);  // (a group of no values: NaN)
      if (rstd != nullptr && g.tx == 0) {
        Mem::at_item(it, g.tx);
        Mem::template store<kSiteRstdStore>(rstd + n, inv);
      }
      ROPE_EXT_NO_UNROLL
      for (int64_t item = g.tx; item < group_items; item += g.block_x) {
        Mem::at_item(it, item);
        item_write(n, item, inv, opmath_t(0));
      }
    } else {
      Mem::at_item(it, g.tx);
      const opmath_t inv = Mem::template load<kSiteRstdLoad>(rstd + n);
      const opmath_t mean = total / count;
      ROPE_EXT_NO_UNROLL
      for (int64_t item = g.tx; item < group_items; item += g.block_x) {
        Mem::at_item(it, item);
        item_write(n, item, inv, mean);
      }
    }
  }

  // After the last iteration and a barrier (backward, weight gradient): the block's block_y rows of
  // partial sums added in row order into its first row, which WeightGradSum reads.
  ROPE_HD void fold(const ThreadCoord& g) const {
    if constexpr (kBackward) {
      if (partial == nullptr || g.block_y == 1) return;
      const int64_t w = layout.length(), threads = g.block_x * g.block_y;
      opmath_t* rows = partial + g.bx * g.block_y * w;
      int64_t step = 0;
      for (int64_t col = g.tx + g.ty * g.block_x; col < w; col += threads, ++step) {
        Mem::at_item(step, g.tx);
        opmath_t acc = 0;
        for (int64_t r = 0; r < g.block_y; ++r) acc += Mem::template load<kSitePartialLoad1>(rows + r * w + col);
        Mem::template store<kSitePartialStore1>(rows + col, acc);
      }
    }
  }

 private:
  ROPE_HD int64_t group_of(const ThreadCoord& g, int64_t it) const { return (g.bx + it * g.grid_x) * g.block_y + g.ty; }

  // Where an item is: its head in the group, its index in the head, and (with offsets) the row's
  // offsets. An item is a vector of pairs (j < rot_items) or a run of kVec pass-through columns; each
  // kind has its own code path below, so that only its own values are live.
  struct Item {
    int64_t h, j;
    int64_t off[5];
  };
  ROPE_HD Item locate(int64_t n, int64_t item, bool offsets = true) const {
    Item a;
    const int32_t i = static_cast<int32_t>(item);  // (group_items < 2^31: plan_norm_call checks)
    a.h = i / head_items;
    a.j = i - a.h * head_items;
    if (offsets) p.rows.offsets(n * p.group + a.h, a.off);
    return a;
  }
  ROPE_HD int64_t half() const { return p.rotary_dim / 2; }
  ROPE_HD int64_t pair0(const Item& a) const { return a.j * kPairs; }
  ROPE_HD int64_t run_col(const Item& a) const { return p.rotary_dim + (a.j - rot_items) * kVec; }
  // The weight's (and its gradient's) first column for head h of a group.
  ROPE_HD int64_t weight_base(int64_t h) const { return p.weight_len > p.head_dim ? h * p.head_dim : 0; }
  // The thread's row of partial sums of the weights' gradient.
  ROPE_HD opmath_t* partial_row(const ThreadCoord& g) const {
    return partial + (g.bx * g.block_y + g.ty) * layout.length();
  }
  static constexpr int kSlot = 2 * kVec;
  static constexpr int kPiece = kSlot < kVectorBytes / static_cast<int>(sizeof(opmath_t))
                                    ? kSlot : kVectorBytes / static_cast<int>(sizeof(opmath_t));
  // An item's slot of partial sums, read or written piece by piece (layout.piece == kPiece).
  ROPE_HD void load_slot(const ThreadCoord& g, int64_t item, opmath_t (&v)[kSlot]) const {
    const opmath_t* row = partial_row(g);
    for (int q = 0; q < kSlot; q += kPiece) {
      opmath_t w[kPiece];
      load_run<kPiece, kSitePartialLoad1, Mem>(row + layout.offset(item, q), 1, true, w);
      for (int e = 0; e < kPiece; ++e) v[q + e] = w[e];
    }
  }
  ROPE_HD void store_slot(const ThreadCoord& g, int64_t item, const opmath_t (&v)[kSlot]) const {
    opmath_t* row = partial_row(g);
    for (int q = 0; q < kSlot; q += kPiece) {
      opmath_t w[kPiece];
      for (int e = 0; e < kPiece; ++e) w[e] = v[q + e];
      store_run<kPiece, kSitePartialStore1, Mem>(row + layout.offset(item, q), 1, true, w);
    }
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
      weight_pairs(static_cast<const float*>(weight), a, g1, g2);
    } else {
      weight_pairs(static_cast<const scalar_t*>(weight), a, g1, g2);
    }
    for (int j = 0; j < kPairs; ++j) g1[j] += weight_offset, g2[j] += weight_offset;
  }
  template <typename W>
  ROPE_HD void weight_pairs(const W* w, const Item& a, opmath_t (&g1)[kPairs], opmath_t (&g2)[kPairs]) const {
    load_pairs<kVec, kInterleaved, kSiteWeight1, kSiteWeight2, Mem>(w + weight_base(a.h) * p.weight_stride,
                                                                     p.weight_stride, half(), pair0(a), weight_vec,
                                                                     g1, g2);
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
  // Backward at the pairs: x_hat = x * rstd, and d, the gradient of x_hat: rotary^T(dy) * g, or with
  // the weight after, rotary^T(g * dy). kTerms: also each column's term of the weights' gradient,
  // rotary^T(dy) * x_hat, or with the weight after, dy * rotary(x_hat).
  template <bool kTerms>
  ROPE_HD void grad_pairs(const Item& a, opmath_t inv, opmath_t (&d1)[kPairs], opmath_t (&d2)[kPairs],
                          opmath_t (&h1)[kPairs], opmath_t (&h2)[kPairs], opmath_t (&t1)[kPairs],
                          opmath_t (&t2)[kPairs]) const {
    opmath_t y1[kPairs], y2[kPairs], c1[kPairs], s1[kPairs], c2[kPairs], s2[kPairs], g1[kPairs], g2[kPairs];
    load_pairs<kVec, kInterleaved, kSiteGrad1, kSiteGrad2, Mem>(grad + a.off[kNormGrad], p.grad_col, half(), pair0(a),
                                                                true, y1, y2);
    table_pairs(a, c1, s1, c2, s2);
    x_pairs(a, h1, h2);
    gain_pairs(a, g1, g2);
    for (int j = 0; j < kPairs; ++j) {
      h1[j] = h1[j] * inv, h2[j] = h2[j] * inv;
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

  // --- loads of an item's pass-through run ---
  ROPE_HD void x_run(const Item& a, opmath_t (&v)[kVec]) const {
    load_run<kVec, kSitePassLoad, Mem>(x + a.off[kNormX] + run_col(a) * p.x_col, p.x_col, kVec > 1, v);
  }
  ROPE_HD void gain_run(const Item& a, opmath_t (&g)[kVec]) const {
    if (weight == nullptr) {
      for (int j = 0; j < kVec; ++j) g[j] = opmath_t(1);
      return;
    }
    const int64_t at = (weight_base(a.h) + run_col(a)) * p.weight_stride;
    if (weight_float) {
      load_run<kVec, kSiteWeight1, Mem>(static_cast<const float*>(weight) + at, p.weight_stride, weight_vec, g);
    } else {
      load_run<kVec, kSiteWeight1, Mem>(static_cast<const scalar_t*>(weight) + at, p.weight_stride, weight_vec, g);
    }
    for (int j = 0; j < kVec; ++j) g[j] += weight_offset;
  }
  ROPE_HD void u_and_x_hat_run(const Item& a, opmath_t inv, opmath_t (&u)[kVec], opmath_t (&h)[kVec]) const {
    load_run<kVec, kSiteGrad1, Mem>(grad + a.off[kNormGrad] + run_col(a) * p.grad_col, p.grad_col, kVec > 1, u);
    x_run(a, h);
    for (int j = 0; j < kVec; ++j) h[j] = h[j] * inv;
  }

  // Phase 1 at it 0 for a thread without a group: zeros in the item's slot of its partial sums.
  ROPE_HD void zero_partials(const ThreadCoord& g, int64_t item) const {
    const opmath_t z[kSlot] = {};
    store_slot(g, item, z);
  }

  // The item's part of the group's sum: sum(x^2) (forward), sum(d * x_hat) with d as grad_pairs gives
  // it (backward).
  ROPE_HD opmath_t item_share(const ThreadCoord& g, int64_t it, int64_t n, int64_t item) const {
    const Item a = locate(n, item);
    return a.j < rot_items ? pairs_share(g, it, n, item, a) : run_share(g, it, n, item, a);
  }
  ROPE_HD opmath_t pairs_share(const ThreadCoord& g, int64_t it, int64_t n, int64_t item, const Item& a) const {
    opmath_t sum = 0;
    if constexpr (!kBackward) {
      opmath_t x1[kPairs], x2[kPairs];
      x_pairs(a, x1, x2);
      for (int j = 0; j < kPairs; ++j) sum += x1[j] * x1[j] + x2[j] * x2[j];
    } else {
      opmath_t d1[kPairs], d2[kPairs], h1[kPairs], h2[kPairs], t1[kPairs], t2[kPairs];
      const opmath_t inv = Mem::template load<kSiteRstdLoad>(rstd + n);
      if (partial != nullptr) {  // (slot order: PartialLayout::of_column's)
        grad_pairs<true>(a, inv, d1, d2, h1, h2, t1, t2);
        opmath_t v[kSlot] = {};
        if (it > 0) load_slot(g, item, v);
        for (int j = 0; j < kPairs; ++j) {
          v[kInterleaved ? 2 * j : j] += t1[j];
          v[kInterleaved ? 2 * j + 1 : kPairs + j] += t2[j];
        }
        store_slot(g, item, v);
      } else {
        grad_pairs<false>(a, inv, d1, d2, h1, h2, t1, t2);
      }
      for (int j = 0; j < kPairs; ++j) sum += d1[j] * h1[j] + d2[j] * h2[j];
    }
    return sum;
  }
  ROPE_HD opmath_t run_share(const ThreadCoord& g, int64_t it, int64_t n, int64_t item, const Item& a) const {
    opmath_t sum = 0;
    if constexpr (!kBackward) {
      opmath_t v[kVec];
      x_run(a, v);
      for (int j = 0; j < kVec; ++j) sum += v[j] * v[j];
    } else {
      opmath_t u[kVec], h[kVec], gn[kVec];
      u_and_x_hat_run(a, Mem::template load<kSiteRstdLoad>(rstd + n), u, h);
      if (partial != nullptr) {
        opmath_t v[kSlot] = {};
        if (it > 0) load_slot(g, item, v);
        for (int j = 0; j < kVec; ++j) v[j] += u[j] * h[j];
        store_slot(g, item, v);
      }
      gain_run(a, gn);
      for (int j = 0; j < kVec; ++j) sum += u[j] * gn[j] * h[j];
    }
    return sum;
  }

  // Forward: out = rotary(x * rstd * g), or g * rotary(x * rstd). Backward: dx = rstd * (d - x_hat *
  // mean), d as grad_pairs gives it (u * g at the pass-through columns, where the order does not matter).
  ROPE_HD void item_write(int64_t n, int64_t item, opmath_t inv, opmath_t mean) const {
    const Item a = locate(n, item);
    if (a.j < rot_items) {
      pairs_write(a, inv, mean);
    } else {
      run_write(a, inv, mean);
    }
  }
  ROPE_HD void pairs_write(const Item& a, opmath_t inv, opmath_t mean) const {
    opmath_t o1[kPairs], o2[kPairs];
    if constexpr (!kBackward) {
      opmath_t x1[kPairs], x2[kPairs], c1[kPairs], s1[kPairs], c2[kPairs], s2[kPairs], g1[kPairs], g2[kPairs];
      gain_pairs(a, g1, g2);
      x_pairs(a, x1, x2);
      table_pairs(a, c1, s1, c2, s2);
      for (int j = 0; j < kPairs; ++j) {
        if (weight_after) {
          rotate_pair<false>(x1[j] * inv, x2[j] * inv, c1[j], s1[j], c2[j], s2[j], o1[j], o2[j]);
          o1[j] = o1[j] * g1[j], o2[j] = o2[j] * g2[j];
        } else {
          const opmath_t y1 = x1[j] * inv * g1[j], y2 = x2[j] * inv * g2[j];
          rotate_pair<false>(y1, y2, c1[j], s1[j], c2[j], s2[j], o1[j], o2[j]);
        }
      }
    } else {
      opmath_t d1[kPairs], d2[kPairs], h1[kPairs], h2[kPairs], t1[kPairs], t2[kPairs];
      grad_pairs<false>(a, inv, d1, d2, h1, h2, t1, t2);
      for (int j = 0; j < kPairs; ++j) {
        o1[j] = inv * (d1[j] - h1[j] * mean);
        o2[j] = inv * (d2[j] - h2[j] * mean);
      }
    }
    store_pairs<kVec, kInterleaved, kSiteOut1, kSiteOut2, Mem>(out + a.off[kNormOut], p.out_col, half(), pair0(a),
                                                               true, o1, o2);
  }
  ROPE_HD void run_write(const Item& a, opmath_t inv, opmath_t mean) const {
    opmath_t gn[kVec], o[kVec];
    gain_run(a, gn);
    if constexpr (!kBackward) {
      x_run(a, o);
      for (int j = 0; j < kVec; ++j) o[j] = o[j] * inv * gn[j];
    } else {
      opmath_t u[kVec], h[kVec];
      u_and_x_hat_run(a, inv, u, h);
      for (int j = 0; j < kVec; ++j) o[j] = inv * (u[j] * gn[j] - h[j] * mean);
    }
    store_run<kVec, kSitePassStore, Mem>(out + a.off[kNormOut] + run_col(a) * p.out_col, p.out_col, kVec > 1, o);
  }
};

// The weights' gradient: column j the sum, in block order, of the blocks' folded partial sums (rows
// b * row_step, b < blocks, each of layout.length() values), at the column's place in the layout;
// zeros where there are none. One thread per column.
template <typename opmath_t, class Mem>
struct WeightGradSum {
  const opmath_t* partial;
  opmath_t* dweight;
  int64_t columns, blocks, row_step;
  PartialLayout layout;

  // The same sum with another memory policy (the host emulator's).
  template <class M>
  WeightGradSum<opmath_t, M> with_memory() const {
    return {partial, dweight, columns, blocks, row_step, layout};
  }

  ROPE_HD void operator()(const ThreadCoord& g) const {
    const int64_t col = g.bx * g.block_x + g.tx;
    if (col >= columns) return;
    const int64_t at = blocks > 0 ? layout.of_column(col) : 0;
    opmath_t acc = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      Mem::at_item(b, g.tx);
      acc += Mem::template load<kSitePartialLoad1>(partial + b * row_step * layout.length() + at);
    }
    Mem::at_item(blocks, g.tx);
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
  r.plan = make_norm_plan(c.x, c.out, c.weight, c.cos, c.sin, c.positions, c.grad, c.across_heads);
  const bool weighted = c.weight != nullptr && c.weight->defined();
  // A forward's statistics include those of groups of no heads (NaN); otherwise the plan's groups.
  const int64_t groups = c.grad == nullptr && c.rstd != nullptr ? c.rstd->numel() : r.plan.num_groups();
  r.launch = choose_norm_launch(r.plan, groups, c.x.const_data_ptr(), c.out.const_data_ptr(),
                                c.grad != nullptr ? c.grad->const_data_ptr() : nullptr, c.cos.const_data_ptr(),
                                c.sin.const_data_ptr(), weighted ? c.weight->const_data_ptr() : nullptr,
                                c.x.element_size(), c.cos.element_size(), weighted ? c.weight->element_size() : 0,
                                c.interleaved, c.dweight != nullptr, ignore_alignment);
  ROPE_EXT_CHECK(r.launch.group_items < (int64_t{1} << 31), c.op, ": a group of ", r.launch.group_items,
                 " vectors is more than the CUDA kernel indexes (2^31)");
  return r;
}

// A launch's scratch for the partial sums of the weights' gradient, from torch's allocator (none
// without them). data is null, or the tensor's.
struct NormScratch {
  std::optional<Output> tensor;
  void* data = nullptr;
};

inline NormScratch norm_scratch(const NormCall& c, const NormLaunch& L) {
  NormScratch s;
  const int64_t size = L.partial_rows * L.partial.length();
  if (size == 0) return s;
  const ScalarType stat = c.x.scalar_type() == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
  s.tensor.emplace(new_contiguous(Dims{&size, 1}, stat, c.x.device()));
  s.data = s.tensor->arg.mutable_data_ptr();
  return s;
}

// For a call with the weights' gradient: f(sum, grid) with its WeightGradSum over the scratch (in the
// compute type) and the grid of 1-D blocks of kMaxThreads it takes, one thread per column.
template <typename F>
void dispatch_weight_grad_sum(const NormCall& c, const NormCallLaunch& cl, const void* partial, F&& f) {
  const NormLaunch& L = cl.launch;
  const auto with = [&]<typename opmath_t>(std::type_identity<opmath_t>) {
    const WeightGradSum<opmath_t, DeviceMemory> t{static_cast<const opmath_t*>(partial),
                                                  static_cast<opmath_t*>(c.dweight->mutable_data_ptr()),
                                                  cl.plan.weight_len, L.groups > 0 ? L.grid_x : 0, L.block_y,
                                                  L.partial};
    f(t, std::max<int64_t>((cl.plan.weight_len + kMaxThreads - 1) / kMaxThreads, 1));
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
