// The streaming-store decision (csrc/cpu/streaming.h) for the register size of every CPU kernel
// variant, AVX-512's included, which no machine here can execute. Against a model of the stores that
// rotate_row_contiguous's vector body issues: the decision must allow streaming only for rows whose
// every register store is aligned to the register size (a misaligned streaming store faults), and
// must allow it for every such row (so large outputs still stream where they can).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cpu/streaming.h"

namespace {

using rope_ext::cpu::Isa;
using rope_ext::cpu::streaming_row_aligned;
using rope_ext::cpu::streaming_store_bytes;

// Byte addresses of the register stores of one row's vector body, written from the loop's
// description: V = register_bytes / 4 floats per register, a step of 2V pairs; each step stores
// its 2V first members and its 2V second members (half-split: at i and half + i; interleaved: the
// 4V columns from 2i), each run of 2V elements as whole registers: two float registers, or one
// register of 2V 16-bit values.
std::vector<std::uintptr_t> vector_body_stores(std::uintptr_t row, int64_t half, int64_t elem, bool interleaved,
                                               int64_t register_bytes) {
  const int64_t v = register_bytes / 4, step = 2 * v;
  std::vector<std::uintptr_t> stores;
  const auto run = [&](int64_t first_elem) {  // 2V elements from first_elem
    for (int64_t b = 0; b < step * elem; b += register_bytes) stores.push_back(row + first_elem * elem + b);
  };
  for (int64_t i = 0; i + step <= half; i += step) {
    if (interleaved) {
      run(2 * i);
      run(2 * i + step);
    } else {
      run(i);
      run(half + i);
    }
  }
  return stores;
}

TEST(StreamingStores, RegisterSizeOfEachVariant) {
  EXPECT_EQ(streaming_store_bytes(Isa::DEFAULT), 0);  // no streaming store: ordinary stores only
  EXPECT_EQ(streaming_store_bytes(Isa::AVX2), 32);    // vmovntps / vmovntdq ymm
  EXPECT_EQ(streaming_store_bytes(Isa::AVX512), 64);  // vmovntps / vmovntdq zmm
}

TEST(StreamingStores, AllowedExactlyWhereEveryStoreIsAligned) {
  for (const Isa isa : {Isa::AVX2, Isa::AVX512}) {
    const int64_t w = streaming_store_bytes(isa);
    for (const int64_t elem : {2, 4}) {        // float16/bfloat16, float32
      for (const bool interleaved : {false, true}) {
        int64_t allowed = 0, refused = 0;
        for (int64_t half = 1; half <= 160; ++half) {
          for (std::uintptr_t row = 4096; row < 4096 + 2 * static_cast<std::uintptr_t>(w); row += elem) {
            const auto stores = vector_body_stores(row, half, elem, interleaved, w);
            if (stores.empty()) continue;  // no vector body: any answer is safe
            bool all_aligned = true;
            for (const auto a : stores) all_aligned = all_aligned && a % w == 0;
            const bool ok = streaming_row_aligned(row, half, elem, interleaved, w);
            EXPECT_EQ(ok, all_aligned) << "isa register " << w << " B, elem " << elem << " B, interleaved "
                                       << interleaved << ", half " << half << ", row % " << w << " = " << row % w;
            (ok ? allowed : refused) += 1;
          }
        }
        EXPECT_GT(allowed, 0);
        EXPECT_GT(refused, 0);
      }
    }
  }
}

TEST(StreamingStores, IssueSixteenRowsAreRefused) {
  // bf16, head dim 72, interleaved: rows 144 bytes apart are 16-byte aligned but every other one is
  // not 32-byte aligned; half-register alignment (16 bytes) used to pass them, and they faulted.
  EXPECT_FALSE(streaming_row_aligned(4096 + 144, 36, 2, true, 32));
  EXPECT_TRUE(streaming_row_aligned(4096 + 288, 36, 2, true, 32));
  // float16, head dim 40, r = 32, half-split: the second half starts 32 bytes in; AVX-512 needs 64.
  EXPECT_TRUE(streaming_row_aligned(4096, 16, 2, false, 32));
  EXPECT_FALSE(streaming_row_aligned(4096, 16, 2, false, 64));
}

TEST(StreamingStores, NeverWithoutAStreamingStore) {
  for (int64_t half = 1; half < 100; ++half) {
    EXPECT_FALSE(streaming_row_aligned(4096, half, 4, false, streaming_store_bytes(Isa::DEFAULT)));
  }
}

}  // namespace
