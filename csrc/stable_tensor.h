// The boundary between torch's stable ABI and rope_ext's own code: a torch::stable::Tensor read
// into a TensorArg (tensor_arg.h), and outputs allocated as at::empty_like allocates them. Only
// translation units built with TORCH_TARGET_VERSION include this (CMakeLists.txt).
//
// Each accessor of torch::stable::Tensor is a call into libtorch, and its scalar_type() and device()
// translate codes through further calls, so a tensor is read here once, with one call per field, and
// dtype and device codes are translated by tables read once per process.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <algorithm>
#include <utility>
#include <vector>

#include "stable_boxing.h"
#include "tensor_arg.h"

namespace rope_ext {

using StableTensor = torch::stable::Tensor;

namespace detail {

// A libtorch call's error code as an exception (an internal error: the arguments were checked).
inline void shim_check(AOTITorchError err, const char* call) {
  if (err != AOTI_TORCH_SUCCESS) throw std::runtime_error(str("rope_ext internal error: ", call, " failed"));
}

// The shim's dtype and device codes of the types rope_ext reads, asked once. (They are the enums'
// values in every torch to date; asking keeps that an assumption of torch's, not ours.)
struct Codes {
  struct Entry {
    int32_t code;
    ScalarType type;
  };
  Entry dtypes[6] = {{aoti_torch_dtype_float32(), ScalarType::Float},   {aoti_torch_dtype_bfloat16(), ScalarType::BFloat16},
                     {aoti_torch_dtype_float16(), ScalarType::Half},    {aoti_torch_dtype_float64(), ScalarType::Double},
                     {aoti_torch_dtype_int64(), ScalarType::Long},      {aoti_torch_dtype_int32(), ScalarType::Int}};
  int32_t cpu = aoti_torch_device_type_cpu();
  int32_t cuda = aoti_torch_device_type_cuda();
};
inline const Codes& codes() {
  static const Codes c;
  return c;
}

inline ScalarType dtype_of_code(int32_t code) {
  for (const auto& e : codes().dtypes) {
    if (e.code == code) return e.type;
  }
  // any other: the shim's codes are c10's enum values (torch::stable's own translation refuses the
  // dtypes it does not list, before rope_ext's check could name the argument)
  return static_cast<ScalarType>(code);
}

inline int32_t code_of_dtype(ScalarType t) {
  for (const auto& e : codes().dtypes) {
    if (e.type == t) return e.code;
  }
  throw std::runtime_error(str("rope_ext internal error: no output of dtype ", t));
}

inline DeviceType device_type_of_code(int32_t code) {
  if (code == codes().cpu) return DeviceType::CPU;
  if (code == codes().cuda) return DeviceType::CUDA;
  return static_cast<DeviceType>(code);  // (as dtype_of_code: c10's enum values)
}

}  // namespace detail

// What rope_ext's checks and kernels read of t; `writes`: its data will be written (in place, or a
// new output). An undefined tensor (None where the schema wants a Tensor) reads as undefined.
inline TensorArg read_arg(AtenTensorHandle h, bool writes = false) {
  using detail::shim_check;
  TensorArg a;
  shim_check(aoti_torch_is_defined(h, &a.defined_), "aoti_torch_is_defined");
  if (!a.defined_) return a;
  int64_t* sizes = nullptr;
  int64_t* strides = nullptr;
  int32_t dtype = 0, device_type = 0, device_index = 0;
  shim_check(aoti_torch_get_dim(h, &a.dim_), "aoti_torch_get_dim");
  shim_check(aoti_torch_get_sizes(h, &sizes), "aoti_torch_get_sizes");
  shim_check(aoti_torch_get_strides(h, &strides), "aoti_torch_get_strides");
  shim_check(aoti_torch_get_dtype(h, &dtype), "aoti_torch_get_dtype");
  shim_check(aoti_torch_get_device_type(h, &device_type), "aoti_torch_get_device_type");
  shim_check(aoti_torch_get_device_index(h, &device_index), "aoti_torch_get_device_index");
  a.sizes_ = sizes;
  a.strides_ = strides;
  a.numel_ = product(sizes, a.dim_);
  a.dtype_ = detail::dtype_of_code(dtype);
  a.device_ = {detail::device_type_of_code(device_type), device_index};
  if (writes) {
    shim_check(torch_get_mutable_data_ptr(h, &a.data_), "torch_get_mutable_data_ptr");
  } else {
    const void* data = nullptr;
    shim_check(torch_get_const_data_ptr(h, &data), "torch_get_const_data_ptr");
    a.data_ = const_cast<void*>(data);  // (read only: TensorArg holds one pointer for both uses)
  }
  return a;
}

inline TensorArg read_arg(TensorRef t, bool writes = false) { return read_arg(t.handle, writes); }
inline TensorArg read_arg(const StableTensor& t, bool writes = false) { return read_arg(t.get(), writes); }

// A new output and what the kernels read of it.
struct Output {
  OwnedTensor tensor;
  TensorArg arg;  // writable
};

// A new tensor laid out as at::empty_like(t) lays it out: with t's strides where t is
// non-overlapping and dense (every layout a model passes), otherwise by empty_like itself through
// the dispatcher (a microsecond more, for the rare expanded or overlapping input). `a` is t, read.
inline Output new_like(AtenTensorHandle t, const TensorArg& a) {
  using detail::shim_check;
  if (!non_overlapping_and_dense(a)) {
    AtenTensorHandle copy = nullptr, out = nullptr;  // (torch::stable::Tensor frees its handle: give it its own)
    shim_check(aoti_torch_new_tensor_handle(t, &copy), "aoti_torch_new_tensor_handle");
    const StableTensor result = torch::stable::empty_like(StableTensor(copy));
    shim_check(aoti_torch_new_tensor_handle(result.get(), &out), "aoti_torch_new_tensor_handle");
    Output o{OwnedTensor(out), {}};
    o.arg = read_arg(out, true);
    return o;
  }
  AtenTensorHandle handle = nullptr;
  const int32_t device_type = a.device().is_cpu() ? detail::codes().cpu : detail::codes().cuda;
  detail::shim_check(aoti_torch_empty_strided(a.dim(), a.sizes_, a.strides_, detail::code_of_dtype(a.scalar_type()),
                                              device_type, a.device().index, &handle),
                     "aoti_torch_empty_strided");
  Output out{OwnedTensor(handle), a};  // t's sizes and strides (read from t, which outlives the call)
  detail::shim_check(torch_get_mutable_data_ptr(handle, &out.arg.data_), "torch_get_mutable_data_ptr");
  return out;
}

// A new contiguous tensor of `sizes` and `dtype` on `device` (the norm's per-row statistics, the
// weights' gradients).
inline Output new_contiguous(Dims sizes, ScalarType dtype, Device device) {
  std::vector<int64_t> strides(sizes.size());
  int64_t step = 1;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    strides[d] = step;
    step *= std::max<int64_t>(sizes[d], 1);
  }
  AtenTensorHandle handle = nullptr;
  const int32_t device_type = device.is_cpu() ? detail::codes().cpu : detail::codes().cuda;
  detail::shim_check(aoti_torch_empty_strided(sizes.size(), sizes.data, strides.data(),
                                              detail::code_of_dtype(dtype), device_type, device.index, &handle),
                     "aoti_torch_empty_strided");
  Output out{OwnedTensor(handle), {}};
  out.arg = read_arg(handle, true);
  return out;
}

}  // namespace rope_ext
