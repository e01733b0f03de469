// Backward (and double backward) of rope_ext::rotary and rotary_qk through torch::autograd::grad,
// against the analytic gradients and against autograd through a differentiable float64 reference.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <rope_ext/rope.h>
#include <torch/autograd.h>

#include <string>
#include <vector>

#include "test_util.h"

using at::Tensor;
using rope_test::expect_bitwise_equal;
using rope_test::expect_close;
using rope_test::expect_error;
using rope_test::reference_rotary_autograd;
using rope_test::rotate_by_gather;
using rope_test::tables_from_angles;

namespace {

constexpr int64_t B = 2, H = 3, S = 4, D = 20, R = 12;
constexpr double kTol = 1e-12;  // float64 throughout

Tensor leaf(const Tensor& t) { return t.detach().clone().set_requires_grad(true); }

std::string label(bool interleaved, bool conjugate) {
  return std::string(interleaved ? "interleaved" : "half-split") + (conjugate ? ", conjugate" : "");
}

std::vector<Tensor> grads(const Tensor& loss, const std::vector<Tensor>& inputs, bool create_graph = false) {
  return torch::autograd::grad({loss}, inputs, /*grad_outputs=*/{}, /*retain_graph=*/std::nullopt, create_graph);
}

class RotaryBackward : public ::testing::Test {
 protected:
  void SetUp() override { at::manual_seed(42); }
};

// d/dx sum(rotary(x) * g) is the transposed map applied to g: rotary(g, conjugate = !conjugate).
TEST_F(RotaryBackward, DxIsConjugateRotary) {
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kDouble}) {
    const Tensor x = leaf(at::randn({B, H, S, D}).to(dtype));
    const Tensor g = at::randn({B, H, S, D}).to(dtype);
    for (const bool interleaved : {false, true}) {
      auto [cos, sin] = tables_from_angles(at::rand({S, R / 2}, at::kDouble) * 8, interleaved);
      cos = cos.to(dtype == at::kDouble ? at::kDouble : at::kFloat), sin = sin.to(cos.scalar_type());
      for (const bool conjugate : {false, true}) {
        const std::string where = std::string(c10::toString(dtype)) + " " + label(interleaved, conjugate);
        const Tensor loss = (rope_ext::rotary(x, cos, sin, interleaved, conjugate) * g).sum();
        const Tensor dx = grads(loss, {x})[0];
        expect_bitwise_equal(dx, rope_ext::rotary(g, cos, sin, interleaved, !conjugate), where);
      }
    }
  }
}

// dcos = g * x and dsin = g * R(x) (conjugate: R(g) * x) on the rotary columns, summed over the
// dims along which the (S, r) tables broadcast.
TEST_F(RotaryBackward, TableGradsAnalytic) {
  const Tensor x = at::randn({B, H, S, D}, at::kDouble);
  const Tensor g = at::randn({B, H, S, D}, at::kDouble);
  const Tensor xr = x.narrow(-1, 0, R), gr = g.narrow(-1, 0, R);
  for (const bool interleaved : {false, true}) {
    const auto [c0, s0] = tables_from_angles(at::rand({S, R / 2}, at::kDouble) * 8, interleaved);
    for (const bool conjugate : {false, true}) {
      const std::string where = label(interleaved, conjugate);
      const Tensor cos = leaf(c0), sin = leaf(s0);
      const Tensor loss = (rope_ext::rotary(x, cos, sin, interleaved, conjugate) * g).sum();
      const auto d = grads(loss, {cos, sin});
      const Tensor dcos = (gr * xr).sum({0, 1});
      const Tensor dsin =
          (conjugate ? rotate_by_gather(gr, interleaved) * xr : gr * rotate_by_gather(xr, interleaved)).sum({0, 1});
      expect_close(d[0], dcos, kTol, kTol, where + ": dcos");
      expect_close(d[1], dsin, kTol, kTol, where + ": dsin");
    }
  }
}

