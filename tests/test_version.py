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
    (header,) = re.findall(r'^#define ROPE_EXT_VERSION "(.+)"$', HEADER.read_text(), re.M)
    assert rope_ext.__version__ == header
    assert importlib.metadata.version("rope_ext") == header
    assert torch.ops.rope_ext._version() == header


# Another copy of rope_ext registered the operators first; played here by schemas defined from
# Python, with a version op or (an older copy) without one.
ANOTHER_COPY_FIRST = """
import torch
first = torch.library.Library("rope_ext", "DEF")
first.define("rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved=False, bool conjugate=False) -> Tensor")
if {version!r} is not None:
    first.define("_version() -> str")
    first.impl("_version", lambda: {version!r}, "CompositeExplicitAutograd")
import rope_ext
"""


@pytest.mark.parametrize(
    "version, described",
    [("0.0.1-other", "0.0.1-other"), (None, "of an unknown version (it has no rope_ext::_version)")],
    ids=["other_version", "unversioned"],
)
def test_another_version_registered_first_is_refused(version, described):
    """The extension warns as it loads, and ``import rope_ext`` raises ImportError naming both."""
    run = subprocess.run([sys.executable, "-c", ANOTHER_COPY_FIRST.format(version=version)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert (f"ImportError: rope_ext {rope_ext.__version__}: the rope_ext operators in this process were "
            f"registered by rope_ext {described}, loaded first") in run.stderr, run.stderr
    first = version or "(a version without rope_ext::_version)"
    assert (f"rope_ext {rope_ext.__version__} is loaded into a process where rope_ext {first} registered "
            "the rope_ext operators first") in run.stderr, run.stderr
