// The CUDA kernel's per-thread work and its launch configuration, with no CUDA runtime
// dependency: nvcc compiles it into the kernel (csrc/cuda/rotary_cuda.cu) and the host
// compiler into the emulator (csrc/testing/host_emulation.cpp), which runs every block and thread
// of the launch the launcher would choose, on the CPU. Index math, bounds, vector/scalar
// choice and tails are thereby tested on a machine without a GPU.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "rotary_math.h"
#include "rotary_ops.h"
#include "rotary_plan.h"

namespace rope_ext::cuda {

constexpr int kVectorBytes = 16;   // one 128-bit load/store
constexpr int kMaxThreads = 256;   // threads per block
constexpr int64_t kMaxGridX = 2147483647;  // gridDim.x limit; the kernel loops beyond it
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kTargetBlocks = 2048;  // enough blocks to fill a large GPU

// A launch: grid (tokens x head groups), block (pair chunks x heads).
//   blockIdx.x  -> token (looping with stride grid_x)
//   blockIdx.y, threadIdx.y -> heads (looping with stride grid_y * block_y); with q and k in one
//                  launch (rotary_pos_qk), q's heads and then k's
//   threadIdx.x -> chunk of `pairs_per_item` pairs of the row, or of pass-through columns
// A thread loads its chunk's cos/sin once per token and reuses it for all its heads.
struct RotaryLaunch {
  int64_t grid_x = 0, grid_y = 0;
  int64_t block_x = 0, block_y = 0;
  int64_t vec = 1;             // elements per load: 16 bytes' worth, or 1 (scalar path)
  int64_t pairs_per_item = 1;  // pairs one thread rotates per head
  int64_t rot_items = 0;       // items covering the rotary columns
  int64_t pass_items = 0;      // items covering the pass-through columns (vec columns each)
  bool table_vec = false;      // gathered caches: an item's pairs_per_item table values in one load
};

// One tensor of a launch: its plan and where its data is.
struct LaunchOperand {
  const RotaryPlan* plan;
  const void* x;
  const void* out;
};

// Chooses the launch for one or two operands (q and k share tokens and tables), given the element
// sizes and the data pointers (for alignment). The 16-byte vector path needs contiguous rows,
// 16-byte aligned row starts, and a rotary and pass-through width that split into whole vectors,
// for every operand; anything else takes the scalar path. Gathered caches are loaded a whole
// item at a time when their columns are contiguous and each item's values are aligned.
inline RotaryLaunch choose_launch(std::initializer_list<LaunchOperand> operands, int64_t elem_size,
                                  bool interleaved, const void* cos = nullptr, const void* sin = nullptr,
                                  int64_t table_elem_size = 0) {
  RotaryLaunch L;
  const RotaryPlan& p = *operands.begin()->plan;
  const int64_t half = p.rotary_dim / 2;
  const int64_t pass = p.head_dim - p.rotary_dim;
  const int64_t e = kVectorBytes / elem_size;
  bool vec_ok = e >= 2 && (interleaved ? p.rotary_dim % e == 0 : half % e == 0) && pass % e == 0;
  int64_t heads = 0;
  for (const LaunchOperand& o : operands) {
    const RotaryPlan& q = *o.plan;
    heads += q.heads.numel();
    vec_ok = vec_ok && q.x_col == 1 && q.out_col == 1 && reinterpret_cast<uintptr_t>(o.x) % kVectorBytes == 0 &&
             reinterpret_cast<uintptr_t>(o.out) % kVectorBytes == 0;
    for (int d = 0; vec_ok && d < q.tokens.ndim; ++d)
      vec_ok = q.tokens.strides[kX][d] % e == 0 && q.tokens.strides[kOut][d] % e == 0;
    for (int d = 0; vec_ok && d < q.heads.ndim; ++d)
      vec_ok = q.heads.strides[kX][d] % e == 0 && q.heads.strides[kOut][d] % e == 0;
  }

  L.vec = vec_ok ? e : 1;
  L.pairs_per_item = vec_ok ? (interleaved ? e / 2 : e) : 1;
  L.rot_items = half / L.pairs_per_item;
  L.pass_items = pass / L.vec;
  if (p.gathered && L.pairs_per_item > 1) {
    const int64_t item_bytes = L.pairs_per_item * table_elem_size;
    L.table_vec = p.cos_col == 1 && p.sin_col == 1 && p.cos_row % L.pairs_per_item == 0 &&
                  p.sin_row % L.pairs_per_item == 0 && reinterpret_cast<uintptr_t>(cos) % item_bytes == 0 &&
                  reinterpret_cast<uintptr_t>(sin) % item_bytes == 0;
  }
  const int64_t items = L.rot_items + L.pass_items;
  const int64_t tokens = p.tokens.numel();
  L.block_x = std::max<int64_t>(1, std::min<int64_t>(items, kMaxThreads));
  L.block_y = std::max<int64_t>(1, std::min<int64_t>(heads, kMaxThreads / L.block_x));
  L.grid_x = std::max<int64_t>(1, std::min(tokens, kMaxGridX));
  const int64_t head_groups = (heads + L.block_y - 1) / L.block_y;
  L.grid_y = std::max<int64_t>(
      1, std::min({head_groups, kMaxGridY, std::max<int64_t>(1, kTargetBlocks / L.grid_x)}));
  return L;
}

template <typename T, int N>
struct alignas(sizeof(T) * N) VecOf {
  T v[N];
};

// opmath: float for float/half/bfloat16, double for double.
template <typename T>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};

