// When the CPU kernel may write a row with streaming (non-temporal) stores.
//
// A streaming store writes one whole vector register and faults (SIGSEGV) unless its address is a
// multiple of the register's size: 32 bytes for AVX2's vmovntps/vmovntdq, 64 for AVX-512's. Being
// aligned to anything less is not enough (issue 16: 16-bit outputs were checked against half a
// register and crashed). This header depends on nothing but the standard library, so a unit test
// (tests/cpp/test_streaming.cpp) evaluates the decision for every variant's register size,
// AVX-512's included, on a machine that cannot execute AVX-512.
#pragma once

#include <cstdint>

namespace rope_ext::cpu {

enum class Isa { DEFAULT, AVX2, AVX512, AVX512_BF16 };

// Bytes one streaming store of the variant writes, and so the alignment it needs; 0 where the
// variant has no streaming store (DEFAULT writes with ordinary stores only).
constexpr int64_t streaming_store_bytes(Isa isa) {
  return isa == Isa::AVX512 || isa == Isa::AVX512_BF16 ? 64 : isa == Isa::AVX2 ? 32 : 0;
}

// True when every vector store of rotate_row_contiguous's vector body on the row of `out` that
// starts at address `row` may be a streaming store of `store_bytes` bytes.
//
// The vector body writes whole registers: it stores at byte offsets that are multiples of the
// register size from the row start (interleaved, and the first half of a half-split row) and from
// the row's second half, `half` elements in (half-split). (rotary_kernel.h static_asserts that a
// step of its loop is a whole number of registers.) So the row start, and for half-split the
// second half's start, must both be multiples of store_bytes.
constexpr bool streaming_row_aligned(std::uintptr_t row, int64_t half, int64_t elem_bytes, bool interleaved,
                                     int64_t store_bytes) {
  if (store_bytes <= 0) return false;
  const auto align = static_cast<std::uintptr_t>(store_bytes);
  return row % align == 0 && (interleaved || static_cast<std::uintptr_t>(half * elem_bytes) % align == 0);
}

}  // namespace rope_ext::cpu
