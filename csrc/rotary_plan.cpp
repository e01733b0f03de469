#include "rotary_plan.h"

#include "rope_ext/errors.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace rope_ext {

void check_x_and_tables(const char* op, const TensorArg& x, const TensorArg& cos, const TensorArg& sin,
                        const ArgNames& n, const TensorArg* positions) {
  // The dispatcher turns None into an undefined tensor, even for a non-optional argument.
  ROPE_EXT_CHECK(x.defined(), op, ": ", n.x, " must be a Tensor, got None");
  ROPE_EXT_CHECK(cos.defined(), op, ": ", n.cos, " must be a Tensor, got None");
  ROPE_EXT_CHECK(sin.defined(), op, ": ", n.sin, " must be a Tensor, got None");
  ROPE_EXT_CHECK(positions == nullptr || positions->defined(), op, ": positions must be a Tensor, got None");
  ROPE_EXT_CHECK(x.dim() >= 1, op, ": ", n.x, " must have at least one dimension (..., head_dim), ",
                 "got a 0-dim tensor");
  ROPE_EXT_CHECK(x.dim() <= kMaxDims, op, ": ", n.x, " may have at most ", kMaxDims, " dims, got ", x.dim());
  const auto xt = x.scalar_type();
  ROPE_EXT_CHECK(xt == ScalarType::Float || xt == ScalarType::Double || xt == ScalarType::Half ||
                     xt == ScalarType::BFloat16,
                 op, ": ", n.x, " must be float32, float64, float16 or bfloat16, got ", xt);
  ROPE_EXT_CHECK(cos.sizes() == sin.sizes(), op, ": ", n.cos, " and ", n.sin, " must have the same shape, got ",
                 n.cos, " ", cos.sizes(), " and ", n.sin, " ", sin.sizes());
  ROPE_EXT_CHECK(cos.scalar_type() == sin.scalar_type(), op, ": ", n.cos, " and ", n.sin,
                 " must have the same dtype, got ", n.cos, " ", cos.scalar_type(), " and ", n.sin, " ",
                 sin.scalar_type());
  ROPE_EXT_CHECK(cos.scalar_type() == xt || cos.scalar_type() == ScalarType::Float, op, ": ", n.cos, " and ",
                 n.sin, " must have ", n.x, "'s dtype (", xt, ") or float32, got ", cos.scalar_type());
  const bool one_device = cos.device() == x.device() && sin.device() == x.device() &&
                          (positions == nullptr || positions->device() == x.device());
  if (!one_device) {
    const std::string got = str(n.x, " on ", x.device(), ", ", n.cos, " on ", cos.device(),
                                positions != nullptr ? ", " : " and ", n.sin, " on ", sin.device());
    ROPE_EXT_CHECK(false, op, ": ", n.x, ", ", n.cos, positions != nullptr ? ", " : " and ", n.sin,
                   positions != nullptr ? " and positions" : "", " must be on the same device, got ", got,
                   positions != nullptr ? str(" and positions on ", positions->device()) : std::string());
  }
}

void check_rotary_args(const char* op, const TensorArg& x, const TensorArg& cos,
                       const TensorArg& sin, const ArgNames& n) {
  check_x_and_tables(op, x, cos, sin, n);
  ROPE_EXT_CHECK(cos.dim() >= 1, op, ": ", n.cos, " and ", n.sin, " must have at least one dimension ",
              "(..., rotary_dim), got 0-dim tensors");

  const int64_t r = cos.size(-1);
  ROPE_EXT_CHECK(r > 0 && r % 2 == 0, op, ": the rotary dim ", n.cos,
              ".size(-1) must be a positive even number, got ", r);
  ROPE_EXT_CHECK(r <= x.size(-1), op, ": the rotary dim ", n.cos, ".size(-1) = ", r,
              " exceeds the head dim ", n.x, ".size(-1) = ", x.size(-1));

  // cos/sin must broadcast against x.shape[:-1] + (r,) without growing it.
  bool broadcasts = cos.dim() <= x.dim();
  for (int64_t i = 2; broadcasts && i <= cos.dim(); ++i) {
    const int64_t c = cos.size(-i);
    broadcasts = c == 1 || c == x.size(-i);
  }
  if (!broadcasts) {
    std::vector<int64_t> target(x.sizes().begin(), x.sizes().end());
    target.back() = r;
    ROPE_EXT_CHECK(false, op, ": ", n.cos, " and ", n.sin, " of shape ", cos.sizes(),
                " do not broadcast against ", n.x, ".shape[:-1] + (rotary_dim,) = ",
                Dims{target.data(), static_cast<int64_t>(target.size())});
  }
}

