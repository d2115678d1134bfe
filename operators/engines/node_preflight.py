"""Each node's check before its torchrun starts: the network interface to use, and whether the
rendezvous can be reached at all, failing fast and permanently when it cannot.

Run on every node of a multi-node job before torchrun (the Slurm script's per-node preamble;
the Ray launcher calls :func:`prepare` in each node's task)::

    python -m trainforge.engines.node_preflight --timeout 600 --node h1 -- \\
        python -m torch.distributed.run ... --rdzv-endpoint=10.0.0.10:29500 \\
        --rdzv-conf=join_timeout=600,is_host=false ...

1. The interface: the one this node's route to the rendezvous address leaves by
   (``ip -o route get ADDR``; without ``ip``, a UDP socket connected to it and the interface
   holding its source address). ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` are set to it
   when neither is set; a named one (the spec's ``env_vars`` or the node's environment) must
   exist, be up, hold an address of the rendezvous' family and not be loopback when the
   rendezvous is not, and names the other too (:mod:`trainforge.engines.socket_ifname`).
2. The rendezvous: the node that hosts the c10d store (``is_host=true``) checks the address is
   its own (it can bind it); every other node connects over TCP, retrying until the store's
   host listens, within ``--timeout`` (``fault.startup_timeout``).
3. Then torchrun is exec'd, its ``join_timeout`` what is left of ``--timeout`` (the store's host:
   :data:`HOST_GRACE_S` more): the start fails at the configured timeout (docs/slurm.md: why).

A failure prints one ``trainforge:`` line (the node, the seconds it took, the endpoint, the node's
address and interface), writes it as a ``bad_config`` result to ``$TRAINFORGE_RESULT_FILE``
(unless one is there) and exits 78: a configuration error, never retried.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from trainforge.contract import EXIT_CONFIG, RESULT_FILE_ENV, STATUS_BAD_CONFIG
from trainforge.engines.socket_ifname import (IFNAME_VARS, PreflightError, check_usable, check_user_ifname,
                                              interfaces, is_loopback_interface, paired)

MODULE = "trainforge.engines.node_preflight"
NODE_ENV = "TRAINFORGE_NODE"
"""Names this node in messages where ``--node`` is not given (the Slurm preamble sets it)."""
DEFAULT_TIMEOUT_S = 600.0
"""Without ``--timeout``: torchrun's own default join timeout."""
RETRY_S = 0.5
"""Pause between two TCP connection attempts to the store's host."""
CONNECT_S = 5.0
"""Longest single TCP connection attempt."""
HOST_GRACE_S = 5.0
"""The store's host waits this much longer for the others to join than they take to give up
reaching it: a node that cannot reach the rendezvous ends the job, with its message (a
configuration error), before the host's torchrun times out (a transient one)."""


