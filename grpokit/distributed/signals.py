"""The stop signals of a run: SIGTERM / SIGINT finish the step, save and stop (a second one stops at once).

    with StopSignals().reporting(say) as stop:
        ...                           # stop.received after SIGTERM / SIGINT: finish the step, save, stop

Under torchrun every rank holds one; World.signal_received makes the decision to stop the ranks' together.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from contextlib import contextmanager


class StopSignals:
    """SIGTERM / SIGINT while a run is inside: the first is remembered (`received`, the signal's name) so that
    the loop finishes its step, saves and stops; a second one stops at once (KeyboardInterrupt), except
    inside `protecting()`: a save in progress finishes first, says so, and then the run stops.
    The previous handlers are restored on exit. `reporting(say)`: when a second signal stops the run,
    say(name) is called on the way out (the trainer prints the newest checkpoint and how to resume).

        with StopSignals().reporting(say) as stop:
            while ...:
                ...
                with stop.protecting("the save of step 3"):
                    save()
                if stop.received: return
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict = {}
        self._protecting: str | None = None  # what must not be cut short now
        self._again: str | None = None  # a second signal that arrived while protecting
        self._stopped: str | None = None  # the second signal, which stopped the run at once
        self._say: Callable[[str], None] | None = None

    def reporting(self, say: Callable[[str], None] | None) -> StopSignals:
        """Call say(the second signal's name) on exit when a second signal stopped the run; returns self."""
        self._say = say
        return self

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
        elif self._protecting is not None:  # finish what is in progress, then stop (see protecting)
            self._again = name
        else:  # a second Ctrl-C: stop now
            self._stopped = name
            raise KeyboardInterrupt

    @contextmanager
    def protecting(self, what: str):
        """A second signal inside this block waits for it to end; then the run stops (KeyboardInterrupt)
        with a line that says what was finished."""
        self._protecting = what
        try:
            yield
        finally:
            self._protecting = None
        if self._again is not None:
            print(f"{self._again} again during {what}: it finished; stopping now", flush=True)
            self._stopped = self._again
            raise KeyboardInterrupt

    def __enter__(self) -> StopSignals:
        self.received = self._again = self._stopped = None
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, exc_type, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._stopped is not None and exc_type is KeyboardInterrupt and self._say is not None:
            self._say(self._stopped)  # the same line a first signal's save prints: where to resume from
