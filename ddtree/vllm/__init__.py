"""DDTree as a vLLM plugin: `--speculative-config '{"method": "ddtree", "model": <drafter>, "budget": 64}'`.

Registered through the `vllm.general_plugins` entry point (`register`), which vLLM calls in every
process it starts. Only requests to engines configured with method "ddtree" are affected.
"""
from __future__ import annotations

import logging

from ddtree.vllm.models import default_paths
from ddtree.vllm.version import SUPPORTED_VLLM_VERSIONS, check_supported, unsupported_reason

__all__ = ["register", "default_paths", "SUPPORTED_VLLM_VERSIONS", "check_supported"]

log = logging.getLogger("ddtree.vllm")


def register() -> None:
    """vLLM general-plugin entry point: install the config, request and attention hooks."""
    reason = unsupported_reason()
    if reason is not None:
        # Not raised here: that would break every vLLM use, DDTree or not. Asking for
        # method "ddtree" raises this reason (config.py).
        log.warning("ddtree vLLM plugin inactive: %s", reason)
    from ddtree.vllm.attention import install_attention_hook
    from ddtree.vllm.config import install_config_hook
    from ddtree.vllm.requests import install_request_hook

    install_config_hook()
    if reason is None:
        install_request_hook()
        install_attention_hook()
