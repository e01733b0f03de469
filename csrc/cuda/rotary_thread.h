// The CUDA kernel's per-thread work and its launch configuration, with no CUDA runtime
// dependency: nvcc compiles it into the kernel (csrc/cuda/rotary_cuda.cu) and the host
// compiler into the emulator (csrc/testing/host_emulation.cpp), which runs every block and thread
// of the launch the launcher would choose, on the CPU. Index math, bounds, vector/scalar
// choice and tails are thereby tested on a machine without a GPU.
#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "rope_ext/errors.h"
#include "rotary_math.h"
#include "rotary_plan.h"

#if defined(__CUDACC__)
#define ROPE_EXT_HOST_DEVICE __host__ __device__
#else
#define ROPE_EXT_HOST_DEVICE
#endif

namespace rope_ext::cuda {

constexpr int kVectorBytes = 16;   // one 128-bit load/store
constexpr int kMaxThreads = 256;   // threads per block
constexpr int64_t kMaxGridX = 2147483647;  // gridDim.x limit; the kernel loops beyond it
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kTargetBlocks = 2048;  // enough blocks to fill a large GPU

// A launch: grid (tokens x head groups), block (pair chunks x heads).
//   blockIdx.x  -> token (looping with stride grid_x)
//   blockIdx.y, threadIdx.y -> heads (looping with stride grid_y * block_y); with q and k in one
//                  launch (rotary_pos_qk, and rotary_qk with shared tables), q's heads and then k's
//   threadIdx.x -> chunk of `pairs_per_item` pairs of the row, or of pass-through columns
// A thread loads its chunk's cos/sin once per token and reuses it for all its heads.
struct RotaryLaunch {
  int64_t grid_x = 0, grid_y = 0;
  int64_t block_x = 0, block_y = 0;
  int64_t vec = 1;             // elements per load: 16 bytes' worth, or 1 (scalar path)
  int64_t pairs_per_item = 1;  // pairs one thread rotates per head
  int64_t rot_items = 0;       // items covering the rotary columns
  int64_t pass_items = 0;      // items covering the pass-through columns (vec columns each)
  bool table_vec = false;      // an item's table values in one load (see choose_launch)
  bool compact = false;        // rows addressed by CompactIndex (else PlanIndex)
};

// Where a thread is: CUDA's built-in indices in the kernel, the loop variables in the emulator.
struct ThreadCoord {
  int64_t bx, by, tx, ty;                    // blockIdx.x/y, threadIdx.x/y
  int64_t grid_x, grid_y, block_x, block_y;  // gridDim.x/y, blockDim.x/y
};

// Whether a launch loads each item's n table values (n > 1) with vector loads: unit column strides,
// bases aligned to n values, and n dividing the strides an item's start steps by: the caches' row
// strides where gathered, else every token stride of the full tables (`token_strides_ok`, the
// caller's: each plan holds them its own way). `ignore_alignment`: choose_launch's.
inline bool tables_vectorize(const TableLayout& p, int64_t n, bool token_strides_ok, const void* cos,
                             const void* sin, int64_t table_elem_size, bool ignore_alignment) {
  const auto aligned = [&](const void* t) {
    return ignore_alignment || reinterpret_cast<uintptr_t>(t) % (n * table_elem_size) == 0;
  };
  const bool strides_ok = p.gathered ? p.cos_row % n == 0 && p.sin_row % n == 0 : token_strides_ok;
  return n > 1 && p.cos_col == 1 && p.sin_col == 1 && (ignore_alignment || strides_ok) && aligned(cos) &&
         aligned(sin);
}

// One tensor of a launch: its plan and where its data is.
struct LaunchOperand {
  const RotaryPlan* plan;
  const void* x;
  const void* out;
};

// Chooses the launch for one or two operands (q and k share tokens and tables) covering `tokens`
// tokens and `heads` rows per token in all, given the element sizes and the data pointers (for
// alignment). The vector path (16 bytes of x, or 8 where the tables are float32 and x 16-bit: see
// vec_elems) needs contiguous rows, 16-byte aligned row starts, and a rotary and pass-through width
// that split into whole vectors, for every operand; anything else takes the scalar path. The tables
// are loaded a whole item at a time (table_vec) when their columns are contiguous and each item's
// values are aligned: for gathered caches, the row stride and the bases; for full tables, the bases
// and every token stride of every operand's plan (q and k number their tokens alike and read the
// same entries, but each plan collapses its token dims by its own strides, so each is checked as it
// is; the item's columns start at a multiple of its width, and half-split's second members at r/2,
// a multiple too). `ignore_alignment` (the host emulator's tests only)
// skips the pointer and stride alignment checks, so that the emulator can show it catches what a
// misaligned vector access would do on a GPU.
inline RotaryLaunch choose_launch(std::initializer_list<LaunchOperand> operands, int64_t tokens, int64_t heads,
                                  int64_t elem_size, bool interleaved, const void* cos = nullptr,
                                  const void* sin = nullptr, int64_t table_elem_size = 0,
                                  bool ignore_alignment = false) {
  const auto aligned = [ignore_alignment](const void* p, int64_t bytes) {
    return ignore_alignment || reinterpret_cast<uintptr_t>(p) % bytes == 0;
  };
  RotaryLaunch L;
  const RotaryPlan& p = *operands.begin()->plan;
  const int64_t half = p.rotary_dim / 2;
  const int64_t pass = p.head_dim - p.rotary_dim;
  const int64_t e = kVectorBytes / std::max(elem_size, table_elem_size);  // vec_elems
  bool vec_ok = e >= 2 && (interleaved ? p.rotary_dim % e == 0 : half % e == 0) && pass % e == 0;
  for (const LaunchOperand& o : operands) {
    const RotaryPlan& q = *o.plan;
    vec_ok = vec_ok && q.x_col == 1 && q.out_col == 1 && aligned(o.x, e * elem_size) && aligned(o.out, e * elem_size);
    for (int d = 0; vec_ok && !ignore_alignment && d < q.tokens.ndim; ++d)
      vec_ok = q.tokens.strides[kX][d] % e == 0 && q.tokens.strides[kOut][d] % e == 0;
    for (int d = 0; vec_ok && !ignore_alignment && d < q.heads.ndim; ++d)
      vec_ok = q.heads.strides[kX][d] % e == 0 && q.heads.strides[kOut][d] % e == 0;
  }

  L.vec = vec_ok ? e : 1;
  L.pairs_per_item = vec_ok ? (interleaved ? e / 2 : e) : 1;
  L.rot_items = half / L.pairs_per_item;
  L.pass_items = pass / L.vec;
  // Table values per vector load: an item's pairs (gathered), or its columns (full tables).
  const int64_t n = p.gathered ? L.pairs_per_item : L.vec;
  bool token_strides_ok = true;
  for (const LaunchOperand& o : operands) {
    const StridedDims<4>& t = o.plan->tokens;
    for (int d = 0; d < t.ndim; ++d)
      token_strides_ok = token_strides_ok && t.strides[kCos][d] % n == 0 && t.strides[kSin][d] % n == 0;
  }
  L.table_vec = tables_vectorize(p, n, token_strides_ok, cos, sin, table_elem_size, ignore_alignment);
  const int64_t items = L.rot_items + L.pass_items;
  L.block_x = std::max<int64_t>(1, std::min<int64_t>(items, kMaxThreads));
  L.block_y = std::max<int64_t>(1, std::min<int64_t>(heads, kMaxThreads / L.block_x));
  L.grid_x = std::max<int64_t>(1, std::min(tokens, kMaxGridX));
  const int64_t head_groups = (heads + L.block_y - 1) / L.block_y;
  L.grid_y = std::max<int64_t>(
      1, std::min({head_groups, kMaxGridY, std::max<int64_t>(1, kTargetBlocks / L.grid_x)}));
  return L;
}

// Every global memory access of the thread function goes through its Memory policy, which names the
// access site: one per load or store instruction of the thread function, in program order (a
// site inside rotate_row or copy_row exists once per operand, O * kSiteCount + site). The kernel's
// policy, DeviceMemory, is a plain dereference, inlined: nvcc compiles what the bare expression
// would give. The host emulator's (csrc/testing/host_emulation.cpp) checks that every address is
// aligned to its access width, as a GPU requires, and can record the addresses of every warp for
// its memory traffic model; at_item tells it which loop iteration the accesses belong to.
enum AccessSite : int {
  kSitePosition,  // the token's position (gathered tables)
  kSiteCos1,      // table values of the item's pairs: at their first members, or all of them
  kSiteSin1,
  kSiteCos2,      // ... at their second members (full tables, half-split)
  kSiteSin2,
  kSiteX1,  // x: the pairs' first members (or the whole interleaved item)
  kSiteX2,  // x: their second members (half-split, or scalar)
  kSiteOut1,
  kSiteOut2,
  kSitePassLoad,  // pass-through columns
  kSitePassStore,
  // qk_norm_rotary's (qk_norm_thread.h), besides x, out and the tables above:
  kSiteWeight1,       // the norm weight at the pairs' first members (or a pass-through run)
  kSiteWeight2,       // ... at their second members
  kSiteGrad1,         // the backward's dy, as x1 and x2
  kSiteGrad2,
  kSiteRstdLoad,      // the saved statistic (backward)
  kSiteRstdStore,     // the statistic (forward)
  kSitePartialLoad1,  // the weights' gradient: a block's partial sums, read
  kSitePartialLoad2,  // ... and the biases'
  kSitePartialStore1, // ... and written
  kSitePartialStore2,
  kSiteWeightGrad,    // the weights' gradient, summed over the blocks
  kSiteBias1,         // the norm's bias, as weight1 and weight2
  kSiteBias2,
  kSiteCount
};

struct DeviceMemory {
  ROPE_HD static void at_item(int64_t /*token*/, int64_t /*item*/) {}
  template <int kSite, class V>
  ROPE_HD static V load(const V* p) {
    return *p;
  }
  template <int kSite, class V>
  ROPE_HD static void store(V* p, const V& v) {
    *p = v;
  }
};

template <typename T, int N>
struct alignas(sizeof(T) * N) VecOf {
  T v[N];
};

// Pairs per item of a thread function: a vector of kVec columns holds kVec/2 interleaved pairs, or
// kVec first members (with their kVec second members half a row away) for half-split; 1 on the
// scalar path.
template <int kVec, bool kInterleaved>
constexpr int pairs_per_vec() {
  return kVec == 1 ? 1 : (kInterleaved ? kVec / 2 : kVec);
}

// kN values of T from p at column stride col, widened into v: in loads of at most 16 bytes where
// `vector` (col 1, p aligned to one load's width), else one element at a time. Every load goes
// through Mem at kSite.
template <int kN, int kSite, class Mem, typename T, typename U>
ROPE_HD void load_run(const T* p, int64_t col, bool vector, U (&v)[kN]) {
  constexpr int kPiece = kN < kVectorBytes / static_cast<int>(sizeof(T)) ? kN : kVectorBytes / static_cast<int>(sizeof(T));
  if constexpr (kPiece > 1) {
    if (vector) {
      for (int i = 0; i < kN; i += kPiece) {
        const auto w = Mem::template load<kSite>(reinterpret_cast<const VecOf<T, kPiece>*>(p + i));
        for (int j = 0; j < kPiece; ++j) v[i + j] = static_cast<U>(w.v[j]);
      }
      return;
    }
  }
  for (int j = 0; j < kN; ++j) v[j] = static_cast<U>(Mem::template load<kSite>(p + j * col));
}

// The values of pairs [pair0, pair0 + kPairs) of a row p (column stride col, r = 2 * half rotary
// columns): v1 at the pairs' first members, v2 at their second. Where `vector` (kVec > 1, contiguous
// columns, aligned), one run of kVec columns from 2 * pair0 (interleaved: the members alternate) or
// two runs of kPairs, from pair0 and half + pair0 (half-split); else one element at a time. x, out,
// grad, full-form tables and the norm weight all hold their pairs this way.
template <int kVec, bool kInterleaved, int kSite1, int kSite2, class Mem, typename T, typename U,
          int kPairs = pairs_per_vec<kVec, kInterleaved>()>
ROPE_HD void load_pairs(const T* p, int64_t col, int64_t half, int64_t pair0, bool vector, U (&v1)[kPairs],
                        U (&v2)[kPairs]) {
  if constexpr (kVec > 1) {
    if (vector) {
      if constexpr (kInterleaved) {
        U v[kVec];
        load_run<kVec, kSite1, Mem>(p + 2 * pair0, 1, true, v);
        for (int j = 0; j < kPairs; ++j) {
          v1[j] = v[2 * j];
          v2[j] = v[2 * j + 1];
        }
      } else {
        load_run<kPairs, kSite1, Mem>(p + pair0, 1, true, v1);
        load_run<kPairs, kSite2, Mem>(p + half + pair0, 1, true, v2);
      }
      return;
    }
  }
  for (int j = 0; j < kPairs; ++j) {
    v1[j] = static_cast<U>(Mem::template load<kSite1>(p + pair_first(pair0 + j, half, kInterleaved) * col));
    v2[j] = static_cast<U>(Mem::template load<kSite2>(p + pair_second(pair0 + j, half, kInterleaved) * col));
  }
}

// The inverse of load_run: kN values rounded to T and stored (vector: in pieces of at most 16 bytes).
template <int kN, int kSite, class Mem, typename T, typename U>
ROPE_HD void store_run(T* p, int64_t col, bool vector, const U (&v)[kN]) {
  constexpr int kPiece = kN < kVectorBytes / static_cast<int>(sizeof(T)) ? kN : kVectorBytes / static_cast<int>(sizeof(T));
  if constexpr (kPiece > 1) {
    if (vector) {
      for (int i = 0; i < kN; i += kPiece) {
        VecOf<T, kPiece> w;
        for (int j = 0; j < kPiece; ++j) w.v[j] = static_cast<T>(v[i + j]);
        Mem::template store<kSite>(reinterpret_cast<VecOf<T, kPiece>*>(p + i), w);
      }
      return;
    }
  }
  for (int j = 0; j < kN; ++j) Mem::template store<kSite>(p + j * col, static_cast<T>(v[j]));
}

// The inverse of load_pairs: o1 and o2 rounded to T and stored at the pairs' members.
template <int kVec, bool kInterleaved, int kSite1, int kSite2, class Mem, typename T, typename U,
          int kPairs = pairs_per_vec<kVec, kInterleaved>()>
ROPE_HD void store_pairs(T* p, int64_t col, int64_t half, int64_t pair0, bool vector, const U (&o1)[kPairs],
                         const U (&o2)[kPairs]) {
  if constexpr (kVec > 1) {
    if (vector) {
      if constexpr (kInterleaved) {
        U v[kVec];
        for (int j = 0; j < kPairs; ++j) {
          v[2 * j] = o1[j];
          v[2 * j + 1] = o2[j];
        }
        store_run<kVec, kSite1, Mem>(p + 2 * pair0, 1, true, v);
      } else {
        store_run<kPairs, kSite1, Mem>(p + pair0, 1, true, o1);
        store_run<kPairs, kSite2, Mem>(p + half + pair0, 1, true, o2);
      }
      return;
    }
  }
  for (int j = 0; j < kPairs; ++j) {
    Mem::template store<kSite1>(p + pair_first(pair0 + j, half, kInterleaved) * col, static_cast<T>(o1[j]));
    Mem::template store<kSite2>(p + pair_second(pair0 + j, half, kInterleaved) * col, static_cast<T>(o2[j]));
  }
}

// How the thread function finds a row: two index types it is templated on, with one interface.
//   token<O>(t, off): operand O's x and out offsets of token t, and (kCos, kSin) the offsets of its
//                     table entries (full tables) or of its position (gathered);
//   head<O>(h, off):  operand O's x and out offsets of its head h within a token.
// Operands are 0 (x or q) and 1 (k); O is a template argument, so no array is indexed at run time
// (such arrays live in local memory, which cuda-check refuses).

// n / d for 64-bit values, one quotient bit per step (restoring division), as plain inline code:
// nvcc's 64-bit '/' is a call to a subroutine, around which it saved a live register to the stack
// in some kernels on sm_80 (a local store and load per thread, which cuda-check refuses). Only
// launches of 2^32 tokens or more take it, where 64 steps per token are nothing against the data.
ROPE_EXT_HOST_DEVICE inline uint64_t divide_u64(uint64_t n, uint64_t d) {
  uint64_t q = 0, r = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
  for (int bit = 63; bit >= 0; --bit) {
    r = (r << 1) | ((n >> bit) & 1);
    if (r >= d) {
      r -= d;
      q |= uint64_t{1} << bit;
    }
  }
  return q;
}

// Any layout: both operands' RotaryPlans, any rank and strides, ~3.5 KB of kernel parameters, and a
// division per dim for each token and head. Calls whose layout CompactIndex cannot describe use it.
struct PlanIndex {
  RotaryPlan p[2];
  int64_t heads0 = 0, heads = 0;  // operand 0's heads, and both operands'

