"""Reward calls with a time limit (config `reward_timeout`, a reward's own `timeout`) and a warning for slow
ones.

    limit = CallLimit("reward function 'judge' (my_rewards:judge)", timeout=300.0, slow=60.0)
    out = limit.call(fn, kwargs, n)   # fn(**kwargs), or TimedOut once `timeout` seconds pass without an
                                      # answer

Python cannot stop a thread. With a time limit the call runs in a daemon worker thread and the caller stops
waiting when the time is up: the abandoned call may go on in the background (its result is dropped; a daemon
thread does not keep the process from exiting). Until it returns the function is busy: a later call is not
started (abandoned threads would pile up) and is a TimedOut at once. A timed-out call is not retried on parts
of the batch, as a call that raises is: that would multiply the wait.

signal.alarm works only in the main thread, and math-verify's own per-expression timeouts use it (so do the
built-in `math` reward and TRL's accuracy_reward, through math-verify). A function marked `fn.main_thread =
True` runs in the caller's thread, without the time limit (its own timeouts bound it); a function that fails
in the worker with "signal only works in main thread" is marked so, with a warning, and called again in the
caller's. `async def` functions are cancelled at their timeout instead (grpokit/rewards/concurrent.py).

What a timed-out call scores (config reward_on_timeout, a reward's own on_timeout) is an OnTimeout:

    rule = OnTimeout.pick(own="skip_group", default=None, strict=False)
    rule.scores(n)        # [N] the function's values for the call's samples: NaN (skip, skip_group) or the
                          # number
    rule.drops_groups     # skip_group: the call's groups get no advantage (RewardOutput.skipped)
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger("grpokit.rewards")

_MAIN_THREAD_ONLY = (
    "signal only works in main thread"  # CPython's ValueError from signal.signal in another thread
)


class TimedOut(Exception):
    """A call that did not return within its time limit, or was not started because an earlier one still
    runs."""


def timeout_advice(own: float | None, default: float | None) -> str:
    """The keys that set a function's time limit, for the message of a call that ran past it. own: the
    reward's own `timeout` (None = unset: the manager's `default`, config reward_timeout)."""
    if own is not None:
        return f"its own timeout={own:g} s in rewards:; raise it, or make the function faster"
    return (
        f"reward_timeout={default or 0:g} s; raise it, give this reward its own `timeout` in rewards:, or "
        "make the function faster"
    )


@dataclass(frozen=True)
class OnTimeout:
    """What a call that timed out scores. choice: "skip" (its samples get no reward from the function, NaN, as
    reward_errors=skip), "skip_group" (the same, and every group of the call is dropped from the loss),
    "raise" (RewardError) or a number (each of its samples scores that). key: the setting that chose it, for
    messages ("reward_on_timeout", "its own on_timeout"; "" when it follows reward_errors)."""

    choice: str | float
    key: str = ""

    @classmethod
    def pick(cls, own: str | float | None, default: str | float | None, strict: bool) -> OnTimeout:
        """A reward's own on_timeout, else the manager's (config reward_on_timeout), else as reward_errors
        says."""
        if own is not None:
            return cls(own, "its own on_timeout")
        if default is not None:
            return cls(default, "reward_on_timeout")
        return cls("raise" if strict else "skip")

    @property
    def drops_groups(self) -> bool:
        return self.choice == "skip_group"

    def scores(self, n: int) -> Tensor:
        """[n] the function's values for the samples of a timed-out call."""
        return torch.full((n,), math.nan if isinstance(self.choice, str) else float(self.choice))

    def outcome(self) -> str:
        """What happened to the call's samples, for the log."""
        if self.drops_groups:
            return (
                "the affected samples get no reward from it, and their groups are dropped from the loss "
                "(skip_group: their advantages are 0; reward/skipped_frac counts them)"
            )
        if isinstance(self.choice, str):
            return "the affected samples get no reward from it (NaN in per_function)"
        return f"each affected sample scores {self.choice:g} from it ({self.key}={self.choice:g})"

    def stop_hint(self) -> str:
        """How to go on instead of stopping, when the run stops at a timeout ("" when reward_errors=raise
        stopped it)."""
        return f"; {self.key}=raise stops the run: skip, skip_group or a score goes on" if self.key else ""


def _needs_main_thread(exc: BaseException | None) -> bool:
    while exc is not None:  # math-verify raises its own ValueError from CPython's
        if _MAIN_THREAD_ONLY in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class CallLimit:
    """The time limit of one reward function. label names it in messages ("reward function 'x' (spec)");
    timeout: seconds, None or 0 = no limit (the call then runs in the caller's thread); slow: seconds after
    which a call that returned logs a warning with its time, None or 0 = never."""

    def __init__(
        self, label: str, timeout: float | None, slow: float | None = None, *, main_thread: bool = False
    ):
        self.label = label
        self.timeout = timeout or None
        self.slow = slow or None
        self.main_thread = main_thread
        self._busy: threading.Thread | None = None  # the worker of a call that timed out, maybe still running
        self._busy_started = 0.0

    def call(self, fn: Callable[..., Any], kwargs: dict[str, Any], n: int) -> Any:
        """fn(**kwargs) on a batch of n completions: its result, or its exception; TimedOut when time ran out
        first."""
        start = time.monotonic()
        if self.timeout is None or self.main_thread:
            out = fn(**kwargs)
        else:
            out = self._in_worker(fn, kwargs)
        self.warn_if_slow(time.monotonic() - start, n)
        return out

    def warn_if_slow(self, seconds: float, n: int) -> None:
        if self.slow is not None and seconds > self.slow:
            timeout = (
                f"its timeout is {self.timeout:g} s"
                if self.timeout and not self.main_thread
                else "it has no timeout"
            )
            logger.warning(
                "%s took %.1f s for %d completions, more than reward_slow_warning=%g s (%s); "
                "a faster function (batch its work, cache) speeds up every step",
                self.label,
                seconds,
                n,
                self.slow,
                timeout,
            )

    def _in_worker(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        if self._busy is not None and self._busy.is_alive():
            raise TimedOut(
                "is still busy with a call that timed out (started "
                f"{time.monotonic() - self._busy_started:.0f} s ago): this call was not started"
            )
        self._busy = None
        result: dict[str, Any] = {}
        grad_enabled = torch.is_grad_enabled()  # thread-local in torch: the worker gets the caller's

        def work() -> None:
            try:
                with torch.set_grad_enabled(grad_enabled):
                    result["value"] = fn(**kwargs)
            except BaseException as exc:  # handed to the caller
                result["error"] = exc

        worker = threading.Thread(target=work, name=f"grpokit-reward {self.label}", daemon=True)
        started = time.monotonic()
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            self._busy, self._busy_started = worker, started
            raise TimedOut(
                f"did not return within {self.timeout:g} s: the call was left running in a background thread "
                "(Python cannot stop one), and the function is skipped until it returns"
            )
        if "error" not in result:
            return result["value"]
        if not _needs_main_thread(result["error"]):
            raise result.pop("error")
        self.main_thread = True
        logger.warning(
            "%s uses signals (signal.alarm, e.g. math-verify's own timeouts), which work only in the main "
            "thread: it runs there from now on, where the reward timeout cannot stop it",
            self.label,
        )
        return fn(**kwargs)
