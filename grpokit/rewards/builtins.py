"""Built-in reward functions, TRL style: `fn(completions=..., completion_ids=..., **columns)`
returns one `float | None` per completion (None: "not applicable to this sample").

    name       reads                         settings (spec kwargs)               value
    math       completions, answer           timeout_seconds=5                    1.0 / 0.0, None: gold
                                                                                  unparsable
    format     completions                   pattern, search=False, dotall=True   1.0 / 0.0
    overlong   completion_ids                max_completion_length, cache_length  DAPO eq. 13, in [-1, 0]
    length     completion_ids                max_completion_length, coef=1.0      -coef * L /
                                                                                  max_completion_length
    code_tests completions, tests            partial=True, sandbox limits         passed / total
                                                                                  (grpokit/rewards/code.py)

These are the task-agnostic built-ins. A built-in task's rewards (countdown, countdown_steps) live
with the task (grpokit/tasks/); `grpokit.rewards.reward_registry()` is this table plus them, the
names a config's `rewards` may use.

A function may carry a `validate_kwargs(kwargs)` attribute; RewardManager calls it when it is
built, so a missing or bad setting fails at start-up, not at the first reward.
Completions may be strings or (conversational datasets) lists of messages; the text scored is
the last message's content, as in TRL.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from typing import Any

from grpokit.rewards.code import code_tests
from grpokit.rewards.text import completion_text

logger = logging.getLogger("grpokit.rewards")


def _check_positive_int(kwargs: dict, key: str, reward: str) -> int:
    if key not in kwargs:
        raise ValueError(f"reward {reward!r} needs kwargs[{key!r}] (an int > 0) in its spec")
    value = kwargs[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"reward {reward!r}: kwargs[{key!r}] must be an int > 0, got {value!r}")
    return value


# -- math --------------------------------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _last_boxed(text: str) -> str | None:
    """Content of the last well-formed \\boxed{...} (or \\fbox{...}) in text, braces balanced."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def extract_final_answer(text: str) -> str:
    """The part of a completion that holds its final answer: inside the last <answer>...</answer>
    when there is one, the last \\boxed{} there; else the whole text (math-verify then looks for
    "final answer is ..." phrases and the last expression)."""
    tags = _ANSWER_TAG.findall(text)
    scope = tags[-1] if tags else text
    boxed = _last_boxed(scope)
    return "\\boxed{" + boxed + "}" if boxed is not None else scope


def _math_timeout(timeout_seconds: int | None) -> int | None:
    # math-verify's timeout is signal.alarm, which works only in the main thread of a POSIX
    # process (elsewhere it raises ValueError). Off the main thread we run without a timeout:
    # a pathological expression can then stall the caller.
    if os.name == "posix" and threading.current_thread() is threading.main_thread():
        return timeout_seconds
    return None


def math_reward(
    completions: list, answer: list, *, timeout_seconds: int | None = 5, **kwargs: Any
) -> list[float | None]:
    """Math answer correctness with math-verify (as TRL's / open-r1's accuracy_reward).

    1.0 if the completion's final answer (last \\boxed{} inside the last <answer> tag, else in
    the text; else math-verify's own extraction) equals the gold `answer` column
    (symbolically or numerically), else 0.0. None when the gold itself does not parse, so the
    sample is "not applicable" rather than wrong. math-verify's internal failures score 0.0.
    """
    from math_verify import parse, verify  # imported here: sympy takes a while to import

    timeout = _math_timeout(timeout_seconds)
    gold_cache: dict[str, list] = {}  # each gold repeats G times in a GRPO batch

    def parse_gold(gold: Any) -> list:
        text = str(gold).strip()
        if text not in gold_cache:
            # A bare gold like "\frac{1}{2}" has no LaTeX delimiters for math-verify to anchor on.
            anchored = any(a in text for a in ("$", "\\boxed", "\\(", "\\["))
            gold_cache[text] = parse(text if anchored else f"${text}$", parsing_timeout=timeout)
        return gold_cache[text]

    rewards: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        gold_parsed = parse_gold(gold) if gold is not None and str(gold).strip() else []
        if not gold_parsed:
            rewards.append(None)
            continue
        try:
            pred = parse(extract_final_answer(completion_text(completion)), parsing_timeout=timeout)
            rewards.append(float(bool(pred) and verify(gold_parsed, pred, timeout_seconds=timeout)))
        except Exception:  # math-verify bugs on odd inputs: unverified means wrong, as in TRL
            logger.debug("math-verify failed on %r", completion, exc_info=True)
            rewards.append(0.0)
    return rewards


