"""API server 1..N-1 of `l3worker serve --api-server-count N`: uvicorn on the listening socket it
inherits from API server 0, with its own connections to the engine cores (and, with several, its
own router: routing state is kept per API server, each seeing only its own requests).

`python -m l3worker.serving.api_server` (its ApiServerConfig as JSON on stdin), started by
server/launcher.py. It stops on SIGTERM (aborting its requests, as API server 0 does), and by
itself when API server 0 goes away.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys

from chip_child.models.loader import load_tokenizer
from l3worker.serving.core_client import CoreClient
from l3worker.serving.launcher import ApiServerConfig
from l3worker.distributed.router import Router, RouterConfig
from l3worker.serving.runner import ModelInfo, ServeOptions, model_for, run_server, serve
from l3worker.serving.signal_stop import SignalStop


async def _serve(config: ApiServerConfig, stop: SignalStop) -> None:
    options = ServeOptions(**config.options)
    options.disable_log_stats = True  # API server 0 logs every engine's figures
    info = ModelInfo(**config.model)
    model = model_for(info, load_tokenizer(info.model_dir), options)
    sock = socket.socket(fileno=config.fd)
    router = Router(RouterConfig(**config.router)) if config.router else None  # this server's own state
    client = CoreClient(config.index, config.controls, config.outputs, config.core_pids, router)
    loop = asyncio.get_running_loop()
    parent = os.pidfd_open(config.parent_pid)

    def on_server(server) -> None:
        stop.on_server(server)
        loop.add_reader(parent, lambda: setattr(server, "should_exit", True))  # API server 0 is gone

    try:
        await serve(client, model, options, sock, on_server=on_server)
    finally:
        loop.remove_reader(parent)
        os.close(parent)


def main() -> int:
    config = ApiServerConfig.from_json(sys.stdin.read())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    stop = SignalStop()
    if os.getppid() != config.parent_pid:
        return 0
    run_server(_serve(config, stop))
    return 0


if __name__ == "__main__":
    sys.exit(main())
