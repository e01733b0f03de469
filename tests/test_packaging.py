"""setup.py's guards, which run before anything compiles: a platform other than Linux x86-64, a
setuptools older than 77, a torch outside the tested range and a build environment without torch
(pip's --no-build-isolation without torch installed) each stop the build with a message that says what to do.
(make dist-check builds the sdist and the wheel and checks the wheel's torch pin.)"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run_setup(prelude: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """Runs setup.py --version after `prelude` (which fakes the condition under test)."""
    code = f"import runpy, sys\n{prelude}\nsys.argv = ['setup.py', '--version']\nrunpy.run_path('setup.py')"
    env = {**os.environ, **env_extra} if env_extra else None
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)


@pytest.mark.parametrize("system, machine", [("Linux", "aarch64"), ("Darwin", "arm64"), ("Windows", "AMD64")])
def test_other_platforms_are_refused_before_compiling(system, machine):
    prelude = f"import platform; platform.machine = lambda: {machine!r}; platform.system = lambda: {system!r}"
    proc = _run_setup(prelude)
    assert proc.returncode != 0
    assert f"rope_ext is built and tested on Linux x86-64 only; this is {system} {machine}" in proc.stderr
    assert "ROPE_EXT_UNTESTED_PLATFORM=1" in proc.stderr
    if system == "Linux":  # the override lets the build go on (to --version, which compiles nothing);
        # faking another system would also mislead torch's own import, which reads platform.system()
        proc = _run_setup(prelude, {"ROPE_EXT_UNTESTED_PLATFORM": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]


def test_linux_x86_64_prints_the_version():
    proc = _run_setup("")
    assert proc.returncode == 0, proc.stderr[-2000:]
    header = (ROOT / "csrc" / "include" / "rope_ext" / "version.h").read_text()
    assert f'#define ROPE_EXT_VERSION "{proc.stdout.strip().splitlines()[-1]}"' in header


def test_a_build_without_torch_says_to_install_it_or_isolate():
    proc = _run_setup("sys.modules['torch'] = None  # import torch raises ImportError")
    assert proc.returncode != 0
    assert "this build environment has no torch" in proc.stderr
    assert 'pip install "torch>=2.10"' in proc.stderr, proc.stderr
    assert "plain `pip install .`" in proc.stderr



def test_an_old_setuptools_says_what_to_install():
    """A fresh venv of Python 3.11 keeps setuptools 65.5, which has no setuptools.command.bdist_wheel
    and cannot read pyproject.toml's license expression: setup.py stops before importing either, and
    says which setuptools to install. (Faked: the module is made unimportable, the version old.)"""
    prelude = ("import setuptools; setuptools.__version__ = '65.5.0'\n"
               "sys.modules['setuptools.command.bdist_wheel'] = None  # as in setuptools 65.5")
    proc = _run_setup(prelude)
    assert proc.returncode != 0
    assert "rope_ext needs setuptools 77 or newer to build, and this environment has setuptools 65.5.0" \
        in proc.stderr, proc.stderr[-2000:]
    from importlib.metadata import version

    assert f'pip install "setuptools>=77" "torch=={version("torch")}"' in proc.stderr, proc.stderr[-2000:]
    assert "ModuleNotFoundError" not in proc.stderr
    proc = _run_setup("import setuptools; setuptools.__version__ = '77.0.3'")  # the oldest accepted
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("version, accepted", [("2.9.1", False), ("2.10.0", True), ("2.16.0", True), ("3.0.0", True)])
def test_torch_older_than_the_stable_abi_floor_is_refused(version, accepted):
    """setup.py builds against any torch from 2.10 on (the stable ABI's TORCH_TARGET_VERSION), and
    refuses an older one, saying why."""
    proc = _run_setup(f"import torch; torch.__version__ = {version!r}")
    if accepted:
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:
        assert proc.returncode != 0
        assert f"rope_ext needs torch 2.10 or newer, whose stable ABI it is built on; this environment has torch " \
               f"{version}" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("version, accepted", [("2.9.1", False), ("9.9.0", True)])
def test_the_cmake_package_needs_a_torch_from_2_10(version, accepted, tmp_path):
    """find_package(rope_ext) takes any LibTorch from 2.10 on (the library is on the stable ABI; the
    header-only API compiles against the LibTorch found), and fails at configure time, naming the
    version found, on an older one (a stand-in Torch package, found first on CMAKE_PREFIX_PATH)."""
    import rope_ext

    fake = tmp_path / "fake-torch" / "share" / "cmake" / "Torch"
    fake.mkdir(parents=True)
    (fake / "TorchConfig.cmake").write_text('set(TORCH_LIBRARIES "")\nset(Torch_FOUND TRUE)\n')
    (fake / "TorchConfigVersion.cmake").write_text(
        f'set(PACKAGE_VERSION "{version}")\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n')
    project = tmp_path / "project"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(uses_rope_ext CXX)\nfind_package(rope_ext REQUIRED)\n")
    proc = subprocess.run(["cmake", "-S", str(project), "-B", str(tmp_path / "build"),
                           f"-DCMAKE_PREFIX_PATH={rope_ext.cmake_prefix_path};{tmp_path / 'fake-torch'}"],
                          capture_output=True, text=True, timeout=300)
    if accepted:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode != 0, proc.stdout
        assert f"needs torch 2.10 or newer; found torch {version}" in proc.stderr, proc.stderr


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_max_jobs_is_refused_before_compiling(value, tmp_path):
    """MAX_JOBS must be a positive integer; anything else stops the build before CMake runs."""
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-temp", str(tmp_path / "t"),
                           "--build-lib", str(tmp_path / "l")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "MAX_JOBS": value}, timeout=300)
    assert proc.returncode != 0
    assert f"MAX_JOBS must be a positive integer, got {value!r}" in proc.stderr, proc.stderr[-2000:]
    assert "rope_ext: CMake build directory" not in proc.stdout


# ---- the CUDA toolkit the build would use (setup.py's want_cuda / find_cuda_toolkit) ---------------
# Each case runs setup.py's functions in a child with a made-up toolkit layout and PATH, and a torch
# that says it is a CUDA build where the case needs one, so the machine's own toolkit plays no part.

def _fake_toolkit(root: Path, lacks: tuple[str, ...] = ()) -> Path:
    """A folder laid out as a CUDA toolkit (empty files), without the files in `lacks`."""
    files = {"bin/nvcc": "#!/bin/sh\nexit 0\n", "include/cuda_runtime.h": "", "lib64/libcudart_static.a": "",
             "lib64/libcudart.so": ""}
    root.mkdir(parents=True)
    for rel, text in files.items():
        if rel not in lacks:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
            (root / rel).chmod(0o755)
    return root


def _wrapper(folder: Path, text: str) -> Path:
    """An nvcc on PATH that is a script outside any toolkit (as /usr/local/bin/nvcc can be)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "nvcc").write_text(text)
    (folder / "nvcc").chmod(0o755)
    return folder


