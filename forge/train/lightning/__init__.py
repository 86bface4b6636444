"""A LightningModule trained by forge's trainers: ``LightningAdapter`` runs its
``training_step`` / ``validation_step``, takes its ``configure_optimizers`` and logs what its
``self.log`` records, with Lightning's meanings; what it does not run is refused before the first
step. See docs/models-and-data.md ("A LightningModule").
"""

from forge.train.lightning.adapter import LightningAdapter, LightningCallback
from forge.train.lightning.hooks import LightningAdapterError

__all__ = ["LightningAdapter", "LightningAdapterError", "LightningCallback"]
