// librope_ext_testing.so: operators for rope_ext's tests only, in their own namespace
// (torch.ops.rope_ext_testing), registered when the tests load this library and never by the
// product. Built with ROPE_EXT_TESTING=ON (`make setup` builds it; wheels leave it out).
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace rope_ext::testing {

// host_emulation.cpp registers the CUDA kernel's thread function run on the CPU as the CPU kernels
// of cuda_emulate_* and cuda_*launch_config, on the stable ABI as the product's kernels are.

// Whether the emulator's calls may use CompactIndex (as the CUDA launcher does); returns
// the previous setting. Off, they use PlanIndex for every layout.
bool allow_compact_index(bool allow);

// Whether the emulator's launches take the vector path (and vector table loads) wherever the widths
// allow, ignoring the alignment of pointers and strides; returns the previous setting. Only to show
// that the emulator's alignment check fires: with a misaligned input, the next emulated op fails.
bool ignore_alignment(bool ignore);

// How many loads and stores the emulator has checked for alignment, in this process.
int64_t checked_accesses();

// The launches the emulated ops make, as the ops choose them (rotary_qk: one launch for q and k
// where they share tables, else one per tensor). record_launches(true) starts recording afresh,
// record_launches(false) stops; each returns whether it was recording. launches(): every launch
// since, in order, each as the 10 values of cuda_launch_config.
bool record_launches(bool on);
std::vector<int64_t> launches();

// The traffic model (host_emulation.cpp): record_traffic(true) starts recording the emulated ops'
// memory accesses afresh, record_traffic(false) stops; each returns whether it was recording.
// traffic(): [load bytes needed, load sector bytes, store bytes needed, store sector bytes, distinct
// load sector bytes, distinct store sector bytes, load instructions, store instructions, load lane
// accesses, store lane accesses] (instructions are per warp; sectors are 32 bytes).
// traffic_by_site(): the access sites used, and for each [bytes needed, sector bytes, instructions].
bool record_traffic(bool on);
std::vector<int64_t> traffic();
std::tuple<std::vector<std::string>, std::vector<int64_t>> traffic_by_site();

// CompactIndex::token<0>(t, off) for operand 0 with the given inner size and token strides
// [x outer, x inner, out outer, out inner, positions outer, positions inner]: the offsets
// [x, out, cos, sin]. Reaches both sides of its 32-bit division shortcut, whose 64-bit side only
// launches of 2^32 tokens or more would take.
std::vector<int64_t> compact_token_offsets(int64_t t, int64_t inner, const std::vector<int64_t>& strides);

}  // namespace rope_ext::testing
