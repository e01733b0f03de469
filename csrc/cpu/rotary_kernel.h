// The CPU rotary kernel body. Included once by each of rotary_kernel_{default,avx2,avx512}.cpp,
// which setup.py compiles with that capability's -m flags and CPU_CAPABILITY define, so that
// at::vec::Vectorized here is real AVX2 / AVX-512 code rather than the generic fallback.
// Everything lands in namespace rope_ext::cpu::<CPU_CAPABILITY>; rotary_cpu.cpp picks one.
// Not a normal header: include it from exactly one translation unit per capability.

#ifndef CPU_CAPABILITY
#error "rotary_kernel.h must be compiled with -DCPU_CAPABILITY=<DEFAULT|AVX2|AVX512>"
#endif

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "rotary_math.h"
#include "rotary_plan.h"

namespace rope_ext::cpu::CPU_CAPABILITY {

using at::vec::Vectorized;

// Elements per parallel task: ATen's own grain (at::internal::GRAIN_SIZE). Below it a call
// runs on the calling thread, which keeps small (decode) shapes free of threading overhead.
constexpr int64_t kGrainElements = 32768;

// Loads and stores of 2 * Vectorized<opmath_t>::size() elements of scalar_t, converting
// float16/bfloat16 to float in registers.
template <typename scalar_t>
struct VecIO {
  using opmath_t = at::opmath_type<scalar_t>;
  using Vec = Vectorized<opmath_t>;
  static constexpr int64_t kStep = 2 * Vec::size();

  static void load(const scalar_t* p, Vec& a, Vec& b) {
    if constexpr (std::is_same_v<scalar_t, opmath_t>) {
      a = Vec::loadu(p);
      b = Vec::loadu(p + Vec::size());
    } else {
      at::vec::load_to_float<scalar_t>(p, a, b);
    }
  }
  static void store(scalar_t* p, const Vec& a, const Vec& b) {
    if constexpr (std::is_same_v<scalar_t, opmath_t>) {
      a.store(p);
      b.store(p + Vec::size());
    } else {
      at::vec::convert_from_float<scalar_t>(a, b).store(p);
    }
  }
};

// One token's table entries in opmath, indexed by pair: c1[i], s1[i] belong to the pair's
// first member, c2[i], s2[i] to its second (see rotate_pair in rotary_math.h).
template <typename opmath_t>
struct PairTables {
  const opmath_t* c1;
  const opmath_t* s1;
  const opmath_t* c2;
  const opmath_t* s2;
};

// Builds a token's PairTables. When the tables already are contiguous opmath values in
// half-split order they are used in place; otherwise they are converted and de-interleaved
// once into `buf` (4 * half values), then reused for every head of the token.
template <bool kInterleaved, typename opmath_t, typename table_t>
PairTables<opmath_t> token_tables(const table_t* cos, int64_t cos_col, const table_t* sin,
                                  int64_t sin_col, int64_t half, opmath_t* buf) {
  if constexpr (!kInterleaved && std::is_same_v<table_t, opmath_t>) {
    if (cos_col == 1 && sin_col == 1) return {cos, sin, cos + half, sin + half};
  }
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = pair_first(i, half, kInterleaved);
    const int64_t b = pair_second(i, half, kInterleaved);
    buf[i] = static_cast<opmath_t>(cos[a * cos_col]);
    buf[half + i] = static_cast<opmath_t>(sin[a * sin_col]);
    buf[2 * half + i] = static_cast<opmath_t>(cos[b * cos_col]);
    buf[3 * half + i] = static_cast<opmath_t>(sin[b * sin_col]);
  }
  return {buf, buf + half, buf + 2 * half, buf + 3 * half};
}

// Rotates pairs [begin, half) of one row with scalar math, for any column strides.
template <bool kConj, bool kInterleaved, typename scalar_t, typename opmath_t>
void rotate_pairs_scalar(const scalar_t* x, int64_t x_col, scalar_t* out, int64_t out_col,
                         const PairTables<opmath_t>& t, int64_t begin, int64_t half) {
  for (int64_t i = begin; i < half; ++i) {
    const int64_t a = pair_first(i, half, kInterleaved);
    const int64_t b = pair_second(i, half, kInterleaved);
    opmath_t o1, o2;
    rotate_pair<kConj>(static_cast<opmath_t>(x[a * x_col]), static_cast<opmath_t>(x[b * x_col]),
                       t.c1[i], t.s1[i], t.c2[i], t.s2[i], o1, o2);
    out[a * out_col] = static_cast<scalar_t>(o1);
    out[b * out_col] = static_cast<scalar_t>(o2);
  }
}