  ROPE_EXT_HOST_DEVICE int64_t tokens() const { return p[0].tokens.numel(); }
  template <int O>
  ROPE_EXT_HOST_DEVICE void token(int64_t t, int64_t (&off)[4]) const {
    p[O].tokens.offsets(t, off);
  }
  template <int O>
  ROPE_EXT_HOST_DEVICE void head(int64_t h, int64_t (&off)[2]) const {
    p[O].heads.offsets(h, off);
  }
  template <int O>
  ROPE_EXT_HOST_DEVICE int64_t x_col() const {
    return p[O].x_col;
  }
  template <int O>
  ROPE_EXT_HOST_DEVICE int64_t out_col() const {
    return p[O].out_col;
  }
  ROPE_EXT_HOST_DEVICE int64_t rotary_dim() const { return p[0].rotary_dim; }
  ROPE_EXT_HOST_DEVICE int64_t cos_col() const { return p[0].cos_col; }
  ROPE_EXT_HOST_DEVICE int64_t sin_col() const { return p[0].sin_col; }
  ROPE_EXT_HOST_DEVICE int64_t cos_row() const { return p[0].cos_row; }
  ROPE_EXT_HOST_DEVICE int64_t sin_row() const { return p[0].sin_row; }
  ROPE_EXT_HOST_DEVICE int64_t cache_rows() const { return p[0].cache_rows; }
};

// A call's rows in 168 bytes, so that its kernel's parameters stay under 256 bytes: at most two token
// dims and one head dim per operand once dims are collapsed and outer broadcast dims (the batch of
// (B, S, H, D) under (S, 1) positions or (S, 1, r) tables) are counted as tokens; unit column
// strides; gathered, one row stride for both caches; full tables, one set of token strides for cos
// and sin. Nearly every layout rotary_pos and rotary see qualifies (compact_index decides): HF's
// (B, S, r) tables broadcast over heads, (S, r) tables shared over the batch, packed tokens.
struct CompactIndex {
  int64_t num_tokens = 0;
  int64_t inner = 1;          // size of the inner token dim: token t = (t / inner, t % inner)
  int64_t tok[2][2][2] = {};  // token strides [operand][x, out][outer, inner]
  int64_t pos[2] = {};        // token strides [outer, inner] of the positions, or of cos and sin
  int64_t hd[2][2] = {};      // head stride [operand][x, out]
  int64_t row = 0;            // gathered: both caches' row stride
  int64_t rows = 0;           // gathered: cache rows
  int64_t heads0 = 0, heads = 0;
  int64_t half = 0;           // rotary_dim / 2

