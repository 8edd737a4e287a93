"""The trainer: entry point, loop, checkpointing, logging and launching."""
