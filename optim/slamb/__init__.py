"""SLAMB: the optimizer (registered as `slamb` and `slamb_v2_official`) and, in `reference`, its step one tensor at a
time for tests and readers."""

from optim.slamb.optimizer import SLAMB

__all__ = ["SLAMB"]
