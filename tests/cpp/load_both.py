"""One registration per process: rope_ext's Python extension and the CMake-built librope_ext.so,
loaded into one process in either order, define the op schemas once and each dispatch key's
kernels once (csrc/ops.cpp), and the ops then work, autograd included.

    python load_both.py <path to librope_ext.so> library_first|python_first
"""

import sys

import torch


def load_library(path):
    torch.ops.load_library(path)


def main(path, order):
    if order == "library_first":
        load_library(path)
        import rope_ext
    else:
        import rope_ext

        load_library(path)
    # The library and the extension are two files; both are mapped in.
    maps = open("/proc/self/maps").read()
    assert path in maps or __import__("os").path.realpath(path) in maps, "librope_ext.so is not loaded"
    assert "rope_ext/_C" in maps, "rope_ext._C is not loaded"

    # The schema is defined once, and each dispatch key has one kernel.
    dump = torch._C._dispatch_dump("rope_ext::rotary")
    assert dump.count("schema:") == 1, dump
    for key in ("CPU", "Autograd[alias]"):
        lines = [line for line in dump.splitlines() if line.startswith(f"{key}:")]
        assert len(lines) == 1, f"{key}: {lines}\n{dump}"

    # The ops work, forward and backward, against the pure-PyTorch reference.
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    angles = torch.randn(5, 4, dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    out = rope_ext.rotary(x, cos, sin)
    expected = rope_ext.reference.rotary_reference(x, cos, sin)
    torch.testing.assert_close(out, expected)
    (g,) = torch.autograd.grad(out.sum(), x)
    (g_ref,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(g, g_ref)
    print(f"{order}: one schema, one CPU and one Autograd kernel; rotary and its gradient match the reference")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
