"""setup.py's guards, which run before anything compiles: a platform other than Linux x86-64, a
setuptools older than 77, a torch outside the tested range and a build environment without torch
(an isolated `pip install`) each stop the build with a message that says what to do.
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


def test_a_build_without_torch_says_to_install_it_and_not_isolate():
    proc = _run_setup("sys.modules['torch'] = None  # import torch raises ImportError")
    assert proc.returncode != 0
    assert "this build environment has none" in proc.stderr
    assert "pip install --no-build-isolation rope_ext" in proc.stderr


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
