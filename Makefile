# Two commands do all the set-up on a fresh machine:
#   make train   create .venv from pyproject.toml, train configs/tiny.py on 8 simulated CPU devices
#   make test    create .venv the same way, lint (ruff), run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RUN ?= runs/tiny
ARGS ?=

.PHONY: setup train test lint golden clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

# The test extra adds pytest, ruff, and torch + transformers for the Hugging Face conversion tests.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed

train: setup
	$(PY) train.py --config=configs/tiny.py --workdir=$(RUN) $(ARGS)

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two workers for most of the suite; the multi-process tests after them (their two files collected),
# two at a time and beside nothing else (they start process groups of their own and time how fast a
# dead peer is noticed).
# One compilation cache serves both. Python writes its bytecode caches even where the environment
# says not to (PYTHONDONTWRITEBYTECODE): each of the suite's hundreds of processes then reads the
# project's modules and the tests' rewritten asserts compiled, instead of compiling them again.
test: lint
	cache=$$(mktemp -d) && export JAX_COMPILATION_CACHE_DIR=$$cache PYTHONDONTWRITEBYTECODE= && \
	$(PY) -m pytest -n 2 --dist loadgroup -m "not multiprocess" && \
	$(PY) -m pytest -n 2 --dist loadgroup -m multiprocess tests/job/test_multiprocess.py tests/train/test_profiling.py; \
	status=$$?; rm -rf $$cache; exit $$status

# Rewrites the golden sharding tables (tests/sharding/golden/*.txt) after an intended change to a rule
# file or the model; the tests only read them. Read `git diff tests/sharding/golden` before committing.
golden: $(VENV)/.installed-test
	PYTHONPATH=. $(PY) tests/sharding/golden_tables.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
