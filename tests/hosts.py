"""Several test hosts on one machine: Linux network namespaces joined by veth pairs on a bridge.

``with test_hosts(2, rate="100mbit", delay="1ms") as hosts:`` gives two hosts, each a network
namespace with its own ``eth0`` on a private test subnet, its own loopback, its own hostname
(``h0``, ``h1``, ...), and a hosts file in which every host's name resolves to its test address,
as on separate machines. Their links meet on a bridge in the calling (root) namespace, which holds the
subnet's first address: that is the "submit host" from which the tests' orchestrator (Airflow,
``sbatch``, the Ray job client) reaches the hosts. Nothing outside the subnet and loopback is
ever addressed.

Layout, for a test that picked subnet 10.213.7.0/24 (the first /24 of 10.213.0.0/16 that no route
of the machine overlaps)::

    root namespace: bridge tf<tag>br  10.213.7.1/24   (the submit host)
       |-- tf<tag>v0 <-veth-> eth0 in netns tf<tag>h0   10.213.7.10   name h0
       '-- tf<tag>v1 <-veth-> eth0 in netns tf<tag>h1   10.213.7.11   name h1

``<tag>`` is the creating process id, so concurrent test sessions never share a namespace, and a
session killed before it cleaned up leaves names that the next one recognises as stale (their
process is gone) and removes first.

* :meth:`TestHosts.argv` wraps a command to run on host ``i``: in its network namespace, with
  the host's name as its hostname and the hosts' hosts file over ``/etc/hosts`` (private mount
  and UTS namespaces: the machine's own files and name never change);
* :meth:`TestHosts.shape` puts a rate and delay (``tc`` netem) on every host's link, both ways;
* :meth:`TestHosts.cut` / :meth:`TestHosts.restore` take one host's link down and up (a lost
  host whose processes live on), :meth:`TestHosts.kill` kills every process on one host;
* :meth:`TestHosts.counters` reads a host's interface byte counters.

Leaving the ``with`` block (normally, by an exception, or at interpreter exit when a test was
interrupted) kills every process left in the namespaces and removes the namespaces, the bridge
and the hosts files. Needs root and ``ip``/``tc`` (Debian's iproute2); :func:`unavailable` says
why not where it cannot run, and the ``test_hosts`` fixture skips with that reason.

For the next engine: start its daemons with ``hosts.argv(i, [...])`` (each host's address is
``hosts.address(i)``, its name ``hosts.name(i)``), give the submit side ``hosts.submit_address``,
and keep every port it opens on the test addresses.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

PREFIX = "tf"
SUPERNET = ipaddress.ip_network("10.213.0.0/16")


def _ip(*args: str, check: bool = True, ns: str | None = None) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def unavailable() -> str | None:
    """Why test hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "root (network namespaces and veth pairs need CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool, path="/usr/sbin:/sbin:/usr/bin:/bin")
               is None]
    if missing:
        return f"iproute2 ({', '.join(missing)} not found): sudo apt-get install -y iproute2"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"network namespaces (ip netns add: {made.stderr.strip()})"
    _ip("netns", "del", probe, check=False)
    return None


def _used_networks() -> list[ipaddress.IPv4Network]:
    routes = json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]")
    nets = []
    for route in routes:
        dst = route.get("dst", "")
        if dst in ("", "default"):
            continue
        try:
            nets.append(ipaddress.ip_network(dst if "/" in dst else dst + "/32", strict=False))
        except ValueError:
            continue
    return nets


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    for subnet in SUPERNET.subnets(new_prefix=24):
        if not any(subnet.overlaps(net) for net in used):
            return subnet
    raise RuntimeError(f"no free /24 in {SUPERNET} for test hosts")


def remove_stale() -> list[str]:
    """Remove namespaces, bridges and hosts files left by test sessions that are gone."""
    removed = []
    names = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()
             if line.strip()]
    links = [link["ifname"] for link in json.loads(_ip("-j", "link", "show", check=False).stdout or "[]")]
    for name in names + links:
        if not name.startswith(PREFIX):
            continue
        digits = name[len(PREFIX):].split("h")[0].split("br")[0].split("v")[0]
        if not digits.isdigit() or _alive(int(digits)):
            continue
        if name in names:
            _kill_namespace(name)
            _ip("netns", "del", name, check=False)
        else:
            _ip("link", "del", name, check=False)
        removed.append(name)
    return removed


_NETEM: dict[str, str | None] = {}


def delay_unavailable() -> str | None:
    """Why a link delay cannot be set here (the kernel's netem qdisc), or None."""
    if "why" not in _NETEM:
        ns = f"{PREFIX}probe{os.getpid()}"
        _ip("netns", "add", ns, check=False)
        proc = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root",
                               "netem", "delay", "1ms"], capture_output=True, text=True, timeout=30)
        _ip("netns", "del", ns, check=False)
        _NETEM["why"] = None if proc.returncode == 0 else (
            f"the kernel's netem qdisc (sch_netem), which this kernel lacks ({proc.stderr.strip()})")
    return _NETEM["why"]


