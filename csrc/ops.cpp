// The one place where rope_ext's operator schemas are defined and every kernel is registered.
// Backends provide their kernels through registration.h. Fake (meta) kernels and the autograd
// formulas are registered from Python (rope_ext/_ops.py, rope_ext/_autograd.py); C++ programs get
// autograd from the C++ API's header (rope_ext/autograd.h). Test hooks live in another library,
// librope_ext_testing.so (csrc/testing/), under their own namespace.
//
// Registration happens once per process. rope_ext is one library, librope_ext.so, which the
// Python package loads and C++ programs link, and the dynamic loader maps a file once however
// often it is loaded. A second, different librope_ext.so in the process (another build or
// install) finds the schemas defined when it loads: it registers nothing and warns, where a
// second TORCH_LIBRARY(rope_ext) would abort the process; and the Python package refuses to
// import beside it (rope_ext/__init__.py compares rope_ext::_library_path with its own library).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <dlfcn.h>

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cpu/rotary_cpu.h"
#include "registration.h"
#include "rope_ext/version.h"

// The one symbol of this library that the C++ API's headers call (rope_ext/autograd.h): a program
// that includes them links the library, even with --as-needed, and so loads the ops.
extern "C" __attribute__((visibility("default"))) const char* rope_ext_library_version() { return ROPE_EXT_VERSION; }

namespace rope_ext {
namespace {

// The file this code was loaded from, as the dynamic loader names it.
std::string this_library() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&this_library), &info) == 0 || info.dli_fname == nullptr) return "";
  return info.dli_fname;
}

void define_schemas(torch::Library& m) {
  // out = x * cos + R(x) * sin on the first r = cos.size(-1) columns of x; the rest pass
  // through. R pairs columns (i, i + r/2), or (2i, 2i + 1) when interleaved. conjugate
  // applies the transpose of that linear map. cos/sin broadcast against x.shape[:-1] + (r,).
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> Tensor");

  // rotary on q and on k in one call: (rotary(q, cos, sin), rotary(k, cos_k, sin_k)), where
  // cos_k/sin_k default to cos/sin (separate tables serve xPos). q and k may differ in head
  // count and in strides, not in dtype.
  m.def(
      "rotary_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved=False, "
      "Tensor? cos_k=None, Tensor? sin_k=None, bool conjugate=False) -> (Tensor, Tensor)");

  // In-place rotary for inference: x = rotary(x, cos, sin). Refuses inputs that need grad.
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> ()");

  // RoPE by positions: the tables are rows of half-width caches, cos_cache/sin_cache of shape
  // (max_positions, r/2) holding cos and sin of p * theta_i for pair i, gathered inside the kernel
  // at positions (int32/int64, broadcasting against x.shape[:-1]). Otherwise as rotary: both
  // pairings, partial rotary, any strides; conjugate rotates by -theta. A position outside
  // [0, max_positions) is an error (CPU) or a device-side assert (CUDA), never a read.
  m.def(
      "rotary_pos(Tensor x, Tensor cos_cache, Tensor sin_cache, Tensor positions, bool interleaved=False, "
      "bool conjugate=False) -> Tensor");

  // rotary_pos on q and k in one call (one CUDA launch); they share positions and caches and may
  // differ in head count (GQA/MQA) and strides.
  m.def(
      "rotary_pos_qk(Tensor q, Tensor k, Tensor cos_cache, Tensor sin_cache, Tensor positions, "
      "bool interleaved=False, bool conjugate=False) -> (Tensor, Tensor)");

  // In-place rotary_pos on q and, if given, k (vLLM's rotary_embedding). Refuses inputs that need grad.
  m.def(
      "rotary_pos_(Tensor(a!) q, Tensor(b!)? k, Tensor cos_cache, Tensor sin_cache, Tensor positions, "
      "bool interleaved=False, bool conjugate=False) -> ()");

  // rope_ext's version (rope_ext/version.h), and the file of the library that registered these
  // schemas (see the top of this file).
  m.def("_version() -> str", []() -> std::string { return ROPE_EXT_VERSION; });
  m.def("_library_path() -> str", &this_library);

  // Which CPU kernel variant runs in this process: "AVX512", "AVX2" or "DEFAULT".
  m.def("cpu_kernel_isa() -> str", &rope_ext::cpu::kernel_isa);
}

// The library that registered the schemas, for a copy that finds them registered. Never throws:
// it runs while a library loads, where an exception would abort the host.
std::string registered_by() {
  try {
    const auto op = c10::Dispatcher::singleton().findSchema({"rope_ext::_library_path", ""});
    return op.has_value() ? op->typed<std::string()>().call() : "(a rope_ext without rope_ext::_library_path)";
  } catch (const std::exception& e) {
    return std::string("(unknown: rope_ext::_library_path failed: ") + e.what() + ")";
  }
}

class Registration {
 public:
  // Never throws (see registered_by): a failure is a warning, and the ops it left out fail with
  // the dispatcher's own error when called.
  Registration() {
    try {
      if (c10::Dispatcher::singleton().findSchema({"rope_ext::rotary", ""}).has_value()) {
        TORCH_WARN("rope_ext ", ROPE_EXT_VERSION, " at ", this_library(),
                   " registers nothing: the rope_ext operators in this process were registered by ",
                   registered_by(), ", loaded first, whose kernels serve every call. Load one "
                   "librope_ext.so per process.");
        return;
      }
      add(torch::Library::DEF, std::nullopt, &define_schemas);
      add(torch::Library::IMPL, c10::DispatchKey::CPU, &register_cpu_kernels);
#ifdef ROPE_EXT_CUDA
      add(torch::Library::IMPL, c10::DispatchKey::CUDA, &register_cuda_kernels);
#endif
    } catch (const std::exception& e) {
      TORCH_WARN("rope_ext ", ROPE_EXT_VERSION, ": registering the rope_ext operators failed: ", e.what());
    }
  }

 private:
  void add(torch::Library::Kind kind, std::optional<c10::DispatchKey> key, void (*fill)(torch::Library&)) {
    libraries_.push_back(std::make_unique<torch::Library>(kind, "rope_ext", key, __FILE__, __LINE__));
    fill(*libraries_.back());
  }
  // Alive as long as the library is loaded: a torch::Library deregisters what it registered
  // when destroyed.
  std::vector<std::unique_ptr<torch::Library>> libraries_;
};

const Registration registration;

}  // namespace
}  // namespace rope_ext
