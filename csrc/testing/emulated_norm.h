// The emulation of qk_norm_rotary's thread functions (qk_norm_thread.h), for the forward's kernels
// (kBackward false) or the backward's: host_emulation_qk_norm.cpp instantiates the one and
// host_emulation_qk_norm_backward.cpp the other, so that the two halves of the testing library's
// longest compile run side by side.
#pragma once

#include <type_traits>
#include <vector>

#include "cuda/qk_norm_thread.h"
#include "testing/emulation.h"

namespace rope_ext::testing::emulation {

template <class Thread>
struct IsBackward;
template <typename scalar_t, typename table_t, bool kI, int kV, bool kG, bool kB, class M>
struct IsBackward<cuda::NormThread<scalar_t, table_t, kI, kV, kG, kB, M>> : std::bool_constant<kB> {};

// The launch's threads, as run_norm_cuda launches them: per block, each iteration's reduce phase for
// every thread, then its centering (LayerNorm's forward) and write phases (the order the kernel's
// barriers give), then the fold. c.grad must be set exactly where kBackward is.
template <bool kBackward>
void emulate_norm_threads(const NormCall& c, const cuda::NormCallLaunch& cl, const cuda::NormScratch& partial) {
  const cuda::NormLaunch& L = cl.launch;
  if (L.groups <= 0) return;
  const auto each_thread = [&](int64_t bx, auto&& f) {
    for (int64_t ty = 0; ty < L.block_y; ++ty)
      for (int64_t tx = 0; tx < L.block_x; ++tx) {
        const cuda::ThreadCoord g{bx, 0, tx, ty, L.grid_x, 1, L.block_x, L.block_y};
        if (g_traffic) g_traffic->begin_thread(g);
        f(g);
      }
    if (g_traffic) g_traffic->flush();  // (the phases are different instructions, even within one warp)
  };
  cuda::dispatch_norm_thread(c, L, [&]<class Thread>() {
    if constexpr (IsBackward<Thread>::value == kBackward) {  // (the other direction's: another file's)
      using Emulated = typename Thread::template WithMemory<EmulatedMemory>;
      using opmath_t = typename Thread::opmath_t;
      const Emulated t = Emulated::make(c, cl.plan, L, partial.weight, partial.bias);
      std::vector<opmath_t> shares(Emulated::kShares);
      for (int64_t bx = 0; bx < L.grid_x; ++bx) {
        const int64_t iterations = t.iterations({bx, 0, 0, 0, L.grid_x, 1, L.block_x, L.block_y});
        for (int64_t it = 0; it < iterations; ++it) {
          each_thread(bx, [&](const cuda::ThreadCoord& g) { t.reduce(g, it, shares.data()); });
          if (t.centers()) each_thread(bx, [&](const cuda::ThreadCoord& g) { t.center(g, it, shares.data()); });
          each_thread(bx, [&](const cuda::ThreadCoord& g) { t.write(g, it, shares.data()); });
        }
        each_thread(bx, [&](const cuda::ThreadCoord& g) { t.fold(g); });
      }
    } else {
      ROPE_EXT_CHECK(false, "rope_ext CUDA emulation: the ", kBackward ? "backward" : "forward",
                     "'s threads asked for the other direction's kernel");
    }
  });
}

extern template void emulate_norm_threads<false>(const NormCall&, const cuda::NormCallLaunch&,
                                                 const cuda::NormScratch&);
extern template void emulate_norm_threads<true>(const NormCall&, const cuda::NormCallLaunch&,
                                                const cuda::NormScratch&);

}  // namespace rope_ext::testing::emulation