  ROPE_EXT_HOST_DEVICE int64_t tokens() const { return num_tokens; }
  template <int O>
  ROPE_EXT_HOST_DEVICE void token(int64_t t, int64_t (&off)[4]) const {
    // A 32-bit division where the values allow (almost always): 64-bit division is a long
    // instruction sequence on a GPU.
    const int64_t o = ((t | inner) >> 32) == 0 ? int64_t{static_cast<uint32_t>(t) / static_cast<uint32_t>(inner)}
                                                : static_cast<int64_t>(divide_u64(t, inner));
    const int64_t i = t - o * inner;
    off[kX] = o * tok[O][0][0] + i * tok[O][0][1];
    off[kOut] = o * tok[O][1][0] + i * tok[O][1][1];
    off[kCos] = off[kSin] = o * pos[0] + i * pos[1];
  }
  template <int O>
  ROPE_EXT_HOST_DEVICE void head(int64_t h, int64_t (&off)[2]) const {
    off[kX] = h * hd[O][0];
    off[kOut] = h * hd[O][1];
  }
  template <int O>
  ROPE_EXT_HOST_DEVICE int64_t x_col() const {
    return 1;
  }
  template <int O>
  ROPE_EXT_HOST_DEVICE int64_t out_col() const {
    return 1;
  }
  ROPE_EXT_HOST_DEVICE int64_t rotary_dim() const { return 2 * half; }
  ROPE_EXT_HOST_DEVICE int64_t cos_col() const { return 1; }
  ROPE_EXT_HOST_DEVICE int64_t sin_col() const { return 1; }
  ROPE_EXT_HOST_DEVICE int64_t cos_row() const { return row; }
  ROPE_EXT_HOST_DEVICE int64_t sin_row() const { return row; }
  ROPE_EXT_HOST_DEVICE int64_t cache_rows() const { return rows; }
};

// The CompactIndex of a call, or nullopt where its layout needs PlanIndex. Dims of x (q) along which
// the positions (gathered) or the tables (full) vary are token dims; the others are broadcast dims.
// Adjacent dims that every operand (q, q_out, k, k_out, and positions or tables for tokens) steps
// through as one are merged;
// of the broadcast dims left, the one where q and k differ in size (GQA/MQA) or else the innermost
// is the head dim, and the rest become token dims with position stride 0.
inline std::optional<CompactIndex> compact_index(const RotaryCall& c) {
  constexpr int kOps = 4;  // q, q_out, k, k_out
  const TensorArg* t[kOps] = {&c.x, &c.out, c.k ? c.k : &c.x, c.k ? c.k_out : &c.out};
  const TensorArg& cc = c.cos;
  const TensorArg& sc = c.sin;
  const auto unit = [](const TensorArg& a, int64_t d) { return a.size(d) <= 1 || a.stride(d) == 1; };
  for (const TensorArg* a : t) {
    if (!unit(*a, -1)) return std::nullopt;
  }
  // What varies along the token dims: the positions, or the tables. Its stride along x's dim d, as
  // broadcast over x.shape[:-1] (read only where x.size(d) > 1).
  const int64_t lead = c.x.dim() - 1;
  const auto varying_stride = [&](int64_t d) {
    return c.positions != nullptr ? broadcast_stride(*c.positions, d, lead) : broadcast_stride(cc, d, lead + 1);
  };
  if (c.positions != nullptr) {
    if (!unit(cc, 1) || !unit(sc, 1) || cc.stride(0) != sc.stride(0)) return std::nullopt;
  } else {
    if (!unit(cc, -1) || !unit(sc, -1)) return std::nullopt;
    for (int64_t d = 0; d < lead; ++d) {
      if (c.x.size(d) > 1 && broadcast_stride(cc, d, lead + 1) != broadcast_stride(sc, d, lead + 1)) {
        return std::nullopt;  // one offset for both
      }
    }
  }
  struct Dim {
    int64_t size[kOps];
    int64_t stride[kOps + 1];  // the operands', then the positions' or tables' (0 for a broadcast dim)
  };
  std::vector<std::pair<int64_t, Dim>> token_dims, bcast_dims;  // (x's dim, dim)
  for (int64_t d = 0; d + 1 < c.x.dim(); ++d) {
    Dim m{};
    bool trivial = true;
    for (int j = 0; j < kOps; ++j) {
      m.size[j] = t[j]->size(d);
      m.stride[j] = t[j]->stride(d);
      trivial = trivial && m.size[j] == 1;
    }
    if (trivial) continue;
    m.stride[kOps] = m.size[0] == 1 ? 0 : varying_stride(d);
    if (m.stride[kOps] != 0 && (m.size[1] != m.size[0] || m.size[2] != m.size[0] || m.size[3] != m.size[0])) {
      return std::nullopt;  // a token dim that the operands do not share (refused by the checks)
    }
    (m.stride[kOps] != 0 ? token_dims : bcast_dims).emplace_back(d, m);
  }
  // Merges adjacent dims (in x's order) that every operand steps through as one.
  const auto collapse = [](std::vector<std::pair<int64_t, Dim>>& dims, int n_strides) {
    std::vector<std::pair<int64_t, Dim>> merged;
    for (const auto& [d, m] : dims) {
      bool merge = !merged.empty();
      for (int j = 0; merge && j < n_strides; ++j) {
        const Dim& prev = merged.back().second;
        merge = prev.stride[j] == m.stride[j] * m.size[j < kOps ? j : 0];
      }
      if (merge) {
        Dim& prev = merged.back().second;
        for (int j = 0; j < kOps; ++j) prev.size[j] *= m.size[j];
        for (int j = 0; j < n_strides; ++j) prev.stride[j] = m.stride[j];
      } else {
        merged.emplace_back(d, m);
      }
    }
    dims = std::move(merged);
  };
  collapse(bcast_dims, kOps);
  // The head dim: where q's and k's sizes differ, else the innermost; the others become tokens.
  int head = static_cast<int>(bcast_dims.size()) - 1;
  for (int i = 0; i < static_cast<int>(bcast_dims.size()); ++i) {
    if (bcast_dims[i].second.size[0] != bcast_dims[i].second.size[2]) head = i;
  }
  for (int i = 0; i < static_cast<int>(bcast_dims.size()); ++i) {
    if (i == head) continue;
    const Dim& m = bcast_dims[i].second;
    if (m.size[0] != m.size[2]) return std::nullopt;  // q and k differ in two dims
    token_dims.push_back(bcast_dims[i]);
  }
  std::sort(token_dims.begin(), token_dims.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  collapse(token_dims, kOps + 1);
  if (token_dims.size() > 2) return std::nullopt;

  CompactIndex ix;
  const int64_t hq = head >= 0 ? bcast_dims[head].second.size[0] : 1;
  const int64_t hk = c.k == nullptr ? 0 : head >= 0 ? bcast_dims[head].second.size[2] : 1;
  ix.heads0 = hq;
  ix.heads = hq + hk;
  for (int o = 0; o < 2 && head >= 0; ++o) {
    for (int j = 0; j < 2; ++j) ix.hd[o][j] = bcast_dims[head].second.stride[2 * o + j];
  }
  ix.num_tokens = 1;
  const size_t first = token_dims.size() == 2 ? 0 : 1;  // slot of token_dims[0]: outer or inner
  for (size_t i = 0; i < token_dims.size(); ++i) {
    const Dim& m = token_dims[i].second;
    const size_t slot = first + i;
    ix.num_tokens *= m.size[0];
    if (slot == 1) ix.inner = m.size[0];
    for (int o = 0; o < 2; ++o) {
      for (int j = 0; j < 2; ++j) ix.tok[o][j][slot] = m.stride[2 * o + j];
    }
    ix.pos[slot] = m.stride[kOps];
  }
  if (c.positions != nullptr) {
    ix.row = cc.stride(0);
    ix.rows = cc.size(0);
    ix.half = cc.size(1);
  } else {
    ix.half = cc.size(-1) / 2;
  }
  return ix;
}


// opmath: float for float/half/bfloat16, double for double.
template <typename T>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};

// The check of a gathered position against the cache's rows. In device code it prints the position
// and the row count, then asserts (CUDA_KERNEL_ASSERT alone would name only the condition): the
// printf's two 64-bit arguments are the one 16-byte stack frame that cuda-check allows, written only
// on this failing path. In the host emulation (csrc/testing/host_emulation.cpp), which runs this code
// on the CPU and must report, not abort, it is an exception saying the same.
#if defined(__CUDA_ARCH__)
#define ROPE_EXT_POSITION_CHECK(pos, rows)                                                                  \
  if (__builtin_expect(!((pos) >= 0 && (pos) < (rows)), 0)) {                                               \
    printf("rope_ext: position %lld is outside the cache of %lld rows (size it for the positions you "      \
           "pass: RotaryEmbedding(max_position_embeddings=...) or .ensure_positions(n))\n",               \
           static_cast<long long>(pos), static_cast<long long>(rows));                                      \
    __assert_fail("position in [0, rows)", __FILE__, __LINE__, __func__); /* as CUDA_KERNEL_ASSERT */       \
  }
#else
#define ROPE_EXT_POSITION_CHECK(pos, rows)                                                                  \
  ROPE_EXT_CHECK((pos) >= 0 && (pos) < (rows), ROPE_EXT_POSITION_OUTSIDE_CACHE "position ", pos,             \
                 " is outside the cache, whose ", rows, " rows hold positions 0 to ", (rows) - 1)
#endif

// Where a kernel reads gathered tables (TableLayout's gathered fields, as the thread holds them).
struct CacheRead {
  int64_t cos_row, sin_row, cos_col, sin_col, rows;
};

// Gathered tables, for every op family's kernel: the cache rows at the position stored at
// positions + at (int32 or int64), checked against the cache's rows before any row is read, for the
// kPairs pairs from pair0 (column i serves both members of pair i).
template <int kPairs, class Mem, typename table_t, typename opmath_t>
ROPE_HD void load_cache_rows(const table_t* cos, const table_t* sin, const void* positions, bool positions_int32,
                             int64_t at, const CacheRead& c, int64_t pair0, bool table_vec, opmath_t (&c1)[kPairs],
                             opmath_t (&s1)[kPairs]) {
  const int64_t pos = positions_int32
                          ? int64_t{Mem::template load<kSitePosition>(static_cast<const int32_t*>(positions) + at)}
                          : Mem::template load<kSitePosition>(static_cast<const int64_t*>(positions) + at);
  ROPE_EXT_POSITION_CHECK(pos, c.rows);
  load_run<kPairs, kSiteCos1, Mem>(cos + pos * c.cos_row + pair0 * c.cos_col, c.cos_col, table_vec, c1);
  load_run<kPairs, kSiteSin1, Mem>(sin + pos * c.sin_row + pair0 * c.sin_col, c.sin_col, table_vec, s1);
}

// The plans, the compact index (if the layout allows and `allow_compact`) and the launch of a
// RotaryCall, for checked arguments (shared by the CUDA launcher and the host emulator).
struct CallLaunch {
  RotaryPlan plan, k_plan;
  std::optional<CompactIndex> compact;
  RotaryLaunch launch;
};

// (`ignore_alignment`: see choose_launch.)
inline CallLaunch plan_call(const RotaryCall& c, bool allow_compact = true, bool ignore_alignment = false) {
  CallLaunch r;
  const auto make = [&](const TensorArg& x, const TensorArg& out) {
    return make_rotary_plan(x, out, c.cos, c.sin, c.positions);
  };
  r.plan = make(c.x, c.out);
  if (c.k != nullptr) {
    r.k_plan = make(*c.k, *c.k_out);
    // One launch walks both operands' tokens with one index and their rows with q's items (the
    // callers' checks ensure both: the tables or positions broadcast over q and k alike, and
    // rotary_qk_one_call / check_qk_args give them one head dim).
    ROPE_EXT_CHECK(r.k_plan.tokens.numel() == r.plan.tokens.numel() && r.k_plan.head_dim == r.plan.head_dim, c.op,
                ": internal error: q and k in one launch must share their tokens and head dim, got ",
                r.plan.tokens.numel(), " and ", r.k_plan.tokens.numel(), " tokens, head dims ", r.plan.head_dim,
                " and ", r.k_plan.head_dim);
  }
  if (allow_compact) r.compact = compact_index(c);
  const int64_t tokens = r.compact ? r.compact->num_tokens : r.plan.tokens.numel();
  const int64_t heads = r.compact ? r.compact->heads
                                  : r.plan.heads.numel() + (c.k != nullptr ? r.k_plan.heads.numel() : 0);
  const LaunchOperand q{&r.plan, c.x.const_data_ptr(), c.out.const_data_ptr()};
  const auto choose = [&](std::initializer_list<LaunchOperand> operands) {
    return choose_launch(operands, tokens, heads, c.x.element_size(), c.interleaved, c.cos.const_data_ptr(),
                         c.sin.const_data_ptr(), c.cos.element_size(), ignore_alignment);
  };
  r.launch = c.k != nullptr ? choose({q, {&r.k_plan, c.k->const_data_ptr(), c.k_out->const_data_ptr()}})
                            : choose({q});
  r.launch.compact = r.compact.has_value();
  return r;
}

// The work of one thread of a launch. kVec is the launch's `vec` (1: scalar path). kGathered: the
// tables are half-width caches read at each token's position (rotary_pos*), else full tables.
// The transpose (conjugate) is a runtime flag: rotate_pair's transpose is its forward form with
// (s1, s2) replaced by (-s2, -s1), which gives the same roundings (negation is exact, and a - b is
// a + (-b)), so one kernel serves both and the number of kernels stays what it was before full
// tables had two indexes. Mem: the memory access policy (DeviceMemory in the kernel). Index:
// PlanIndex or CompactIndex.
template <typename scalar_t, typename table_t, bool kInterleaved, int kVec, bool kGathered, class Mem, class Index>
struct RotaryThread {
  using opmath_t = typename OpMath<scalar_t>::type;
  // The same thread function with another memory policy (the host emulator's).
  template <class M>
  using WithMemory = RotaryThread<scalar_t, table_t, kInterleaved, kVec, kGathered, M, Index>;

