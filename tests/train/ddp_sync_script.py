"""Two DDP ranks count their host reads per step; rank 0 gets SIGTERM at a quiet step.

    python -m torch.distributed.run --nproc_per_node=2 ddp_sync_script.py OUTPUT_DIR

Run by test_host_sync.py. Each rank writes OUTPUT_DIR/result-RANK.json: the step it stopped at
and the host reads it made during steps that neither log nor save (files, not stdout: two ranks
printing at once can share a line of the pipe).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from forge.data import CausalLMCollator
from forge.train import Trainer, TrainingInterrupted
from tests.train.common import SignalAtStep, TokenDataset, make_args
from tests.train.host_reads import HostReads, SmallLM, quiet_steps

MAX_STEPS, LOGGING_STEPS, SIGNAL_AT = 12, 4, 5


def main(output_dir: str) -> int:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    reads = HostReads()
    callbacks = [reads] + ([SignalAtStep(SIGNAL_AT)] if rank == 0 else [])
    args = make_args(
        output_dir,
        max_steps=MAX_STEPS,
        logging_steps=LOGGING_STEPS,
        gradient_accumulation_steps=2,
        report_to=[],
    )
    trainer = Trainer(
        SmallLM,
        args,
        TokenDataset(128),
        data_collator=reads.collator(CausalLMCollator(pad_token_id=0)),
        callbacks=callbacks,
    )
    stopped = None
    with reads:
        try:
            trainer.train()
        except TrainingInterrupted as stop:
            stopped = stop.step
    by_step = reads.by_step()
    quiet = [  # the step the job stops at saves: it is no quiet step
        s
        for s in quiet_steps(MAX_STEPS, LOGGING_STEPS, None)
        if s <= trainer.state.global_step and s != stopped
    ]
    result = {
        "rank": rank,
        "stopped_at": stopped,
        "quiet_reads": {step: by_step[step] for step in quiet if step in by_step},
        "logging_step_reads": len(by_step.get(LOGGING_STEPS, [])),
    }
    Path(output_dir, f"result-{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