void check_rotary_pos_args(const char* op, const TensorArg& x, const TensorArg& cos_cache,
                           const TensorArg& sin_cache, const TensorArg& positions, const char* nx) {
  check_x_and_tables(op, x, cos_cache, sin_cache, {nx, "cos_cache", "sin_cache"}, &positions);
  ROPE_EXT_CHECK(cos_cache.dim() == 2, op, ": cos_cache must be 2-D, (max_positions, rotary_dim / 2), got shape ",
              cos_cache.sizes());
  const auto pt = positions.scalar_type();
  ROPE_EXT_CHECK(pt == ScalarType::Int || pt == ScalarType::Long, op, ": positions must be int32 or int64, got ", pt);
  const int64_t half = cos_cache.size(1);
  ROPE_EXT_CHECK(half > 0, op, ": cos_cache.size(1) = rotary_dim / 2 must be positive, got 0");
  ROPE_EXT_CHECK(2 * half <= x.size(-1), op, ": the rotary dim 2 * cos_cache.size(1) = ", 2 * half,
              " exceeds the head dim ", nx, ".size(-1) = ", x.size(-1));
  bool broadcasts = positions.dim() < x.dim();
  for (int64_t i = 1; broadcasts && i <= positions.dim(); ++i) {
    const int64_t n = positions.size(-i);
    broadcasts = n == 1 || n == x.size(-i - 1);
  }
  ROPE_EXT_CHECK(broadcasts, op, ": positions of shape ", positions.sizes(), " do not broadcast against ", nx,
              ".shape[:-1] = ", x.sizes().slice(0, x.dim() - 1),
              " (one position per token; unsqueeze the head dim, e.g. (S, 1) for (B, S, H, D) x)");
}

void check_positions_in_range(const char* op, const TensorArg& positions, int64_t rows) {
  ROPE_EXT_CHECK(positions.device().is_cpu(), "check_positions_in_range reads a CPU tensor");
  // In the order of positions.flatten(), read in place through the strides (no copy: this runs on
  // every CPU call by positions).
  const auto check = [&](const auto* v) {
    const int64_t n = positions.dim();
    int64_t index[kMaxDims] = {};
    int64_t offset = 0;
    for (int64_t i = 0; i < positions.numel(); ++i) {
      const int64_t p = v[offset];
      ROPE_EXT_CHECK(p >= 0 && p < rows, ROPE_EXT_POSITION_OUTSIDE_CACHE, op, ": position ", p, " (positions.flatten()[", i,
                     "]) is outside the cache, whose ", rows, " rows hold positions 0 to ", rows - 1,
                     "; build the cache for more positions (or check the positions)");
      for (int64_t d = n - 1; d >= 0; --d) {  // the next index, row-major
        offset += positions.stride(d);
        if (++index[d] < positions.size(d)) break;
        offset -= index[d] * positions.stride(d);
        index[d] = 0;
      }
    }
  };
  if (positions.scalar_type() == ScalarType::Int) {
    check(positions.const_data_ptr<int32_t>());
  } else {
    check(positions.const_data_ptr<int64_t>());
  }
}

void check_qk_args(const char* op, const TensorArg& q, const TensorArg& k,
                   const std::optional<TensorArg>& shared, const char* name, int64_t trailing) {
  ROPE_EXT_CHECK(q.scalar_type() == k.scalar_type(), op, ": q and k must have the same dtype, got q ",
              q.scalar_type(), " and k ", k.scalar_type());
  if (!shared.has_value()) return;
  const TensorArg& t = *shared;
  ROPE_EXT_CHECK(q.dim() == k.dim(), op, ": q and k must have the same number of dims, got q ", q.sizes(),
              " and k ", k.sizes());
  if (trailing == 0) {  // positions: q and k share one launch, whose items follow the head dim
    ROPE_EXT_CHECK(q.size(-1) == k.size(-1), op, ": q and k must have the same head dim, got q ", q.sizes(),
                " and k ", k.sizes());
  }
  int64_t differing = 0;
  for (int64_t d = 0; d + 1 < q.dim(); ++d) {
    if (q.size(d) == k.size(d)) continue;
    ++differing;
    const int64_t from_end = q.dim() - 1 - d + trailing;  // the shared tensor's dim aligned with d, if any
    const bool broadcast = t.dim() < from_end || t.size(-from_end) == 1;
    ROPE_EXT_CHECK(differing == 1 && broadcast, op, ": q ", q.sizes(), " and k ", k.sizes(),
                " may differ only in the head count (one dim along which ", name, " of shape ", t.sizes(),
                " broadcast); batch and sequence dims must match");
  }
}