  // Host side: the thread function of a planned call.
  static RotaryThread make(const RotaryCall& c, const CallLaunch& cl) {
    RotaryThread t{};
    if constexpr (std::is_same_v<Index, CompactIndex>) {
      t.idx = *cl.compact;
    } else {
      t.idx.p[0] = cl.plan;
      t.idx.heads0 = t.idx.heads = cl.plan.heads.numel();
      if (c.k != nullptr) {
        t.idx.p[1] = cl.k_plan;
        t.idx.heads += cl.k_plan.heads.numel();
      }
    }
    t.x[0] = c.x.const_data_ptr<scalar_t>();
    t.out[0] = c.out.mutable_data_ptr<scalar_t>();
    if (c.k != nullptr) {
      t.x[1] = c.k->const_data_ptr<scalar_t>();
      t.out[1] = c.k_out->mutable_data_ptr<scalar_t>();
    }
    t.cos = c.cos.const_data_ptr<table_t>();
    t.sin = c.sin.const_data_ptr<table_t>();
    t.positions = c.positions ? c.positions->const_data_ptr() : nullptr;
    t.rot_items = cl.launch.rot_items;
    t.pass_items = cl.launch.pass_items;
    t.positions_int32 = c.positions && c.positions->scalar_type() == ScalarType::Int;
    t.table_vec = cl.launch.table_vec;
    t.conjugate = c.conjugate;
    return t;
  }

