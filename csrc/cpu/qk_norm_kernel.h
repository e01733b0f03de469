// The CPU kernel of QK-norm + RoPE (qk_norm_rotary), forward and backward. Like rotary_kernel.h,
// whose VecIO, parallel_for and rotate_pair it uses, it is compiled once per CPU capability: each
// rotary_kernel_<capability>.cpp includes it after rotary_kernel.h. Not a normal header.
//
// Per group of `group` rows (one head, or all of a token's heads), in the compute type T (float;
// double for double x), with g = weight + weight_offset (or 1) and b the bias (or 0):
//   forward   rstd = 1 / sqrt(mean(x^2) + eps);  x_hat = x * rstd;  out = rotary(g * x_hat + b, cos, sin)
//   backward  u = rotary^T(dy);  dg += u * x_hat;  db += u;  d = u * g;
//             dx = rstd * (d - x_hat * mean(d * x_hat))
// and with the weight after the rotation (NormOperands::weight_after):
//   forward   out = g * rotary(x_hat, cos, sin) + b
//   backward  d = rotary^T(g * dy);  dg += dy * rotary(x_hat);  db += dy;  dx as above
// Centered (LayerNorm, NormOperands::centered): x_hat = (x - mean(x)) * rstd with rstd = 1 / sqrt(
// mean((x - mean(x))^2) + eps), two passes over the buffered group, and dx = rstd * (d - mean(d) -
// x_hat * mean(d * x_hat)); the backward reads the mean the forward saved beside rstd.
// The row is read once into a T buffer; every value is rounded once, when stored. The backward
// recomputes x_hat from x and the saved rstd (never from out: a weight near 0 would lose it).
// The weights' (biases') gradient is summed in T per block of groups whose size depends on the shape only,
// and the blocks' sums are added in block order: the same bits whatever the thread count.

#ifndef CPU_CAPABILITY
#error "qk_norm_kernel.h must be compiled with -DCPU_CAPABILITY=<DEFAULT|AVX2|AVX512>"
#endif

#include <cmath>
#include <memory>

namespace rope_ext::cpu::CPU_CAPABILITY {

template <typename T>
struct NormMath {
  using Vec = Vectorized<T>;
  static constexpr int64_t kLanes = Vec::size();

  // sum(a[j] * b[j]): two vector accumulators, lanes added in order, then the tail.
  static T dot(const T* a, const T* b, int64_t n) {
    Vec acc0(T(0)), acc1(T(0));
    int64_t j = 0;
    for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
      acc0 = acc0 + Vec::loadu(a + j) * Vec::loadu(b + j);
      acc1 = acc1 + Vec::loadu(a + j + kLanes) * Vec::loadu(b + j + kLanes);
    }
    T s = sum_lanes(acc0 + acc1);
    for (; j < n; ++j) s += a[j] * b[j];
    return s;
  }

  // The lanes of v added (at::vec's shuffle tree on AVX2 and AVX-512: an order fixed by the ISA).
  static T sum_lanes(const Vec& v) {
    return at::vec::vec_reduce_all<T>([](const Vec& a, const Vec& b) { return a + b; }, v);
  }

  // y[j] = a[j] * s * g[j], or a[j] * s without g; y may be a.
  static void scale(const T* a, T s, const T* g, T* y, int64_t n) {
    const Vec vs(s);
    int64_t j = 0;
    if (g != nullptr) {
      for (; j + kLanes <= n; j += kLanes) (Vec::loadu(a + j) * vs * Vec::loadu(g + j)).store(y + j);
      for (; j < n; ++j) y[j] = a[j] * s * g[j];
    } else {
      for (; j + kLanes <= n; j += kLanes) (Vec::loadu(a + j) * vs).store(y + j);
      for (; j < n; ++j) y[j] = a[j] * s;
    }
  }

  // acc[j] += a[j]
  static void add(const T* a, T* acc, int64_t n) {
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) (Vec::loadu(acc + j) + Vec::loadu(a + j)).store(acc + j);
    for (; j < n; ++j) acc[j] += a[j];
  }

  // acc[j] += a[j] * b[j]
  static void add_products(const T* a, const T* b, T* acc, int64_t n) {
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) (Vec::loadu(acc + j) + Vec::loadu(a + j) * Vec::loadu(b + j)).store(acc + j);
    for (; j < n; ++j) acc[j] += a[j] * b[j];
  }

  // sum(a[j]), in dot's order.
  static T sum(const T* a, int64_t n) {
    Vec acc0(T(0)), acc1(T(0));
    int64_t j = 0;
    for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
      acc0 = acc0 + Vec::loadu(a + j);
      acc1 = acc1 + Vec::loadu(a + j + kLanes);
    }
    T total = sum_lanes(acc0 + acc1);
    for (; j < n; ++j) total += a[j];
    return total;
  }

  // a[j] -= m in place; returns the sum of the new a[j]^2 (in dot's order).
  static T center(T* a, T m, int64_t n) {
    const Vec vm(m);
    Vec acc0(T(0)), acc1(T(0));
    int64_t j = 0;
    for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
      const Vec u = Vec::loadu(a + j) - vm, v = Vec::loadu(a + j + kLanes) - vm;
      u.store(a + j);
      v.store(a + j + kLanes);
      acc0 = acc0 + u * u, acc1 = acc1 + v * v;
    }
    T total = sum_lanes(acc0 + acc1);
    for (; j < n; ++j) a[j] -= m, total += a[j] * a[j];
    return total;
  }

  // y[j] = s * ((d[j] - md) - h[j] * m): md, the mean of d, is 0 but for a centered norm (and d - 0
  // is d: the RMS norm's bits are those of s * (d - h * m)).
  static void norm_grad(const T* d, const T* h, T m, T md, T s, T* y, int64_t n) {
    const Vec vm(m), vd(md), vs(s);
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) (vs * ((Vec::loadu(d + j) - vd) - Vec::loadu(h + j) * vm)).store(y + j);
    for (; j < n; ++j) y[j] = s * ((d[j] - md) - h[j] * m);
  }

  // y[j] = (a[j] - m) * s; y may be a.
  static void center_scale(const T* a, T m, T s, T* y, int64_t n) {
    const Vec vm(m), vs(s);
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) ((Vec::loadu(a + j) - vm) * vs).store(y + j);
    for (; j < n; ++j) y[j] = (a[j] - m) * s;
  }
};

