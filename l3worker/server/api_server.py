"""API server 1..N-1 of `l3worker serve --api-server-count N`: uvicorn on the listening socket it
inherits from API server 0, with its own connection to the engine core.

`python -m l3worker.server.api_server CONFIG_JSON`, started by server/launcher.py. It stops on
SIGTERM (aborting its requests, as API server 0 does), and by itself when API server 0 goes away.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys

from chip_child.loader import load_tokenizer
from l3worker.server.core_client import CoreClient
from l3worker.server.launcher import ApiServerConfig
from l3worker.server.runner import ModelInfo, ServeOptions, model_for, serve


async def _serve(config: ApiServerConfig, stop: dict) -> None:
    options = ServeOptions(**config.options)
    info = ModelInfo(**config.model)
    model = model_for(info, load_tokenizer(info.model_dir), options)
    sock = socket.socket(fileno=config.fd)
    client = CoreClient(config.index, config.control, config.outputs, config.core_pid)
    loop = asyncio.get_running_loop()
    parent = os.pidfd_open(config.parent_pid)

    def on_server(server) -> None:
        stop["server"] = server
        server.should_exit = stop["requested"]
        loop.add_reader(parent, lambda: setattr(server, "should_exit", True))  # API server 0 is gone

    try:
        await serve(client, model, options, sock, on_server=on_server)
    finally:
        loop.remove_reader(parent)
        os.close(parent)


def main(argv: list[str]) -> int:
    config = ApiServerConfig.from_json(argv[1])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    # Before uvicorn takes the signals over (and after it hands them back) a signal asks the same
    # orderly stop; it never ends the clean-up half way.
    stop = {"requested": False, "server": None}

    def on_signal(signum, frame) -> None:
        stop["requested"] = True
        if stop["server"] is not None:
            stop["server"].should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    if os.getppid() != config.parent_pid:
        return 0
    asyncio.run(_serve(config, stop))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