  static constexpr int kPairs = pairs_per_vec<kVec, kInterleaved>();

  Index idx;
  const scalar_t* x[2];
  scalar_t* out[2];
  const table_t* cos;
  const table_t* sin;
  const void* positions;          // gathered: int32 or int64
  int64_t rot_items, pass_items;  // the launch's
  bool positions_int32;
  bool table_vec;                 // the launch's
  bool conjugate;                 // the transpose (see above)

  ROPE_EXT_HOST_DEVICE void operator()(const ThreadCoord& g) const {
    const int64_t tokens = idx.tokens();
    // A second operand (k): rotary_pos_qk, and rotary_qk where q and k share tables. k's token
    // offsets only where it has heads; its table entries are q's (the same token of the same tables).
    const bool two = idx.heads > idx.heads0;
    for (int64_t token = g.bx; token < tokens; token += g.grid_x) {
      int64_t t0[4], t1[4] = {};
      idx.template token<0>(token, t0);
      if (two) idx.template token<1>(token, t1);
      for (int64_t item = g.tx; item < rot_items + pass_items; item += g.block_x) {
        Mem::at_item(token, item);
        if (item < rot_items) {
          rotate_item(item, t0, t1, g);
        } else {
          copy_item(item - rot_items, t0, t1, g);
        }
      }
    }
  }

