// The CPU rotary kernel body. Included once by each of rotary_kernel_{default,avx2,avx512}.cpp,
// which setup.py compiles with that capability's -m flags and CPU_CAPABILITY define, so that
// at::vec::Vectorized here is real AVX2 / AVX-512 code rather than the generic fallback.
// Everything lands in namespace rope_ext::cpu::<CPU_CAPABILITY>; rotary_cpu.cpp picks one.
// Not a normal header: include it from exactly one translation unit per capability.

#ifndef CPU_CAPABILITY
#error "rotary_kernel.h must be compiled with -DCPU_CAPABILITY=<DEFAULT|AVX2|AVX512>"
#endif

// (Header-only parts of ATen and c10: at::vec's inline code and the Half and BFloat16 types. The
// kernel calls no libtorch function; see KernelOperands in rotary_cpu.h.)
#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/rotary_cpu.h"
#include "cpu/streaming.h"
#include "rotary_math.h"
#include "rotary_plan.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define ROPE_EXT_STREAMING_STORES 1
#else
#define ROPE_EXT_STREAMING_STORES 0
#endif

// The AVX512_BF16 variant (rotary_kernel_avx512_bf16.cpp) is the AVX512 one with bfloat16 rounded
// by AVX512-BF16's instructions; rotary_cpu.cpp runs it only where cpuid reports them.
#ifndef ROPE_EXT_NATIVE_BF16
#define ROPE_EXT_NATIVE_BF16 0
#endif
#if ROPE_EXT_NATIVE_BF16 && !(defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__))
#error "ROPE_EXT_NATIVE_BF16 needs CPU_CAPABILITY_AVX512 and -mavx512bf16"
#endif

namespace rope_ext::cpu::CPU_CAPABILITY {

using at::vec::Vectorized;

// f(a value of the C++ type of `dtype`): the one switch from a kernel's dtype to its instantiation.
template <typename F>
void by_kernel_dtype(KernelDtype dtype, const F& f) {
  switch (dtype) {
    case KernelDtype::kFloat: return f(float{});
    case KernelDtype::kDouble: return f(double{});
    case KernelDtype::kHalf: return f(c10::Half{});
    case KernelDtype::kBFloat16: return f(c10::BFloat16{});
  }
  throw std::logic_error("rope_ext internal error (please report it): the CPU kernel has no such dtype");
}

// at::parallel_for's contract, through the caller's pool (rotary_cpu.h's ThreadPool).
template <typename F>
void parallel_for(const ThreadPool& pool, int64_t begin, int64_t end, int64_t grain, const F& body) {
  pool.parallel_for(begin, end, grain, &body,
                    [](const void* f, int64_t b, int64_t e) { (*static_cast<const F*>(f))(b, e); });
}

// n value-initialized elements, on the stack when they fit in N (a token's tables, per chunk).
template <typename T, size_t N>
class Scratch {
 public:
  explicit Scratch(size_t n) : data_(n <= N ? local_.data() : (heap_.resize(n), heap_.data())) {
    std::fill_n(data_, n, T{});
  }
  Scratch(const Scratch&) = delete;  // (data_ may point into local_)
  Scratch& operator=(const Scratch&) = delete;
  T* data() { return data_; }

