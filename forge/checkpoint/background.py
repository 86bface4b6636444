"""Committing a checkpoint outside the training thread (``async_save``).

The loop pauses only for the snapshot (every component's state copied to host memory); the
commit (files, hashes, fsync, manifest, rename) and what follows it (last and best checkpoint,
rotation, ``on_save``) run on one background thread. At most one commit is in flight: the next
save waits for it, and so does the end of training, a stop by signal and an error's exit.

A commit that fails keeps its error until the training thread asks (``raise_if_failed`` at
every step boundary, ``wait`` before the next save and at the end): the run then fails with the
writer's message, exactly as a synchronous save would have, one step or so later.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class BackgroundCommit:
    """One background commit at a time; its failure is raised in the thread that waits."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, commit: Callable[[], Any], name: str = "checkpoint") -> None:
        """Wait for the previous commit (raising its failure), then start ``commit``."""
        self.wait()

        def run() -> None:
            try:
                commit()
            except BaseException as exc:  # kept for the training thread, which raises it
                self._error = exc

        # Not a daemon: an interpreter that exits (a second Ctrl-C) still finishes the commit,
        # so a checkpoint is either renamed into place or its temporary directory is left.
        self._thread = threading.Thread(target=run, name=f"forge-commit-{name}", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Block until no commit is in flight; raise the failure of the last one, once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def raise_if_failed(self) -> None:
        """Raise a finished commit's failure now (a cheap check, for every step boundary)."""
        if self._error is not None and not self.in_flight:
            self.wait()

    def failure(self) -> BaseException | None:
        """Wait for the commit in flight; its failure (or a finished one's), without raising
        it: once, as ``wait`` would have raised it."""
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
