"""``python -m forge.launch TORCHRUN_ARGS``: torchrun without its own traceback on failure.

torchrun (``torch.distributed.run``) reports a failed worker by raising ``ChildFailedError``,
which prints a Python traceback and a failure table after the worker has already printed its
own one-line error. forge's workers report their errors themselves (and record them in
``run.json``), so this wrapper runs the same launcher and only passes on the exit code.
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as failure:
        codes = [f.exitcode for f in failure.failures.values() if f.exitcode and f.exitcode > 0]
        return codes[0] if codes else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
