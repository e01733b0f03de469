# rope_ext developer commands. From a fresh clone, in a venv: `make setup`, then `make test` (the
# README's two commands; CI runs them from the README's lines). `make setup` installs what the build
# needs where it is missing or too old: torch (TORCH, default torch==2.13.0, only when no torch is
# importable: install another first to use it), setuptools>=77 (a Python 3.12 venv has none, a 3.11
# venv 65.5), Ninja and CMake; then an editable build of rope_ext with its test and bench extras
# and the tests' hook library (ROPE_EXT_TESTING=1). setup.py drives the CMake build with Ninja,
# MAX_JOBS jobs (default: all CPUs); with a CUDA build of torch and a CUDA toolkit it finds, the
# CUDA kernels too (ROPE_EXT_CUDA=0: the CPU kernels alone, in a fraction of the time).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH ?= torch==2.13.0
SOURCES := setup.py pyproject.toml CMakeLists.txt $(wildcard cmake/*) $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu')
STAMP := build/.installed

.PHONY: setup build-tools wheel newcomer-check test engine-pythons releases-check bench lint abi-audit dist-check wheel-check cuda-check gpu-check gpu-build gpu-rehearse sanitize gtest cpp-test cpp-example clean FORCE

setup: $(STAMP)

# What a build without isolation takes from the environment (pyproject.toml's build requires, which
# pip installs only into an isolated build's own environment).
build-tools:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH)
	@$(PYTHON) -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null || \
	    $(PIP) install "setuptools>=77" "torch==$$($(PYTHON) -c 'from importlib.metadata import version; print(version("torch"))')"
	@$(PYTHON) -c "import ninja" 2>/dev/null || $(PIP) install ninja
	@cmake --version 2>/dev/null | grep -qE "version (3\.(1[89]|[2-9][0-9])|[4-9])" || $(PIP) install "cmake>=3.18"

# Rebuilt when a source changed, or when the importable rope_ext is not this checkout's
# (e.g. another clone was installed in editable mode since).
$(STAMP): $(SOURCES) build-tools FORCE
	@$(PYTHON) -c "import importlib.util as u, sys; sys.exit(u.find_spec('rotary_embedding_torch') is None)" || \
	    $(PIP) install --no-deps rotary-embedding-torch==0.9.1  # no-deps: see pyproject.toml
	@if [ ! -f $@ ] || [ -n "$$(find $(SOURCES) -newer $@)" ] || [ ! -f rope_ext/lib/librope_ext_testing.so ] || \
	    ! $(PYTHON) -I -c "import pathlib, rope_ext, sys; \
	    sys.exit(pathlib.Path(rope_ext.__file__).resolve().parent != pathlib.Path('rope_ext').resolve())" 2>/dev/null; \
	then ROPE_EXT_TESTING=1 $(PIP) install --no-build-isolation -e ".[test,bench]" && mkdir -p build && touch $@; fi

# The wheel users install with no compiler: dist/rope_ext-<version>-py3-none-linux_x86_64.whl, built once
# against the installed torch (any from 2.10: the library is on torch's stable ABI) and loaded by every
# torch from 2.10, CPU or CUDA. ROPE_EXT_CUDA=1 makes a build without the CUDA kernels an error.
wheel: build-tools
	$(PIP) wheel --no-build-isolation --no-deps -w dist .

FORCE:

# Two pytest workers (pytest-xdist), each with one OpenMP thread by default: a test run keeps about
# one core busy, and two runs whose torch each starts a thread per core would spin on each other's
# cores (a run of the suite took 20 minutes so, 4 with one thread each). Tests that want threads set
# them (torch.set_num_threads). PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
test: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PYTHON) -m pytest -q -n $(PYTEST_WORKERS) tests

# The form engine's pure-Python tests (tests/test_engine.py: no torch, no build) under the other
# Pythons rope_ext supports (requires-python >= 3.10), run as a script: pyenv's 3.10 and 3.13 here
# (ENGINE_PYTHONS to change; a missing one is an error, not a skip). About 2 s.
ENGINE_PYTHONS ?= 3.10 3.13
engine-pythons:
	@for v in $(ENGINE_PYTHONS); do \
	  py=$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$$v.*/bin/python 2>/dev/null | tail -1); \
	  [ -n "$$py" ] || py=$$(command -v python$$v) || { echo "engine-pythons: no Python $$v found"; exit 1; }; \
	  out=$$($$py tests/test_engine.py 2>&1) || { echo "$$out"; exit 1; }; echo "$$out" | tail -1; \
	done

# The integrations under the library releases users run beside the suite's (transformers 4.57.6 and
# 5.24.0, diffusers 0.41.0), each installed --no-deps into build/releases/<name>, first on the path:
# their forms tests, and transformers' QK-norm fusion tests. See tools/releases_check.sh.
releases-check: setup
	PYTHON=$(PYTHON) bash tools/releases_check.sh

bench: setup
	$(PYTHON) benchmarks/bench_rope.py --quick