@dataclass
class Network:
    """What a node resolved: the rendezvous ``host``/``address``/``port``, and its own
    ``interface`` and ``own_address`` towards it (None where they could not be found), and
    ``notes`` on socket variables set to what the user did not name (socket_ifname.paired)."""

    host: str
    address: str
    port: int
    interface: str | None = None
    own_address: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        shown = f"[{self.address}]" if ":" in self.address else self.address
        name = f" ({self.host})" if self.host != self.address else ""
        return f"{shown}:{self.port}{name}"

    @property
    def own(self) -> str:
        if not self.own_address:
            return "no address of its own towards it (no route)"
        return f"its own address {self.own_address} on {self.interface or 'an unknown interface'}"


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` as (host, port); ValueError naming the expected form."""
    host, sep, port = endpoint.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected the rendezvous endpoint as HOST:PORT or [IPV6]:PORT with a "
                         f"port 1-65535 (got {endpoint!r})")
    return host, int(port)


def _is_loopback(address: str | None) -> bool:
    try:
        return address is not None and ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> str:
    """The address ``host`` resolves to here (the first one TCP would use)."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, IndexError) as err:
        raise PreflightError(f"the rendezvous host {host} does not resolve here ({err}); fix "
                             f"the node's name resolution") from None


def ip_command() -> str | None:
    """iproute2's ``ip`` (on the PATH or in /usr/sbin, /sbin), or None."""
    return shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None)


def route(address: str) -> tuple[str | None, str | None]:
    """(interface, source address) of this node's route to ``address``: ``ip -o route get``,
    else a connected UDP socket's source address; a ``local`` route (``dev lo``) to one of
    this node's own addresses is mapped to the interface holding it."""
    ip = ip_command()
    dev = src = None
    if ip:
        proc = subprocess.run([ip, "-o", "route", "get", address], capture_output=True,
                              text=True, timeout=10)
        if proc.returncode != 0:
            raise PreflightError(f"this node has no route to the rendezvous address {address} "
                                 f"(ip route get: {proc.stderr.strip()})")
        words = proc.stdout.split()
        dev = words[words.index("dev") + 1] if "dev" in words else None
        src = words[words.index("src") + 1] if "src" in words else None
    if src is None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((address, 9))  # UDP: nothing is sent
                src = probe.getsockname()[0]
        except OSError as err:
            raise PreflightError(f"this node has no route to the rendezvous address {address} "
                                 f"({err})") from None
    if dev is None or (is_loopback_interface(dev) and not _is_loopback(address)):
        dev = interface_of(src) or dev
    return dev, src


def interface_of(address: str) -> str | None:
    """The interface that holds ``address`` on this node (psutil, else ``ip -o addr``)."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address.split("%")[0] == address for a in addrs):
                return name
        return None
    except ImportError:
        pass
    ip = ip_command()
    if ip:
        out = subprocess.run([ip, "-o", "addr", "show"], capture_output=True, text=True,
                             timeout=10).stdout
        for line in out.splitlines():
            words = line.split()
            if len(words) > 3 and words[3].split("/")[0] == address:
                return words[1]
    return None


def reach(net: Network, is_host: bool, deadline: float) -> None:
    """The store's host: its address must be one of this node's. Every other node: a TCP
    connection to the endpoint, retried until ``deadline`` (time.monotonic)."""
    family = socket.AF_INET6 if ":" in net.address else socket.AF_INET
    if is_host:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((net.address, 0))
        except OSError as err:
            raise PreflightError(f"it is to host the rendezvous at {net.endpoint}, but cannot "
                                 f"listen on that address ({err.strerror}): it is not this "
                                 f"node's") from None
        return
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PreflightError(f"it could not reach the rendezvous {net.endpoint} over TCP "
                                 f"(last attempt: {last})")
        try:
            with socket.create_connection((net.address, net.port),
                                          timeout=max(0.1, min(CONNECT_S, left))):
                return
        except OSError as err:
            last = (f"[Errno {err.errno}] {err.strerror or errno.errorcode.get(err.errno, '')}"
                    if err.errno else str(err) or type(err).__name__)
        time.sleep(min(RETRY_S, max(0.0, deadline - time.monotonic())))


def _option(argv: Sequence[str], name: str) -> tuple[int, str] | None:
    """(index, value) of torchrun's ``--rdzv-<name>`` (or ``--rdzv_<name>``) in ``argv``."""
    for i, arg in enumerate(argv):
        for flag in (f"--rdzv-{name}", f"--rdzv_{name}"):
            if arg.startswith(flag + "="):
                return i, arg[len(flag) + 1:]
            if arg == flag and i + 1 < len(argv):
                return i + 1, argv[i + 1]
    return None


def rdzv_option(argv: Sequence[str], name: str) -> str | None:
    """The value of torchrun's ``--rdzv-<name>`` in ``argv`` (either spelling), or None."""
    found = _option(argv, name)
    return found[1] if found else None


def conf_value(argv: Sequence[str], key: str) -> str | None:
    found = _option(argv, "conf")
    pairs = dict(p.split("=", 1) for p in (found[1].split(",") if found else []) if "=" in p)
    return pairs.get(key)


def with_join_timeout(argv: Sequence[str], seconds: float) -> list[str]:
    """``argv`` with ``join_timeout`` in ``--rdzv-conf`` set to ``seconds`` (whole, >= 1)."""
    out = list(argv)
    found = _option(out, "conf")
    if found is None:
        return out
    i, value = found
    pairs = [p for p in value.split(",") if p and not p.startswith("join_timeout=")]
    pairs.insert(0, f"join_timeout={max(1, math.ceil(seconds))}")
    out[i] = out[i][: len(out[i]) - len(value)] + ",".join(pairs)
    return out


def join_seconds(timeout_s: float, elapsed_s: float, is_host: bool) -> int:
    """torchrun's ``join_timeout``: what is left of ``timeout_s`` (whole seconds, >= 1), plus
    :data:`HOST_GRACE_S` on the store's host."""
    return max(1, math.ceil(timeout_s - elapsed_s + (HOST_GRACE_S if is_host else 0.0)))


def prepare(endpoint: str, is_host: bool, timeout_s: float, environ: Mapping[str, str],
            started: float | None = None) -> tuple[Network, dict[str, str]]:
    """Steps 1 and 2 of the module docstring: the rendezvous as resolved, and the variables to
    add to torchrun's environment. Raises PreflightError (its message without the node)."""
    started = time.monotonic() if started is None else started
    host, port = split_endpoint(endpoint)
    net = Network(host, resolve(host), port)
    loopback_ok = _is_loopback(net.address)
    try:
        net.interface, net.own_address = route(net.address)
        usable = {}
        for name in IFNAME_VARS:  # named: present, not loopback, up, an address of the family
            if environ.get(name):
                check_user_ifname(name, environ[name], loopback_ok)
                usable[name] = check_usable(name, environ[name], net.address, net.interface, ip_command())
        env, net.notes = paired(environ, net.interface, usable)
        reach(net, is_host, started + timeout_s)
    except PreflightError as err:
        err.net = net
        raise
    local = environ.get("PET_LOCAL_ADDR")
    if local and not loopback_ok and net.own_address and _local_is_loopback(local):
        env["PET_LOCAL_ADDR"] = net.own_address  # a host name that maps to 127.0.1.1 here
    return net, env


def _local_is_loopback(name: str) -> bool:
    try:
        return _is_loopback(resolve(name))
    except PreflightError:
        return False


def failure(node: str, net: Network | None, endpoint: str, timeout_s: float, why: str,
            elapsed_s: float | None = None) -> str:
    """The one line a failed preflight prints; ``elapsed_s``: how long it took (else the timeout)."""
    where = f"; {net.own}" if net else ""
    took = (f"within {round(timeout_s, 1):g} s (fault.startup_timeout)" if elapsed_s is None else
            f"after {elapsed_s:.1f} s (fault.startup_timeout {round(timeout_s, 1):g} s)")
    return (f"preflight failed on node {node} {took}, rendezvous {net.endpoint if net else endpoint}"
            f"{where}: {why}")


def write_result(message: str, environ: Mapping[str, str]) -> None:
    """``message`` as a ``bad_config`` result in ``$TRAINFORGE_RESULT_FILE`` unless one is
    there (the first node to fail names the cause)."""
    path = environ.get(RESULT_FILE_ENV)
    if not path or os.path.exists(path):
        return
    tmp = f"{path}.preflight.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            json.dump({"status": STATUS_BAD_CONFIG, "exit_code": EXIT_CONFIG,
                       "message": message}, out)
        os.replace(tmp, path)
    except OSError:
        pass


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds the node may take to reach the rendezvous and join it")
    parser.add_argument("--node", default=os.environ.get(NODE_ENV) or socket.gethostname(),
                        help=f"this node, in messages (default: ${NODE_ENV}, else the host name)")
    parser.add_argument("--endpoint", help="HOST:PORT (default: torchrun's --rdzv-endpoint)")
    parser.add_argument("--is-host", choices=("true", "false"),
                        help="whether this node hosts the store (default: torchrun's "
                             "--rdzv-conf is_host)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- and the torchrun command")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    args.endpoint = args.endpoint or rdzv_option(args.command, "endpoint")
    args.is_host = args.is_host or conf_value(args.command, "is_host")
    if not args.command or not args.endpoint or args.is_host not in ("true", "false"):
        parser.error(f"expected a torchrun command after -- with --rdzv-endpoint and "
                     f"--rdzv-conf is_host=true|false, or --endpoint and --is-host (got endpoint "
                     f"{args.endpoint!r}, is_host {args.is_host!r}, command {args.command!r})")
    if not args.timeout > 0:
        parser.error(f"--timeout must be positive seconds (got {args.timeout:g})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    try:
        net, env = prepare(args.endpoint, args.is_host == "true", args.timeout, os.environ,
                           started)
    except (PreflightError, ValueError) as err:
        message = failure(args.node, getattr(err, "net", None), args.endpoint, args.timeout,
                          str(err), time.monotonic() - started)
        print(f"trainforge: {message}", file=sys.stderr, flush=True)
        write_result(message, os.environ)
        return EXIT_CONFIG
    left = join_seconds(args.timeout, time.monotonic() - started, args.is_host == "true")
    command = with_join_timeout(args.command, left)
    set_ = " ".join(f"{k}={v}" for k, v in env.items()) or "nothing (set by the user)"
    set_ += "".join(f" ({note})" for note in net.notes)
    print(f"trainforge: node {args.node} reaches the rendezvous {net.endpoint} from {net.own}; "
          f"set {set_}; torchrun's rendezvous must complete within {left} s (what is left of "
          f"fault.startup_timeout)", flush=True)
    os.execvpe(command[0], command, {**os.environ, **env})
    return EXIT_CONFIG  # not reached


if __name__ == "__main__":
    sys.exit(main())
