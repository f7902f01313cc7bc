"""Rewards: load reward functions, call them as TRL does, combine them.

    manager = RewardManager(specs, strict=False, registry=None, timeout=300.0, slow_warning=60.0)
    out = manager(prompts=..., completions=..., completion_ids=..., columns={"answer": [...]})
    out.total          # [N] sum_k weight_k * r_k, None / failed entries counting as 0
    out.per_function   # name -> [N] raw (unweighted) rewards, NaN where None or failed
    out.errors         # name -> samples whose reward failed in this call
    out.timeouts       # name -> calls that timed out (0 or 1 here; summed when outputs are merged)
    out.skipped        # [N] bool: samples whose group a timed-out call dropped (on_timeout=skip_group)
    out.metrics()      # reward/... scalars, listed in RewardOutput.metrics

Calling convention (TRL's, so TRL reward functions work unchanged): keyword arguments only,
`fn(prompts=, completions=, completion_ids=, **columns, **spec.kwargs)` (chat prompts: each completion a list
of messages, [{"role": "assistant", "content": ...}], as TRL passes them), returning one
`float | None` per completion, or a `StepScores` (per-step scores with the character offsets
where the steps end: process rewards, grpokit/rewards/steps.py). A StepScores counts as its
`value` (its outcome, default the sum of its scores) wherever one number is needed, and is kept
in `out.steps` for the trainer's per-token advantages. A function without **kwargs gets only the arguments it
declares; a required argument that is none of these is a ValueError naming it and the columns.
Spec kwargs take precedence over a dataset column of the same name.

Combination (TRL's `nansum` of weighted rewards): None means "not applicable" and counts as 0
in the total; a sample for which no function applies gets total 0 and is counted in
`reward/none_frac`. Failures are isolated: a call that raises is retried on halves of the batch, and a
half that raises on its halves, down to single samples (RewardManager._isolate, which bounds the calls), so
exactly the samples the function raises on get no reward from it; a function that returns something other
than N numbers gives no reward to any sample this call; a bad element (NaN, inf, a string, ...) voids only
that element. Either way the samples are counted in `errors`, the first failure of each function is logged
once with its traceback (logger "grpokit.rewards"), later ones only counted. strict=True raises RewardError
(a RuntimeError) instead.

`async def` functions (grpokit/rewards/concurrent.py) are called the same way, once per batch, and all those
of a batch run at once on one event loop in a thread of the manager's, while the sync ones run one after the
other.

Time limits (grpokit/rewards/timeouts.py): a call of a function with a timeout (its spec's `timeout`, else the
manager's `timeout`: config reward_timeout; None or 0 = none) runs in a worker thread (an async one is
cancelled at its timeout); one that does not return in time is counted in `errors` and `timeouts`, is not
retried on parts, and scores as its spec's `on_timeout` says, else the manager's `on_timeout` (config
reward_on_timeout), else as `strict` says: skip (no reward from it), skip_group (the same, and the call's
samples are `skipped`: total 0, so their groups' advantages are 0), raise (RewardError) or a number (each
sample's value). A call slower than `slow_warning` seconds logs a warning with its time.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpokit.config import RewardSpec, check_on_timeout
from grpokit.config.imports import did_you_mean, load_object
from grpokit.metrics.compute import RESERVED_REWARD_NAMES
from grpokit.rewards.builtins import BUILTIN_REWARDS
from grpokit.rewards.concurrent import LoopThread, Pending, RewardLimit, is_async
from grpokit.rewards.steps import StepScores
from grpokit.rewards.text import as_messages, completion_text
from grpokit.rewards.timeouts import OnTimeout, TimedOut, timeout_advice
from grpokit.types import RewardOutput
from grpokit.values import real_number, short_repr

logger = logging.getLogger("grpokit.rewards")

#: arguments every reward function may receive besides the dataset columns
CALL_ARGS = ("prompts", "completions", "completion_ids")
#: and, in multi-turn rollouts with tools, the episodes (grpokit.tools.Episode) and their environments (TRL's
#: name)
EPISODE_ARGS = ("episodes", "environments")
#: names a reward may not take: they would collide with the summary metrics
# reward/<name> of these is another metric (grpokit/metrics/compute.py)
_RESERVED_NAMES = RESERVED_REWARD_NAMES


#: reward name -> function: the names a spec's `function` may use (BUILTIN_REWARDS by default;
#: the trainer's grpokit.rewards.reward_registry() adds the registered ones: the built-in tasks' rewards)
Registry = Mapping[str, Callable[..., Any]]


# -- loading -----------------------------------------------------------------------------


def resolve_reward(
    spec_function: str | Callable[..., Any], registry: Registry = BUILTIN_REWARDS
) -> Callable[..., Any]:
    """The callable a spec's `function` names: a name in `registry` (the built-ins by default;
    the trainer passes grpokit.rewards.reward_registry(), which adds the tasks' rewards),
    "package.module:function" (a dotted attribute path such as "mod:Class.method" works) or
    "path/to/file.py:function" (a target containing "/" or ending in ".py" is a file).
    A callable is returned as is."""
    if callable(spec_function):
        return spec_function
    if not isinstance(spec_function, str):
        raise ValueError(f"reward function must be a string or a callable, got {spec_function!r}")
    spec = spec_function.strip()
    if spec in registry:
        return registry[spec]
    if ":" not in spec:
        raise ValueError(
            f"reward {spec!r} is not a built-in ({', '.join(registry)}); {did_you_mean(spec, registry)}"
            "use 'package.module:function' or 'path/to/file.py:function'"
        )
    return load_object(
        spec,
        f"reward {spec!r}",
        hint="point at a function fn(completions, **kwargs) -> list[float | None]",
    )


def _default_name(function: str | Callable[..., Any], fn: Callable[..., Any], registry: Registry) -> str:
    if isinstance(function, str):
        function = function.strip()
        return function if function in registry else function.rsplit(":", 1)[-1].split(".")[-1]
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__name__", type(inner).__name__)


# -- one reward function -----------------------------------------------------------------


def _reward_label(function: str | Callable[..., Any], fn: Callable[..., Any]) -> str:
    """How messages name the function: its spec's string, or module:qualname of a callable."""
    if isinstance(function, str):
        return function
    inner = getattr(fn, "func", fn)  # functools.partial
    return f"{getattr(inner, '__module__', '?')}:{getattr(inner, '__qualname__', type(inner).__name__)}"