// A row of scalar_t (column stride `col`) into a buffer of its compute type and back: whole vector
// steps where the columns are contiguous, one element at a time otherwise and for the tail.
template <typename scalar_t>
struct NormRowIO {
  using IO = VecIO<scalar_t>;
  using T = typename IO::opmath_t;
  using Vec = Vectorized<T>;
  // With kSquares, each value's square is added to the sum of squares as it is read (acc0 and acc1
  // take a step's two vectors, tail the rest): the forward's two reads of the row in one.
  template <bool kSquares = false>
  static void load(const scalar_t* p, int64_t col, int64_t n, T* dst, Vec* acc0 = nullptr, Vec* acc1 = nullptr,
                   T* tail = nullptr) {
    int64_t j = 0;
    if (col == 1) {
      for (; j + IO::kStep <= n; j += IO::kStep) {
        Vec a, b;
        IO::load(p + j, a, b);
        a.store(dst + j);
        b.store(dst + j + Vec::size());
        if constexpr (kSquares) *acc0 = *acc0 + a * a, *acc1 = *acc1 + b * b;
      }
    }
    for (; j < n; ++j) {
      dst[j] = static_cast<T>(p[j * col]);
      if constexpr (kSquares) *tail += dst[j] * dst[j];
    }
  }
  static void store(scalar_t* p, int64_t col, int64_t n, const T* src) {
    int64_t j = 0;
    if (col == 1) {
      for (; j + IO::kStep <= n; j += IO::kStep) IO::store(p + j, Vec::loadu(src + j), Vec::loadu(src + j + Vec::size()));
    }
    for (; j < n; ++j) p[j * col] = static_cast<scalar_t>(src[j]);
  }
};

// The pairs [from, half) of rotate_buffer, one at a time. (Written as this loop over two buffers, GCC
// 12 leaves it scalar; a loop that also scaled its inputs was vectorized into vfmaddsub, a fused
// multiply-add, despite -ffp-contract=off: test_variants_are_compiled_for_their_isa looks for them.)
template <typename T, bool kInterleaved, bool kConj>
void rotate_tail(const T* a, const T* c, const T* s, T* y, int64_t from, int64_t half) {
  for (int64_t i = from; i < half; ++i) {
    const int64_t f = pair_first(i, half, kInterleaved), t = pair_second(i, half, kInterleaved);
    rotate_pair<kConj>(a[f], a[t], c[f], s[f], c[t], s[t], y[f], y[t]);
  }
}

// y = rotary(a) (kConj: its transpose) on the first r of d columns of a buffer, the rest copied,
// with full-form table rows c and s; rotary_math.h's rotate_pair on vectors of pairs, then the tail.
template <typename T, bool kInterleaved, bool kConj>
void rotate_buffer(const T* a, const T* c, const T* s, T* y, int64_t r, int64_t d) {
  using IO = VecIO<T>;
  using Vec = Vectorized<T>;
  const int64_t half = r / 2;
  int64_t i = 0;
  for (; i + IO::kStep <= half; i += IO::kStep) {
    Vec x1[2], x2[2], c1[2], c2[2], s1[2], s2[2], o1[2], o2[2];
    IO::template load_pairs<kInterleaved>(a, i, half, x1, x2);
    IO::template load_pairs<kInterleaved>(c, i, half, c1, c2);
    IO::template load_pairs<kInterleaved>(s, i, half, s1, s2);
    for (int k = 0; k < 2; ++k) rotate_pair<kConj>(x1[k], x2[k], c1[k], s1[k], c2[k], s2[k], o1[k], o2[k]);
    IO::template store_pairs<kInterleaved>(y, i, half, o1, o2);
  }
  rotate_tail<T, kInterleaved, kConj>(a, c, s, y, i, half);
  for (int64_t j = r; j < d; ++j) y[j] = a[j];
}

// A row's affine parameters, in the compute type: the gain g and the bias b (either may be null: 1 and
// 0), applied before the rotation or, `after`, to the rotated row.
template <typename T>
struct Affine {
  const T* g;
  const T* b;
  bool after;
};

