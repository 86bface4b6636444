"""Evaluate the test classifier on 2 ranks; run by torchrun from test_ddp_evaluation.py.

    python -m torch.distributed.run --nproc_per_node=2 ddp_eval_script.py OUTPUT_DIR

Rank 0 writes ``OUTPUT_DIR/eval.json``: the metrics and the predictions compute_metrics got. The
classifier also returns its batch's mean label (``with_label_mean``), a scalar output the
evaluation averages over every rank's rows as ``eval_label_mean``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

from tests.train.test_evaluation import classifier, forge_classifier_trainer

EVAL_SIZE = 21  # odd: the ranks' shards differ by one row


def with_label_mean(model: torch.nn.Module) -> torch.nn.Module:
    """``model``, its outputs holding ``label_mean`` too: the mean label of the batch."""

    def add(module, args, kwargs, output):
        output["label_mean"] = kwargs["labels"].float().mean()
        return output

    model.register_forward_hook(add, with_kwargs=True)
    return model


def main(output_dir: str) -> int:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    seen = {}

    def record(eval_pred):
        seen["predictions"] = eval_pred.predictions.tolist()
        seen["labels"] = eval_pred.label_ids.tolist()
        return {"rows": len(eval_pred.label_ids)}

    trainer = forge_classifier_trainer(
        Path(output_dir),
        with_label_mean(classifier()),
        eval_size=EVAL_SIZE,
        per_device_eval_batch_size=4,
    )
    trainer.compute_metrics = record
    metrics = trainer.evaluate()
    if trainer.topology.rank == 0:
        Path(output_dir, "eval.json").write_text(json.dumps({"metrics": metrics, **seen}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
