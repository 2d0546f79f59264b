"""uvicorn around the app: on shutdown (SIGTERM, SIGINT) the engine first stops taking requests,
in-flight ones get ``grace_s`` seconds to finish and are then ended with an error event."""
from __future__ import annotations

import socket

import uvicorn


class DDTreeUvicornServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace_s: float):
        super().__init__(config)
        self.grace_s = grace_s

    async def shutdown(self, sockets=None):
        server = getattr(getattr(self.config.app, "state", None), "server", None)
        if server is not None:
            server.engine.begin_shutdown(self.grace_s)
        await super().shutdown(sockets=sockets)


def make_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                grace_s: float = 10.0) -> DDTreeUvicornServer:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=grace_s + 5.0, timeout_keep_alive=5,
                            access_log=log_level == "debug")
    return DDTreeUvicornServer(config, grace_s)


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket (port 0 = a free one; read it back with ``sock.getsockname()[1]``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock
