# Every target creates or refreshes .venv itself, so a fresh clone needs nothing but python3.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv test lint typecheck pytest demo bench docs clean

# torchtitan (tests/dist/test_dcp_torchtitan.py runs its CheckpointManager) declares datasets,
# wandb, tensorboard... that its checkpointer never imports: installed without dependencies,
# with the few its import chain needs, each pinned in constraints.txt.
TORCHTITAN := torchtitan tyro spmd_types docstring-parser typeguard

# The 'megatron' extra (megatron-core for tests/compat/test_megatron.py) declares Python >= 3.12
# but runs on 3.11: it has its own step, so --ignore-requires-python applies to nothing else.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,docs]'
	$(BIN)/python -m pip install -q -c constraints.txt --ignore-requires-python -e '.[megatron]'
	$(BIN)/python -m pip install -q -c constraints.txt --no-deps $(TORCHTITAN)
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples docs
	$(BIN)/ruff format --check src tests benchmarks examples docs

typecheck: $(STAMP)
	$(BIN)/mypy src

# Three pytest workers, each handed the next test as it frees up: a test spends much of its
# time waiting on processes it started (ranks, background writers, a server); with three the
# 2-core machine stays busy.
PYTEST_WORKERS ?= 3
pytest: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist load $(PYTEST_ARGS)

test: lint typecheck docs pytest

demo: $(STAMP)
	$(BIN)/python -m resilient_ckpt.demo

# The site (mkdocs.yml, pages in docs/, the API reference made from the docstrings) into
# site/. --strict: a broken link, a missing page or a docstring mkdocstrings cannot read fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/resilient-ckpt bench --quick

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