def _choice(env: dict, torch_cuda: str | None = "13.0") -> subprocess.CompletedProcess:
    """setup.py's want_cuda() in a child with this environment (PATH, CUDA_HOME, ROPE_EXT_CUDA):
    prints the toolkit and the reason as JSON."""
    code = ("import json, runpy, sys, torch\n"
            f"torch.version.cuda = {torch_cuda!r}\n"
            "sys.argv = ['setup.py', '--version']\n"
            "g = runpy.run_path('setup.py')\n"
            "c = g['want_cuda']()\n"
            "print(json.dumps({'toolkit': c.toolkit and str(c.toolkit), 'reason': c.reason, 'line': c.line()}))")
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "ROPE_EXT_CUDA")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**base, "PATH": "/usr/bin:/bin", **env})


def _chosen(proc: subprocess.CompletedProcess) -> dict:
    import json

    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_wrapper_nvcc_is_asked_for_its_toolkit(tmp_path):
    """nvcc on PATH only through a wrapper script outside the toolkit, no CUDA_HOME: the toolkit is
    where nvcc says it is (its dry run's TOP), not the wrapper's folder's parent, as torch guesses."""
    toolkit = _fake_toolkit(tmp_path / "cuda-13.0")
    bin_dir = _wrapper(tmp_path / "local" / "bin", f"#!/bin/sh\necho '#$ TOP={toolkit}/bin/..' >&2\n")
    chosen = _chosen(_choice({"PATH": f"{bin_dir}:/usr/bin:/bin"}))
    assert chosen["toolkit"] == str(toolkit.resolve())
    assert chosen["line"].startswith(f"rope_ext: CUDA kernels: built with the toolkit at {toolkit.resolve()}")