// All first derivatives against autograd through the reference, for several table shapes.
TEST_F(RotaryBackward, MatchesReferenceAutograd) {
  const std::vector<std::vector<int64_t>> table_shapes = {{S, R / 2}, {B, 1, S, R / 2}, {R / 2}, {H, 1, R / 2}};
  for (const auto& shape : table_shapes) {
    for (const bool interleaved : {false, true}) {
      const auto [c0, s0] = tables_from_angles(at::rand(shape, at::kDouble) * 8, interleaved);
      for (const bool conjugate : {false, true}) {
        const std::string where = label(interleaved, conjugate) + ", tables " + c10::str(c0.sizes());
        const Tensor x = leaf(at::randn({B, H, S, D}, at::kDouble)), cos = leaf(c0), sin = leaf(s0);
        const Tensor g = at::randn({B, H, S, D}, at::kDouble);
        const auto got = grads((rope_ext::rotary(x, cos, sin, interleaved, conjugate) * g).sum(), {x, cos, sin});
        const auto want =
            grads((reference_rotary_autograd(x, cos, sin, interleaved, conjugate) * g).sum(), {x, cos, sin});
        const char* names[] = {"dx", "dcos", "dsin"};
        for (int i = 0; i < 3; ++i) expect_close(got[i], want[i], kTol, kTol, where + ": " + names[i]);
      }
    }
  }
}

// Double backward: the first derivatives built with create_graph, then the gradient of
// <dx, v1> + <dcos, v2> + <dsin, v3> with respect to x, cos, sin and g.
TEST_F(RotaryBackward, DoubleBackwardMatchesReference) {
  for (const bool interleaved : {false, true}) {
    const auto [c0, s0] = tables_from_angles(at::rand({S, R / 2}, at::kDouble) * 8, interleaved);
    for (const bool conjugate : {false, true}) {
      const std::string where = label(interleaved, conjugate);
      const Tensor x = leaf(at::randn({B, H, S, D}, at::kDouble)), cos = leaf(c0), sin = leaf(s0);
      const Tensor g = leaf(at::randn({B, H, S, D}, at::kDouble));
      const Tensor v1 = at::randn_like(x), v2 = at::randn_like(c0), v3 = at::randn_like(s0);
      const auto second = [&](auto&& fn) {
        const auto d = grads((fn(x, cos, sin, interleaved, conjugate) * g).sum(), {x, cos, sin}, true);
        const Tensor s = (d[0] * v1).sum() + (d[1] * v2).sum() + (d[2] * v3).sum();
        return grads(s, {x, cos, sin, g});
      };
      const auto got = second([](auto&&... a) { return rope_ext::rotary(a...); });
      const auto want = second([](auto&&... a) { return reference_rotary_autograd(a...); });
      const char* names[] = {"d/dx", "d/dcos", "d/dsin", "d/dg"};
      for (int i = 0; i < 4; ++i) expect_close(got[i], want[i], kTol, kTol, where + ": " + names[i]);
    }
  }
}

// With only cos requiring grad: d/dcos <dx, v> where dx = rotary(g, conjugate = !conjugate).
TEST_F(RotaryBackward, SecondDerivativeThroughDxOnly) {
  const auto [c0, s0] = tables_from_angles(at::rand({S, R / 2}, at::kDouble) * 8, false);
  const Tensor x = leaf(at::randn({B, H, S, D}, at::kDouble)), cos = leaf(c0);
  const Tensor g = at::randn({B, H, S, D}, at::kDouble), v = at::randn_like(g);
  const Tensor dx = grads((rope_ext::rotary(x, cos, s0) * g).sum(), {x}, true)[0];
  const Tensor got = grads((dx * v).sum(), {cos})[0];
  // <rotary(g, conj), v> = <g c - R(g s), v> on the rotary columns: d/dc = sum of g * v.
  const Tensor want = (g.narrow(-1, 0, R) * v.narrow(-1, 0, R)).sum({0, 1});
  expect_close(got, want, kTol, kTol, "d/dcos <dx, v>");
}

