"""Two copies of rope_ext in one process: the Python extension and the CMake-built librope_ext.so.

    python load_both.py <path to librope_ext.so> <case>

library_first, python_first
    Loaded in either order, they define the op schemas once and each dispatch key's kernels once
    (csrc/ops.cpp), and the ops then work, autograd included.
library_unloaded
    librope_ext.so is linked with -z nodelete (its DT_FLAGS_1 says NODELETE). It registers first
    and is then dlclose()d: it stays loaded, so the ops the Python package calls keep their
    schemas and kernels. (A GCC build would stay loaded without the flag too, pinned by its
    STB_GNU_UNIQUE symbols; clang emits none, so the flag check is what guards this.)
other_version_first, unversioned_first
    Another rope_ext (here: schemas defined from Python) registered the operators first, with
    another version or with no rope_ext::_version op: librope_ext.so registers nothing and warns
    when it loads, naming both versions. (tests/test_version.py checks that the Python package refuses to import.)
"""

import ctypes
import os
import subprocess
import sys
import tempfile

import torch


def check_registered_once_and_working():
    # The schema is defined once, and each dispatch key has one kernel.
    dump = torch._C._dispatch_dump("rope_ext::rotary")
    assert dump.count("schema:") == 1, dump
    for key in ("CPU", "Autograd[alias]"):
        lines = [line for line in dump.splitlines() if line.startswith(f"{key}:")]
        assert len(lines) == 1, f"{key}: {lines}\n{dump}"

    # The ops work, forward and backward, against the pure-PyTorch reference.
    import rope_ext

    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    angles = torch.randn(5, 4, dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    out = rope_ext.rotary(x, cos, sin)
    expected = rope_ext.reference.rotary_reference(x, cos, sin)
    torch.testing.assert_close(out, expected)
    (g,) = torch.autograd.grad(out.sum(), x)
    (g_ref,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(g, g_ref)


def mapped(path):
    maps = open("/proc/self/maps").read()
    return path in maps or os.path.realpath(path) in maps


def load_capturing_stderr(path):
    """Load the library; what it writes to file descriptor 2 meanwhile (C++ warnings go there)."""
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            torch.ops.load_library(path)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        return captured.read().decode()


def both_orders(path, order):
    if order == "library_first":
        torch.ops.load_library(path)
        import rope_ext  # noqa: F401
    else:
        import rope_ext  # noqa: F401

        torch.ops.load_library(path)
    # The library and the extension are two files; both are mapped in.
    assert mapped(path), "librope_ext.so is not loaded"
    assert "rope_ext/_C" in open("/proc/self/maps").read(), "rope_ext._C is not loaded"
    check_registered_once_and_working()
    print(f"{order}: one schema, one CPU and one Autograd kernel; rotary and its gradient match the reference")


def library_unloaded(path):
    import _ctypes

    dynamic = subprocess.run(["readelf", "--dynamic", path], capture_output=True, text=True, check=True).stdout
    flags = [line for line in dynamic.splitlines() if "(FLAGS_1)" in line]
    assert flags and "NODELETE" in flags[0].split(), f"{path} is not linked with -z nodelete: {flags}"

    library = ctypes.CDLL(path)  # registers the schemas and every kernel
    import rope_ext  # noqa: F401  (registers nothing: every key has its kernel)

    _ctypes.dlclose(library._handle)
    assert mapped(path), "dlclose() unloaded librope_ext.so, and with it the ops"
    check_registered_once_and_working()
    print("library_unloaded: librope_ext.so stays loaded after dlclose(); the ops still work")


def another_copy_first(path, other_version):
    first = torch.library.Library("rope_ext", "DEF")
    first.define("rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> Tensor")
    if other_version is not None:
        first.define("_version() -> str")
        first.impl("_version", lambda: other_version, "CompositeExplicitAutograd")
    described = other_version or "(a version without rope_ext::_version)"

    warning = load_capturing_stderr(path)
    expected = f"is loaded into a process where rope_ext {described} registered the rope_ext operators first"
    assert expected in warning, f"no warning from librope_ext.so saying {expected!r}; it wrote {warning!r}"
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    added = [key for key in ("CPU", "Autograd") if has_kernel("rope_ext::rotary", key)]
    assert not added, f"librope_ext.so added its {added} kernels to another version's schemas"
    print(f"another copy first, {described}: librope_ext.so warned: {warning.strip()}")


def main(path, case):
    if case in ("library_first", "python_first"):
        both_orders(path, case)
    elif case == "library_unloaded":
        library_unloaded(path)
    elif case == "other_version_first":
        another_copy_first(path, "0.0.1-other")
    elif case == "unversioned_first":
        another_copy_first(path, None)
    else:
        raise SystemExit(f"unknown case {case!r}; see the docstring")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
