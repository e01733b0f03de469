"""`python -m rope_ext.info`: what was built (the build's record, lib/build.json) and what runs here."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import torch

import rope_ext
from rope_ext import info

FACTS = {"rope_ext": "0.1.0", "location": "/site/rope_ext", "library": "/site/rope_ext/lib/librope_ext.so.0.1",
         "torch": "2.14.1+cu130", "torch_cuda": "13.0", "cpu_kernel": "AVX2", "cuda_registered": True,
         "driver_needed": {"cuda": "13.0", "driver": "580.65.06"},
         "build": {"rope_ext": "0.1.0", "built_against_torch": "2.14.1+cu130",
                   "cuda": {"built": True, "reason": "CUDA_HOME=/usr/local/cuda", "hint": "",
                            "toolkit": "/usr/local/cuda-13.0", "nvcc": "13.0.88", "archs": "8.0;9.0;12.1+PTX"}}}


def test_the_record_is_this_build():
    record = info.build_record()
    assert record is not None, "setup.py writes lib/build.json beside the library"
    assert record["rope_ext"] == rope_ext.__version__
    cuda = record["cuda"]
    # a CPU torch can only have built the CPU kernels, and says so (unless told not to look)
    if record["built_against_torch"] == torch.__version__ and torch.version.cuda is None:
        assert not cuda["built"] and cuda["reason"] in (f"torch {torch.__version__} is a CPU-only build",
                                                        "ROPE_EXT_CUDA=0")
    assert bool(cuda["archs"]) == bool(cuda["nvcc"]) == bool(cuda["toolkit"]) == cuda["built"]


def test_the_command_prints_this_install():
    proc = subprocess.run([sys.executable, "-m", "rope_ext.info"], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(rope_ext.__file__)))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert out[0] == f"rope_ext {rope_ext.__version__} at {os.path.dirname(rope_ext.__file__)}"
    assert f"CPU kernel: {rope_ext.cpu_kernel_isa()}" in out
    assert out[2].startswith(f"torch {torch.__version__} (")
    cuda = info.build_record()["cuda"]
    if not cuda["built"]:
        assert f"CUDA kernels: none (the build was CPU-only: {cuda['reason']})" in out


def test_a_cuda_build_in_words():
    found = {"version": "580.95.05", "cuda": "13.0", "problem": None}
    out = info.lines({**FACTS, "driver": found})
    assert out[4:] == ["CUDA kernels: built by nvcc 13.0.88 for sm_80, sm_90, sm_121 (+PTX)",
                       "  registered with torch's dispatcher: yes",
                       "  they need an NVIDIA driver for CUDA 13.0 or newer (580.65.06 or newer)",
                       "  driver found: 580.95.05, for CUDA 13.0"]


def test_an_old_driver_or_none_is_named():
    old = info.lines({**FACTS, "driver": {"version": "570.86.10", "cuda": "12.8", "problem": None}})
    assert old[-1] == "  driver found: 570.86.10, for CUDA 12.8: too old for these kernels; update the driver"
    no_driver = {"version": None, "cuda": None, "problem": "no NVIDIA driver: libcuda.so.1 does not load"}
    none = info.lines({**FACTS, "cuda_registered": False, "torch_cuda": None, "driver": no_driver})
    assert "  registered with torch's dispatcher: no" in none
    assert none[-1] == "  driver found: none (no NVIDIA driver: libcuda.so.1 does not load)"
    cpu_torch = info.lines({**FACTS, "torch_cuda": None, "driver": no_driver})
    assert "  registered with torch's dispatcher: yes, but this torch is a CPU-only build: a CUDA build of torch " \
           "runs them" in cpu_torch
    unknown = info.lines({**FACTS, "driver_needed": None, "driver": None})
    assert unknown[-1] == "  the NVIDIA driver they need: unknown (the build recorded no nvcc version)"


def test_a_library_without_a_record_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(rope_ext, "_LIBRARY", str(tmp_path / "librope_ext.so.0.1"))
    assert info.build_record() is None
    assert info.lines(info.report())[-1].startswith("CUDA kernels: unknown (the library has no lib/build.json")
    (tmp_path / "build.json").write_text(json.dumps(FACTS["build"]))
    assert info.build_record() == FACTS["build"]
    (tmp_path / "build.json").write_text("{not json")
    assert info.lines(info.report())[-1].startswith("CUDA kernels: unknown (the build's record cannot be read: ")


def test_the_driver_is_read_without_cuda():
    """On a machine without the driver the reason is given; with it, the CUDA version it supports."""
    try:
        ctypes.CDLL("libcuda.so.1")
        has_driver = True
    except OSError:
        has_driver = False
    found = info.driver()
    if has_driver:
        assert found["problem"] is None and found["cuda"] is not None
    else:
        assert found == {"version": None, "cuda": None, "problem": "no NVIDIA driver: libcuda.so.1 does not load"}
