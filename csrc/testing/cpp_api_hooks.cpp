// librope_ext_testing_cpp_api.so: hooks that call the C++ API's header-only functions
// (rope_ext/frequencies.h through rope_ext/rope.h), so that tests compare them with their Python
// twins (rope_ext.scaling, rope_ext.positions). Unlike librope_ext_testing.so it is LibTorch code,
// built against one torch's C++ ABI as a C++ program using the API is: the tests that need it load
// it (conftest.cpp_api()), the core tests run under other torches do not.
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "rope_ext/rope.h"

namespace rope_ext::testing {
namespace {

// The C++ API's inv_freq_for (rope.h) for a schedule given field by field, so that tests can
// compare it with Python's rope_ext.scaling.RopeSchedule.inv_freq.
at::Tensor inv_freq_for(const at::Tensor& inv_freq, const std::optional<at::Tensor>& inv_freq_long,
                        const std::string& rope_type, double base, int64_t rotary_dim, int64_t switch_len,
                        double factor, int64_t max_position) {
  RopeFrequencies f;
  f.rope_type = rope_type;
  f.base = base;
  f.rotary_dim = rotary_dim;
  f.inv_freq = inv_freq;
  if (inv_freq_long.has_value()) f.inv_freq_long = *inv_freq_long;
  f.switch_len = switch_len;
  f.factor = factor;
  return rope_ext::inv_freq_for(f, max_position);
}

// The C++ API's rope_frequencies (rope.h) with the configuration as op arguments, so that tests can
// compare it with Python's rope_ext.scaling: (inv_freq, inv_freq_long (empty unless longrope),
// attention_factor, switch_len, factor).
std::tuple<at::Tensor, at::Tensor, double, int64_t, double> rope_frequencies(
    c10::string_view rope_type, double base, int64_t rotary_dim, int64_t max_position_embeddings,
    std::optional<double> factor, std::optional<int64_t> original_max_position_embeddings,
    std::optional<double> attention_factor, std::optional<double> beta_fast, std::optional<double> beta_slow,
    std::optional<double> mscale, std::optional<double> mscale_all_dim, bool truncate,
    std::optional<double> low_freq_factor, std::optional<double> high_freq_factor,
    c10::ArrayRef<double> short_factor, c10::ArrayRef<double> long_factor,
    std::optional<double> partial_rotary_factor) {
  RopeScaling s;
  s.rope_type = std::string(rope_type);
  s.factor = factor;
  s.original_max_position_embeddings = original_max_position_embeddings;
  s.attention_factor = attention_factor;
  s.beta_fast = beta_fast, s.beta_slow = beta_slow, s.mscale = mscale, s.mscale_all_dim = mscale_all_dim;
  s.truncate = truncate;
  s.low_freq_factor = low_freq_factor, s.high_freq_factor = high_freq_factor;
  s.short_factor = short_factor.vec(), s.long_factor = long_factor.vec();
  s.partial_rotary_factor = partial_rotary_factor;
  RopeFrequencies f = rope_ext::rope_frequencies(s, base, rotary_dim, max_position_embeddings);
  const at::Tensor long_f = f.inv_freq_long.defined() ? f.inv_freq_long : at::empty({0}, f.inv_freq.options());
  return {f.inv_freq, long_f, f.attention_factor, f.switch_len, f.factor};
}

TORCH_LIBRARY(rope_ext_testing_cpp_api, m) {
  m.def(
      "inv_freq_for(Tensor inv_freq, Tensor? inv_freq_long, str rope_type, float base, int rotary_dim, "
      "int switch_len, float factor, int max_position) -> Tensor",
      &inv_freq_for);
  m.def(
      "rope_frequencies(str rope_type, float base, int rotary_dim, int max_position_embeddings, "
      "float? factor=None, int? original_max_position_embeddings=None, float? attention_factor=None, "
      "float? beta_fast=None, float? beta_slow=None, float? mscale=None, float? mscale_all_dim=None, "
      "bool truncate=True, float? low_freq_factor=None, float? high_freq_factor=None, "
      "float[] short_factor=[], float[] long_factor=[], float? partial_rotary_factor=None) "
      "-> (Tensor, Tensor, float, int, float)",
      &rope_frequencies);
  // The C++ API's cos_sin_tables (rope.h), to compare with Python's rope_ext.positions.cos_sin_tables.
  m.def("cos_sin_tables(Tensor positions, Tensor inv_freq, bool interleaved, float scale, ScalarType dtype) "
        "-> (Tensor, Tensor)",
        [](const at::Tensor& positions, const at::Tensor& inv_freq, bool interleaved, double scale,
           at::ScalarType dtype) { return rope_ext::cos_sin_tables(positions, inv_freq, interleaved, scale, dtype); });
}

}  // namespace
}  // namespace rope_ext::testing