def test_a_wrapper_that_says_nothing_gives_a_cpu_build_that_says_why(tmp_path):
    bin_dir = _wrapper(tmp_path / "bin", "#!/bin/sh\nexit 1\n")
    chosen = _chosen(_choice({"PATH": f"{bin_dir}:/usr/bin:/bin"}))
    assert chosen["toolkit"] is None
    assert chosen["reason"] == f"the nvcc on PATH ({bin_dir / 'nvcc'}) did not say where its toolkit is " \
                               "(nvcc --dryrun printed no TOP)"
    assert "set CUDA_HOME to a CUDA toolkit" in chosen["line"]


@pytest.mark.parametrize("lacks", [("bin/nvcc", "include/cuda_runtime.h", "lib64/libcudart_static.a",
                                    "lib64/libcudart.so"),  # a folder with no toolkit at all
                                   ("lib64/libcudart_static.a",),  # a toolkit without the static runtime
                                   ("include/cuda_runtime.h",)])
def test_a_cuda_home_that_is_not_a_toolkit_gives_a_cpu_build_that_says_why(tmp_path, lacks):
    """CUDA_HOME naming a folder without (all of) a toolkit, as a runtime-only install leaves it, and
    no nvcc on PATH: the CPU kernels, and one line that names what is missing and what to do."""
    home = _fake_toolkit(tmp_path / "cuda", lacks)
    chosen = _chosen(_choice({"CUDA_HOME": str(home)}))
    assert chosen["toolkit"] is None
    assert chosen["reason"] == f"CUDA_HOME={home} is not a CUDA toolkit: {home} has no {', '.join(lacks)}"
    assert chosen["line"] == (f"rope_ext: CUDA kernels: none, the CPU kernels only: {chosen['reason']}. For the "
                              "CUDA kernels, set CUDA_HOME to a CUDA toolkit (the folder holding bin/nvcc, "
                              "include/cuda_runtime.h and lib64/libcudart_static.a) and build again.")


def test_cuda_home_is_taken_over_the_nvcc_on_path(tmp_path):
    """An explicit CUDA_HOME is the toolkit, or the reason: never replaced by a guess from PATH."""
    toolkit = _fake_toolkit(tmp_path / "named")
    other = _fake_toolkit(tmp_path / "other")
    bin_dir = _wrapper(tmp_path / "bin", f"#!/bin/sh\necho '#$ TOP={other}/bin/..' >&2\n")
    path = f"{bin_dir}:/usr/bin:/bin"
    assert _chosen(_choice({"CUDA_HOME": str(toolkit), "PATH": path}))["toolkit"] == str(toolkit.resolve())
    chosen = _chosen(_choice({"CUDA_HOME": str(tmp_path / "missing"), "PATH": path}))
    assert (chosen["toolkit"], chosen["reason"]) == (None, f"CUDA_HOME={tmp_path / 'missing'}: no such folder")


def test_rope_ext_cuda_1_without_a_toolkit_stops_with_the_same_message(tmp_path):
    home = _fake_toolkit(tmp_path / "cuda", ("bin/nvcc",))
    proc = _choice({"CUDA_HOME": str(home), "ROPE_EXT_CUDA": "1"})
    assert proc.returncode != 0
    assert (f"ROPE_EXT_CUDA=1, but the CUDA kernels cannot be built: CUDA_HOME={home} is not a CUDA toolkit: "
            f"{home} has no bin/nvcc. For the CUDA kernels, set CUDA_HOME") in proc.stderr, proc.stderr[-2000:]


def test_a_cpu_torch_builds_the_cpu_kernels_and_says_so(tmp_path):
    toolkit = _fake_toolkit(tmp_path / "cuda")
    chosen = _chosen(_choice({"CUDA_HOME": str(toolkit)}, torch_cuda=None))
    assert chosen["toolkit"] is None and chosen["reason"].endswith("is a CPU-only build")
    proc = _choice({"CUDA_HOME": str(toolkit), "ROPE_EXT_CUDA": "1"}, torch_cuda=None)
    assert proc.returncode != 0 and "They need a CUDA build of torch." in proc.stderr
    chosen = _chosen(_choice({"CUDA_HOME": str(toolkit), "ROPE_EXT_CUDA": "0"}))
    assert (chosen["toolkit"], chosen["reason"]) == (None, "ROPE_EXT_CUDA=0")


def test_the_license_file_is_the_one_pyproject_names():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert (project["license"], project["license-files"]) == ("BSD-3-Clause", ["LICENSE"])
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License\n") and "Neither the name of the copyright holder" in text
