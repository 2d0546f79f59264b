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


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached). Off CUDA (the Triton interpreter) the
    H200's 132, so interpreted tests pick the same grids as the card the plans were tuned on."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]
