"""The private torch names rope_ext uses (rope_ext/_torch_private.py), each checked to exist and do
what rope_ext relies on: a torch release that changes one fails here, by name."""
from __future__ import annotations

import pytest
import torch
from torch.nn.modules import module as torch_module

import rope_ext
from rope_ext import _torch_private as private


def test_kernel_is_the_ops_own_call():
    op = torch.ops.rope_ext.rotary.default
    x = torch.randn(2, 3, 4, 8, generator=torch.Generator().manual_seed(0))
    cos, sin = torch.randn(3, 1, 4).cos(), torch.randn(3, 1, 4).sin()
    assert callable(private.kernel(op))
    assert torch.equal(private.kernel(op)(x, cos, sin, False, False), op(x, cos, sin, False, False))


def test_any_requires_grad():
    a, b = torch.ones(2), torch.ones(2, requires_grad=True)
    assert private.any_requires_grad(a, b) and not private.any_requires_grad(a, a.detach())
    assert not private.any_requires_grad(a, None)


def test_below_autograd_records_no_graph():
    x = torch.randn(1, 2, 1, 4, requires_grad=True)
    cos, sin = torch.ones(2, 1, 2), torch.zeros(2, 1, 2)
    assert rope_ext.rotary(x, cos, sin).grad_fn is not None
    with private.below_autograd():
        assert torch.ops.rope_ext.rotary.default(x, cos, sin, False, False).grad_fn is None


@pytest.mark.parametrize("register", [torch_module.register_module_forward_hook,
                                      torch_module.register_module_forward_pre_hook,
                                      torch_module.register_module_full_backward_hook,
                                      torch_module.register_module_full_backward_pre_hook])
def test_hooked_sees_a_hook_for_every_module(register):
    m = torch.nn.Linear(2, 2)
    assert not private.hooked(m)
    handle = register(lambda *args: None)
    try:
        assert private.hooked(m)
    finally:
        handle.remove()
    assert not private.hooked(m)


@pytest.mark.parametrize("register", ["register_forward_hook", "register_forward_pre_hook",
                                      "register_full_backward_hook", "register_full_backward_pre_hook"])
def test_hooked_sees_a_modules_own_hook(register):
    m, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    handle = getattr(m, register)(lambda *args: None)
    assert private.hooked(m) and not private.hooked(other)
    handle.remove()
    assert not private.hooked(m)


def test_version_counters_and_dispatch_keys():
    t = torch.zeros(3)
    before = t._version
    private.increment_version([t])
    assert t._version == before + 1
    assert private.dispatch_keys(t).has(torch._C.DispatchKey.CPU)
    assert not private.dispatch_keys(t).has(private.PYTHON_KEY)
    assert isinstance(private.after_autograd_keyset, torch._C.DispatchKeySet)


def test_assert_async_checks_without_a_sync():
    private.assert_async(torch.tensor(True), "never")
    with pytest.raises(RuntimeError, match="checked"):
        private.assert_async(torch.tensor(False), "checked")


def test_has_kernel_for_dispatch_key():
    has_kernel = private.has_kernel_for_dispatch_key
    assert has_kernel is not None, "python -m rope_ext.info cannot say whether the CUDA kernels are registered"
    assert has_kernel("rope_ext::rotary", "CPU") and not has_kernel("rope_ext::rotary", "XLA")
