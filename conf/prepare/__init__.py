"""Hydra config of `python -m data.prepare` (the corpus pipeline); separate from the training config."""
