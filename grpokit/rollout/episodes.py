"""Multi-turn rollouts with tools, on any engine: the rollout stage's business, so the update sees masks, not
tools.

    engine = ToolRollout(
        make_engine("fast", model, tok), tok, [as_tool(calculator)], fmt=make_format("plain"), max_turns=4
    )
    comps = engine.generate(prompt_ids, G, SamplingParams(max_tokens=64), columns=[row.columns, ...])
    comps.token_ids[i]    # the model's turns interleaved with tool results, after the prompt
    comps.model_mask[i]   # 1 on the model's tokens, 0 on tool-result / template tokens
    comps.episodes[i]     # grpokit.tools.Episode: messages, calls, results, turns

Each turn, every unfinished episode of the batch goes through the engine in one call (the first turn of the G
episodes of a prompt as n=G samples of it, sharing its prefill; later turns as n=1 continuations of each
episode's own context, prompt + everything so far), so the G episodes of a prompt run independently. After a
turn:
  - no tool call: the episode ends ("stop" at EOS, "length" when it ran out of tokens);
  - a tool call at turn rollout.max_turns: the episode ends there, the call not run
    (Episode.cut = "max_turns");
  - otherwise the calls run (a thread pool across the batch; each under tools.timeout) and their results are
    appended as context; if the results would leave no token of the budget rollout.max_completion_length
    (which counts model and tool tokens alike, as TRL's max_completion_length does), the episode ends before
    them: finish "length", Episode.cut = "budget".
Log-probs: the engine's for the model's tokens (0.0 on tool tokens) when it returns them (fast does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from grpokit.rollout.base import Completions, EngineCaps, RolloutEngine, SamplingParams
from grpokit.rollout.hf import eos_token_ids
from grpokit.tools.episode import Episode, ToolCall, episode_metrics
from grpokit.tools.formats import ChatTemplateFormat, ParsedCall, PlainFormat
from grpokit.tools.registry import Tool, ToolBox


@dataclass
class _Run:
    """One episode in flight."""

    prompt: list[int]
    box: ToolBox
    episode: Episode
    observation: list[int]  # tokens of reset()'s observation, context before the first turn ([] without one)
    ids: list[int] = field(default_factory=list)  # the completion so far: model turns and tool results
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    call_ends: list[int] = field(
        default_factory=list
    )  # per call: token count of the completion up to its end
    call_chars: list[int] = field(
        default_factory=list
    )  # per call: characters of its turn's text up to its end
    pending: list[str] = field(default_factory=list)  # raw calls of the last turn, to run
    finish: str | None = None

    @property
    def context(self) -> list[int]:
        return self.prompt + self.ids


def prefix_tokens(tokenizer: Any, ids: list[int], chars: int) -> int:
    """The fewest leading tokens of `ids` whose text (skip_special_tokens) has at least `chars` characters: a
    bisection (O(log L) decodes), as the decoded length of a prefix grows with the prefix."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