// out = rotary(a * s * g + b) on the first r of d columns of one row (`after`: g * rotary(a * s) + b),
// the rest a * s * g + b, into `out` (column stride col) rounded once: where out's columns are
// contiguous, whole vector steps of pairs are scaled, rotated and stored in one pass; the other pairs
// and the pass-through columns go through the buffers z (scaled) and y (rotated). (The same roundings
// as rotate_buffer after NormMath::scale: (a * s) * g, + b, then rotate_pair; `after`: a * s,
// rotate_pair, then the product with g, + b.)
template <typename scalar_t, bool kInterleaved>
void store_scaled_rotation(const at::opmath_type<scalar_t>* a, at::opmath_type<scalar_t> s,
                           const Affine<at::opmath_type<scalar_t>>& f, const at::opmath_type<scalar_t>* c,
                           const at::opmath_type<scalar_t>* sn, at::opmath_type<scalar_t>* z,
                           at::opmath_type<scalar_t>* y, int64_t r, int64_t d, scalar_t* out, int64_t col) {
  using T = at::opmath_type<scalar_t>;
  using IO = VecIO<T>;
  using OutIO = VecIO<scalar_t>;
  using Vec = Vectorized<T>;
  static_assert(IO::kStep == OutIO::kStep, "a step of pairs is as wide in the buffer as in the output");
  const T* const g = f.g;
  const T* const b = f.b;
  const bool after = f.after;
  const int64_t half = r / 2;
  int64_t i = 0;
  if (col == 1) {
    const Vec vs(s);
    for (; i + IO::kStep <= half; i += IO::kStep) {
      Vec x1[2], x2[2], c1[2], c2[2], s1[2], s2[2], o1[2], o2[2], g1[2], g2[2], b1[2], b2[2];
      IO::template load_pairs<kInterleaved>(a, i, half, x1, x2);
      if (g != nullptr) IO::template load_pairs<kInterleaved>(g, i, half, g1, g2);
      if (b != nullptr) IO::template load_pairs<kInterleaved>(b, i, half, b1, b2);
      if (g != nullptr && !after) {
        for (int k = 0; k < 2; ++k) x1[k] = x1[k] * vs * g1[k], x2[k] = x2[k] * vs * g2[k];
      } else {
        for (int k = 0; k < 2; ++k) x1[k] = x1[k] * vs, x2[k] = x2[k] * vs;
      }
      if (b != nullptr && !after) {
        for (int k = 0; k < 2; ++k) x1[k] = x1[k] + b1[k], x2[k] = x2[k] + b2[k];
      }
      IO::template load_pairs<kInterleaved>(c, i, half, c1, c2);
      IO::template load_pairs<kInterleaved>(sn, i, half, s1, s2);
      for (int k = 0; k < 2; ++k) rotate_pair<false>(x1[k], x2[k], c1[k], s1[k], c2[k], s2[k], o1[k], o2[k]);
      if (g != nullptr && after) {
        for (int k = 0; k < 2; ++k) o1[k] = o1[k] * g1[k], o2[k] = o2[k] * g2[k];
      }
      if (b != nullptr && after) {
        for (int k = 0; k < 2; ++k) o1[k] = o1[k] + b1[k], o2[k] = o2[k] + b2[k];
      }
      OutIO::template store_pairs<kInterleaved>(out, i, half, o1, o2);
    }
  }
  if (i == half && r == d) return;  // (every column stored: no tail, no pass-through columns)
  // the columns of pairs [i, half) and the pass-through ones, scaled into z (the rotated columns by g
  // and b before the rotation, or after it into y)
  // z[j] = a[j] * s * g[j] + b[j] (g and b where affine and given): whole vectors, then one at a time
  // (the same products in the same order either way; -ffp-contract=off keeps them unfused)
  const auto scale = [&](int64_t j0, int64_t j1, bool affine) {
    const T* const gs = affine ? g : nullptr;
    const T* const bs = affine ? b : nullptr;
    const Vec vs(s);
    int64_t j = j0;
    for (; j + Vec::size() <= j1; j += Vec::size()) {
      Vec v = Vec::loadu(a + j) * vs;
      if (gs != nullptr) v = v * Vec::loadu(gs + j);
      if (bs != nullptr) v = v + Vec::loadu(bs + j);
      v.store(z + j);
    }
    for (; j < j1; ++j) {
      z[j] = gs != nullptr ? a[j] * s * gs[j] : a[j] * s;
      if (bs != nullptr) z[j] = z[j] + bs[j];
    }
  };
  const auto scale_after = [&](int64_t j0, int64_t j1) {
    if (!after) return;
    if (g != nullptr) for (int64_t j = j0; j < j1; ++j) y[j] = y[j] * g[j];
    if (b != nullptr) for (int64_t j = j0; j < j1; ++j) y[j] = y[j] + b[j];
  };
  if (kInterleaved) {
    scale(2 * i, r, !after);
  } else {
    scale(i, half, !after);
    scale(half + i, r, !after);
  }
  scale(r, d, true);
  rotate_tail<T, kInterleaved, false>(z, c, sn, y, i, half);
  if (kInterleaved) {
    scale_after(2 * i, r);
  } else {
    scale_after(i, half);
    scale_after(half + i, r);
  }
  std::copy(z + r, z + d, y + r);
  using Row = NormRowIO<scalar_t>;
  if (col != 1) {  // (no vector step ran: y holds the whole row)
    Row::store(out, col, d, y);
    return;
  }
  if (kInterleaved) {
    Row::store(out + 2 * i, 1, r - 2 * i, y + 2 * i);
  } else {
    Row::store(out + i, 1, half - i, y + i);
    Row::store(out + half + i, 1, half - i, y + half + i);
  }
  Row::store(out + r, 1, d - r, y + r);
}

// What one thread reads and keeps: the call's g and b, and the table rows of the row it is on,
// reloaded only when the row's table offsets change (heads that share a token's tables reuse them).
template <typename scalar_t>
struct NormContext {
  using T = at::opmath_type<scalar_t>;
  const NormPlan& p;
  const NormOperands& o;
  std::vector<T> g;  // weight + weight_offset; empty without a weight
  std::vector<T> b;  // the bias; empty without one

  NormContext(const NormPlan& plan, const NormOperands& ops) : p(plan), o(ops) {
    read(o.weight, o.float_weight, p.weight_len, p.weight_stride, static_cast<T>(o.weight_offset), g);
    read(o.bias, o.float_bias, p.bias_len, p.bias_stride, T(0), b);
  }
  static void read(const void* t, bool as_float, int64_t len, int64_t stride, T offset, std::vector<T>& dst) {
    if (t == nullptr) return;
    dst.resize(len);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t at = j * stride;
      const T v = as_float ? static_cast<T>(static_cast<const float*>(t)[at])
                           : static_cast<T>(static_cast<const scalar_t*>(t)[at]);
      dst[j] = v + offset;
    }
  }
  // g for row `row` (x's rows in row-major order): a weight of one row serves every head, one of
  // p.heads rows has a row per head (NormPlan::heads).
  const T* g_for(int64_t row) const { return ctx_slice(g, row); }
  const T* b_for(int64_t row) const { return ctx_slice(b, row); }
  Affine<T> affine(int64_t row) const { return {g_for(row), b_for(row), o.weight_after}; }
  // The first column of row `row`'s slice of a parameter of `len` values.
  static int64_t slice_at(const NormPlan& p, int64_t len, int64_t row) {
    return len > p.head_dim ? row % p.heads * p.head_dim : 0;
  }

 private:
  const T* ctx_slice(const std::vector<T>& v, int64_t row) const {
    return v.empty() ? nullptr : v.data() + slice_at(p, static_cast<int64_t>(v.size()), row);
  }
};

template <typename scalar_t, bool kInterleaved>
struct TableRows {
  using T = at::opmath_type<scalar_t>;
  T* c;
  T* s;
  bool loaded = false;
  int64_t cos_at = 0, sin_at = 0;