// A device-side check: CUDA_KERNEL_ASSERT in device code; an exception in the host emulation
// (csrc/testing/host_emulation.cpp), which runs this code on the CPU and must report, not abort.
#if defined(__CUDA_ARCH__)
#define ROPE_EXT_DEVICE_CHECK(cond, ...) CUDA_KERNEL_ASSERT(cond)
#else
#define ROPE_EXT_DEVICE_CHECK(cond, ...) TORCH_CHECK(cond, __VA_ARGS__)
#endif

// The work of thread (tx, ty) of block (bx, by). kVec is the launch's `vec` (1: scalar path).
// kGathered: the tables are half-width caches read at each token's position (rotary_pos*); the
// transpose (conjugate) is then the rotation with -sin, a runtime flag.
template <typename scalar_t, typename table_t, bool kConj, bool kInterleaved, int kVec, bool kGathered = false>
struct RotaryThread {
  using opmath_t = typename OpMath<scalar_t>::type;

  // Host side: the thread function for out = rotary(x, cos, sin) described by `plan`, and, when
  // `k_plan` is given, k_out = rotary(k, ...) with the same tables and tokens in the same launch.
  static RotaryThread make(const RotaryPlan& plan, const at::Tensor& x, at::Tensor& out, const at::Tensor& cos,
                           const at::Tensor& sin, const void* positions = nullptr, bool conjugate = false,
                           const RotaryPlan* k_plan = nullptr, const at::Tensor* k = nullptr,
                           at::Tensor* k_out = nullptr) {
    RotaryThread t{};
    t.n = k_plan != nullptr ? 2 : 1;
    t.p[0] = plan;
    t.x[0] = x.const_data_ptr<scalar_t>();
    t.out[0] = out.mutable_data_ptr<scalar_t>();
    if (k_plan != nullptr) {
      t.p[1] = *k_plan;
      t.x[1] = k->const_data_ptr<scalar_t>();
      t.out[1] = k_out->mutable_data_ptr<scalar_t>();
    }
    t.heads0 = plan.heads.numel();
    t.heads = t.heads0 + (k_plan != nullptr ? k_plan->heads.numel() : 0);
    t.cos = cos.const_data_ptr<table_t>();
    t.sin = sin.const_data_ptr<table_t>();
    t.positions = positions;
    t.sin_sign = conjugate ? opmath_t(-1) : opmath_t(1);
    return t;
  }

  // Pairs per item: a vector of kVec columns holds kVec/2 interleaved pairs, or kVec first
  // members (with their kVec second members half a row away) for half-split.
  static constexpr int kPairs = kVec == 1 ? 1 : (kInterleaved ? kVec / 2 : kVec);

  int n;                   // operands: 1, or 2 (q and k)
  RotaryPlan p[2];         // their plans; tokens and tables are the same for both
  const scalar_t* x[2];
  scalar_t* out[2];
  int64_t heads0, heads;   // q's heads, and q's + k's
  const table_t* cos;
  const table_t* sin;
  const void* positions;   // gathered: int32 or int64 (p[0].positions_int32)
  opmath_t sin_sign;       // gathered: -1 for the transpose

