// What the checks, the plans and the kernels see of a tensor: its geometry, dtype, device and data,
// read once at the operator's boundary (csrc/stable_tensor.h for the library, on torch's stable ABI;
// csrc/testing/ for the test hooks). Nothing here calls torch: only torch/headeronly's types, which
// are plain enums and need no library, so every translation unit (stable or not, C++ or CUDA) can
// include it. Also the one way rope_ext raises an error (ROPE_EXT_CHECK), with messages built as
// c10's TORCH_CHECK builds them, so that they match the fake kernels' (rope_ext/_ops.py) to the letter.
#pragma once

#include <torch/headeronly/core/DeviceType.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "rotary_math.h"

namespace rope_ext {

using torch::headeronly::DeviceType;
using torch::headeronly::ScalarType;

// A run of int64 values owned elsewhere (a tensor's sizes or strides, or a slice of them).
struct Dims {
  const int64_t* data = nullptr;
  int64_t n = 0;
  int64_t size() const { return n; }
  const int64_t* begin() const { return data; }
  const int64_t* end() const { return data + n; }
  int64_t operator[](int64_t i) const { return data[i]; }
  Dims slice(int64_t start, int64_t len) const { return {data + start, len}; }
  friend bool operator==(const Dims& a, const Dims& b) {
    if (a.n != b.n) return false;
    for (int64_t i = 0; i < a.n; ++i) {
      if (a.data[i] != b.data[i]) return false;
    }
    return true;
  }
};

// A device as c10::Device prints it: "cpu", "cuda:0".
struct Device {
  DeviceType type = DeviceType::CPU;
  int32_t index = -1;
  bool is_cpu() const { return type == DeviceType::CPU; }
  friend bool operator==(const Device& a, const Device& b) { return a.type == b.type && a.index == b.index; }
};

struct TensorArg {
  bool defined_ = false;
  int64_t dim_ = 0;
  const int64_t* sizes_ = nullptr;    // dim_ values, valid while the tensor lives
  const int64_t* strides_ = nullptr;
  int64_t numel_ = 0;
  ScalarType dtype_ = ScalarType::Undefined;
  Device device_;
  void* data_ = nullptr;              // the first element (storage offset applied)

  bool defined() const { return defined_; }
  int64_t dim() const { return dim_; }
  int64_t size(int64_t d) const { return sizes_[d < 0 ? d + dim_ : d]; }
  int64_t stride(int64_t d) const { return strides_[d < 0 ? d + dim_ : d]; }
  Dims sizes() const { return {sizes_, dim_}; }
  Dims strides() const { return {strides_, dim_}; }
  int64_t numel() const { return numel_; }
  ScalarType scalar_type() const { return dtype_; }
  int64_t element_size() const;
  Device device() const { return device_; }
  const void* const_data_ptr() const { return data_; }
  void* mutable_data_ptr() const { return data_; }
  template <typename T>
  const T* const_data_ptr() const { return static_cast<const T*>(data_); }
  template <typename T>
  T* mutable_data_ptr() const { return static_cast<T*>(data_); }
};

inline int64_t element_size(ScalarType t) {
  switch (t) {
    case ScalarType::Bool: case ScalarType::Byte: case ScalarType::Char: return 1;
    case ScalarType::Short: case ScalarType::Half: case ScalarType::BFloat16: return 2;
    case ScalarType::Int: case ScalarType::Float: return 4;
    case ScalarType::Long: case ScalarType::Double: case ScalarType::ComplexFloat: return 8;
    case ScalarType::ComplexDouble: return 16;
    default: throw std::runtime_error(std::string("rope_ext: no element size known for dtype ") +
                                      torch::headeronly::toString(t));
  }
}
inline int64_t TensorArg::element_size() const { return rope_ext::element_size(dtype_); }

// The product of sizes (a tensor's numel).
inline int64_t product(const int64_t* sizes, int64_t n) {
  int64_t p = 1;
  for (int64_t i = 0; i < n; ++i) p *= sizes[i];
  return p;
}

// What c10 calls is_non_overlapping_and_dense: some permutation of the dims makes the strides
// those of a contiguous tensor (dims of size 1 aside). at::empty_like gives such a tensor's output
// its strides; csrc/stable_tensor.h's new_like does the same.
inline bool non_overlapping_and_dense(const TensorArg& t) {
  const int64_t n = t.dim();
  if (n == 1) return t.size(0) < 2 || t.stride(0) == 1;
  int64_t perm[kMaxDims];
  for (int64_t d = 0; d < n; ++d) perm[d] = d;
  // dims of size < 2 last, the others by increasing stride (insertion sort: n <= kMaxDims)
  const auto before = [&](int64_t a, int64_t b) {
    if (t.size(a) < 2) return false;
    if (t.size(b) < 2) return true;
    return t.stride(a) < t.stride(b);
  };
  for (int64_t i = 1; i < n; ++i) {
    for (int64_t j = i; j > 0 && before(perm[j], perm[j - 1]); --j) std::swap(perm[j], perm[j - 1]);
  }
  int64_t expected = 1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t size = t.size(perm[i]);
    if (size < 2) return true;
    if (t.stride(perm[i]) != expected) return false;
    expected *= size;
  }
  return true;
}

namespace detail {

inline const char* device_type_name(DeviceType t) {
  switch (t) {
    case DeviceType::CPU: return "cpu";
    case DeviceType::CUDA: return "cuda";
    case DeviceType::HIP: return "hip";
    case DeviceType::XPU: return "xpu";
    case DeviceType::MPS: return "mps";
    case DeviceType::Meta: return "meta";
    case DeviceType::XLA: return "xla";
    case DeviceType::HPU: return "hpu";
    case DeviceType::MTIA: return "mtia";
    case DeviceType::PrivateUse1: return "privateuseone";
    default: return "unknown device";
  }
}

inline void put(std::ostream& s, const Dims& d) {
  s << '[';
  for (int64_t i = 0; i < d.n; ++i) s << (i ? ", " : "") << d.data[i];
  s << ']';
}
inline void put(std::ostream& s, const Device& d) {
  s << device_type_name(d.type);
  if (d.index >= 0) s << ':' << d.index;
}
inline void put(std::ostream& s, ScalarType t) { s << torch::headeronly::toString(t); }
template <typename T>
void put(std::ostream& s, const T& v) {
  s << v;
}

}  // namespace detail

// The arguments' text, concatenated as c10::str concatenates them (sizes as "[2, 3]", dtypes as
// "Float", devices as "cuda:0").
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream s;
  (detail::put(s, args), ...);
  return s.str();
}

}  // namespace rope_ext

// Throws std::runtime_error (RuntimeError in Python, as c10::Error was) with the message alone:
// STD_TORCH_CHECK, the stable ABI's, would prefix it with the function, file and line.
#define ROPE_EXT_CHECK(cond, ...)                               \
  do {                                                          \
    if (__builtin_expect(!(cond), 0)) {                         \
      throw std::runtime_error(::rope_ext::str(__VA_ARGS__));   \
    }                                                           \
  } while (0)
