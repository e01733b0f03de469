// Forward of rope_ext::rotary, rotary_qk and rotary_ against a float64 loop over pairs
// (test_util.h), for both pairings, partial rotary, conjugate, strided inputs and every dtype.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <rope_ext/rope.h>

#include <cmath>
#include <string>

#include "test_util.h"

using rope_test::expect_bitwise_equal;
using rope_test::expect_within;
using rope_test::reference_rotary;
using rope_test::tables_from_angles;

namespace {

constexpr int64_t B = 2, H = 3, S = 5;

// Tolerances, as a multiple of each output's magnitude |x_a c| + |x_b s| (the reference's
// `magnitude`): the kernel forms the two products and their sum in float32 (float64 for
// float64 x), without FMA, so float32 math is off by at most ~2u * magnitude with u = 2^-24;
// 3u leaves a margin. A float16 / bfloat16 result is that float32 value rounded once more, off by
// at most half an ulp, i.e. u = 2^-11 (float16, 11-bit significand) or 2^-8 (bfloat16, 8-bit)
// relative to a value no larger than the magnitude. float16 results that land among the
// subnormals are off by up to half the smallest subnormal, 2^-25, in absolute terms.
constexpr double kF32 = 3.0 / (1 << 24);
double rel_tol(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return 1e-12;
    case at::kFloat: return kF32;
    case at::kHalf: return std::ldexp(1.0, -11) + kF32;
    case at::kBFloat16: return std::ldexp(1.0, -8) + kF32;
    default: return 0;
  }
}
double abs_tol(at::ScalarType t) { return t == at::kHalf ? std::ldexp(1.0, -25) : 0.0; }

std::string label(bool interleaved, bool conjugate) {
  return std::string(interleaved ? "interleaved" : "half-split") + (conjugate ? ", conjugate" : "");
}

// Angles of positions 0..S-1 at a spread of frequencies, (S, r/2) float64.
at::Tensor position_angles(int64_t r) {
  const at::Tensor pos = at::arange(S, at::kDouble).unsqueeze(-1) + 3;
  const at::Tensor freq = at::pow(100.0, -at::arange(r / 2, at::kDouble) / (r / 2)) * 1.3;
  return pos * freq;
}

// Checks rotary(x, cos, sin) against the reference for all four (interleaved, conjugate)
// combinations, and that columns r.. pass through bit for bit.
void check_all_modes(const at::Tensor& x, const at::Tensor& angles, at::ScalarType table_dtype,
                     const std::string& what) {
  const int64_t r = 2 * angles.size(-1);
  for (const bool interleaved : {false, true}) {
    auto [cos, sin] = tables_from_angles(angles, interleaved);
    cos = cos.to(table_dtype), sin = sin.to(table_dtype);
    for (const bool conjugate : {false, true}) {
      const std::string where = what + " (" + label(interleaved, conjugate) + ")";
      const at::Tensor out = rope_ext::rotary(x, cos, sin, interleaved, conjugate);
      ASSERT_EQ(out.scalar_type(), x.scalar_type()) << where;
      expect_within(out, reference_rotary(x, cos, sin, interleaved, conjugate), rel_tol(x.scalar_type()),
                    abs_tol(x.scalar_type()), where);
      if (r < x.size(-1)) {
        expect_bitwise_equal(out.narrow(-1, r, x.size(-1) - r), x.narrow(-1, r, x.size(-1) - r),
                             where + ": pass-through columns");
      }
    }
  }
}

class RotaryForward : public ::testing::Test {
 protected:
  void SetUp() override { at::manual_seed(1234); }
};

TEST_F(RotaryForward, Float64FullAndPartial) {
  for (const int64_t d : {16, 24}) {
    const at::Tensor x = at::randn({B, H, S, d}, at::kDouble);
    check_all_modes(x, position_angles(16), at::kDouble, "float64 d=" + std::to_string(d));
  }
}

TEST_F(RotaryForward, Float32FullAndPartial) {
  for (const int64_t d : {16, 40}) {
    const at::Tensor x = at::randn({B, H, S, d});
    check_all_modes(x, position_angles(16), at::kFloat, "float32 d=" + std::to_string(d));
  }
}

TEST_F(RotaryForward, HalfPrecisionWithOwnAndFloat32Tables) {
  for (const auto dtype : {at::kHalf, at::kBFloat16}) {
    const at::Tensor x = at::randn({B, H, S, 24}).to(dtype);
    for (const auto table_dtype : {dtype, at::kFloat}) {
      check_all_modes(x, position_angles(16), table_dtype,
                      std::string(c10::toString(dtype)) + " x, " + c10::toString(table_dtype) + " tables");
    }
  }
}

