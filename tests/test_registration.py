"""One library, one registration: what `import rope_ext` loads, and what a second load does.

rope_ext is one file, rope_ext/lib/librope_ext.so, which the Python package loads and C++ programs
link (find_package(rope_ext) through rope_ext.cmake_prefix_path). Loading that file again is
harmless: the dynamic loader maps it once. A different librope_ext.so in the same process registers
nothing and warns, and the Python package refuses to import beside one loaded first (csrc/ops.cpp).
Each process-level case runs in a fresh interpreter.
"""
from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rope_ext

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "include" / "rope_ext" / "version.h"
PACKAGE = Path(rope_ext.__file__).resolve().parent
LIB = Path(rope_ext._LIBRARY)
PUBLIC_OPS = {"rotary", "rotary_qk", "rotary_", "rotary_pos", "rotary_pos_qk", "rotary_pos_", "qk_norm_rotary",
              "qk_norm_rotary_pos", "qk_norm_rotary_backward", "qk_norm_rotary_", "qk_norm_rotary_pos_", "norm_rotary",
              "cpu_kernel_isa", "_version", "_library_path"}


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_one_version_everywhere():
    """The header's version is the package's, its metadata's and the library's."""
    (header,) = re.findall(r'^#define ROPE_EXT_VERSION "(\d+\.\d+\.\d+)"$', HEADER.read_text(), re.M)
    assert rope_ext.__version__ == header
    assert importlib.metadata.version("rope_ext") == header
    assert torch.ops.rope_ext._version() == header


def test_the_package_holds_one_library_for_python_and_cmake():
    """librope_ext.so registered the ops; beside it are the headers and the CMake package that
    find_package(rope_ext) reads from rope_ext.cmake_prefix_path (tests/cpp builds against them),
    and no Python extension module."""
    assert Path(torch.ops.rope_ext._library_path()).resolve() == LIB
    major_minor = ".".join(rope_ext.__version__.split(".")[:2])
    assert LIB == PACKAGE / "lib" / f"librope_ext.so.{major_minor}"
    soname = subprocess.run(["readelf", "-d", str(LIB)], capture_output=True, text=True, check=True).stdout
    assert f"Library soname: [librope_ext.so.{major_minor}]" in soname  # a program built against
    # another 0.x release, whose API structs differ, fails to load instead of misreading them
    prefix = Path(rope_ext.cmake_prefix_path)
    for f in (f"lib/librope_ext.so.{major_minor}", "include/rope_ext/rope.h", "include/rope_ext/version.h",
              "include/rope_ext/errors.h", "lib/cmake/rope_ext/rope_extConfig.cmake",
              "lib/cmake/rope_ext/rope_extConfigVersion.cmake", "lib/cmake/rope_ext/rope_extTargets.cmake"):
        assert (prefix / f).is_file(), f
    assert sorted(p.name for p in PACKAGE.glob("*.so")) == []
    targets = "".join(p.read_text() for p in (prefix / "lib" / "cmake" / "rope_ext").glob("rope_extTargets*.cmake"))
    assert f"${{_IMPORT_PREFIX}}/lib/librope_ext.so.{major_minor}" in targets


def test_the_product_registers_no_test_hooks():
    """A fresh `import rope_ext` registers exactly the public and private rope_ext ops, none of the
    test hooks (librope_ext_testing.so, which only the tests load)."""
    run = run_python(
        "import torch, rope_ext\n"
        "print(sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith('rope_ext')))"
    )
    assert run.returncode == 0, run.stderr
    assert eval(run.stdout) == sorted(f"rope_ext::{op}" for op in PUBLIC_OPS)


CHECK_REGISTERED_ONCE = """
dump = torch._C._dispatch_dump("rope_ext::rotary")
assert dump.count("schema:") == 1, dump
for key in ("CPU", "Autograd[alias]"):
    assert len([l for l in dump.splitlines() if l.startswith(key + ":")]) == 1, dump
x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
angles = torch.randn(5, 4, dtype=torch.float64)
cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
out = rope_ext.rotary(x, cos, sin)
expected = rope_ext.reference.rotary_reference(x, cos, sin)
torch.testing.assert_close(out, expected)
torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(expected.sum(), x)[0])
print("registered once, and working")
"""