namespace {

// Whether the bytes two strided views can reach, [lowest, highest], intersect.
bool spans_intersect(const TensorArg& a, const TensorArg& b) {
  const auto span = [](const TensorArg& t) {
    int64_t lo = 0, hi = 0;
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t reach = (t.size(d) - 1) * t.stride(d);
      (reach < 0 ? lo : hi) += reach;
    }
    const auto base = reinterpret_cast<std::uintptr_t>(t.const_data_ptr());
    const auto size = static_cast<std::uintptr_t>(t.element_size());
    return std::pair{base + lo * size, base + hi * size + size - 1};
  };
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto [a_lo, a_hi] = span(a);
  const auto [b_lo, b_hi] = span(b);
  return a_lo <= b_hi && b_lo <= a_hi;
}

// An exact answer, where spans_intersect is only a bound, for views of one buffer that repeat with one
// period: each has a dim whose stride L is its largest, and everything else it holds lies within L
// elements of that dim's steps (rows of a fused qkv buffer split between q, k and v). Then each view
// occupies one interval of offsets modulo L, and two views are disjoint when their intervals are.
// False when the pattern does not apply (the caller then assumes they may intersect).
bool disjoint_by_period(const TensorArg& a, const TensorArg& b) {
  if (a.element_size() != b.element_size() || a.dim() == 0 || b.dim() == 0) return false;
  struct Period {
    int64_t stride = 0, span = 1;  // the period L, and the extent within it
  };
  const auto period_of = [](const TensorArg& t) -> std::optional<Period> {
    int64_t outer = -1;
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (t.size(d) > 1 && t.stride(d) <= 0) return std::nullopt;
      if (t.size(d) > 1 && (outer < 0 || t.stride(d) > t.stride(outer))) outer = d;
    }
    Period p;
    if (outer < 0) return std::nullopt;
    p.stride = t.stride(outer);
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (d != outer) p.span += (t.size(d) - 1) * t.stride(d);
    }
    if (p.span > p.stride) return std::nullopt;
    return p;
  };
  const auto pa = period_of(a), pb = period_of(b);
  if (!pa || !pb || pa->stride != pb->stride) return false;
  // Where each view starts, in elements, from its address rather than its storage offset: two
  // storages over one buffer (from_numpy or DLPack twice) start at different offsets.
  const auto size = static_cast<std::uintptr_t>(a.element_size());
  const auto a_at = reinterpret_cast<std::uintptr_t>(a.const_data_ptr());
  const auto b_at = reinterpret_cast<std::uintptr_t>(b.const_data_ptr());
  if (a_at % size != b_at % size) return false;
  const int64_t L = pa->stride;
  const auto mod = [L](int64_t v) { return ((v % L) + L) % L; };
  const int64_t ra = mod(static_cast<int64_t>(a_at / size)), rb = mod(static_cast<int64_t>(b_at / size));
  return mod(rb - ra) >= pa->span && mod(ra - rb) >= pb->span;
}

}  // namespace

void check_inplace_args(const char* op, const TensorArg& x, std::initializer_list<NamedTensor> others,
                        const char* nx) {
  // (What ATen's has_internal_overlap calls Yes: a dim of more than one element with stride 0.
  // Other overlapping strides, which only as_strided makes, are not detected, as ATen's TooHard.)
  bool repeats = false;
  for (int64_t d = 0; d < x.dim() && x.numel() > 0; ++d) repeats |= x.size(d) > 1 && x.stride(d) == 0;
  ROPE_EXT_CHECK(!repeats, op, ": ", nx,
              " has elements that share memory (e.g. an expanded view), so it cannot be rotated in place; ",
              "use the out-of-place op");
  for (const auto& [name, t] : others) {
    // Two views whose byte ranges intersect are refused unless disjoint_by_period proves them apart
    // (rows of one buffer split between q and k): never a missed overlap, and a false alarm only for
    // interleavings of other shapes. Exact for dense views (their elements fill their range), and it
    // sees memory shared by two storages (from_numpy or DLPack twice), which ATen's check does not.
    const bool overlap = spans_intersect(x, *t) && !disjoint_by_period(x, *t);
    ROPE_EXT_CHECK(!overlap, op, ": ", nx, " shares memory with ", name,
                "; in-place rotation would overwrite it while reading it");
  }
}

