"""The containers every stage passes to the next, at the bottom of grpokit's layers (they import no other
grpokit module but the metric names), so that the batch, the rollout engines, the rewards and the data
can all use them without importing one another.

    PromptRow        one prompt of the dataset, tokenized (grpokit/data/prompts.py makes them)
    SamplingParams   how an engine samples (grpokit/rollout/base.py: the engine interface)
    Completions      what an engine returns: G completions per prompt, prompt-major
    StepScores       a process reward's per-step scores (grpokit/rewards/steps.py)
    RewardOutput     the combined rewards of a batch (grpokit/rewards/manager.py makes them)

Each is also importable from the module that makes or documents it (grpokit.data.PromptRow,
grpokit.rollout.Completions, grpokit.rewards.RewardOutput, grpokit.rewards.StepScores).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from grpokit.metrics.names import (
    REWARD_ERROR_FRAC,
    REWARD_NONE_FRAC,
    REWARD_SKIPPED_FRAC,
    REWARD_TOTAL,
    REWARD_TOTAL_STD,
    reward_errors,
    reward_fn,
    reward_fn_std,
    reward_fn_steps,
    reward_timeouts,
)

# ---------------------------------------------------------------------------------------------
# Data

Prompt = str | list[dict[str, Any]]
"""A prompt as the dataset holds it: a string, or chat messages [{"role": ..., "content": ...}]."""


@dataclass(frozen=True)
class PromptRow:
    prompt_ids: list[int]  # [P] token ids fed to the model, P <= max_prompt_length
    prompt_text: str  # the rendered text behind prompt_ids (decoded from them when truncated)
    prompt: Prompt  # the original value, passed to reward functions as `prompts`
    columns: dict[str, Any] = field(default_factory=dict)  # every other column, passed as keyword arguments
    truncated: bool = False  # longer than max_prompt_length, cut to its last tokens (overlong="truncate")


# ---------------------------------------------------------------------------------------------
# Rollout


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    """Max new tokens per completion."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 = off."""
    greedy: bool = False
    """Argmax decoding (temperature, top_p and top_k are ignored)."""
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    """Token sequences that end a completion as EOS does (kept in it): the fast engine stops a row there; an
    engine without them (hf) generates on and the caller cuts (multi-turn episodes stop a turn at a tool call
    this way)."""
    record_kept: bool = False
    """Return each sampled token's kept set under top-k / top-p (Completions.kept), for the log-prob passes to
    replay the truncation (rollout.replay_truncation); engines that cannot leave Completions.kept None."""
    generator: torch.Generator | None = None
    """The random stream that draws the samples; None = torch's global generator (the run's, which a resume
    restores). Asynchronous rollouts give their background sampler one of its own, so that the trainer's draws
    in the other thread never interleave with it (the same seed then gives the same samples). The hf engine
    has none."""


@dataclass
class Completions:
    token_ids: list[list[int]]  # [N][len_i] completion tokens, EOS included when the model stopped
    texts: list[str]  # [N] decoded without special tokens
    finish_reasons: list[str]  # [N] "stop" (EOS) | "length" (hit max_tokens: truncated)
    # [N][len_i] sampler log-probs (after temperature), if the engine has them (fast, vllm: yes; hf: no).
    # The loop measures the sampler-trainer mismatch with them and, with rollout.importance_correction,
    # corrects for it (rollout/mismatch.py, docs/rollout.md); tests: test_rollout_fast.py,
    # test_rollout_vllm.py, test_importance.py.
    logprobs: list[list[float]] | None = None
    # Multi-turn episodes with tools (grpokit/rollout/episodes.py); None for one-turn completions. token_ids
    # then interleave the model's turns with tool results: model_mask [N][len_i] is 1 on tokens the model
    # sampled and 0 on tool-result / template tokens, which are context only (never trained on, never counted
    # in a normalizer).
    model_mask: list[list[int]] | None = None
    episodes: list[Any] | None = None  # [N] grpokit.tools.Episode: messages, tool calls and results, turns
    # [N] the policy version (optimizer steps taken) whose weights sampled each completion; None when the
    # engine does not say (the loop then knows it: synchronous rollouts are always the current version). The
    # server engine reports it per sample; asynchronous rollouts (rollout.max_policy_lag) fill it and log the
    # lag.
    versions: list[int] | None = None
    # [N] per completion its tokens' kept sets [len_i, W_i] int32 under top-k / top-p
    # (grpokit/algo/truncation.py: the set each token was drawn from, which the log-prob passes replay), when
    # the engine records them
    # (SamplingParams.record_kept; fast: yes; hf, vllm: no) and None otherwise.
    kept: list[Tensor] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def truncated(self) -> list[bool]:
        return [r == "length" for r in self.finish_reasons]