  // The full-form table rows of a row whose kNormCos/kNormSin offsets are these: read from full-form
  // tables, or, gathered, from the caches' rows at the position found there (each half-width entry
  // serving both members of its pair).
  void load(const NormPlan& p, const NormOperands& o, int64_t cos_at_, int64_t sin_at_) {
    if (loaded && cos_at_ == cos_at && sin_at_ == sin_at) return;
    loaded = true, cos_at = cos_at_, sin_at = sin_at_;
    const auto read = [&](const auto* t, int64_t col, T* dst) {
      if (!p.gathered) {
        for (int64_t j = 0; j < p.rotary_dim; ++j) dst[j] = static_cast<T>(t[j * col]);
        return;
      }
      const int64_t half = p.rotary_dim / 2;
      for (int64_t i = 0; i < half; ++i) dst[i] = static_cast<T>(t[i * col]);
      if (kInterleaved) {  // pair i is (2i, 2i + 1): spread from the top down, never reading a written entry
        for (int64_t i = half - 1; i >= 0; --i) dst[2 * i] = dst[2 * i + 1] = dst[i];
      } else {             // pair i is (i, i + half)
        std::copy_n(dst, half, dst + half);
      }
    };
    const auto table = [&](const void* base, int64_t at, int64_t row, int64_t col, T* dst) {
      if (p.gathered) at = position_at(o.positions, p.positions_int32, at) * row;
      if (o.float_tables && !std::is_same_v<scalar_t, float>) {
        read(static_cast<const float*>(base) + at, col, dst);
      } else {
        read(static_cast<const scalar_t*>(base) + at, col, dst);
      }
    };
    table(o.cos, cos_at, p.cos_row, p.cos_col, c);
    table(o.sin, sin_at, p.sin_row, p.sin_col, s);
  }
};

// The offsets of consecutive rows of `dims` from row `linear` on, a row at a time without a
// division (StridedDims::offsets divides once per dim, a cost a row of 128 values feels). The
// innermost dim's size and strides are held by value: a cursor that is a local of its loop then
// keeps them, and its offsets, in registers, where the dims reached through the reference are
// reloaded after every store of a may_alias vector type (all of the kernels' stores). The outer
// dims are read once per run of the innermost.
template <int K>
struct RowCursor {
  const StridedDims<K>& dims;
  int64_t index[kMaxDims];
  int64_t off[K];
  int64_t inner = 0, inner_size = 1;  // index and size of the innermost dim (1: no dims)
  int64_t inner_stride[K] = {};

  RowCursor(const StridedDims<K>& d, int64_t linear) : dims(d) {
    d.offsets(linear, off);
    for (int i = d.ndim - 1; i > 0; --i) {
      index[i] = linear % d.sizes[i];
      linear /= d.sizes[i];
    }
    if (d.ndim > 0) index[0] = linear;
    if (d.ndim > 0) {
      const int i = d.ndim - 1;
      inner = index[i];
      inner_size = i == 0 ? std::numeric_limits<int64_t>::max() : d.sizes[i];  // (dim 0 never wraps)
      for (int k = 0; k < K; ++k) inner_stride[k] = d.strides[k][i];
    }
  }
  C10_ALWAYS_INLINE void next() {
    for (int k = 0; k < K; ++k) off[k] += inner_stride[k];
    if (++inner < inner_size) return;
    carry();
  }

 private:
  // The innermost dim wrapped: back to its start, and the next index of the dims outside it.
  void carry() {
    const int last = dims.ndim - 1;
    for (int k = 0; k < K; ++k) off[k] -= inner * inner_stride[k];
    inner = 0;
    for (int i = last - 1; i >= 0; --i) {
      ++index[i];
      for (int k = 0; k < K; ++k) off[k] += dims.strides[k][i];
      if (i == 0 || index[i] < dims.sizes[i]) return;
      for (int k = 0; k < K; ++k) off[k] -= index[i] * dims.strides[k][i];
      index[i] = 0;
    }
  }
};

// Groups a thread normalizes between the passes of the forward (at most): their rows are read and
// their statistics computed first, then scaled and rotated. A row's statistic is a chain of dependent
// steps (the sum of its squares, the lanes' sum, a square root and a division) that its scaling
// waits for; a block's chains are independent, and overlap. (Qwen3's bfloat16 heads of 128, in
// cache, one thread: 5% less time than a row at a time; heads of 64, 12% less.) 16 rows of 128
// float32 values are 8 KiB, in L1.
constexpr int64_t kNormBlockRows = 16;

// The forward's row path: RMS (not centered), no bias, the weight (if any) before the rotation, every column rotated,
// x's and out's columns contiguous, and rows of whole vector steps, at most kNormRowSteps of them (head_dim 256 on
// AVX2, 512 on AVX-512, for float32 and 16-bit x); per head or across heads, with any weight the plan takes (one row
// for every head, or a row per head). A block's rows (per head, kNormRowBlock rows; across heads, a group) are read
// from x with their squares summed as they come (16-bit x widened into a buffer: per head on the stack, in L1; across
// heads on the heap), then each row is scaled, rotated and stored from the buffer, or for float32 and float64 x from x
// itself, with the token's tables held across its heads; where the blocked path reads a block of rows into its buffer,
// finds their statistics, then takes each row through store_scaled_rotation's general loops. The same operations in the
// same order: the same bits (tests/test_qk_norm.py compares the two paths).
constexpr int64_t kNormRowSteps = 8;

// Rows per head the row path reads (and finds the statistics of) before it writes any of them. A
// row's statistic is a chain of dependent steps (its squares' sum, the lanes' sum, a division, a
// square root, a division) that its writes wait for; a block's chains are independent, and overlap.
// (4 rows of kRowValues float32 values at most: 8 KiB of stack; rows of 128, 2 KiB, in L1 beside the
// tables. Blocks of 8 measured the same as 4: docs/devlog.md.)
constexpr int64_t kNormRowBlock = 4;

template <typename scalar_t>
bool norm_row_path(const NormPlan& p, const NormOperands& o) {
  const int64_t half = p.rotary_dim / 2, step = VecIO<scalar_t>::kStep;
  return !o.centered && o.bias == nullptr && (o.weight == nullptr || !o.weight_after) &&
         p.rotary_dim == p.head_dim && p.x_col == 1 && p.out_col == 1 && half % step == 0 && half >= step &&
         half <= kNormRowSteps * step;
}

