"""A sidecar worker process: HTTP on the sidecar's shared socket, decisions by the kernel's process.

Started by the sidecar (`workers = N` in its config, `nexuskv_sidecar._workers`), never by hand:
`python -m nexuskv_sidecar.worker LISTEN_FD CHANNEL_FD`, where both descriptors are inherited. The first message
on the channel is the worker's settings (token digests, limits, the kernel's node and deadline bound). The worker
serves until the kernel's process closes the channel (or dies), or it gets SIGTERM / SIGINT.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading

import uvicorn
import uvloop

from nexuskv import configure_logging, get_logger
from nexuskv_sidecar._channel import Channel
from nexuskv_sidecar._remote import RemoteBackend
from nexuskv_sidecar.app import Limits, create_app

__all__ = ["main"]

log = get_logger("nexuskv_sidecar")


def main(argv: list[str]) -> int:
    """Serve as one worker (argv: LISTEN_FD CHANNEL_FD); exit status 0 once stopped."""
    configure_logging(level=os.environ.get("NEXUSKV_LOG_LEVEL", "warning"))
    listen_fd, channel_fd = int(argv[0]), int(argv[1])
    channel = Channel(socket.socket(fileno=channel_fd))
    settings = channel.recv()  # the one blocking read: then the loop owns the channel
    if channel.pending():  # the kernel's process sends nothing before this worker says it is ready
        raise SystemExit("sidecar worker: the kernel's process sent more than the settings before 'ready'")
    sock = socket.socket(fileno=listen_fd)
    backend = RemoteBackend(settings["node"], settings["max_deadline_ms"])
    app = create_app(backend, settings["tokens"], max_body_bytes=settings["max_body_bytes"],
                     limits=Limits(**settings["limits"]))  # fmt: skip
    server = uvicorn.Server(uvicorn.Config(
        app, http="httptools", loop="uvloop", log_level="warning", access_log=False, lifespan="off",
        proxy_headers=False, server_header=False, date_header=False, timeout_keep_alive=30,
        timeout_graceful_shutdown=5))  # fmt: skip

    stop = server.handle_exit

    def handle_exit(sig: int, frame: object) -> None:  # SIGTERM / SIGINT: decision streams end now, not after
        app.close_streams()  # the server's grace period (they would hold it to the end)
        stop(sig, frame)  # type: ignore[arg-type]

    server.handle_exit = handle_exit  # type: ignore[method-assign]

    def watch() -> None:  # the kernel's process is gone: nothing could be answered any more
        backend.gone.wait()
        app.close_streams()
        server.should_exit = True

    async def serve() -> None:
        await backend.connect(channel.sock)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():  # tell the kernel's process once connections are accepted
            await asyncio.sleep(0.005)
        if server.started:
            backend._send((0, "ready", os.getpid(), None))
        await task

    threading.Thread(target=watch, name="nexuskv-sidecar-watch", daemon=True).start()
    try:
        uvloop.run(serve())
    finally:
        app.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
