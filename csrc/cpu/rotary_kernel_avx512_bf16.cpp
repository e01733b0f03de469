// The CPU kernel for AVX-512 CPUs with AVX512-BF16: rotary_kernel_avx512.cpp's kernel with bfloat16
// results rounded by vcvtne2ps2bf16 (CMakeLists.txt gives it -mavx512bf16). rotary_cpu.cpp runs it
// only where cpuid reports AVX512-BF16.
#define ROPE_EXT_NATIVE_BF16 1
#include "cpu/rotary_kernel.h"
#include "cpu/qk_norm_kernel.h"