def _operstate(dev: str, ns: str | None = None) -> str:
    links = json.loads(_ip("-j", "link", "show", "dev", dev, ns=ns, check=False).stdout or "[]")
    return links[0].get("operstate", "") if links else ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespace_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def _kill_namespace(ns: str, grace_s: float = 5.0) -> None:
    """SIGTERM every process in ``ns``, then SIGKILL what is left after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = _namespace_pids(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _namespace_pids(ns):
            time.sleep(0.1)


class TestHosts:
    """``count`` hosts; see the module docstring. Use through :func:`test_hosts`."""

    __test__ = False  # not a pytest test class

    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"count must be at least 1 (got {count})")
        self.count = count
        self.tag = str(os.getpid())
        self.subnet = _free_subnet()
        base = self.subnet.network_address
        self.submit_address = str(base + 1)
        self._addresses = [str(base + 10 + i) for i in range(count)]
        self.namespaces = [f"{PREFIX}{self.tag}h{i}" for i in range(count)]
        self.bridge = f"{PREFIX}{self.tag}br"
        self._veths = [f"{PREFIX}{self.tag}v{i}" for i in range(count)]
        self._up = False
        self.rate: str | None = None
        self.delay: str | None = None

    # -- naming -------------------------------------------------------------------------------
    def name(self, i: int) -> str:
        """Host ``i``'s name, resolvable on every host (``h0``, ``h1``, ...)."""
        return f"h{i}"

    def address(self, i: int) -> str:
        return self._addresses[i]

    @property
    def addresses(self) -> list[str]:
        return list(self._addresses)

    # -- life ---------------------------------------------------------------------------------
    def create(self) -> None:
        remove_stale()
        atexit.register(self.remove)
        self._up = True
        self._etc = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{self.tag}-etc-"))
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.submit_address}/{self.subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, (ns, veth) in enumerate(zip(self.namespaces, self._veths)):
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            _ip("link", "set", f"{veth}p", "netns", ns)
            _ip("link", "set", "dev", f"{veth}p", "name", "eth0", ns=ns)
            _ip("addr", "add", f"{self.address(i)}/{self.subnet.prefixlen}", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            lines = ["127.0.0.1 localhost", "::1 localhost", f"{self.submit_address} submit"]
            lines += [f"{self.address(j)} {self.name(j)}" for j in range(self.count)]
            self._hosts_file(i).write_text("\n".join(lines) + "\n")
        self._wait_reachable()

    def _wait_reachable(self, timeout_s: float = 15.0) -> None:
        """Until every host's link is up on both ends (a bridge port forwards once it is)."""
        deadline = time.monotonic() + timeout_s
        for i, veth in enumerate(self._veths):
            while not (_operstate(veth) == "UP" and _operstate("eth0", self.namespaces[i]) == "UP"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"test host {self.name(i)}: link {veth} not up after "
                                       f"{timeout_s:.0f} s")
                time.sleep(0.05)

    def remove(self) -> None:
        """Kill every process on the hosts, then remove namespaces, links and hosts files."""
        if not self._up:
            return
        self._up = False
        for ns in self.namespaces:
            _kill_namespace(ns)
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)
        shutil.rmtree(self._etc, ignore_errors=True)
        for veth in self._veths:
            _ip("link", "del", veth, check=False)
        _ip("link", "del", self.bridge, check=False)
        atexit.unregister(self.remove)

    # -- using the hosts ----------------------------------------------------------------------
    def argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on host ``i``: in its network namespace (``nsenter``), with a hostname of
        its own (the host's name, in a UTS namespace) and its hosts file bind-mounted over
        ``/etc/hosts`` (in a mount namespace of its own, so nothing of the machine changes).
        The rest of the file system is the machine's: every host sees the same files, as nodes
        on a shared file system do, and ``/sys`` (cgroups included) is left as it is."""
        return ["nsenter", f"--net=/run/netns/{self.namespaces[i]}",
                "unshare", "--mount", "--uts", "--propagation", "private", "--",
                "sh", "-c", 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"',
                str(self._hosts_file(i)), self.name(i), *argv]

    def _hosts_file(self, i: int) -> Path:
        return self._etc / f"hosts-{self.name(i)}"

    def run(self, i: int, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.argv(i, argv), **kwargs)

    def spawn(self, i: int, argv: Sequence[str], log: Path, **kwargs) -> subprocess.Popen:
        """A background process on host ``i``, its output appended to ``log``."""
        with open(log, "ab") as out:
            return subprocess.Popen(self.argv(i, argv), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)

    def pids(self, i: int) -> list[int]:
        return _namespace_pids(self.namespaces[i])

    def processes(self, i: int, word: str) -> list:
        """Host ``i``'s live processes (``psutil.Process``) whose command line holds ``word``."""
        import psutil

        found = []
        for pid in self.pids(i):
            try:
                proc = psutil.Process(pid)
                if word in " ".join(proc.cmdline()):
                    found.append(proc)
            except psutil.NoSuchProcess:
                continue
        return found

    def leftovers(self, words: Sequence[str]) -> list[str]:
        """``h<i>: <command line>`` of every live process on the hosts whose command line holds
        one of ``words``."""
        return [f"h{i}: {' '.join(p.cmdline())[:200]}" for i in range(self.count)
                for word in words for p in self.processes(i, word)]

    def wait_nothing_left(self, words: Sequence[str], timeout_s: float = 30.0) -> None:
        """Poll until no process of ``words`` is left on any host; fail naming them after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.leftovers(words) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not self.leftovers(words), self.leftovers(words)

    def shape(self, rate: str | None = None, delay: str | None = None) -> None:
        """``rate`` (tc units, e.g. ``"100mbit"``) and one-way ``delay`` (``"1ms"``) on every
        host's link in both directions; ``shape()`` with neither removes the shaping.

        The rate is an HTB class (``sch_htb``) on each end of every link; the delay is netem
        (``sch_netem``) under it, which some kernels lack: then asking for a delay raises, and
        :func:`delay_unavailable` says so beforehand.
        """
        if delay and delay_unavailable():
            raise RuntimeError(f"a link delay needs {delay_unavailable()}")
        devices = [(ns, "eth0") for ns in self.namespaces] + [(None, v) for v in self._veths]
        for ns, dev in devices:
            tc = ["ip", "netns", "exec", ns, "tc"] if ns else ["tc"]
            subprocess.run([*tc, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)
            steps = []
            if rate:
                steps += [["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
                          ["class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                           "rate", rate, "ceil", rate, "quantum", "60000"]]
                if delay:
                    steps.append(["qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:",
                                  "netem", "limit", "100000", "delay", delay])
            elif delay:
                steps.append(["qdisc", "add", "dev", dev, "root", "netem", "limit", "100000",
                              "delay", delay])
            for step in steps:
                proc = subprocess.run([*tc, *step], capture_output=True, text=True, timeout=30)
                if proc.returncode != 0:
                    raise RuntimeError(f"tc {' '.join(step)}: {proc.stderr.strip()}")
        self.rate, self.delay = rate, delay

    def cut(self, i: int) -> None:
        """Host ``i`` drops off the network: its link goes down, its processes keep running."""
        _ip("link", "set", self._veths[i], "down")

    def restore(self, i: int) -> None:
        _ip("link", "set", self._veths[i], "up")

    def kill(self, i: int) -> None:
        """Every process on host ``i`` is killed at once (SIGKILL), as when a machine dies."""
        for pid in self.pids(i):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def counters(self, i: int) -> dict[str, int]:
        """Host ``i``'s ``eth0`` byte and packet counters (``rx_bytes``, ``tx_bytes``, ...)."""
        links = json.loads(_ip("-j", "-s", "link", "show", "dev", "eth0", ns=self.namespaces[i]).stdout)
        stats = links[0]["stats64"]
        return {"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"],
                "rx_packets": stats["rx"]["packets"], "tx_packets": stats["tx"]["packets"]}


@contextmanager
def test_hosts(count: int, rate: str | None = None, delay: str | None = None) -> Iterator[TestHosts]:
    """``count`` fresh hosts, their links shaped to ``rate``/``delay``; removed on any exit."""
    hosts = TestHosts(count)
    try:
        hosts.create()
        if rate or delay:
            hosts.shape(rate, delay)
        yield hosts
    finally:
        hosts.remove()


test_hosts.__test__ = False  # type: ignore[attr-defined]


def skip_if_unavailable() -> None:
    """Skip the calling test, saying what is missing and how to get it, where test hosts cannot
    be made here."""
    why = unavailable()
    if why:
        from tests.conftest import skip_without

        skip_without("hosts", why)


@pytest.fixture
def make_hosts() -> Iterator:
    """A factory ``make_hosts(count, rate=None, delay=None) -> TestHosts``; every host it made is
    removed when the test ends. Skips, saying what is missing, where hosts cannot be made."""
    skip_if_unavailable()
    made: list[TestHosts] = []

    def make(count: int, rate: str | None = None, delay: str | None = None) -> TestHosts:
        hosts = TestHosts(count)
        made.append(hosts)
        hosts.create()
        if rate or delay:
            hosts.shape(rate, delay)
        return hosts

    try:
        yield make
    finally:
        for hosts in reversed(made):
            hosts.remove()
