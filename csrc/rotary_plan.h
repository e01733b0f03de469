// Device-agnostic glue shared by the CPU and CUDA implementations of the rotary ops:
// argument checks with messages that name the argument, and the "plan" that turns
// (x, out, tables) into the pointer/size/stride description the kernels consume.
#pragma once

#include <initializer_list>
#include <optional>
#include <vector>

#include "internal_api.h"
#include "rotary_math.h"
#include "tensor_arg.h"

namespace rope_ext {

// Operand slots in RotaryPlan::tokens. With gathered tables (rotary_pos*), kCos and kSin both
// step through the positions tensor.
enum TokenOperand { kX = 0, kOut = 1, kCos = 2, kSin = 3 };

// Where a call of any op family reads cos and sin, and the row width they rotate: full-form
// tables broadcast over x.shape[:-1] + (r,), or (`gathered`, the *_pos ops) half-width caches, one
// row per position and one column per pair (column i serves both members of pair i), a token's cos
// row starting at cos + positions[its cos offset] * cos_row. Positions outside [0, cache_rows) are
// refused before any read (check_positions_in_range on the CPU, a device-side assert on CUDA).
// Every plan is a TableLayout and fills it with read_tables, so that each kernel reads the tables
// one way whatever it computes around the rotation.
struct TableLayout {
  int64_t head_dim = 0;    // x.size(-1)
  int64_t rotary_dim = 0;  // r: cos.size(-1), or 2 * cache.size(1); even, <= head_dim
  int64_t cos_col = 1, sin_col = 1;  // strides along the last dim, in elements
  bool gathered = false;
  bool positions_int32 = false;  // gathered: int32 positions (else int64)
  int64_t cos_row = 0, sin_row = 0;  // gathered: the caches' row strides
  int64_t cache_rows = 0;            // gathered: the caches' rows (positions 0 to cache_rows - 1)
};

// How a rotary call walks memory. x's leading dims (all but the last) are split into
//   token dims: cos or sin varies along them (sequence, batch for per-row positions);
//   head dims:  cos and sin are broadcast (stride 0) along them (heads, usually batch).
// A kernel loads one token's cos/sin once and reuses them for all of that token's
// heads. Dims of size 1 are dropped. Rows are numbered token-major: row = t * nheads + h.
// With gathered tables, kCos and kSin both step through the positions tensor.
struct RotaryPlan : TableLayout {
  StridedDims<4> tokens;  // strides of x, out, cos, sin (elements)
  StridedDims<2> heads;   // strides of x, out (elements)
  int64_t x_col = 1, out_col = 1;  // strides along the last dim, in elements

