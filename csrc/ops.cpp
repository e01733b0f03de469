// The one place where rope_ext's operator schemas are defined. Backends register their
// kernels next to their code with TORCH_LIBRARY_IMPL(rope_ext, <Backend>, m); autograd
// kernels are in autograd.cpp, and fake (meta) kernels are registered from Python in
// rope_ext/_ops.py.
#include <torch/library.h>

#include "cpu/rotary_cpu.h"

TORCH_LIBRARY(rope_ext, m) {
  // out = x * cos + R(x) * sin on the first r = cos.size(-1) columns of x; the rest pass
  // through. R pairs columns (i, i + r/2), or (2i, 2i + 1) when interleaved. conjugate
  // applies the transpose of that linear map. cos/sin broadcast against x.shape[:-1] + (r,).
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> Tensor");

  // rotary on q and on k in one call: (rotary(q, cos, sin), rotary(k, cos_k, sin_k)), where
  // cos_k/sin_k default to cos/sin (separate tables serve xPos). q and k may differ in head
  // count and in strides, not in dtype.
  m.def(
      "rotary_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved=False, "
      "Tensor? cos_k=None, Tensor? sin_k=None, bool conjugate=False) -> (Tensor, Tensor)");

  // In-place rotary for inference: x = rotary(x, cos, sin). Refuses inputs that need grad.
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> ()");

  // Which CPU kernel variant runs in this process: "AVX512", "AVX2" or "DEFAULT".
  m.def("cpu_kernel_isa() -> str", &rope_ext::cpu::kernel_isa);

  // Test hooks: the CUDA kernels' thread function run on the CPU over the launch grid the CUDA
  // launcher would choose (csrc/cuda/host_emulation.cpp), with the semantics of the real ops,
  // and that launch: [grid_x, grid_y, block_x, block_y, vec, pairs_per_item, rot_items, pass_items].
  m.def("_cuda_emulate_rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> Tensor");
  m.def(
      "_cuda_emulate_rotary_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved=False, "
      "Tensor? cos_k=None, Tensor? sin_k=None, bool conjugate=False) -> (Tensor, Tensor)");
  m.def("_cuda_emulate_rotary_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> ()");
  m.def("_cuda_launch_config(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> int[]");

  // Test hook: how many threads at::parallel_for uses for n items, as built here.
  m.def("_parallel_threads_used(int n) -> int", &rope_ext::cpu::parallel_threads_used);
}