def _check_name(name: str, label: str) -> None:
    """A reward's name becomes the metric reward/<name>: no '/', and none of the summary metrics' names."""
    if name in _RESERVED_NAMES or "/" in name:
        why = (
            "contains '/'"
            if "/" in name
            else f"is reserved (reward/{name} is another metric; reserved: "
            f"{', '.join(sorted(_RESERVED_NAMES))})"
        )
        raise ValueError(f"reward {label!r}: name {name!r} {why}; set another `name`")


def _signature(
    fn: Callable[..., Any], name: str, kwargs: dict[str, Any]
) -> tuple[bool, frozenset[str], tuple[str, ...]]:
    """(accepts_any, params, required) of a reward function; raises on positional-only parameters and on
    spec kwargs the function does not take, and runs the function's own validate_kwargs."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins and C extensions: trust them with everything
        parameters = [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
    P = inspect.Parameter
    if positional_only := [
        p.name for p in parameters if p.kind is P.POSITIONAL_ONLY and p.default is P.empty
    ]:
        raise ValueError(
            f"reward {name!r}: parameters {positional_only} are positional-only, but reward "
            "functions are called with keyword arguments only (TRL's convention)"
        )
    keyword = [p for p in parameters if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    accepts_any = any(p.kind is P.VAR_KEYWORD for p in parameters)
    params = frozenset(p.name for p in keyword)
    if not accepts_any and (unknown := sorted(set(kwargs) - params)):
        raise ValueError(
            f"reward {name!r}: kwargs {unknown} are not parameters of the function "
            f"(it takes {sorted(params)} and no **kwargs)"
        )
    if validate := getattr(fn, "validate_kwargs", None):
        validate(kwargs)
    required = tuple(p.name for p in keyword if p.default is P.empty)
    return accepts_any, params, required


def _check_timeout(name: str, timeout: Any) -> float | None:
    """A spec's timeout in seconds: None (the manager's), or a number >= 0 where 0 and inf mean no limit."""
    if timeout is not None:
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, numbers.Real)
            or timeout < 0
            or math.isnan(timeout)
        ):
            raise ValueError(
                f"reward {name!r}: timeout must be a number of seconds >= 0 (0 = no limit), got {timeout!r}"
            )
        timeout = float(timeout) if math.isfinite(timeout) else 0.0  # inf: no limit
    return timeout


@dataclass
class _Reward:
    name: str
    fn: Callable[..., Any]
    weight: float
    kwargs: dict[str, Any]
    spec: str
    accepts_any: bool
    """the function has **kwargs (or an uninspectable signature): pass it everything"""
    params: frozenset[str]
    required: tuple[str, ...]
    timeout: float | None = None
    """the spec's own time limit in seconds (0 = none); None = the manager's"""
    on_timeout: str | float | None = None
    """what the spec's own timed-out calls score (OnTimeout); None = the manager's"""

    @classmethod
    def build(cls, spec: Any, registry: Registry) -> _Reward:
        if isinstance(spec, (str, RewardSpec)) or callable(spec):
            spec = spec if isinstance(spec, RewardSpec) else RewardSpec(function=spec)
        get = spec.get if isinstance(spec, Mapping) else (lambda k, d=None: getattr(spec, k, d))
        function = get("function")
        if function is None:
            raise ValueError(f"reward spec {spec!r} has no 'function'")
        fn = resolve_reward(function, registry)
        label = _reward_label(function, fn)
        name = get("name") or _default_name(function, fn, registry)
        _check_name(name, label)
        weight = get("weight", 1.0)
        weight = 1.0 if weight is None else weight
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"reward {name!r}: weight must be a finite number, got {weight!r}")
        kwargs = dict(get("kwargs") or {})
        if clash := sorted(set(kwargs) & set(CALL_ARGS + EPISODE_ARGS)):
            raise ValueError(f"reward {name!r}: kwargs may not set {clash}: the trainer passes them")
        accepts_any, params, required = _signature(fn, name, kwargs)
        timeout = _check_timeout(name, get("timeout"))
        try:
            on_timeout = check_on_timeout(get("on_timeout"))
        except ValueError as e:  # pydantic's error, raised outside a model
            raise ValueError(f"reward {name!r}: on_timeout {get('on_timeout')!r}: {e}") from None
        return cls(
            name, fn, float(weight), kwargs, str(label), accepts_any, params, required, timeout, on_timeout
        )

    def arguments(
        self, call_args: dict[str, Any], columns: Mapping[str, Any], prompt_column: str | None = None
    ) -> dict[str, Any]:
        """The keyword arguments of a call. prompt_column: the dataset's prompt column, which `columns` leave
        out (it reaches the function as `prompts`), for the message of a missing column."""
        available = {**columns, **call_args, **self.kwargs}
        if missing := [a for a in self.required if a not in available]:
            if missing[0] in EPISODE_ARGS:
                raise ValueError(
                    f"reward {self.name!r} ({self.spec}) needs argument {missing[0]!r}, which only "
                    "multi-turn rollouts with tools pass: add a tools section (tools.builtin, "
                    "tools.functions or tools.environment)"
                )
            raise ValueError(
                f"reward {self.name!r} ({self.spec}) needs argument {missing[0]!r}, which is not "
                f"one of {list(CALL_ARGS)} (nor, with tools, {list(EPISODE_ARGS)}), not in the spec's "
                f"kwargs, and not a dataset column; {_columns_text(columns, prompt_column)}. Add the column "
                "to the dataset or set it in kwargs"
            )
        if self.accepts_any:
            return available
        return {k: v for k, v in available.items() if k in self.params}


def _columns_text(columns: Mapping[str, Any], prompt_column: str | None) -> str:
    """The dataset's columns as a missing-column message names them: the prompt column too, said to be passed
    as `prompts` (a bare [] would read as a dataset without columns)."""
    if prompt_column is None:
        return f"dataset columns besides the prompt: {sorted(columns)}"
    return (
        f"dataset columns: {sorted([prompt_column, *columns])} (the prompt column {prompt_column!r} is "
        "passed as `prompts`)"
    )


# -- the combination ---------------------------------------------------------------------


class _Failure(Exception):
    """What went wrong with one reward function's output, for the log or strict mode."""