  int64_t num_tokens() const { return tokens.numel(); }
  int64_t num_heads() const { return heads.numel(); }
};

// How error messages name the three arguments (rotary_qk's k uses "k", "cos_k", "sin_k").
struct ArgNames {
  const char* x = "x";
  const char* cos = "cos";
  const char* sin = "sin";
};

// What every op family requires alike of x and its tables: tensors, x of 1 to kMaxDims dims and a
// float dtype, cos and sin of one shape and dtype (x's or float32), and everything, `positions` too
// where given, on x's device. (rope_ext._ops._check_x_and_tables, for the fake kernels, gives the
// same messages for these conditions, but for the dims' limit, which only the kernels have.) The family's own checks follow (the tables' shape against x's: check_rotary_args or
// check_rotary_pos_args).
ROPE_EXT_INTERNAL void check_x_and_tables(const char* op, const TensorArg& x, const TensorArg& cos,
                                          const TensorArg& sin, const ArgNames& names,
                                          const TensorArg* positions = nullptr);

// Checks (x, cos, sin) against rotary's contract; `op` prefixes every message.
ROPE_EXT_INTERNAL void check_rotary_args(const char* op, const TensorArg& x, const TensorArg& cos,
                       const TensorArg& sin, const ArgNames& names = {});

// Checks q and k once each passed its single-tensor checks: they share a dtype. When they share
// tables or positions (`shared`), they also share a rank and differ in at most one leading dim (the
// head count, GQA/MQA), along which `shared` broadcasts. `shared` aligns with q.shape[:-1] from the
// right after its last `trailing` dims: 1 for tables (their last dim is the rotary dim), 0 for
// positions. Without it (rotary_qk with separate k tables) their shapes are independent.
ROPE_EXT_INTERNAL void check_qk_args(const char* op, const TensorArg& q, const TensorArg& k,
                                     const std::optional<TensorArg>& shared, const char* name = "cos/sin",
                                     int64_t trailing = 1);

// Checks (x, cos_cache, sin_cache, positions) against rotary_pos's contract: caches
// (max_positions, r/2) of one shape and dtype (x's or float32), 2 * r/2 <= head_dim; positions
// int32 or int64, broadcasting against x.shape[:-1]; all on x's device. Values are not read.
ROPE_EXT_INTERNAL void check_rotary_pos_args(const char* op, const TensorArg& x, const TensorArg& cos_cache,
                                             const TensorArg& sin_cache, const TensorArg& positions,
                                             const char* x_name = "x");

// Checks that every position of a CPU tensor is a row of a cache with `rows` rows; the error
// names the first one that is not. (On CUDA the kernel asserts it on the device instead.)
ROPE_EXT_INTERNAL void check_positions_in_range(const char* op, const TensorArg& positions, int64_t rows);

// A tensor and the name error messages give it.
struct NamedTensor {
  const char* name;
  const TensorArg* tensor;
};

// Checks that x (called `x_name`) can be rotated in place: no element stored twice, and no memory
// shared with any of `others` (the tables, positions, the other of q and k).
ROPE_EXT_INTERNAL void check_inplace_args(const char* op, const TensorArg& x,
                                          std::initializer_list<NamedTensor> others, const char* x_name = "x");

// Builds the plan for out = rotary(x, cos, sin), or with `positions` for out = rotary_pos(x, cos_cache,
// sin_cache, positions); the arguments must have passed check_rotary_args (check_rotary_pos_args) and
// `out` must have x's sizes. No tensor data is touched or copied.
ROPE_EXT_INTERNAL RotaryPlan make_rotary_plan(const TensorArg& x, const TensorArg& out, const TensorArg& cos,
                                              const TensorArg& sin, const TensorArg* positions = nullptr);

// The stride of t along dim d of a rank-`ndim` shape it broadcasts against (trailing dims aligned,
// as expand() would give it where that dim has more than one element): 0 where t lacks the dim or
// has size 1 there.
inline int64_t broadcast_stride(const TensorArg& t, int64_t d, int64_t ndim) {
  const int64_t i = d - (ndim - t.dim());
  return i < 0 || t.size(i) == 1 ? 0 : t.stride(i);
}

// QK-norm + RoPE (qk_norm_rotary): out = rotary(g * x_hat + b, cos, sin) per row, x_hat = x * rstd,
// rstd = 1/sqrt(mean(x^2) + eps) over a row of one head (x.size(-1) columns) or, across heads, over
// all of a token's heads (dim -2 of x: x.size(-2) * x.size(-1) columns); g = weight + weight_offset,
// or 1 without a weight; b the bias, or 0. Centered (LayerNorm): x_hat = (x - mean) * rstd, rstd =
// 1/sqrt(mean((x - mean)^2) + eps), the mean over the same columns.
// Operand slots in NormPlan::rows; kGrad is the backward's incoming gradient (out is then dx).
enum NormOperand { kNormX = 0, kNormOut = 1, kNormCos = 2, kNormSin = 3, kNormGrad = 4 };

// How a qk_norm_rotary call walks memory: the rows of x (all dims but the last, size-1 dims dropped
// and adjacent ones merged, in row-major order), `group` consecutive rows normalized together (1, or
// x.size(-2) across heads). Group n's statistics are in a contiguous tensor in the compute dtype
// (float32; float64 for float64 x): rstd[n], or centered, (mean, rstd) at [2n] and [2n + 1].
struct NormPlan : TableLayout {
  StridedDims<5> rows;  // strides of x, out, cos, sin, grad (elements; the tables' broadcast)
  int64_t group = 1;
  int64_t x_col = 1, out_col = 1, grad_col = 1;
  int64_t weight_len = 0, weight_stride = 1;  // 0: no weight (g = 1)
  int64_t bias_len = 0, bias_stride = 1;      // 0: no bias (b = 0)
  // x.size(-2) (1 for a 1-D x). A weight or bias of heads * head_dim values gives row r (row-major
  // over x.shape[:-1], which merging dims keeps) the slice r % heads: across heads a group's h-th row,
  // per head (group 1) each head its own row of parameters with its own statistic.
  int64_t heads = 1;

