// librope_ext_testing.so: operators for rope_ext's tests only, in their own namespace
// (torch.ops.rope_ext_testing), registered when the tests load this library and never by the
// product. Built with ROPE_EXT_TESTING=ON (`make setup` builds it; wheels leave it out).
#pragma once

#include <torch/library.h>

namespace rope_ext::testing {

// host_emulation.cpp: the CUDA kernel's thread function run on the CPU, as CPU kernels of
// cuda_emulate_rotary, cuda_emulate_rotary_qk, cuda_emulate_rotary_ and cuda_launch_config.
void register_cuda_emulation(torch::Library& m);

// Whether the emulator's gathered calls may use CompactIndex (as the CUDA launcher does); returns
// the previous setting. Off, they use PlanIndex for every layout.
bool allow_compact_index(bool allow);

}  // namespace rope_ext::testing