  C10_HOST_DEVICE void operator()(int64_t bx, int64_t by, int64_t tx, int64_t ty,
                                  const RotaryLaunch& L) const {
    const int64_t tokens = p[0].tokens.numel();
    const int64_t half = p[0].rotary_dim / 2;
    for (int64_t token = bx; token < tokens; token += L.grid_x) {
      int64_t tok[2][4];
      for (int o = 0; o < n; ++o) p[o].tokens.offsets(token, tok[o]);
      for (int64_t item = tx; item < L.rot_items + L.pass_items; item += L.block_x) {
        if (item < L.rot_items) {
          rotate_item(item, tok, by, ty, L, half);
        } else {
          copy_item(item - L.rot_items, tok, by, ty, L);
        }
      }
    }
  }

 private:
  // Head h of the launch: operand o, and that operand's row pointers for the token.
  C10_HOST_DEVICE int operand_of(int64_t& h) const {
    if (h < heads0) return 0;
    h -= heads0;
    return 1;
  }

  // This token's table entries for the item's pairs.
  C10_HOST_DEVICE void load_tables(int64_t pair0, const int64_t (&tok)[4], const RotaryLaunch& L, int64_t half,
                                   opmath_t (&c1)[kPairs], opmath_t (&s1)[kPairs], opmath_t (&c2)[kPairs],
                                   opmath_t (&s2)[kPairs]) const {
    const RotaryPlan& q = p[0];
    if constexpr (kGathered) {
      const int64_t pos = q.positions_int32 ? int64_t{static_cast<const int32_t*>(positions)[tok[kCos]]}
                                            : static_cast<const int64_t*>(positions)[tok[kCos]];
      ROPE_EXT_DEVICE_CHECK(pos >= 0 && pos < q.cache_rows, "rope_ext: position ", pos,
                            " is outside the cache, whose ", q.cache_rows, " rows hold positions 0 to ",
                            q.cache_rows - 1);
      const table_t* c = cos + pos * q.cos_row;
      const table_t* s = sin + pos * q.sin_row;
      bool vector_load = false;
      if constexpr (kPairs > 1) {
        if (L.table_vec) {
          const auto cv = *reinterpret_cast<const VecOf<table_t, kPairs>*>(c + pair0);
          const auto sv = *reinterpret_cast<const VecOf<table_t, kPairs>*>(s + pair0);
          for (int j = 0; j < kPairs; ++j) {
            c1[j] = static_cast<opmath_t>(cv.v[j]);
            s1[j] = sin_sign * static_cast<opmath_t>(sv.v[j]);
          }
          vector_load = true;
        }
      }
      if (!vector_load) {
        for (int j = 0; j < kPairs; ++j) {
          c1[j] = static_cast<opmath_t>(c[(pair0 + j) * q.cos_col]);
          s1[j] = sin_sign * static_cast<opmath_t>(s[(pair0 + j) * q.sin_col]);
        }
      }
      for (int j = 0; j < kPairs; ++j) {
        c2[j] = c1[j];
        s2[j] = s1[j];
      }
    } else {
      for (int j = 0; j < kPairs; ++j) {
        const int64_t a = pair_first(pair0 + j, half, kInterleaved);
        const int64_t b = pair_second(pair0 + j, half, kInterleaved);
        c1[j] = static_cast<opmath_t>(cos[tok[kCos] + a * q.cos_col]);
        s1[j] = static_cast<opmath_t>(sin[tok[kSin] + a * q.sin_col]);
        c2[j] = static_cast<opmath_t>(cos[tok[kCos] + b * q.cos_col]);
        s2[j] = static_cast<opmath_t>(sin[tok[kSin] + b * q.sin_col]);
      }
    }
  }