class ToolRollout:
    """A rollout engine that runs multi-turn episodes with tools on top of another engine (hf, fast, ...)."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        tools: Sequence[Tool],
        *,
        fmt: PlainFormat | ChatTemplateFormat,
        max_turns: int,
        environment: Callable[[], Any] | None = None,
        timeout: float = 10.0,
        max_result_chars: int = 1000,
        max_workers: int = 4,
    ):
        if max_turns < 1:
            raise ValueError(f"rollout.max_turns must be >= 1, got {max_turns}")
        self.engine, self.tokenizer, self.tools, self.fmt = engine, tokenizer, list(tools), fmt
        self.max_turns, self.environment, self.timeout = max_turns, environment, timeout
        self.max_result_chars, self.max_workers = max_result_chars, max_workers
        self.eos_ids = getattr(engine, "eos_ids", None) or eos_token_ids(
            getattr(engine, "model", None), tokenizer
        )
        self.last_metrics: dict[str, float] = {}
        ToolBox(self.tools)  # distinct names, checked now

    @property
    def caps(self) -> EngineCaps:  # what the engine underneath can do, but episodes carry no kept sets
        return replace(self.engine.caps, kept_sets=False)

    def sync_weights(self, model, version: int | None = None) -> None:
        self.engine.sync_weights(model, version=version)

    def close(self) -> None:
        self.engine.close()

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        sampling: SamplingParams,
        columns: Sequence[dict[str, Any]] | None = None,
    ) -> Completions:
        """G = n episodes per prompt, prompt-major. columns: each prompt's dataset row, for the environment's
        reset."""
        runs = self._start(prompt_token_ids, n, columns)
        self._logprobs = True  # every turn's engine call returned log-probs
        for turn in range(1, self.max_turns + 1):
            active = [r for r in runs if r.finish is None]
            if not active:
                break
            shared = turn == 1 and not any(r.observation for r in runs)
            self._turn(active, turn, n if shared else 1, prompt_token_ids if shared else None, sampling)
            self._run_calls([r for r in active if r.finish is None and r.pending], sampling.max_tokens)
        return self._completions(runs)

    def _start(
        self, prompts: list[list[int]], n: int, columns: Sequence[dict[str, Any]] | None
    ) -> list[_Run]:
        runs = []
        for i, prompt in enumerate(prompts):
            for _ in range(n):
                row = dict(columns[i]) if columns is not None else {}
                box, observation = ToolBox.for_episode(
                    self.tools,
                    self.environment,
                    columns=row,
                    timeout=self.timeout,
                    max_result_chars=self.max_result_chars,
                )
                obs = self.tokenizer.encode(observation, add_special_tokens=False) if observation else []
                run = _Run(list(prompt), box, Episode(environment=box.environment), obs)
                if obs:  # TRL appends it to the last user message; here it is context before the first turn
                    run.ids, run.mask, run.logprobs = list(obs), [0] * len(obs), [0.0] * len(obs)
                    run.episode.messages.append({"role": "user", "content": observation})
                runs.append(run)
        return runs

    def _turn(
        self, active: list[_Run], turn: int, n: int, prompts: list[list[int]] | None, sampling: SamplingParams
    ) -> None:
        """One engine call for every active episode, then each episode's turn is cut, recorded and judged."""
        budget = max(sampling.max_tokens - len(r.ids) for r in active)
        stop = (
            (tuple(self.tokenizer.encode(self.fmt.call_close, add_special_tokens=False)),)
            if self.fmt.ends_turn_at_call
            else ()
        )
        out = self.engine.generate(
            prompts if prompts is not None else [r.context for r in active],
            n,
            replace(sampling, max_tokens=budget, stop_token_ids=stop),
        )  # stop: saves tokens only
        self._logprobs = self._logprobs and out.logprobs is not None
        for j, run in enumerate(active):
            left = sampling.max_tokens - len(run.ids)
            ids = out.token_ids[j][:left]
            lps = out.logprobs[j][: len(ids)] if out.logprobs is not None else [0.0] * len(ids)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            cut, raws = self.fmt.split_turn(text)
            if cut is not None:
                keep = prefix_tokens(self.tokenizer, ids, cut)
                ids, lps, text = ids[:keep], lps[:keep], text[:cut]
            ended = bool(ids) and ids[-1] in self.eos_ids
            run.ids, run.mask, run.logprobs = (
                run.ids + ids,
                run.mask + [1] * len(ids),
                run.logprobs + list(lps),
            )
            run.episode.messages.append({"role": "assistant", "content": text})
            run.episode.turns = turn
            calls_complete = bool(raws) and (self.fmt.ends_turn_at_call or ended)
            if not calls_complete:  # the answer; or a close marker without a call, where the engine stopped
                ended = ended or (
                    self.fmt.ends_turn_at_call and text.endswith(self.fmt.call_close) and len(ids) < left
                )
                run.finish = "stop" if ended else "length"
                run.episode.cut = None if ended else "budget"
                continue
            starts, pos = [], 0
            for raw in raws:  # where each call ends in the turn's text
                pos = text.find(raw, pos) + len(raw)
                starts.append(min(len(text), text.find(self.fmt.call_close, pos) + len(self.fmt.call_close)))
            run.call_ends += [len(run.ids)] * len(raws)
            run.call_chars += [c - len(text) for c in starts]  # <= 0: offset from the end of the turn's text
            run.pending = raws
            if turn == self.max_turns:
                run.finish, run.episode.cut = "stop", "max_turns"
                run.episode.tool_calls += [self._record(raw, run.box, turn, ran=False) for raw in raws]
                run.pending = []

    def _record(self, raw: str, box: ToolBox, turn: int, outcome=None, *, ran: bool = True) -> ToolCall:
        parsed: ParsedCall = self.fmt.parse(raw, box)
        call = ToolCall(raw=raw, name=parsed.name, arguments=parsed.arguments, turn=turn)
        if parsed.problem is not None:
            call.error, call.result = "parse", f"error: could not parse the call: {parsed.problem}"
        elif not ran:  # a call at the last turn is not run: only whether it was well formed
            call.error, call.result = box.check(parsed.name, parsed.arguments)[0] or "not_run", ""
        elif outcome is not None:
            call.result, call.error, call.seconds = outcome.text, outcome.error, outcome.seconds
        return call

    def _run_calls(self, runs: list[_Run], max_tokens: int) -> None:
        """Run the pending calls of every episode (a thread pool over the batch) and append their results."""
        jobs = [(run, raw) for run in runs for raw in run.pending]

        def one(job: tuple[_Run, str]) -> ToolCall:
            run, raw = job
            parsed = self.fmt.parse(raw, run.box)
            outcome = run.box.call(parsed.name, parsed.arguments) if parsed.problem is None else None
            return self._record(raw, run.box, run.episode.turns, outcome)

        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(jobs)))) as pool:
            calls = list(pool.map(one, jobs))
        at = 0
        for run in runs:
            mine, at = calls[at : at + len(run.pending)], at + len(run.pending)
            run.pending = []
            run.episode.tool_calls += mine
            results = [(c.name or "", c.result) for c in mine]
            ids = self.fmt.render_results(results, self.tokenizer)
            if len(run.ids) + len(ids) >= max_tokens:  # no room for the model to read them and answer
                run.finish, run.episode.cut = "length", "budget"
                continue
            run.ids, run.mask, run.logprobs = (
                run.ids + ids,
                run.mask + [0] * len(ids),
                run.logprobs + [0.0] * len(ids),
            )
            run.episode.messages += [
                {"role": "tool", "name": name, "content": text} for name, text in results
            ]

    def _completions(self, runs: list[_Run]) -> Completions:
        texts = self.tokenizer.batch_decode([r.ids for r in runs], skip_special_tokens=True)
        for run, text in zip(runs, texts, strict=True):
            last = 0
            for call, tokens, back in zip(run.episode.tool_calls, run.call_ends, run.call_chars, strict=True):
                end = len(self.tokenizer.decode(run.ids[:tokens], skip_special_tokens=True)) + back
                call.end = last = min(len(text), max(end, last + 1))  # strictly increasing (StepScores.ends)
        episodes = [r.episode for r in runs]
        comps = Completions(
            token_ids=[r.ids for r in runs],
            texts=texts,
            finish_reasons=[r.finish or "length" for r in runs],
            logprobs=[r.logprobs for r in runs] if self._logprobs else None,
            model_mask=[r.mask for r in runs],
            episodes=episodes,
        )
        self.last_metrics = episode_metrics(episodes)
        return comps


