# tidefeed — two commands set everything up from nothing: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: test demo lint typecheck pytest bench java-check clean reliability

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[spark,postgres,delta,dev]'
	touch $(STAMP)

java-check:
	@$(BIN)/python -m feed._java

lint: $(STAMP)
	$(BIN)/ruff check protocol feed tests benchmarks docs
	$(BIN)/ruff format --check protocol feed tests benchmarks docs

typecheck: $(STAMP)
	$(BIN)/mypy protocol feed

pytest: $(STAMP) java-check
	$(BIN)/python -m pytest

test: lint typecheck pytest

demo: $(STAMP) java-check
	$(BIN)/tidefeed demo --workdir demo-output

# RELIABILITY=quick (default, CI) or long (the figures in docs/reliability.md)
reliability: $(STAMP) java-check
	$(BIN)/python -m tests.reliability.harness

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_codecs.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