def _validate_math(kwargs: dict) -> None:
    t = kwargs.get("timeout_seconds", 5)
    if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0):
        raise ValueError(f"reward 'math': kwargs['timeout_seconds'] must be an int >= 0 or None, got {t!r}")


math_reward.validate_kwargs = _validate_math  # type: ignore[attr-defined]  # function attribute
# Called in the main thread (no reward_timeout, grpokit/rewards/timeouts.py), where math-verify's own
# per-expression timeouts (signal.alarm) work: a pathological answer costs timeout_seconds, not the call.
math_reward.main_thread = True  # type: ignore[attr-defined]  # function attribute


# -- format ------------------------------------------------------------------------------

#: <think>...</think> then <answer>...</answer>, each tag once, whitespace allowed around them
#: (open-r1's format_reward asks for exact newlines; small models rarely get those right).
THINK_ANSWER_PATTERN = r"\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*</answer>\s*"


def format_reward(
    completions: list,
    *,
    pattern: str = THINK_ANSWER_PATTERN,
    search: bool = False,
    dotall: bool = True,
    **kwargs: Any,
) -> list[float]:
    """1.0 if the completion matches the regex `pattern`, else 0.0 (TRL / open-r1 format_reward).

    The whole completion must match (re.fullmatch) unless `search=True` (re.search: anywhere);
    `dotall` (default True) lets "." cross newlines.
    """
    regex = re.compile(pattern, re.DOTALL if dotall else 0)
    match = regex.search if search else regex.fullmatch
    return [1.0 if match(completion_text(c)) else 0.0 for c in completions]


def _validate_format(kwargs: dict) -> None:
    try:
        re.compile(kwargs.get("pattern", THINK_ANSWER_PATTERN))
    except (re.error, TypeError) as e:
        raise ValueError(f"reward 'format': kwargs['pattern'] is not a valid regex: {e}") from e


format_reward.validate_kwargs = _validate_format  # type: ignore[attr-defined]  # function attribute


# -- length shaping ----------------------------------------------------------------------


def overlong_reward(
    completion_ids: list, *, max_completion_length: int, cache_length: int, **kwargs: Any
) -> list[float]:
    """DAPO soft overlong punishment (arXiv 2503.14476, eq. 13), L = len(completion_ids):

        0                                  if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
        -1                                 if L > L_max

    with L_max = max_completion_length (the generation limit) and L_cache = cache_length.
    DAPO: L_max = 20480, L_cache = 4096. completion_ids are unpadded (EOS counts if generated).
    """
    free = max_completion_length - cache_length  # L_max - L_cache
    rewards = []
    for ids in completion_ids:
        n = len(ids)
        if n <= free:
            rewards.append(0.0)
        elif n <= max_completion_length:
            rewards.append((free - n) / cache_length)
        else:
            rewards.append(-1.0)
    return rewards


def _validate_overlong(kwargs: dict) -> None:
    max_len = _check_positive_int(kwargs, "max_completion_length", "overlong")
    cache = _check_positive_int(kwargs, "cache_length", "overlong")
    if cache > max_len:
        raise ValueError(
            f"reward 'overlong': cache_length ({cache}) must be <= max_completion_length ({max_len})"
        )


overlong_reward.validate_kwargs = _validate_overlong  # type: ignore[attr-defined]  # function attribute


def length_reward(
    completion_ids: list, *, max_completion_length: int, coef: float = 1.0, **kwargs: Any
) -> list[float]:
    """Linear length penalty: r = -coef * L / max_completion_length, L = len(completion_ids),
    so r runs from 0 (empty) to -coef (at the limit). A negative coef rewards length instead."""
    return [-coef * len(ids) / max_completion_length for ids in completion_ids]


def _validate_length(kwargs: dict) -> None:
    _check_positive_int(kwargs, "max_completion_length", "length")


length_reward.validate_kwargs = _validate_length  # type: ignore[attr-defined]  # function attribute


BUILTIN_REWARDS: dict[str, Callable[..., list]] = {
    "math": math_reward,
    "format": format_reward,
    "overlong": overlong_reward,
    "length": length_reward,
    "code_tests": code_tests,  # sandboxed
}
