// ATen glue for the CPU: checks, allocation, choice of kernel variant, registration.
#include "cpu/rotary_cpu.h"

#include <ATen/Version.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <atomic>

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

namespace {

// out = rotary(x, cos, sin) for checked arguments; out may be x.
void run(const at::Tensor& x, at::Tensor& out, const at::Tensor& cos, const at::Tensor& sin,
         bool interleaved, bool conjugate) {
  const RotaryPlan plan = make_rotary_plan(x, out, cos, sin);
  variant().fn(plan, x, out, cos, sin, interleaved, conjugate);
}

}  // namespace

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  bool interleaved, bool conjugate) {
  check_rotary_args("rope_ext.rotary", x, cos, sin);
  at::Tensor out = at::empty_like(x);  // x's memory layout, new storage
  run(x, out, cos, sin, interleaved, conjugate);
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& cos, const at::Tensor& sin,
                                             bool interleaved,
                                             const std::optional<at::Tensor>& cos_k,
                                             const std::optional<at::Tensor>& sin_k,
                                             bool conjugate) {
  TORCH_CHECK(cos_k.has_value() == sin_k.has_value(),
              "rope_ext.rotary_qk: cos_k and sin_k must be given together, got only ",
              cos_k.has_value() ? "cos_k" : "sin_k");
  const at::Tensor& ck = cos_k.has_value() ? *cos_k : cos;
  const at::Tensor& sk = sin_k.has_value() ? *sin_k : sin;
  check_rotary_args("rope_ext.rotary_qk", q, cos, sin, {"q", "cos", "sin"});
  check_rotary_args("rope_ext.rotary_qk", k, ck, sk,
                    cos_k.has_value() ? ArgNames{"k", "cos_k", "sin_k"} : ArgNames{"k", "cos", "sin"});
  check_qk_args("rope_ext.rotary_qk", q, k, cos_k.has_value() ? std::nullopt : std::optional(cos));
  at::Tensor q_out = at::empty_like(q);
  at::Tensor k_out = at::empty_like(k);
  run(q, q_out, cos, sin, interleaved, conjugate);
  run(k, k_out, ck, sk, interleaved, conjugate);
  return {q_out, k_out};
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
             bool conjugate) {
  check_rotary_args("rope_ext.rotary_", x, cos, sin);
  check_inplace_args("rope_ext.rotary_", x, cos, sin);
  run(x, x, cos, sin, interleaved, conjugate);
}

}  // namespace rope_ext::cpu

TORCH_LIBRARY_IMPL(rope_ext, CPU, m) {
  m.impl("rotary", &rope_ext::cpu::rotary);
  m.impl("rotary_qk", &rope_ext::cpu::rotary_qk);
  m.impl("rotary_", &rope_ext::cpu::rotary_);
}
