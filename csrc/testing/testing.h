// librope_ext_testing.so: operators for rope_ext's tests only, in their own namespace
// (torch.ops.rope_ext_testing), registered when the tests load this library and never by the
// product. Built with ROPE_EXT_TESTING=ON (`make setup` builds it; wheels leave it out).
#pragma once

#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace rope_ext::testing {

// host_emulation.cpp: the CUDA kernel's thread function run on the CPU, as CPU kernels of
// cuda_emulate_rotary, cuda_emulate_rotary_qk, cuda_emulate_rotary_ and cuda_launch_config.
void register_cuda_emulation(torch::Library& m);

// Whether the emulator's gathered calls may use CompactIndex (as the CUDA launcher does); returns
// the previous setting. Off, they use PlanIndex for every layout.
bool allow_compact_index(bool allow);

// CompactIndex::token<0>(t, off) for operand 0 with the given inner size and token strides
// [x outer, x inner, out outer, out inner, positions outer, positions inner]: the offsets
// [x, out, cos, sin]. Reaches both sides of its 32-bit division shortcut, whose 64-bit side only
// launches of 2^32 tokens or more would take.
std::vector<int64_t> compact_token_offsets(int64_t t, int64_t inner, const std::vector<int64_t>& strides);

}  // namespace rope_ext::testing
