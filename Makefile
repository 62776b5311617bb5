# Quick start: `make demo` (sets up .venv, runs the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# the dev environment's exact versions (resolved for Python 3.11 on Linux); `make lock` refreshes it
LOCK := requirements-dev.lock

.PHONY: venv compiled demo test bench bench-scale stress lint format schema lock clean

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r $(LOCK)
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

# the package's modules compiled ahead (quick when they are current): an editable install compiles
# nothing, and where PYTHONDONTWRITEBYTECODE is set (as on the team's machines) every process
# compiled the modules it imported, each time (a forget's process and its worker: about 0.3 s each)
PACKAGES := trajwh schemas ingest lineage pipelines redaction dedup fragments synth packing licenses datacards
compiled: venv
	$(PY) -m compileall -q -j 0 $(PACKAGES)

demo: compiled
	$(VENV)/bin/trajwh demo

test: compiled
	$(PY) -m pytest -q

bench: compiled
	$(PY) bench/run.py

# the design's scale (107,000 episodes by default; EPISODES=20000 for a quicker run): full,
# +1 % incremental and no-op builds, per stage wall / CPU / peak RSS (about half an hour)
EPISODES ?= 107000
bench-scale: compiled
	$(PY) bench/scale.py --episodes $(EPISODES)

stress: compiled
	$(PY) bench/stress.py

lint: venv
	$(VENV)/bin/ruff check .

format: venv
	$(VENV)/bin/ruff format .

schema: venv
	$(VENV)/bin/trajwh schema --out docs/native-format.schema.json

# re-resolve the lock file after a change to pyproject.toml's dependencies (keeps the pins it can;
# `make lock UPGRADE=1` moves every pin to the newest release the ranges allow)
lock: venv
	$(PY) -m pip install -q 'uv>=0.4'
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --extra scale --python-version 3.11 --python-platform linux \
	    $(if $(UPGRADE),--upgrade) --quiet -o $(LOCK)

clean:
	rm -rf warehouse demo-corpus .pytest_cache
