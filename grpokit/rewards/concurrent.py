"""`async def` reward functions: all those of a batch run at once on one event loop, each under its time
limit.

    loop = LoopThread("grpokit-rewards")              # one per RewardManager; its thread starts on first use
    limit = RewardLimit(label, timeout, slow, loop=loop, is_async=is_async(fn))
    pending = limit.start(fn, kwargs)                 # async: awaited on the loop from now on, under
                                                      # asyncio.wait_for
    ...                                               # the caller goes on: the sync reward functions run
                                                      # meanwhile
    out = limit.call(fn, kwargs, n, pending)          # its result (or its exception), or TimedOut

As TRL's GRPOTrainer does with its async reward functions (`asyncio.iscoroutinefunction`, gathered with
`asyncio.gather` on an event loop of their own in a daemon thread), an async function is called like a sync
one, once per batch with keyword lists, and the manager collects the results of all of them together. A thread
of its own for the loop, rather than asyncio.run: the scoring may run in a thread that is not the main one, or
under an event loop that is running already (Jupyter), where asyncio.run refuses to start; and a loop that
lives as long as the manager lets a function keep a client (an httpx.AsyncClient, an aiohttp session) bound to
it from call to call. A sync callable that returns an awaitable (a lambda around an async function) is found
at its first call and treated as async from then on.

Unlike a thread, a coroutine can be stopped: at its timeout wait_for cancels it, and the function is free for
the next call. Two ways a coroutine defeats that: it blocks the loop (time.sleep or requests inside async def:
nothing else on the loop runs, timers included), or it swallows the cancellation. The caller waits for the
loop at most GRACE seconds past the timeout; then the call counts as timed out, the function as busy until the
coroutine ends (its later calls are not started, as for a sync function), and a blocked loop is left to finish
on its own: the next call gets a new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from grpokit.rewards.timeouts import CallLimit, TimedOut

logger = logging.getLogger("grpokit.rewards")

#: seconds the caller waits for the loop past a call's timeout before it stops waiting for wait_for itself
GRACE = 1.0
#: seconds a loop that is not blocked takes at most to run a callback: a loop slower than this is blocked
PING = 0.1


def is_async(fn: Callable[..., Any]) -> bool:
    """`async def` functions, partials of them and objects with an `async def __call__`."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class Pending:
    """One call under way on the loop: result() waits for it, until its deadline at most."""

    def __init__(
        self,
        future: concurrent.futures.Future,
        finished: threading.Event,
        timeout: float | None,
        owner: LoopThread | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        tasks: list | None = None,
    ):
        self.future, self.finished, self.timeout, self.owner, self.loop = (
            future,
            finished,
            timeout,
            owner,
            loop,
        )
        self.tasks = tasks if tasks is not None else []  # its asyncio tasks, filled in on the loop (_bounded)
        self.deadline = None if timeout is None else time.monotonic() + timeout + GRACE
        self.released = False  # cut off by another function that blocked the loop: not busy itself

    @classmethod
    def failed(cls, exc: BaseException) -> Pending:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_exception(exc)
        finished = threading.Event()
        finished.set()
        return cls(future, finished, None)

    def busy(self) -> bool:
        """Whether the call still runs (after it timed out without stopping): the function's next call is not
        started."""
        return not self.finished.is_set() and not self.released

    def result(self) -> tuple[Any, float]:
        """(the function's result, the seconds the call took on the loop); its exception; or TimedOut."""
        wait = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        try:
            return self.future.result(wait)
        except concurrent.futures.TimeoutError:
            if (
                self.future.done()
            ):  # it ended just now, or raised its own TimeoutError (the builtin, from Python 3.11 on)
                return self.future.result()
        self.future.cancel()
        assert self.owner is not None and self.loop is not None and self.timeout is not None
        blocker = self.owner.blocker(self.loop)
        if blocker is None:
            raise TimedOut(
                f"did not return within {self.timeout:g} s and did not stop when cancelled (it catches "
                "asyncio.CancelledError): it was left running, and the function is skipped until it returns"
            )
        if blocker is not UNKNOWN and blocker not in self.tasks:
            self.released = True
            raise TimedOut(
                f"did not return within {self.timeout:g} s: another async reward function blocked the event "
                "loop"
            )
        who = "it" if blocker in self.tasks else "it, or another async reward function,"
        raise TimedOut(
            f"did not return within {self.timeout:g} s, and {who} blocks the event loop (a blocking call "
            "such as time.sleep or requests inside `async def`: await asyncio.sleep, use an async client, or "
            "make it a plain `def`); a new loop serves the next calls, and the function is skipped until the "
            "blocked call returns"
        )


#: the blocker of a loop that is blocked outside any task
UNKNOWN = object()


