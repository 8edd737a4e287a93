"""Whether NVIDIA apex's fused CUDA kernels can run here (apex is optional; the PyPI package `apex` is unrelated)."""

from __future__ import annotations

import importlib

NVIDIA_APEX_HINT = ("needs NVIDIA apex with its CUDA extensions and a GPU: use an NGC PyTorch container or build "
                    "apex from github.com/NVIDIA/apex with --cpp_ext --cuda_ext (the PyPI package 'apex' is unrelated)")


def missing_nvidia_apex(*modules: str) -> str | None:
    """Why NVIDIA apex's fused CUDA kernels (in `modules`) cannot run here, or None when they can."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            return f"cannot import {module} ({err})"
    return None
