// What each backend registers with the dispatcher. csrc/ops.cpp, the one registration site,
// defines the schemas and calls these, each into a torch::Library for its dispatch key.
#pragma once

#include <torch/library.h>

namespace rope_ext {

void register_cpu_kernels(torch::Library& m);       // cpu/rotary_cpu.cpp: rotary, rotary_qk, rotary_
#ifdef ROPE_EXT_CUDA
void register_cuda_kernels(torch::Library& m);      // cuda/rotary_cuda.cu
#endif

}  // namespace rope_ext
