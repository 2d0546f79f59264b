"""Hot-path kernels: Triton on CUDA, torch references everywhere (and for the tests)."""
from __future__ import annotations

import importlib.util
import os

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def triton_enabled(x: torch.Tensor) -> bool:
    """Use the Triton kernels for tensors on CUDA (DDTREE_TRITON=0 forces the torch path). They are
    inference kernels (no backward, fused weights cached), so drafter training takes the torch path."""
    return (x.is_cuda and HAVE_TRITON and os.environ.get("DDTREE_TRITON", "1") != "0"
            and not (x.requires_grad and torch.is_grad_enabled()))