namespace {

// Element strides of a tensor with `sizes` and `strides` broadcast over `shape` (its trailing dims
// aligned with shape's, as expand() would give them, without making the view): 0 along the dims it
// lacks or has size 1. The callers have checked that it broadcasts.
using DimStrides = std::array<int64_t, kMaxDims>;
DimStrides broadcast_strides(Dims sizes, Dims strides, int64_t ndim) {
  DimStrides out{};
  const int64_t lead = ndim - static_cast<int64_t>(sizes.size());
  for (int64_t d = std::max<int64_t>(lead, 0); d < ndim; ++d) {
    out[d] = sizes[d - lead] == 1 ? 0 : strides[d - lead];
  }
  return out;
}

// The layout's fields for x's tables (cos and sin, or with `positions` the caches gathered there),
// and the strides of what a row's table entries step with along each of x.shape[:-1]: the tables'
// (broadcast_strides), or the positions' for both. A dim along which either varies is a token dim.
struct TableStrides {
  DimStrides cos, sin;
};
TableStrides read_tables(TableLayout& p, const TensorArg& x, const TensorArg& cos, const TensorArg& sin,
                         const TensorArg* positions) {
  p.head_dim = x.size(-1);
  p.cos_col = cos.stride(-1);
  p.sin_col = sin.stride(-1);
  if (positions == nullptr) {
    p.rotary_dim = cos.size(-1);
    return {broadcast_strides(cos.sizes(), cos.strides(), x.dim()),
            broadcast_strides(sin.sizes(), sin.strides(), x.dim())};
  }
  p.rotary_dim = 2 * cos.size(1);
  p.gathered = true;
  p.positions_int32 = positions->scalar_type() == ScalarType::Int;
  p.cos_row = cos.stride(0);
  p.sin_row = sin.stride(0);
  p.cache_rows = cos.size(0);
  // positions over x.shape[:-1], aligned as if unsqueezed to x's rank (the last dim is the columns)
  const DimStrides pos = broadcast_strides(positions->sizes(), positions->strides(), x.dim() - 1);
  return {pos, pos};
}

}  // namespace

// The plans read strides only: the broadcasts are computed, not made as views (each view cost
// about 1000 instructions of the dispatcher's, a third of a small call's own time).
RotaryPlan make_rotary_plan(const TensorArg& x, const TensorArg& out, const TensorArg& cos, const TensorArg& sin,
                            const TensorArg* positions) {
  RotaryPlan p;
  const TableStrides t = read_tables(p, x, cos, sin, positions);
  // Split x's leading dims into token dims (the tables step along them) and head dims.
  for (int64_t d = 0; d + 1 < x.dim(); ++d) {
    const int64_t n = x.size(d);
    if (n == 1) continue;
    if (t.cos[d] != 0 || t.sin[d] != 0) {
      auto& k = p.tokens;
      k.sizes[k.ndim] = n;
      k.strides[kX][k.ndim] = x.stride(d);
      k.strides[kOut][k.ndim] = out.stride(d);
      k.strides[kCos][k.ndim] = t.cos[d];
      k.strides[kSin][k.ndim] = t.sin[d];
      ++k.ndim;
    } else {
      auto& h = p.heads;
      h.sizes[h.ndim] = n;
      h.strides[kX][h.ndim] = x.stride(d);
      h.strides[kOut][h.ndim] = out.stride(d);
      ++h.ndim;
    }
  }
  p.tokens.collapse();
  p.heads.collapse();
  p.x_col = x.stride(-1);
  p.out_col = out.stride(-1);
  return p;
}