def _as_list(out: Any, n: int) -> list[Any]:
    if isinstance(out, (list, tuple)):
        items = list(out)
    elif hasattr(out, "tolist") and getattr(out, "ndim", None) == 1:  # numpy array, torch tensor
        items = out.tolist()
    else:
        raise _Failure(f"returned {type(out).__name__} instead of a list of N floats (N={n})")
    if len(items) != n:
        raise _Failure(f"returned {len(items)} rewards for {n} completions")
    return items


def _as_float(v: Any) -> float | None:
    """The element as a float, NaN for None ("not applicable"), None if it is not a number."""
    if v is None:
        return math.nan
    # grpokit/values.py's rules, but a bool counts as 0 or 1, as in TRL's float32 reward tensor
    return float(v) if isinstance(v, bool) else real_number(v)


def _check_batch(call_args: Mapping[str, list[Any]], columns: Mapping[str, list[Any]], n: int) -> None:
    """Every argument and column has one entry per completion, and no column shadows an argument."""
    for key, value in {**call_args, **columns}.items():
        if len(value) != n:
            raise ValueError(f"{key} has {len(value)} entries for {n} completions")
    if clash := sorted(set(columns) & set(call_args)):
        raise ValueError(f"dataset columns {clash} collide with the reward call's own arguments; rename them")