# ---------------------------------------------------------------------------------------------
# Rewards


@dataclass(frozen=True)
class StepScores:
    """One completion's process reward: a score per step and where each step ends in its text."""

    scores: list[float]
    """[K] the reward of each step, finite"""
    ends: list[int]
    """[K] character offset just past each step's last character, strictly increasing, <= len(text);
    a step ending at len(text) ends at the completion's last token (EOS included)"""
    outcome: float | None = None
    """the completion's one-number reward where one is needed (reward/<name>, the total, dynamic
    sampling, evaluation); None = the sum of the step scores. Not used by the advantages."""

    def __post_init__(self) -> None:
        if problem := self.problem():
            raise ValueError(f"StepScores: {problem}")

    @property
    def value(self) -> float:
        return float(self.outcome) if self.outcome is not None else float(sum(self.scores))

    def problem(self, text_length: int | None = None) -> str | None:
        """What is wrong with these step scores (for a text of text_length characters), or None."""
        scores, ends = self.scores, self.ends
        if not isinstance(scores, (list, tuple)) or not isinstance(ends, (list, tuple)):
            return "scores and ends must be lists"
        if len(scores) != len(ends):
            return f"{len(scores)} scores but {len(ends)} step ends"
        if not scores:
            return "no steps (return None for 'not applicable')"
        if not all(
            isinstance(s, numbers.Real) and not isinstance(s, bool) and math.isfinite(s) for s in scores
        ):
            return f"scores must be finite numbers, got {scores!r}"
        if not all(isinstance(e, numbers.Integral) and not isinstance(e, bool) for e in ends):
            return f"ends must be ints (character offsets), got {ends!r}"
        if ends[0] < 0 or any(b <= a for a, b in zip(ends, ends[1:], strict=False)):
            return f"ends must be >= 0 and strictly increasing, got {list(ends)}"
        if text_length is not None and ends[-1] > text_length:
            return f"step end {ends[-1]} is past the end of the completion ({text_length} characters)"
        if self.outcome is not None and not (
            isinstance(self.outcome, numbers.Real) and math.isfinite(self.outcome)
        ):
            return f"outcome must be a finite number or None, got {self.outcome!r}"
        return None


