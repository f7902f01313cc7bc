# grpokit: the two commands.  `make demo` and `make test` work on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
# torch==2.13.0 is pinned in pyproject.toml: it resolves to the local CPU build here.
STAMP    = $(VENV)/.installed

.PHONY: demo test install clean bench

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/grpokit demo --out runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

# TRL, accelerate and datasets for benchmarks/compare_trl.py (the bench extra in pyproject.toml).
bench: $(STAMP)
	$(BIN)/pip install -q -e ".[bench]"
	@echo "now: $(BIN)/python benchmarks/compare_trl.py   (see benchmarks/README.md)"

clean:
	rm -rf $(VENV) runs build *.egg-info
