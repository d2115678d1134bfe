"""Free loopback ports for the servers the tests start."""

from __future__ import annotations

import contextlib
import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports on ``host``: each socket stays bound until all are chosen (ports
    chosen one after another can come back the same, and two servers then race for one)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


def free_port(host: str = "127.0.0.1") -> int:
    """One free port on ``host``."""
    return free_ports(1, host)[0]
