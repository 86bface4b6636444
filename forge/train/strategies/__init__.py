"""Parallelism strategies: how the processes of a job share the work (forge/train/strategies/
base.py has the protocol). The training loop names none of them."""
