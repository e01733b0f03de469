// The one place where rope_ext's operator schemas are defined and every kernel is registered.
// Backends provide their kernels through registration.h. Fake (meta) kernels and the autograd
// formulas are registered from Python (rope_ext/_ops.py, rope_ext/_autograd.py); C++ programs get
// autograd from the C++ API's header (rope_ext/autograd.h). Test hooks live in another library,
// librope_ext_testing.so (csrc/testing/), under their own namespace.
//
// The library is built on torch's stable ABI (TORCH_TARGET_VERSION, CMakeLists.txt): it registers
// through torch/csrc/stable's C interface, not torch::Library.
//
// Registration happens once per process. rope_ext is one library, librope_ext.so, which the
// Python package loads and C++ programs link, and the dynamic loader maps a file once however
// often it is loaded. A second, different librope_ext.so in the process (another build or
// install) finds the namespace defined when it loads: it registers nothing and warns, where a
// second STABLE_TORCH_LIBRARY(rope_ext) would leave its library half made; and the Python package
// refuses to import beside it (rope_ext/__init__.py compares rope_ext::_library_path with its own
// library).
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/stableivalue_conversions.h>
#include <dlfcn.h>

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cpu/rotary_cpu.h"
#include "qk_norm_schemas.h"
#include "registration.h"
#include "rope_ext/version.h"
#include "stable_tensor.h"

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

std::string version() { return ROPE_EXT_VERSION; }

// The schemas, into the library that defines the namespace.
void define_schemas(TorchLibraryHandle lib) {
  const auto def = [lib](const char* schema) {
    detail::shim_check(aoti_torch_library_def(lib, schema), "aoti_torch_library_def");
  };
  // out = x * cos + R(x) * sin on the first r = cos.size(-1) columns of x; the rest pass
  // through. R pairs columns (i, i + r/2), or (2i, 2i + 1) when interleaved. conjugate
  // applies the transpose of that linear map. cos/sin broadcast against x.shape[:-1] + (r,).
  def("rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> Tensor");

  // rotary on q and on k in one call: (rotary(q, cos, sin), rotary(k, cos_k, sin_k)), where
  // cos_k/sin_k default to cos/sin (separate tables serve xPos). q and k may differ in head
  // count and in strides, not in dtype.
  def(
      "rotary_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved=False, "
      "Tensor? cos_k=None, Tensor? sin_k=None, bool conjugate=False) -> (Tensor, Tensor)");

  // In-place rotary for inference: x = rotary(x, cos, sin). Refuses inputs that need grad.
  def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> ()");

  // RoPE by positions: the tables are rows of half-width caches, cos_cache/sin_cache of shape
  // (max_positions, r/2) holding cos and sin of p * theta_i for pair i, gathered inside the kernel
  // at positions (int32/int64, broadcasting against x.shape[:-1]). Otherwise as rotary: both
  // pairings, partial rotary, any strides; conjugate rotates by -theta. A position outside
  // [0, max_positions) is an error (CPU) or a device-side assert (CUDA), never a read.
  def(
      "rotary_pos(Tensor x, Tensor cos_cache, Tensor sin_cache, Tensor positions, bool interleaved=False, "
      "bool conjugate=False) -> Tensor");

  // rotary_pos on q and k in one call (one CUDA launch); they share positions and caches and may
  // differ in head count (GQA/MQA) and strides.
  def(
      "rotary_pos_qk(Tensor q, Tensor k, Tensor cos_cache, Tensor sin_cache, Tensor positions, "
      "bool interleaved=False, bool conjugate=False) -> (Tensor, Tensor)");

  // In-place rotary_pos on q and, if given, k (vLLM's rotary_embedding). Refuses inputs that need grad.
  def(
      "rotary_pos_(Tensor(a!) q, Tensor(b!)? k, Tensor cos_cache, Tensor sin_cache, Tensor positions, "
      "bool interleaved=False, bool conjugate=False) -> ()");

  // QK-norm + RoPE (qk_norm_schemas.h says what each computes).
  for (const OpSchema& schema : kQkNormSchemas) def(str(schema.name, schema.signature).c_str());

  // rope_ext's version (rope_ext/version.h), and the file of the library that registered these
  // schemas (see the top of this file).
  def("_version() -> str");
  def("_library_path() -> str");

  // Which CPU kernel variant runs in this process: "AVX512", "AVX2" or "DEFAULT".
  def("cpu_kernel_isa() -> str");
}

// The kernels of the ops without tensors.
void register_info(Library& m) {
  m.impl("_version", TORCH_BOX(&version));
  m.impl("_library_path", TORCH_BOX(&this_library));
  m.impl("cpu_kernel_isa", TORCH_BOX(&cpu::kernel_isa));
}

// The library that registered the schemas, for a copy that finds them registered. Never throws:
// it runs while a library loads, where an exception would abort the host. (The stable ABI reports
// only that a call failed, not why: a copy without rope_ext::_library_path and one whose
// _library_path fails read alike. libtorch logs the reason.)
std::string registered_by() {
  try {
    StableIValue stack[1] = {};
    if (aoti_torch_call_dispatcher("rope_ext::_library_path", "", stack) != AOTI_TORCH_SUCCESS) {
      return "(a rope_ext whose rope_ext::_library_path is missing or failed)";
    }
    return torch::stable::detail::to<std::string>(stack[0]);
  } catch (const std::exception& e) {
    return std::string("(unknown: ") + e.what() + ")";
  }
}

void warn(const std::string& message) { aoti_torch_warn(__func__, __FILE__, __LINE__, message.c_str()); }

class Registration {
 public:
  // Never throws (see registered_by): a failure is a warning, and the ops it left out fail with
  // the dispatcher's own error when called.
  Registration() {
    try {
      // Defining the namespace fails where it is defined already (libtorch logs why).
      if (aoti_torch_library_init_def("rope_ext", __FILE__, __LINE__, &def_) != AOTI_TORCH_SUCCESS) {
        def_ = nullptr;
        warn(str("rope_ext ", ROPE_EXT_VERSION, " at ", this_library(),
                 " registers nothing: the rope_ext operators in this process were registered by ", registered_by(),
                 ", loaded first, whose kernels serve every call. Load one librope_ext.so per process."));
        return;
      }
      define_schemas(def_);
      add("CompositeExplicitAutograd", &register_info);
      add("CPU", &register_cpu_kernels);
#ifdef ROPE_EXT_CUDA
      add("CUDA", &register_cuda_kernels);
#endif
    } catch (const std::exception& e) {
      warn(str("rope_ext ", ROPE_EXT_VERSION, ": registering the rope_ext operators failed: ", e.what()));
    }
  }
  ~Registration() {
    impls_.clear();  // the kernels before the schemas they implement
    if (def_ != nullptr) aoti_torch_delete_library_object(def_);
  }
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

 private:
  void add(const char* key, void (*fill)(Library&)) {
    impls_.push_back(std::make_unique<Library>(Library::Kind::IMPL, "rope_ext", key, __FILE__, __LINE__));
    fill(*impls_.back());
  }
  // Alive as long as the library is loaded: a library object deregisters what it registered
  // when destroyed.
  TorchLibraryHandle def_ = nullptr;
  std::vector<std::unique_ptr<Library>> impls_;
};

const Registration registration;

}  // namespace
}  // namespace rope_ext
