"""Turn SIGINT / SIGTERM / a scheduler's warning signal into a request to stop at the next
step boundary, with a checkpoint.

The scheduler's signal is the one a cluster sends ahead of its time limit (SLURM's
``--signal=USR1@90``); SIGUSR1 unless ``FORGE_STOP_SIGNAL`` names another (``forge train
--stop-signal``, which every process of the job inherits).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

from forge.lifetime import stop_signals

logger = logging.getLogger(__name__)


class TrainingInterrupted(Exception):
    """Training stopped on a signal after saving a checkpoint.

    ``signum`` is the signal (the CLI exits with 128 + signum: 130 for SIGINT, 143 for
    SIGTERM); ``checkpoint`` is the checkpoint that holds the last completed step.
    """

    def __init__(self, signum: int, step: int | None = None, checkpoint: str | None = None):
        self.signum = int(signum)
        self.step = step
        self.checkpoint = checkpoint
        name = signal.Signals(self.signum).name
        where = f" at step {step}" if step is not None else ""
        saved = f"; resume from {checkpoint}" if checkpoint else ""
        super().__init__(f"training interrupted by {name}{where}{saved}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.signum, self.step, self.checkpoint))


class StopSignals:
    """Context manager: while active, the stop signals (:func:`stop_signals`) only set
    ``received``.

    Handlers are installed from the main thread only (elsewhere this does nothing) and the
    previous ones are restored on exit. A Ctrl-C (SIGINT) after the first signal raises
    KeyboardInterrupt at once: checkpoints are written atomically, so cutting a save short loses
    nothing committed. A repeated SIGTERM or scheduler signal is the same request again (a
    scheduler signals every process of a job, and each launcher passes the signal on as well):
    it changes nothing, and a scheduler that will not wait sends SIGKILL.
    """

    def __init__(self, stop_at: str = "the next step") -> None:
        self.received: int = 0
        self.stop_at = stop_at  # when the loop acts on a signal, for the acknowledgement
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received and signum != signal.SIGINT:
            logger.debug("received %s again: the stop already asked for", name)
            return
        if self.received:
            logger.info("received %s again: stopping now, without a checkpoint", name)
            raise KeyboardInterrupt
        self.received = signum
        _STARTING.stopping = True  # a signal after the loop is the same request again
        # Said at once: the step in progress (and the save) may take a while.
        logger.info("received %s: saving a checkpoint at %s", name, self.stop_at)

    def __enter__(self) -> StopSignals:
        # a stop asked for while the job started, that code in between swallowed
        self.received = _STARTING.disarm()
        if threading.current_thread() is threading.main_thread():
            for signum in stop_signals():
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()


class _StopWhileStarting:
    """Before the loop (building the model and the data, restoring a checkpoint) a stop signal
    stops the process at once: there is no step to save. Its handler raises
    ``TrainingInterrupted`` without a step; once the loop's :class:`StopSignals` has taken over
    (or a launcher waits on its children) a further signal is the same request again and
    changes nothing; without a stop asked for, a signal after the loop acts as it would without
    forge (Ctrl-C raises KeyboardInterrupt, the others end the process)."""

    def __init__(self) -> None:
        self.armed = False
        self.holding = False  # a stop is only noted (while Python loads forge), for arm()
        self.received = 0
        self.stopping = False  # a stop was asked for: another signal is the same request

    def arm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        pending = self.received if self.holding else 0
        self.armed, self.holding, self.received, self.stopping = True, False, pending, False
        for signum in stop_signals():
            signal.signal(signum, self._handle)
        if pending:  # it came while forge loaded
            self.stopping = True
            raise TrainingInterrupted(pending)

    def hold(self) -> None:
        """Note a stop signal until :meth:`arm` (which raises it then)."""
        if threading.current_thread() is threading.main_thread():
            self.holding, self.received = True, 0
            for signum in stop_signals():
                signal.signal(signum, self._handle)

    def disarm(self) -> int:
        """The signal received while armed (0 if none), forgotten: from now on a stop is the
        loop's (or a launcher's) to act on."""
        received, self.armed, self.received = self.received, False, 0
        self.stopping = bool(received)
        return received

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.holding and not self.received:
            self.received = signum
            return
        if self.armed and not self.received:
            self.received, self.stopping = signum, True
            logger.info("received %s before training started: stopping", name)
            raise TrainingInterrupted(signum)
        if signum == signal.SIGINT:  # Ctrl-C again, or after training: stop now
            raise KeyboardInterrupt
        if self.stopping:
            logger.debug("received %s again: the stop already asked for", name)
            return
        signal.signal(signum, signal.SIG_DFL)  # no stop asked for, no loop to save: as before
        os.kill(os.getpid(), signum)


_STARTING = _StopWhileStarting()


def stop_while_starting() -> None:
    """From now until the training loop begins, a stop signal (SIGINT, SIGTERM, the scheduler's
    warning signal) stops this process with ``TrainingInterrupted`` (no step, no checkpoint)
    instead of killing it; the CLI exits 128 + N. Main thread only (elsewhere nothing)."""
    _STARTING.arm()


def note_stops_while_loading() -> None:
    """For a process that will train (a rank): from now on a stop signal is noted, and
    :func:`stop_while_starting` acts on it (Python is still loading forge and torch here)."""
    _STARTING.hold()


def launched_children() -> None:
    """This process now waits on processes it launched and passes stops on to them: a stop
    signal no longer raises here (the launcher's own handler forwards it)."""
    _STARTING.disarm()
