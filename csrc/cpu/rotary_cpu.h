// CPU entry points of rope_ext. The kernel body exists once per CPU capability (see
// rotary_kernel.h); rotary_cpu.cpp chooses between them at run time.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "rotary_plan.h"

namespace rope_ext::cpu {

#define ROPE_EXT_DECLARE_KERNEL(CAP)                                                        \
  namespace CAP {                                                                           \
  void rotary_kernel(const RotaryPlan& p, const at::Tensor& x, at::Tensor& out,             \
                     const at::Tensor& cos, const at::Tensor& sin, bool interleaved,        \
                     bool conjugate);                                                       \
  }
ROPE_EXT_DECLARE_KERNEL(DEFAULT)
#ifdef ROPE_EXT_HAVE_AVX
ROPE_EXT_DECLARE_KERNEL(AVX2)
ROPE_EXT_DECLARE_KERNEL(AVX512)
#endif
#undef ROPE_EXT_DECLARE_KERNEL

// The kernel variant this process runs: "AVX512", "AVX2" or "DEFAULT". It follows
// at::get_cpu_capability(), so ATEN_CPU_CAPABILITY=default|avx2 selects a lower one.
std::string kernel_isa();

// Runs at::parallel_for over n items with grain 1 and returns how many distinct threads
// took part. It is compiled with this extension's flags, so it shows whether
// parallel_for really is parallel here (it is serial in a build without OpenMP).
int64_t parallel_threads_used(int64_t n);

// out = rotary(x, cos, sin) on the CPU for checked arguments (out may be x); the ops are
// RotaryOps<&run> (rotary_ops.h).
void run(const at::Tensor& x, at::Tensor& out, const at::Tensor& cos, const at::Tensor& sin,
         bool interleaved, bool conjugate);

}  // namespace rope_ext::cpu
