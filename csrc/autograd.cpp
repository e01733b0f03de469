// Autograd-key kernels written in C++ (device-agnostic). rotary and rotary_qk get their
// formulas from rope_ext/_ops.py; the in-place op has none by design and lives here.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

namespace rope_ext {
namespace {

// rotary_ is for inference. Rather than record a wrong (or no) gradient, it refuses inputs
// that need one, and bumps x's version counter so that a tensor saved for someone else's
// backward and then rotated in place raises autograd's "modified by an inplace operation".
void rotary_inplace_autograd(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                             bool interleaved, bool conjugate) {
  if (at::GradMode::is_enabled()) {
    const char* needs = x.requires_grad()     ? "x"
                        : cos.requires_grad() ? "cos"
                        : sin.requires_grad() ? "sin"
                                              : nullptr;
    TORCH_CHECK(needs == nullptr, "rope_ext.rotary_: ", needs,
                " requires grad, but the in-place op records no gradient. Use rope_ext.rotary "
                "(out of place) for training, or call rotary_ under torch.no_grad() or "
                "torch.inference_mode()");
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("rope_ext::rotary_", "")
                               .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool)>();
    op.call(x, cos, sin, interleaved, conjugate);
  }
  if (!x.is_inference()) torch::autograd::impl::bump_version(x);
}

}  // namespace
}  // namespace rope_ext

TORCH_LIBRARY_IMPL(rope_ext, Autograd, m) { m.impl("rotary_", &rope_ext::rotary_inplace_autograd); }