 private:
  std::array<T, N> local_;
  std::vector<T> heap_;
  T* data_;
};

// The size thresholds at which this kernel changes path (streaming stores, the parallel grain,
// the head-major tile and thread split) arrive as a Thresholds (rotary_cpu.h), whose defaults
// and reasons are in rotary_cpu.cpp.

// How far ahead of the row being rotated x is prefetched, in bytes. Rows of one token's
// heads are usually adjacent in memory, so the next rows' lines are requested while this
// row computes; a prefetch past x's end or into another tensor is harmless.
constexpr int64_t kPrefetchBytes = 2048;

// Requests the lines of the row of `bytes` bytes that starts kPrefetchBytes past `row` (a hint: it
// reads and checks nothing, and a line past x's end or into another tensor is harmless). kLocality is
// __builtin_prefetch's: 0, non-temporal (prefetchnta on x86), for a row rewritten as soon as it is
// read; 3, into every cache level, for one rewritten later.
template <int kLocality = 0>
inline void prefetch_ahead(const void* row, int64_t bytes) {
  const char* ahead = static_cast<const char*>(row) + kPrefetchBytes;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(ahead + b, 0, kLocality);
}

// The position at offset `at` of a gathered call's positions, int32 or int64 (widened).
inline int64_t position_at(const void* positions, bool int32, int64_t at) {
  return int32 ? int64_t{static_cast<const int32_t*>(positions)[at]} : static_cast<const int64_t*>(positions)[at];
}

// Bytes one streaming store of this variant writes (streaming.h): 0 for DEFAULT, which has none.
constexpr int64_t kStreamStoreBytes = streaming_store_bytes(Isa::CPU_CAPABILITY);
static_assert(kStreamStoreBytes == (ROPE_EXT_STREAMING_STORES ? sizeof(Vectorized<float>) : 0),
              "a streaming store writes exactly one Vectorized<float> register");

// True when x's rows of one token are farther apart in memory than consecutive tokens' rows,
// i.e. storage is head-major: the smallest head stride of x exceeds its smallest token stride.
inline bool head_major(const RotaryPlan& p) {
  if (p.heads.ndim == 0 || p.tokens.ndim == 0) return false;
  const auto smallest = [](const auto& dims, int operand) {
    int64_t m = std::numeric_limits<int64_t>::max();
    for (int d = 0; d < dims.ndim; ++d) m = std::min(m, std::abs(dims.strides[operand][d]));
    return m;
  };
  return smallest(p.heads, kX) > smallest(p.tokens, kX);
}

// Loads and stores of 2 * Vectorized<opmath_t>::size() elements of scalar_t, converting
// float16/bfloat16 to float in registers.
template <typename scalar_t>
struct VecIO {
  using opmath_t = at::opmath_type<scalar_t>;
  using Vec = Vectorized<opmath_t>;
  static constexpr int64_t kStep = 2 * Vec::size();
  // load() and store() of a 16-bit type move one Vectorized<scalar_t>: exactly kStep elements, so
  // the vector body neither reads nor writes past the columns it rotates.
  static_assert(std::is_same_v<scalar_t, opmath_t> || Vectorized<scalar_t>::size() == kStep,
                "a 16-bit vector holds the elements of two float vectors");
  // float, float16 and bfloat16 outputs may be streamed (store_streaming); double never is.
  static constexpr bool kStreams = kStreamStoreBytes > 0 && !std::is_same_v<scalar_t, double>;
  static_assert(!kStreams || (kStep * sizeof(scalar_t)) % std::max<int64_t>(kStreamStoreBytes, 1) == 0,
                "a step of the vector body stores whole registers (streaming_row_aligned relies on it)");

#if defined(CPU_CAPABILITY_AVX512)
  static constexpr bool kHalfLoads = true;
  static Vec bf16_half_to_float(const scalar_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  static constexpr bool kHalfLoads = true;
  static Vec bf16_half_to_float(const scalar_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
#else
  static constexpr bool kHalfLoads = false;
#endif
  static void load(const scalar_t* p, Vec& a, Vec& b) {
    if constexpr (std::is_same_v<scalar_t, opmath_t>) {
      a = Vec::loadu(p);
      b = Vec::loadu(p + Vec::size());
    } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && kHalfLoads) {
      // a bfloat16 is the high half of its float: widen each half-register load directly (ATen's
      // load_to_float loads the whole register twice and extracts the upper half)
      a = bf16_half_to_float(p);
      b = bf16_half_to_float(p + Vec::size());
    } else {
      at::vec::load_to_float<scalar_t>(p, a, b);
    }
  }
  // a and b rounded to scalar_t, for float16/bfloat16: one Vectorized<scalar_t>.
  static Vectorized<scalar_t> narrow(const Vec& a, const Vec& b) {
#if ROPE_EXT_NATIVE_BF16
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      // vcvtne2ps2bf16 rounds to nearest even like ATen's integer sequence (and keeps NaN a NaN),
      // but it reads float denormals as zero where ATen rounds them to bfloat16 denormals. Such
      // lanes are rare and found with two compares: those steps take ATen's rounding.
      const __m512 fa = a, fb = b;
      constexpr int kDenormal = 0x20;  // vfpclassps category: denormal (either sign)
      const __mmask16 da = _mm512_fpclass_ps_mask(fa, kDenormal), db = _mm512_fpclass_ps_mask(fb, kDenormal);
      if (__builtin_expect(_kortestz_mask16_u8(da, db), 1)) {  // kortestw: one branch for both
        // the second operand fills the low half
        return Vectorized<scalar_t>(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(fb, fa)));
      }
    }
#endif
    return at::vec::convert_from_float<scalar_t>(a, b);
  }
  static void store(scalar_t* p, const Vec& a, const Vec& b) {
    if constexpr (std::is_same_v<scalar_t, opmath_t>) {
      a.store(p);
      b.store(p + Vec::size());
    } else {
      narrow(a, b).store(p);
    }
  }

  // The step of pairs [c, c + kStep) of a row with contiguous columns: x1 holds their first
  // members and x2 their second, two vectors each (half-split: columns c.. and half + c..;
  // interleaved: columns 2c.. alternating first and second).
  template <bool kInterleaved>
  static void load_pairs(const scalar_t* row, int64_t c, int64_t half, Vec (&x1)[2], Vec (&x2)[2]) {
    if constexpr (kInterleaved) {
      Vec a[4];
      load(row + 2 * c, a[0], a[1]);
      load(row + 2 * c + kStep, a[2], a[3]);
      std::tie(x1[0], x2[0]) = at::vec::deinterleave2(a[0], a[1]);
      std::tie(x1[1], x2[1]) = at::vec::deinterleave2(a[2], a[3]);
    } else {
      load(row + c, x1[0], x1[1]);
      load(row + half + c, x2[0], x2[1]);
    }
  }
  // load_pairs' inverse: the step's results o1 (first members) and o2 (second) into their columns;
  // with kStream through non-temporal stores (the caller has checked their alignment).
  template <bool kInterleaved, bool kStream = false>
  static void store_pairs(scalar_t* row, int64_t c, int64_t half, const Vec (&o1)[2], const Vec (&o2)[2]) {
    const auto put = [](scalar_t* p, const Vec& a, const Vec& b) {
      if constexpr (kStream) {
        store_streaming(p, a, b);
      } else {
        store(p, a, b);
      }
    };
    if constexpr (kInterleaved) {
      Vec b[4];
      std::tie(b[0], b[1]) = at::vec::interleave2(o1[0], o2[0]);
      std::tie(b[2], b[3]) = at::vec::interleave2(o1[1], o2[1]);
      put(row + 2 * c, b[0], b[1]);
      put(row + 2 * c + kStep, b[2], b[3]);
    } else {
      put(row + c, o1[0], o1[1]);
      put(row + half + c, o2[0], o2[1]);
    }
  }

