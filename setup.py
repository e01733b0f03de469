"""Build rope_ext: setup.py drives the CMake build (CMakeLists.txt), the one build there is.

CMake builds librope_ext.so once and installs it, with the headers and the CMake package, into the
Python package: rope_ext/lib/librope_ext.so, rope_ext/include/rope_ext/*.h,
rope_ext/lib/cmake/rope_ext/. `import rope_ext` loads that library (torch.ops.load_library), and C++
programs link the same file through find_package(rope_ext) with
CMAKE_PREFIX_PATH=$(python -c 'import rope_ext; print(rope_ext.cmake_prefix_path)').

The library does not use Python's C API, and it uses only torch's stable ABI (the C functions of
torch/csrc/stable, whose signatures every later torch keeps), with TORCH_TARGET_VERSION 2.10: the
wheel is tagged py3-none-<platform> and requires torch>=2.10, one wheel for every Python version and
every torch release from 2.10 on. (`make wheel-check` builds one and runs the core tests in it under
torch 2.10, 2.11, 2.13 and 2.15.) Building needs torch 2.10 or newer installed, for its headers.

CUDA: the library also gets the CUDA kernels (csrc/cuda/*.cu) when torch is a CUDA build and a
complete CUDA toolkit is found (find_cuda_toolkit: CUDA_HOME, else the nvcc on PATH, else
/usr/local/cuda); otherwise it is CPU-only, and the build says why in one line. lib/build.json
records what was built and why (`python -m rope_ext.info` prints it). The architectures default
to sm_80 and sm_90 plus the first arch of each newer major the installed nvcc supports (a cubin runs
on every later minor of its major; PTX for the newest); TORCH_CUDA_ARCH_LIST overrides them.

Platforms: Linux on x86-64, the one that is built and tested; others are refused before anything
compiles (ROPE_EXT_UNTESTED_PLATFORM=1 tries anyway, for someone porting rope_ext).

Environment:
  MAX_JOBS=N          parallel compile jobs (default: the number of CPUs); nvcc also compiles that
                      many architectures at once (--threads).
  ROPE_EXT_CUDA=1|0   force the CUDA build on (an error if it cannot be done) or off.
  ROPE_EXT_TESTING=1  also build librope_ext_testing.so, the tests' hooks (`make setup` does;
                      wheels leave it out).
  DEBUG=1             a Debug build (-O0 -g; nvcc -G), with the kernels' debug checks.
  ROPE_EXT_DEBUG_CHECKS=1  the kernels' debug checks (e.g. the alignment of every streaming
                      store) in an optimized build; `make sanitize` builds this way.
  CXXFLAGS, LDFLAGS, CXX, ...  read by CMake when it configures a build directory (CMAKE_ENV);
                      `make sanitize` passes its flags so.
The CMake build directory is build/cmake-<hash of the configuration> in the source tree: a rebuild
with the same torch, options and compilers recompiles only what changed (headers included).
"""
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import setuptools

# setuptools 77 is the oldest that reads pyproject.toml's `license = "BSD-3-Clause"` (an SPDX
# expression, PEP 639), and 70.1 the oldest with setuptools.command.bdist_wheel. pyproject.toml's
# build-system requires says so, but pip does not check it in a build without isolation (the fast
# one, and `make setup`'s): that uses the environment's own setuptools, and a fresh venv of Python
# 3.11 has 65.5, one of 3.12 none. Say what to install rather than fail on an import or a schema error.
SETUPTOOLS_MIN = 77
_setuptools_major = int(re.match(r"\d+", setuptools.__version__).group())
if _setuptools_major < SETUPTOOLS_MIN:
    # Named with the installed torch, which caps setuptools (torch 2.11 requires setuptools<82), so that
    # pip picks a setuptools this torch accepts and leaves torch as it is.
    try:
        from importlib.metadata import version as _version_of
        _keep_torch = f' "torch=={_version_of("torch")}"'
    except Exception:  # no torch: the torch check below says so once setuptools is new enough
        _keep_torch = ""
    raise SystemExit(
        f"rope_ext needs setuptools {SETUPTOOLS_MIN} or newer to build, and this environment has setuptools "
        f"{setuptools.__version__}. A build without isolation uses the environment's own setuptools: upgrade it "
        f'first, `pip install "setuptools>={SETUPTOOLS_MIN}"{_keep_torch}`, then build again.')