 private:
  // Operand O's instance of a site in rotate_row or copy_row (each is compiled once per operand).
  template <int O>
  static constexpr int site(AccessSite s) {
    return O * kSiteCount + s;
  }

  // This token's table entries for the item's pairs: (c1, s1) at their first members, (c2, s2) at
  // their second; with conjugate, (-s2, -s1) in place of (s1, s2). These helpers are force-inlined:
  // a device call taking arrays by reference puts them on the stack (nvcc left the 16-bit
  // interleaved kernels with 8 to 16 bytes of stack when it chose not to inline).
  ROPE_HD void load_tables(int64_t pair0, const int64_t (&tok)[4], opmath_t (&c1)[kPairs],
                                   opmath_t (&s1)[kPairs], opmath_t (&c2)[kPairs], opmath_t (&s2)[kPairs]) const {
    if constexpr (kGathered) {
      load_gathered(pair0, tok, c1, s1);
      for (int j = 0; j < kPairs; ++j) {
        c2[j] = c1[j];
        s2[j] = s1[j];
      }
    } else {
      load_full_tables(pair0, tok, c1, s1, c2, s2);
    }
    if (conjugate) {
      for (int j = 0; j < kPairs; ++j) {
        const opmath_t t = s1[j];
        s1[j] = -s2[j];
        s2[j] = -t;
      }
    }
  }