  // store() with non-temporal stores where the ISA has them. Every register store must be
  // kStreamStoreBytes-aligned, which the caller establishes with streaming_row_aligned.
  static void store_streaming(scalar_t* p, const Vec& a, const Vec& b) {
#ifdef ROPE_EXT_DEBUG_CHECKS
    // A misaligned streaming store faults without a word, and AddressSanitizer does not see
    // intrinsic stores: debug builds (DEBUG=1, make sanitize) check every one.
    if (!(kStreamStoreBytes > 0 && reinterpret_cast<std::uintptr_t>(p) % kStreamStoreBytes == 0)) {
      char what[160];
      std::snprintf(what, sizeof what,
                    "rope_ext internal error (please report it): misaligned streaming store: %p is not %lld-byte "
                    "aligned", static_cast<const void*>(p), static_cast<long long>(kStreamStoreBytes));
      throw std::logic_error(what);
    }
#endif
#if ROPE_EXT_STREAMING_STORES
    if constexpr (std::is_same_v<scalar_t, float>) {
#if defined(CPU_CAPABILITY_AVX512)
      _mm512_stream_ps(p, a);
      _mm512_stream_ps(p + Vec::size(), b);
#else
      _mm256_stream_ps(p, a);
      _mm256_stream_ps(p + Vec::size(), b);
#endif
      return;
    } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>) {
      const Vectorized<scalar_t> v = narrow(a, b);
      static_assert(sizeof(v) == kStreamStoreBytes, "a 16-bit step is one whole register");
#if defined(CPU_CAPABILITY_AVX512)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
#else
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
#endif
      return;
    }
#endif
    store(p, a, b);
  }
};

// Ends a thread's share of a streaming call: orders its streaming stores before whatever reads the
// output next, and counts its streamed rows (PathCounts).
inline void finish_streaming(int64_t streamed_rows) {
#if ROPE_EXT_STREAMING_STORES
  _mm_sfence();
#endif
  if (streamed_rows > 0) path_counts().streamed_rows.fetch_add(streamed_rows, std::memory_order_relaxed);
}

// dst[0, n) = src[0, n) converted to float, for float16/bfloat16 src.
template <typename src_t, typename opmath_t>
void convert_span(const src_t* src, opmath_t* dst, int64_t n) {
  static_assert(std::is_same_v<opmath_t, float> && !std::is_same_v<src_t, float>,
                "convert_span widens 16-bit floats to float");
  using IO = VecIO<src_t>;
  int64_t i = 0;
  for (; i + IO::kStep <= n; i += IO::kStep) {
    typename IO::Vec a, b;
    IO::load(src + i, a, b);
    a.store(dst + i);
    b.store(dst + i + IO::Vec::size());
  }
  for (; i < n; ++i) dst[i] = static_cast<opmath_t>(src[i]);
}

// One token's table entries in opmath, indexed by pair: c1[i], s1[i] belong to the pair's
// first member, c2[i], s2[i] to its second (see rotate_pair in rotary_math.h).
template <typename opmath_t>
struct PairTables {
  const opmath_t* c1;
  const opmath_t* s1;
  const opmath_t* c2;
  const opmath_t* s2;
};

// The rotation or its transpose (the backward's; rotate_pair<true> in rotary_math.h), chosen at run
// time rather than instantiated twice. The transpose is the rotation with each pair's two sines
// swapped and negated (x1 c1 + x2 s2 = x1 c1 - x2 (-s2), and x2 c2 - x1 s1 = x2 c2 + x1 (-s1)), and
// negation is exact: rotary_typed swaps s1 and s2 (transposed_tables), and every sine the rotation
// reads passes through a SineSign, which flips its sign bit or keeps it, so the kernels below compute
// rotate_pair<false> only, with rotate_pair<true>'s bits. (Instantiated for both, the rotation's code
// was twice as much to compile in every build: docs/devlog.md, issue 53 part 5, has the times.)
template <typename opmath_t>
struct SineSign {
  using Vec = Vectorized<opmath_t>;
  Vec mask;     // the sign bit alone in every lane (-0.0) for the transpose, nothing (+0.0) for the rotation
  bool negate;  // the same, for the scalar tails
  explicit SineSign(bool transpose) : mask(transpose ? opmath_t(-0.0) : opmath_t(0.0)), negate(transpose) {}
  Vec operator()(const Vec& s) const { return s ^ mask; }
  opmath_t operator()(opmath_t s) const { return negate ? -s : s; }
};

// The tables of the transpose, from the rotation's: the pair's sines swapped (SineSign negates them).
// Gathered tables hold one sine per pair (s2 = s1), which the swap keeps.
template <typename opmath_t>
PairTables<opmath_t> transposed_tables(const PairTables<opmath_t>& t, bool transpose) {
  return transpose ? PairTables<opmath_t>{t.c1, t.s2, t.c2, t.s1} : t;
}

