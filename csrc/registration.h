// What each backend registers with the dispatcher. csrc/ops.cpp, the one registration site,
// defines the schemas and calls these, each into a library object for its dispatch key.
#pragma once

#include <torch/csrc/stable/library.h>

namespace rope_ext {

using Library = torch::stable::detail::StableLibrary;

void register_cpu_kernels(Library& m);   // cpu/rotary_cpu.cpp: the rotary ops' CPU kernels
#ifdef ROPE_EXT_CUDA
void register_cuda_kernels(Library& m);  // cuda/rotary_cuda.cu
#endif

}  // namespace rope_ext
