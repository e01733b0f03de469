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

#include "rotary_math.h"
#include "rotary_plan.h"

namespace rope_ext::cuda {

constexpr int kVectorBytes = 16;   // one 128-bit load/store
constexpr int kMaxThreads = 256;   // threads per block
constexpr int64_t kMaxGridX = 2147483647;  // gridDim.x limit; the kernel loops beyond it
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kTargetBlocks = 2048;  // enough blocks to fill a large GPU

// A launch: grid (tokens x head groups), block (pair chunks x heads).
//   blockIdx.x  -> token (looping with stride grid_x)
//   blockIdx.y, threadIdx.y -> heads (looping with stride grid_y * block_y)
//   threadIdx.x -> chunk of `pairs_per_item` pairs of the row, or of pass-through columns
// A thread loads its chunk's cos/sin once per token and reuses it for all its heads.
struct RotaryLaunch {
  int64_t grid_x = 0, grid_y = 0;
  int64_t block_x = 0, block_y = 0;
  int64_t vec = 1;             // elements per load: 16 bytes' worth, or 1 (scalar path)
  int64_t pairs_per_item = 1;  // pairs one thread rotates per head
  int64_t rot_items = 0;       // items covering the rotary columns
  int64_t pass_items = 0;      // items covering the pass-through columns (vec columns each)
};

// Chooses the launch for a plan, given element size and the data pointers (for alignment).
// The 16-byte vector path needs contiguous rows, 16-byte aligned row starts, and a rotary and
// pass-through width that split into whole vectors; anything else takes the scalar path.
inline RotaryLaunch choose_launch(const RotaryPlan& p, int64_t elem_size, bool interleaved,
                                  const void* x, const void* out) {
  RotaryLaunch L;
  const int64_t half = p.rotary_dim / 2;
  const int64_t pass = p.head_dim - p.rotary_dim;
  const int64_t e = kVectorBytes / elem_size;
  bool vec_ok = p.x_col == 1 && p.out_col == 1 && e >= 2 &&
                reinterpret_cast<uintptr_t>(x) % kVectorBytes == 0 &&
                reinterpret_cast<uintptr_t>(out) % kVectorBytes == 0 &&
                (interleaved ? p.rotary_dim % e == 0 : half % e == 0) && pass % e == 0;
  for (int d = 0; vec_ok && d < p.tokens.ndim; ++d)
    vec_ok = p.tokens.strides[kX][d] % e == 0 && p.tokens.strides[kOut][d] % e == 0;
  for (int d = 0; vec_ok && d < p.heads.ndim; ++d)
    vec_ok = p.heads.strides[kX][d] % e == 0 && p.heads.strides[kOut][d] % e == 0;

  L.vec = vec_ok ? e : 1;
  L.pairs_per_item = vec_ok ? (interleaved ? e / 2 : e) : 1;
  L.rot_items = half / L.pairs_per_item;
  L.pass_items = pass / L.vec;
  const int64_t items = L.rot_items + L.pass_items;
  const int64_t tokens = p.tokens.numel(), heads = p.heads.numel();
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

// The work of thread (tx, ty) of block (bx, by). kVec is the launch's `vec` (1: scalar path).
template <typename scalar_t, typename table_t, bool kConj, bool kInterleaved, int kVec>
struct RotaryThread {
  using opmath_t = typename OpMath<scalar_t>::type;

  // Host side: the thread function for out = rotary(x, cos, sin) described by `plan`.
  static RotaryThread make(const RotaryPlan& plan, const at::Tensor& x, at::Tensor& out,
                           const at::Tensor& cos, const at::Tensor& sin) {
    return {plan, x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
            cos.const_data_ptr<table_t>(), sin.const_data_ptr<table_t>()};
  }

  // Pairs per item: a vector of kVec columns holds kVec/2 interleaved pairs, or kVec first
  // members (with their kVec second members half a row away) for half-split.
  static constexpr int kPairs = kVec == 1 ? 1 : (kInterleaved ? kVec / 2 : kVec);

  RotaryPlan p;
  const scalar_t* x;
  scalar_t* out;
  const table_t* cos;
  const table_t* sin;

  C10_HOST_DEVICE void operator()(int64_t bx, int64_t by, int64_t tx, int64_t ty,
                                  const RotaryLaunch& L) const {
    const int64_t tokens = p.tokens.numel(), heads = p.heads.numel();
    const int64_t half = p.rotary_dim / 2;
    for (int64_t token = bx; token < tokens; token += L.grid_x) {
      int64_t tok[4];
      p.tokens.offsets(token, tok);
      for (int64_t item = tx; item < L.rot_items + L.pass_items; item += L.block_x) {
        if (item < L.rot_items) {
          rotate_item(item, tok, by, ty, L, heads, half);
        } else {
          copy_item(item - L.rot_items, tok, by, ty, L, heads);
        }
      }
    }
  }

 private:
  C10_HOST_DEVICE void rotate_item(int64_t item, const int64_t (&tok)[4], int64_t by, int64_t ty,
                                   const RotaryLaunch& L, int64_t heads, int64_t half) const {
    // This token's table entries for the item's pairs: loaded once, reused for every head.
    opmath_t c1[kPairs], s1[kPairs], c2[kPairs], s2[kPairs];
    const int64_t pair0 = item * kPairs;
    for (int j = 0; j < kPairs; ++j) {
      const int64_t a = pair_first(pair0 + j, half, kInterleaved);
      const int64_t b = pair_second(pair0 + j, half, kInterleaved);
      c1[j] = static_cast<opmath_t>(cos[tok[kCos] + a * p.cos_col]);
      s1[j] = static_cast<opmath_t>(sin[tok[kSin] + a * p.sin_col]);
      c2[j] = static_cast<opmath_t>(cos[tok[kCos] + b * p.cos_col]);
      s2[j] = static_cast<opmath_t>(sin[tok[kSin] + b * p.sin_col]);
    }
    for (int64_t h = by * L.block_y + ty; h < heads; h += L.grid_y * L.block_y) {
      int64_t hd[2];
      p.heads.offsets(h, hd);
      const scalar_t* xr = x + tok[kX] + hd[kX];
      scalar_t* outr = out + tok[kOut] + hd[kOut];
      opmath_t x1[kPairs], x2[kPairs], o1[kPairs], o2[kPairs];
      if constexpr (kVec == 1) {
        const int64_t a = pair_first(pair0, half, kInterleaved);
        const int64_t b = pair_second(pair0, half, kInterleaved);
        x1[0] = static_cast<opmath_t>(xr[a * p.x_col]);
        x2[0] = static_cast<opmath_t>(xr[b * p.x_col]);
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
        outr[a * p.out_col] = static_cast<scalar_t>(o1[0]);
        outr[b * p.out_col] = static_cast<scalar_t>(o2[0]);
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
  C10_HOST_DEVICE void copy_item(int64_t item, const int64_t (&tok)[4], int64_t by, int64_t ty,
                                 const RotaryLaunch& L, int64_t heads) const {
    for (int64_t h = by * L.block_y + ty; h < heads; h += L.grid_y * L.block_y) {
      int64_t hd[2];
      p.heads.offsets(h, hd);
      const scalar_t* xr = x + tok[kX] + hd[kX];
      scalar_t* outr = out + tok[kOut] + hd[kOut];
      if (xr == outr && p.x_col == p.out_col) return;  // in place: already there
      const int64_t c = p.rotary_dim + item * kVec;
      if constexpr (kVec == 1) {
        outr[c * p.out_col] = xr[c * p.x_col];
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
// dtype (x's or float32), conjugate, interleaved and the launch's vector width. Shared by the
// CUDA launcher and the host emulator, so both instantiate exactly the same set of kernels.
template <typename scalar_t, typename table_t, typename F>
void dispatch_variant(bool conjugate, bool interleaved, int64_t vec, F&& f) {
  constexpr int kV = vec_elems<scalar_t>();
  auto by_vec = [&](auto conj_tag, auto inter_tag) {
    constexpr bool kC = decltype(conj_tag)::value, kI = decltype(inter_tag)::value;
    if (vec == 1) {
      f.template operator()<RotaryThread<scalar_t, table_t, kC, kI, 1>>();
    } else {
      f.template operator()<RotaryThread<scalar_t, table_t, kC, kI, kV>>();
    }
  };
  using T = std::true_type;
  using Fa = std::false_type;
  if (conjugate) {
    interleaved ? by_vec(T{}, T{}) : by_vec(T{}, Fa{});
  } else {
    interleaved ? by_vec(Fa{}, T{}) : by_vec(Fa{}, Fa{});
  }
}

template <typename F>
void dispatch_thread(const at::Tensor& x, const at::Tensor& cos, bool conjugate, bool interleaved,
                     int64_t vec, F&& f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rope_ext.rotary_thread", [&] {
    // check_rotary_args allows tables in x's dtype or in float32.
    if (cos.scalar_type() == x.scalar_type()) {
      dispatch_variant<scalar_t, scalar_t>(conjugate, interleaved, vec, f);
    } else {
      dispatch_variant<scalar_t, float>(conjugate, interleaved, vec, f);
    }
  });
}

}  // namespace rope_ext::cuda