def _halves(part: list[int]) -> list[list[int]]:
    """The two halves of a part of 2 or more samples (the first one the smaller), as _isolate bisects."""
    return [part[: len(part) // 2], part[len(part) // 2 :]]


class RewardError(RuntimeError):
    """A reward function failed (raised, timed out, returned bad values) and the manager is strict."""


class RewardManager:
    """Calls each reward function once per batch (the sync ones one after the other, the async ones all at
    once) and combines them.

    specs: RewardSpec objects (grpokit.config.RewardSpec), or anything with attributes (or keys)
    function, weight, kwargs, name, timeout; a bare string or callable is a spec with weight 1.
    strict: raise RewardError on the first failing function instead of isolating it.
    registry: the names a spec's `function` may use; None = BUILTIN_REWARDS (the task-agnostic
    built-ins). The trainer passes grpokit.rewards.reward_registry(), the built-ins plus the
    built-in tasks' rewards (countdown, countdown_steps): rewards never import tasks.
    timeout: seconds a call may take when its spec sets no `timeout` (config reward_timeout); None or 0 = no
    limit.
    slow_warning: a call slower than this many seconds logs a warning (config reward_slow_warning); None or 0
    = never.
    on_timeout: what a timed-out call scores when its spec sets no `on_timeout` (config reward_on_timeout):
    "skip", "skip_group", "raise" or a number; None = as `strict` says ("raise" when strict, else "skip").
    """

    def __init__(
        self,
        specs: Any,
        strict: bool = False,
        registry: Registry | None = None,
        *,
        timeout: float | None = None,
        slow_warning: float | None = None,
        on_timeout: str | float | None = None,
    ):
        registry = BUILTIN_REWARDS if registry is None else registry
        self.rewards = [_Reward.build(s, registry) for s in specs]
        if not self.rewards:
            raise ValueError("no reward functions: give at least one reward spec")
        names = [r.name for r in self.rewards]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(
                f"reward names {dupes} are used more than once; give each spec a distinct `name`"
            )
        self.strict = strict
        self._reported: set[str] = set()
        self.timeout = timeout
        loop = LoopThread(
            "grpokit-rewards"
        )  # the async functions' event loop (grpokit/rewards/concurrent.py)
        self._limits = {  # main_thread: functions that need signal.alarm (grpokit/rewards/timeouts.py)
            r.name: RewardLimit(
                f"reward function {r.name!r} ({r.spec})",
                timeout if r.timeout is None else r.timeout,
                slow_warning,
                main_thread=any(
                    getattr(f, "main_thread", False) for f in (r.fn, getattr(r.fn, "func", None))
                ),
                loop=loop,
                is_async=is_async(r.fn),
            )
            for r in self.rewards
        }
        self._on_timeout = {
            r.name: OnTimeout.pick(r.on_timeout, check_on_timeout(on_timeout), strict) for r in self.rewards
        }

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    @property
    def weights(self) -> dict[str, float]:
        return {r.name: r.weight for r in self.rewards}

    def __call__(
        self,
        *,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        columns: Mapping[str, list[Any]] | None = None,
        episodes: list[Any] | None = None,
    ) -> RewardOutput:
        """episodes: [N] grpokit.tools.Episode of multi-turn rollouts with tools; then functions may also take
        `episodes` and `environments` (each episode's environment instance or None, as TRL passes them).
        Conversational prompts (chat messages): string completions are passed on as messages
        (text.as_messages)."""
        columns = dict(columns or {})
        n = len(completions)
        # what StepScores' offsets count in, taken before chat prompts' completions become messages (TRL)
        self._texts = [completion_text(c) for c in completions]
        completions = as_messages(prompts, completions, episodes)
        call_args = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
        if episodes is not None:
            call_args.update(
                episodes=episodes, environments=[getattr(e, "environment", None) for e in episodes]
            )
        _check_batch(call_args, columns, n)
        per_function, errors, steps, timeouts, skipped = self._call_all(call_args, columns, n)
        weighted = torch.stack([r.weight * per_function[r.name] for r in self.rewards])  # [K, N]
        total = torch.nansum(weighted, dim=0)  # [N]; nansum as TRL: None / failed count as 0
        # equal totals: the group's advantages are exactly 0 (grpokit/algo/advantages.py)
        total[skipped] = 0.0
        return RewardOutput(
            total=total,
            per_function=per_function,
            errors=errors,
            weights=self.weights,
            steps=steps,
            timeouts=timeouts,
            skipped=skipped,
        )

    def _call_all(
        self, call_args: dict[str, Any], columns: dict[str, Any], n: int
    ) -> tuple[dict[str, Tensor], dict[str, int], dict[str, list[StepScores | None]], dict[str, int], Tensor]:
        """Calls every function on the batch, the async ones started all at once first; returns per_function,
        errors, steps, timeouts and skipped ([N] bool) as RewardOutput has them."""
        per_function: dict[str, Tensor] = {}
        errors: dict[str, int] = {}
        steps: dict[str, list[StepScores | None]] = {}
        timeouts: dict[str, int] = {}
        skipped = torch.zeros(n, dtype=torch.bool)  # [N]
        started = {  # every async function at once
            r.name: self._limits[r.name].start(r.fn, r.arguments(call_args, columns))
            for r in self.rewards
            if self._limits[r.name].is_async
        }
        try:
            for reward in self.rewards:
                try:
                    per_function[reward.name], errors[reward.name], step_list = self._call(
                        reward, call_args, columns, n, started.pop(reward.name, None)
                    )
                except TimedOut as exc:
                    # not retried on parts, as a call that raises is: that would multiply the wait
                    per_function[reward.name] = self._timed_out(reward, exc, n)
                    errors[reward.name], step_list = n, None
                    timeouts[reward.name] = 1
                    skipped |= self._on_timeout[reward.name].drops_groups
                if step_list is not None:
                    steps[reward.name] = step_list
        finally:
            for pending in started.values():  # left by a RewardError (reward_errors=raise): stop them
                pending.future.cancel()
        return per_function, errors, steps, timeouts, skipped

    def _timed_out(self, reward: _Reward, exc: TimedOut, n: int) -> Tensor:
        """[n] what the samples of a call that timed out get from the function, as its OnTimeout says (or
        RewardError)."""
        rule = self._on_timeout[reward.name]
        advice = timeout_advice(reward.timeout, self.timeout)
        if rule.choice == "raise":
            raise RewardError(
                f"reward function {reward.name!r} ({reward.spec}) {exc} ({advice}{rule.stop_hint()})"
            ) from None
        self._report(
            reward,
            f"{exc} ({advice})",
            None,
            key=f"{reward.name}/timeout",
            outcome=rule.outcome(),
            stop=False,
        )
        return rule.scores(n)

    def _call(
        self,
        reward: _Reward,
        call_args: dict[str, Any],
        columns: dict[str, Any],
        n: int,
        started: Pending | None = None,
    ) -> tuple[Tensor, int, list[StepScores | None] | None]:
        """started: the call of an async function, under way since the batch began (RewardLimit.start)."""
        kwargs = reward.arguments(call_args, columns)  # a missing column raises: a setup error
        called = self._outputs(reward, kwargs, call_args, columns, n, started)
        if called is None:  # no reward to any sample this call
            return torch.full((n,), math.nan), n, None
        items, failed = called
        steps, step_problems = self._take_steps(items, n)
        return self._scores(reward, items, failed, steps, step_problems, n)

    def _outputs(
        self,
        reward: _Reward,
        kwargs: dict[str, Any],
        call_args: dict[str, Any],
        columns: dict[str, Any],
        n: int,
        started: Pending | None,
    ) -> tuple[list[Any], list[int]] | None:
        """The function's n outputs and the samples it raised on (when the batch call raised and was retried
        on parts, _isolate), or None when the call failed as a whole (reported, or raised when strict)."""
        failed: list[int] = []  # samples the function raised on (when the batch call raised)
        try:
            items = _as_list(self._limits[reward.name].call(reward.fn, kwargs, n, started), n)
        except TimedOut:
            raise
        except Exception as e:
            problem = str(e) if isinstance(e, _Failure) else f"raised {type(e).__name__}: {e}"
            if self.strict or isinstance(e, _Failure) or n == 1:
                self._report(reward, problem, e if not isinstance(e, _Failure) else None)
                return None
            items, failed = self._isolate(reward, call_args, columns, n)
            if 0 < len(failed) < n:
                problem = (
                    f"{problem} (on {len(failed)} of {n} samples, first at index {failed[0]}: the "
                    "others keep their scores)"
                )
            elif not failed:
                problem = (
                    f"{problem} on the whole batch, but not on its parts (retried): every sample has "
                    "its score"
                )
            self._report(reward, problem, e)
        return items, failed

    def _take_steps(self, items: list[Any], n: int) -> tuple[list[StepScores | None] | None, dict[int, str]]:
        """Replaces each valid StepScores in items by its value (in place); returns the per-sample StepScores
        (None when the function returned none) and the problems of the invalid ones by index."""
        steps: list[StepScores | None] | None = None
        step_problems: dict[int, str] = {}
        if any(isinstance(v, StepScores) for v in items):
            steps = [None] * n
            for i, v in enumerate(items):
                if not isinstance(v, StepScores):
                    continue
                if step_problem := v.problem(len(self._texts[i])):
                    step_problems[i] = step_problem
                    continue
                steps[i] = v
                items[i] = v.value
        return steps, step_problems

    def _scores(
        self,
        reward: _Reward,
        items: list[Any],
        failed: list[int],
        steps: list[StepScores | None] | None,
        step_problems: dict[int, str],
        n: int,
    ) -> tuple[Tensor, int, list[StepScores | None] | None]:
        """[n] the rewards (NaN where None, failed or invalid), the number of failed and invalid samples, and
        the StepScores (None where invalid); the first invalid value is reported."""
        values = [_as_float(v) for v in items]
        bad = [i for i, v in enumerate(values) if v is None]
        rewards = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)  # [N]
        # inf, NaN, and finite doubles that overflow float32 are bad values too; None is not
        none = torch.tensor([v is None for v in items], dtype=torch.bool)
        none[failed] = False  # raised on: an error, not "not applicable"
        bad = sorted(set(bad) | set(torch.nonzero(~rewards.isfinite() & ~none).flatten().tolist()))
        if invalid := [i for i in bad if i not in failed]:
            i = invalid[0]
            why = f": {step_problems[i]}" if i in step_problems else ""
            self._report(
                reward,
                f"returned {len(invalid)} invalid reward(s) of {n}, e.g. {short_repr(items[i])} at index "
                f"{i}{why} (rewards must be finite floats, StepScores or None)",
                None,
            )
        if bad:
            rewards[bad] = math.nan
            if steps is not None:
                for i in bad:
                    steps[i] = None
        return rewards, len(bad), steps

    def _isolate(
        self, reward: _Reward, call_args: dict[str, Any], columns: dict[str, Any], n: int
    ) -> tuple[list[Any], list[int]]:
        """After the batch call raised: bisect. Call the function on both halves of the samples; a part that
        raises is split again, down to single samples. A sample it raises on alone is failed; every other
        sample gets its value from the part that returned. Returns the items (None where it failed) and the
        failed indices: exactly the samples the function fails on, whatever their pattern.

        The bound, in calls of the function for a batch of n samples, the batch call included (stated in
        docs/rewards.md, checked by tests/test_rewards.py::test_isolation_finds_exactly_the_failing_samples):
        - Each part that raises and holds 2 or more samples costs two calls, its halves: the calls are
          1 + 2 * R, R the parts of 2 or more samples that raise (the batch is one of them).
        - Parts never overlap within a depth, and none is called twice: at most 2n - 1 calls (the nodes of
          a binary tree with n leaves), whatever the function does. One that fails on everything costs that.
        - A part of m samples splits into m // 2 and m - m // 2, so a part at depth l holds at most
          ceil(n / 2**l) samples, and parts of 2 or more lie at depths l < D = ceil(log2 n) only.
        - If the function fails on k samples (a call raises exactly when its part holds one of them), the
          raising parts at depth l are disjoint and each holds one of the k: at most min(2**l, k) of them.
          So R <= sum over l < D of min(2**l, k) = 2**a - 1 + k * (D - a), with a = ceil(log2 k), and
          calls <= B(n, k) = 2**(a + 1) - 1 + 2k (D - a) <= 2k * ceil(log2(n / k)) + 4k - 3 (k >= 1, as
          2**a <= 2k - 1 and D - a <= ceil(log2(n / k))): 2 * ceil(log2 n) + 1 for one failing sample, 1
          for none (the batch call returned). Example: n = 64 and k = 12 cost at most 79 calls."""
        items: list[Any] = [None] * n
        failed: list[int] = []
        parts = _halves(list(range(n)))
        while parts:
            raising = []
            for part in parts:
                sub_args = {k: [v[i] for i in part] for k, v in call_args.items()}
                sub_columns = {k: [v[i] for i in part] for k, v in columns.items()}
                try:
                    out = _as_list(
                        self._limits[reward.name].call(
                            reward.fn, reward.arguments(sub_args, sub_columns), len(part)
                        ),
                        len(part),
                    )
                except TimedOut:
                    raise
                except Exception:
                    if len(part) == 1:
                        failed.append(part[0])
                    else:
                        raising.append(part)
                    continue
                for i, v in zip(part, out, strict=True):
                    items[i] = v
            parts = [half for part in raising for half in _halves(part)]
        return items, sorted(failed)

    def _report(
        self,
        reward: _Reward,
        problem: str,
        exc: BaseException | None,
        key: str | None = None,
        outcome: str = "the affected samples get no reward from it (NaN in per_function)",
        stop: bool | None = None,
    ) -> None:
        """Logs a function's first failure of a kind (key), or raises RewardError when `stop` (default:
        strict)."""
        message = f"reward function {reward.name!r} ({reward.spec}) {problem}"
        if self.strict if stop is None else stop:
            raise RewardError(message) from exc
        key = key or reward.name  # a function's first timeout is reported even after its first failure
        if key in self._reported:
            return
        self._reported.add(key)
        later = "failures are only counted in " + (
            f"reward/errors/{reward.name}"
            if key == reward.name
            else f"reward/errors/{reward.name} and reward/timeouts/{reward.name}"
        )
        logger.error("%s; %s. Reported once: later %s", message, outcome, later, exc_info=exc)