@dataclass
class RewardOutput:
    total: Tensor  # [N] float32: nansum_k weight_k * per_function[k]; 0 where nothing applies
    per_function: dict[str, Tensor]  # name -> [N] float32 raw rewards, NaN where None or failed
    errors: dict[str, int]  # name -> samples whose reward failed in this call
    weights: dict[str, float]  # name -> weight
    steps: dict[str, list[StepScores | None]] = field(default_factory=dict)
    """name -> [N] the step scores of functions that returned any this call; None where an
    element was a float, None or invalid (per_function then holds its value or NaN)"""
    timeouts: dict[str, int] = field(default_factory=dict)
    """name -> calls that timed out or found the function still busy with one that had (absent = 0)"""
    scored: int | None = None
    """completions that `errors` counts over: N, or all those of the calls merged into this output
    (dynamic sampling's rounds, grpokit/data/batch.py); None = N"""
    skipped: Tensor | None = None
    """[N] bool: samples whose group is dropped from the loss because a call timed out under
    on_timeout=skip_group; their total is 0, so their group's advantages are exactly 0. None = no sample (made
    [N] False on construction)"""

    def __post_init__(self) -> None:
        if self.skipped is None:
            self.skipped = torch.zeros(self.total.shape, dtype=torch.bool)

    @property
    def skip_mask(self) -> Tensor:
        """`skipped` as the [N] bool tensor it is once constructed."""
        assert self.skipped is not None  # __post_init__ made it
        return self.skipped

    @staticmethod
    def take(spans: list[tuple[RewardOutput, slice]]) -> RewardOutput:
        """The samples `slice` of each output, concatenated in order: the groups dynamic sampling keeps
        (grpokit/data/batch.py), every rank's batch (grpokit/distributed/). Errors and timeouts, which count
        calls' failures, add up once per distinct output."""
        first = spans[0][0]
        sources = {id(src): src for src, _ in spans}.values()
        step_names = {k for src, _ in spans for k in src.steps}
        steps = {
            k: [s for src, sl in spans for s in src.steps.get(k, [None] * len(src.total))[sl]]
            for k in step_names
        }
        return RewardOutput(
            total=torch.cat([src.total[sl] for src, sl in spans]),
            per_function={
                k: torch.cat([src.per_function[k][sl] for src, sl in spans]) for k in first.per_function
            },
            errors={k: sum(src.errors[k] for src in sources) for k in first.errors},
            weights=first.weights,
            steps=steps,
            timeouts={k: sum(src.timeouts.get(k, 0) for src in sources) for k in first.errors},
            scored=sum(src.scored or src.total.numel() for src in sources),  # what the errors count over
            skipped=torch.cat([src.skip_mask[sl] for src, sl in spans]),
        )

    def metrics(self) -> dict[str, float]:
        """Scalars for logging (NaN when there is nothing to average):

        reward/total, reward/total/std    mean and std of the weighted total over the batch
        reward/<name>, reward/<name>/std   nanmean and nanstd of one function's raw reward
                                           over the samples it applies to
        reward/errors/<name>               samples whose reward from <name> failed this call
        reward/timeouts/<name>             calls of <name> that timed out (their samples are in errors too)
        reward/error_frac                  the largest errors/<name> over the scored completions
        reward/none_frac                   fraction of samples no function applies to (all None
                                           or failed); their total is 0
        reward/skipped_frac                fraction of samples whose group a timed-out call dropped
                                           (on_timeout=skip_group); their total is 0
        reward/<name>/steps                mean number of steps of <name>'s StepScores (only for
                                           functions that returned step scores)
        Stds are sample stds (Bessel-corrected, as TRL's nanstd); NaN under 2 values.
        """
        out = {REWARD_TOTAL: _nanmean(self.total), REWARD_TOTAL_STD: _nanstd(self.total)}
        for name, r in self.per_function.items():
            out[reward_fn(name)] = _nanmean(r)
            out[reward_fn_std(name)] = _nanstd(r)
            out[reward_errors(name)] = float(self.errors[name])
            out[reward_timeouts(name)] = float(self.timeouts.get(name, 0))
            if name in self.steps:
                counts = [len(s.scores) for s in self.steps[name] if s is not None]
                out[reward_fn_steps(name)] = sum(counts) / len(counts) if counts else float("nan")
        none = torch.stack(list(self.per_function.values())).isnan().all(dim=0)  # [N]
        out[REWARD_NONE_FRAC] = none.float().mean().item() if none.numel() else float("nan")
        scored = self.scored if self.scored is not None else self.total.numel()
        out[REWARD_ERROR_FRAC] = max(self.errors.values(), default=0) / scored if scored else float("nan")
        out[REWARD_SKIPPED_FRAC] = (
            self.skip_mask.float().mean().item() if self.skip_mask.numel() else float("nan")
        )
        return out


def _nanmean(x: Tensor) -> float:
    x = x[~x.isnan()]
    return x.mean().item() if x.numel() else float("nan")


def _nanstd(x: Tensor) -> float:
    x = x[~x.isnan()]
    return x.std().item() if x.numel() >= 2 else float("nan")


class Ranks(Protocol):
    """What the modules below the loop ask of the ranks: grpokit.distributed.World has it all, and at world
    size 1 every collective returns what the one process has. The math (grpokit/algorithm.py) and the
    checkpoints (grpokit/checkpoint/) take a Ranks, never the World, so that neither reads the world's
    wrapping or its process group."""

    size: int
    rank: int

    @property
    def is_main(self) -> bool: ...

    def sum(self, value: Any) -> Any: ...

    def gather(self, obj: Any) -> list[Any]: ...

    def barrier(self) -> None: ...

    def all_rows(self, x: Tensor) -> Tensor: ...

    def my_rows(self, x: Tensor) -> Tensor: ...
