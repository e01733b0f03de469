// The one place where rope_ext's operator schemas are defined and every kernel is registered.
// Backends provide their kernels through registration.h; fake (meta) kernels are registered from
// Python in rope_ext/_ops.py.
//
// Registration happens once per process, even when two copies of this code are loaded: the
// Python extension (rope_ext/_C*.so) and the C++ library of the CMake build (librope_ext.so),
// say in a C++ program that embeds Python. Each copy defines the schemas only if no copy has,
// and registers a dispatch key's kernels only if that key has none yet, so the first copy
// serves and a later CUDA-enabled copy still adds its CUDA kernels. (TORCH_LIBRARY would abort
// the second load: it allows one definition of a namespace per process.) The copies must be the
// same version: a later copy of another version registers nothing and warns when it loads (and
// the Python package refuses to import), since the first copy's kernels would serve its calls.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <memory>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "cpu/rotary_cpu.h"
#include "frequencies.h"
#include "registration.h"
#include "rope_ext/version.h"

namespace rope_ext {
namespace {

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

  // The version of the rope_ext copy that registered these schemas (rope_ext/version.h).
  m.def("_version() -> str", []() -> std::string { return ROPE_EXT_VERSION; });

  // Which CPU kernel variant runs in this process: "AVX512", "AVX2" or "DEFAULT".
  m.def("cpu_kernel_isa() -> str", &rope_ext::cpu::kernel_isa);

  // Test hooks: the CUDA kernels' thread function run on the CPU over the launch grid the CUDA
  // launcher would choose (csrc/cuda/host_emulation.cpp), with the semantics of the real ops,
  // and that launch: [grid_x, grid_y, block_x, block_y, vec, pairs_per_item, rot_items, pass_items].
  m.def("_cuda_emulate_rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> Tensor");
  m.def(
      "_cuda_emulate_rotary_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved=False, "
      "Tensor? cos_k=None, Tensor? sin_k=None, bool conjugate=False) -> (Tensor, Tensor)");
  m.def("_cuda_emulate_rotary_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> ()");
  m.def("_cuda_launch_config(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> int[]");

  // Test hook: how many threads at::parallel_for uses for n items, as built here.
  m.def("_parallel_threads_used(int n) -> int", &rope_ext::cpu::parallel_threads_used);

  // Test hooks (private, process-wide): the sizes at which the CPU kernel changes path
  // (cpu::Thresholds, whose defaults rotary_cpu.cpp gives), in this order, and their replacement
  // for every caller in the process. Tests lower them so that small tensors take the paths that
  // otherwise only large ones reach, and read how often each path ran (cpu::PathCounts, in order).
  m.def("_cpu_thresholds() -> int[]", []() -> std::vector<int64_t> {
    const cpu::Thresholds t = cpu::thresholds();
    return {t.streaming_bytes, t.huge_page_bytes, t.grain_elements, t.tile_tokens, t.min_heads_per_thread};
  });
  m.def(
      "_set_cpu_thresholds(int streaming_bytes, int huge_page_bytes, int grain_elements, int tile_tokens, "
      "int min_heads_per_thread) -> ()",
      [](int64_t streaming, int64_t huge, int64_t grain, int64_t tile, int64_t min_heads) {
        cpu::set_thresholds({streaming, huge, grain, tile, min_heads});
      });
  m.def("_cpu_path_counts() -> int[]", []() -> std::vector<int64_t> {
    const cpu::PathCounts& c = cpu::path_counts();
    return {c.streamed_rows.load(), c.huge_page_outputs.load(), c.head_split_walks.load(),
            c.token_split_walks.load()};
  });

  // Frequencies and tables (frequencies.cpp; the C++ API's rope_frequencies, inv_freq_for and
  // cos_sin_tables). Composite: under torch.compile they trace into ATen ops.
  m.def(
      "_rope_frequencies(str rope_type, float base, int rotary_dim, int max_position_embeddings, "
      "float? factor=None, int? original_max_position_embeddings=None, float? attention_factor=None, "
      "float? beta_fast=None, float? beta_slow=None, float? mscale=None, float? mscale_all_dim=None, "
      "bool truncate=True, float? low_freq_factor=None, float? high_freq_factor=None, "
      "float[] short_factor=[], float[] long_factor=[]) -> (Tensor, Tensor, float, int, float)",
      &rope_frequencies_op);
  m.def(
      "_inv_freq_for(Tensor inv_freq, Tensor? inv_freq_long, str rope_type, float base, int rotary_dim, "
      "int switch_len, float factor, Tensor max_position) -> Tensor",
      &inv_freq_for_length);
  m.def(
      "cos_sin_tables(Tensor positions, Tensor inv_freq, bool interleaved=False, float scale=1.0, "
      "ScalarType? dtype=None) -> (Tensor, Tensor)",
      &cos_sin_tables_impl);
}

bool defined() {
  return c10::Dispatcher::singleton().findSchema({"rope_ext::rotary", ""}).has_value();
}

bool has_kernel(c10::DispatchKey key) {
  const auto op = c10::Dispatcher::singleton().findSchema({"rope_ext::rotary", ""});
  return op.has_value() && op->hasKernelForDispatchKey(key);
}

// The version of the copy that registered the schemas, for a copy that finds them registered.
// Never throws: it runs while a library loads, where an exception would abort the host.
std::string registered_version() {
  try {
    const auto op = c10::Dispatcher::singleton().findSchema({"rope_ext::_version", ""});
    if (!op.has_value()) return "(a version without rope_ext::_version)";
    return op->typed<std::string()>().call();
  } catch (const std::exception& e) {
    return std::string("(unknown: rope_ext::_version failed: ") + e.what() + ")";
  }
}

void register_cpu(torch::Library& m) {
  register_cpu_kernels(m);
  register_cuda_emulation(m);
}

class Registration {
 public:
  // Never throws (see registered_version): a failure is a warning, and the ops it left out fail
  // with the dispatcher's own error when called.
  Registration() {
    try {
      register_what_is_missing();
    } catch (const std::exception& e) {
      TORCH_WARN("rope_ext ", ROPE_EXT_VERSION, ": registering the rope_ext operators failed: ", e.what());
    }
  }

 private:
  void register_what_is_missing() {
    if (defined()) {
      // Two copies of one version share the registrations. A copy of another version adds
      // nothing to the first copy's (its kernels under that copy's schemas would mix the two);
      // its calls run the first copy's kernels, which it can only say loudly. The Python package
      // then refuses to import (rope_ext/__init__.py).
      const std::string first = registered_version();
      if (first != ROPE_EXT_VERSION) {
        TORCH_WARN(
            "rope_ext ", ROPE_EXT_VERSION, " is loaded into a process where rope_ext ", first,
            " registered the rope_ext operators first; this copy registers nothing, and calls from it "
            "will run that version's kernels. Load a single version of rope_ext (its Python package and "
            "librope_ext.so alike) per process.");
        return;
      }
    } else {
      add(torch::Library::DEF, std::nullopt, &define_schemas);
    }
    if (!has_kernel(c10::DispatchKey::CPU)) add(torch::Library::IMPL, c10::DispatchKey::CPU, &register_cpu);
#ifdef ROPE_EXT_CUDA
    if (!has_kernel(c10::DispatchKey::CUDA)) {
      add(torch::Library::IMPL, c10::DispatchKey::CUDA, &register_cuda_kernels);
    }
#endif
    if (!has_kernel(c10::DispatchKey::Autograd)) {
      add(torch::Library::IMPL, c10::DispatchKey::Autograd, &register_autograd_kernels);
    }
  }

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
