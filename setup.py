"""Build rope_ext's C++ extension.

The CPU kernel body (csrc/cpu/rotary_kernel.h) is compiled once per CPU capability
(DEFAULT, AVX2, AVX-512), each object with its own -m flags and CPU_CAPABILITY define,
exactly as ATen builds its own kernels; rotary_cpu.cpp picks one at run time from
at::get_cpu_capability().  Nothing is built with -march=native.

Environment:
  DEBUG=1   build with -O0 -g instead of -O3.
"""
import os
import platform
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).parent
DEBUG = os.environ.get("DEBUG", "0") == "1"

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


def sources():
    """All C++ sources, with the AVX2/AVX-512 kernel objects last.

    Inline functions from headers (std::vector, c10 helpers) are emitted in every object, and
    the linker keeps the first copy it meets. Linking the generically compiled objects first
    keeps AVX instructions out of code that every CPU runs.
    """
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cpp"))
    simd = [f for f in files if f.endswith(("_avx2.cpp", "_avx512.cpp"))]
    generic = [f for f in files if f not in simd]
    return generic + (simd if X86 else [])


# -ffp-contract=off: no FMA contraction, so the scalar, AVX2 and AVX-512 paths (and CUDA,
# built with --fmad=false) round identically and give bitwise-equal results.
cxx_flags = ["-fopenmp", "-fvisibility=hidden", "-ffp-contract=off", "-Wno-unknown-pragmas"]
cxx_flags += ["-O0", "-g"] if DEBUG else ["-O3"]

setup(
    ext_modules=[
        CppExtension(
            "rope_ext._C",
            sources(),
            include_dirs=[str(ROOT / "csrc")],
            define_macros=[("ROPE_EXT_HAVE_AVX", None)] if X86 else [],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"] + (["-g"] if DEBUG else []),
        )
    ],
    # Per-source flags need distutils' one-file-at-a-time compile path, not ninja.
    cmdclass={"build_ext": Build.with_options(use_ninja=False)},
)
