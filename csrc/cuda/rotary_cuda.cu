// CUDA implementation of the rotary ops: the launcher around rotary_thread.h's thread function,
// on torch's stable ABI (the device guard and the current stream from its C interface). Built only
// when torch is a CUDA build and nvcc is found (setup.py).
//
// The library links no CUDA library of torch's and the CUDA runtime statically (CMakeLists.txt), so
// that one build loads beside a CPU-only torch and beside a CUDA torch of any CUDA major, needing
// only a driver that runs this nvcc's code: the one function it needs from libtorch_cuda.so, the
// current stream, is looked up where a CUDA torch has loaded it, at the first CUDA call.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>

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

// aoti_torch_get_current_cuda_stream, from the libtorch_cuda.so of the process's torch (there are
// CUDA tensors, so it is loaded).
using CurrentStreamFn = AOTITorchError (*)(int32_t device_index, void** stream);
CurrentStreamFn current_stream_fn() {
  static const CurrentStreamFn fn = []() -> CurrentStreamFn {
    void* torch_cuda = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    return torch_cuda == nullptr
               ? nullptr
               : reinterpret_cast<CurrentStreamFn>(dlsym(torch_cuda, "aoti_torch_get_current_cuda_stream"));
  }();
  ROPE_EXT_CHECK(fn != nullptr, "rope_ext: CUDA tensors, but no libtorch_cuda.so with "
                 "aoti_torch_get_current_cuda_stream is loaded in this process");
  return fn;
}

void run_cuda(const RotaryCall& c) {
  if (c.out.numel() == 0 && (c.k_out == nullptr || c.k_out->numel() == 0)) return;
  const torch::stable::accelerator::DeviceGuard guard(c.x.device().index);
  const CallLaunch cl = plan_call(c);
  const RotaryLaunch& L = cl.launch;
  const dim3 grid(static_cast<unsigned>(L.grid_x), static_cast<unsigned>(L.grid_y));
  const dim3 block(static_cast<unsigned>(L.block_x), static_cast<unsigned>(L.block_y));
  void* stream = nullptr;
  detail::shim_check(current_stream_fn()(c.x.device().index, &stream), "aoti_torch_get_current_cuda_stream");
  dispatch_thread(c, L, [&]<class Thread>() {
    rotary_kernel<Thread><<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(Thread::make(c, cl));
    // (as C10_CUDA_KERNEL_LAUNCH_CHECK: a launch error, reported by the op that launched)
    const cudaError_t err = cudaGetLastError();
    ROPE_EXT_CHECK(err == cudaSuccess, c.op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
  });
}

}  // namespace
}  // namespace rope_ext::cuda

void rope_ext::register_cuda_kernels(Library& m) { register_rotary_ops<&cuda::run_cuda>(m); }
