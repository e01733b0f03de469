// rope_ext::rope_frequencies / inv_freq_for for every rope_type, and cos_sin_tables, against the
// published formulas written out here in double precision.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <rope_ext/rope.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "test_util.h"

using rope_test::expect_close;

namespace {

constexpr double kPi = std::numbers::pi;
constexpr double kRel = 1e-12;

// theta_i = base^(-2i/d), i = 0 .. d/2 - 1.
std::vector<double> default_theta(double base, int64_t d) {
  std::vector<double> theta(d / 2);
  for (int64_t i = 0; i < d / 2; ++i) theta[i] = std::pow(base, -2.0 * i / d);
  return theta;
}

void expect_freqs(const at::Tensor& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  EXPECT_EQ(got.scalar_type(), at::kDouble) << what;
  EXPECT_EQ(got.device(), at::kCPU) << what;
  ASSERT_EQ(got.dim(), 1) << what;
  ASSERT_EQ(got.size(0), static_cast<int64_t>(want.size())) << what;
  const at::Tensor g = got.contiguous();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(g.data_ptr<double>()[i], want[i], kRel * std::abs(want[i])) << what << ", i = " << i;
  }
}

TEST(RopeFrequencies, Default) {
  for (const int64_t d : {2, 64, 96, 128}) {
    const auto f = rope_ext::rope_frequencies({}, 10000.0, d, 4096);
    expect_freqs(f.inv_freq, default_theta(10000.0, d), "default d=" + std::to_string(d));
    EXPECT_EQ(f.rope_type, "default");
    EXPECT_EQ(f.rotary_dim, d);
    EXPECT_EQ(f.base, 10000.0);
    EXPECT_EQ(f.attention_factor, 1.0);
    EXPECT_EQ(f.factor, 1.0);
    EXPECT_FALSE(f.inv_freq_long.defined());
    // inv_freq_for ignores the position for every type but dynamic and longrope.
    expect_freqs(rope_ext::inv_freq_for(f, 100000), default_theta(10000.0, d), "default, long batch");
  }
}

TEST(RopeFrequencies, Linear) {
  rope_ext::RopeScaling s;
  s.rope_type = "linear";
  s.factor = 4.0;
  const auto f = rope_ext::rope_frequencies(s, 10000.0, 64, 8192);
  std::vector<double> want = default_theta(10000.0, 64);
  for (double& t : want) t /= 4.0;
  expect_freqs(f.inv_freq, want, "linear");
  EXPECT_EQ(f.factor, 4.0);
  EXPECT_EQ(f.attention_factor, 1.0);
}

// Llama 3.1: wavelength 2 pi / theta; longer than original / low_freq_factor: theta / factor;
// shorter than original / high_freq_factor: theta; between: (1 - s) theta / factor + s theta,
// s = (original / wavelength - low) / (high - low).
std::vector<double> llama3_theta(double base, int64_t d, double factor, double low, double high, double original) {
  std::vector<double> out;
  for (const double theta : default_theta(base, d)) {
    const double wavelen = 2 * kPi / theta;
    if (wavelen > original / low) {
      out.push_back(theta / factor);
    } else if (wavelen < original / high) {
      out.push_back(theta);
    } else {
      const double s = (original / wavelen - low) / (high - low);
      out.push_back((1 - s) * theta / factor + s * theta);
    }
  }
  return out;
}

TEST(RopeFrequencies, Llama3) {
  rope_ext::RopeScaling s;
  s.rope_type = "llama3";
  s.factor = 8.0;
  s.low_freq_factor = 1.0;
  s.high_freq_factor = 4.0;
  s.original_max_position_embeddings = 8192;
  const auto f = rope_ext::rope_frequencies(s, 500000.0, 128, 131072);
  const auto want = llama3_theta(500000.0, 128, 8.0, 1.0, 4.0, 8192.0);
  expect_freqs(f.inv_freq, want, "llama3");
  EXPECT_EQ(f.factor, 8.0);
  EXPECT_EQ(f.attention_factor, 1.0);
  // The configuration exercises all three bands.
  const auto theta = default_theta(500000.0, 128);
  int kept = 0, divided = 0, blended = 0;
  for (size_t i = 0; i < theta.size(); ++i) {
    kept += want[i] == theta[i];
    divided += want[i] == theta[i] / 8.0;
  }
  blended = static_cast<int>(theta.size()) - kept - divided;
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);

  // Without original_max_position_embeddings, max_position_embeddings stands in for it.
  s.original_max_position_embeddings.reset();
  s.factor = 2.0, s.low_freq_factor = 0.5, s.high_freq_factor = 3.0;
  expect_freqs(rope_ext::rope_frequencies(s, 10000.0, 64, 2048).inv_freq,
               llama3_theta(10000.0, 64, 2.0, 0.5, 3.0, 2048.0), "llama3, original = max_position_embeddings");
}

// Proportional (Gemma 4): pairs below floor(p * d / 2) at theta_i / factor, the rest 0.
TEST(RopeFrequencies, Proportional) {
  rope_ext::RopeScaling s;
  s.rope_type = "proportional";
  s.partial_rotary_factor = 0.25;
  const auto theta = default_theta(1e6, 256);
  auto want = theta;
  for (size_t i = 32; i < want.size(); ++i) want[i] = 0;
  expect_freqs(rope_ext::rope_frequencies(s, 1e6, 256, 4096).inv_freq, want, "proportional 0.25");
  s.partial_rotary_factor = 0.3, s.factor = 8.0;  // floor(0.3 * 96 / 2) = 14 pairs turn
  const auto theta96 = default_theta(1e6, 96);
  want.assign(48, 0.0);
  for (size_t i = 0; i < 14; ++i) want[i] = theta96[i] / 8.0;
  expect_freqs(rope_ext::rope_frequencies(s, 1e6, 96, 4096).inv_freq, want, "proportional 0.3, factor 8");
  s.partial_rotary_factor.reset(), s.factor.reset();  // defaults: every pair turns, factor 1
  expect_freqs(rope_ext::rope_frequencies(s, 1e6, 96, 4096).inv_freq, theta96, "proportional defaults");
}

// YaRN: correction dim of n rotations d ln(original / (2 pi n)) / (2 ln base); ramp over pair
// index i from floor(dim(beta_fast)) to ceil(dim(beta_slow)) (clamped to [0, d - 1]);
// theta_i / factor where the ramp is 1, theta_i where it is 0.
std::vector<double> yarn_theta(double base, int64_t d, double factor, double original, double beta_fast,
                               double beta_slow, bool truncate) {
  const auto dim = [&](double n) { return d * std::log(original / (2 * kPi * n)) / (2 * std::log(base)); };
  double low = dim(beta_fast), high = dim(beta_slow);
  if (truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0), high = std::min(high, d - 1.0);
  if (low == high) high += 0.001;
  std::vector<double> out;
  const auto theta = default_theta(base, d);
  for (size_t i = 0; i < theta.size(); ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    out.push_back(ramp * theta[i] / factor + (1 - ramp) * theta[i]);
  }
  return out;
}

TEST(RopeFrequencies, YarnDefaults) {
  rope_ext::RopeScaling s;
  s.rope_type = "yarn";
  s.factor = 4.0;
  s.original_max_position_embeddings = 4096;
  const auto f = rope_ext::rope_frequencies(s, 10000.0, 128, 16384);
  expect_freqs(f.inv_freq, yarn_theta(10000.0, 128, 4.0, 4096.0, 32.0, 1.0, true), "yarn");
  EXPECT_NEAR(f.attention_factor, 0.1 * std::log(4.0) + 1.0, 1e-15);
  EXPECT_EQ(f.factor, 4.0);

  // factor defaults to max_position_embeddings / original.
  s.factor.reset();
  const auto g = rope_ext::rope_frequencies(s, 10000.0, 128, 32768);
  EXPECT_EQ(g.factor, 8.0);
  expect_freqs(g.inv_freq, yarn_theta(10000.0, 128, 8.0, 4096.0, 32.0, 1.0, true), "yarn, implied factor");
  EXPECT_NEAR(g.attention_factor, 0.1 * std::log(8.0) + 1.0, 1e-15);
}

TEST(RopeFrequencies, YarnOptions) {
  rope_ext::RopeScaling s;
  s.rope_type = "yarn";
  s.factor = 16.0;
  s.original_max_position_embeddings = 4096;
  s.beta_fast = 16.0, s.beta_slow = 2.0, s.truncate = false;
  s.mscale = 0.707, s.mscale_all_dim = 1.0;
  const auto f = rope_ext::rope_frequencies(s, 50000.0, 64, 65536);
  expect_freqs(f.inv_freq, yarn_theta(50000.0, 64, 16.0, 4096.0, 16.0, 2.0, false), "yarn, no truncation");
  const double ms = (0.1 * 0.707 * std::log(16.0) + 1) / (0.1 * 1.0 * std::log(16.0) + 1);
  EXPECT_NEAR(f.attention_factor, ms, 1e-15);

  s.attention_factor = 1.5;
  EXPECT_EQ(rope_ext::rope_frequencies(s, 50000.0, 64, 65536).attention_factor, 1.5);
}

// LongRoPE: theta_i / short_factor[i] while the length L = max_position + 1 fits in the
// original context, theta_i / long_factor[i] beyond it; attention sqrt(1 + ln(factor) / ln(original)).
TEST(RopeFrequencies, LongRope) {
  constexpr int64_t d = 16;
  rope_ext::RopeScaling s;
  s.rope_type = "longrope";
  s.original_max_position_embeddings = 4096;
  for (int64_t i = 0; i < d / 2; ++i) {
    s.short_factor.push_back(1.0 + 0.05 * i);
    s.long_factor.push_back(1.5 + 2.5 * i);
  }
  const auto f = rope_ext::rope_frequencies(s, 10000.0, d, 131072);
  std::vector<double> short_theta, long_theta;
  const auto theta = default_theta(10000.0, d);
  for (int64_t i = 0; i < d / 2; ++i) {
    short_theta.push_back(theta[i] / s.short_factor[i]);
    long_theta.push_back(theta[i] / s.long_factor[i]);
  }
  expect_freqs(f.inv_freq, short_theta, "longrope inv_freq");
  expect_freqs(f.inv_freq_long, long_theta, "longrope inv_freq_long");
  EXPECT_EQ(f.switch_len, 4096);
  EXPECT_EQ(f.factor, 32.0);  // max_position_embeddings / original
  EXPECT_NEAR(f.attention_factor, std::sqrt(1 + std::log(32.0) / std::log(4096.0)), 1e-15);

  expect_freqs(rope_ext::inv_freq_for(f), short_theta, "no max_position");
  expect_freqs(rope_ext::inv_freq_for(f, 0), short_theta, "max_position 0");
  expect_freqs(rope_ext::inv_freq_for(f, 4095), short_theta, "L = original");
  expect_freqs(rope_ext::inv_freq_for(f, 4096), long_theta, "L = original + 1");
  expect_freqs(rope_ext::inv_freq_for(f, 100000), long_theta, "long batch");

  s.factor = 8.0;
  EXPECT_NEAR(rope_ext::rope_frequencies(s, 10000.0, d, 131072).attention_factor,
              std::sqrt(1 + std::log(8.0) / std::log(4096.0)), 1e-15);
  s.attention_factor = 1.25;
  EXPECT_EQ(rope_ext::rope_frequencies(s, 10000.0, d, 131072).attention_factor, 1.25);
}

// Dynamic NTK: with L = max(max_position + 1, max_pos),
// base' = base (factor L / max_pos - (factor - 1))^(d / (d - 2)), theta_i = base'^(-2i/d).
TEST(RopeFrequencies, Dynamic) {
  constexpr int64_t d = 64, max_pos = 2048;
  constexpr double base = 10000.0, factor = 2.0;
  rope_ext::RopeScaling s;
  s.rope_type = "dynamic";
  s.factor = factor;
  const auto f = rope_ext::rope_frequencies(s, base, d, max_pos);
  EXPECT_EQ(f.switch_len, max_pos);
  EXPECT_EQ(f.factor, factor);
  expect_freqs(f.inv_freq, default_theta(base, d), "dynamic inv_freq");
  expect_freqs(rope_ext::inv_freq_for(f), default_theta(base, d), "dynamic, no max_position");
  for (const int64_t max_position : {0, 1000, 2047, 2048, 5000, 100000}) {
    const double length = std::max<double>(max_position + 1, max_pos);
    const double grown = base * std::pow(factor * length / max_pos - (factor - 1), d / (d - 2.0));
    expect_freqs(rope_ext::inv_freq_for(f, max_position), default_theta(grown, d),
                 "dynamic, max_position " + std::to_string(max_position));
  }
}

TEST(RopeFrequencies, FieldsOfTheConfiguration) {
  rope_ext::RopeScaling s;
  s.rope_type = "linear";
  s.factor = 2.0;
  const auto f = rope_ext::rope_frequencies(s, 1e6, 96, 32768);
  EXPECT_EQ(f.rope_type, "linear");
  EXPECT_EQ(f.rotary_dim, 96);
  EXPECT_EQ(f.base, 1e6);
  EXPECT_EQ(f.switch_len, 32768);
  EXPECT_EQ(f.inv_freq.size(0), 48);
}

// cos_sin_tables: shape P + (r,), half-split [cos(a), cos(a)], interleaved [c0, c0, c1, c1, ...],
// with a = position * inv_freq in double.
TEST(CosSinTables, LayoutsAndValues) {
  const at::Tensor positions = at::tensor({0, 1, 7, 4095, 123456, 3}, at::kLong).view({2, 3});
  const std::vector<double> theta = default_theta(10000.0, 16);
  const at::Tensor inv_freq = at::tensor(theta, at::kDouble);
  const int64_t half = 8;
  for (const bool interleaved : {false, true}) {
    const auto [cos, sin] = rope_ext::cos_sin_tables(positions, inv_freq, interleaved, 1.0, at::kDouble);
    ASSERT_EQ(cos.sizes(), (std::vector<int64_t>{2, 3, 16}));
    ASSERT_EQ(sin.sizes(), cos.sizes());
    ASSERT_EQ(cos.scalar_type(), at::kDouble);
    const at::Tensor c = cos.contiguous().view({6, 16}), s = sin.contiguous().view({6, 16});
    const at::Tensor p = positions.contiguous().view({6});
    for (int64_t row = 0; row < 6; ++row) {
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(p[row].item<int64_t>()) * theta[i];
        for (const int64_t col : interleaved ? std::vector<int64_t>{2 * i, 2 * i + 1}
                                             : std::vector<int64_t>{i, i + half}) {
          EXPECT_NEAR(c[row][col].item<double>(), std::cos(angle), 1e-14)
              << (interleaved ? "interleaved" : "half-split") << " cos, row " << row << " col " << col;
          EXPECT_NEAR(s[row][col].item<double>(), std::sin(angle), 1e-14)
              << (interleaved ? "interleaved" : "half-split") << " sin, row " << row << " col " << col;
        }
      }
    }
  }
}

TEST(CosSinTables, DtypeScaleAndPositionTypes) {
  const at::Tensor inv_freq = at::tensor(default_theta(500000.0, 32), at::kDouble);
  const at::Tensor positions = at::arange(20, at::kLong);
  const auto [c64, s64] = rope_ext::cos_sin_tables(positions, inv_freq, false, 1.0, at::kDouble);

  // Default dtype float32; float32 / bfloat16 / float16 results are the float64 values rounded once.
  const auto [cf, sf] = rope_ext::cos_sin_tables(positions, inv_freq);
  EXPECT_EQ(cf.scalar_type(), at::kFloat);
  expect_close(cf, c64, std::ldexp(1.0, -24), 1e-300, "float32 cos");
  expect_close(sf, s64, std::ldexp(1.0, -24), 1e-300, "float32 sin");
  for (const auto& [dtype, u] : {std::pair{at::kBFloat16, -8}, std::pair{at::kHalf, -11}}) {
    const auto [c, s] = rope_ext::cos_sin_tables(positions, inv_freq, false, 1.0, dtype);
    EXPECT_EQ(c.scalar_type(), dtype);
    EXPECT_EQ(s.scalar_type(), dtype);
    // Half an ulp relative, plus half the smallest float16 subnormal for values near 0.
    expect_close(c, c64, std::ldexp(1.0, u), std::ldexp(1.0, -25), std::string(c10::toString(dtype)) + " cos");
    expect_close(s, s64, std::ldexp(1.0, u), std::ldexp(1.0, -25), std::string(c10::toString(dtype)) + " sin");
  }

  // scale multiplies both tables.
  const auto [c_sc, s_sc] = rope_ext::cos_sin_tables(positions, inv_freq, true, 1.3, at::kDouble);
  const auto [c_il, s_il] = rope_ext::cos_sin_tables(positions, inv_freq, true, 1.0, at::kDouble);
  expect_close(c_sc, c_il * 1.3, 1e-15, 0, "scaled cos");
  expect_close(s_sc, s_il * 1.3, 1e-15, 0, "scaled sin");

  // Any integer dtype of positions, and float32 frequencies.
  for (const auto t : {at::kInt, at::kShort, at::kByte}) {
    const auto [c, s] = rope_ext::cos_sin_tables(positions.to(t), inv_freq, false, 1.0, at::kDouble);
    expect_close(c, c64, 1e-15, 1e-15, std::string("positions ") + c10::toString(t));
  }
  const auto [c32, s32] = rope_ext::cos_sin_tables(positions, inv_freq.to(at::kFloat), false, 1.0, at::kDouble);
  const auto [cw, sw] =
      rope_ext::cos_sin_tables(positions, inv_freq.to(at::kFloat).to(at::kDouble), false, 1.0, at::kDouble);
  rope_test::expect_bitwise_equal(c32, cw, "float32 inv_freq is widened, not rounded further");

  const auto [ce, se] = rope_ext::cos_sin_tables(at::empty({0, 4}, at::kLong), inv_freq);
  EXPECT_EQ(ce.sizes(), (std::vector<int64_t>{0, 4, 32}));
}

// End to end: tables from rope_frequencies drive rotary; rotating position p by the table is the
// reference rotation by the angle p * theta.
TEST(CosSinTables, DriveRotary) {
  at::manual_seed(3);
  rope_ext::RopeScaling s;
  s.rope_type = "linear";
  s.factor = 2.0;
  const auto f = rope_ext::rope_frequencies(s, 10000.0, 16, 4096);
  const at::Tensor positions = at::arange(6, at::kLong) * 17;
  const at::Tensor x = at::randn({2, 3, 6, 24}, at::kDouble);
  for (const bool interleaved : {false, true}) {
    const auto [cos, sin] = rope_ext::cos_sin_tables(positions, f.inv_freq, interleaved, 1.0, at::kDouble);
    const at::Tensor angles = positions.to(at::kDouble).unsqueeze(-1) * f.inv_freq;
    const auto [rc, rs] = rope_test::tables_from_angles(angles, interleaved);
    const auto ref = rope_test::reference_rotary(x, rc, rs, interleaved, false);
    rope_test::expect_within(rope_ext::rotary(x, cos, sin, interleaved), ref, 1e-12, 1e-14,
                             interleaved ? "interleaved" : "half-split");
  }
}

}  // namespace
