"""Starting a training job: the processes each rank runs, where they run and what is checked
before any of them starts.

``torchrun`` launches the job here (one process) or under torchrun, forwarding signals, and
is what ``python -m forge.launch`` runs: torchrun's agent as forge starts it. ``cluster``
reads the nodes of a job (``--nnodes``, SLURM); ``endpoint`` is where they meet (node 0's
agent serves the job's store, the others find it, and they check each other: who waits for
whom, one job per endpoint, one config); ``multinode`` lets the nodes of one job agree
on its run; ``worker`` is the training process of one rank, which dies with its launcher;
``preflight`` checks the model/data contract before a run directory is created,
``length_note`` says which argument decides a run's length and which ones a partial makes
moot, ``start`` creates or claims the run around the job (for the commands and the Python
API), and ``job_plan`` is what ``forge train --dry-run`` prints. Nothing here imports forge.cli.
"""
