"""Counting host reads of tensor values: each one waits for the device on a GPU, so hot paths must make none.

The Tensor methods that read a value on the host are patched for the test; a read counts when code in a watched
file makes it (directly, or anywhere up the stack with `anywhere_on_stack`).
"""

from __future__ import annotations

import sys

import pytest
import torch

HOST_READS = ("item", "tolist", "numpy", "nonzero", "__bool__", "__float__", "__int__", "__index__")


def count_host_reads(monkeypatch: pytest.MonkeyPatch, *watched: str, anywhere_on_stack: bool = False) -> list[str]:
    """From now on, the host reads made by code whose file path contains one of `watched` ("file:line" each)."""
    calls: list[str] = []

    def watching(frame) -> str | None:
        while frame is not None:
            if any(part in frame.f_code.co_filename for part in watched):
                return f"{frame.f_code.co_filename}:{frame.f_lineno}"
            frame = frame.f_back if anywhere_on_stack else None
        return None

    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            where = watching(sys._getframe(1))
            if where is not None:
                calls.append(f"{_name} from {where}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls
