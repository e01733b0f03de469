// Bad arguments raise c10::Error with a message that names the argument.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <rope_ext/rope.h>

#include "test_util.h"

using at::Tensor;
using rope_test::expect_error;

namespace {

struct Tables {
  Tensor cos = at::ones({5, 16}), sin = at::zeros({5, 16});
};

TEST(Errors, RotaryArguments) {
  const Tables t;
  const Tensor x = at::randn({2, 3, 5, 24});
  expect_error([&] { rope_ext::rotary(x.to(at::kInt), t.cos, t.sin); }, "x must be float32",
               "integer x");
  expect_error([&] { rope_ext::rotary(x, t.cos.narrow(-1, 0, 15), t.sin.narrow(-1, 0, 15)); },
               "cos.size(-1) must be a positive even number", "odd rotary dim");
  expect_error([&] { rope_ext::rotary(x, at::ones({5, 26}), at::zeros({5, 26})); },
               "cos.size(-1) = 26 exceeds the head dim x.size(-1) = 24", "rotary dim > head dim");
  expect_error([&] { rope_ext::rotary(x, t.cos, t.sin.to(at::kDouble)); }, "cos and sin must have the same dtype",
               "cos/sin of different dtypes");
  expect_error([&] { rope_ext::rotary(x, at::ones({4, 16}), at::zeros({4, 16})); },
               "cos and sin of shape [4, 16] do not broadcast against x.shape", "tables not broadcastable");
  expect_error([&] { rope_ext::rotary(x, at::ones({3, 1, 5, 16}), at::zeros({3, 1, 5, 16})); },
               "do not broadcast against x", "tables that would grow x");
  expect_error([&] { rope_ext::rotary(x, t.cos, at::zeros({1, 5, 16})); }, "cos and sin must have the same shape",
               "cos/sin of different shapes");
  expect_error([&] { rope_ext::rotary(x, t.cos.to(at::kDouble), t.sin.to(at::kDouble)); },
               "cos and sin must have x's dtype", "float64 tables for float32 x");
}

TEST(Errors, RotaryQKArguments) {
  const Tables t;
  const Tensor q = at::randn({2, 4, 5, 24}), k = at::randn({2, 2, 5, 24});
  expect_error([&] { rope_ext::rotary_qk(q, k, t.cos, t.sin, false, t.cos, std::nullopt); },
               "cos_k and sin_k must be given together", "cos_k without sin_k");
  expect_error([&] { rope_ext::rotary_qk(q, k, t.cos, t.sin, false, std::nullopt, t.sin); },
               "cos_k and sin_k must be given together", "sin_k without cos_k");
  // The same under autograd, where the call goes through the autograd kernel first.
  const Tensor qg = q.detach().clone().set_requires_grad(true);
  expect_error([&] { rope_ext::rotary_qk(qg, k, t.cos, t.sin, false, t.cos, std::nullopt); },
               "cos_k and sin_k must be given together", "cos_k without sin_k, q requiring grad");
  expect_error([&] { rope_ext::rotary_qk(q, k.to(at::kDouble), t.cos, t.sin); }, "q and k must have the same dtype",
               "q/k dtypes");
  expect_error([&] { rope_ext::rotary_qk(q, at::randn({2, 2, 6, 24}), t.cos, t.sin); }, "k",
               "k with another sequence length");
  expect_error(
      [&] { rope_ext::rotary_qk(q, k, t.cos, t.sin, false, at::ones({5, 18}), at::zeros({5, 18}).to(at::kDouble)); },
      "cos_k and sin_k must have the same dtype", "cos_k/sin_k dtypes");
}

TEST(Errors, InPlaceArguments) {
  const Tables t;
  at::NoGradGuard no_grad;
  Tensor expanded = at::randn({2, 1, 5, 24}).expand({2, 3, 5, 24});
  expect_error([&] { rope_ext::rotary_(expanded, t.cos, t.sin); }, "x has elements that share memory",
               "rotary_ on an expanded x");
  // x and cos as overlapping row windows of one contiguous buffer.
  const Tensor buffer = at::randn({6, 16});
  Tensor x = buffer.narrow(0, 1, 5);
  expect_error([&] { rope_ext::rotary_(x, buffer.narrow(0, 0, 5), t.sin); }, "x shares memory with cos",
               "rotary_ with cos aliasing x");
  expect_error([&] { rope_ext::rotary_(x, t.cos, buffer.narrow(0, 0, 5)); }, "x shares memory with sin",
               "rotary_ with sin aliasing x");
}

// A table that aliases x through a non-contiguous view (here columns 4..19 of x): the byte ranges
// intersect and no periodic-rows proof separates them, so it is refused (it would be rotated while
// read, wrongly for the half-split pairing).
TEST(Errors, InPlaceStridedTableAliasingX) {
  at::NoGradGuard no_grad;
  Tensor x = at::randn({5, 24});
  const Tensor sin = at::randn({5, 16});
  expect_error([&] { rope_ext::rotary_(x, x.narrow(-1, 4, 16), sin); }, "x shares memory with cos",
               "rotary_ with cos a column window of x");
}

rope_ext::RopeScaling scaling(const char* type) {
  rope_ext::RopeScaling s;
  s.rope_type = type;
  return s;
}

TEST(Errors, RopeFrequenciesArguments) {
  expect_error([] { rope_ext::rope_frequencies(scaling("bogus"), 10000, 64, 2048); },
               "rope_type must be one of default, linear, dynamic, yarn, longrope, llama3, proportional, got 'bogus'",
               "rope_type bogus");
  expect_error([] { rope_ext::rope_frequencies({}, 10000, 63, 2048); }, "rotary_dim must be a positive even int",
               "odd rotary_dim");
  expect_error([] { rope_ext::rope_frequencies({}, 10000, 0, 2048); }, "rotary_dim must be a positive even int",
               "zero rotary_dim");
  expect_error([] { rope_ext::rope_frequencies({}, -10000, 64, 2048); }, "base must be a finite positive number",
               "negative base");
  expect_error([] { rope_ext::rope_frequencies({}, std::nan(""), 64, 2048); },
               "base must be a finite positive number", "NaN base");
  expect_error([] { rope_ext::rope_frequencies({}, 10000, 64, 0); }, "max_position_embeddings must be a positive",
               "zero max_position_embeddings");

  auto llama = scaling("llama3");
  llama.factor = 8, llama.low_freq_factor = 4, llama.high_freq_factor = 1;
  expect_error([&] { rope_ext::rope_frequencies(llama, 500000, 128, 131072); },
               "low_freq_factor (4) must be <= high_freq_factor (1)", "llama3 low > high");
  llama.low_freq_factor = 2, llama.high_freq_factor = 2;  // no band between: accepted (vLLM's rule)
  EXPECT_TRUE(rope_ext::rope_frequencies(llama, 500000, 128, 131072).inv_freq.isfinite().all().item<bool>());
  llama.high_freq_factor.reset();
  expect_error([&] { rope_ext::rope_frequencies(llama, 500000, 128, 131072); }, "high_freq_factor",
               "llama3 without high_freq_factor");

  auto yarn_ratio = scaling("yarn");
  yarn_ratio.factor = 4, yarn_ratio.mscale = 1, yarn_ratio.mscale_all_dim = -10;  // a negative mscale ratio
  expect_error([&] { rope_ext::rope_frequencies(yarn_ratio, 10000, 64, 2048); },
               "attention factor from mscale and mscale_all_dim must be a finite positive number",
               "yarn mscale ratio < 0");

  auto linear = scaling("linear");
  expect_error([&] { rope_ext::rope_frequencies(linear, 10000, 64, 2048); }, "factor", "linear without factor");
  linear.factor = 0.5;
  expect_error([&] { rope_ext::rope_frequencies(linear, 10000, 64, 2048); }, "factor must be >= 1",
               "linear factor < 1");

  auto longrope = scaling("longrope");
  longrope.original_max_position_embeddings = 4096;
  longrope.short_factor = std::vector<double>(32, 1.0);
  longrope.long_factor = std::vector<double>(31, 2.0);
  expect_error([&] { rope_ext::rope_frequencies(longrope, 10000, 64, 131072); },
               "long_factor must have rotary_dim/2 = 32 values, got 31", "longrope long_factor length");
  longrope.short_factor = {};
  expect_error([&] { rope_ext::rope_frequencies(longrope, 10000, 64, 131072); },
               "short_factor must have rotary_dim/2 = 32 values, got 0", "longrope without short_factor");
  longrope.short_factor = std::vector<double>(32, 1.0);
  longrope.long_factor = std::vector<double>(32, 2.0);
  longrope.long_factor[3] = -1;
  expect_error([&] { rope_ext::rope_frequencies(longrope, 10000, 64, 131072); }, "long_factor must be positive",
               "longrope negative factor");

  auto dynamic = scaling("dynamic");
  dynamic.factor = 2;
  expect_error([&] { rope_ext::rope_frequencies(dynamic, 10000, 2, 2048); }, "rotary_dim > 2",
               "dynamic with rotary_dim 2");
  const auto f = rope_ext::rope_frequencies(dynamic, 10000, 64, 2048);
  expect_error([&] { rope_ext::inv_freq_for(f, -1); }, "max_position must be >= 0", "inv_freq_for(-1)");

  auto yarn = scaling("yarn");
  yarn.factor = 4, yarn.beta_fast = -1;
  expect_error([&] { rope_ext::rope_frequencies(yarn, 10000, 64, 2048); }, "beta_fast must be a finite positive",
               "yarn negative beta_fast");
}

TEST(Errors, CosSinTablesArguments) {
  const Tensor inv_freq = at::rand({8}, at::kDouble);
  expect_error([&] { rope_ext::cos_sin_tables(at::arange(4, at::kFloat), inv_freq); },
               "positions must be an integer tensor", "float positions");
  expect_error([&] { rope_ext::cos_sin_tables(at::arange(4, at::kLong) - 2, inv_freq); },
               "positions must be >= 0, got a minimum of -2", "negative positions");
  expect_error([&] { rope_ext::cos_sin_tables(at::arange(4, at::kLong), inv_freq.view({2, 4})); },
               "inv_freq must be a 1-D floating-point tensor", "2-D inv_freq");
  expect_error([&] { rope_ext::cos_sin_tables(at::arange(4, at::kLong), at::arange(8, at::kLong)); },
               "inv_freq must be a 1-D floating-point tensor", "integer inv_freq");
  expect_error([&] { rope_ext::cos_sin_tables(at::ones({4}, at::kBool), inv_freq); },
               "positions must be an integer tensor", "bool positions");
}

}  // namespace