def generate_groups(
    engine: RolloutEngine, rows: Sequence[Any], G: int, sampling: SamplingParams, metrics: dict[str, float]
) -> Completions:
    """G completions of each row's prompt: episodes with tools when the engine is a ToolRollout (their
    rollout/tools/ metrics go into `metrics`), else the engine's one-turn completions."""
    if not isinstance(engine, ToolRollout):
        return engine.generate([r.prompt_ids for r in rows], G, sampling)
    comps = engine.generate([r.prompt_ids for r in rows], G, sampling, columns=[r.columns for r in rows])
    metrics.update(engine.last_metrics)
    return comps


def with_tools(engine: RolloutEngine, cfg: Any, tokenizer: Any) -> RolloutEngine:
    """The engine itself, or (a `tools:` section with a tool in it) a ToolRollout around it that runs
    episodes."""
    if not cfg.tools.enabled:
        return engine
    from grpokit.tools.formats import make_format
    from grpokit.tools.setup import load_tools

    tools, environment = load_tools(cfg.tools)
    return ToolRollout(
        engine,
        tokenizer,
        tools,
        fmt=make_format(cfg.tools.format),
        max_turns=cfg.rollout.max_turns,
        environment=environment,
        timeout=cfg.tools.timeout,
        max_result_chars=cfg.tools.max_result_chars,
        max_workers=cfg.tools.max_workers,
    )
