"""The read side: a checkpoint or run forge wrote, opened as one object
(``forge.read.reader.CheckpointReader``, also ``forge.CheckpointReader``), and what the reading
commands do through it: export.py (``forge export``), predict.py (``forge evaluate``,
``forge predict``), generate.py (``forge generate``), run_model.py (a run's model, built as its
training built it). Nothing here imports forge.cli: refusals are forge.read.errors'.

Nothing is imported here, so ``import forge.read`` loads no torch.
"""
