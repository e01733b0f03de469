// ATen glue for the CPU: checks, allocation, choice of kernel variant, registration.
#include "cpu/rotary_cpu.h"
#include "registration.h"
#include "rotary_ops.h"

#include <ATen/Version.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace rope_ext::cpu {
namespace {

using KernelFn = decltype(&DEFAULT::rotary_kernel);

struct Variant {
  KernelFn fn;
  const char* name;
};

Variant choose_variant() {
#ifdef ROPE_EXT_HAVE_AVX
  const std::string cap = at::get_cpu_capability();
  if (cap == "AVX512") return {&AVX512::rotary_kernel, "AVX512"};
  if (cap == "AVX2") return {&AVX2::rotary_kernel, "AVX2"};
#endif
  return {&DEFAULT::rotary_kernel, "DEFAULT"};
}

const Variant& variant() {
  static const Variant v = choose_variant();
  return v;
}

}  // namespace

std::string kernel_isa() { return variant().name; }

int64_t parallel_threads_used(int64_t n) {
  TORCH_CHECK(n >= 0, "rope_ext._parallel_threads_used: n must be >= 0, got ", n);
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << (at::get_thread_num() % 64));
  });
  return __builtin_popcountll(seen.load());
}

// Outputs of at least this size ask Linux for transparent huge pages. glibc serves them with
// a fresh mmap (its mmap threshold never exceeds 32 MiB), so every 4 KiB page of a new output
// costs a page fault on first write: 160 MiB of output took ~60 ms of faults on our 2-core
// machine, four times the rotation itself. Huge pages cut the faults 512-fold; the kernel still
// zeroes the memory. Nothing changes where THP is off ("never") or memory comes from a pool.
constexpr int64_t kHugePageBytes = int64_t{32} << 20;

void advise_huge_pages(const at::Tensor& out) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const int64_t nbytes = static_cast<int64_t>(out.storage().nbytes());
  if (nbytes < kHugePageBytes) return;
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<std::uintptr_t>(out.storage().data());
  const std::uintptr_t lo = (begin + kHuge - 1) & ~(kHuge - 1);
  const std::uintptr_t hi = (begin + static_cast<std::uintptr_t>(nbytes)) & ~(kHuge - 1);
  // Advice only: an error (THP compiled out, say) leaves ordinary pages, which are correct.
  if (hi > lo) (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)out;
#endif
}

// out = rotary(x, cos, sin) for checked arguments; out may be x.
void run(const at::Tensor& x, at::Tensor& out, const at::Tensor& cos, const at::Tensor& sin,
         bool interleaved, bool conjugate) {
  const RotaryPlan plan = make_rotary_plan(x, out, cos, sin);
  if (!out.is_same(x)) advise_huge_pages(out);  // a new output: see kHugePageBytes
  variant().fn(plan, x, out, cos, sin, interleaved, conjugate);
}

}  // namespace rope_ext::cpu

void rope_ext::register_cpu_kernels(torch::Library& m) {
  using Ops = RotaryOps<&cpu::run>;
  m.impl("rotary", &Ops::rotary);
  m.impl("rotary_qk", &Ops::rotary_qk);
  m.impl("rotary_", &Ops::rotary_);
}
