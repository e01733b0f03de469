// CUDA implementation of the rotary ops: the launcher around rotary_thread.h's thread function.
// Built only when torch is a CUDA build and nvcc is found (setup.py).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
// c10's stream header rather than ATen/cuda/CUDAContext.h: the kernels need only the current
// stream (at::cuda::getCurrentCUDAStream is this same function), and CUDAContext.h pulls in
// cuBLAS/cuSPARSE headers that a compiler-only CUDA install does not have.
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda/rotary_thread.h"
#include "registration.h"
#include "rotary_ops.h"

namespace rope_ext::cuda {
namespace {

// The thread function is the kernel's only parameter (under 256 bytes with CompactIndex);
// __grid_constant__ lets it be read in place from the parameter bank, never copied to local memory.
// At least 2 blocks of kMaxThreads per SM, so up to 128 registers a thread: with the block size
// alone, ptxas for sm_100 and later held the kernels to 64 registers and spilled (cuda-check refuses
// stack); they used 32 to 88 while full-table kernels held no code for k, and use 40 to 110 on sm_90
// since (the most in the 16-bit half-split full-table kernels; other architectures not remeasured).
template <typename Thread>
__global__ void __launch_bounds__(kMaxThreads, 2) rotary_kernel(const __grid_constant__ Thread t) {
  t({blockIdx.x, blockIdx.y, threadIdx.x, threadIdx.y, gridDim.x, gridDim.y, blockDim.x, blockDim.y});
}

void run_cuda(const RotaryCall& c) {
  if (c.out.numel() == 0 && (c.k_out == nullptr || c.k_out->numel() == 0)) return;
  const c10::cuda::CUDAGuard guard(c.x.device());
  const CallLaunch cl = plan_call(c);
  const RotaryLaunch& L = cl.launch;
  const dim3 grid(static_cast<unsigned>(L.grid_x), static_cast<unsigned>(L.grid_y));
  const dim3 block(static_cast<unsigned>(L.block_x), static_cast<unsigned>(L.block_y));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_thread(c, L, [&]<class Thread>() {
    rotary_kernel<Thread><<<grid, block, 0, stream>>>(Thread::make(c, cl));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace rope_ext::cuda

void rope_ext::register_cuda_kernels(torch::Library& m) {
  using Ops = RotaryOps<&cuda::run_cuda>;
  m.impl("rotary", &Ops::rotary);
  m.impl("rotary_qk", &Ops::rotary_qk);
  m.impl("rotary_", &Ops::rotary_);
  m.impl("rotary_pos", &Ops::rotary_pos);
  m.impl("rotary_pos_qk", &Ops::rotary_pos_qk);
  m.impl("rotary_pos_", &Ops::rotary_pos_);
}
