# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Test workers: CI has 2 cores. Whole files go to one worker (--dist loadfile), so a module's
# cached simulations are made once, as in a serial run; in the order tests/conftest.py
# collects them (the slowest files first), not xdist's default of the most tests first.
TEST_WORKERS ?= 2

.PHONY: demo test lint bench gaps pictures golden clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,ray,dask,parquet]'
	# HTA pins jupyterlab and more it does not import: take the package alone (its imports
	# are in the test extra).
	$(BIN)/pip install -q --no-deps HolisticTraceAnalysis==0.5.0
	# mlc-chakra (tests/integration/test_chakra_export.py reads the export with it) requires that
	# HTA too: the package alone, and the protobuf runtime its et_def_pb2 was generated for.
	$(BIN)/pip install -q --no-deps mlc-chakra==1.0.0
	$(BIN)/pip install -q 'protobuf>=6.31'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fabricsim run llama3-70b-fsdp2-64xh100
	$(BIN)/fabricsim compare llama3-70b-fsdp2-64xh100 --what-if cluster.nic_gbps=100,400
	$(BIN)/fabricsim run llama3-70b-megatron-tp8pp4-64xh100
	$(BIN)/fabricsim run llama3-70b-deepspeed-zero3-64xh100
	$(BIN)/fabricsim run llama3-70b-fsdp2-64xh100-2az --out runs/demo-2az --overwrite
	$(BIN)/fabricsim run llama3.2-1b-1xh200
	@echo "plots, trace and CSVs of the two-zone run: runs/demo-2az/"

# A machine that sets PYTHONDONTWRITEBYTECODE (as this project's CI machine does) recompiles
# sim/ in every process the tests start (CLI subprocesses, loky, Ray and Dask workers): an
# empty value lets the first compile be kept (Python ignores it when empty).
test: export PYTHONDONTWRITEBYTECODE :=
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --nbmake notebooks

lint: $(STAMP)
	$(BIN)/ruff check sim tests tools notebooks
	$(BIN)/mypy sim
	# the layers of docs/layers.md (contracts in pyproject.toml); no cache folder left behind
	$(BIN)/lint-imports --no-cache

pictures: $(STAMP)
	$(BIN)/python tools/readme_pictures.py

# Regenerate tests/integration/golden/ after an intended change of output; prints what moved
# (docs/golden.md).
golden: $(STAMP)
	$(BIN)/python tools/update_golden.py

# Simulator speed (tests/integration/test_benchmark.py, docs/performance.md); -rxX prints the
# measured figure of each case still short of issue 13's goal (XFAIL).
bench: $(STAMP)
	$(BIN)/python -m pytest -q -m benchmark -s -rxX

# Strict xfails too slow for `make test` that pin a gap of the model (each names its simulated
# and measured figures); XPASS fails, so a change that closes a gap says so here.
gaps: $(STAMP)
	$(BIN)/python -m pytest -q -m gap -rxX

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
