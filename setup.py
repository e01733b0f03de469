"""Build rope_ext's C++ extension.

The CPU kernel body (csrc/cpu/rotary_kernel.h) is compiled once per CPU capability
(DEFAULT, AVX2, AVX-512), each object with its own -m flags and CPU_CAPABILITY define,
exactly as ATen builds its own kernels; rotary_cpu.cpp picks one at run time from
at::get_cpu_capability().  Nothing is built with -march=native.

CUDA: the extension also gets the CUDA kernels (csrc/cuda/*.cu) when torch is a CUDA build and
nvcc is found (CUDA_HOME); otherwise it is CPU-only. The architectures default to sm_80, sm_86,
sm_89 and sm_90 plus every newer one the installed nvcc supports (PTX for the newest);
TORCH_CUDA_ARCH_LIST overrides them.

Platforms: Linux on x86-64, the one that is built and tested; others are refused before anything
compiles (ROPE_EXT_UNTESTED_PLATFORM=1 tries anyway, for someone porting rope_ext).

Environment:
  ROPE_EXT_CUDA=1|0   force the CUDA build on (an error if it cannot be done) or off.
  DEBUG=1             build with -O0 -g instead of -O3, and with the kernels' debug checks.
  ROPE_EXT_DEBUG_CHECKS=1  the kernels' debug checks (e.g. the alignment of every streaming
                      store) in an optimized build; `make sanitize` builds this way.
"""
import os
import platform
import re
import subprocess
from pathlib import Path

from setuptools import setup

if (platform.system(), platform.machine().lower()) not in (("Linux", "x86_64"), ("Linux", "amd64")) and \
        os.environ.get("ROPE_EXT_UNTESTED_PLATFORM") != "1":
    raise SystemExit(
        f"rope_ext is built and tested on Linux x86-64 only; this is {platform.system()} {platform.machine()}. "
        "Set ROPE_EXT_UNTESTED_PLATFORM=1 to try the build anyway.")

try:
    import torch
except ImportError:
    raise SystemExit(
        "rope_ext compiles against the torch it will run with, and this build environment has none: torch "
        "is not installed, or pip is building in an isolated environment (its default), which cannot see "
        "it. Install torch first, then build without isolation: `pip install --no-build-isolation rope_ext` "
        "(or `.`, or `-e .` in a checkout)."
    ) from None
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).parent
# The version is written once, in the C++ header that CMake and the compiled code read too, as
# MAJOR.MINOR.PATCH (CMake's project(VERSION) takes no other form).
_version = re.search(r'^#define ROPE_EXT_VERSION "(\d+\.\d+\.\d+)"$',
                     (ROOT / "csrc" / "include" / "rope_ext" / "version.h").read_text(), re.M)
if _version is None:
    raise SystemExit('csrc/include/rope_ext/version.h must have a line #define ROPE_EXT_VERSION "X.Y.Z"')
VERSION = _version.group(1)
DEBUG = os.environ.get("DEBUG", "0") == "1"
DEBUG_CHECKS = DEBUG or os.environ.get("ROPE_EXT_DEBUG_CHECKS", "0") == "1"

# Flags for the kernel objects of each capability, keyed by the file-name suffix.
# They match what PyTorch passes for its own AVX2/AVX-512 kernel files.
CAPABILITY_FLAGS = {
    "_default.cpp": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"],
    "_avx2.cpp": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "_avx512.cpp": [
        "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512",
        "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
    ],
}


class Build(BuildExtension):
    """BuildExtension that adds per-source capability flags to the kernel objects."""

    def build_extension(self, ext):
        compile_one = self.compiler._compile  # already wrapped by BuildExtension

        def compile_with_capability(obj, src, ext_, cc_args, extra_postargs, pp_opts):
            extra = next((f for s, f in CAPABILITY_FLAGS.items() if src.endswith(s)), [])
            if extra:  # BuildExtension passes {"cxx": [...], "nvcc": [...]} here
                extra_postargs = {**extra_postargs, "cxx": extra_postargs["cxx"] + extra}
            return compile_one(obj, src, ext_, cc_args, extra_postargs, pp_opts)

        self.compiler._compile = compile_with_capability
        try:
            super().build_extension(ext)
        finally:
            self.compiler._compile = compile_one