// The row path's two halves for one row. norm_read_row reads the row's 2 * steps chunks of kStep
// columns (kStore: into `a`, float32, in column order), each chunk's two vectors'
// squares into the accumulators acc0 and acc1 (NormRowIO::load's order; across heads they run on
// over the group's rows, as the blocked path's do); norm_rstd then gives 1 / sqrt(mean(x^2) + eps)
// (the blocked path adds its scalar tail, + 0 here: the same value). (`a` is raw storage, not an
// array of Vec: Vectorized's constructor zeroes its lanes.)
template <typename scalar_t, bool kStore>
C10_ALWAYS_INLINE void norm_read_row(const scalar_t* x, at::opmath_type<scalar_t>* a, int64_t steps,
                                     Vectorized<at::opmath_type<scalar_t>>& acc0,
                                     Vectorized<at::opmath_type<scalar_t>>& acc1) {
  using T = at::opmath_type<scalar_t>;
  using IO = VecIO<scalar_t>;
  using Vec = typename IO::Vec;
  constexpr int64_t V = Vec::size();
  constexpr int64_t kStep = IO::kStep;
  for (int64_t c = 0; c < 2 * steps; ++c) {
    Vec u, v;
    IO::load(x + c * kStep, u, v);
    if constexpr (kStore) {
      u.store(a + c * kStep);
      v.store(a + c * kStep + V);
    }
    acc0 = acc0 + u * u;
    acc1 = acc1 + v * v;
  }
}

template <typename T>
C10_ALWAYS_INLINE T norm_rstd(const Vectorized<T>& acc0, const Vectorized<T>& acc1, T eps, T count) {
  return T(1) / std::sqrt(NormMath<T>::sum_lanes(acc0 + acc1) / count + eps);
}

