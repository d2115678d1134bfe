"""Each node's preflight (trainforge.engines.node_preflight), on this machine's loopback only:
the interface of the route to the rendezvous, a user's interface kept or refused, the store's
host reached (or not) within the timeout, and the exit and message of a failure."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import skip_without
from trainforge.contract import EXIT_CONFIG, STATUS_BAD_CONFIG
from trainforge.engines import node_preflight as pf


def _closed_port() -> tuple[socket.socket, int]:
    """A loopback port that refuses connections (bound, never listening) while held."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]


@pytest.fixture
def listener():
    """A loopback TCP server that accepts and closes connections: (port, connections seen)."""
    server = socket.create_server(("127.0.0.1", 0))
    seen: list[int] = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            seen.append(1)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1], seen
    server.close()


def _torchrun(endpoint: str, is_host: str, conf: str = "join_timeout=600") -> list[str]:
    return ["python", "-m", "torch.distributed.run", "--nnodes=2",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-conf={conf},is_host={is_host}",
            "-m", "trainforge.trainer.train", "--config", "job.json"]


def test_the_route_to_a_loopback_address_leaves_by_the_loopback_interface():
    assert pf.route("127.0.0.1") == ("lo", "127.0.0.1")


def test_without_ip_the_route_comes_from_a_udp_socket_and_the_interface_holding_its_address(
        monkeypatch):
    monkeypatch.setattr(pf, "ip_command", lambda: None)
    assert pf.route("127.0.0.1") == ("lo", "127.0.0.1")


def test_the_route_sets_both_socket_variables_when_the_user_set_neither(listener):
    port, seen = listener
    net, env = pf.prepare(f"127.0.0.1:{port}", False, 5, {})
    assert (net.interface, net.own_address) == ("lo", "127.0.0.1")
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:  # the server thread counts it
        time.sleep(0.01)
    assert seen  # it did connect


def test_a_users_interface_is_kept(listener):
    port, _ = listener
    _, env = pf.prepare(f"127.0.0.1:{port}", False, 5, {"GLOO_SOCKET_IFNAME": "lo"})
    assert env == {"NCCL_SOCKET_IFNAME": "=lo"}  # the interface the user named, exactly
    _, env = pf.prepare(f"127.0.0.1:{port}", False, 5,
                        {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "^docker"})
    assert env == {}


@pytest.mark.parametrize("name, value, fragment", [
    ("GLOO_SOCKET_IFNAME", "nosuch0", "names nosuch0, which this node does not have"),
    ("GLOO_SOCKET_IFNAME", "lo,nosuch0", "names nosuch0"),
    ("NCCL_SOCKET_IFNAME", "=nosuch0", "names nosuch0"),
    ("NCCL_SOCKET_IFNAME", "nosuch", "names nosuch,"),
])
def test_a_users_interface_this_node_lacks_is_refused(name, value, fragment):
    with pytest.raises(pf.PreflightError, match=fragment):
        pf.check_user_ifname(name, value, loopback_ok=True)


def test_a_loopback_interface_is_refused_when_the_rendezvous_is_not_loopback():
    with pytest.raises(pf.PreflightError, match="loopback interface, which the other nodes"):
        pf.check_user_ifname("GLOO_SOCKET_IFNAME", "lo", loopback_ok=False)
    with pytest.raises(pf.PreflightError, match="loopback"):
        pf.check_user_ifname("NCCL_SOCKET_IFNAME", "l", loopback_ok=False)
    pf.check_user_ifname("GLOO_SOCKET_IFNAME", "lo", loopback_ok=True)
    pf.check_user_ifname("NCCL_SOCKET_IFNAME", "^lo", loopback_ok=False)  # left to NCCL


