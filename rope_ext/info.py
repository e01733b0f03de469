"""What this rope_ext is and what it can run: ``python -m rope_ext.info``.

Prints, one fact a line: rope_ext's version and where it is installed; the torch it runs with and
its build; the CPU kernel chosen for this machine; whether the library holds CUDA kernels, for which
architectures and from which nvcc, and whether they are registered with torch's dispatcher; the
NVIDIA driver they need and the one found; and, where there are no CUDA kernels, why (as the build
recorded it in ``rope_ext/lib/build.json``, with what to do about it).

``report()`` returns the same facts as a dict. Nothing here initializes CUDA: the driver is asked
through its own libraries, not through a CUDA context.
"""
from __future__ import annotations

import ctypes
import json
import os

import torch

import rope_ext
from rope_ext import _torch_private

# The oldest driver for each CUDA major the kernels can be compiled by: the library links the CUDA
# runtime of its nvcc statically, and a runtime of CUDA major N runs on drivers of major N or newer
# (CUDA's minor-version compatibility), from these releases on.
DRIVER_FOR_CUDA_MAJOR = {12: "525.60.13", 13: "580.65.06"}


def build_record() -> dict | None:
    """lib/build.json, written by setup.py beside the library; None for a library built otherwise."""
    path = os.path.join(os.path.dirname(rope_ext._LIBRARY), "build.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # unreadable, or not JSON: said, not raised
        return {"unreadable": f"{path}: {e}"}


def _cuda_registered() -> bool | None:
    """Whether torch's dispatcher has rope_ext::rotary's CUDA kernel (None: this torch cannot say)."""
    has_kernel = _torch_private.has_kernel_for_dispatch_key
    return None if has_kernel is None else bool(has_kernel("rope_ext::rotary", "CUDA"))


def driver() -> dict:
    """The NVIDIA driver of this machine: its version (NVML) and the newest CUDA it supports
    (cuDriverGetVersion), each None where it cannot be read, with why."""
    found: dict = {"version": None, "cuda": None, "problem": None}
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        found["problem"] = "no NVIDIA driver: libcuda.so.1 does not load"
        return found
    v = ctypes.c_int(0)
    if cuda.cuDriverGetVersion(ctypes.byref(v)) == 0:
        found["cuda"] = f"{v.value // 1000}.{v.value % 1000 // 10}"
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() == 0:
            buf = ctypes.create_string_buffer(96)
            if nvml.nvmlSystemGetDriverVersion(buf, 96) == 0:
                found["version"] = buf.value.decode()
            nvml.nvmlShutdown()
    except (OSError, AttributeError):
        pass  # the version string is a courtesy; the CUDA version is what decides
    return found


def report() -> dict:
    """The facts ``python -m rope_ext.info`` prints."""
    record = build_record()
    cuda_record = (record or {}).get("cuda") or {}  # (an unreadable record has none)
    nvcc = cuda_record.get("nvcc")
    needs = None
    if cuda_record.get("built") and nvcc:
        major = int(nvcc.split(".")[0])
        needs = {"cuda": f"{major}.0", "driver": DRIVER_FOR_CUDA_MAJOR.get(major)}
    return {
        "rope_ext": rope_ext.__version__,
        "location": os.path.dirname(rope_ext.__file__),
        "library": rope_ext._LIBRARY,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpu_kernel": rope_ext.cpu_kernel_isa(),
        "build": record,
        "cuda_registered": _cuda_registered(),
        "driver_needed": needs,
        "driver": driver() if needs else None,
    }


def lines(facts: dict) -> list[str]:
    """``report()`` in words."""
    out = [f"rope_ext {facts['rope_ext']} at {facts['location']}",
           f"  library: {facts['library']}",
           f"torch {facts['torch']} ({'CUDA ' + facts['torch_cuda'] if facts['torch_cuda'] else 'CPU-only build'})",
           f"CPU kernel: {facts['cpu_kernel']}"]
    record = facts["build"]
    if record is None:
        out.append("CUDA kernels: unknown (the library has no lib/build.json: it was not built by rope_ext's setup.py)")
        return out
    if "unreadable" in record:
        out.append(f"CUDA kernels: unknown (the build's record cannot be read: {record['unreadable']})")
        return out
    cuda = record["cuda"]
    if not cuda["built"]:
        out.append(f"CUDA kernels: none (the build was CPU-only: {cuda['reason']})")
        if cuda.get("hint"):
            out.append(f"  {cuda['hint']}")
        return out
    archs = ", ".join("sm_" + a.replace(".", "").replace("+PTX", " (+PTX)") for a in cuda["archs"].split(";"))
    out.append(f"CUDA kernels: built by nvcc {cuda['nvcc']} for {archs}")
    registered = facts["cuda_registered"]
    if registered is None:
        said = "unknown (this torch cannot say)"
    elif not registered:
        said = "no"
    elif facts["torch_cuda"]:
        said = "yes"
    else:  # (the library registers them whatever torch loads it)
        said = "yes, but this torch is a CPU-only build: a CUDA build of torch runs them"
    out.append(f"  registered with torch's dispatcher: {said}")
    needs, found = facts["driver_needed"], facts["driver"]
    if needs is None:  # (the build could not read its nvcc's version)
        out.append("  the NVIDIA driver they need: unknown (the build recorded no nvcc version)")
        return out
    out.append(f"  they need an NVIDIA driver for CUDA {needs['cuda']} or newer"
               + (f" ({needs['driver']} or newer)" if needs["driver"] else ""))
    if found["problem"]:
        out.append(f"  driver found: none ({found['problem']})")
    else:
        ok = found["cuda"] is not None and tuple(map(int, found["cuda"].split("."))) >= tuple(
            map(int, needs["cuda"].split(".")))
        out.append(f"  driver found: {found['version'] or 'version unknown'}, for CUDA {found['cuda'] or 'unknown'}"
                   + ("" if ok else ": too old for these kernels; update the driver"))
    return out


def main() -> None:
    print("\n".join(lines(report())))


if __name__ == "__main__":
    main()
