// The errors rope_ext gives a type of its own, and how the type crosses the library's boundary.
//
// librope_ext is built on torch's stable ABI, whose kernels' exceptions reach the caller as
// std::runtime_error (RuntimeError in Python) carrying the message alone: no type survives the
// shim. So the kind of error travels as the first words of its message, one prefix per kind,
// written here once. The kernels write it; the C++ API (rope_ext/autograd.h: rope_ext::PositionOutsideCache)
// and Python (rope_ext._errors: rope_ext.PositionOutsideCache) turn it back into their own type,
// the rest of the message unchanged. Header-only, with no torch include: the library and the C++
// API both include it.
#pragma once

// A position outside the cos/sin cache it gathers from (rotary_pos and the other ops by position,
// on the CPU; on CUDA it is a device-side assert, which no caller can catch).
#define ROPE_EXT_POSITION_OUTSIDE_CACHE "rope_ext.PositionOutsideCache: "
