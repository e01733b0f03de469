"""One version, written once (csrc/include/rope_ext/version.h), and one version per process."""
from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rope_ext

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "include" / "rope_ext" / "version.h"


def test_one_version_everywhere():
    """The header's version is the package's, the compiled extension's and the registered ops'."""
    (header,) = re.findall(r'^#define ROPE_EXT_VERSION "(\d+\.\d+\.\d+)"$', HEADER.read_text(), re.M)
    assert rope_ext.__version__ == header
    assert importlib.metadata.version("rope_ext") == header
    assert torch.ops.rope_ext._version() == header


# Another copy of rope_ext registered the operators first; played here by schemas defined from
# Python, with a version op, without one (an older copy), or with one that fails.
ANOTHER_COPY_FIRST = """
import torch
first = torch.library.Library("rope_ext", "DEF")
first.define("rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> Tensor")
version = {version!r}
if version is not None:
    def other_version():
        if version == "broken":
            raise ValueError("broken")
        return version
    first.define("_version() -> str")
    first.impl("_version", other_version, "CompositeExplicitAutograd")
try:
    import rope_ext
except ImportError as e:
    print("ImportError:", e)
has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
print("kernels:", [key for key in ("CPU", "Autograd") if has_kernel("rope_ext::rotary", key)])
"""


@pytest.mark.parametrize(
    "version, described, warned",
    [
        ("0.0.1-other", "0.0.1-other", "0.0.1-other"),
        (None, "of an unknown version (it has no rope_ext::_version)", "(a version without rope_ext::_version)"),
        ("broken", "of an unknown version (rope_ext::_version raised ValueError('broken'))",
         "(unknown: rope_ext::_version failed: ValueError: broken"),
    ],
    ids=["other_version", "unversioned", "broken_version_op"],
)
def test_another_version_registered_first_is_refused(version, described, warned):
    """The extension registers nothing and warns as it loads; ``import rope_ext`` raises ImportError."""
    run = subprocess.run([sys.executable, "-c", ANOTHER_COPY_FIRST.format(version=version)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert (f"ImportError: rope_ext {rope_ext.__version__}: the rope_ext operators in this process were "
            f"registered by rope_ext {described}, loaded first") in run.stdout, run.stdout
    assert "kernels: []" in run.stdout, run.stdout  # none of this copy's kernels under the other's schemas
    assert (f"rope_ext {rope_ext.__version__} is loaded into a process where rope_ext {warned}") in run.stderr
    assert "registered the rope_ext operators first; this copy registers nothing" in run.stderr, run.stderr