void check_qk_norm_args(const char* op, const TensorArg& x, const NormParams& params, const TensorArg& cos,
                        const TensorArg& sin, const TensorArg* positions, double eps, double weight_offset,
                        bool across_heads, const char* nx) {
  if (positions != nullptr) {
    check_rotary_pos_args(op, x, cos, sin, *positions, nx);
  } else {
    check_rotary_args(op, x, cos, sin, {nx, "cos", "sin"});
  }
  ROPE_EXT_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be a finite number >= 0, got ", eps);
  ROPE_EXT_CHECK(std::isfinite(weight_offset), op, ": weight_offset must be finite, got ", weight_offset);
  if (across_heads) {
    ROPE_EXT_CHECK(x.dim() >= 2, op, ": ", nx, " must have at least two dims (..., heads, head_dim) to be ",
                   "normalized across heads, got shape ", x.sizes());
  }
  const bool weighted = params.weight != nullptr && params.weight->defined();
  // (a row per head needs heads: with none, (0,) would read as no weight)
  const int64_t rows_of_weight = x.dim() >= 2 && x.size(-2) > 0 ? x.size(-2) * x.size(-1) : -1;
  for (const auto& [t, nw] : {std::pair{params.weight, params.weight_name}, std::pair{params.bias, params.bias_name}}) {
    if (t == nullptr || !t->defined()) continue;
    const TensorArg& w = *t;
    // The shapes it may have: one, or per head a weight's two (one row for every head, or a row each).
    int64_t sizes[2] = {x.size(-1), -1};
    std::string what;
    if (across_heads) {
      sizes[0] = x.size(-2) * x.size(-1), what = str(nx, ".size(-2) * ", nx, ".size(-1), normalized across heads");
    } else if (t == params.bias && weighted) {  // (the backward sizes the bias's gradient by the weight)
      sizes[0] = params.weight->size(0), what = str("the shape of ", params.weight_name);
    } else if (t == params.bias) {
      what = str(nx, ".size(-1) without a weight");
    } else if (rows_of_weight < 0) {
      what = str(nx, ".size(-1)");
    } else {
      sizes[1] = rows_of_weight;
      what = str(nx, ".size(-1): one row for every head, or ", nx, ".size(-2) * ", nx, ".size(-1): a row per head");
    }
    ROPE_EXT_CHECK(w.dim() == 1 && (w.size(0) == sizes[0] || w.size(0) == sizes[1]), op, ": ", nw,
                   " must have shape (", sizes[0], ",)", sizes[1] < 0 ? std::string() : str(" or (", sizes[1], ",)"),
                   " (", what, "), got ", w.sizes());
    const auto xt = x.scalar_type();
    ROPE_EXT_CHECK(w.scalar_type() == xt || w.scalar_type() == ScalarType::Float, op, ": ", nw, " must have ", nx,
                   "'s dtype (", xt, ") or float32, got ", w.scalar_type());
    ROPE_EXT_CHECK(w.device() == x.device(), op, ": ", nx, " and ", nw, " must be on the same device, got ", nx,
                   " on ", x.device(), " and ", nw, " on ", w.device());
  }
}

std::vector<int64_t> norm_stat_shape(const TensorArg& x, bool across_heads, bool centered) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - (across_heads ? 2 : 1));
  if (centered) shape.push_back(2);
  return shape;
}

NormPlan make_norm_plan(const TensorArg& x, const TensorArg& out, const NormParams& params, const TensorArg& cos,
                        const TensorArg& sin, const TensorArg* positions, const TensorArg* grad, bool across_heads) {
  NormPlan p;
  p.group = across_heads ? x.size(-2) : 1;
  p.heads = x.dim() >= 2 ? x.size(-2) : 1;
  const TableStrides t = read_tables(p, x, cos, sin, positions);
  auto& r = p.rows;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) {
    if (x.size(d) == 1) continue;
    r.sizes[r.ndim] = x.size(d);
    r.strides[kNormX][r.ndim] = x.stride(d);
    r.strides[kNormOut][r.ndim] = out.stride(d);
    r.strides[kNormCos][r.ndim] = t.cos[d];
    r.strides[kNormSin][r.ndim] = t.sin[d];
    r.strides[kNormGrad][r.ndim] = grad != nullptr ? grad->stride(d) : 0;
    ++r.ndim;
  }
  r.collapse();
  p.x_col = x.stride(-1);
  p.out_col = out.stride(-1);
  p.grad_col = grad != nullptr ? grad->stride(-1) : 1;
  if (params.weight != nullptr && params.weight->defined()) {
    p.weight_len = params.weight->size(0);
    p.weight_stride = params.weight->stride(0);
  }
  if (params.bias != nullptr && params.bias->defined()) {
    p.bias_len = params.bias->size(0);
    p.bias_stride = params.bias->stride(0);
  }
  return p;
}

}  // namespace rope_ext
