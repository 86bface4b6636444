"""forge: inheritable templates to resumable PyTorch training jobs."""

__version__ = "0.1.0"
