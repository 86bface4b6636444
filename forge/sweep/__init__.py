"""Sweeps over a config's template variables (``forge sweep``): the search space
(:mod:`forge.sweep.space`), the sweep's state in the project's output and its Optuna study
(:mod:`forge.sweep.study`), the workers that train the trials (:mod:`forge.sweep.runner`), and
the trainer callback that reports to a study that prunes (:mod:`forge.sweep.pruning`)."""
