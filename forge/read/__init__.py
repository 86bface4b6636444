"""The read side: a checkpoint or run forge wrote, opened as one object
(``forge.read.reader.CheckpointReader``, also ``forge.CheckpointReader``; its run is a
``forge.read.run.RunReader``, which ``forge runs`` and ``forge checkpoints`` read), and what the
reading commands do through it, each given the reader: export.py (``forge export``), predict.py
(``forge evaluate``, ``forge predict``), generate.py (``forge generate``), run_model.py (a run's
model, built as its training built it). Nothing here imports forge.cli: refusals are
forge.read.errors'.

Nothing is imported here, so ``import forge.read`` loads no torch.
"""
