// The registration site of librope_ext_testing.so (testing.h): test hooks into librope_ext.so,
// under torch.ops.rope_ext_testing. The product library registers none of them. On the stable ABI,
// as the product is, so that one build of both runs the core tests under every torch (make
// wheel-check).
#include <torch/csrc/stable/library.h>

#include <atomic>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cpu/rotary_cpu.h"
#include "qk_norm_schemas.h"
#include "tensor_arg.h"
#include "testing/testing.h"

namespace rope_ext::testing {
namespace {

// How many distinct threads the CPU kernels' thread pool (librope_ext.so's cpu::torch_pool(), torch's
// pool through the stable ABI) uses for n items with grain 1: whether the kernels' parallel_for
// really is parallel.
int64_t parallel_threads_used(int64_t n) {
  ROPE_EXT_CHECK(n >= 0, "rope_ext_testing.parallel_threads_used: n must be >= 0, got ", n);
  std::mutex mutex;
  std::set<std::thread::id> seen;
  const auto body = [&](int64_t, int64_t) {
    const std::lock_guard<std::mutex> lock(mutex);
    seen.insert(std::this_thread::get_id());
  };
  using Body = decltype(body);
  cpu::torch_pool().parallel_for(0, n, 1, &body, [](const void* f, int64_t b, int64_t e) {
    (*static_cast<const Body*>(f))(b, e);
  });
  return static_cast<int64_t>(seen.size());
}

// The CPU kernels' thread pool running n items with grain 1, where the chunk holding item 0 throws: its
// message must reach the caller intact (rotary_cpu.cpp's torch_parallel_for), not as the stable
// interface's bare error code.
void parallel_for_raise(int64_t n) {
  ROPE_EXT_CHECK(n >= 1, "rope_ext_testing.parallel_for_raise: n must be >= 1, got ", n);
  const auto body = [](int64_t b, int64_t) {
    if (b == 0) throw std::runtime_error("rope_ext_testing.parallel_for_raise: the chunk at item 0 raised");
  };
  using Body = decltype(body);
  cpu::torch_pool().parallel_for(0, n, 1, &body, [](const void* f, int64_t b, int64_t e) {
    (*static_cast<const Body*>(f))(b, e);
  });
}

std::vector<int64_t> cpu_thresholds() {
  const cpu::Thresholds t = cpu::thresholds();
  return {t.streaming_bytes, t.huge_page_bytes, t.grain_elements, t.tile_tokens, t.min_heads_per_thread};
}

void set_cpu_thresholds(int64_t streaming, int64_t huge, int64_t grain, int64_t tile, int64_t min_heads) {
  cpu::set_thresholds({streaming, huge, grain, tile, min_heads});
}

std::vector<int64_t> cpu_path_counts() {
  const cpu::PathCounts& c = cpu::path_counts();
  return {c.streamed_rows.load(), c.huge_page_outputs.load(), c.head_split_walks.load(),
          c.token_split_walks.load(), c.rows[cpu::kFastRows].load(), c.rows[cpu::kGeneralRows].load(),
          c.native_bf16_calls.load(), c.wide_fast_rows.load(), c.norm_rows.load()};
}

int64_t cpu_unrolled_steps() { return cpu::kUnrolledSteps; }

STABLE_TORCH_LIBRARY(rope_ext_testing, m) {
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
  // qk_norm_rotary's kernels (cuda/qk_norm_thread.h) emulated the same way, with the product ops' schemas.
  for (const OpSchema& schema : kQkNormSchemas) {
    m.def((std::string("cuda_emulate_") + schema.name + schema.signature).c_str());
  }
  // qk_norm_rotary's launch for x, 12 values (host_emulation.cpp's norm_launch_config names them).
  m.def(
      "cuda_norm_launch_config(Tensor x, Tensor? weight, Tensor cos, Tensor sin, Tensor? positions, "
      "bool across_heads=False, bool interleaved=False, bool backward=False) -> int[]");
  m.def("cuda_launch_config(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> int[]");
  // rotary_qk's launches with shared tables: 10 values each, one launch where q and k share a head dim.
  m.def("cuda_qk_launch_config(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved=False) -> int[]");
  m.def(
      "cuda_pos_launch_config(Tensor q, Tensor? k, Tensor cos_cache, Tensor sin_cache, Tensor positions, "
      "bool interleaved=False) -> int[]");
  m.def("cuda_allow_compact_index(bool allow) -> bool");
  m.def("cuda_compact_token_offsets(int t, int inner, int[] strides) -> int[]");
  // The emulator's alignment check and traffic model (testing.h says what each returns).
  m.def("cuda_ignore_alignment(bool ignore) -> bool");
  m.def("cuda_checked_accesses() -> int");
  // The launches the emulated ops make, 10 values each (testing.h).
  m.def("cuda_record_launches(bool on) -> bool");
  m.def("cuda_launches() -> int[]");
  m.def("cuda_record_traffic(bool on) -> bool");
  m.def("cuda_traffic() -> int[]");
  m.def("cuda_traffic_by_site() -> (str[], int[])");

  m.def("parallel_threads_used(int n) -> int");
  m.def("parallel_for_raise(int n) -> ()");
  // The sizes at which librope_ext.so's CPU kernel changes path (cpu::Thresholds, whose defaults
  // rotary_cpu.cpp gives), in this order, and their replacement for every caller in the process
  // (checked: an error names the value out of range). Tests lower them so that small tensors take
  // the paths that otherwise only large ones reach, and read how often each path ran
  // (cpu::PathCounts, in order).
  m.def("cpu_thresholds() -> int[]");
  m.def(
      "set_cpu_thresholds(int streaming_bytes, int huge_page_bytes, int grain_elements, int tile_tokens, "
      "int min_heads_per_thread) -> ()");
  m.def("cpu_path_counts() -> int[]");
  // Whether the CPU kernel may round bfloat16 with AVX512-BF16 where the CPU has it (the AVX512_BF16
  // variant); False forces the AVX512 variant's integer rounding. Returns the previous setting.
  m.def("cpu_allow_native_bf16(bool allow) -> bool");
  // The widest row, in vector steps, that this build's fast path unrolls (cpu::kUnrolledSteps: 8, or
  // what the sanitize build lowered it to).
  m.def("cpu_unrolled_steps() -> int");
  // Whether this CPU and build have the AVX512_BF16 variant (AVX512 kernel and cpuid's avx512bf16).
  m.def("cpu_native_bf16_available() -> bool");
}

// The hooks without tensor arguments (the emulated ops' CPU kernels are host_emulation.cpp's).
STABLE_TORCH_LIBRARY_IMPL(rope_ext_testing, CompositeExplicitAutograd, m) {
  m.impl("cuda_allow_compact_index", TORCH_BOX(&allow_compact_index));
  m.impl("cuda_compact_token_offsets", TORCH_BOX(&compact_token_offsets));
  m.impl("cuda_ignore_alignment", TORCH_BOX(&ignore_alignment));
  m.impl("cuda_checked_accesses", TORCH_BOX(&checked_accesses));
  m.impl("cuda_record_launches", TORCH_BOX(&record_launches));
  m.impl("cuda_launches", TORCH_BOX(&launches));
  m.impl("cuda_record_traffic", TORCH_BOX(&record_traffic));
  m.impl("cuda_traffic", TORCH_BOX(&traffic));
  m.impl("cuda_traffic_by_site", TORCH_BOX(&traffic_by_site));
  m.impl("parallel_threads_used", TORCH_BOX(&parallel_threads_used));
  m.impl("parallel_for_raise", TORCH_BOX(&parallel_for_raise));
  m.impl("cpu_allow_native_bf16", TORCH_BOX(&cpu::allow_native_bf16));
  m.impl("cpu_native_bf16_available", TORCH_BOX(&cpu::native_bf16_available));
  m.impl("cpu_thresholds", TORCH_BOX(&cpu_thresholds));
  m.impl("set_cpu_thresholds", TORCH_BOX(&set_cpu_thresholds));
  m.impl("cpu_path_counts", TORCH_BOX(&cpu_path_counts));
  m.impl("cpu_unrolled_steps", TORCH_BOX(&cpu_unrolled_steps));
}

}  // namespace
}  // namespace rope_ext::testing
