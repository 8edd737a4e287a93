"""The weights a run evaluates and exports when its ranks' replicas differ (SLAMB, SlowMo and 0/1 Adam between
their synchronisations): the replicas' average, in a copy, so that training goes on from each rank's own.

Rank 0's replica alone would be a different model from the one a synchronisation would make, and up to a sync
interval behind it in agreement: evaluating it between syncs would compare the optimizers unfairly. The average is
what the optimizer's next dense synchronisation would start from (SLAMB's and SlowMo's are parameter averages).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from optim.comm import Comm, average_tensors_


@torch.no_grad()
def averaged_copy(model: nn.Module, comm: Comm) -> nn.Module:
    """A copy of `model` holding the mean of every rank's parameters (every rank calls it, and gets the same).

    The all-reduce goes through the comm with `counted=False`: its bytes are not charged to a training step but
    tallied on their own line (the run's `replica_average_bytes`), since the run sends them only because it is
    evaluated or exported between synchronisations. The mean is taken in fp32 whatever the parameters' dtype.
    Buffers are copied as they are (the models here keep no trained buffers).
    """
    average = copy.deepcopy(model)
    average_tensors_(list(average.parameters()), comm, counted=False)
    return average

