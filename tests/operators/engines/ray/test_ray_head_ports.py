"""Ports of the local Ray head (``trainforge.engines.ray.head``): one free port per component,
never the same port twice, none inside the workers' port range — what ``ray start`` checks
before it starts ("Ray component metrics_export is trying to use a port number N that is used
by other components"). Pure unit tests: a small fake of the kernel's port allocation, plus one
check with real sockets on loopback."""

from __future__ import annotations

import socket

import pytest

from trainforge.engines.ray import head
from trainforge.engines.ray.head import (
    RAY_PORT_OPTIONS,
    WORKER_PORTS,
    RayHeadError,
    _port_taken,
    free_ports,
    ray_ports,
)


class FakeKernel:
    """Hands out the lowest port at or above ``first`` that no open socket holds, as a kernel
    may: a port closed a moment ago is the next one given out again."""

    def __init__(self, first: int):
        self.first = first
        self.bound: set[int] = set()

    def socket(self, *args, **kwargs):
        kernel = self

        class Sock:
            port: int | None = None

            def bind(self, address):
                port = kernel.first
                while port in kernel.bound:
                    port += 1
                kernel.bound.add(port)
                self.port = port

            def getsockname(self):
                return ("127.0.0.1", self.port)

            def close(self):
                kernel.bound.discard(self.port)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.close()

        return Sock()


@pytest.mark.parametrize("first", [40_000, WORKER_PORTS.stop - 3])
def test_every_component_gets_its_own_port_outside_the_worker_range(monkeypatch, first):
    kernel = FakeKernel(first)
    monkeypatch.setattr(head.socket, "socket", kernel.socket)
    ports = ray_ports()
    assert list(ports) == list(RAY_PORT_OPTIONS)
    assert len(set(ports.values())) == len(RAY_PORT_OPTIONS), ports
    assert not [p for p in ports.values() if p in WORKER_PORTS], ports
    assert kernel.bound == set()  # every socket is closed again


def test_too_few_ports_outside_the_range_to_avoid_is_an_error(monkeypatch):
    monkeypatch.setattr(head.socket, "socket", FakeKernel(100).socket)
    with pytest.raises(RayHeadError, match="found 0 of 2 free ports on 127.0.0.1 outside 100-1099"):
        free_ports(2, avoid=range(100, 1100), max_tries=50)


def test_ports_are_free_on_loopback():
    ports = ray_ports()
    assert len(set(ports.values())) == len(ports)
    for port in ports.values():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises OSError when someone holds it


@pytest.mark.parametrize("text,taken", [
    ("[gcs_server] Failed to bind to address 127.0.0.1:41234: Address already in use", True),
    ("The dashboard on 127.0.0.1:8265 failed: [Errno 98] address already in use", True),
    ("ray.exceptions.RaySystemError: out of memory", False),
])
def test_a_port_taken_before_ray_bound_it_is_told_from_other_start_failures(tmp_path, text, taken):
    log = tmp_path / "ray-start.log"
    log.write_text("Address already in use (an earlier attempt)\n")
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write(text + "\n")
    assert _port_taken(log, offset) is taken
