"""Held-out evaluation with fixed decoding: pass@1 (greedy), pass@k, maj@k and mean@k (sampled, seeded).

    metrics = evaluate(engine, rows, judge, k=8, temperature=1.0, max_tokens=64, seed=1234)

`judge(rows, completions) -> (score, correct, well_formed)` turns completions into per-sample floats
and booleans; `make_judge` builds one from a RewardManager (correct = the judging reward >= threshold).
Sampling runs under a forked RNG, so evaluating never changes the training run's random stream.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from grpokit.metrics.compute import (
    EVAL_FORMAT_RATE,
    EVAL_MEAN_LENGTH,
    EVAL_NUM_PROMPTS,
    EVAL_PASS_AT_1,
    EVAL_REWARD_MEAN,
    EVAL_TIME,
    EVAL_TOOLS_PREFIX,
    eval_maj_at,
    eval_mean_at,
    eval_pass_at,
)
from grpokit.rollout.base import Completions, SamplingParams
from grpokit.rollout.episodes import generate_groups
from grpokit.tools.episode import episode_metrics

Judge = Callable[[Sequence, Completions], tuple[list[float], list[bool], list[bool]]]


def make_judge(reward_manager, *, reward_name: str | None = None, threshold: float = 1.0) -> Judge:
    """Judge with one reward function's raw value (default: the first configured one)."""

    def judge(rows, comps: Completions):
        n = len(comps) // len(rows)

        def expand(xs):
            return [x for x in xs for _ in range(n)]

        columns = {c: expand([r.columns[c] for r in rows]) for c in rows[0].columns}
        out = reward_manager(
            prompts=expand([r.prompt for r in rows]),
            completions=comps.texts,
            completion_ids=comps.token_ids,
            columns=columns,
            episodes=comps.episodes,  # multi-turn rollouts with tools (None otherwise)
        )
        name = reward_name or next(iter(out.per_function))
        if name not in out.per_function:
            raise ValueError(
                f"eval reward {name!r} is not one of the configured rewards: {', '.join(out.per_function)}"
            )
        raw = torch.nan_to_num(out.per_function[name], nan=0.0)
        fmt = out.per_function.get("format")
        fmt = torch.nan_to_num(fmt, nan=0.0) > 0 if fmt is not None else raw > 0
        return raw.tolist(), (raw >= threshold).tolist(), fmt.tolist()

    return judge


def answer_key(text: str) -> str:
    """What maj@k votes on: the completion with whitespace normalized."""
    return " ".join(text.split())


@torch.no_grad()
def evaluate(
    engine,
    rows: Sequence,
    judge: Judge,
    *,
    k: int = 8,
    temperature: float = 1.0,
    max_tokens: int = 256,
    batch_size: int = 64,
    seed: int = 1234,
) -> dict[str, float]:
    t0 = time.perf_counter()
    greedy = SamplingParams(max_tokens=max_tokens, greedy=True)
    correct, fmt, scores, lengths, episodes = [], [], [], [], []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        comps = generate_groups(
            engine, chunk, 1, greedy, {}
        )  # with tools: episodes (environments reset with the rows)
        s, c, f = judge(chunk, comps)
        scores += s
        correct += c
        fmt += f
        lengths += [len(t) for t in comps.token_ids]
        episodes += comps.episodes or []
    n = max(len(rows), 1)
    metrics = {
        EVAL_PASS_AT_1: sum(correct) / n,
        EVAL_FORMAT_RATE: sum(fmt) / n,
        EVAL_REWARD_MEAN: sum(scores) / n,
        EVAL_MEAN_LENGTH: sum(lengths) / max(len(lengths), 1),
        EVAL_NUM_PROMPTS: float(len(rows)),
        **(
            episode_metrics(episodes, prefix=EVAL_TOOLS_PREFIX) if episodes else {}
        ),  # greedy episodes' tool use
    }
    if k > 1:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        any_ok, maj_ok, sample_ok = 0, 0, 0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(rows), max(1, batch_size // k) or 1):
                chunk = rows[start : start + max(1, batch_size // k)]
                comps = generate_groups(engine, chunk, k, sampling, {})
                _, ok, _ = judge(chunk, comps)
                for i in range(len(chunk)):
                    oks = ok[i * k : (i + 1) * k]
                    keys = [answer_key(t) for t in comps.texts[i * k : (i + 1) * k]]
                    any_ok += any(oks)
                    sample_ok += sum(oks)
                    top = Counter(keys).most_common(1)[0][0]  # ties: the first seen
                    maj_ok += oks[keys.index(top)]
        metrics[eval_pass_at(k)] = any_ok / n
        metrics[eval_maj_at(k)] = maj_ok / n
        metrics[eval_mean_at(k)] = sample_ok / (n * k)
    metrics[EVAL_TIME] = time.perf_counter() - t0
    return metrics
