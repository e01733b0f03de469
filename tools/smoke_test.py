"""Smoke test of an installed rope_ext, run from outside any checkout (make dist-check).

Forward and backward against the rotate_half formula written out here, opcheck, torch.compile with
fullgraph=True, and RotaryEmbedding: enough to show that the wheel's binary loads into this torch,
registers its ops, and computes. Exits non-zero on the first failure.
"""
import pathlib

import torch

import rope_ext

here = pathlib.Path(rope_ext.__file__).resolve().parent
assert "site-packages" in here.parts, f"rope_ext imported from {here}, not from an installed wheel"
library = pathlib.Path(torch.ops.rope_ext._library_path()).resolve()
assert library == pathlib.Path(rope_ext._LIBRARY) and library.parent == here / "lib", f"the ops came from {library}"
hooks = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("rope_ext_testing::")]
assert not hooks, f"the installed package registers test hooks: {hooks}"


def rotate_half_reference(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


B, S, H, D = 2, 8, 4, 64
angles = torch.arange(S, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
angles = torch.cat((angles, angles), dim=-1)[:, None]  # (S, 1, D): broadcast over heads
cos, sin = angles.cos(), angles.sin()
x = torch.randn(B, S, H, D, dtype=torch.float64, requires_grad=True)

out = rope_ext.rotary(x, cos, sin)
torch.testing.assert_close(out, rotate_half_reference(x, cos, sin))
g = torch.randn_like(out)
(dx,) = torch.autograd.grad(out, x, g)
(dx_ref,) = torch.autograd.grad(rotate_half_reference(x, cos, sin), x, g)
torch.testing.assert_close(dx, dx_ref)
xs = x[:1, :, :1].detach().clone().requires_grad_()
assert torch.autograd.gradcheck(lambda t: rope_ext.rotary(t, cos, sin), (xs,))

torch.library.opcheck(torch.ops.rope_ext.rotary.default, (x.detach().float(), cos.float(), sin.float()))
torch.library.opcheck(torch.ops.rope_ext.rotary.default, (x.detach().requires_grad_(), cos, sin))

compiled = torch.compile(lambda t: rope_ext.rotary(t, cos.float(), sin.float()), fullgraph=True)
xf = x.detach().float()
torch.testing.assert_close(compiled(xf), rope_ext.rotary(xf, cos.float(), sin.float()), rtol=0, atol=0)

rope = rope_ext.RotaryEmbedding(D, layout="bhsd")  # layout (B, H, S, D)
q, k = torch.randn(B, H, S, D), torch.randn(B, 1, S, D)
q_out, k_out = rope(q, k)
table_cos, table_sin = cos.float().transpose(0, 1), sin.float().transpose(0, 1)  # (1, S, D)
torch.testing.assert_close(q_out, rotate_half_reference(q, table_cos, table_sin))
torch.testing.assert_close(k_out, rotate_half_reference(k, table_cos, table_sin))

print(f"smoke test passed: rope_ext {rope_ext.__version__} ({rope_ext.cpu_kernel_isa()} kernel) "
      f"from {here}, torch {torch.__version__}")