// Rotates one row whose x and out columns are contiguous: vector body, scalar tail.
template <bool kConj, bool kInterleaved, typename scalar_t, typename opmath_t>
void rotate_row_contiguous(const scalar_t* x, scalar_t* out, const PairTables<opmath_t>& t,
                           int64_t half) {
  using IO = VecIO<scalar_t>;
  using Vec = typename IO::Vec;
  constexpr int64_t V = Vec::size();
  constexpr int64_t kStep = IO::kStep;  // pairs per iteration
  int64_t i = 0;
  for (; i + kStep <= half; i += kStep) {
    Vec x1[2], x2[2], o1[2], o2[2];
    if constexpr (kInterleaved) {
      // 2 * kStep consecutive columns hold kStep (first, second) pairs.
      Vec a[4];
      IO::load(x + 2 * i, a[0], a[1]);
      IO::load(x + 2 * i + kStep, a[2], a[3]);
      std::tie(x1[0], x2[0]) = at::vec::deinterleave2(a[0], a[1]);
      std::tie(x1[1], x2[1]) = at::vec::deinterleave2(a[2], a[3]);
    } else {
      IO::load(x + i, x1[0], x1[1]);
      IO::load(x + half + i, x2[0], x2[1]);
    }
    for (int k = 0; k < 2; ++k) {
      const int64_t j = i + k * V;
      rotate_pair<kConj>(x1[k], x2[k], Vec::loadu(t.c1 + j), Vec::loadu(t.s1 + j),
                         Vec::loadu(t.c2 + j), Vec::loadu(t.s2 + j), o1[k], o2[k]);
    }
    if constexpr (kInterleaved) {
      Vec b[4];
      std::tie(b[0], b[1]) = at::vec::interleave2(o1[0], o2[0]);
      std::tie(b[2], b[3]) = at::vec::interleave2(o1[1], o2[1]);
      IO::store(out + 2 * i, b[0], b[1]);
      IO::store(out + 2 * i + kStep, b[2], b[3]);
    } else {
      IO::store(out + i, o1[0], o1[1]);
      IO::store(out + half + i, o2[0], o2[1]);
    }
  }
  rotate_pairs_scalar<kConj, kInterleaved>(x, 1, out, 1, t, i, half);
}

template <typename scalar_t, typename table_t, bool kConj, bool kInterleaved>
void rotary_typed(const RotaryPlan& p, const at::Tensor& x, at::Tensor& out,
                  const at::Tensor& cos, const at::Tensor& sin) {
  using opmath_t = at::opmath_type<scalar_t>;
  const scalar_t* x_base = x.const_data_ptr<scalar_t>();
  scalar_t* out_base = out.mutable_data_ptr<scalar_t>();
  const table_t* cos_base = cos.const_data_ptr<table_t>();
  const table_t* sin_base = sin.const_data_ptr<table_t>();

  const int64_t half = p.rotary_dim / 2;
  const int64_t pass = p.head_dim - p.rotary_dim;  // pass-through columns per row
  const int64_t nheads = p.num_heads();
  const int64_t rows = p.num_tokens() * nheads;
  const bool contiguous_rows = p.x_col == 1 && p.out_col == 1;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, p.head_dim));

  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<opmath_t> buf(4 * half);
    for (int64_t row = begin; row < end;) {
      // One token: its tables are built once, then used for its heads in [h, h_end).
      const int64_t token = row / nheads;
      const int64_t h_begin = row % nheads;
      const int64_t h_end = std::min(nheads, h_begin + (end - row));
      int64_t tok[4];
      p.tokens.offsets(token, tok);
      const auto t = token_tables<kInterleaved>(cos_base + tok[kCos], p.cos_col,
                                                sin_base + tok[kSin], p.sin_col, half, buf.data());
      for (int64_t h = h_begin; h < h_end; ++h) {
        int64_t hd[2];
        p.heads.offsets(h, hd);
        const scalar_t* xr = x_base + tok[kX] + hd[kX];
        scalar_t* outr = out_base + tok[kOut] + hd[kOut];
        if (contiguous_rows) {
          rotate_row_contiguous<kConj, kInterleaved>(xr, outr, t, half);
          if (pass > 0 && outr != xr) {  // in place, the pass-through columns are already there
            std::memcpy(outr + p.rotary_dim, xr + p.rotary_dim, pass * sizeof(scalar_t));
          }
        } else {
          rotate_pairs_scalar<kConj, kInterleaved>(xr, p.x_col, outr, p.out_col, t, 0, half);
          if (outr != xr || p.out_col != p.x_col) {
            for (int64_t c = p.rotary_dim; c < p.head_dim; ++c) outr[c * p.out_col] = xr[c * p.x_col];
          }
        }
      }
      row += h_end - h_begin;
    }
  });
}

// The entry point declared in rotary_cpu.h: out = rotary(x, cos, sin), where `out` has
// been allocated by the caller with x's sizes and `p` describes all four tensors. `out` may
// be x itself (in place): each pair is read completely before it is written.
void rotary_kernel(const RotaryPlan& p, const at::Tensor& x, at::Tensor& out,
                               const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                               bool conjugate) {
  if (out.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rope_ext.rotary", [&] {
    auto run = [&](auto table_tag) {
      using table_t = decltype(table_tag);
      if (interleaved) {
        conjugate ? rotary_typed<scalar_t, table_t, true, true>(p, x, out, cos, sin)
                  : rotary_typed<scalar_t, table_t, false, true>(p, x, out, cos, sin);
      } else {
        conjugate ? rotary_typed<scalar_t, table_t, true, false>(p, x, out, cos, sin)
                  : rotary_typed<scalar_t, table_t, false, false>(p, x, out, cos, sin);
      }
    };
    // check_rotary_args allows tables in x's dtype or in float32.
    if (cos.scalar_type() == x.scalar_type()) {
      run(scalar_t{});
    } else {
      run(float{});
    }
  });
}

}  // namespace rope_ext::cpu::CPU_CAPABILITY
