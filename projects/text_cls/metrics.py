"""compute_metrics for the classifier, exactly as for Hugging Face's Trainer."""

from __future__ import annotations

import numpy as np


def compute_metrics(eval_pred) -> dict[str, float]:
    """Accuracy of the arg-max class: ``EvalPrediction`` holds numpy logits and labels."""
    logits, labels = eval_pred.predictions, eval_pred.label_ids
    predictions = np.argmax(logits, axis=-1)
    return {"accuracy": float((predictions == labels).mean())}