X86 = platform.machine().lower() in ("x86_64", "amd64")


BASE_ARCHS = ["8.0", "8.6", "8.9", "9.0"]


def want_cuda() -> bool:
    force = os.environ.get("ROPE_EXT_CUDA", "").strip()
    if force not in ("", "0", "1"):
        raise SystemExit(f"ROPE_EXT_CUDA must be 0 or 1, got {force!r}")
    possible = torch.version.cuda is not None and CUDA_HOME is not None
    if force == "1" and not possible:
        raise SystemExit(f"ROPE_EXT_CUDA=1, but the CUDA build needs a CUDA build of torch (torch.version.cuda = "
                         f"{torch.version.cuda}) and nvcc (CUDA_HOME = {CUDA_HOME})")
    return possible if force == "" else force == "1"


def default_arch_list() -> str:
    """sm_80/86/89/90 and the newer archs this nvcc can target, PTX for the newest."""
    out = subprocess.run([str(Path(CUDA_HOME) / "bin" / "nvcc"), "--list-gpu-arch"], capture_output=True,
                         text=True, check=True).stdout
    supported = sorted({int(m) for m in re.findall(r"compute_(\d+)", out)})
    newer = [f"{a // 10}.{a % 10}" for a in supported if a > 90]
    archs = [a for a in BASE_ARCHS if int(a.replace(".", "")) in supported] + newer
    return ";".join(archs[:-1] + [archs[-1] + "+PTX"])


def sources(cuda: bool):
    """All C++ sources, with the AVX2/AVX-512 kernel objects last.

    Inline functions from headers (std::vector, c10 helpers) are emitted in every object, and
    the linker keeps the first copy it meets. Linking the generically compiled objects first
    keeps AVX instructions out of code that every CPU runs.
    """
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cpp"))
    simd = [f for f in files if f.endswith(("_avx2.cpp", "_avx512.cpp"))]
    generic = [f for f in files if f not in simd]
    cu = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cu")) if cuda else []
    return generic + cu + (simd if X86 else [])


# -ffp-contract=off: no FMA contraction, so the scalar, AVX2 and AVX-512 paths (and CUDA,
# built with --fmad=false) round identically and give bitwise-equal results.
# -fno-tree-slp-vectorize: GCC 12's SLP vectorizer turns the pair (x1*c1 - x2*s1, x2*c2 + x1*s2) into
# vfmaddsub despite -ffp-contract=off; the kernels vectorize explicitly and do not need it.
cxx_flags = ["-fopenmp", "-fvisibility=hidden", "-ffp-contract=off", "-fno-tree-slp-vectorize", "-Wno-unknown-pragmas"]
cxx_flags += ["-O0", "-g"] if DEBUG else ["-O3"]
# --fmad=false: the same roundings as the CPU kernels (no contraction), so CPU and GPU agree bitwise.
nvcc_flags = ["--fmad=false", "-lineinfo"] + (["-O0", "-g", "-G"] if DEBUG else ["-O3"])

CUDA = want_cuda()
if CUDA and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
    os.environ["TORCH_CUDA_ARCH_LIST"] = default_arch_list()
Extension = CUDAExtension if CUDA else CppExtension

# The binary uses torch's C++ ABI, which changes between minor releases: the package requires the
# major.minor it was compiled against, so pip refuses (rather than breaks) it beside another torch.
TORCH_MAJOR_MINOR = ".".join(torch.__version__.split("+")[0].split(".")[:2])

setup(
    version=VERSION,
    install_requires=[f"torch=={TORCH_MAJOR_MINOR}.*"],
    ext_modules=[
        Extension(
            "rope_ext._C",
            sources(CUDA),
            include_dirs=[str(ROOT / "csrc"), str(ROOT / "csrc" / "include")],
            define_macros=([("ROPE_EXT_HAVE_AVX", None)] if X86 else []) + ([("ROPE_EXT_CUDA", None)] if CUDA else [])
            + ([("ROPE_EXT_DEBUG_CHECKS", None)] if DEBUG_CHECKS else []),
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=["-fopenmp"] + (["-g"] if DEBUG else []),
        )
    ],
    # Per-source flags need distutils' one-file-at-a-time compile path, not ninja.
    cmdclass={"build_ext": Build.with_options(use_ninja=False)},
)
