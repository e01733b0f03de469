"""Every private torch name rope_ext's Python code uses, each where no public API does the job, in
one place.
tests/test_torch_private.py checks that each still exists and still does what rope_ext relies on,
so a torch release that changes one fails there, by name, rather than somewhere downstream.

Each is on a hot path (a call that records no graph, a decode step's rotation, an attention's
per-call checks) or in an in-place op's autograd kernel:

- ``kernel(op)``: an OpOverload's C++ callable (``OpOverload._op``). Calling it skips
  ``OpOverload.__call__``'s Python frame.
- ``any_requires_grad(*tensors)`` (``torch._C._any_requires_grad``): one C++ call for what a Python
  loop over ``requires_grad`` does, on every public wrapper's call.
- ``below_autograd`` (``torch._C._AutoDispatchBelowAutograd``): the guard the C++ autograd kernels
  use. Op calls inside it go straight to the device kernel. torch has no public equivalent.
- ``hooked(module)``: whether a call of the module runs a hook, its own or one registered for every
  module (``torch.nn.modules.module.register_module_forward_hook`` and its kin). torch exposes the
  registration, not the dicts it fills (``Module._forward_hooks``, ``_global_forward_hooks``, ...).
- ``increment_version(tensors)`` (``torch._C._increment_version``): an in-place op run below autograd
  bumps the version counters the autograd kernel would have.
- ``after_autograd_keyset`` and ``dispatch_keys(t)`` (``torch._C``): redispatching below autograd,
  and telling a tensor subclass (the Python key) apart.
- ``assert_async(cond, message)`` (``torch._assert_async``): a check of device values that does not
  wait for the device (a forward makes no host sync).
- ``has_kernel_for_dispatch_key`` (``torch._C._dispatch_has_kernel_for_dispatch_key``, None where a
  torch lacks it): ``python -m rope_ext.info`` asks whether the CUDA kernels are registered.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as _module

_C = torch._C

below_autograd = _C._AutoDispatchBelowAutograd
any_requires_grad = _C._any_requires_grad
increment_version = _C._increment_version
after_autograd_keyset = _C._after_autograd_keyset
dispatch_keys = _C._dispatch_keys
PYTHON_KEY = _C.DispatchKey.Python
assert_async = torch._assert_async
has_kernel_for_dispatch_key = getattr(_C, "_dispatch_has_kernel_for_dispatch_key", None)


def kernel(op: torch._ops.OpOverload):
    """The op's C++ callable: the same call as ``op(...)``, one Python frame fewer."""
    return op._op


def hooked(module: torch.nn.Module) -> bool:
    """Whether calling the module runs a hook: one of its own, or one registered for every module
    (forward, forward pre, backward, backward pre). (Written out: it runs for each q/k norm at each
    fused attention call.)"""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or _module._global_backward_pre_hooks)
