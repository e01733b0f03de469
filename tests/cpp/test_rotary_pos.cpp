// The C++ API's rotary_pos, rotary_pos_qk and rotary_pos_: the same results as rotary() on the
// full-form tables gathered from the caches by plain indexing (bit for bit: same roundings), errors
// for positions outside the cache, and gradients that reach the caches.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <rope_ext/rope.h>
#include <torch/autograd.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>


#include "test_util.h"

using rope_test::expect_bitwise_equal;
using rope_test::expect_close;
using rope_test::expect_error;

namespace {

// (P, r/2) caches of p * theta_i, angles in float64.
std::pair<at::Tensor, at::Tensor> caches(int64_t P, int64_t r, at::ScalarType dtype = at::kFloat) {
  const at::Tensor theta = at::pow(10000.0, -at::arange(0, r, 2, at::kDouble) / static_cast<double>(r));
  const at::Tensor angles = at::arange(P, at::kDouble).unsqueeze(-1) * theta;
  return {angles.cos().to(dtype), angles.sin().to(dtype)};
}

// Full-form tables of the positions' rows: positions.shape + (r,).
std::pair<at::Tensor, at::Tensor> gathered(const at::Tensor& cc, const at::Tensor& sc, const at::Tensor& pos,
                                           bool interleaved) {
  const at::Tensor c = cc.index({pos}), s = sc.index({pos});
  if (interleaved) return {c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)};
  return {at::cat({c, c}, -1), at::cat({s, s}, -1)};
}

TEST(RotaryPos, EqualsRotaryOnGatheredTables) {
  const auto [cc, sc] = caches(40, 24);
  const at::Tensor pos = at::randint(0, 40, {2, 5, 1}, at::kLong);
  for (const auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    const at::Tensor x = at::randn({2, 5, 3, 32}).to(dtype);
    for (const bool interleaved : {false, true}) {
      for (const bool conjugate : {false, true}) {
        const auto [c, s] = gathered(cc, sc, pos, interleaved);
        const at::Tensor expected = rope_ext::rotary(x, c, s, interleaved, conjugate);
        expect_bitwise_equal(rope_ext::rotary_pos(x, cc, sc, pos, interleaved, conjugate), expected, "rotary_pos");
        const at::Tensor k = at::randn({2, 5, 1, 32}).to(dtype);
        const auto [q_out, k_out] = rope_ext::rotary_pos_qk(x, k, cc, sc, pos.to(at::kInt), interleaved, conjugate);
        expect_bitwise_equal(q_out, expected, "rotary_pos_qk q");
        expect_bitwise_equal(k_out, rope_ext::rotary(k, c, s, interleaved, conjugate), "rotary_pos_qk k");
        at::Tensor q2 = x.clone(), k2 = k.clone();
        rope_ext::rotary_pos_(q2, k2, cc, sc, pos, interleaved, conjugate);
        expect_bitwise_equal(q2, q_out, "rotary_pos_ q");
        expect_bitwise_equal(k2, k_out, "rotary_pos_ k");
      }
    }
  }
}

TEST(RotaryPos, PositionOutsideTheCacheIsAnError) {
  const auto [cc, sc] = caches(8, 16);
  at::Tensor x = at::randn({4, 2, 16});
  const at::Tensor pos = at::tensor({0, 3, 8, 1}, at::kLong).unsqueeze(-1);
  expect_error([&] { rope_ext::rotary_pos(x, cc, sc, pos); }, "position 8 (positions.flatten()[2]) is outside the cache",
               "one past the end");
  const at::Tensor before = x.clone();
  expect_error([&] { rope_ext::rotary_pos_(x, std::nullopt, cc, sc, pos); }, "is outside the cache", "in place");
  expect_bitwise_equal(x, before, "a refused in-place call writes nothing");
}

// The type the C++ API gives that error, on each path: rope_ext::PositionOutsideCache, a
// c10::IndexError, its message the library's without the prefix that carried the type.
TEST(RotaryPos, PositionOutsideTheCacheHasItsType) {
  const auto [cc, sc] = caches(8, 16);
  const at::Tensor pos = at::tensor({0, 3, 8, 1}, at::kLong).unsqueeze(-1);
  const at::Tensor x = at::randn({4, 2, 16}), k = at::randn({4, 1, 16});
  const std::vector<std::pair<const char*, std::function<void()>>> calls = {
      {"rotary_pos", [&] { rope_ext::rotary_pos(x, cc, sc, pos); }},
      {"rotary_pos, x requiring grad", [&] { rope_ext::rotary_pos(x.clone().requires_grad_(), cc, sc, pos); }},
      {"rotary_pos_qk", [&] { rope_ext::rotary_pos_qk(x, k, cc, sc, pos); }},
      {"rotary_pos_", [&] {
         at::Tensor q_in = x.clone();
         rope_ext::rotary_pos_(q_in, k.clone(), cc, sc, pos);
       }},
  };
  for (const auto& [what, call] : calls) {
    try {
      call();
      ADD_FAILURE() << what << ": did not throw";
    } catch (const rope_ext::PositionOutsideCache& e) {
      const c10::IndexError& index_error = e;
      EXPECT_EQ(index_error.msg().rfind("rope_ext.rotary_pos", 0), 0u) << what << ": " << e.msg();
      EXPECT_NE(e.msg().find("position 8 (positions.flatten()[2]) is outside the cache"), std::string::npos) << e.msg();
      EXPECT_EQ(e.msg().find("PositionOutsideCache"), std::string::npos) << what << ": the prefix stayed: " << e.msg();
    } catch (const std::exception& e) {
      ADD_FAILURE() << what << ": threw another type: " << e.what();
    }
  }
}

TEST(RotaryPos, GradientsReachQKAndTheCaches) {
  const auto [c0, s0] = caches(6, 8, at::kDouble);
  const at::Tensor cc = c0.clone().requires_grad_(), sc = s0.clone().requires_grad_();
  const at::Tensor q = at::randn({3, 2, 8}, at::kDouble).requires_grad_();
  const at::Tensor k = at::randn({3, 1, 8}, at::kDouble).requires_grad_();
  const at::Tensor pos = at::tensor({2, 2, 5}, at::kLong).unsqueeze(-1);  // a repeated position
  const auto [qo, ko] = rope_ext::rotary_pos_qk(q, k, cc, sc, pos);
  const auto got = torch::autograd::grad({qo.sum() + ko.square().sum()}, {q, k, cc, sc});
  const auto [c, s] = gathered(cc, sc, pos, false);
  const auto want =
      torch::autograd::grad({rope_ext::rotary(q, c, s).sum() + rope_ext::rotary(k, c, s).square().sum()}, {q, k, cc, sc});
  for (size_t i = 0; i < got.size(); ++i) expect_close(got[i], want[i], 1e-12, 1e-12, "gradient " + std::to_string(i));
}

}  // namespace
