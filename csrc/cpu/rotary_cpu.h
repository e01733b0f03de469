// CPU entry points of rope_ext. The kernel body exists once per CPU capability (see
// rotary_kernel.h); rotary_cpu.cpp chooses between them at run time.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "internal_api.h"
#include "rotary_plan.h"

namespace rope_ext::cpu {

// The sizes at which the CPU kernel changes path. The defaults (rotary_cpu.cpp) are what every
// user gets; tests lower or raise them through rope_ext_testing::set_cpu_thresholds (csrc/testing/), so
// that both sides of each switch run on small tensors (issue 16: a path that only tensors of
// 16 MiB took crashed, and no test had reached it).
struct Thresholds {
  int64_t streaming_bytes;       // outputs of at least this many bytes: streaming stores
  int64_t huge_page_bytes;       // new outputs of at least this many bytes: MADV_HUGEPAGE
  int64_t grain_elements;        // elements per parallel task (below it: the calling thread only)
  int64_t tile_tokens;           // tokens per tile in head-major storage
  int64_t min_heads_per_thread;  // head-major: threads split the heads if each gets this many
};

// The thresholds in force, and their replacement for the whole process (set_thresholds checks
// each value and refuses the lot if one is out of range).
ROPE_EXT_INTERNAL Thresholds thresholds();
ROPE_EXT_INTERNAL void set_thresholds(const Thresholds& t);

// How often each side of the switches above was taken since the library loaded, so that tests can
// show a path ran rather than assume it. Counted once per call or per parallel chunk (relaxed
// atomic adds), never per element.
struct PathCounts {
  std::atomic<int64_t> streamed_rows{0};        // rows written with streaming stores
  std::atomic<int64_t> huge_page_outputs{0};    // new outputs of at least huge_page_bytes
  std::atomic<int64_t> head_split_walks{0};     // head-major calls whose threads split the heads
  std::atomic<int64_t> token_split_walks{0};    // head-major calls whose threads split the tokens
  // Rows rotated by the contiguous-row fast path (FastRows) and by the general one
  // (rotate_row, per row), indexed by RowPath; added once per parallel chunk.
  std::atomic<int64_t> rows[2] = {0, 0};
  // Of the fast path's rows, those too wide for its unrolled blocks, rotated by the row loop
  std::atomic<int64_t> wide_fast_rows{0};
  std::atomic<int64_t> native_bf16_calls{0};    // calls run by the AVX512_BF16 variant
  std::atomic<int64_t> norm_rows{0};            // QK-norm forward rows run by the row path (norm_forward_rows)
};
enum RowPath { kFastRows = 0, kGeneralRows = 1 };
ROPE_EXT_INTERNAL PathCounts& path_counts();

// The widest row, in vector steps, that the fast path's unrolled blocks take (rotate_block_rows in
// rotary_kernel.h: rotary_dim 256 on AVX2 and DEFAULT, 512 on AVX-512, for float and 16-bit x); wider
// rows take the row loop. 8 in every build users get. The CMake option ROPE_EXT_UNROLLED_STEPS lowers
// it for the sanitize build alone (tools/sanitize.sh): GCC with ASan spent 16 minutes on each AVX-512
// kernel file at 8 (one instantiation per step count, each unrolled), and every side of the switch
// (held tables, held and read, the row loop) is still reached on every ISA at 5.
#ifndef ROPE_EXT_UNROLLED_STEPS
#define ROPE_EXT_UNROLLED_STEPS 8
#endif
constexpr int kUnrolledSteps = ROPE_EXT_UNROLLED_STEPS;
static_assert(1 <= kUnrolledSteps && kUnrolledSteps <= 8, "ROPE_EXT_UNROLLED_STEPS must be 1 to 8");

// What a kernel object is given: raw pointers and the element type, never a torch type, and torch's
// thread pool as two function pointers. The kernel objects (rotary_kernel_*.cpp) then call no
// libtorch function: their only undefined symbols are the C++ runtime's and this library's own,
// which the build checks with nm (cmake/check_kernel_symbols.cmake). That is what lets them
// be linked unchanged into a library built on torch's stable ABI, which allows no ATen or c10 call
// (issue 37); at::vec's inline code, compiled into them, is no call.
enum class KernelDtype : int { kFloat, kDouble, kHalf, kBFloat16 };
struct KernelOperands {
  const void* x;
  void* out;  // x's sizes; may be x itself (in place)
  const void* cos;
  const void* sin;
  const void* positions;  // int32 or int64 (RotaryPlan::positions_int32), or nullptr
  KernelDtype dtype;      // of x and out
  bool float_tables;      // cos and sin in float32 rather than in x's dtype
  int64_t out_numel;
};
// body(begin, end) over [begin, end) in chunks of at least `grain`, as at::parallel_for.
using ChunkFn = void (*)(const void* body, int64_t begin, int64_t end);
struct ThreadPool {
  void (*parallel_for)(int64_t begin, int64_t end, int64_t grain, const void* body, ChunkFn chunk);
  int (*num_threads)();
};
// torch's pool, through the stable ABI (torch::stable::parallel_for): the one the kernels are given.
ROPE_EXT_INTERNAL const ThreadPool& torch_pool();

// What the QK-norm kernel (qk_norm_kernel.h) is given, beside its NormPlan.
struct NormOperands {
  const void* x;
  void* out;  // the forward's output, or the backward's dx
  const void* cos;
  const void* sin;
  const void* positions;  // gathered tables (NormPlan::gathered): int32 or int64; else nullptr
  const void* weight;  // nullptr: no weight
  bool float_weight;   // weight in float32 rather than in x's dtype
  double weight_offset;
  double eps;
  void* rstd;          // the statistics (the compute dtype): written by the forward (unless null), read by the backward
  const void* grad;    // the backward's dy, or nullptr (the forward)
  void* dweight;       // the backward's weight gradient (the compute dtype), or nullptr
  KernelDtype dtype;   // of x, out, grad
  bool float_tables;
  bool weight_after;   // g applied after the rotation (NormCall::weight_after)
  const void* bias;    // nullptr: no bias
  bool float_bias;     // bias in float32 rather than in x's dtype
  void* dbias;         // the backward's bias gradient (the compute dtype), or nullptr
  bool centered;       // LayerNorm: the mean subtracted; rstd holds (mean, rstd) pairs
};

#define ROPE_EXT_DECLARE_KERNEL(CAP)                                                           \
  namespace CAP {                                                                              \
  void rotary_kernel(const RotaryPlan& p, const KernelOperands& o, bool interleaved, bool conjugate, \
                     const Thresholds& thresholds, const ThreadPool& pool);                       \
  void qk_norm_kernel(const NormPlan& p, const NormOperands& o, bool interleaved, bool backward,  \
                      const Thresholds& thresholds, const ThreadPool& pool);                      \
  }
ROPE_EXT_DECLARE_KERNEL(DEFAULT)
#ifdef ROPE_EXT_HAVE_AVX
ROPE_EXT_DECLARE_KERNEL(AVX2)
ROPE_EXT_DECLARE_KERNEL(AVX512)
ROPE_EXT_DECLARE_KERNEL(AVX512_BF16)
#endif
#undef ROPE_EXT_DECLARE_KERNEL

// The kernel variant this process runs: "AVX512", "AVX2" or "DEFAULT". It follows
// torch's choice of its own CPU kernels (rotary_cpu.cpp's choose_variant(), made as
// at::get_cpu_capability() makes it), so ATEN_CPU_CAPABILITY=default|avx2 selects a lower one.
std::string kernel_isa();

// Where kernel_isa() is "AVX512" and cpuid reports AVX512-BF16, calls run the AVX512_BF16 variant
// (the same kernel, bfloat16 rounded by vcvtne2ps2bf16) unless native bfloat16 has been switched off
// (tests do, to reach the fallback). native_bf16_available(): the CPU and the build have it.
// allow_native_bf16 returns the previous setting.
ROPE_EXT_INTERNAL bool native_bf16_available();
ROPE_EXT_INTERNAL bool allow_native_bf16(bool allow);

// What `call` describes, on the CPU, for checked arguments; the ops are RotaryOps<&run>
// (rotary_ops.h). With positions, every one is checked against the cache before anything runs.
void run(const RotaryCall& call);
// What `call` describes (qk_norm_rotary's forward or backward), on the CPU, for checked arguments.
void run_norm(const NormCall& call);

}  // namespace rope_ext::cpu
