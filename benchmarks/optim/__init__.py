"""Optimizer step time, memory, bandwidth and agreement with reference implementations."""
