# tidefeed — two commands set everything up from nothing: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: test test-first test-fast test-sources test-engines demo lint typecheck pytest bench java-check bytecode jvm-archive clean reliability notebook

$(BIN)/python:
	@echo "creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# compat mode puts the checkout itself on the path, so PySpark's search for pyspark_*
# modules finds pyspark_tidefeed (format("tidefeed") with no registration)
# The installer: uv when pip can fetch it (it installs the ~1 GB of wheels in about half
# of pip's time here, docs/map.md), else pip itself; uv failing for any reason (no network
# to its index, say) falls back to pip, which reads the machine's pip configuration.
# INSTALLER=pip skips uv. Like pip, it compiles the bytecode as it installs: where
# PYTHONDONTWRITEBYTECODE is set (this machine's images), Python would otherwise compile
# pyspark and the rest from source in every process, every time.
INSTALLER ?= uv
EXTRAS := spark,postgres,delta,dev,bench
define install
	{ [ "$(INSTALLER)" = uv ] && $(1)/python -m pip install --quiet uv \
		&& $(1)/uv pip install --python $(1)/python --compile-bytecode -e '$(2)' \
			--config-settings editable_mode=compat; } \
	|| { [ "$(INSTALLER)" != uv ] || echo "uv did not install $(2): pip does"; \
		$(1)/python -m pip install --progress-bar off -e '$(2)' \
			--config-settings editable_mode=compat; }
endef

$(STAMP): pyproject.toml | $(BIN)/python
	@echo "installing tidefeed and its dependencies into $(VENV) (the first time takes a minute or more: pyspark alone is ~400 MB)"
	$(call install,$(BIN),.[$(EXTRAS)])
	touch $(STAMP)
	@echo "installed: $(BIN)/tidefeed (or run 'source $(BIN)/activate' to have tidefeed on the PATH)"

java-check:
	@$(BIN)/python -m feed._java

# The checkout's own modules compiled to bytecode. The install is editable, so they are
# not compiled by it, and where PYTHONDONTWRITEBYTECODE is set (this machine's images)
# Python never writes their .pyc itself: every tidefeed process a test starts, and every
# Python worker of Spark's tasks, would compile them from source again. Python still
# checks each .pyc against its source, so a stale one is only slower, never wrong. Quick
# when nothing changed.
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q -j0 feed protocol tests benchmarks pyspark_tidefeed.py >/dev/null

# The classes Spark's start loads, in an archive the JVM maps instead of parsing them
# again (feed/emit/jvm_archive.py; feed/cli/jvm_archive.py makes it): each tidefeed
# process of the tests starts Spark about 3 s sooner. Made once per environment (about
# a minute); if it cannot be made, that is said and Spark starts as usual.
JVM_ARCHIVE := $(abspath $(VENV))/tidefeed-jvm.jsa
WITH_ARCHIVE := TIDEFEED_JVM_ARCHIVE=$(JVM_ARCHIVE)
$(JVM_ARCHIVE): $(STAMP)
	@echo "making the JVM class archive $(JVM_ARCHIVE) (once: Spark starts sooner with it)"
	-$(BIN)/python -m feed.cli.jvm_archive $@

jvm-archive: java-check $(JVM_ARCHIVE)

lint: $(STAMP)
	$(BIN)/ruff check protocol feed tests benchmarks docs pyspark_tidefeed.py
	$(BIN)/ruff format --check protocol feed tests benchmarks docs pyspark_tidefeed.py

typecheck: $(STAMP)
	$(BIN)/mypy protocol feed

# every test but the real-source and engine ones (make test-sources, make test-engines),
# in one run
SUITE := not realsource and not engines
pytest: $(STAMP) java-check bytecode jvm-archive
	$(WITH_ARCHIVE) $(BIN)/python -m pytest -m "$(SUITE)"

# the tests that need neither Spark nor a tidefeed process (make test-fast's), pure
# Python: they run in FAST_WORKERS pytest-xdist workers
FAST := not slow and not spark and not process
FAST_WORKERS ?= 2
# the rest, in REST_WORKERS workers, each with a Spark session of its own and whole test
# files (their module fixtures made once): run serially, the rest leaves a third of the
# two cores idle while processes start and tests wait on them (docs/map.md)
REST_WORKERS ?= 2

# The same tests as lint, typecheck and pytest, in two runs: the JVM archive takes about
# a minute of one core, and the fast tests run beside it; then the rest, with the
# archive. A failure in either stops make test.
test: $(STAMP) java-check bytecode
	@$(MAKE) --no-print-directory -j2 $(JVM_ARCHIVE) test-first
	$(WITH_ARCHIVE) $(BIN)/python -m pytest -m "$(SUITE) and not ($(FAST))" \
		-n $(REST_WORKERS) --dist loadfile

test-first: lint typecheck
	$(BIN)/python -m pytest -m "$(SUITE) and $(FAST)" -n $(FAST_WORKERS) --durations=5

# the real-source tests: a throwaway PostgreSQL cluster captured by Debezium's embedded
# engine (they need PostgreSQL's server programs: apt-get install postgresql; without them
# they skip). .ci/run runs them after make test and makes a skip a failure.
test-sources: $(STAMP) java-check bytecode jvm-archive
	$(WITH_ARCHIVE) $(BIN)/python -m pytest -m realsource

# real downstream engines as users: a Pathway program reading a growing feed
# (tests/e2e/test_pathway.py, marker engines). Pathway needs pyarrow<26, so it gets an
# environment of its own, .venv-pathway, with tidefeed's core and the pathway extra; the
# tests run from $(VENV) and start the Pathway program there. .ci/run runs this after
# make test and makes a skip a failure.
PATHWAY_VENV ?= .venv-pathway
$(PATHWAY_VENV)/.installed: pyproject.toml
	@echo "creating $(PATHWAY_VENV) for Pathway (it needs pyarrow<26; a few minutes the first time)"
	$(PYTHON) -m venv $(PATHWAY_VENV)
	$(PATHWAY_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(call install,$(PATHWAY_VENV)/bin,.[pathway])
	touch $@

test-engines: $(STAMP) java-check bytecode jvm-archive $(PATHWAY_VENV)/.installed
	$(WITH_ARCHIVE) TIDEFEED_PATHWAY_PYTHON=$(PATHWAY_VENV)/bin/python $(BIN)/python -m pytest -m engines

# the inner loop: lint, types and every test that needs neither Spark nor a tidefeed
# process (the codecs, the consumer state machine, the receiver, the HTTP servers in
# process, the model checks); `make test` runs everything
test-fast: lint typecheck bytecode
	$(BIN)/python -m pytest -m "$(FAST)" -n $(FAST_WORKERS) -q

# JupyterLab on the notebooks, from the project's venv (installed on first use); on
# 127.0.0.1, and as root too (containers, CI machines), which Jupyter refuses by default
notebook: $(STAMP) java-check
	$(BIN)/python -c "import jupyterlab" 2>/dev/null || \
		$(BIN)/python -m pip install --quiet -e '.[notebook]' --config-settings editable_mode=compat
	$(BIN)/jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 --no-browser \
		$$([ "$$(id -u)" = 0 ] && echo --allow-root)

demo: $(STAMP) java-check bytecode
	$(BIN)/tidefeed demo --workdir demo-output

# RELIABILITY=quick (default, CI) or long (the figures in docs/reliability.md)
reliability: $(STAMP) java-check bytecode jvm-archive
	$(WITH_ARCHIVE) $(BIN)/python -m tests.reliability.harness

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_codecs.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
