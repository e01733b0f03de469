# rope_ext developer commands. `make test` and `make bench` each set up what they need
# on a fresh machine: torch==2.13.0 (CPU build) if no torch is importable, then an
# editable build of rope_ext with its test and bench extras.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
SOURCES := setup.py pyproject.toml $(shell find csrc -name '*.cpp' -o -name '*.h')
STAMP := build/.installed

.PHONY: setup test bench lint clean

setup: $(STAMP)

$(STAMP): $(SOURCES)
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install --no-build-isolation -e ".[test,bench]"
	@mkdir -p build && touch $(STAMP)

test: setup
	$(PYTHON) -m pytest -q tests

bench: setup
	$(PYTHON) benchmarks/bench_rope.py

lint:
	$(PYTHON) -m ruff check rope_ext tests benchmarks setup.py

clean:
	rm -rf build *.egg-info rope_ext/*.so
