"""Save checkpoints in a loop until killed (driven by test_checkpoint_integration.py).

usage: python ckpt_kill_worker.py CHECKPOINTS_DIR FIRST_STEP [die-before-rename|die-between-renames]
Prints each step once its checkpoint is committed. With a mode, the process SIGKILLs itself
at that point of its first commit: just before the finished temporary directory is renamed
into place, or (replacing an existing step) after the old directory was moved aside.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

from forge.checkpoint import CheckpointWriter, rotate_checkpoints


def die_at(mode: str) -> None:
    real_rename = os.rename

    def rename(src: str, dst: str) -> None:
        src_path, dst_path = Path(src), Path(dst)
        if src_path.name.startswith(".tmp-checkpoint-"):
            moved_aside = (dst_path.parent / f".tmp-old-{dst_path.name}").exists()
            if mode == "die-before-rename" or (mode == "die-between-renames" and moved_aside):
                os.kill(os.getpid(), signal.SIGKILL)
        real_rename(src, dst)

    os.rename = rename


def main() -> None:
    checkpoints_dir, step = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:
        die_at(sys.argv[3])
    model = nn.Linear(512, 512)  # about 1 MB of weights
    while True:
        torch.manual_seed(step)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
        with CheckpointWriter(checkpoints_dir, step) as writer:
            writer.save_model(model)
            writer.save_torch("training.pt", {"step": step, "noise": torch.randn(250_000)})
            writer.save_torch("data-rank-00000.pt", {"step": step})
            writer.set_meta(epoch=0, metrics={"loss": 1.0 / (step + 1)})
        rotate_checkpoints(checkpoints_dir, 3)
        print(step, flush=True)
        step += 1


if __name__ == "__main__":
    main()
