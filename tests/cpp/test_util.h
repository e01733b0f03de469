// Shared helpers of the C++ API tests: an independent float64 rotary reference (a loop over
// pairs), a differentiable one (index_select with a sign vector), tolerance checks, and a
// c10::Error matcher.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace rope_test {

// Column pairs (a, b) of a rotary dim r: (i, i + r/2) half-split, (2i, 2i + 1) interleaved.
inline std::pair<int64_t, int64_t> pair_of(int64_t i, int64_t r, bool interleaved) {
  return interleaved ? std::pair{2 * i, 2 * i + 1} : std::pair{i, i + r / 2};
}

// Full-form (cos, sin) tables of shape angles.shape[:-1] + (2 * angles.size(-1),) from per-pair
// angles, built by assigning each angle to both columns of its pair.
inline std::pair<at::Tensor, at::Tensor> tables_from_angles(const at::Tensor& angles, bool interleaved) {
  const int64_t half = angles.size(-1), r = 2 * half;
  std::vector<int64_t> shape(angles.sizes().begin(), angles.sizes().end());
  shape.back() = r;
  at::Tensor full = at::empty(shape, angles.options());
  for (int64_t i = 0; i < half; ++i) {
    const auto [a, b] = pair_of(i, r, interleaved);
    full.select(-1, a).copy_(angles.select(-1, i));
    full.select(-1, b).copy_(angles.select(-1, i));
  }
  return {full.cos(), full.sin()};
}

struct Reference {
  at::Tensor out;        // float64 rotary(x, cos, sin)
  at::Tensor magnitude;  // |x_a c| + |x_b s| of each output's two products (|x| on pass-through)
};

// rotary in float64 by a plain loop over rows and pairs, from the per-pair 2x2 matrix:
// forward [[c_a, -s_a], [s_b, c_b]], conjugate its transpose [[c_a, s_b], [-s_a, c_b]].
inline Reference reference_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                  bool interleaved, bool conjugate) {
  const int64_t d = x.size(-1), r = cos.size(-1);
  std::vector<int64_t> table_shape(x.sizes().begin(), x.sizes().end());
  table_shape.back() = r;
  const at::Tensor xs = x.to(at::kDouble).contiguous();
  const at::Tensor cs = cos.to(at::kDouble).expand(table_shape).contiguous();
  const at::Tensor ss = sin.to(at::kDouble).expand(table_shape).contiguous();
  at::Tensor out = xs.clone(), mag = xs.abs();
  const double *X = xs.data_ptr<double>(), *C = cs.data_ptr<double>(), *S = ss.data_ptr<double>();
  double *O = out.data_ptr<double>(), *M = mag.data_ptr<double>();
  const int64_t rows = d ? xs.numel() / d : 0;
  for (int64_t row = 0; row < rows; ++row) {
    const double *xr = X + row * d, *c = C + row * r, *s = S + row * r;
    double *o = O + row * d, *m = M + row * d;
    for (int64_t i = 0; i < r / 2; ++i) {
      const auto [a, b] = pair_of(i, r, interleaved);
      const double xa = xr[a], xb = xr[b];
      if (!conjugate) {
        o[a] = xa * c[a] - xb * s[a];
        o[b] = xa * s[b] + xb * c[b];
        m[a] = std::abs(xa * c[a]) + std::abs(xb * s[a]);
        m[b] = std::abs(xa * s[b]) + std::abs(xb * c[b]);
      } else {
        o[a] = xa * c[a] + xb * s[b];
        o[b] = -xa * s[a] + xb * c[b];
        m[a] = std::abs(xa * c[a]) + std::abs(xb * s[b]);
        m[b] = std::abs(xa * s[a]) + std::abs(xb * c[b]);
      }
    }
  }
  return {out, mag};
}

// R(v) over v's last dim r, as a gather with signs: R(v)[j] = sign[j] * v[perm[j]]. Differentiable.
inline at::Tensor rotate_by_gather(const at::Tensor& v, bool interleaved) {
  const int64_t r = v.size(-1);
  std::vector<int64_t> perm(r);
  std::vector<double> sign(r);
  for (int64_t i = 0; i < r / 2; ++i) {
    const auto [a, b] = pair_of(i, r, interleaved);
    perm[a] = b, sign[a] = -1.0;  // R(v)[a] = -v[b]
    perm[b] = a, sign[b] = 1.0;   // R(v)[b] = v[a]
  }
  const at::Tensor index = at::tensor(perm, at::kLong);
  const at::Tensor signs = at::tensor(sign, v.options().requires_grad(false));
  return v.index_select(-1, index) * signs;
}

// rotary with differentiable ATen ops (float64 in, float64 out): x c + R(x) s, and for conjugate
// the transpose x c - R(x s) (R^T = -R).
inline at::Tensor reference_rotary_autograd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                            bool interleaved, bool conjugate) {
  const int64_t r = cos.size(-1);
  const at::Tensor xr = x.narrow(-1, 0, r), pass = x.narrow(-1, r, x.size(-1) - r);
  const at::Tensor rot = conjugate ? xr * cos - rotate_by_gather(xr * sin, interleaved)
                                   : xr * cos + rotate_by_gather(xr, interleaved) * sin;
  std::vector<int64_t> pass_shape(rot.sizes().begin(), rot.sizes().end());
  pass_shape.back() = pass.size(-1);
  return at::cat({rot, pass.expand(pass_shape)}, -1);
}

// Every element of `out` within `rel * magnitude + atol` of the float64 reference.
inline void expect_within(const at::Tensor& out, const Reference& ref, double rel, double atol,
                          const std::string& what) {
  ASSERT_EQ(out.sizes(), ref.out.sizes()) << what;
  const at::Tensor err = (out.to(at::kDouble) - ref.out).abs();
  const at::Tensor bound = ref.magnitude * rel + atol;
  const at::Tensor bad = (err <= bound).logical_not();  // NaN counts as out of tolerance
  EXPECT_FALSE(bad.any().item<bool>()) << what << ": " << bad.sum().item<int64_t>() << " of " << out.numel()
                                       << " elements out of tolerance; max error " << err.max().item<double>()
                                       << ", max error / bound " << (err / bound).max().item<double>();
}

inline void expect_close(const at::Tensor& a, const at::Tensor& b, double rtol, double atol,
                         const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const at::Tensor err = (a.to(at::kDouble) - b.to(at::kDouble)).abs();
  const at::Tensor bound = b.to(at::kDouble).abs() * rtol + atol;
  EXPECT_TRUE((err <= bound).all().item<bool>())
      << what << ": max error " << err.max().item<double>() << ", max error / bound "
      << (err / bound).max().item<double>();
}

// Bitwise equality (same dtype, shape and bits; NaN-free inputs assumed).
inline void expect_bitwise_equal(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.scalar_type(), b.scalar_type()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  EXPECT_TRUE(at::equal(a, b)) << what << ": max difference "
                               << (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// Runs fn, expects a c10::Error whose message contains `needle`; prints the message either way.
inline void expect_error(const std::function<void()>& fn, const std::string& needle, const std::string& what) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string msg = e.msg();
    if (std::getenv("ROPE_TEST_PRINT_ERRORS")) std::cout << "[" << what << "] " << msg << "\n";
    EXPECT_NE(msg.find(needle), std::string::npos)
        << what << ": message does not contain \"" << needle << "\":\n  " << msg;
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": threw a non-c10::Error: " << e.what();
    return;
  }
  ADD_FAILURE() << what << ": did not throw (expected \"" << needle << "\")";
}

}  // namespace rope_test
