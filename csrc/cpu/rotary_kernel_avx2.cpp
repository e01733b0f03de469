// The CPU kernel, compiled with setup.py's CAPABILITY_FLAGS["_avx2.cpp"].
#include "cpu/rotary_kernel.h"
#include "cpu/qk_norm_kernel.h"
