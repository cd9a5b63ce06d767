"""The raw ``torch.distributed`` Gloo group a benchmark runs beside roundel, in the same processes."""

from __future__ import annotations

import socket


def start_gloo_group(hvd) -> None:
    """Initialize torch.distributed's default Gloo group over the ranks of the running roundel job (rank 0
    picks a free loopback port and broadcasts it)."""
    import torch.distributed as dist

    address = None
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = ("127.0.0.1", s.getsockname()[1])
    host, port = hvd.broadcast_object(address, root_rank=0, name="bench.store")
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=hvd.rank(), world_size=hvd.size())