class LoopThread:
    """An asyncio event loop running in a daemon thread, started on first use (no thread for managers without
    async functions); a daemon thread does not keep the process from exiting."""

    def __init__(self, name: str):
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._blocked: dict[
            asyncio.AbstractEventLoop, Any
        ] = {}  # loops given up -> the task that blocked them

    def start(self, make: Callable[[], Awaitable[Any] | Any], timeout: float | None) -> Pending:
        """Runs `await make()` on the loop under asyncio.wait_for(timeout) (None = no limit), from now on."""
        loop = self._running_loop()
        finished = threading.Event()
        tasks: list[asyncio.Future[Any] | None] = []
        coro = _bounded(
            make, timeout, torch.is_grad_enabled(), finished, tasks
        )  # grad mode is thread-local in torch
        return Pending(asyncio.run_coroutine_threadsafe(coro, loop), finished, timeout, self, loop, tasks)

    def blocker(self, loop: asyncio.AbstractEventLoop) -> Any:
        """None while `loop` runs callbacks (within PING seconds); else the task that blocks it (UNKNOWN when
        none does), and the loop is given up: it stops, and its thread ends, once the blocking call
        returns."""
        with self._lock:
            if loop in self._blocked:  # given up already, at an earlier call's deadline
                return self._blocked[loop]
        try:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(PING)
            return None
        except concurrent.futures.TimeoutError:
            pass
        with self._lock:
            # The task running on the loop's thread now; asyncio.current_task reads it from any thread.
            self._blocked[loop] = asyncio.current_task(loop) or UNKNOWN
            if self._loop is loop:
                self._loop = None
        logger.warning(
            "an async reward function blocks the event loop of the async reward functions; it is left to "
            "finish in its thread, and a new loop runs the next calls"
        )
        _stop(loop)
        return self._blocked[loop]

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop, ready = asyncio.new_event_loop(), threading.Event()
                threading.Thread(target=_serve, args=(loop, ready), name=self.name, daemon=True).start()
                ready.wait()
                self._loop = loop
                weakref.finalize(self, _stop, loop)  # the manager is gone: so is its loop's thread
            return self._loop


def _stop(loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:  # closed already
        pass


def _serve(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(ready.set)
    loop.run_forever()
    # Stopped (given up, or its manager is gone): cancel what is left, then close.
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.close()


async def _bounded(
    make: Callable[[], Any], timeout: float | None, grad: bool, finished: threading.Event, tasks: list
) -> tuple[Any, float]:
    torch.set_grad_enabled(grad)
    start = time.monotonic()
    tasks.append(asyncio.current_task())
    try:
        out = make()
        if not inspect.isawaitable(out):  # detected as async, but returned a value: take it
            return out, time.monotonic() - start
        task = asyncio.ensure_future(out)
        tasks.append(task)
        try:
            value = await asyncio.wait_for(task, timeout)
        except asyncio.TimeoutError:
            if (
                not task.cancelled()
            ):  # the function's own TimeoutError (an HTTP client's, say): its failure, not ours
                raise
            raise TimedOut(f"did not return within {timeout:g} s: the call was cancelled") from None
        return value, time.monotonic() - start
    finally:
        finished.set()


class RewardLimit(CallLimit):
    """CallLimit (a time limit, a slow-call warning) for sync and async reward functions alike: a sync one
    runs as CallLimit runs it; an async one on `loop`, cancelled at its timeout."""

    def __init__(
        self,
        label: str,
        timeout: float | None,
        slow: float | None = None,
        *,
        main_thread: bool = False,
        loop: LoopThread,
        is_async: bool = False,
    ):
        super().__init__(label, timeout, slow, main_thread=main_thread)
        self.loop, self.is_async = loop, is_async
        self._running: Pending | None = None  # the last async call: busy until it has finished

    def start(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Pending:
        """An async function's call, under way on the loop from now on (or a TimedOut at once while the
        function is still busy with a call that defeated its timeout)."""
        return self._await(lambda: fn(**kwargs))

    def call(
        self, fn: Callable[..., Any], kwargs: dict[str, Any], n: int, pending: Pending | None = None
    ) -> Any:
        """fn(**kwargs) on n completions: its result, or its exception; TimedOut when time ran out first.
        pending: the call started already (start), for an async function."""
        if not self.is_async:
            out = super().call(fn, kwargs, n)
            if not inspect.isawaitable(out):
                return out
            self.is_async = (
                True  # a sync callable that returned an awaitable: awaited on the loop, now and from now on
            )
            pending = self._await(lambda: out)
        value, seconds = (pending or self.start(fn, kwargs)).result()
        self.warn_if_slow(seconds, n)
        return value

    def _await(self, make: Callable[[], Any]) -> Pending:
        if self._running is not None and self._running.busy():
            return Pending.failed(
                TimedOut(
                    "is still busy with a call that timed out and did not stop: this call was not started"
                )
            )
        self._running = self.loop.start(make, self.timeout)
        return self._running