@pytest.mark.parametrize("order", ["package_first", "library_first", "symlink"])
def test_a_second_load_of_the_library_is_harmless(order, tmp_path):
    """The library loaded again, before or after the package, by torch.ops.load_library, by ctypes
    (as a C++ program's dlopen would) or through another path to the same file: one schema, one
    kernel per dispatch key, no warning, and the ops work."""
    link = tmp_path / "librope_ext.so"
    link.symlink_to(LIB)
    loads = {
        "package_first": f"import rope_ext\ntorch.ops.load_library({str(LIB)!r})\nctypes.CDLL({str(LIB)!r})\n",
        "library_first": f"ctypes.CDLL({str(LIB)!r})\nimport rope_ext\n",
        "symlink": f"ctypes.CDLL({str(link)!r})\nimport rope_ext\ntorch.ops.load_library({str(link)!r})\n",
    }[order]
    run = run_python("import ctypes, torch\n" + loads + CHECK_REGISTERED_ONCE)
    assert run.returncode == 0, run.stderr
    assert "registered once, and working" in run.stdout
    assert "registers nothing" not in run.stderr, run.stderr


def test_another_library_loaded_first_is_refused(tmp_path):
    """Another librope_ext.so (a copy: another file) registered the ops first: `import rope_ext`
    raises ImportError naming both files instead of running on the other copy's kernels, and its
    library, loading second, registers nothing and warns; nothing crashes."""
    other = tmp_path / "librope_ext.so"
    shutil.copy(LIB, other)
    run = run_python(
        f"import ctypes, torch\nctypes.CDLL({str(other)!r})\n"
        "try:\n    import rope_ext\nexcept ImportError as e:\n    print('ImportError:', e)\n"
    )
    assert run.returncode == 0, run.stderr
    assert (f"ImportError: rope_ext: the rope_ext operators in this process were registered by {other}, loaded "
            f"before this package's {LIB}") in run.stdout, run.stdout
    assert f"rope_ext {rope_ext.__version__} at {LIB} registers nothing" in run.stderr, run.stderr


def test_another_library_loaded_later_registers_nothing(tmp_path):
    """A different librope_ext.so loaded after the package (a C++ library linking its own build, say)
    registers nothing and says so; the package's registrations stay, once, and keep working."""
    other = tmp_path / "librope_ext.so"
    shutil.copy(LIB, other)
    run = run_python(f"import ctypes, torch, rope_ext\nctypes.CDLL({str(other)!r})\n" + CHECK_REGISTERED_ONCE)
    assert run.returncode == 0, run.stderr
    assert "registered once, and working" in run.stdout
    assert (f"rope_ext {rope_ext.__version__} at {other} registers nothing: the rope_ext operators in this process "
            f"were registered by {LIB}, loaded first") in run.stderr, run.stderr


# Another rope_ext registered the operators first, played by schemas defined from Python: one
# without rope_ext::_library_path (an older copy), or with one that fails.
DEFINED_FROM_PYTHON_FIRST = """
import torch
first = torch.library.Library("rope_ext", "DEF")
first.define("rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> Tensor")
if {broken}:
    def library_path():
        raise ValueError("broken")
    first.define("_library_path() -> str")
    first.impl("_library_path", library_path, "CompositeExplicitAutograd")
try:
    import rope_ext
except ImportError as e:
    print("ImportError:", e)
has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
print("kernels:", [key for key in ("CPU", "Autograd") if has_kernel("rope_ext::rotary", key)])
"""


@pytest.mark.parametrize("broken", [False, True], ids=["without_library_path", "broken_library_path"])
def test_another_rope_ext_that_cannot_say_which_it_is_is_refused(broken):
    """A first copy that cannot name its library is not this package's: the library adds none of its
    kernels under that copy's schemas and warns, and `import rope_ext` raises ImportError. (The stable
    ABI's dispatcher call reports failure without its reason, so the warning is one for both cases.)"""
    warned = "(a rope_ext whose rope_ext::_library_path is missing or failed)"
    run = run_python(DEFINED_FROM_PYTHON_FIRST.format(broken=broken))
    assert run.returncode == 0, run.stderr
    assert ("ImportError: rope_ext: the rope_ext operators in this process were registered by a rope_ext without a "
            "working rope_ext::_library_path (") in run.stdout, run.stdout
    assert "kernels: []" in run.stdout, run.stdout
    assert f"registers nothing: the rope_ext operators in this process were registered by {warned}" in run.stderr, \
        run.stderr
