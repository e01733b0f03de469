// ROPE_EXT_INTERNAL: the few internal functions that librope_ext.so exports besides
// rope_ext_library_version (the C++ API is header-only). The library is built with hidden visibility; these are exported
// for librope_ext_testing.so (csrc/testing/), which must reach this library's own state and code
// rather than a copy of it: the CPU kernel's thresholds and path counters (one per process) and
// the checks and plan that the CUDA host emulation runs. Not installed, not an API.
#pragma once

#define ROPE_EXT_INTERNAL __attribute__((visibility("default")))