# The sdist, a CPU-only wheel built from it, and that wheel installed into a fresh venv and
# smoke-tested, all under build/dist-check (about 4 minutes). See tools/dist_check.sh; cuda-check
# runs it for the CUDA wheel (CI runs that one only).
dist-check:
	PYTHON=$(PYTHON) bash tools/dist_check.sh

# The core tests (CPU): `make test` runs them under torch 2.13.0, and
# `make wheel-check`: one wheel (WHEEL; default dist-check's, CI gives cuda-check's) installed into
# venvs with torch 2.10, 2.11 and 2.15 (build/wheel-check/<version>, reused; TORCHES="..." for
# others), the core tests in each. See tools/wheel_check.sh.
CORE_TESTS := tests/test_rotary.py tests/test_autograd.py tests/test_qk_and_inplace.py tests/test_errors.py \
  tests/test_cpu_kernel.py tests/test_cuda_emulation.py tests/test_rotary_pos.py tests/test_compile.py tests/test_export.py \
  tests/test_dtensor.py tests/test_qk_norm.py tests/test_qk_norm_emulation.py
wheel-check: setup
	PYTHON=$(PYTHON) CORE_TESTS="$(CORE_TESTS)" bash tools/wheel_check.sh

# The README's from-source install as a new user runs it, with a CUDA build of torch (cuda-check's venv)
# and the CUDA toolkit where torch does not guess it: see tools/newcomer_check.sh. About 2 minutes.
newcomer-check:
	CUDA_VENV_ONLY=1 bash tools/cuda_check.sh
	bash tools/newcomer_check.sh

# The CUDA wheel: built from the sdist by tools/dist_check.sh (its checks included), nvcc against a
# CUDA build of torch (in a venv under build/, about 5.5 GB); no GPU needed. See tools/cuda_check.sh.
cuda-check: setup
	bash tools/cuda_check.sh

# rope_ext proven on a CUDA GPU, on a machine that has one (tools/gpu_check.sh; tools/GPU_LEASE.md for
# the lent machines): STEP=lease (the default: one command of at most 9 minutes), rest, all, or a list
# of parts; GPU_CHECK_OUT=dir for the summary and logs (default build/gpu-check). Without a GPU it says
# so and exits 0 at once. gpu-build makes what the lease carries (build/gpu-carry: cuda-check's wheel,
# the one CI tests under three torches, the test hooks and other wheels); gpu-rehearse runs the lease
# here against a fake GPU.
STEP ?= lease
GPU_CHECK_OUT ?= build/gpu-check
gpu-check:
	STEP="$(STEP)" GPU_CHECK_OUT="$(GPU_CHECK_OUT)" PYTHON=$(PYTHON) bash tools/gpu_check.sh

gpu-build:
	bash tools/gpu_build.sh

gpu-rehearse:
	bash tools/gpu_rehearse.sh

# Build the CPU library with AddressSanitizer + UndefinedBehaviorSanitizer into build/sanitize
# (the editable build in rope_ext/ is left alone) and run the core and fuzz tests against it;
# any sanitizer report fails. `setup` provides torch and the test dependencies. See tools/sanitize.sh.
sanitize: setup
	PYTHON=$(PYTHON) bash tools/sanitize.sh

# The C++ side, against the library the editable install put in rope_ext/ (the one Python loads),
# found as a user's CMake project finds it: find_package(rope_ext) through rope_ext.cmake_prefix_path.
# cpp-test builds and runs the GoogleTest tests (tests/cpp) with ctest; cpp-example builds
# examples/cpp and runs it.
TORCH_CMAKE = $(shell $(PYTHON) -c 'import torch; print(torch.utils.cmake_prefix_path)')
ROPE_CMAKE = $(shell $(PYTHON) -c 'import rope_ext; print(rope_ext.cmake_prefix_path)')
GENERATOR = $(shell command -v ninja >/dev/null && echo "-G Ninja")

gtest:  # GoogleTest from Debian's packages, when the system has none
	@[ -f /usr/include/gtest/gtest.h ] || { apt-get update -qq && apt-get install -y -qq libgtest-dev; }

cpp-test: setup gtest
	cmake -S tests/cpp -B build/cpp-test $(GENERATOR) -DCMAKE_PREFIX_PATH="$(ROPE_CMAKE);$(TORCH_CMAKE)"
	cmake --build build/cpp-test
	ctest --test-dir build/cpp-test --output-on-failure

cpp-example: setup
	cmake -S examples/cpp -B build/example $(GENERATOR) -DCMAKE_PREFIX_PATH="$(ROPE_CMAKE);$(TORCH_CMAKE)"
	cmake --build build/example
	build/example/rope_example

# Proof that librope_ext.so is on torch's stable ABI: nm, readelf, torch-abi-audit (issue 37).
abi-audit: setup
	PYTHON=$(PYTHON) bash tools/abi_audit.sh

lint:
	$(PYTHON) -m ruff check rope_ext tests benchmarks tools setup.py

clean:
	rm -rf build *.egg-info rope_ext/*.so rope_ext/lib rope_ext/include
