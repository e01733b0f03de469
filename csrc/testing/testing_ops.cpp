// The registration site of librope_ext_testing.so (testing.h): test hooks into librope_ext.so,
// under torch.ops.rope_ext_testing. The product library registers none of them.
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cpu/rotary_cpu.h"
#include "rope_ext/rope.h"
#include "testing/testing.h"

namespace rope_ext::testing {
namespace {

// How many distinct threads at::parallel_for uses for n items with grain 1. Compiled with the
// library's flags (CMakeLists.txt gives both libraries the same), so it shows whether the
// kernels' parallel_for really is parallel in this build (it is serial without OpenMP).
int64_t parallel_threads_used(int64_t n) {
  TORCH_CHECK(n >= 0, "rope_ext_testing.parallel_threads_used: n must be >= 0, got ", n);
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen.fetch_or(uint64_t{1} << (at::get_thread_num() % 64)); });
  return __builtin_popcountll(seen.load());
}

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

TORCH_LIBRARY(rope_ext_testing, m) {
  // The CUDA kernels' thread function run on the CPU over the launch grid the CUDA launcher would
  // choose, with the semantics of rope_ext::rotary, rotary_qk and rotary_; and that launch:
  // [grid_x, grid_y, block_x, block_y, vec, pairs_per_item, rot_items, pass_items, table_vec, compact].
  // cuda_allow_compact_index(False) makes calls use PlanIndex where they would use
  // CompactIndex (rotary_thread.h), in emulation and launch configs; it returns the previous setting.
  m.def("cuda_emulate_rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> Tensor");
  m.def(
      "cuda_emulate_rotary_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved=False, "
      "Tensor? cos_k=None, Tensor? sin_k=None, bool conjugate=False) -> (Tensor, Tensor)");
  m.def("cuda_emulate_rotary_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> ()");
  m.def(
      "cuda_emulate_rotary_pos(Tensor x, Tensor cos_cache, Tensor sin_cache, Tensor positions, "
      "bool interleaved=False, bool conjugate=False) -> Tensor");
  m.def(
      "cuda_emulate_rotary_pos_qk(Tensor q, Tensor k, Tensor cos_cache, Tensor sin_cache, Tensor positions, "
      "bool interleaved=False, bool conjugate=False) -> (Tensor, Tensor)");
  m.def(
      "cuda_emulate_rotary_pos_(Tensor(a!) q, Tensor(b!)? k, Tensor cos_cache, Tensor sin_cache, "
      "Tensor positions, bool interleaved=False, bool conjugate=False) -> ()");
  m.def("cuda_launch_config(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> int[]");
  // rotary_qk's launches with shared tables: 10 values each, one launch where q and k share a head dim.
  m.def("cuda_qk_launch_config(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved=False) -> int[]");
  m.def(
      "cuda_pos_launch_config(Tensor q, Tensor? k, Tensor cos_cache, Tensor sin_cache, Tensor positions, "
      "bool interleaved=False) -> int[]");
  m.def("cuda_allow_compact_index(bool allow) -> bool", &allow_compact_index);
  m.def("cuda_compact_token_offsets(int t, int inner, int[] strides) -> int[]", &compact_token_offsets);
  // The emulator's alignment check and traffic model (testing.h says what each returns).
  m.def("cuda_ignore_alignment(bool ignore) -> bool", &ignore_alignment);
  m.def("cuda_checked_accesses() -> int", &checked_accesses);
  // The launches the emulated ops make, 10 values each (testing.h).
  m.def("cuda_record_launches(bool on) -> bool", &record_launches);
  m.def("cuda_launches() -> int[]", &launches);
  m.def("cuda_record_traffic(bool on) -> bool", &record_traffic);
  m.def("cuda_traffic() -> int[]", &traffic);
  m.def("cuda_traffic_by_site() -> (str[], int[])", &traffic_by_site);

  m.def("parallel_threads_used(int n) -> int", &parallel_threads_used);
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

  // The sizes at which librope_ext.so's CPU kernel changes path (cpu::Thresholds, whose defaults
  // rotary_cpu.cpp gives), in this order, and their replacement for every caller in the process
  // (checked: an error names the value out of range). Tests lower them so that small tensors take
  // the paths that otherwise only large ones reach, and read how often each path ran
  // (cpu::PathCounts, in order).
  m.def("cpu_thresholds() -> int[]", []() -> std::vector<int64_t> {
    const cpu::Thresholds t = cpu::thresholds();
    return {t.streaming_bytes, t.huge_page_bytes, t.grain_elements, t.tile_tokens, t.min_heads_per_thread};
  });
  m.def(
      "set_cpu_thresholds(int streaming_bytes, int huge_page_bytes, int grain_elements, int tile_tokens, "
      "int min_heads_per_thread) -> ()",
      [](int64_t streaming, int64_t huge, int64_t grain, int64_t tile, int64_t min_heads) {
        cpu::set_thresholds({streaming, huge, grain, tile, min_heads});
      });
  m.def("cpu_path_counts() -> int[]", []() -> std::vector<int64_t> {
    const cpu::PathCounts& c = cpu::path_counts();
    return {c.streamed_rows.load(), c.huge_page_outputs.load(), c.head_split_walks.load(),
            c.token_split_walks.load(), c.rows[cpu::kFastRows].load(), c.rows[cpu::kGeneralRows].load(),
            c.native_bf16_calls.load(), c.wide_fast_rows.load()};
  });
  // Whether the CPU kernel may round bfloat16 with AVX512-BF16 where the CPU has it (the AVX512_BF16
  // variant); False forces the AVX512 variant's integer rounding. Returns the previous setting.
  m.def("cpu_allow_native_bf16(bool allow) -> bool", &cpu::allow_native_bf16);
  // The widest row, in vector steps, that this build's fast path unrolls (cpu::kUnrolledSteps: 8, or
  // what the sanitize build lowered it to).
  m.def("cpu_unrolled_steps() -> int", []() -> int64_t { return cpu::kUnrolledSteps; });
  // Whether this CPU and build have the AVX512_BF16 variant (AVX512 kernel and cpuid's avx512bf16).
  m.def("cpu_native_bf16_available() -> bool", &cpu::native_bf16_available);
}

TORCH_LIBRARY_IMPL(rope_ext_testing, CPU, m) { register_cuda_emulation(m); }

}  // namespace
}  // namespace rope_ext::testing
