"""Turn SIGINT / SIGTERM / a scheduler's warning signal into a request to stop at the next
step boundary, with a checkpoint.

The scheduler's signal is the one a cluster sends ahead of its time limit (SLURM's
``--signal=USR1@90``); SIGUSR1 unless ``FORGE_STOP_SIGNAL`` names another (``forge train
--stop-signal``, which every process of the job inherits).
"""

from __future__ import annotations

import logging
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
        # Said at once: the step in progress (and the save) may take a while.
        logger.info("received %s: saving a checkpoint at %s", name, self.stop_at)

    def __enter__(self) -> StopSignals:
        self.received = 0
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