TEST_F(RotaryForward, LongRowsCoverVectorTails) {
  // Head dims that are not multiples of any vector width, and a long rotary dim.
  for (const int64_t d : {130, 258}) {
    const at::Tensor x = at::randn({2, 3, d});
    const at::Tensor angles = at::rand({3, 64}, at::kDouble) * 20 - 10;  // r = 128
    check_all_modes(x, angles, at::kFloat, "float32 d=" + std::to_string(d));
    check_all_modes(x.to(at::kBFloat16), angles, at::kFloat, "bfloat16 d=" + std::to_string(d));
  }
}

TEST_F(RotaryForward, TableBroadcastShapes) {
  const at::Tensor x = at::randn({B, H, S, 24});
  // Per-row positions (B, 1, S, r), one position for everything (r,), per batch (B, 1, 1, r).
  check_all_modes(x, at::rand({B, 1, S, 8}, at::kDouble) * 6, at::kFloat, "(B,1,S,r) tables");
  check_all_modes(x, at::rand({8}, at::kDouble) * 6, at::kFloat, "(r,) tables");
  check_all_modes(x, at::rand({B, 1, 1, 8}, at::kDouble) * 6, at::kFloat, "(B,1,1,r) tables");
}

TEST_F(RotaryForward, TransposedView) {
  // (B, S, H, D) storage seen as (B, H, S, D), the layout of a fused qkv projection.
  const at::Tensor storage = at::randn({B, S, H, 24});
  const at::Tensor x = storage.transpose(1, 2);
  ASSERT_FALSE(x.is_contiguous());
  check_all_modes(x, position_angles(16), at::kFloat, "transposed float32");
  check_all_modes(x.to(at::kDouble), position_angles(16), at::kDouble, "transposed float64");

  const auto [cos, sin] = tables_from_angles(position_angles(16), false);
  const at::Tensor out = rope_ext::rotary(x, cos.to(at::kFloat), sin.to(at::kFloat));
  EXPECT_EQ(out.strides(), x.strides()) << "rotary keeps x's memory layout";
  EXPECT_NE(out.data_ptr(), x.data_ptr());
}

TEST_F(RotaryForward, SlicedViews) {
  const at::Tensor big = at::randn({B, H, 2 * S, 64});
  // A column window (row stride 64), every other sequence position, and a last-dim stride of 2.
  check_all_modes(big.narrow(-1, 5, 24).slice(2, 0, 2 * S, 2), position_angles(16), at::kFloat,
                  "column window of every other row");
  check_all_modes(big.slice(-1, 1, 49, 2).narrow(2, 0, S), position_angles(16), at::kFloat,
                  "last-dim stride 2");
  check_all_modes(big.to(at::kHalf).narrow(-1, 7, 20).narrow(2, 3, S), position_angles(16), at::kHalf,
                  "float16 window");
}

TEST_F(RotaryForward, StridedTables) {
  const at::Tensor x = at::randn({B, H, S, 24});
  // Tables as a transposed view of (r, S) storage, and tables expanded (stride 0) over the batch.
  const auto [cos, sin] = tables_from_angles(position_angles(16), false);
  const at::Tensor cos_t = cos.to(at::kFloat).t().contiguous().t(), sin_t = sin.to(at::kFloat).t().contiguous().t();
  ASSERT_FALSE(cos_t.is_contiguous());
  for (const bool conjugate : {false, true}) {
    expect_within(rope_ext::rotary(x, cos_t, sin_t, false, conjugate),
                  reference_rotary(x, cos_t, sin_t, false, conjugate), kF32, 0, "transposed tables");
    const at::Tensor cos_e = cos_t.unsqueeze(0).unsqueeze(0).expand({B, 1, S, 16});
    const at::Tensor sin_e = sin_t.unsqueeze(0).unsqueeze(0).expand({B, 1, S, 16});
    expect_within(rope_ext::rotary(x, cos_e, sin_e, false, conjugate),
                  reference_rotary(x, cos_e, sin_e, false, conjugate), kF32, 0, "expanded tables");
  }
}

TEST_F(RotaryForward, ZeroAngleIsIdentityAndConjugateInverts) {
  const at::Tensor x = at::randn({B, H, S, 16}, at::kDouble);
  const at::Tensor one = at::ones({16}, at::kDouble), zero = at::zeros({16}, at::kDouble);
  expect_bitwise_equal(rope_ext::rotary(x, one, zero), x, "angle 0");
  for (const bool interleaved : {false, true}) {
    const auto [cos, sin] = tables_from_angles(position_angles(16), interleaved);
    const at::Tensor back = rope_ext::rotary(rope_ext::rotary(x, cos, sin, interleaved), cos, sin, interleaved, true);
    EXPECT_TRUE(at::allclose(back, x, 1e-13, 1e-13)) << "conjugate undoes the rotation, " << label(interleaved, false);
  }
}

TEST_F(RotaryForward, EmptyInput) {
  const at::Tensor x = at::randn({0, H, S, 16});
  const auto [cos, sin] = tables_from_angles(position_angles(16), false);
  const at::Tensor out = rope_ext::rotary(x, cos.to(at::kFloat), sin.to(at::kFloat));
  EXPECT_EQ(out.sizes(), x.sizes());
}