  C10_HOST_DEVICE void rotate_item(int64_t item, const int64_t (&tok)[2][4], int64_t by, int64_t ty,
                                   const RotaryLaunch& L, int64_t half) const {
    // This token's table entries for the item's pairs: loaded once, reused for every head.
    opmath_t c1[kPairs], s1[kPairs], c2[kPairs], s2[kPairs];
    const int64_t pair0 = item * kPairs;
    load_tables(pair0, tok[0], L, half, c1, s1, c2, s2);
    for (int64_t h = by * L.block_y + ty; h < heads; h += L.grid_y * L.block_y) {
      int64_t hh = h;
      const int o = operand_of(hh);
      const RotaryPlan& q = p[o];
      int64_t hd[2];
      q.heads.offsets(hh, hd);
      const scalar_t* xr = x[o] + tok[o][kX] + hd[kX];
      scalar_t* outr = out[o] + tok[o][kOut] + hd[kOut];
      opmath_t x1[kPairs], x2[kPairs], o1[kPairs], o2[kPairs];
      if constexpr (kVec == 1) {
        const int64_t a = pair_first(pair0, half, kInterleaved);
        const int64_t b = pair_second(pair0, half, kInterleaved);
        x1[0] = static_cast<opmath_t>(xr[a * q.x_col]);
        x2[0] = static_cast<opmath_t>(xr[b * q.x_col]);
      } else if constexpr (kInterleaved) {
        const auto v = *reinterpret_cast<const VecOf<scalar_t, kVec>*>(xr + 2 * pair0);
        for (int j = 0; j < kPairs; ++j) {
          x1[j] = static_cast<opmath_t>(v.v[2 * j]);
          x2[j] = static_cast<opmath_t>(v.v[2 * j + 1]);
        }
      } else {
        const auto v1 = *reinterpret_cast<const VecOf<scalar_t, kVec>*>(xr + pair0);
        const auto v2 = *reinterpret_cast<const VecOf<scalar_t, kVec>*>(xr + half + pair0);
        for (int j = 0; j < kPairs; ++j) {
          x1[j] = static_cast<opmath_t>(v1.v[j]);
          x2[j] = static_cast<opmath_t>(v2.v[j]);
        }
      }
      for (int j = 0; j < kPairs; ++j) {
        rotate_pair<kConj>(x1[j], x2[j], c1[j], s1[j], c2[j], s2[j], o1[j], o2[j]);
      }
      if constexpr (kVec == 1) {
        const int64_t a = pair_first(pair0, half, kInterleaved);
        const int64_t b = pair_second(pair0, half, kInterleaved);
        outr[a * q.out_col] = static_cast<scalar_t>(o1[0]);
        outr[b * q.out_col] = static_cast<scalar_t>(o2[0]);
      } else if constexpr (kInterleaved) {
        VecOf<scalar_t, kVec> v;
        for (int j = 0; j < kPairs; ++j) {
          v.v[2 * j] = static_cast<scalar_t>(o1[j]);
          v.v[2 * j + 1] = static_cast<scalar_t>(o2[j]);
        }
        *reinterpret_cast<VecOf<scalar_t, kVec>*>(outr + 2 * pair0) = v;
      } else {
        VecOf<scalar_t, kVec> v1, v2;
        for (int j = 0; j < kPairs; ++j) {
          v1.v[j] = static_cast<scalar_t>(o1[j]);
          v2.v[j] = static_cast<scalar_t>(o2[j]);
        }
        *reinterpret_cast<VecOf<scalar_t, kVec>*>(outr + pair0) = v1;
        *reinterpret_cast<VecOf<scalar_t, kVec>*>(outr + half + pair0) = v2;
      }
    }
  }

  // Pass-through columns [r + item*kVec, r + (item+1)*kVec): copied, unless in place.
  C10_HOST_DEVICE void copy_item(int64_t item, const int64_t (&tok)[2][4], int64_t by, int64_t ty,
                                 const RotaryLaunch& L) const {
    for (int64_t h = by * L.block_y + ty; h < heads; h += L.grid_y * L.block_y) {
      int64_t hh = h;
      const int o = operand_of(hh);
      const RotaryPlan& q = p[o];
      int64_t hd[2];
      q.heads.offsets(hh, hd);
      const scalar_t* xr = x[o] + tok[o][kX] + hd[kX];
      scalar_t* outr = out[o] + tok[o][kOut] + hd[kOut];
      if (xr == outr && q.x_col == q.out_col) continue;  // in place: already there
      const int64_t c = q.rotary_dim + item * kVec;
      if constexpr (kVec == 1) {
        outr[c * q.out_col] = xr[c * q.x_col];
      } else {
        *reinterpret_cast<VecOf<scalar_t, kVec>*>(outr + c) =
            *reinterpret_cast<const VecOf<scalar_t, kVec>*>(xr + c);
      }
    }
  }
};