  // Gathered: the cache rows at the token's position, column i serving both members of pair i.
  ROPE_HD void load_gathered(int64_t pair0, const int64_t (&tok)[4], opmath_t (&c1)[kPairs],
                             opmath_t (&s1)[kPairs]) const {
    const CacheRead read{idx.cos_row(), idx.sin_row(), idx.cos_col(), idx.sin_col(), idx.cache_rows()};
    load_cache_rows<kPairs, Mem>(cos, sin, positions, positions_int32, tok[kCos], read, pair0, table_vec, c1, s1);
  }

  // Full tables: the token's row, at both members' columns (as load_pairs reads a row).
  ROPE_HD void load_full_tables(int64_t pair0, const int64_t (&tok)[4], opmath_t (&c1)[kPairs],
                                        opmath_t (&s1)[kPairs], opmath_t (&c2)[kPairs],
                                        opmath_t (&s2)[kPairs]) const {
    const int64_t half = idx.rotary_dim() / 2;
    load_pairs<kVec, kInterleaved, kSiteCos1, kSiteCos2, Mem>(cos + tok[kCos], idx.cos_col(), half, pair0, table_vec,
                                                              c1, c2);
    load_pairs<kVec, kInterleaved, kSiteSin1, kSiteSin2, Mem>(sin + tok[kSin], idx.sin_col(), half, pair0, table_vec,
                                                              s1, s2);
  }

  // The item's pairs of every head this thread covers: q's heads, then k's (heads h - heads0).
  ROPE_EXT_HOST_DEVICE void rotate_item(int64_t item, const int64_t (&t0)[4], const int64_t (&t1)[4],
                                   const ThreadCoord& g) const {
    const int64_t step = g.grid_y * g.block_y;
    int64_t h = g.by * g.block_y + g.ty;
    // A thread past the last head (in the last head group, where q's and k's heads together do not
    // fill it: 40 heads in blocks of 32) reads no tables, so that its warp issues no loads at all.
    if (h >= idx.heads) return;
    // This token's table entries for the item's pairs: loaded once, reused for every head.
    opmath_t c1[kPairs], s1[kPairs], c2[kPairs], s2[kPairs];
    const int64_t pair0 = item * kPairs;
    load_tables(pair0, t0, c1, s1, c2, s2);
    for (; h < idx.heads0; h += step) rotate_row<0>(h, t0, pair0, c1, s1, c2, s2);
    for (; h < idx.heads; h += step) rotate_row<1>(h - idx.heads0, t1, pair0, c1, s1, c2, s2);
  }

  template <int O>
  ROPE_EXT_HOST_DEVICE void rotate_row(int64_t h, const int64_t (&tok)[4], int64_t pair0, const opmath_t (&c1)[kPairs],
                                  const opmath_t (&s1)[kPairs], const opmath_t (&c2)[kPairs],
                                  const opmath_t (&s2)[kPairs]) const {
    const int64_t half = idx.rotary_dim() / 2;
    int64_t hd[2];
    idx.template head<O>(h, hd);
    const scalar_t* xr = x[O] + tok[kX] + hd[kX];
    scalar_t* outr = out[O] + tok[kOut] + hd[kOut];
    opmath_t x1[kPairs], x2[kPairs], o1[kPairs], o2[kPairs];
    load_pairs<kVec, kInterleaved, site<O>(kSiteX1), site<O>(kSiteX2), Mem>(xr, idx.template x_col<O>(), half, pair0,
                                                                            true, x1, x2);
    for (int j = 0; j < kPairs; ++j) {
      rotate_pair<false>(x1[j], x2[j], c1[j], s1[j], c2[j], s2[j], o1[j], o2[j]);
    }
    store_pairs<kVec, kInterleaved, site<O>(kSiteOut1), site<O>(kSiteOut2), Mem>(outr, idx.template out_col<O>(), half,
                                                                                 pair0, true, o1, o2);
  }

