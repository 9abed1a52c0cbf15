"""The training loop and what it records: checkpoints, metrics, plots, early stopping."""
