"""compute_metrics for the sorting task, as for Hugging Face's Trainer."""

from __future__ import annotations

import numpy as np


def compute_metrics(eval_pred) -> dict[str, float]:
    """``accuracy``: the share of sequences sorted exactly; ``token_accuracy``: of digits in
    the right place. Predictions are the arg-max of the logits."""
    logits, labels = eval_pred.predictions, eval_pred.label_ids
    if isinstance(logits, tuple):
        logits = logits[0]
    predictions = np.argmax(logits, axis=-1)
    scored = labels != -100
    correct = (predictions == labels) | ~scored
    return {
        "accuracy": float(correct.all(axis=-1).mean()),
        "token_accuracy": float((correct & scored).sum() / max(scored.sum(), 1)),
    }