  // Pass-through columns [r + item*kVec, r + (item+1)*kVec) of every head: copied, unless in place.
  ROPE_EXT_HOST_DEVICE void copy_item(int64_t item, const int64_t (&t0)[4], const int64_t (&t1)[4],
                                 const ThreadCoord& g) const {
    const int64_t step = g.grid_y * g.block_y;
    int64_t h = g.by * g.block_y + g.ty;
    for (; h < idx.heads0; h += step) copy_row<0>(h, t0, item);
    for (; h < idx.heads; h += step) copy_row<1>(h - idx.heads0, t1, item);
  }

  template <int O>
  ROPE_EXT_HOST_DEVICE void copy_row(int64_t h, const int64_t (&tok)[4], int64_t item) const {
    int64_t hd[2];
    idx.template head<O>(h, hd);
    const scalar_t* xr = x[O] + tok[kX] + hd[kX];
    scalar_t* outr = out[O] + tok[kOut] + hd[kOut];
    const int64_t xc = idx.template x_col<O>(), oc = idx.template out_col<O>();
    if (xr == outr && xc == oc) return;  // in place: already there
    const int64_t c = idx.rotary_dim() + item * kVec;
    if constexpr (kVec == 1) {
      const scalar_t v = Mem::template load<site<O>(kSitePassLoad)>(xr + c * xc);
      Mem::template store<site<O>(kSitePassStore)>(outr + c * oc, v);
    } else {
      using V = VecOf<scalar_t, kVec>;
      const V v = Mem::template load<site<O>(kSitePassLoad)>(reinterpret_cast<const V*>(xr + c));
      Mem::template store<site<O>(kSitePassStore)>(reinterpret_cast<V*>(outr + c), v);
    }
  }
};

// cuda-check fails on any kernel with CompactIndex whose parameters reach 256 bytes; this catches the
// largest of them at compile time.
static_assert(sizeof(RotaryThread<double, double, false, 2, true, DeviceMemory, CompactIndex>) < 256);

// Elements per vector: as many as 16 bytes of the wider of x and the tables hold, so that a table
// vector is never wider than 16 bytes (the widest load of sm_80 to sm_90: a 32-byte one is two
// instructions, each touching every other half-sector of its warp's span).
template <typename scalar_t, typename table_t>
constexpr int vec_elems() {
  return kVectorBytes / static_cast<int>(std::max(sizeof(scalar_t), sizeof(table_t)));
}

// Calls f.template operator()<Thread>() with the RotaryThread type of a planned call: x's dtype,
// the tables' dtype (x's or float32), interleaved, the launch's vector width, full or gathered
// tables, and the index. Shared by the CUDA launcher and the host emulator, so both instantiate
// exactly the same set of kernels: 16 per pair of dtypes (conjugate is a runtime flag).
template <typename scalar_t, typename table_t, typename F>
void dispatch_variant(const RotaryCall& c, const RotaryLaunch& L, F&& f) {
  constexpr int kV = vec_elems<scalar_t, table_t>();
  const auto by_vec = [&](auto inter_tag, auto gathered_tag, auto index_tag) {
    constexpr bool kI = decltype(inter_tag)::value, kG = decltype(gathered_tag)::value;
    using Index = typename decltype(index_tag)::type;
    if (L.vec == 1) {
      f.template operator()<RotaryThread<scalar_t, table_t, kI, 1, kG, DeviceMemory, Index>>();
    } else {
      f.template operator()<RotaryThread<scalar_t, table_t, kI, kV, kG, DeviceMemory, Index>>();
    }
  };
  const auto by_index = [&](auto inter_tag, auto gathered_tag) {
    L.compact ? by_vec(inter_tag, gathered_tag, std::type_identity<CompactIndex>{})
              : by_vec(inter_tag, gathered_tag, std::type_identity<PlanIndex>{});
  };
  const auto by_tables = [&](auto inter_tag) {
    c.positions != nullptr ? by_index(inter_tag, std::true_type{}) : by_index(inter_tag, std::false_type{});
  };
  c.interleaved ? by_tables(std::true_type{}) : by_tables(std::false_type{});
}

// Calls f.template operator()<scalar_t, table_t>() with x's dtype and the tables' (the checks allow
// x's or float32): the dtype pairs every CUDA kernel family is built for.
template <typename F>
void dispatch_dtypes(ScalarType x, ScalarType tables, const char* op, F&& f) {
  const auto with = [&]<typename scalar_t>(std::type_identity<scalar_t>) {
    if (tables == x) {
      f.template operator()<scalar_t, scalar_t>();
    } else {
      f.template operator()<scalar_t, float>();
    }
  };
  switch (x) {
    case ScalarType::Float: return with(std::type_identity<float>{});
    case ScalarType::Double: return with(std::type_identity<double>{});
    case ScalarType::Half: return with(std::type_identity<c10::Half>{});
    case ScalarType::BFloat16: return with(std::type_identity<c10::BFloat16>{});
    default: ROPE_EXT_CHECK(false, op, ": internal error: no CUDA kernel for dtype ", x);
  }
}

template <typename F>
void dispatch_thread(const RotaryCall& c, const RotaryLaunch& L, F&& f) {
  dispatch_dtypes(c.x.scalar_type(), c.cos.scalar_type(), c.op,
                  [&]<typename scalar_t, typename table_t>() { dispatch_variant<scalar_t, table_t>(c, L, f); });
}

}  // namespace rope_ext::cuda
