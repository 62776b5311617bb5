# Quick start: `make demo` (sets up .venv, runs the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: venv demo test bench bench-scale stress lint format schema clean

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/trajwh demo

test: venv
	$(PY) -m pytest -q

bench: venv
	$(PY) bench/run.py

# the design's scale (107,000 episodes by default; EPISODES=20000 for a quicker run): full,
# +1 % incremental and no-op builds, per stage wall / CPU / peak RSS (about half an hour)
EPISODES ?= 107000
bench-scale: venv
	$(PY) bench/scale.py --episodes $(EPISODES)

stress: venv
	$(PY) bench/stress.py

lint: venv
	$(VENV)/bin/ruff check .

format: venv
	$(VENV)/bin/ruff format .

schema: venv
	$(VENV)/bin/trajwh schema --out docs/native-format.schema.json

clean:
	rm -rf warehouse demo-corpus .pytest_cache