// out = rotary(a * inv * g) for a row norm_read_row read (its buffered values, or x itself, which
// may be out: each step of pairs is loaded before it is stored, and stores only its own columns):
// each step of pairs scaled, rotated and stored. g1 and g2 are the weight's values of each pair's
// first and second member (null: g = 1); t the row's tables; with `stream`, the stores are
// non-temporal (the caller checked the alignment). (Whether there is a weight, and whether the row
// streams, are chosen once a row, not tested at every step.)
template <typename scalar_t, bool kInterleaved>
C10_ALWAYS_INLINE void norm_write_row(const at::opmath_type<scalar_t>* a, at::opmath_type<scalar_t> inv,
                                      scalar_t* out, int64_t steps, const at::opmath_type<scalar_t>* g1,
                                      const at::opmath_type<scalar_t>* g2,
                                      const PairTables<at::opmath_type<scalar_t>>& t, bool stream) {
  using IO = VecIO<scalar_t>;
  using Vec = typename IO::Vec;
  constexpr int64_t V = Vec::size();
  constexpr int64_t kStep = IO::kStep;
  const int64_t half = steps * kStep;
  const auto part = [&](int64_t k) { return Vec::loadu(a + k * V); };  // the row's k-th vector
  const Vec vs(inv);
  const auto steps_with = [&](auto weighted, auto streamed) {
    for (int64_t i = 0; i < steps; ++i) {
      Vec x1[2], x2[2], o1[2], o2[2];
      if constexpr (kInterleaved) {  // step i is chunks 2i and 2i + 1, pairs alternating
        std::tie(x1[0], x2[0]) = at::vec::deinterleave2(part(4 * i), part(4 * i + 1));
        std::tie(x1[1], x2[1]) = at::vec::deinterleave2(part(4 * i + 2), part(4 * i + 3));
      } else {  // step i's first members are chunk i, its second ones chunk steps + i
        x1[0] = part(2 * i), x1[1] = part(2 * i + 1);
        x2[0] = part(2 * (steps + i)), x2[1] = part(2 * (steps + i) + 1);
      }
      for (int k = 0; k < 2; ++k) {
        const int64_t j = i * kStep + k * V;  // the pair of x1[k]'s first lane
        if constexpr (decltype(weighted)::value) {
          x1[k] = x1[k] * vs * Vec::loadu(g1 + j), x2[k] = x2[k] * vs * Vec::loadu(g2 + j);
        } else {
          x1[k] = x1[k] * vs, x2[k] = x2[k] * vs;
        }
        rotate_pair<false>(x1[k], x2[k], Vec::loadu(t.c1 + j), Vec::loadu(t.s1 + j), Vec::loadu(t.c2 + j),
                           Vec::loadu(t.s2 + j), o1[k], o2[k]);
      }
      IO::template store_pairs<kInterleaved, decltype(streamed)::value>(out, i * kStep, half, o1, o2);
    }
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (g1 != nullptr) {
    stream ? steps_with(Yes{}, Yes{}) : steps_with(Yes{}, No{});
  } else {
    stream ? steps_with(No{}, Yes{}) : steps_with(No{}, No{});
  }
}

// kSteps: the rows' vector steps (half / kStep) when known at compile time, so that each row's loops
// unroll into straight code; 0, read from the plan.
template <typename scalar_t, bool kInterleaved, int64_t kSteps>
void norm_forward_rows(const NormPlan& p, const NormOperands& o, const Thresholds& th, const ThreadPool& pool) {
  using T = at::opmath_type<scalar_t>;
  using IO = VecIO<scalar_t>;
  using Vec = Vectorized<T>;
  constexpr int64_t kRowValues = 2 * kNormRowSteps * IO::kStep;
  constexpr int64_t kBlockValues = kNormRowBlock * kRowValues;
  // 16-bit x is widened once, into a buffer the writes read; float32 and float64 x are read where they
  // are (in place too: a row is rewritten after its own values are read, a step of pairs at a time).
  constexpr bool kBuffered = !std::is_same_v<scalar_t, T>;
  const NormContext<scalar_t> ctx(p, o);
  const int64_t D = p.head_dim, G = p.group, half = D / 2, steps = kSteps > 0 ? kSteps : half / IO::kStep;
  // The weight by pair member, each head's D columns in place: half-split, its two halves; interleaved,
  // its even and odd columns. A row's first members are at slice_at(row), its second ones half after.
  std::vector<T> pair_weight;
  const T* weight = nullptr;
  if (!ctx.g.empty()) {
    if (kInterleaved) {
      pair_weight.resize(ctx.g.size());
      for (size_t h0 = 0; h0 < ctx.g.size(); h0 += D) {
        for (int64_t i = 0; i < half; ++i) {
          pair_weight[h0 + i] = ctx.g[h0 + 2 * i], pair_weight[h0 + half + i] = ctx.g[h0 + 2 * i + 1];
        }
      }
      weight = pair_weight.data();
    } else {
      weight = ctx.g.data();
    }
  }
  const int64_t weight_len = static_cast<int64_t>(ctx.g.size());
  const auto* x = static_cast<const scalar_t*>(o.x);
  auto* out = static_cast<scalar_t*>(o.out);
  T* rstd = static_cast<T*>(o.rstd);
  const T eps = static_cast<T>(o.eps), count = static_cast<T>(G * D);
  const int64_t rows = p.num_rows();
  // (as rotary_kernel.h's: out of place and too large to stay in cache)
  const bool stream = IO::kStreams && o.x != o.out &&
                      rows * D * static_cast<int64_t>(sizeof(scalar_t)) >= th.streaming_bytes;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
  // A row's tables, from its kNormCos/kNormSin offsets (gathered: the position there selects the
  // caches' row), in the type they are stored in. (The offsets by value: a cursor whose address
  // escaped into a call that is not inlined would no longer be kept in registers.)
  const auto tables_at = [&](int64_t cos_off, int64_t sin_off, T* buf) {
    const auto build = [&](auto table_tag) {
      using table_t = decltype(table_tag);
      const auto* cos = static_cast<const table_t*>(o.cos);
      const auto* sin = static_cast<const table_t*>(o.sin);
      if (!p.gathered) {
        return token_tables<kInterleaved, false>(cos + cos_off, p.cos_col, sin + sin_off, p.sin_col,
                                                 half, buf);
      }
      const int64_t cos_pos = position_at(o.positions, p.positions_int32, cos_off);
      const int64_t sin_pos = position_at(o.positions, p.positions_int32, sin_off);
      return token_tables<kInterleaved, true>(cos + cos_pos * p.cos_row, p.cos_col, sin + sin_pos * p.sin_row,
                                              p.sin_col, half, buf);
    };
    if (o.float_tables && !std::is_same_v<scalar_t, float>) return build(float{});
    return build(scalar_t{});
  };
  // Per head, kNormRowBlock groups (rows) per block: all read first, then all written; across heads,
  // one group per block.
  const int64_t block = G == 1 ? kNormRowBlock : 1;
  const int64_t grain = std::max<int64_t>(1, th.grain_elements / (G * D));
  // What every row reads, copied into each thread's locals (the lambda's first line): the stores to
  // out and to the buffers are of may_alias vector types, and a value reached through the lambda's
  // captures, which escape into parallel_for, is reloaded after each of them. (So reloaded, with
  // the cursors' dims, a row's bookkeeping was as many instructions as all of rotary_'s for the row:
  // docs/devlog.md.)
  struct RowCall {
    const scalar_t* x;
    scalar_t* out;
    T* rstd;
    const T* weight;
    T eps, count;
    int64_t D, G, half, steps, heads, row_bytes, block;
    bool weight_per_head, stream;
  };
  const RowCall call{x, out, rstd, weight, eps, count, D, G, half, steps, p.heads, row_bytes, block, weight_len > D, stream};
  parallel_for(pool, 0, p.num_groups(), grain, [&](int64_t begin, int64_t end) {
    const RowCall c = call;
    Scratch<T, 512> table_buf(4 * c.half);  // a row's tables, converted (token_tables)
    // The block's rows as read, where buffered (left unset): per head, on the stack; across heads a
    // group's G rows, on the heap, 64-byte aligned.
    alignas(64) T head_rows[kBuffered ? kBlockValues : 1];
    const bool group_buffer = kBuffered && c.G > 1;
    const std::unique_ptr<T[]> group_buf(group_buffer ? new T[c.G * c.D + 64 / sizeof(T)] : nullptr);
    T* const values = group_buffer ? reinterpret_cast<T*>(
                                         (reinterpret_cast<std::uintptr_t>(group_buf.get()) + 63) & ~std::uintptr_t{63})
                                   : head_rows;
    PairTables<T> t{};
    bool loaded = false;
    int64_t cos_at = 0, sin_at = 0, streamed = 0;
    RowCursor<5> reading(p.rows, begin * c.G), writing(p.rows, begin * c.G);
    // The head of the row being written (NormContext::slice_at's row % heads), which selects its
    // weights where there is a row of them per head: counted, not divided for, since a division per
    // row is a cost a row of 128 values feels (docs/devlog.md).
    int64_t head = c.heads > 1 ? begin * c.G % c.heads : 0;
    T inv[kNormRowBlock];
    for (int64_t n0 = begin; n0 < end; n0 += c.block) {
      const int64_t groups = std::min(c.block, end - n0);
      // 1. Read the block's rows, and each group's statistic.
      for (int64_t b = 0; b < groups; ++b) {
        Vec acc0(T(0)), acc1(T(0));
        for (int64_t h = 0; h < c.G; ++h, reading.next()) {
          const scalar_t* xr = c.x + reading.off[kNormX];
          // The rows ahead are prefetched into every cache level. A row is needed again a block or a
          // group after its first read (rewritten in place; float32 and float64 rows read again by
          // the writes), and the non-temporal hint (right for rotary_'s rows, rewritten as soon as
          // read) keeps its lines out of L2 meanwhile, so the writes wait for them. (16-bit rows out
          // of place are needed once, and measured faster with T0 too: docs/devlog.md.)
          prefetch_ahead<3>(xr, kSteps > 0 ? 2 * kSteps * IO::kStep * int64_t{sizeof(scalar_t)} : c.row_bytes);
          T* const into = kBuffered ? values + (b * c.G + h) * c.D : nullptr;
          norm_read_row<scalar_t, kBuffered>(xr, into, kSteps > 0 ? kSteps : c.steps, acc0, acc1);
        }
        inv[b] = norm_rstd<T>(acc0, acc1, c.eps, c.count);
        if (c.rstd != nullptr) c.rstd[n0 + b] = inv[b];
      }
      // 2. Scale, rotate and store each row.
      for (int64_t b = 0; b < groups; ++b) {
        for (int64_t h = 0; h < c.G; ++h, writing.next()) {
          const int64_t* off = writing.off;
          if (!loaded || off[kNormCos] != cos_at || off[kNormSin] != sin_at) {  // (a token's heads share them)
            t = tables_at(off[kNormCos], off[kNormSin], table_buf.data());
            loaded = true, cos_at = off[kNormCos], sin_at = off[kNormSin];
          }
          scalar_t* outr = c.out + off[kNormOut];
          const bool stream_row = c.stream && streaming_row_aligned(reinterpret_cast<std::uintptr_t>(outr), c.half,
                                                                  sizeof(scalar_t), kInterleaved, kStreamStoreBytes);
          streamed += stream_row;
          const T* g1 = c.weight == nullptr ? nullptr : c.weight + (c.weight_per_head ? head * c.D : 0);
          head = head + 1 >= c.heads ? 0 : head + 1;
          const T* g2 = c.weight == nullptr ? nullptr : g1 + c.half;
          const T* a = nullptr;
          if constexpr (kBuffered) {
            a = values + (b * c.G + h) * c.D;
          } else {
            a = c.x + off[kNormX];  // (in place too: see norm_write_row)
          }
          norm_write_row<scalar_t, kInterleaved>(a, inv[b], outr, kSteps > 0 ? kSteps : c.steps, g1, g2, t, stream_row);
        }
      }
    }
    if (c.stream) finish_streaming(streamed);
    path_counts().norm_rows.fetch_add((end - begin) * c.G, std::memory_order_relaxed);
  });
}

template <typename scalar_t, bool kInterleaved>
void norm_forward(const NormPlan& p, const NormOperands& o, const Thresholds& th, const ThreadPool& pool) {
  using T = at::opmath_type<scalar_t>;
  using Row = NormRowIO<scalar_t>;
  using Vec = Vectorized<T>;
  if (norm_row_path<scalar_t>(p, o)) {
    // Heads of 128, the common size, with their step count compiled in.
    constexpr int64_t k128 = 64 / VecIO<scalar_t>::kStep;
    if (k128 > 0 && p.rotary_dim == 128) return norm_forward_rows<scalar_t, kInterleaved, k128>(p, o, th, pool);
    return norm_forward_rows<scalar_t, kInterleaved, 0>(p, o, th, pool);
  }
  const NormContext<scalar_t> ctx(p, o);
  const int64_t D = p.head_dim, G = p.group, R = p.rotary_dim, N = G * D;
  // Per head, a block of groups between the passes; across heads a group is already G rows.
  const int64_t block = G == 1 ? kNormBlockRows : 1;
  const auto* x = static_cast<const scalar_t*>(o.x);
  auto* out = static_cast<scalar_t*>(o.out);
  T* rstd = static_cast<T*>(o.rstd);
  const T eps = static_cast<T>(o.eps), count = static_cast<T>(N);
  const int64_t grain = std::max<int64_t>(1, th.grain_elements / N);
  parallel_for(pool, 0, p.num_groups(), grain, [&](int64_t begin, int64_t end) {
    std::vector<T> buf(block * N + 2 * D + 2 * R);
    T* const xf = buf.data();
    T* const y = xf + block * N;
    T* const z = y + D;
    TableRows<scalar_t, kInterleaved> tables{z + D, z + D + R};
    T inv[kNormBlockRows];
    RowCursor<5> reading(p.rows, begin * G), writing(p.rows, begin * G);
    for (int64_t n0 = begin; n0 < end; n0 += block) {
      const int64_t groups = std::min(block, end - n0);
      for (int64_t b = 0; b < groups; ++b) {  // pass 1: read the groups, their statistics
        Vec acc0(T(0)), acc1(T(0));
        T tail = 0;
        for (int64_t h = 0; h < G; ++h, reading.next()) {
          if (o.centered) {  // (the squares are of the centered values: below)
            Row::load(x + reading.off[kNormX], p.x_col, D, xf + (b * G + h) * D);
          } else {
            Row::template load<true>(x + reading.off[kNormX], p.x_col, D, xf + (b * G + h) * D, &acc0, &acc1, &tail);
          }
        }
        T* const group = xf + b * G * D;
        T squares = NormMath<T>::sum_lanes(acc0 + acc1) + tail;
        if (o.centered) {
          // The mean, then the centered values' own mean (what the first sum's rounding left: a row
          // whose mean is far from its spread loses its low digits there) taken off too, and the
          // squares of what remains: the two-pass variance, with its correction.
          const T mean = NormMath<T>::sum(group, N) / count;
          NormMath<T>::center(group, mean, N);
          const T residual = NormMath<T>::sum(group, N) / count;
          squares = NormMath<T>::center(group, residual, N);
          if (rstd != nullptr) rstd[2 * (n0 + b)] = mean + residual;
        }
        inv[b] = T(1) / std::sqrt(squares / count + eps);
        if (rstd != nullptr) rstd[o.centered ? 2 * (n0 + b) + 1 : n0 + b] = inv[b];
      }
      for (int64_t b = 0; b < groups; ++b) {  // pass 2: scale, rotate, round once into out
        for (int64_t h = 0; h < G; ++h, writing.next()) {
          const int64_t* off = writing.off;
          tables.load(p, o, off[kNormCos], off[kNormSin]);
          store_scaled_rotation<scalar_t, kInterleaved>(xf + (b * G + h) * D, inv[b], ctx.affine((n0 + b) * G + h),
                                                        tables.c, tables.s, z, y, R, D, out + off[kNormOut], p.out_col);
        }
      }
    }
  });
}

// Groups per block of the weights' gradient, from the shape alone: blocks of about 16K elements of x,
// and at most 512 blocks (the blocks' partial sums, 512 * weight_len values at most, are the scratch).
inline int64_t norm_block_groups(int64_t groups, int64_t group_elements) {
  const int64_t by_size = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(group_elements, 1));
  return std::max(by_size, (groups + 511) / 512);
}