// Low-precision x with float32 tables: each gradient in its input's dtype.
TEST_F(RotaryBackward, GradDtypes) {
  const Tensor x = leaf(at::randn({B, H, S, D}).to(at::kBFloat16));
  const auto [c0, s0] = tables_from_angles(at::rand({S, R / 2}, at::kDouble) * 8, false);
  const Tensor cos = leaf(c0.to(at::kFloat)), sin = leaf(s0.to(at::kFloat));
  const auto d = grads(rope_ext::rotary(x, cos, sin).to(at::kFloat).square().sum(), {x, cos, sin});
  EXPECT_EQ(d[0].scalar_type(), at::kBFloat16);
  EXPECT_EQ(d[1].scalar_type(), at::kFloat);
  EXPECT_EQ(d[2].scalar_type(), at::kFloat);
  EXPECT_EQ(d[1].sizes(), cos.sizes());
}

// rotary_qk: GQA with shared tables (the k contribution adds into dcos / dsin), and separate k tables.
TEST_F(RotaryBackward, RotaryQKMatchesReference) {
  for (const bool separate : {false, true}) {
    for (const bool interleaved : {false, true}) {
      const auto [c0, s0] = tables_from_angles(at::rand({S, R / 2}, at::kDouble) * 8, interleaved);
      const auto [ck0, sk0] = tables_from_angles(at::rand({S, R / 2}, at::kDouble) * 8, interleaved);
      for (const bool conjugate : {false, true}) {
        const std::string where = std::string(separate ? "separate k tables, " : "shared tables, ") +
                                  label(interleaved, conjugate);
        const Tensor q = leaf(at::randn({B, 4, S, D}, at::kDouble));
        const Tensor k = leaf(at::randn({B, S, 2, D}, at::kDouble).transpose(1, 2));
        const Tensor cos = leaf(c0), sin = leaf(s0), cos_k = leaf(ck0), sin_k = leaf(sk0);
        const Tensor gq = at::randn({B, 4, S, D}, at::kDouble), gk = at::randn({B, 2, S, D}, at::kDouble);
        std::vector<Tensor> inputs = {q, k, cos, sin};
        if (separate) inputs.insert(inputs.end(), {cos_k, sin_k});

        const auto [q_out, k_out] =
            separate ? rope_ext::rotary_qk(q, k, cos, sin, interleaved, cos_k, sin_k, conjugate)
                     : rope_ext::rotary_qk(q, k, cos, sin, interleaved, std::nullopt, std::nullopt, conjugate);
        const auto got = grads((q_out * gq).sum() + (k_out * gk).sum(), inputs);

        const Tensor& ck = separate ? cos_k : cos;
        const Tensor& sk = separate ? sin_k : sin;
        const Tensor ref = (reference_rotary_autograd(q, cos, sin, interleaved, conjugate) * gq).sum() +
                           (reference_rotary_autograd(k, ck, sk, interleaved, conjugate) * gk).sum();
        const auto want = grads(ref, inputs);
        for (size_t i = 0; i < inputs.size(); ++i) {
          expect_close(got[i], want[i], kTol, kTol, where + ": input " + std::to_string(i));
        }
      }
    }
  }
}

TEST(RotaryInPlaceGrad, RefusesInputsThatRequireGrad) {
  const auto [c0, s0] = tables_from_angles(at::rand({S, R / 2}, at::kDouble), false);
  Tensor x = leaf(at::randn({B, H, S, D}, at::kDouble));
  expect_error([&] { rope_ext::rotary_(x, c0, s0); }, "x requires grad", "rotary_ with x requiring grad");
  Tensor y = at::randn({B, H, S, D}, at::kDouble);
  const Tensor cos = leaf(c0);
  expect_error([&] { rope_ext::rotary_(y, cos, s0); }, "cos requires grad", "rotary_ with cos requiring grad");
  // The refusal is for grad mode only: under no_grad the same call runs.
  at::NoGradGuard no_grad;
  Tensor z = x.detach().clone();
  rope_ext::rotary_(z, c0, s0);
  expect_bitwise_equal(z, rope_ext::rotary(x.detach(), c0, s0), "rotary_ under no_grad");
}

}  // namespace
