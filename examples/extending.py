"""Extending grpokit from your own code: a reward function, a tool and a rollout engine (docs/extending.md).

    python examples/make_tiny_model.py runs/tiny-model
    python examples/extending.py --model runs/tiny-model --out runs/extending [--steps 2]

1. `correct_sum` and `used_a_tool` are reward functions with TRL's signature; `total` is a tool (a typed
   function with a Google-style docstring). Both go into a GRPO run through the Python API as callables
   (in a YAML config they are `package.module:function` paths instead).
2. `PlainSampler` is a rollout engine: a class with `generate` and `sync_weights`. It samples a group of
   completions on its own and runs multi-turn episodes with the tool under grpokit's ToolRollout.
   `grpokit.train` picks its engine from `rollout.engine`, so training with a new engine needs the edit
   inside the package that docs/extending.md describes.
"""

from __future__ import annotations

import argparse
import json

import torch

import grpokit
from grpokit.rollout import Completions, EngineCaps, RolloutEngine, SamplingParams
from grpokit.rollout.episodes import ToolRollout
from grpokit.tools import ToolBox, as_tool, make_format

# ---------------------------------------------------------------- a reward function


def correct_sum(completions, answer, **kwargs):
    """1.0 for the expected sum, 0.1 for another number, else 0. `answer` is a dataset column."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion.strip()
        scores.append(1.0 if text == str(expected) else 0.1 if text.isdigit() else 0.0)
    return scores


def used_a_tool(completions, episodes=None, **kwargs):
    """A small bonus for an episode that called a tool; `episodes` is passed when tools are on."""
    if episodes is None:
        return [0.0] * len(completions)
    return [1.0 if ep.tool_calls else 0.0 for ep in episodes]


# ---------------------------------------------------------------- a tool


def total(a: int, b: int) -> int:
    """Adds two integers exactly.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


# ---------------------------------------------------------------- a rollout engine


class PlainSampler(RolloutEngine):
    """The rollout interface (grpokit.rollout.RolloutEngine) in a few lines: ancestral sampling with the
    model's forward, no KV cache. Slow, but complete: it returns the sampling log-probs too."""

    caps = EngineCaps(sampling_logprobs=True)

    def __init__(self, model: torch.nn.Module, tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer

    def sync_weights(self, model: torch.nn.Module, version: int | None = None) -> None:
        self.model = model  # the weights to sample from after an optimizer step

    @torch.no_grad()
    def _sample(self, prompt: list[int], sampling: SamplingParams) -> tuple[list[int], list[float], str]:
        seq, out, logps = list(prompt), [], []
        stops = [list(s) for s in sampling.stop_token_ids]
        while len(out) < sampling.max_tokens:
            logits = self.model(torch.tensor([seq])).logits[0, -1].float()
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                probs = torch.softmax(logits / sampling.temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=sampling.generator))
            seq.append(token)
            out.append(token)
            logps.append(float(torch.log_softmax(logits / sampling.temperature, dim=-1)[token]))
            if token == self.tokenizer.eos_token_id or any(out[-len(s) :] == s for s in stops):
                return out, logps, "stop"
        return out, logps, "length"

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> Completions:
        # Prompt-major: the n samples of prompt i are rows i*n .. i*n + n - 1 (one group).
        samples = [self._sample(prompt, sampling) for prompt in prompt_token_ids for _ in range(n)]
        return Completions(
            token_ids=[ids for ids, _, _ in samples],
            texts=[self.tokenizer.decode(ids, skip_special_tokens=True) for ids, _, _ in samples],
            finish_reasons=[reason for _, _, reason in samples],
            logprobs=[logps for _, logps, _ in samples],
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/tiny-model", help="a model folder with its tokenizer")
    parser.add_argument("--out", default="runs/extending", help="the run folder")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps")
    args = parser.parse_args()
    torch.manual_seed(0)

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 30) for b in range(10, 30)]

    # 1. GRPO with the reward functions and the tool, from Python.
    last = grpokit.train(
        {
            "model": {"name_or_path": args.model},
            "rewards": [{"function": correct_sum}, {"function": used_a_tool, "weight": 0.1}],
            "tools": {"functions": [total]},
            "rollout": {"engine": "fast", "prompts_per_step": 4, "num_generations": 4},
            "optim": {"max_steps": args.steps, "learning_rate": 1e-3},
            "eval": {"at_start": False},
            "logging": {"sample_every": 0},
            "checkpoint": {"save_every": 0},
            "output_dir": args.out,
        },
        ["rollout.max_completion_length=16", "rollout.max_turns=2", "algorithm.beta=0.0"],
        train_rows=rows,
    )
    print(json.dumps({k: round(v, 4) for k, v in last.items() if k.startswith("reward/")}))
    print(f"GRPO: {args.steps} steps with correct_sum, used_a_tool and the tool `total` in {args.out}")

    # 2. The tool on its own, as an episode calls it: the result is the text the model reads.
    print(f"total(12, 7) as a tool call: {ToolBox([as_tool(total)]).call('total', {'a': 12, 'b': 7}).text}")

    # 3. The engine: a group of completions, then episodes with the tool on top of it.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(f"{args.out}/final")
    model = AutoModelForCausalLM.from_pretrained(f"{args.out}/final").eval()
    engine = PlainSampler(model, tokenizer)
    prompt = tokenizer(rows[0]["prompt"])["input_ids"]
    sampling = SamplingParams(max_tokens=8, temperature=1.0, generator=torch.Generator().manual_seed(0))
    group = engine.generate([prompt], 4, sampling)
    print(f"PlainSampler: {len(group)} completions of {rows[0]['prompt']!r}: {group.texts}")
    episodes = ToolRollout(
        engine, tokenizer, [as_tool(total)], fmt=make_format("plain"), max_turns=2
    ).generate([prompt], 2, sampling, columns=[rows[0]])
    print(
        f"PlainSampler with the tool: {len(episodes)} episodes, turns {[e.turns for e in episodes.episodes]}"
    )


if __name__ == "__main__":
    main()
