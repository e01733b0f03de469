// The rotation itself, and the index arithmetic every rope_ext kernel needs.
//
// This header is the single definition of RoPE's per-element math. It depends on
// nothing but the C++ standard library, so the CPU kernels (which instantiate it on
// scalars and on at::vec::Vectorized) and the CUDA kernels (which instantiate it on
// float/double in device code) share it, and a host test can run the device code path.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define ROPE_HD __host__ __device__ __forceinline__
#else
#define ROPE_HD inline
#endif

namespace rope_ext {

// Maximum tensor rank the kernels handle (x.dim() <= kMaxDims). Matches ATen's
// TensorIterator limit (25); real RoPE inputs have rank 2 to 5.
constexpr int kMaxDims = 25;

// Rotate one pair (x1, x2) by its table entries.
//
// The op is out = x * cos + R(x) * sin with R(x) = (-x2, x1) on each pair, i.e. per pair
//
//   forward   (kConj = false):  [o1]   [c1  -s1] [x1]
//                               [o2] = [s2   c2] [x2]
//
//   transpose (kConj = true):   [o1]   [c1   s2] [x1]
//                               [o2] = [-s1  c2] [x2]
//
// (c1, s1) are the table entries at the pair's first member, (c2, s2) at its second;
// for real angles c1 == c2 and s1 == s2 and the transpose is the rotation by -theta.
// The transpose is the exact adjoint whatever the tables hold, so backward(forward)
// is this same function with kConj flipped. (The CPU and CUDA rotation kernels compute it
// as the forward form with (s1, s2) replaced by (-s2, -s1): the same roundings.)
//
// T is float, double, or a SIMD vector type with the usual arithmetic operators.
template <bool kConj, typename T>
ROPE_HD void rotate_pair(const T& x1, const T& x2, const T& c1, const T& s1, const T& c2,
                         const T& s2, T& o1, T& o2) {
  if constexpr (kConj) {
    o1 = x1 * c1 + x2 * s2;
    o2 = x2 * c2 - x1 * s1;
  } else {
    o1 = x1 * c1 - x2 * s1;
    o2 = x2 * c2 + x1 * s2;
  }
}

// Column of the two members of pair i in a rotary block of width r = 2 * half.
//   half-split  (GPT-NeoX, HF rotate_half): (i, i + half)
//   interleaved (GPT-J, RoFormer, complex): (2i, 2i + 1)
ROPE_HD int64_t pair_first(int64_t i, int64_t half, bool interleaved) {
  return interleaved ? 2 * i : i;
}
ROPE_HD int64_t pair_second(int64_t i, int64_t half, bool interleaved) {
  return interleaved ? 2 * i + 1 : i + half;
}

// A strided view over up to kMaxDims dimensions, with one stride array per operand.
// Turning a linear index over `sizes` (row-major) into per-operand element offsets is
// the only index math the kernels do, always in int64_t.
template <int kOperands>
struct StridedDims {
  int ndim = 0;
  int64_t sizes[kMaxDims];
  int64_t strides[kOperands][kMaxDims];

  ROPE_HD int64_t numel() const {
    int64_t n = 1;
    for (int d = 0; d < ndim; ++d) n *= sizes[d];
    return n;
  }

  // offsets[k] = sum_d index_d * strides[k][d], where (index_d) is `linear` unraveled. The
  // outermost dim takes what is left without a division, so a single dim (what the plans' dim
  // collapsing leaves for most layouts) costs none.
  ROPE_HD void offsets(int64_t linear, int64_t (&out)[kOperands]) const {
    for (int k = 0; k < kOperands; ++k) out[k] = 0;
    for (int d = ndim - 1; d > 0; --d) {
      const int64_t i = linear % sizes[d];
      linear /= sizes[d];
      for (int k = 0; k < kOperands; ++k) out[k] += i * strides[k][d];
    }
    if (ndim > 0) {
      for (int k = 0; k < kOperands; ++k) out[k] += linear * strides[k][0];
    }
  }

  // Merges each pair of adjacent dims that every operand steps through as one (stride of the outer
  // = stride of the inner * size of the inner), keeping the order of the linear index.
  ROPE_HD void collapse() {
    int n = 0;
    for (int d = 0; d < ndim; ++d) {
      bool merge = n > 0;
      for (int k = 0; merge && k < kOperands; ++k) merge = strides[k][n - 1] == strides[k][d] * sizes[d];
      if (merge) {
        sizes[n - 1] *= sizes[d];
        for (int k = 0; k < kOperands; ++k) strides[k][n - 1] = strides[k][d];
      } else {
        sizes[n] = sizes[d];
        for (int k = 0; k < kOperands; ++k) strides[k][n] = strides[k][d];
        ++n;
      }
    }
    ndim = n;
  }
};

}  // namespace rope_ext
