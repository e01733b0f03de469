// The CPU glue, on torch's stable ABI: choice of kernel variant, the call into it, registration.
#include "cpu/rotary_cpu.h"
#include "registration.h"
#include "qk_norm_ops.h"
#include "rotary_ops.h"

#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace rope_ext::cpu {
namespace {

using KernelFn = decltype(&DEFAULT::rotary_kernel);
using NormKernelFn = decltype(&DEFAULT::qk_norm_kernel);

// One capability's kernels.
struct Variant {
  KernelFn fn;
  NormKernelFn norm;
  const char* name;
};

// The variant torch would choose for its own CPU kernels (at::get_cpu_capability(), which a
// stable-ABI library cannot call), chosen the same way: ATEN_CPU_CAPABILITY=avx512|avx2|default if set
// to one of those (taken as given, as torch does, even above what the CPU has), otherwise the best
// this CPU runs: AVX512 with AVX512VL, BW, DQ and FMA, AVX2 with FMA. (GCC's cpuid reading also checks
// that the OS saves the vector registers.) tests/test_cpu_kernel.py compares it with torch's answer
// under every setting.
Variant choose_variant() {
  const Variant generic{&DEFAULT::rotary_kernel, &DEFAULT::qk_norm_kernel, "DEFAULT"};
#ifdef ROPE_EXT_HAVE_AVX
  const Variant avx512{&AVX512::rotary_kernel, &AVX512::qk_norm_kernel, "AVX512"};
  const Variant avx2{&AVX2::rotary_kernel, &AVX2::qk_norm_kernel, "AVX2"};
  if (const char* env = std::getenv("ATEN_CPU_CAPABILITY")) {
    if (std::strcmp(env, "avx512") == 0) return avx512;
    if (std::strcmp(env, "avx2") == 0) return avx2;
    if (std::strcmp(env, "default") == 0) return generic;
    // (any other value: torch warns that it ignores it, and so is it ignored here)
  }
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
    return avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return avx2;
#endif
  return generic;
}

const Variant& variant() {
  static const Variant v = choose_variant();
  return v;
}

// Whether this CPU has AVX512-BF16 (cpuid, read once when the library loads: torch's capability
// says only "AVX512"), under the AVX512 variant.
bool detect_native_bf16() {
#ifdef ROPE_EXT_HAVE_AVX
  return variant().fn == &AVX512::rotary_kernel && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}
const bool g_native_bf16_available = detect_native_bf16();
std::atomic<bool> g_native_bf16_allowed{true};

// The variant for one call: the AVX512_BF16 kernels where they may run, else the process's variant.
const Variant& variant_for_call() {
#ifdef ROPE_EXT_HAVE_AVX
  static const Variant native_bf16{&AVX512_BF16::rotary_kernel, &AVX512_BF16::qk_norm_kernel, "AVX512_BF16"};
  if (g_native_bf16_available && g_native_bf16_allowed.load(std::memory_order_relaxed)) return native_bf16;
#endif
  return variant();
}

}  // namespace

std::string kernel_isa() { return variant().name; }

bool native_bf16_available() { return g_native_bf16_available; }

bool allow_native_bf16(bool allow) { return g_native_bf16_allowed.exchange(allow); }

namespace {

// The defaults, and why:
constexpr Thresholds kDefaultThresholds{
    // streaming_bytes: outputs this large cannot stay in cache anyway, and a normal store would
    // first read each output line from memory (read for ownership), a third memory stream beside
    // reading x and writing out. Smaller outputs are stored normally, so the attention that reads
    // them next finds them in cache. The figure is the last-level cache of the machines we
    // measure on (8 to 32 MiB).
    int64_t{16} << 20,
    // huge_page_bytes: glibc serves allocations this large with a fresh mmap (its mmap threshold
    // never exceeds 32 MiB), so every 4 KiB page of a new output costs a page fault on first
    // write: 160 MiB of output took ~60 ms of faults on our 2-core machine, four times the
    // rotation itself. Huge pages cut the faults 512-fold; the kernel still zeroes the memory.
    // Nothing changes where THP is off ("never") or memory comes from a pool.
    int64_t{32} << 20,
    // grain_elements: ATen's own grain (at::internal::GRAIN_SIZE). Below it a call runs on the
    // calling thread, which keeps small (decode) shapes free of threading overhead.
    32768,
    // tile_tokens: each head's rows of a tile are one run of tile * head_dim elements (16 to
    // 32 KiB at head dim 128), and the tile's tables (tile * 4 * half opmath values) stay in
    // L1/L2 across its heads.
    32,
    // min_heads_per_thread: so that a split of the heads is even to within 25%.
    4,
};

// Read by every call and replaced by tests from any thread: each field is atomic (a call may see
// a mix of old and new fields, each of which is valid).
struct AtomicThresholds {
  std::atomic<int64_t> streaming_bytes{kDefaultThresholds.streaming_bytes};
  std::atomic<int64_t> huge_page_bytes{kDefaultThresholds.huge_page_bytes};
  std::atomic<int64_t> grain_elements{kDefaultThresholds.grain_elements};
  std::atomic<int64_t> tile_tokens{kDefaultThresholds.tile_tokens};
  std::atomic<int64_t> min_heads_per_thread{kDefaultThresholds.min_heads_per_thread};
} g_thresholds;

}  // namespace