from setuptools import Extension, setup  # noqa: E402  (after the version check)
from setuptools.command.bdist_wheel import bdist_wheel  # noqa: E402
from setuptools.command.build_ext import build_ext  # noqa: E402

if (platform.system(), platform.machine().lower()) not in (("Linux", "x86_64"), ("Linux", "amd64")) and \
        os.environ.get("ROPE_EXT_UNTESTED_PLATFORM") != "1":
    raise SystemExit(
        f"rope_ext is built and tested on Linux x86-64 only; this is {platform.system()} {platform.machine()}. "
        "Set ROPE_EXT_UNTESTED_PLATFORM=1 to try the build anyway.")

try:
    import torch
except ImportError:
    raise SystemExit(
        "rope_ext compiles against torch's headers, and this build environment has no torch: a build "
        "without isolation (pip's --no-build-isolation) uses the environment's own packages. Install torch "
        "2.10 or newer first, `pip install \"torch>=2.10\"`, or build with isolation (plain `pip install .`), "
        "where pip installs a torch of its own for the build."
    ) from None

ROOT = Path(__file__).parent.resolve()
# The version is written once, in the C++ header that CMake and the compiled code read too, as
# MAJOR.MINOR.PATCH (CMake's project(VERSION) takes no other form).
_version = re.search(r'^#define ROPE_EXT_VERSION "(\d+\.\d+\.\d+)"$',
                     (ROOT / "csrc" / "include" / "rope_ext" / "version.h").read_text(), re.M)
if _version is None:
    raise SystemExit('csrc/include/rope_ext/version.h must have a line #define ROPE_EXT_VERSION "X.Y.Z"')
VERSION = _version.group(1)