// Elements per 16-byte vector for scalar_t.
template <typename scalar_t>
constexpr int vec_elems() {
  return kVectorBytes / static_cast<int>(sizeof(scalar_t));
}

// Calls f.template operator()<Thread>() with the RotaryThread type for x's dtype, the tables'
// dtype (x's or float32), conjugate, interleaved, the launch's vector width and gathered tables.
// Shared by the CUDA launcher and the host emulator, so both instantiate exactly the same set of
// kernels. Gathered kernels take conjugate at run time (Thread::make), which halves their number.
template <typename scalar_t, typename table_t, typename F>
void dispatch_variant(bool conjugate, bool interleaved, int64_t vec, bool gathered, F&& f) {
  constexpr int kV = vec_elems<scalar_t>();
  auto by_vec = [&](auto conj_tag, auto inter_tag, auto gathered_tag) {
    constexpr bool kC = decltype(conj_tag)::value, kI = decltype(inter_tag)::value;
    constexpr bool kG = decltype(gathered_tag)::value;
    if (vec == 1) {
      f.template operator()<RotaryThread<scalar_t, table_t, kC, kI, 1, kG>>();
    } else {
      f.template operator()<RotaryThread<scalar_t, table_t, kC, kI, kV, kG>>();
    }
  };
  using T = std::true_type;
  using Fa = std::false_type;
  if (gathered) {
    interleaved ? by_vec(Fa{}, T{}, T{}) : by_vec(Fa{}, Fa{}, T{});
    return;
  }
  if (conjugate) {
    interleaved ? by_vec(T{}, T{}, Fa{}) : by_vec(T{}, Fa{}, Fa{});
  } else {
    interleaved ? by_vec(Fa{}, T{}, Fa{}) : by_vec(Fa{}, Fa{}, Fa{});
  }
}

template <typename F>
void dispatch_thread(const at::Tensor& x, const at::Tensor& cos, bool conjugate, bool interleaved,
                     int64_t vec, bool gathered, F&& f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rope_ext.rotary_thread", [&] {
    // The checks allow tables in x's dtype or in float32.
    if (cos.scalar_type() == x.scalar_type()) {
      dispatch_variant<scalar_t, scalar_t>(conjugate, interleaved, vec, gathered, f);
    } else {
      dispatch_variant<scalar_t, float>(conjugate, interleaved, vec, gathered, f);
    }
  });
}

// The plans and the launch of a RotaryCall, for checked arguments (shared by the CUDA launcher
// and the host emulator).
struct CallLaunch {
  RotaryPlan plan, k_plan;
  RotaryLaunch launch;
};

inline CallLaunch plan_call(const RotaryCall& c) {
  CallLaunch r;
  const auto make = [&](const at::Tensor& x, const at::Tensor& out) {
    return c.positions ? make_rotary_pos_plan(x, out, c.cos, c.sin, *c.positions)
                       : make_rotary_plan(x, out, c.cos, c.sin);
  };
  r.plan = make(c.x, c.out);
  if (c.k != nullptr) {
    r.k_plan = make(*c.k, *c.k_out);
    r.launch = choose_launch({{&r.plan, c.x.const_data_ptr(), c.out.const_data_ptr()},
                              {&r.k_plan, c.k->const_data_ptr(), c.k_out->const_data_ptr()}},
                             c.x.element_size(), c.interleaved, c.cos.const_data_ptr(), c.sin.const_data_ptr(),
                             c.cos.element_size());
  } else {
    r.launch = choose_launch({{&r.plan, c.x.const_data_ptr(), c.out.const_data_ptr()}}, c.x.element_size(),
                             c.interleaved, c.cos.const_data_ptr(), c.sin.const_data_ptr(), c.cos.element_size());
  }
  return r;
}

// The thread function of a RotaryCall with its plans.
template <class Thread>
Thread make_thread(const RotaryCall& c, const CallLaunch& cl) {
  return Thread::make(cl.plan, c.x, c.out, c.cos, c.sin, c.positions ? c.positions->const_data_ptr() : nullptr,
                      c.conjugate, c.k ? &cl.k_plan : nullptr, c.k, c.k_out);
}

}  // namespace rope_ext::cuda