// Builds a token's PairTables. When the tables already are contiguous opmath values in
// half-split order they are used in place; otherwise they are converted and de-interleaved
// once into `buf` (4 * half values), then reused for every head of the token.
//
// kGathered: cos and sin are a row of half-width caches (rotary_pos), one value per pair for
// both members, so c2 = c1 and s2 = s1: a contiguous opmath row is used in place, others are
// converted once into buf (2 * half values), whatever the pairing.
template <bool kInterleaved, bool kGathered, typename opmath_t, typename table_t>
PairTables<opmath_t> token_tables(const table_t* cos, int64_t cos_col, const table_t* sin,
                                  int64_t sin_col, int64_t half, opmath_t* buf) {
  if constexpr (kGathered) {
    if (cos_col == 1 && sin_col == 1) {
      if constexpr (std::is_same_v<table_t, opmath_t>) {
        return {cos, sin, cos, sin};
      } else if constexpr (std::is_same_v<opmath_t, float>) {
        convert_span(cos, buf, half);
        convert_span(sin, buf + half, half);
        return {buf, buf + half, buf, buf + half};
      }
    }
    for (int64_t i = 0; i < half; ++i) {
      buf[i] = static_cast<opmath_t>(cos[i * cos_col]);
      buf[half + i] = static_cast<opmath_t>(sin[i * sin_col]);
    }
    return {buf, buf + half, buf, buf + half};
  }
  if constexpr (!kInterleaved) {
    if (cos_col == 1 && sin_col == 1) {
      if constexpr (std::is_same_v<table_t, opmath_t>) {
        return {cos, sin, cos + half, sin + half};
      } else if constexpr (std::is_same_v<opmath_t, float>) {
        // contiguous 16-bit tables: converted a vector at a time (float tables of double x
        // take the loop below)
        convert_span(cos, buf, half);
        convert_span(sin, buf + half, half);
        convert_span(cos + half, buf + 2 * half, half);
        convert_span(sin + half, buf + 3 * half, half);
        return {buf, buf + half, buf + 2 * half, buf + 3 * half};
      }
    }
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
template <bool kInterleaved, typename scalar_t, typename opmath_t>
void rotate_pairs_scalar(const scalar_t* x, int64_t x_col, scalar_t* out, int64_t out_col,
                         const PairTables<opmath_t>& t, const SineSign<opmath_t>& sign, int64_t begin,
                         int64_t half) {
  for (int64_t i = begin; i < half; ++i) {
    const int64_t a = pair_first(i, half, kInterleaved);
    const int64_t b = pair_second(i, half, kInterleaved);
    opmath_t o1, o2;
    rotate_pair<false>(static_cast<opmath_t>(x[a * x_col]), static_cast<opmath_t>(x[b * x_col]), t.c1[i],
                       sign(t.s1[i]), t.c2[i], sign(t.s2[i]), o1, o2);
    out[a * out_col] = static_cast<scalar_t>(o1);
    out[b * out_col] = static_cast<scalar_t>(o2);
  }
}

// Rotates one row whose x and out columns are contiguous: vector body, scalar tail. With
// kStream the vector body's stores are non-temporal (the caller checks their alignment). With
// kGathered the tables hold one value per pair (c2 = c1, s2 = s1), loaded once.
//
// Inlined into its loops, and `t` taken by value: the compiler then knows the row's stores cannot
// change the table pointers, which it otherwise reloads at every step (the call and those reloads
// were a fifth of the AVX2 float32 row's instructions).
template <bool kInterleaved, bool kStream, bool kGathered, typename scalar_t, typename opmath_t>
C10_ALWAYS_INLINE void rotate_row_contiguous(const scalar_t* x, scalar_t* out, const PairTables<opmath_t> t,
                                             const SineSign<opmath_t>& sign, int64_t half) {
  using IO = VecIO<scalar_t>;
  using Vec = typename IO::Vec;
  constexpr int64_t V = Vec::size();
  constexpr int64_t kStep = IO::kStep;  // pairs per iteration
  int64_t i = 0;
  for (; i + kStep <= half; i += kStep) {
    Vec x1[2], x2[2], o1[2], o2[2];
    IO::template load_pairs<kInterleaved>(x, i, half, x1, x2);
    for (int k = 0; k < 2; ++k) {
      const int64_t j = i + k * V;
      if constexpr (kGathered) {
        const Vec c = Vec::loadu(t.c1 + j), s = sign(Vec::loadu(t.s1 + j));
        rotate_pair<false>(x1[k], x2[k], c, s, c, s, o1[k], o2[k]);
      } else {
        rotate_pair<false>(x1[k], x2[k], Vec::loadu(t.c1 + j), sign(Vec::loadu(t.s1 + j)),
                           Vec::loadu(t.c2 + j), sign(Vec::loadu(t.s2 + j)), o1[k], o2[k]);
      }
    }
    IO::template store_pairs<kInterleaved, kStream>(out, i, half, o1, o2);
  }
  rotate_pairs_scalar<kInterleaved>(x, 1, out, 1, t, sign, i, half);
}

// How many vector steps (IO::kStep pairs each) of one token's tables rotate_block_rows holds in
// registers: 8 of AVX2's 16 and 16 of AVX-512's 32 registers, the rest left to the rows' values.
template <typename scalar_t, bool kGathered>
constexpr int kRegisterSteps =
    std::max(1, ((sizeof(Vectorized<float>) >= 64 ? 16 : 8) / (2 * (kGathered ? 2 : 4))));

// kUnrolledSteps (rotary_cpu.h): the widest row, in vector steps, that rotate_block_rows unrolls.
// Wider rows take rotate_row_contiguous's loop.

// The contiguous-row fast path: pairs [0, kSteps * kStep) (a row's whole vector part) of `nh`
// rows that share one token's tables, row h at x + h * x_head (and out + h * out_head), columns
// contiguous, one row after the other, each row's steps unrolled. The tables of the first kHeld
// steps are loaded into registers once and kept there for every row, which a row-at-a-time loop
// reloads per row; those of the steps beyond (rows wider than the register budget) are read from
// L1 at each row, as a plain loop does. kHeld is chosen so that the held tables fit the register
// file beside the row's values.
//
// Each row is finished before the next starts: splitting wide rows into column blocks, one pass
// over the token's rows per block, reads each row's cache lines out of order, which measured 0.58
// of neg_ out of cache (AVX2, float32, head_dim 128, in place) where a pass per row reaches 0.97.
// And unrolled: rows wider than the held tables went through rotate_row_contiguous's loop (4
// iterations a row on AVX2 at head_dim 128), and the probe's AVX2 float32 in cache rose from 0.74
// to 0.82 of the plain loop when they were unrolled instead (docs/devlog.md, issue 30's third pass).
template <int kSteps, int kHeld, bool kInterleaved, bool kGathered, typename scalar_t, typename opmath_t>
inline void rotate_block_rows(const scalar_t* x, int64_t x_head, scalar_t* out, int64_t out_head, int64_t nh,
                              const PairTables<opmath_t>& tables, const SineSign<opmath_t>& sine_sign,
                              int64_t half) {
  const PairTables<opmath_t> t = tables;  // local copies: the rows' stores cannot change them
  const SineSign<opmath_t> sign = sine_sign;
  static_assert(1 <= kHeld && kHeld <= kSteps, "rotate_block_rows holds 1 to kSteps steps of tables");
  using IO = VecIO<scalar_t>;
  using Vec = typename IO::Vec;
  constexpr int64_t V = Vec::size();
  constexpr int64_t kStep = IO::kStep;
  constexpr int kN = 2 * kHeld;  // Vec registers per held table
  constexpr int kTables = kGathered ? 2 : 4;
  Vec tab[kTables][kN];
#pragma GCC unroll 16
  for (int k = 0; k < kN; ++k) {
    const int64_t j = k * V;
    tab[0][k] = Vec::loadu(t.c1 + j);
    tab[1][k] = sign(Vec::loadu(t.s1 + j));
    if constexpr (!kGathered) {
      tab[2][k] = Vec::loadu(t.c2 + j);
      tab[3][k] = sign(Vec::loadu(t.s2 + j));
    }
  }
  const Vec(&c2)[kN] = tab[kGathered ? 0 : 2];
  const Vec(&s2)[kN] = tab[kGathered ? 1 : 3];
  // Step q of a row (pairs [q * kStep, (q + 1) * kStep)), with q known at compile time.
  const auto rotate_step = [&](auto step, const scalar_t* xr, scalar_t* outr) {
    constexpr int q = decltype(step)::value;
    const int64_t c = q * kStep;  // first pair of this step
    Vec x1[2], x2[2], o1[2], o2[2];
    IO::template load_pairs<kInterleaved>(xr, c, half, x1, x2);
#pragma GCC unroll 2
    for (int k = 0; k < 2; ++k) {  // unrolled, so that tab[.][m] is a register
      const int m = 2 * q + k;
      if constexpr (q < kHeld) {
        rotate_pair<false>(x1[k], x2[k], tab[0][m], tab[1][m], c2[m], s2[m], o1[k], o2[k]);
      } else if constexpr (kGathered) {
        const Vec cm = Vec::loadu(t.c1 + m * V), sm = sign(Vec::loadu(t.s1 + m * V));
        rotate_pair<false>(x1[k], x2[k], cm, sm, cm, sm, o1[k], o2[k]);
      } else {
        rotate_pair<false>(x1[k], x2[k], Vec::loadu(t.c1 + m * V), sign(Vec::loadu(t.s1 + m * V)),
                           Vec::loadu(t.c2 + m * V), sign(Vec::loadu(t.s2 + m * V)), o1[k], o2[k]);
      }
    }
    IO::template store_pairs<kInterleaved>(outr, c, half, o1, o2);
  };
  for (int64_t h = 0; h < nh; ++h) {
    const scalar_t* xr = x + h * x_head;
    scalar_t* outr = out + h * out_head;
    [&]<int... q>(std::integer_sequence<int, q...>) {
      (rotate_step(std::integral_constant<int, q>{}, xr, outr), ...);
    }(std::make_integer_sequence<int, kSteps>{});
  }
}

// rotate_row_contiguous on `nh` rows of one token (row h at x + h * x_head), for rows too wide for
// rotate_block_rows to unroll.
template <bool kInterleaved, bool kGathered, typename scalar_t, typename opmath_t>
void rotate_wide_rows(const scalar_t* x, int64_t x_head, scalar_t* out, int64_t out_head, int64_t nh,
                      const PairTables<opmath_t>& tables, const SineSign<opmath_t>& sine_sign, int64_t half) {
  const PairTables<opmath_t> t = tables;
  const SineSign<opmath_t> sign = sine_sign;
  for (int64_t h = 0; h < nh; ++h) {
    rotate_row_contiguous<kInterleaved, false, kGathered>(x + h * x_head, out + h * out_head, t, sign, half);
  }
}

// The contiguous-row fast path for the rows of one call (columns contiguous, x_col = out_col = 1),
// chosen once per call from the rotary width, so that each token costs one call:
// - rows of up to kUnrolledSteps vector steps: the instantiation of rotate_block_rows for their
//   step count, then each row's scalar tail (pairs [tail, half)) where there is one;
// - wider rows (half / kStep > kUnrolledSteps: at 8, for float and 16-bit x, rotary_dim 288 and up
//   on AVX2 and DEFAULT, 576 and up on AVX-512; double x from half those): rotate_row_contiguous's
//   loop, a row at a time, tail included (PathCounts::wide_fast_rows).
template <bool kInterleaved, bool kGathered, typename scalar_t, typename opmath_t>
struct FastRows {
  // The tables by reference: by value, the caller built the 32-byte argument with two 16-byte
  // stores over its own 8-byte ones, and the loads that followed waited for them to reach the cache
  // (no store forwarding across stores of different widths), once per token.
  using Fn = void (*)(const scalar_t*, int64_t, scalar_t*, int64_t, int64_t, const PairTables<opmath_t>&,
                      const SineSign<opmath_t>&, int64_t);
  Fn vector_part = nullptr;  // nullptr when the rows are all tail
  int64_t tail = 0;          // first pair left to rotate_pairs_scalar
  bool wide = false;

  explicit FastRows(int64_t half) {
    constexpr int64_t kStep = VecIO<scalar_t>::kStep;
    const int64_t steps = half / kStep;
    if (steps > kUnrolledSteps) {
      vector_part = &rotate_wide_rows<kInterleaved, kGathered, scalar_t, opmath_t>;
      tail = half;
      wide = true;
      return;
    }
    if (steps > 0) vector_part = kBlocks[steps - 1];  // steps == 0: the rows are all tail
    tail = steps * kStep;
  }

  // Rotates `nh` rows of one token, row h at x + h * x_head (and out + h * out_head), and copies
  // their pass-through columns (head_dim > 2 * half) when out is not x.
  void rotate(const scalar_t* x, int64_t x_head, scalar_t* out, int64_t out_head, int64_t nh,
              const PairTables<opmath_t>& t, const SineSign<opmath_t>& sign, int64_t half,
              int64_t head_dim) const {
    if (vector_part != nullptr) vector_part(x, x_head, out, out_head, nh, t, sign, half);
    const int64_t rotary_dim = 2 * half;
    const bool copy_pass = rotary_dim < head_dim && out != x;  // in place, they are already there
    if (tail == half && !copy_pass) return;
    for (int64_t h = 0; h < nh; ++h) {
      const scalar_t* xr = x + h * x_head;
      scalar_t* outr = out + h * out_head;
      rotate_pairs_scalar<kInterleaved>(xr, 1, outr, 1, t, sign, tail, half);
      if (copy_pass) std::memcpy(outr + rotary_dim, xr + rotary_dim, (head_dim - rotary_dim) * sizeof(scalar_t));
    }
  }

 private:
  // kBlocks[s - 1]: rotate_block_rows for s steps, holding what the registers allow.
  static constexpr auto kBlocks = []<int... s>(std::integer_sequence<int, s...>) {
    return std::array<Fn, sizeof...(s)>{
        &rotate_block_rows<s + 1, std::min(s + 1, kRegisterSteps<scalar_t, kGathered>), kInterleaved, kGathered,
                           scalar_t, opmath_t>...};
  }(std::make_integer_sequence<int, kUnrolledSteps>{});
};

// Walks the linear indices of a StridedDims in order, keeping each operand's offset: the first
// position costs an unravel (divisions), each next one an add and rarely a carry.
template <int kOperands>
struct StridedCursor {
  const StridedDims<kOperands>& dims;
  int64_t index[kMaxDims];
  int64_t off[kOperands];

  void seek(int64_t linear) {
    for (int k = 0; k < kOperands; ++k) off[k] = 0;
    for (int d = dims.ndim - 1; d >= 0; --d) {
      index[d] = linear % dims.sizes[d];
      linear /= dims.sizes[d];
      for (int k = 0; k < kOperands; ++k) off[k] += index[d] * dims.strides[k][d];
    }
  }
  void next() {
    for (int d = dims.ndim - 1; d >= 0; --d) {
      for (int k = 0; k < kOperands; ++k) off[k] += dims.strides[k][d];
      if (++index[d] < dims.sizes[d]) return;
      for (int k = 0; k < kOperands; ++k) off[k] -= dims.sizes[d] * dims.strides[k][d];
      index[d] = 0;
    }
  }
};

template <typename scalar_t, typename table_t, bool kInterleaved, bool kGathered>
void rotary_typed(const RotaryPlan& p, const KernelOperands& o, bool transpose, const Thresholds& th,
                  const ThreadPool& pool) {
  using opmath_t = at::opmath_type<scalar_t>;
  const scalar_t* x_base = static_cast<const scalar_t*>(o.x);
  scalar_t* out_base = static_cast<scalar_t*>(o.out);
  const table_t* cos_base = static_cast<const table_t*>(o.cos);
  const table_t* sin_base = static_cast<const table_t*>(o.sin);
  const void* positions = o.positions;

  // A token's PairTables, from the tables' offsets `tok` (kCos, kSin) or, gathered, from the row
  // of the caches its position (at offset tok[kCos] of positions) selects, with the sines swapped
  // for the transpose (`sign` negates them as they load: SineSign). The caller has checked every
  // position against the cache.
  const SineSign<opmath_t> sign(transpose);
  const auto position = [&](int64_t offset) { return position_at(positions, p.positions_int32, offset); };
  const auto tables_at = [&](const int64_t (&tok)[4], opmath_t* buf) {
    if constexpr (kGathered) {
      const int64_t pos = position(tok[kCos]);
      return token_tables<kInterleaved, true>(cos_base + pos * p.cos_row, p.cos_col, sin_base + pos * p.sin_row,
                                              p.sin_col, p.rotary_dim / 2, buf);  // (s2 = s1: no swap)
    } else {
      return transposed_tables(token_tables<kInterleaved, false>(cos_base + tok[kCos], p.cos_col,
                                                                 sin_base + tok[kSin], p.sin_col,
                                                                 p.rotary_dim / 2, buf),
                               transpose);
    }
  };

  const int64_t half = p.rotary_dim / 2;
  const int64_t pass = p.head_dim - p.rotary_dim;  // pass-through columns per row
  const int64_t nheads = p.num_heads();
  const int64_t ntokens = p.num_tokens();

  // Gathered: requests the cache rows of the next token (`next`, at offsets next_tok) while the
  // current one (at position `pos`) rotates. Positions in no order (packed sequences, decodes at
  // different lengths, random tests) give the hardware prefetcher nothing to follow, and out of
  // cache, with x streaming through, each token would otherwise wait for its rows from memory. The
  // next position of a sequence (or the same one) is left to the hardware, which follows it. A hint:
  // it reads and checks nothing. Rows with strided columns are left to the hardware.
  const auto prefetch_tables = [&](int64_t next, const int64_t (&next_tok)[4], int64_t pos) {
    if (next >= ntokens || p.cos_col != 1 || p.sin_col != 1) return;
    const int64_t next_pos = position(next_tok[kCos]);
    if (next_pos == pos || next_pos == pos + 1) return;
    const char* c = reinterpret_cast<const char*>(cos_base + next_pos * p.cos_row);
    const char* s = reinterpret_cast<const char*>(sin_base + next_pos * p.sin_row);
    for (int64_t b = 0; b < half * static_cast<int64_t>(sizeof(table_t)); b += 64) {
      __builtin_prefetch(c + b, 0, 3);
      __builtin_prefetch(s + b, 0, 3);
    }
  };
  const int64_t rows = p.num_tokens() * nheads;
  const bool contiguous_rows = p.x_col == 1 && p.out_col == 1;
  const int64_t grain = std::max<int64_t>(1, th.grain_elements / std::max<int64_t>(1, p.head_dim));
  using IO = VecIO<scalar_t>;
  const int64_t row_bytes = p.rotary_dim * static_cast<int64_t>(sizeof(scalar_t));
  // Streaming stores skip the read for ownership of each output line, a third memory stream
  // beside reading x and writing out; in place, the lines were just read anyway.
  const bool stream = IO::kStreams && x_base != out_base &&
                      o.out_numel * static_cast<int64_t>(sizeof(scalar_t)) >= th.streaming_bytes;

  // One row: x at xr, out at outr, rotated with one token's tables. Adds 1 to `streamed` if the
  // row was written with streaming stores.
  const auto rotate_row = [&](const scalar_t* xr, scalar_t* outr, const PairTables<opmath_t>& t,
                              int64_t& streamed) {
    if (contiguous_rows) {
      prefetch_ahead(xr, row_bytes);
      if (stream && streaming_row_aligned(reinterpret_cast<std::uintptr_t>(outr), half, sizeof(scalar_t),
                                          kInterleaved, kStreamStoreBytes)) {
        rotate_row_contiguous<kInterleaved, true, kGathered>(xr, outr, t, sign, half);
        ++streamed;
      } else {
        rotate_row_contiguous<kInterleaved, false, kGathered>(xr, outr, t, sign, half);
      }
      if (pass > 0 && outr != xr) {  // in place, the pass-through columns are already there
        std::memcpy(outr + p.rotary_dim, xr + p.rotary_dim, pass * sizeof(scalar_t));
      }
    } else {
      rotate_pairs_scalar<kInterleaved>(xr, p.x_col, outr, p.out_col, t, sign, 0, half);
      if (outr != xr || p.out_col != p.x_col) {
        for (int64_t c = p.rotary_dim; c < p.head_dim; ++c) outr[c * p.out_col] = xr[c * p.x_col];
      }
    }
  };

  if (!head_major(p)) {
    // The fast path: rows with contiguous columns along at most one head dim, stored normally.
    // (Streamed rows keep rotate_row, which checks each row's alignment.)
    const bool fast = contiguous_rows && !stream && p.heads.ndim <= 1;
    // Token-major storage (e.g. (B,S,H,D), or HF's (B,H,S,D) view of it): rows in storage
    // order, each token's tables built once for its adjacent heads. Threads split rows, so
    // a few tokens with many heads (decode) still divide.
    const FastRows<kInterleaved, kGathered, scalar_t, opmath_t> fast_rows(half);  // used when `fast`
    parallel_for(pool, 0, rows, grain, [&](int64_t begin, int64_t end) {
      Scratch<opmath_t, 512> buf(4 * half);  // a token's converted tables (token_tables)
      int64_t streamed = 0;
      StridedCursor<2> head{p.heads};
      const int64_t hx = p.heads.ndim ? p.heads.strides[kX][0] : 0;  // the fast path's head strides
      const int64_t ho = p.heads.ndim ? p.heads.strides[kOut][0] : 0;
      // one division for the chunk; each next token starts at its head 0
      int64_t token = begin / nheads;
      int64_t h_begin = begin % nheads;
      StridedCursor<4> next{p.tokens};  // the token after the current one
      next.seek(token);
      for (int64_t row = begin; row < end; ++token, h_begin = 0) {
        const int64_t h_end = std::min(nheads, h_begin + (end - row));
        int64_t tok[4];
        std::copy(next.off, next.off + 4, tok);
        next.next();
        const auto t = tables_at(tok, buf.data());
        if constexpr (kGathered) prefetch_tables(token + 1, next.off, position(tok[kCos]));
        if (fast) {
          fast_rows.rotate(x_base + tok[kX] + h_begin * hx, hx, out_base + tok[kOut] + h_begin * ho, ho,
                           h_end - h_begin, t, sign, half, p.head_dim);
          row += h_end - h_begin;
          continue;
        }
        head.seek(h_begin);  // then no division per row
        for (int64_t h = h_begin; h < h_end; ++h, head.next()) {
          rotate_row(x_base + tok[kX] + head.off[kX], out_base + tok[kOut] + head.off[kOut], t, streamed);
        }
        row += h_end - h_begin;
      }
      if (stream) finish_streaming(streamed);
      path_counts().rows[fast ? kFastRows : kGeneralRows].fetch_add(end - begin, std::memory_order_relaxed);
      if (fast && fast_rows.wide) path_counts().wide_fast_rows.fetch_add(end - begin, std::memory_order_relaxed);
    });
    return;
  }

  // Head-major storage (e.g. contiguous (B,H,S,D)): a token's heads lie far apart, so walking
  // token by token would touch one row in each of nheads distant places. Instead each tile of
  // th.tile_tokens tokens has its tables built once, then is rotated head by head: every head's
  // rows of a tile are one contiguous run of memory. Threads split the heads when there are
  // enough of them, so that each writes its own stretch of the output (pages that fault in on
  // first write are not shared between threads); otherwise they split the tokens.
  const auto walk = [&](int64_t t_begin, int64_t t_end, int64_t h_begin, int64_t h_end) {
    const int64_t tile = th.tile_tokens;
    std::vector<opmath_t> buf(tile * 4 * half);
    std::vector<PairTables<opmath_t>> tables(tile);
    struct Offsets {
      int64_t of[4];  // x, out, cos, sin (TokenOperand)
    };
    std::vector<Offsets> tok(tile);
    int64_t streamed = 0;
    for (int64_t t0 = t_begin; t0 < t_end; t0 += tile) {
      const int64_t n = std::min(tile, t_end - t0);
      for (int64_t j = 0; j < n; ++j) {
        p.tokens.offsets(t0 + j, tok[j].of);
        tables[j] = tables_at(tok[j].of, buf.data() + j * 4 * half);
      }
      StridedCursor<2> head{p.heads};
      head.seek(h_begin);
      for (int64_t h = h_begin; h < h_end; ++h, head.next()) {
        for (int64_t j = 0; j < n; ++j) {
          rotate_row(x_base + tok[j].of[kX] + head.off[kX], out_base + tok[j].of[kOut] + head.off[kOut],
                     tables[j], streamed);
        }
      }
    }
    if (stream) finish_streaming(streamed);
  };
  // (nheads / threads >= m is nheads >= m * threads for positive values, without the overflow.)
  if (nheads / pool.num_threads() >= th.min_heads_per_thread) {
    path_counts().head_split_walks.fetch_add(1, std::memory_order_relaxed);
    const int64_t head_grain = std::max<int64_t>(1, grain / std::max<int64_t>(1, ntokens));
    parallel_for(pool, 0, nheads, head_grain, [&](int64_t begin, int64_t end) { walk(0, ntokens, begin, end); });
    path_counts().rows[kGeneralRows].fetch_add(rows, std::memory_order_relaxed);
  } else {
    path_counts().token_split_walks.fetch_add(1, std::memory_order_relaxed);
    const int64_t token_grain = std::max<int64_t>(1, grain / std::max<int64_t>(1, nheads));
    parallel_for(pool, 0, ntokens, token_grain, [&](int64_t begin, int64_t end) { walk(begin, end, 0, nheads); });
    path_counts().rows[kGeneralRows].fetch_add(rows, std::memory_order_relaxed);
  }
}

// The entry point declared in rotary_cpu.h: out = rotary(x, cos, sin), where `out` has
// been allocated by the caller with x's sizes and `p` describes all four tensors. `out` may
// be x itself (in place): each pair is read completely before it is written.
void rotary_kernel(const RotaryPlan& p, const KernelOperands& o, bool interleaved, bool conjugate,
                   const Thresholds& th, const ThreadPool& pool) {
  if (o.out_numel == 0) return;
  const auto by_type = [&](auto scalar_tag) {
    using scalar_t = decltype(scalar_tag);
    const auto run = [&](auto table_tag) {
      using table_t = decltype(table_tag);
      const auto typed = [&](auto inter, auto gathered) {
        rotary_typed<scalar_t, table_t, decltype(inter)::value, decltype(gathered)::value>(p, o, conjugate, th,
                                                                                            pool);
      };
      const auto by_gathered = [&](auto inter) {
        p.gathered ? typed(inter, std::true_type{}) : typed(inter, std::false_type{});
      };
      interleaved ? by_gathered(std::true_type{}) : by_gathered(std::false_type{});
    };
    // check_rotary_args allows tables in x's dtype or in float32.
    if (o.float_tables && !std::is_same_v<scalar_t, float>) {
      run(float{});
    } else {
      run(scalar_t{});
    }
  };
  by_kernel_dtype(o.dtype, by_type);
}

}  // namespace rope_ext::cpu::CPU_CAPABILITY
