"""The socket interfaces a node's ranks use (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``): each
named one checked on the node, and the one the user named used by both backends.

Part of the node preflight (:mod:`trainforge.engines.node_preflight`). A named interface must
exist, be up (``IFF_UP`` and ``IFF_RUNNING``: set, and with a carrier) and hold an
address of the rendezvous' family; otherwise gloo fails much later, as a transient error that names
neither the node nor the interface. Setting only one of the two variables sets the other to the
same interfaces (NCCL's ``=`` exact form; a gloo list of NCCL's prefix matches), never to another
interface without saying so: an NCCL exclusion list (``^...``) leaves gloo the route's interface,
with a note. docs/slurm.md, "Several nodes".
"""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import subprocess
from collections.abc import Mapping

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
SIOCGIFFLAGS, IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x8913, 0x1, 0x8, 0x40  # linux/sockios.h, linux/if.h


class PreflightError(Exception):
    """The node cannot take part in the rendezvous; the message says why, in one line, and
    ``net`` what the node had resolved by then (:class:`~trainforge.engines.node_preflight.Network`)."""

    net = None


def interfaces() -> list[str]:
    """The names of this node's network interfaces."""
    return [name for _, name in socket.if_nameindex()]


def flags(name: str) -> int | None:
    """Interface ``name``'s flags (``SIOCGIFFLAGS``: those of this process's network namespace,
    which ``/sys/class/net`` need not show), or None when they cannot be read."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            request = struct.pack("16sH22x", name.encode()[:15], 0)
            return struct.unpack("16sH22x", fcntl.ioctl(probe.fileno(), SIOCGIFFLAGS, request))[1]
    except (OSError, ValueError, UnicodeError):
        return None


def is_loopback_interface(name: str) -> bool:
    """Whether interface ``name`` is a loopback one (IFF_LOOPBACK in its flags)."""
    found = flags(name)
    return name == "lo" if found is None else bool(found & IFF_LOOPBACK)


def down(name: str) -> str | None:
    """Why interface ``name`` is down (``"is administratively down"``: not IFF_UP; ``"is up
    without a carrier"``: not IFF_RUNNING), or None when it is up or its flags cannot be read."""
    found = flags(name)
    if found is None:
        return None
    if not found & IFF_UP:
        return "is administratively down"
    return None if found & IFF_RUNNING else "is up without a carrier (operstate down)"


def addresses(name: str, family: socket.AddressFamily, ip: str | None) -> list[str] | None:
    """Interface ``name``'s addresses of ``family`` (psutil, else ``ip -j addr``); None when
    neither can tell."""
    try:
        import psutil

        return [a.address.split("%")[0] for a in psutil.net_if_addrs().get(name, ()) if a.family == family]
    except ImportError:
        pass
    if not ip:
        return None
    proc = subprocess.run([ip, "-j", "addr", "show", "dev", name], capture_output=True, text=True, timeout=10)
    try:
        links = json.loads(proc.stdout or "[]")
    except ValueError:
        return None
    kind = "inet6" if family == socket.AF_INET6 else "inet"
    return [a["local"] for link in links for a in link.get("addr_info", ()) if a.get("family") == kind]


def matched(name: str, value: str, here: list[str]) -> dict[str, list[str]]:
    """Each item of ``value`` and this node's interfaces it names: exact names for gloo and NCCL's
    ``=`` form, prefixes for NCCL's plain form ({} for NCCL's exclusion form, ``^...``)."""
    if name == "NCCL_SOCKET_IFNAME" and value.startswith("^"):
        return {}
    exact = name == "GLOO_SOCKET_IFNAME" or value.startswith("=")
    items = [i for i in value.lstrip("=").split(",") if i]
    return {i: [n for n in here if (n == i if exact else n.startswith(i))] for i in items}


def check_user_ifname(name: str, value: str, loopback_ok: bool) -> None:
    """A user's ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` against this node's interfaces:
    PreflightError when a named one is missing, or only loopback ones match and ``loopback_ok``
    is false. NCCL's exclusion form (``^...``) is left to NCCL."""
    here = interfaces()
    found = matched(name, value, here)
    missing = [i for i, names in found.items() if not names]
    exact = name == "GLOO_SOCKET_IFNAME" or value.startswith("=")
    if missing and (exact or len(missing) == len(found)):
        raise PreflightError(f"{name}={value} names {', '.join(missing)}, which this node does "
                             f"not have (its interfaces: {', '.join(here)})")
    used = [n for names in found.values() for n in names]
    if not loopback_ok and used and all(is_loopback_interface(n) for n in used):
        raise PreflightError(f"{name}={value} is a loopback interface, which the other nodes "
                             f"cannot reach")


def check_usable(name: str, value: str, address: str, route_if: str | None, ip: str | None) -> list[str]:
    """The interfaces ``name=value`` names that are up and hold an address of the family of the
    rendezvous ``address``. PreflightError, naming each named interface, its state and the route's
    interface ``route_if``, when an exact name is not usable or no prefix match is."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    shown = "IPv6" if family == socket.AF_INET6 else "IPv4"
    found = matched(name, value, interfaces())
    usable, why = [], {}
    for item, names in found.items():
        for n in names:
            held = addresses(n, family, ip)
            why[n] = down(n) or (f"has no {shown} address" if held == [] else None)
            if why[n] is None:
                usable.append(n)
    exact = name == "GLOO_SOCKET_IFNAME" or value.startswith("=")
    bad = {n: w for n, w in why.items() if w} if exact else ({} if usable else why)
    if bad:
        states = "; ".join(f"{n} {w}" for n, w in bad.items())
        raise PreflightError(f"{name}={value} names an interface this node cannot use for the rendezvous "
                             f"{address} ({states}); the route to it leaves by {route_if or 'no interface'}: "
                             f"bring the interface up with an {shown} address or name {route_if or 'another'}")
    return usable


def paired(environ: Mapping[str, str], route_if: str | None,
           usable: Mapping[str, list[str]]) -> tuple[dict[str, str], list[str]]:
    """The interface variables to set and a note for each choice that is not the user's own:
    neither set: both the route's interface; one set: the other names the same interfaces
    (``usable``: what :func:`check_usable` found for each set variable)."""
    gloo, nccl = (environ.get(v) for v in IFNAME_VARS)
    if not gloo and not nccl:
        return ({v: route_if for v in IFNAME_VARS} if route_if else {}), []
    if gloo and nccl:
        return {}, []
    if gloo:
        return {"NCCL_SOCKET_IFNAME": "=" + gloo}, ["NCCL_SOCKET_IFNAME: the interfaces GLOO_SOCKET_IFNAME names"]
    if nccl.startswith("^"):
        excluded = matched("NCCL_SOCKET_IFNAME", nccl[1:], interfaces())
        if not route_if or any(route_if in names for names in excluded.values()):
            raise PreflightError(f"NCCL_SOCKET_IFNAME={nccl} excludes interfaces, which gloo cannot take, "
                                 f"and the route to the rendezvous leaves by {route_if or 'no interface'}, "
                                 f"which it excludes: set GLOO_SOCKET_IFNAME to the interface gloo is to use")
        return {"GLOO_SOCKET_IFNAME": route_if}, [
            "GLOO_SOCKET_IFNAME: the route's interface, as gloo cannot take NCCL_SOCKET_IFNAME's exclusion list"]
    names = usable.get("NCCL_SOCKET_IFNAME") or []
    return {"GLOO_SOCKET_IFNAME": ",".join(names)}, [f"GLOO_SOCKET_IFNAME: the usable interfaces "
                                                     f"NCCL_SOCKET_IFNAME={nccl} names here"]
