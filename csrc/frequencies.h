// The kernels of the private ops behind rope_ext's frequency and table helpers (frequencies.cpp),
// for the one registration site (ops.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>
#include <vector>

namespace rope_ext {

// cos_sin_tables without the value check on positions (see the C++ API's cos_sin_tables).
std::tuple<at::Tensor, at::Tensor> cos_sin_tables_impl(const at::Tensor& positions, const at::Tensor& inv_freq,
                                                       bool interleaved, double scale,
                                                       std::optional<at::ScalarType> dtype);

// rope_frequencies with the configuration as op arguments:
// (inv_freq, inv_freq_long (empty unless longrope), attention_factor, switch_len, factor).
std::tuple<at::Tensor, at::Tensor, double, int64_t, double> rope_frequencies_op(
    c10::string_view rope_type, double base, int64_t rotary_dim, int64_t max_position_embeddings,
    std::optional<double> factor, std::optional<int64_t> original_max_position_embeddings,
    std::optional<double> attention_factor, std::optional<double> beta_fast, std::optional<double> beta_slow,
    std::optional<double> mscale, std::optional<double> mscale_all_dim, bool truncate,
    std::optional<double> low_freq_factor, std::optional<double> high_freq_factor,
    c10::ArrayRef<double> short_factor, c10::ArrayRef<double> long_factor,
    std::optional<double> partial_rotary_factor);

}  // namespace rope_ext