Thresholds thresholds() {
  return {g_thresholds.streaming_bytes.load(std::memory_order_relaxed),
          g_thresholds.huge_page_bytes.load(std::memory_order_relaxed),
          g_thresholds.grain_elements.load(std::memory_order_relaxed),
          g_thresholds.tile_tokens.load(std::memory_order_relaxed),
          g_thresholds.min_heads_per_thread.load(std::memory_order_relaxed)};
}

void set_thresholds(const Thresholds& t) {
  const char* op = "rope_ext_testing.set_cpu_thresholds";
  ROPE_EXT_CHECK(t.streaming_bytes >= 0, op, ": streaming_bytes must be >= 0, got ", t.streaming_bytes);
  ROPE_EXT_CHECK(t.huge_page_bytes >= 0, op, ": huge_page_bytes must be >= 0, got ", t.huge_page_bytes);
  ROPE_EXT_CHECK(t.grain_elements >= 1, op, ": grain_elements must be >= 1, got ", t.grain_elements);
  // Each thread allocates its tile's tables, 4 * tile_tokens * half values: no tile needs more
  // tokens than this to amortize them.
  ROPE_EXT_CHECK(t.tile_tokens >= 1 && t.tile_tokens <= 4096, op, ": tile_tokens must be in [1, 4096], got ",
              t.tile_tokens);
  ROPE_EXT_CHECK(t.min_heads_per_thread >= 1, op, ": min_heads_per_thread must be >= 1, got ", t.min_heads_per_thread);
  g_thresholds.streaming_bytes.store(t.streaming_bytes, std::memory_order_relaxed);
  g_thresholds.huge_page_bytes.store(t.huge_page_bytes, std::memory_order_relaxed);
  g_thresholds.grain_elements.store(t.grain_elements, std::memory_order_relaxed);
  g_thresholds.tile_tokens.store(t.tile_tokens, std::memory_order_relaxed);
  g_thresholds.min_heads_per_thread.store(t.min_heads_per_thread, std::memory_order_relaxed);
}

PathCounts& path_counts() {
  static PathCounts counts;
  return counts;
}

// Asks Linux for transparent huge pages for a new output of at least huge_page_bytes.
// `out` is a new output (new_like), dense: its storage starts at its first element and holds numel
// elements.
void advise_huge_pages(const TensorArg& out, int64_t huge_page_bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const int64_t nbytes = out.numel() * out.element_size();
  if (nbytes < huge_page_bytes) return;
  path_counts().huge_page_outputs.fetch_add(1, std::memory_order_relaxed);
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<std::uintptr_t>(out.const_data_ptr());
  const std::uintptr_t lo = (begin + kHuge - 1) & ~(kHuge - 1);
  const std::uintptr_t hi = (begin + static_cast<std::uintptr_t>(nbytes)) & ~(kHuge - 1);
  // Advice only: an error (THP compiled out, say) leaves ordinary pages, which are correct.
  if (hi > lo) (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)out, (void)huge_page_bytes;
#endif
}

namespace {

// torch's thread pool, as the kernel objects take it (rotary_cpu.h's ThreadPool).
// torch's parallel_for reports a chunk's exception through the stable C interface as an error code
// alone ("API call failed"): the first one is kept here and rethrown as it was, message and type
// (the kernels' debug checks, an allocation failure), as at::parallel_for rethrew it.
void torch_parallel_for(int64_t begin, int64_t end, int64_t grain, const void* body, ChunkFn chunk) {
  std::exception_ptr first;
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  torch::stable::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    try {
      chunk(body, b, e);
    } catch (...) {
      if (!failed.test_and_set()) first = std::current_exception();
    }
  });
  if (first) std::rethrow_exception(first);
}
int torch_num_threads() { return static_cast<int>(torch::stable::get_num_threads()); }
constexpr ThreadPool kTorchPool{&torch_parallel_for, &torch_num_threads};

}  // namespace

const ThreadPool& torch_pool() { return kTorchPool; }

namespace {

KernelDtype kernel_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return KernelDtype::kFloat;
    case ScalarType::Double: return KernelDtype::kDouble;
    case ScalarType::Half: return KernelDtype::kHalf;
    case ScalarType::BFloat16: return KernelDtype::kBFloat16;
    default: ROPE_EXT_CHECK(false, "rope_ext internal error (please report it): no CPU kernel for ", t);
  }
  return KernelDtype::kFloat;
}