// rotary_qk is two rotary calls; GQA k has fewer heads.
TEST(RotaryQK, EqualsTwoRotaryCallsBitForBit) {
  at::manual_seed(7);
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kDouble}) {
    const at::Tensor q = at::randn({B, 4, S, 24}).to(dtype);
    // k: 2 kv heads, stored (B, S, H, D) and viewed (B, H, S, D).
    const at::Tensor k = at::randn({B, S, 2, 24}).to(dtype).transpose(1, 2);
    for (const bool interleaved : {false, true}) {
      auto [cos, sin] = tables_from_angles(position_angles(16), interleaved);
      const auto table_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;
      cos = cos.to(table_dtype), sin = sin.to(table_dtype);
      for (const bool conjugate : {false, true}) {
        const std::string where = std::string(c10::toString(dtype)) + " " + label(interleaved, conjugate);
        const auto [q_out, k_out] = rope_ext::rotary_qk(q, k, cos, sin, interleaved, std::nullopt, std::nullopt,
                                                        conjugate);
        expect_bitwise_equal(q_out, rope_ext::rotary(q, cos, sin, interleaved, conjugate), where + ": q");
        expect_bitwise_equal(k_out, rope_ext::rotary(k, cos, sin, interleaved, conjugate), where + ": k");
        EXPECT_EQ(k_out.strides(), k.strides()) << where;
      }
    }
  }
}

TEST(RotaryQK, SeparateKeyTables) {
  at::manual_seed(8);
  const at::Tensor q = at::randn({B, 4, S, 24});
  const at::Tensor k = at::randn({B, S, 2, 24});  // (B, S, H, D): a shape of its own
  const auto [cos, sin] = tables_from_angles(position_angles(16), false);
  // xPos-like: q's tables scaled up, k's scaled down, k's in (S, 1, r) form.
  const at::Tensor cq = (cos * 1.25).to(at::kFloat), sq = (sin * 1.25).to(at::kFloat);
  const at::Tensor ck = (cos * 0.8).to(at::kFloat).unsqueeze(1), sk = (sin * 0.8).to(at::kFloat).unsqueeze(1);
  for (const bool conjugate : {false, true}) {
    const auto [q_out, k_out] = rope_ext::rotary_qk(q, k, cq, sq, false, ck, sk, conjugate);
    expect_bitwise_equal(q_out, rope_ext::rotary(q, cq, sq, false, conjugate), "q");
    expect_bitwise_equal(k_out, rope_ext::rotary(k, ck, sk, false, conjugate), "k");
    expect_within(k_out, reference_rotary(k, ck, sk, false, conjugate), kF32, 0, "k vs reference");
  }
}

TEST(RotaryInPlace, EqualsRotaryBitForBit) {
  at::manual_seed(9);
  for (const auto dtype : {at::kFloat, at::kHalf, at::kDouble}) {
    const at::Tensor x = at::randn({B, S, H, 24}).to(dtype).transpose(1, 2);  // strided, in place
    for (const bool interleaved : {false, true}) {
      auto [cos, sin] = tables_from_angles(position_angles(16), interleaved);
      cos = cos.to(dtype), sin = sin.to(dtype);
      for (const bool conjugate : {false, true}) {
        const std::string where = std::string(c10::toString(dtype)) + " " + label(interleaved, conjugate);
        const at::Tensor expected = rope_ext::rotary(x, cos, sin, interleaved, conjugate);
        at::Tensor y = x.clone();  // keeps x's strides
        const void* storage = y.data_ptr();
        {
          at::NoGradGuard no_grad;
          rope_ext::rotary_(y, cos, sin, interleaved, conjugate);
        }
        EXPECT_EQ(y.data_ptr(), storage);
        expect_bitwise_equal(y, expected, where + " (no_grad)");

        at::Tensor z;
        {
          c10::InferenceMode inference;
          z = x.clone();
          rope_ext::rotary_(z, cos, sin, interleaved, conjugate);
        }
        expect_bitwise_equal(z, expected, where + " (inference mode)");
      }
    }
  }
}

TEST(RotaryInPlace, AllowedUnderGradModeWhenNothingRequiresGrad) {
  at::Tensor x = at::randn({B, H, S, 16});
  const auto [cos, sin] = tables_from_angles(position_angles(16), false);
  const at::Tensor expected = rope_ext::rotary(x, cos.to(at::kFloat), sin.to(at::kFloat));
  ASSERT_TRUE(at::GradMode::is_enabled());
  rope_ext::rotary_(x, cos.to(at::kFloat), sin.to(at::kFloat));
  expect_bitwise_equal(x, expected, "rotary_ in grad mode");
}

// The ops say which rope_ext registered them: this library, the version of its headers.
TEST(Registration, VersionOpIsTheHeadersVersion) {
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("rope_ext::_version", "");
  EXPECT_EQ(op.typed<std::string()>().call(), std::string(ROPE_EXT_VERSION));
}

}  // namespace
