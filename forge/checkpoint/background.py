"""Committing a checkpoint outside the training thread (``async_save``).

The loop pauses only for the snapshot (every component's state copied to host memory); the
commit (files, hashes, fsync, manifest, rename) runs on one background thread. What follows a
commit (the last and best checkpoint, rotation, ``on_save``) runs back in the training thread,
at the first step boundary after the commit ended (``poll``), or when it waits for the commit:
callbacks never run on another thread. At most one commit is in flight: the next save waits for
it, and so do the end of training, a stop by signal and an error's exit.

A commit that fails keeps its error until the training thread asks (``poll`` at every step
boundary, ``wait`` before the next save and at the end): the run then fails with the writer's
message, exactly as a synchronous save would have, one step or so later.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class BackgroundCommit:
    """One background commit at a time; its failure is raised, and its follow-up run, in the
    thread that waits for it or polls it."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._then: Callable[[], Any] | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending(self) -> bool:
        """A commit was submitted and not yet waited for (in flight, or ended unseen)."""
        return self._thread is not None

    @property
    def ended(self) -> bool:
        """The submitted commit has ended (succeeded or failed) and was not yet waited for."""
        return self._thread is not None and not self._thread.is_alive()

    def submit(
        self,
        commit: Callable[[], Any],
        name: str = "checkpoint",
        then: Callable[[], Any] | None = None,
    ) -> None:
        """Wait for the previous commit (raising its failure), then start ``commit``; ``then``
        runs once it succeeded, in the thread that next polls or waits."""
        self.wait()

        def run() -> None:
            try:
                commit()
            except BaseException as exc:  # kept for the training thread, which raises it
                self._error = exc

        self._then = then
        # Not a daemon: an interpreter that exits (a second Ctrl-C) still finishes the commit,
        # so a checkpoint is either renamed into place or its temporary directory is left.
        self._thread = threading.Thread(target=run, name=f"forge-commit-{name}", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Block until no commit is in flight; raise the failure of the last one, once, or run
        its follow-up."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        then, self._then = self._then, None
        if error is not None:
            raise error
        if then is not None:
            then()

    def poll(self) -> None:
        """At a step boundary (cheap): a commit that has ended is finished here (its failure
        raised, or its follow-up run); one still in flight is left alone."""
        if self.ended:
            self.wait()

    def raise_if_failed(self) -> None:
        """Raise an ended commit's failure now; a success's follow-up waits for ``poll`` or
        ``wait`` (where every rank of a job runs it at the same step)."""
        if self.ended and self._error is not None:
            self.wait()

    def failure(self) -> BaseException | None:
        """Wait for the commit in flight; its failure (or a finished one's), without raising
        it: once, as ``wait`` would have raised it. A commit that succeeded gets its follow-up
        (the checkpoint is in place: the run's record must list it)."""
        try:
            self.wait()
        except BaseException as exc:
            return exc
        return None

    def wait_quietly(self) -> None:
        """On the way out of a failed run: let the commit in flight finish, log its failure
        (the run's own error is the one reported)."""
        try:
            self.wait()
        except Exception as exc:
            logger.error("the checkpoint being written in the background failed too: %s", exc)
