"""Small reference models forge ships: plain ``nn.Module`` s that take dict batches and return
a dict with ``loss`` and ``logits`` (and any 0-d metrics forge logs beside the loss)."""

from forge.models.adaptive import AdaptiveComputationModel, RecurrentBlock

__all__ = ["AdaptiveComputationModel", "RecurrentBlock"]
