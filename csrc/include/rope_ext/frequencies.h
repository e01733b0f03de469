// The C++ API's frequency schedules (every Hugging Face rope_type) and cos/sin tables, in float64,
// included by rope_ext/rope.h (not for direct use). Header-only: written with ATen ops, compiled
// against the program's own LibTorch (the library, on torch's stable ABI, has none of them). Python's
// rope_ext.scaling and rope_ext.positions do the same float64 operations in the same order;
// tests/test_scaling.py and tests/test_module.py compare their bits through the test hooks.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace rope_ext {
namespace detail {

inline constexpr const char* kWhere = "rope_ext.rope_frequencies";

// value if set, else fallback; must be finite (and > 0 unless positive is false).
inline double number(const char* name, std::optional<double> value, std::optional<double> fallback,
              bool positive = true) {
  TORCH_CHECK(value.has_value() || fallback.has_value(), kWhere, ": scaling needs ", name);
  const double v = value.has_value() ? *value : *fallback;
  TORCH_CHECK(std::isfinite(v) && (!positive || v > 0), kWhere, ": ", name, " must be a finite ",
              positive ? "positive " : "", "number, got ", v);
  return v;
}

inline at::Tensor as_factors(const char* name, const std::vector<double>& values, int64_t half) {
  TORCH_CHECK(static_cast<int64_t>(values.size()) == half, kWhere, ": ", name,
              " must have rotary_dim/2 = ", half, " values, got ", values.size());
  for (const double v : values) {
    TORCH_CHECK(std::isfinite(v) && v > 0, kWhere, ": ", name, " must be positive numbers, got ", v);
  }
  return at::tensor(values, at::TensorOptions().dtype(at::kDouble));
}

// The exponents -2i/d, i < d/2, of theta_i = base^(-2i/d).
inline at::Tensor exponents(int64_t d, const at::TensorOptions& options) {
  return -(at::arange(0, d, 2, options) / static_cast<double>(d));
}

inline double yarn_mscale(double scale, double m = 1.0) {
  return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

// YaRN (Peng et al., 2023), as transformers computes it: a linear ramp over the dims between
// the correction dims of beta_fast and beta_slow rotations, interpolating below it and
// extrapolating above it.
inline at::Tensor yarn(const RopeScaling& s, double base, int64_t d, const at::Tensor& inv,
                double factor, int64_t original, double* attention) {
  if (s.attention_factor.has_value()) {
    *attention = number("attention_factor", s.attention_factor, std::nullopt);
  } else {
    const bool both = s.mscale.value_or(0) != 0 && s.mscale_all_dim.value_or(0) != 0;
    *attention = both ? yarn_mscale(factor, *s.mscale) / yarn_mscale(factor, *s.mscale_all_dim)
                      : yarn_mscale(factor);
    TORCH_CHECK(std::isfinite(*attention) && *attention > 0, kWhere,
                ": the attention factor from mscale and mscale_all_dim must be a finite positive number, got ",
                *attention);
  }
  const double beta_fast = number("beta_fast", s.beta_fast, 32.0);
  const double beta_slow = number("beta_slow", s.beta_slow, 1.0);
  const auto correction_dim = [&](double rotations) {
    return static_cast<double>(d) * std::log(static_cast<double>(original) / (rotations * 2 * M_PI)) /
           (2 * std::log(base));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (s.truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(d - 1));
  if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
  const at::Tensor ramp =
      ((at::arange(d / 2, inv.options()) - low) / (high - low)).clamp(0, 1);
  return (inv / factor) * ramp + inv * (1 - ramp);
}

// Llama 3.1: wavelengths longer than original / low_freq_factor are divided by factor, those
// shorter than original / high_freq_factor kept, and the ones between blended smoothly. With
// low_freq_factor == high_freq_factor there is no band between (transformers warns and computes
// the same; vLLM takes the blend weight as 0 there, as here: a wavelength of exactly
// original / low_freq_factor is divided by factor).
inline at::Tensor llama3(const RopeScaling& s, const at::Tensor& inv, double factor, int64_t original) {
  const double low = number("low_freq_factor", s.low_freq_factor, std::nullopt);
  const double high = number("high_freq_factor", s.high_freq_factor, std::nullopt);
  TORCH_CHECK(low <= high, kWhere, ": low_freq_factor (", low, ") must be <= high_freq_factor (", high, ")");
  const double orig = static_cast<double>(original);
  const at::Tensor wavelen = inv.reciprocal() * (2 * M_PI);
  const at::Tensor scaled = at::where(wavelen > orig / low, inv / factor, inv);
  const at::Tensor smooth =
      high > low ? (wavelen.reciprocal() * orig - low) / (high - low) : at::zeros_like(wavelen);
  const at::Tensor smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
  const at::Tensor medium = (wavelen >= orig / high) & (wavelen <= orig / low);
  return at::where(medium, smoothed, scaled);
}

}  // namespace detail

inline RopeFrequencies rope_frequencies(const RopeScaling& s, double base, int64_t d, int64_t max_pos) {
  const std::string& type = s.rope_type;
  TORCH_CHECK(type == "default" || type == "linear" || type == "dynamic" || type == "yarn" ||
                  type == "longrope" || type == "llama3" || type == "proportional",
              detail::kWhere, ": rope_type must be one of default, linear, dynamic, yarn, longrope, llama3, proportional, got '",
              type, "'");
  TORCH_CHECK(std::isfinite(base) && base > 0, detail::kWhere, ": base must be a finite positive number, got ", base);
  TORCH_CHECK(d > 0 && d % 2 == 0, detail::kWhere, ": rotary_dim must be a positive even int, got ", d);
  TORCH_CHECK(max_pos > 0, detail::kWhere, ": max_position_embeddings must be a positive int, got ", max_pos);
  const int64_t original = s.original_max_position_embeddings.value_or(max_pos);
  TORCH_CHECK(original > 0, detail::kWhere, ": original_max_position_embeddings must be a positive int, got ", original);

  // Config-time math, on the CPU in float64.
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(at::kCPU);
  at::Tensor inv = at::pow(base, detail::exponents(d, f64));

  RopeFrequencies out;
  out.rope_type = type;
  out.rotary_dim = d;
  out.base = base;
  out.switch_len = max_pos;
  if (type == "linear" || type == "dynamic" || type == "llama3") {
    out.factor = detail::number("factor", s.factor, std::nullopt);
    TORCH_CHECK(out.factor >= 1, detail::kWhere, ": factor must be >= 1 for rope_type '", type, "', got ", out.factor);
  }
  if (type == "linear") {
    inv = inv / out.factor;
  } else if (type == "dynamic") {
    TORCH_CHECK(d > 2, detail::kWhere, ": dynamic NTK scaling needs rotary_dim > 2");
  } else if (type == "yarn") {
    out.factor = detail::number("factor", s.factor, static_cast<double>(max_pos) / static_cast<double>(original));
    inv = detail::yarn(s, base, d, inv, out.factor, original, &out.attention_factor);
  } else if (type == "longrope") {
    const at::Tensor short_f = detail::as_factors("short_factor", s.short_factor, d / 2);
    const at::Tensor long_f = detail::as_factors("long_factor", s.long_factor, d / 2);
    out.factor = detail::number("factor", s.factor, static_cast<double>(max_pos) / static_cast<double>(original));
    const double fallback =
        out.factor <= 1 ? 1.0
                        : std::sqrt(1 + std::log(out.factor) / std::log(static_cast<double>(original)));
    out.attention_factor = detail::number("attention_factor", s.attention_factor, fallback);
    out.inv_freq_long = inv / long_f;
    inv = inv / short_f;
    out.switch_len = original;
  } else if (type == "llama3") {
    inv = detail::llama3(s, inv, out.factor, original);
  } else if (type == "proportional") {
    // transformers' Gemma 4 rule: int(p * head_dim // 2) pairs turn, at head_dim's frequencies.
    const double p = detail::number("partial_rotary_factor", s.partial_rotary_factor, 1.0, /*positive=*/false);
    TORCH_CHECK(p >= 0 && p <= 1, detail::kWhere, ": partial_rotary_factor must be in [0, 1] for rope_type 'proportional', got ",
                p);
    out.factor = detail::number("factor", s.factor, 1.0);
    const int64_t turning = static_cast<int64_t>(std::floor(p * static_cast<double>(d) / 2));
    inv = inv / out.factor;
    inv.narrow(0, turning, d / 2 - turning).zero_();
  }
  out.inv_freq = inv;
  return out;
}

// dynamic / longrope theta_i for a batch whose largest position is the 0-dim max_position.
namespace detail {
inline at::Tensor inv_freq_for_length(const at::Tensor& inv_freq, const std::optional<at::Tensor>& inv_freq_long,
                               c10::string_view rope_type, double base, int64_t rotary_dim,
                               int64_t switch_len, double factor, const at::Tensor& max_position) {
  const auto f64 = inv_freq.options().dtype(at::kDouble);
  const at::Tensor length = max_position.to(inv_freq.device(), at::kDouble) + 1;
  if (rope_type == "longrope") {
    TORCH_CHECK(inv_freq_long.has_value(), "rope_ext.inv_freq_for: longrope needs inv_freq_long");
    return at::where(length > static_cast<double>(switch_len), inv_freq_long->to(f64), inv_freq.to(f64));
  }
  TORCH_CHECK(rope_type == "dynamic", "rope_ext.inv_freq_for: only dynamic and longrope depend on the length, got '",
              rope_type, "'");
  // dynamic NTK (transformers' rule): the base grows once the length exceeds switch_len.
  const int64_t d = rotary_dim;
  const double sw = static_cast<double>(switch_len);
  const at::Tensor grown =
      base * at::pow(factor * length.clamp_min(sw) / sw - (factor - 1), static_cast<double>(d) / (d - 2));
  return at::pow(grown, exponents(d, f64));
}

}  // namespace detail

inline at::Tensor inv_freq_for(const RopeFrequencies& f, std::optional<int64_t> max_position) {
  if (!max_position.has_value() || (f.rope_type != "dynamic" && f.rope_type != "longrope")) return f.inv_freq;
  TORCH_CHECK(*max_position >= 0, "rope_ext.inv_freq_for: max_position must be >= 0, got ", *max_position);
  const std::optional<at::Tensor> long_f =
      f.inv_freq_long.defined() ? std::optional<at::Tensor>(f.inv_freq_long) : std::nullopt;
  return detail::inv_freq_for_length(f.inv_freq, long_f, f.rope_type, f.base, f.rotary_dim, f.switch_len, f.factor,
                             at::scalar_tensor(*max_position, at::TensorOptions().dtype(at::kLong)));
}

namespace detail {
// cos_sin_tables without the value check on positions.
inline std::tuple<at::Tensor, at::Tensor> cos_sin_tables_impl(const at::Tensor& positions, const at::Tensor& inv_freq,
                                                       bool interleaved, double scale,
                                                       std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(!at::isFloatingType(positions.scalar_type()) && !at::isComplexType(positions.scalar_type()) &&
                  positions.scalar_type() != at::kBool,
              "rope_ext.cos_sin_tables: positions must be an integer tensor, got ", positions.scalar_type());
  TORCH_CHECK(at::isFloatingType(inv_freq.scalar_type()) && inv_freq.dim() == 1,
              "rope_ext.cos_sin_tables: inv_freq must be a 1-D floating-point tensor (rotary_dim / 2,), got ",
              inv_freq.scalar_type(), " of shape ", inv_freq.sizes());
  const at::Tensor angles =
      positions.to(at::kDouble).unsqueeze(-1) * inv_freq.to(positions.device(), at::kDouble);
  at::Tensor cos = angles.cos() * scale, sin = angles.sin() * scale;
  if (interleaved) {
    cos = cos.repeat_interleave(2, -1), sin = sin.repeat_interleave(2, -1);
  } else {
    cos = at::cat({cos, cos}, -1), sin = at::cat({sin, sin}, -1);
  }
  const at::ScalarType out = dtype.value_or(at::kFloat);
  return {cos.to(out), sin.to(out)};
}
}  // namespace detail

inline std::tuple<at::Tensor, at::Tensor> cos_sin_tables(const at::Tensor& positions, const at::Tensor& inv_freq,
                                                  bool interleaved, double scale, at::ScalarType dtype) {
  // (The value check reads the data: a device sync.)
  const at::ScalarType t = positions.scalar_type();
  if (positions.numel() && at::isIntegralType(t, /*includeBool=*/false)) {
    const int64_t least = positions.min().item<int64_t>();
    TORCH_CHECK(least >= 0, "rope_ext.cos_sin_tables: positions must be >= 0, got a minimum of ", least);
  }
  return detail::cos_sin_tables_impl(positions, inv_freq, interleaved, scale, dtype);
}

}  // namespace rope_ext
