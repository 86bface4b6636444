"""The read side: a checkpoint or run forge wrote, opened as one object
(``forge.read.reader.CheckpointReader``, also ``forge.CheckpointReader``).

Nothing is imported here, so ``import forge.read`` loads no torch.
"""