  int64_t num_rows() const { return rows.numel(); }
  int64_t num_groups() const { return group == 0 ? 0 : num_rows() / group; }
  // A weight (and so a bias: check_qk_norm_args) of a row per head, each head with its own statistic.
  ROPE_HD bool rows_per_head() const { return group == 1 && weight_len > head_dim; }
};

// A norm's affine parameters and the names error messages give them; a null or undefined tensor is
// absent.
struct NormParams {
  const TensorArg* weight = nullptr;
  const TensorArg* bias = nullptr;
  const char* weight_name = "weight";
  const char* bias_name = "bias";
};

// Checks one of q and k (named `x_name`) against qk_norm_rotary's contract: the tables as rotary's
// (check_rotary_args), or with `positions` as rotary_pos's caches (check_rotary_pos_args); the weight and
// the bias each 1-D of x.size(-2) * x.size(-1) elements across heads; per head, the weight of x.size(-1)
// (one row for every head) or x.size(-2) * x.size(-1) (a row per head), and the bias of the weight's length
// (x.size(-1) without a weight); in x's dtype or float32, on x's device; eps and weight_offset finite, eps
// >= 0. Returns nothing; throws with a message naming the argument.
ROPE_EXT_INTERNAL void check_qk_norm_args(const char* op, const TensorArg& x, const NormParams& params,
                                          const TensorArg& cos, const TensorArg& sin, const TensorArg* positions,
                                          double eps, double weight_offset, bool across_heads, const char* x_name);

// The shape of the per-group statistics of checked x: x.shape[:-1], or x.shape[:-2] across heads;
// centered, with a last dim of 2 (mean, rstd).
ROPE_EXT_INTERNAL std::vector<int64_t> norm_stat_shape(const TensorArg& x, bool across_heads, bool centered);

// The plan for a checked call (cos/sin are caches when `positions` is set); `grad` (the backward)
// has x's sizes and is walked with its own strides.
ROPE_EXT_INTERNAL NormPlan make_norm_plan(const TensorArg& x, const TensorArg& out, const NormParams& params,
                                          const TensorArg& cos, const TensorArg& sin, const TensorArg* positions,
                                          const TensorArg* grad, bool across_heads);

// One backend call: out = rotary(x, tables) and, when k is set, k_out = rotary(k, the same
// tables) (rotary_pos_qk, and rotary_qk where q and k share tables: one CUDA launch covers both,
// reading each token's table entries once for q's heads and k's). out may be x and k_out may be k
// (in place).
struct RotaryCall {
  const TensorArg& x;
  const TensorArg& out;
  const TensorArg& cos;  // full-form tables (..., r), or half-width caches (P, r/2) with positions
  const TensorArg& sin;
  const TensorArg* positions = nullptr;  // set: cos/sin are caches gathered at these positions
  const TensorArg* k = nullptr;
  const TensorArg* k_out = nullptr;
  bool interleaved = false;
  bool conjugate = false;
  const char* op = "rope_ext";  // for error messages raised while running
};

using RunFn = void (*)(const RotaryCall& call);

// One backend call of qk_norm_rotary on one tensor. Forward (grad unset): out = rotary(g * x_hat + b),
// or with weight_after out = g * rotary(x_hat) + b (the norm of models that normalize after RoPE:
// the rotation keeps a row's sum of squares, so only the weight's place differs); x_hat centered or
// not (NormPlan's note); the statistics written to rstd unless it is null (the in-place ops keep
// none; out may be x). Backward: out = dx from grad (dy) and the saved statistics, and, when dweight
// (dbias) is set, the weight's (bias's) gradient, weight_len values in the compute dtype, written
// there.
struct NormCall {
  const TensorArg& x;
  const TensorArg& out;
  const TensorArg* weight;  // nullptr or undefined: g = 1
  const TensorArg& cos;
  const TensorArg& sin;
  const TensorArg* rstd;  // the statistics: contiguous, norm_stat_shape(x), the compute dtype; or null (in place)
  const TensorArg* positions = nullptr;  // set: cos/sin are half-width caches gathered at these
  const TensorArg* grad = nullptr;
  const TensorArg* dweight = nullptr;
  double eps = 0, weight_offset = 0;
  bool across_heads = false, interleaved = false;
  const char* op = "rope_ext";
  // (last, so that the calls that leave them unset need not name them)
  bool weight_after = false;
  const TensorArg* bias = nullptr;   // nullptr or undefined: b = 0
  const TensorArg* dbias = nullptr;  // the backward's bias gradient (as dweight), or nullptr
  bool centered = false;             // LayerNorm: the mean subtracted

  NormParams params() const { return {weight, bias}; }
};

using NormRunFn = void (*)(const NormCall& call);

// Whether rotary_qk rotates q and k in one backend call (one CUDA launch). Not with k's own tables
// (cos_k/sin_k): the kernel holds one pair of table pointers and reads a token's entries once for
// every head it covers. Nor where q and k differ in head dim (shared full tables allow it): a
// launch's items cover one row width. Each of those cases makes one call per tensor.
inline bool rotary_qk_one_call(const TensorArg& q, const TensorArg& k, bool own_k_tables) {
  return !own_k_tables && q.size(-1) == k.size(-1);
}

}  // namespace rope_ext