void run_one(const TensorArg& x, const TensorArg& out, const RotaryCall& c, const Thresholds& th) {
  if (out.numel() == 0) return;
  const RotaryPlan plan = make_rotary_plan(x, out, c.cos, c.sin, c.positions);
  if (out.const_data_ptr() != x.const_data_ptr()) advise_huge_pages(out, th.huge_page_bytes);  // a new output
  const KernelFn fn = variant_for_call().fn;
#ifdef ROPE_EXT_HAVE_AVX
  if (fn == &AVX512_BF16::rotary_kernel && x.scalar_type() == ScalarType::BFloat16) {
    path_counts().native_bf16_calls.fetch_add(1, std::memory_order_relaxed);
  }
#endif
  const KernelOperands operands{x.const_data_ptr(), out.mutable_data_ptr(), c.cos.const_data_ptr(),
                                c.sin.const_data_ptr(), c.positions ? c.positions->const_data_ptr() : nullptr,
                                kernel_dtype(x.scalar_type()), c.cos.scalar_type() != x.scalar_type(), out.numel()};
  fn(plan, operands, c.interleaved, c.conjugate, th, kTorchPool);
}

}  // namespace

// What a RotaryCall describes, for checked arguments, on the CPU.
void run(const RotaryCall& c) {
  const bool any = c.x.numel() > 0 || (c.k != nullptr && c.k->numel() > 0);
  // Every position is checked before anything is written: an in-place call that fails leaves its
  // input as it was.
  if (c.positions != nullptr && any) check_positions_in_range(c.op, *c.positions, c.cos.size(0));
  const Thresholds th = thresholds();
  run_one(c.x, c.out, c, th);
  if (c.k != nullptr) run_one(*c.k, *c.k_out, c, th);
}

void run_norm(const NormCall& c) {
  // Every position is checked before anything is written, as for the rotation.
  if (c.positions != nullptr && c.x.numel() > 0) check_positions_in_range(c.op, *c.positions, c.cos.size(0));
  const NormPlan plan = make_norm_plan(c.x, c.out, c.params(), c.cos, c.sin, c.positions, c.grad, c.across_heads);
  const Thresholds th = thresholds();
  if (c.out.const_data_ptr() != c.x.const_data_ptr()) advise_huge_pages(c.out, th.huge_page_bytes);  // a new output
  if (c.grad == nullptr && c.rstd != nullptr && c.x.numel() == 0 && c.rstd->numel() > 0) {
    // Tokens of no heads, across heads: the mean of no values is NaN, as torch's mean says.
    void* rstd = c.rstd->mutable_data_ptr();
    if (c.rstd->scalar_type() == ScalarType::Double) {
      std::fill_n(static_cast<double*>(rstd), c.rstd->numel(), std::numeric_limits<double>::quiet_NaN());
    } else {
      std::fill_n(static_cast<float*>(rstd), c.rstd->numel(), std::numeric_limits<float>::quiet_NaN());
    }
  }
  const bool weighted = c.weight != nullptr && c.weight->defined();
  const bool biased = c.bias != nullptr && c.bias->defined();
  const NormOperands operands{c.x.const_data_ptr(),
                              c.out.mutable_data_ptr(),
                              c.cos.const_data_ptr(),
                              c.sin.const_data_ptr(),
                              c.positions != nullptr ? c.positions->const_data_ptr() : nullptr,
                              weighted ? c.weight->const_data_ptr() : nullptr,
                              weighted && c.weight->scalar_type() != c.x.scalar_type(),
                              c.weight_offset,
                              c.eps,
                              c.rstd != nullptr ? const_cast<void*>(c.rstd->const_data_ptr()) : nullptr,  // (the backward reads it)
                              c.grad != nullptr ? c.grad->const_data_ptr() : nullptr,
                              c.dweight != nullptr ? c.dweight->mutable_data_ptr() : nullptr,
                              kernel_dtype(c.x.scalar_type()),
                              c.cos.scalar_type() != c.x.scalar_type(),
                              c.weight_after,
                              biased ? c.bias->const_data_ptr() : nullptr,
                              biased && c.bias->scalar_type() != c.x.scalar_type(),
                              c.dbias != nullptr ? c.dbias->mutable_data_ptr() : nullptr,
                              c.centered};
  variant_for_call().norm(plan, operands, c.interleaved, c.grad != nullptr, th, kTorchPool);
}

}  // namespace rope_ext::cpu

void rope_ext::register_cpu_kernels(Library& m) {
  register_rotary_ops<&cpu::run>(m);
  register_qk_norm_ops<&cpu::run_norm>(m);
}
