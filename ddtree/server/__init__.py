"""OpenAI-compatible HTTP server: ``ddtree serve`` / ``python -m ddtree.server``.

``build_app(llm)`` gives the FastAPI app (imported lazily so that ``ddtree.cli`` stays light).
"""
from __future__ import annotations

__all__ = ["build_app", "make_server"]


def __getattr__(name):
    if name == "build_app":
        from ddtree.server.app import build_app
        return build_app
    if name == "make_server":
        from ddtree.server.serving import make_server
        return make_server
    raise AttributeError(name)
