// The backward half of host_emulation_qk_norm.cpp's emulation: qk_norm_rotary's backward kernels'
// threads (emulated_norm.h), compiled in a file of their own so that the two halves compile side by
// side.
#include "testing/emulated_norm.h"

namespace rope_ext::testing::emulation {
template void emulate_norm_threads<true>(const NormCall&, const cuda::NormCallLaunch&, const cuda::NormScratch&);
}  // namespace rope_ext::testing::emulation