template <typename scalar_t, bool kInterleaved>
void norm_backward(const NormPlan& p, const NormOperands& o, const Thresholds& th, const ThreadPool& pool) {
  using T = at::opmath_type<scalar_t>;
  using Row = NormRowIO<scalar_t>;
  const NormContext<scalar_t> ctx(p, o);
  const int64_t D = p.head_dim, G = p.group, R = p.rotary_dim, N = G * D;
  const auto* x = static_cast<const scalar_t*>(o.x);
  const auto* dy = static_cast<const scalar_t*>(o.grad);
  auto* dx = static_cast<scalar_t*>(o.out);
  const T* stats = static_cast<const T*>(o.rstd);
  // The weight's and the bias's gradients have the parameters' columns: a head's, or a row per head
  // (across heads, or per head with a row each: NormPlan::heads), W of them: the weight's length, and
  // the bias's, which is the weight's where there is one (check_qk_norm_args).
  T* const sums[2] = {static_cast<T*>(o.dweight), static_cast<T*>(o.dbias)};
  const int64_t W = p.weight_len > 0 ? p.weight_len : N;
  const int64_t groups = p.num_groups(), block = norm_block_groups(groups, N);
  const int64_t blocks = (groups + block - 1) / block;
  std::vector<T> partial[2];
  for (int k = 0; k < 2; ++k) partial[k].assign(sums[k] != nullptr ? blocks * W : 0, T(0));
  const int64_t grain = std::max<int64_t>(1, th.grain_elements / (block * N));
  parallel_for(pool, 0, blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<T> buf(2 * N + 3 * D + 2 * R);
    T* const xh = buf.data();  // x_hat, the group's rows
    T* const d = xh + N;       // the gradient of x_hat
    T* const gy = d + N;       // one row of dy, then of dx
    T* const u = gy + D;       // rotary^T(dy); with the weight after, rotary(x_hat)
    T* const gdy = u + D;      // with the weight after, g * dy
    TableRows<scalar_t, kInterleaved> tables{gdy + D, gdy + D + R};
    int64_t off[5];
    for (int64_t b = b0; b < b1; ++b) {
      T* const part = sums[0] != nullptr ? partial[0].data() + b * W : nullptr;
      T* const part_b = sums[1] != nullptr ? partial[1].data() + b * W : nullptr;
      for (int64_t n = b * block; n < std::min(groups, (b + 1) * block); ++n) {
        const T mean = o.centered ? stats[2 * n] : T(0);
        const T inv = o.centered ? stats[2 * n + 1] : stats[n];
        for (int64_t h = 0; h < G; ++h) {
          const int64_t row = n * G + h;
          p.rows.offsets(row, off);
          T* const xr = xh + h * D;
          Row::load(x + off[kNormX], p.x_col, D, xr);
          if (o.centered) {
            NormMath<T>::center_scale(xr, mean, inv, xr, D);
          } else {
            NormMath<T>::scale(xr, inv, nullptr, xr, D);
          }
          Row::load(dy + off[kNormGrad], p.grad_col, D, gy);
          tables.load(p, o, off[kNormCos], off[kNormSin]);
          T* const part_h = part != nullptr ? part + NormContext<scalar_t>::slice_at(p, W, row) : nullptr;
          T* const part_bh = part_b != nullptr ? part_b + NormContext<scalar_t>::slice_at(p, W, row) : nullptr;
          if (o.weight_after) {  // d = rotary^T(g * dy); dg += dy * rotary(x_hat); db += dy
            if (part_h != nullptr) {
              rotate_buffer<T, kInterleaved, false>(xr, tables.c, tables.s, u, R, D);
              NormMath<T>::add_products(gy, u, part_h, D);
            }
            if (part_bh != nullptr) NormMath<T>::add(gy, part_bh, D);
            const T* const g = ctx.g_for(row);
            if (g != nullptr) NormMath<T>::scale(gy, T(1), g, gdy, D);
            rotate_buffer<T, kInterleaved, true>(g != nullptr ? gdy : gy, tables.c, tables.s, d + h * D, R, D);
          } else {  // u = rotary^T(dy); dg += u * x_hat; db += u; d = u * g
            rotate_buffer<T, kInterleaved, true>(gy, tables.c, tables.s, u, R, D);
            if (part_h != nullptr) NormMath<T>::add_products(u, xr, part_h, D);
            if (part_bh != nullptr) NormMath<T>::add(u, part_bh, D);
            NormMath<T>::scale(u, T(1), ctx.g_for(row), d + h * D, D);
          }
        }
        const T m = NormMath<T>::dot(d, xh, N) / static_cast<T>(N);
        const T md = o.centered ? NormMath<T>::sum(d, N) / static_cast<T>(N) : T(0);
        for (int64_t h = 0; h < G; ++h) {
          if (G > 1) p.rows.offsets(n * G + h, off);  // (one row: the offsets read it by are still in off)
          NormMath<T>::norm_grad(d + h * D, xh + h * D, m, md, inv, gy, D);
          Row::store(dx + off[kNormOut], p.out_col, D, gy);
        }
      }
    }
  });
  // Each column's blocks in block order, whatever the threads did (threads split the columns).
  for (int k = 0; k < 2; ++k) {
    T* const sum = sums[k];
    if (sum == nullptr) continue;
    const std::vector<T>& parts = partial[k];
    parallel_for(pool, 0, W, std::max<int64_t>(1, th.grain_elements / blocks), [&](int64_t j0, int64_t j1) {
      std::fill(sum + j0, sum + j1, T(0));
      for (int64_t b = 0; b < blocks; ++b) {
        const T* part = parts.data() + b * W;
        for (int64_t j = j0; j < j1; ++j) sum[j] += part[j];
      }
    });
  }
}

void qk_norm_kernel(const NormPlan& p, const NormOperands& o, bool interleaved, bool backward, const Thresholds& th,
                    const ThreadPool& pool) {
  const auto by_type = [&](auto scalar_tag) {
    using scalar_t = decltype(scalar_tag);
    using T = at::opmath_type<scalar_t>;
    if (p.num_groups() == 0) {
      const int64_t width = p.weight_len > 0 ? p.weight_len : p.group * p.head_dim;
      if (backward && o.dweight != nullptr) std::fill_n(static_cast<T*>(o.dweight), width, T(0));
      if (backward && o.dbias != nullptr) std::fill_n(static_cast<T*>(o.dbias), width, T(0));
      return;
    }
    const auto by_inter = [&](auto inter) {
      constexpr bool kInter = decltype(inter)::value;
      backward ? norm_backward<scalar_t, kInter>(p, o, th, pool) : norm_forward<scalar_t, kInter>(p, o, th, pool);
    };
    interleaved ? by_inter(std::true_type{}) : by_inter(std::false_type{});
  };
  by_kernel_dtype(o.dtype, by_type);
}

}  // namespace rope_ext::cpu::CPU_CAPABILITY