def env_flag(name: str) -> bool | None:
    """An environment switch: True for 1, False for 0, None when unset; anything else is refused."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise SystemExit(f"{name} must be 0 or 1, got {value!r}")
    return None if value == "" else value == "1"


def max_jobs() -> int:
    """MAX_JOBS, else the CPUs this process may run on (its affinity, not the machine's count)."""
    value = os.environ.get("MAX_JOBS", "").strip() or str(len(os.sched_getaffinity(0)))
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(f"MAX_JOBS must be a positive integer, got {value!r}")
    return int(value)


# The CUDA toolkit is checked here, before the build chooses CUDA, rather than left to CMake: torch's
# own guess (torch.utils.cpp_extension.CUDA_HOME) takes the parent of the folder of the first nvcc on
# PATH, which is /usr/local for a wrapper script in /usr/local/bin, and believes any CUDA_HOME, also
# one a runtime-only install left behind. CMake then stops deep in torch's package with "Could NOT
# find CUDA", and `pip install .` fails for a user who never asked for the CUDA kernels.
CUDA_HINT = ("For the CUDA kernels, set CUDA_HOME to a CUDA toolkit (the folder holding bin/nvcc, "
             "include/cuda_runtime.h and lib64/libcudart_static.a) and build again.")


def nvcc_toolkit(nvcc: str) -> Path | None:
    """The toolkit an nvcc belongs to, as nvcc itself says (its dry run's TOP), which holds also for a
    wrapper script or a symlink outside the toolkit; None if it does not say."""
    try:
        proc = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    top = re.search(r"^#\$ TOP=(.+)$", proc.stdout + "\n" + proc.stderr, re.M)
    return Path(top.group(1).strip()).resolve() if top else None


def toolkit_lacks(root: Path) -> list[str]:
    """What a CUDA build needs of a toolkit and `root` does not hold: nvcc, the runtime's headers, and
    the runtime library (statically linked into the library; torch's CMake package looks for the
    shared one)."""
    def anywhere(*patterns: str) -> bool:
        return any(any(root.glob(p)) for p in patterns)
    lacks = [] if os.access(root / "bin" / "nvcc", os.X_OK) else ["bin/nvcc"]
    if not anywhere("include/cuda_runtime.h", "targets/*/include/cuda_runtime.h"):
        lacks.append("include/cuda_runtime.h")
    for lib in ("libcudart_static.a", "libcudart.so"):
        if not anywhere(f"lib64/{lib}", f"lib/{lib}", f"targets/*/lib/{lib}"):
            lacks.append(f"lib64/{lib}")
    return lacks


def find_cuda_toolkit() -> tuple[Path | None, str]:
    """(the toolkit's root, how it was found), or (None, why no usable toolkit was found).

    CUDA_HOME (or CUDA_PATH) when set, and then that folder only: an explicit choice is not replaced
    by a guess. Otherwise the toolkit of the nvcc on PATH, asked of nvcc, else /usr/local/cuda."""
    named = next(((v, os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)), None)
    if named is not None:
        root, source = Path(named[1]), f"{named[0]}={named[1]}"
    elif nvcc := shutil.which("nvcc"):
        root, source = nvcc_toolkit(nvcc), f"the nvcc on PATH ({nvcc})"
        if root is None:
            return None, f"{source} did not say where its toolkit is (nvcc --dryrun printed no TOP)"
    elif Path("/usr/local/cuda").is_dir():
        root, source = Path("/usr/local/cuda"), "/usr/local/cuda"
    else:
        return None, "no CUDA toolkit found (CUDA_HOME is not set, no nvcc is on PATH, no /usr/local/cuda)"
    if not root.is_dir():
        return None, f"{source}: no such folder"
    if lacks := toolkit_lacks(root):
        return None, f"{source} is not a CUDA toolkit: {root} has no {', '.join(lacks)}"
    return root.resolve(), source


class CudaChoice(NamedTuple):
    """What the build does about the CUDA kernels: the toolkit it builds them with, or None, and why."""
    toolkit: Path | None
    reason: str
    hint: str = ""  # how to get the CUDA kernels where they could be built and are not

    def line(self) -> str:
        if self.toolkit is not None:
            return f"rope_ext: CUDA kernels: built with the toolkit at {self.toolkit} ({self.reason})"
        line = f"rope_ext: CUDA kernels: none, the CPU kernels only: {self.reason}."
        return f"{line} {self.hint}" if self.hint else line


def want_cuda() -> CudaChoice:
    """The toolkit to build the CUDA kernels with, or why the build is CPU-only. ROPE_EXT_CUDA=1 makes
    a missing toolkit an error, =0 skips the search."""
    force = env_flag("ROPE_EXT_CUDA")
    if force is False:
        return CudaChoice(None, "ROPE_EXT_CUDA=0")
    if torch.version.cuda is None:
        choice = CudaChoice(None, f"torch {torch.__version__} is a CPU-only build",
                            "They need a CUDA build of torch.")
    else:
        choice = CudaChoice(*find_cuda_toolkit(), CUDA_HINT)
    if choice.toolkit is None and force:
        raise SystemExit(f"ROPE_EXT_CUDA=1, but the CUDA kernels cannot be built: {choice.reason}. {choice.hint}")
    return choice if choice.toolkit is None else choice._replace(hint="")


BASE_ARCHS = ["8.0", "9.0"]


def default_arch_list(toolkit: Path) -> str:
    """sm_80, sm_90 and the first arch of each newer major this nvcc can target, PTX for the last.

    One SASS per major suffices: a cubin for X.y runs on every X.z with z >= y (sm_80's on sm_86,
    87 and 89; sm_100's on sm_103; sm_120's on sm_121), and the kernels read no minor-specific
    feature. Each further arch would cost the build as much again for no new GPU."""
    out = subprocess.run([str(toolkit / "bin" / "nvcc"), "--list-gpu-arch"], capture_output=True,
                         text=True, check=True).stdout
    supported = sorted({int(m) for m in re.findall(r"compute_(\d+)", out)})
    newer = {}
    for a in supported:
        if a > 90:
            newer.setdefault(a // 10, f"{a // 10}.{a % 10}")
    archs = [a for a in BASE_ARCHS if int(a.replace(".", "")) in supported] + list(newer.values())
    return ";".join(archs[:-1] + [archs[-1] + "+PTX"])


def nvcc_release(toolkit: Path) -> str | None:
    """nvcc's version, as `nvcc --version` gives it (e.g. 13.0.88)."""
    out = subprocess.run([str(toolkit / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    found = re.search(r"\bV(\d+\.\d+\.\d+)", out)
    return found.group(1) if found else None


def cuda_args(toolkit: Path, archs: str) -> list[str]:
    args = [f"-DCMAKE_CUDA_COMPILER={toolkit / 'bin' / 'nvcc'}", f"-DCUDA_TOOLKIT_ROOT_DIR={toolkit}",
            f"-DTORCH_CUDA_ARCH_LIST={archs}"]
    # torch's CMake package wants libnvrtc, which a compiler-only CUDA install lacks; the nvidia
    # wheels that a CUDA build of torch depends on have it.
    if not list(toolkit.glob("lib*/libnvrtc.so*")):
        try:
            import nvidia
            nvrtc = next(p for r in nvidia.__path__ for p in sorted(Path(r).rglob("libnvrtc.so*")))
            args.append(f"-DCUDA_nvrtc_LIBRARY={nvrtc}")
        except (ImportError, StopIteration):
            pass  # torch's CMake package then says what it misses
    return args


def cmake_args() -> list[str]:
    """ROPE_EXT_CMAKE_ARGS: more CMake arguments, after rope_ext's own (so they win). Its own name, not
    the CMAKE_ARGS that conda's compiler packages set for every build. tools/sanitize.sh sets the
    sanitized build's optimization level and ROPE_EXT_UNROLLED_STEPS this way."""
    return shlex.split(os.environ.get("ROPE_EXT_CMAKE_ARGS", ""))


def generator() -> list[str]:
    """Ninja (the `ninja` package from PyPI, a build requirement, or one on PATH), else Makefiles."""
    try:
        import ninja
        program = Path(ninja.BIN_DIR or "-") / "ninja"
    except ImportError:
        program = None
    if program is None or not program.is_file():
        program = shutil.which("ninja")
    return ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={program}"] if program else []


def cmake() -> str:
    """The cmake command (3.18 or newer) on PATH: the system's, or the `cmake` package from PyPI's.
    (Not `import cmake`: the checkout's cmake/ directory would answer it.)"""
    beside_python = Path(sys.executable).parent / "cmake"  # pip install cmake into an unactivated venv
    found = shutil.which("cmake") or (str(beside_python) if beside_python.is_file() else None)
    if found is None:
        raise SystemExit("rope_ext builds with CMake 3.18 or newer, and none is on PATH: `pip install cmake`, "
                         "or install it with the system's package manager")
    return found


# Read by CMake from the environment when it first configures a build directory.
CMAKE_ENV = ("CC", "CXX", "CUDACXX", "CUDAHOSTCXX", "CFLAGS", "CXXFLAGS", "CUDAFLAGS", "LDFLAGS")


class CMakeExtension(Extension):
    """librope_ext.so, built and installed by CMake rather than compiled by setuptools."""

    def __init__(self):
        super().__init__("rope_ext.lib.librope_ext", sources=[])


class CMakeBuild(build_ext):
    """Configures, builds and installs CMakeLists.txt into the package directory."""

    def get_ext_filename(self, fullname):
        # rope_ext/lib/librope_ext.so.<major.minor>, its soname (CMakeLists.txt), not a Python module's name
        return os.path.join(*fullname.split(".")) + ".so." + ".".join(VERSION.split(".")[:2])

    def build_extension(self, ext):
        jobs = max_jobs()
        debug = os.environ.get("DEBUG", "0") == "1"  # a common variable: anything else is off, not an error
        choice = want_cuda()
        cuda = choice.toolkit is not None
        print(choice.line(), flush=True)
        archs = (os.environ.get("TORCH_CUDA_ARCH_LIST") or default_arch_list(choice.toolkit)) if cuda else ""
        args = [
            f"-DCMAKE_BUILD_TYPE={'Debug' if debug else 'Release'}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DROPE_EXT_CUDA={'ON' if cuda else 'OFF'}",
            f"-DROPE_EXT_TESTING={'ON' if env_flag('ROPE_EXT_TESTING') else 'OFF'}",
            f"-DROPE_EXT_DEBUG_CHECKS={'ON' if debug or env_flag('ROPE_EXT_DEBUG_CHECKS') else 'OFF'}",
            # rope_ext/lib/librope_ext.so finds site-packages/torch/lib when no torch is loaded yet
            # (a C++ program linking it); in Python, torch is always imported first.
            "-DCMAKE_INSTALL_RPATH=$ORIGIN/../../torch/lib",
            "-DCMAKE_INSTALL_LIBDIR=lib",
            "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
        ] + generator() + (cuda_args(choice.toolkit, archs) if cuda else []) + cmake_args()
        # One build directory per configuration: the options, the torch, and what CMake reads from the
        # environment only when it first configures (compilers, flags). It lives in the source tree's
        # build/, not in setuptools' build_temp, which an editable install deletes after each build.
        configured_from_env = [f"{v}={os.environ.get(v, '')}" for v in CMAKE_ENV]
        key = hashlib.sha256("\0".join(args + [torch.__file__] + configured_from_env).encode()).hexdigest()[:12]
        build_dir = ROOT / "build" / f"cmake-{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        print(f"rope_ext: CMake build directory {build_dir}", flush=True)
        run = [cmake()]
        subprocess.run(run + ["-S", str(ROOT), "-B", str(build_dir), f"-DROPE_EXT_NVCC_THREADS={jobs}"] + args,
                       check=True)
        build = run + ["--build", str(build_dir), "--parallel", str(jobs)]
        print(f"rope_ext: {' '.join(build)}", flush=True)
        subprocess.run(build, check=True)
        # Into the package: build/lib*/rope_ext for a wheel; for an editable install,
        # copy_extensions_to_source installs into the checkout's rope_ext/ as well.
        self._cmake_build_dir = build_dir
        # What was built and why, installed beside the library as lib/build.json for
        # `python -m rope_ext.info` (rope_ext/info.py reads it).
        self._record = {
            "rope_ext": VERSION,
            "built_against_torch": torch.__version__,
            "cuda": {"built": cuda, "reason": choice.reason, "hint": choice.hint,
                     "toolkit": str(choice.toolkit) if cuda else None,
                     "nvcc": nvcc_release(choice.toolkit) if cuda else None, "archs": archs or None},
        }
        self._install(Path(self.get_ext_fullpath(ext.name)).parent.parent)

    def _install(self, package_dir: Path):
        # cmake --install only adds files: clear what an earlier build installed (a testing library,
        # another version's library) and any Python-module build of rope_ext, so that only this
        # build's files reach the package and a wheel made from it.
        for stale in ("lib", "include"):
            shutil.rmtree(package_dir / stale, ignore_errors=True)
        for stale in package_dir.glob("*.so"):
            stale.unlink()
        subprocess.run([cmake(), "--install", str(self._cmake_build_dir), "--prefix", str(package_dir)],
                       check=True)
        (package_dir / "lib" / "build.json").write_text(json.dumps(self._record, indent=1) + "\n")

    def copy_extensions_to_source(self):
        # The library, the headers and the CMake package, not only the one file setuptools knows of.
        self._install(ROOT / "rope_ext")


class Wheel(bdist_wheel):
    """py3-none-<platform>: the library links libtorch, not libpython."""

    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])


# The oldest torch whose stable ABI has what the library uses (TORCH_TARGET_VERSION in CMakeLists.txt):
# strings through the dispatcher and torch::stable::parallel_for came in 2.10. Building needs its
# headers; the wheel then loads into it and every later torch.
TORCH_MIN = (2, 10)
_torch_release = tuple(int(n) for n in torch.__version__.split("+")[0].split(".")[:2])
if _torch_release < TORCH_MIN:
    raise SystemExit(
        f"rope_ext needs torch {'.'.join(map(str, TORCH_MIN))} or newer, whose stable ABI it is built on; this "
        f"environment has torch {torch.__version__}. Install a newer torch first.")

setup(
    version=VERSION,
    install_requires=[f"torch>={'.'.join(map(str, TORCH_MIN))}"],
    ext_modules=[CMakeExtension()],
    cmdclass={"build_ext": CMakeBuild, "bdist_wheel": Wheel},
)