def test_a_node_waits_for_the_store_host_to_listen():
    held, port = _closed_port()
    held.close()

    def listen_later():
        time.sleep(1.0)
        server = socket.create_server(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()
        server.close()

    thread = threading.Thread(target=listen_later, daemon=True)
    thread.start()
    started = time.monotonic()
    pf.reach(pf.Network("127.0.0.1", "127.0.0.1", port), False, started + 10)
    assert 0.9 < time.monotonic() - started < 5
    thread.join(5)


def test_the_store_host_checks_the_address_is_its_own_without_connecting():
    held, port = _closed_port()
    with held:
        pf.reach(pf.Network("127.0.0.1", "127.0.0.1", port), True, time.monotonic() + 1)
        with pytest.raises(pf.PreflightError, match="cannot listen on that address"):
            # TEST-NET-3: no address of this machine; bind fails without any traffic.
            pf.reach(pf.Network("203.0.113.7", "203.0.113.7", port), True, time.monotonic() + 1)


def test_an_unreachable_endpoint_fails_permanently_within_the_timeout_naming_node_and_address(
        tmp_path, monkeypatch, capsys):
    result = tmp_path / "result.json"
    monkeypatch.setenv("TRAINFORGE_RESULT_FILE", str(result))
    monkeypatch.setattr(pf.os, "execvpe", lambda *a: pytest.fail(f"torchrun started: {a}"))
    held, port = _closed_port()
    with held:
        started = time.monotonic()
        code = pf.main(["--timeout", "1.5", "--node", "h1 (node 1 of 2)", "--",
                        *_torchrun(f"127.0.0.1:{port}", "false")])
        took = time.monotonic() - started
    assert code == EXIT_CONFIG == 78
    assert 1.4 < took < 3.5, took
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err  # one line
    for fragment in ("preflight failed on node h1 (node 1 of 2)", f"127.0.0.1:{port}",
                     "its own address 127.0.0.1 on lo", "after 1.", "(fault.startup_timeout 1.5 s)",
                     "could not reach the rendezvous", "Connection refused"):
        assert fragment in err, (fragment, err)
    record = json.loads(result.read_text())
    assert record["status"] == STATUS_BAD_CONFIG and record["exit_code"] == 78
    assert record["message"] in err


def test_a_first_failure_keeps_its_result(tmp_path, monkeypatch):
    result = tmp_path / "result.json"
    result.write_text('{"status": "bad_config", "message": "node h0 first"}')
    pf.write_result("node h1 later", {"TRAINFORGE_RESULT_FILE": str(result)})
    assert json.loads(result.read_text())["message"] == "node h0 first"


def test_a_wrong_interface_value_fails_permanently_naming_it(monkeypatch, capsys, listener):
    port, _ = listener
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    monkeypatch.delenv("TRAINFORGE_RESULT_FILE", raising=False)
    monkeypatch.setattr(pf.os, "execvpe", lambda *a: pytest.fail(f"torchrun started: {a}"))
    assert pf.main(["--timeout", "5", "--node", "h1", "--",
                    *_torchrun(f"127.0.0.1:{port}", "false")]) == 78
    err = capsys.readouterr().err
    assert "node h1" in err and "GLOO_SOCKET_IFNAME=nosuch0" in err and f":{port}" in err


def test_on_success_torchrun_is_execd_with_the_interface_and_the_time_left(monkeypatch, listener):
    port, _ = listener
    for name in pf.IFNAME_VARS:
        monkeypatch.delenv(name, raising=False)
    started: list = []
    monkeypatch.setattr(pf.os, "execvpe", lambda *a: started.append(a))
    pf.main(["--timeout", "30", "--node", "h0", "--", *_torchrun(f"127.0.0.1:{port}", "true")])
    (file, argv, env), = started
    assert file == "python" and argv[-2:] == ["--config", "job.json"]
    conf = next(a for a in argv if a.startswith("--rdzv-conf="))
    # The store's host waits a little longer than the others take to give up reaching it.
    assert conf in ("--rdzv-conf=join_timeout=35,is_host=true",
                    "--rdzv-conf=join_timeout=34,is_host=true"), conf
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"


def test_the_join_timeout_is_what_is_left_and_a_little_more_on_the_host():
    assert pf.join_seconds(60, 12.5, False) == 48
    assert pf.join_seconds(60, 12.5, True) == 48 + pf.HOST_GRACE_S
    assert pf.join_seconds(60, 75, False) == 1


def test_torchrun_options_are_read_and_join_timeout_set():
    argv = _torchrun("[fd00::10]:29500", "false", conf="read_timeout=60,join_timeout=600")
    assert pf.rdzv_option(argv, "endpoint") == "[fd00::10]:29500"
    assert pf.conf_value(argv, "is_host") == "false"
    out = pf.with_join_timeout(argv, 41.2)
    assert "--rdzv-conf=join_timeout=42,read_timeout=60,is_host=false" in out
    spaced = ["torchrun", "--rdzv_conf", "is_host=true", "x.py"]
    assert pf.with_join_timeout(spaced, 0.2)[2] == "join_timeout=1,is_host=true"
    assert pf.with_join_timeout(["torchrun", "x.py"], 5) == ["torchrun", "x.py"]


@pytest.mark.parametrize("endpoint, expected", [
    ("10.0.0.1:29500", ("10.0.0.1", 29500)), ("[fd00::10]:29500", ("fd00::10", 29500)),
    ("h0:1", ("h0", 1)),
])
def test_endpoints_are_split(endpoint, expected):
    assert pf.split_endpoint(endpoint) == expected


@pytest.mark.parametrize("endpoint", ["10.0.0.1", "h0:", ":29500", "h0:http", "h0:70000"])
def test_a_bad_endpoint_is_refused_with_the_expected_form(endpoint):
    with pytest.raises(ValueError, match=r"HOST:PORT or \[IPV6\]:PORT"):
        pf.split_endpoint(endpoint)


def test_a_command_without_rendezvous_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as ended:
        pf.main(["--timeout", "5", "--", "python", "train.py"])
    assert ended.value.code == 2
    assert "--rdzv-endpoint" in capsys.readouterr().err


@pytest.fixture
def namespace():
    """A network namespace of this test's own with two veth pairs: ``tfd1`` up with 10.77.0.1/24
    (the route to the rendezvous), ``tfd0`` down without an address (its peer ``tfp0`` up);
    removed afterwards with its interfaces."""
    ns = f"tf-pf-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode != 0:
        skip_without("hosts", "ip netns add failed")
    try:
        for step in (["link", "set", "lo", "up"], ["link", "add", "tfd1", "type", "veth", "peer", "name", "tfp1"],
                     ["addr", "add", "10.77.0.1/24", "dev", "tfd1"], ["link", "set", "tfp1", "up"],
                     ["link", "set", "tfd1", "up"], ["link", "add", "tfd0", "type", "veth", "peer", "name", "tfp0"],
                     ["link", "set", "tfp0", "up"]):
            subprocess.run(["ip", "-n", ns, *step], check=True, capture_output=True)
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _preflight_in(ns: str, **env: str) -> tuple[int, str, float]:
    argv = ["ip", "netns", "exec", ns, sys.executable, "-m", pf.MODULE, "--timeout", "60", "--node", "hb",
            "--endpoint", "10.77.0.1:29511", "--is-host", "true", "--", "env"]
    clean = {k: v for k, v in os.environ.items() if k not in pf.IFNAME_VARS and k != "TRAINFORGE_RESULT_FILE"}
    started = time.monotonic()
    proc = subprocess.run(argv, env={**clean, **env}, capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started


def test_a_named_interface_that_is_down_or_without_an_address_fails_in_seconds_naming_it(namespace):
    code, out, took = _preflight_in(namespace, GLOO_SOCKET_IFNAME="tfd0")
    assert code == EXIT_CONFIG and took < 10, out
    for fragment in ("preflight failed on node hb after ", "(fault.startup_timeout 60 s)", "GLOO_SOCKET_IFNAME=tfd0",
                     "tfd0 is administratively down", "the route to it leaves by tfd1"):
        assert fragment in out, (fragment, out)
    subprocess.run(["ip", "-n", namespace, "link", "set", "tfp0", "down"], check=True)
    subprocess.run(["ip", "-n", namespace, "link", "set", "tfd0", "up"], check=True)  # its peer down
    code, out, _ = _preflight_in(namespace, GLOO_SOCKET_IFNAME="tfd0")
    assert code == EXIT_CONFIG and "tfd0 is up without a carrier" in out, out
    subprocess.run(["ip", "-n", namespace, "link", "set", "tfp0", "up"], check=True)
    code, out, _ = _preflight_in(namespace, NCCL_SOCKET_IFNAME="=tfd0")
    assert code == EXIT_CONFIG and "tfd0 has no IPv4 address" in out and "leaves by tfd1" in out, out


def test_one_named_socket_variable_names_the_same_interface_for_both(namespace):
    code, out, _ = _preflight_in(namespace, GLOO_SOCKET_IFNAME="tfd1")
    assert code == 0 and "\nNCCL_SOCKET_IFNAME==tfd1\n" in out and "\nGLOO_SOCKET_IFNAME=tfd1\n" in out, out
    assert "set NCCL_SOCKET_IFNAME==tfd1 (NCCL_SOCKET_IFNAME: the interfaces GLOO_SOCKET_IFNAME names)" in out
    subprocess.run(["ip", "-n", namespace, "link", "set", "tfd0", "up"], check=True)  # up, no address
    code, out, _ = _preflight_in(namespace, NCCL_SOCKET_IFNAME="tfd")  # a prefix: gloo gets the usable one
    assert code == 0 and "\nGLOO_SOCKET_IFNAME=tfd1\n" in out and "\nNCCL_SOCKET_IFNAME=tfd\n" in out, out
