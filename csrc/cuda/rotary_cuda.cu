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

#include "cuda/qk_norm_thread.h"
#include "cuda/rotary_thread.h"
#include "qk_norm_ops.h"
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

// qk_norm_rotary (qk_norm_thread.h says how the work is split): each iteration of the group loop in
// its phases, then the block's partial sums of the weights' and biases' gradients folded. The shares
// of the groups' sums are the only shared memory (2 or 4 KiB). Two blocks per SM at least, as the
// rotation's. (centers() is the same for every thread of the launch: every thread reaches every
// barrier.)
template <typename Thread>
__global__ void __launch_bounds__(kMaxThreads, 2) qk_norm_kernel(const __grid_constant__ Thread t) {
  __shared__ typename Thread::opmath_t shares[Thread::kShares];
  const ThreadCoord g{blockIdx.x, 0, threadIdx.x, threadIdx.y, gridDim.x, 1, blockDim.x, blockDim.y};
  const int64_t iterations = t.iterations(g);
  for (int64_t it = 0; it < iterations; ++it) {
    t.reduce(g, it, shares);
    __syncthreads();
    if (t.centers()) {
      t.center(g, it, shares);
      __syncthreads();
    }
    t.write(g, it, shares);
    __syncthreads();
  }
  t.fold(g);
}

template <typename Sum>
__global__ void __launch_bounds__(kMaxThreads) weight_grad_sum_kernel(const __grid_constant__ Sum t) {
  t({blockIdx.x, 0, threadIdx.x, 0, gridDim.x, 1, blockDim.x, 1});
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

void check_launch(const char* op) {
  // (as C10_CUDA_KERNEL_LAUNCH_CHECK: a launch error, reported by the op that launched)
  const cudaError_t err = cudaGetLastError();
  ROPE_EXT_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
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
    check_launch(c.op);
  });
}

// One NormCall: the forward or backward kernel over its groups, and for the weights' gradient the
// sum of the blocks' partial sums (a scratch tensor from torch's allocator, on the stream).
void run_norm_cuda(const NormCall& c) {
  const torch::stable::accelerator::DeviceGuard guard(c.x.device().index);
  const NormCallLaunch cl = plan_norm_call(c);
  const NormLaunch& L = cl.launch;
  if (L.groups == 0 && c.dweight == nullptr && c.dbias == nullptr) return;
  void* stream = nullptr;
  detail::shim_check(current_stream_fn()(c.x.device().index, &stream), "aoti_torch_get_current_cuda_stream");
  const auto s = static_cast<cudaStream_t>(stream);
  const NormScratch partial = norm_scratch(c, L);
  if (L.groups > 0) {
    dispatch_norm_thread(c, L, [&]<class Thread>() {
      qk_norm_kernel<Thread><<<dim3(static_cast<unsigned>(L.grid_x)),
                               dim3(static_cast<unsigned>(L.block_x), static_cast<unsigned>(L.block_y)), 0, s>>>(
          Thread::make(c, cl.plan, L, partial.weight, partial.bias));
      check_launch(c.op);
    });
  }
  dispatch_weight_grad_sum(c, cl, partial, [&]<class Sum>(const Sum& t, int64_t grid) {
    weight_grad_sum_kernel<<<dim3(static_cast<unsigned>(grid)), dim3(kMaxThreads), 0, s>>>(t);
    check_launch(c.op);
  });
}

}  // namespace
}  // namespace rope_ext::cuda

void rope_ext::register_cuda_kernels(Library& m) {
  register_rotary_ops<&cuda::run_cuda>(m);
  register_qk_norm_ops<&cuda::run_norm_cuda>(m);
}
