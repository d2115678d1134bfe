"""trainforge.mlflow_setup.server: command building, health waits, start/stop of a real server."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from trainforge.mlflow_setup import (
    HealthTimeoutError,
    ServerConfig,
    ServerStartError,
    build_server_command,
    start_server,
    wait_healthy,
)
from trainforge.mlflow_setup.home import PID_FILE_NAME
from trainforge.mlflow_setup.server import client_url

REPO_ROOT = Path(__file__).parents[2]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again when the block ends


def _group_alive(pgid: int) -> list[int]:
    alive = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


def test_build_server_command_defaults(tmp_path: Path) -> None:
    argv = build_server_command(ServerConfig(home=tmp_path), port=5123)
    assert argv[:4] == [sys.executable, "-m", "mlflow", "server"]
    assert argv.count("--serve-artifacts") == 1
    assert f"sqlite:///{tmp_path}/mlflow.db" in argv
    assert argv[argv.index("--artifacts-destination") + 1] == str(tmp_path / "artifacts")
    assert argv[argv.index("--workers") + 1] == "1"
    assert argv[argv.index("--port") + 1] == "5123"
    assert "--allowed-hosts" not in argv


def test_build_server_command_overrides(tmp_path: Path) -> None:
    config = ServerConfig(
        home=tmp_path,
        host="0.0.0.0",
        backend_store_uri="postgresql://db/mlflow",
        artifacts_destination="s3://bucket/mlflow",
        allowed_hosts="mlflow,mlflow:5000",
    )
    argv = build_server_command(config, port=5000)
    assert argv[argv.index("--backend-store-uri") + 1] == "postgresql+psycopg2://db/mlflow"  # installed driver
    assert argv[argv.index("--artifacts-destination") + 1] == "s3://bucket/mlflow"
    assert argv[argv.index("--allowed-hosts") + 1] == "mlflow,mlflow:5000"


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:5000"),
        ("0.0.0.0", "http://127.0.0.1:5000"),
        ("::", "http://[::1]:5000"),
        ("localhost", "http://localhost:5000"),
    ],
)
def test_client_url(host: str, url: str) -> None:
    assert client_url(host, 5000) == url


def test_health_wait_timeout_names_url_duration_state_and_log_tail(tmp_path: Path) -> None:
    log_file = tmp_path / "mlflow-server.log"
    log_file.write_text("booting\nERROR mlflow.store.db.utils: database is locked\n")
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(HealthTimeoutError) as info:
        wait_healthy(url, timeout_s=1.0, interval_s=0.2, log_file=log_file)
    message = str(info.value)
    assert f"GET {url}/health" in message
    assert "after waiting 1.0 s" in message
    assert "Connection refused" in message
    assert "database is locked" in message
    assert info.value.last_state.startswith("ConnectionRefusedError")


@pytest.fixture
def unhealthy_http_server() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_health_wait_reports_last_http_status(unhealthy_http_server: str) -> None:
    with pytest.raises(HealthTimeoutError, match="last state seen: HTTP 503"):
        wait_healthy(unhealthy_http_server, timeout_s=0.5, interval_s=0.1)


def test_start_refuses_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"port {port} on 127.0.0.1 is already in use"):
            start_server(tmp_path, port=port)
    assert not (tmp_path / PID_FILE_NAME).exists()


@pytest.mark.integration
def test_start_reports_an_early_exit_with_the_log_tail(tmp_path: Path) -> None:
    # A well-formed URI the server cannot open: its "folder" is a regular file.
    (tmp_path / "not-a-folder").write_text("")
    store = f"sqlite:///{tmp_path}/not-a-folder/mlflow.db"
    with pytest.raises(ServerStartError, match="exited with code") as info:
        start_server(tmp_path, port=0, backend_store_uri=store, timeout_s=60)
    assert "not-a-folder" in info.value.log_tail
    assert not (tmp_path / PID_FILE_NAME).exists()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainforge.mlflow_setup", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.integration
def test_start_is_idempotent_and_stop_leaves_no_process(tmp_path: Path) -> None:
    handle = start_server(tmp_path, port=0, timeout_s=120)
    record = json.loads((tmp_path / PID_FILE_NAME).read_text())
    assert (record["pid"], record["url"]) == (handle.pid, handle.url)
    assert len(_group_alive(handle.pid)) >= 2  # mlflow CLI + uvicorn

    again = _cli("start", "--home", str(tmp_path), "--port", "0")  # another process, same home
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == handle.url
    assert "reusing" in again.stderr
    waited = _cli("wait", "--url", handle.url, "--timeout-s", "5")
    assert waited.returncode == 0, waited.stderr

    stopped = _cli("stop", "--home", str(tmp_path))
    assert stopped.returncode == 0, stopped.stderr
    handle.stop()  # already gone: a no-op that also reaps our child
    assert _group_alive(handle.pid) == []
    assert not (tmp_path / PID_FILE_NAME).exists()
    assert _cli("stop", "--home", str(tmp_path)).returncode == 0  # nothing to stop: still fine


@pytest.mark.integration
def test_a_port_taken_by_another_server_during_the_start_is_not_taken_for_this_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs starting together on one port: the one whose server lost the port must not take
    the other's health answer for its own (its runs would go to the other's store)."""
    import trainforge.mlflow_setup.server as server_mod

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args: object) -> None:
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    port = other.server_address[1]
    threading.Thread(target=other.serve_forever, daemon=True).start()
    # the other server binds between this start's port check and its own bind
    monkeypatch.setattr(server_mod, "port_in_use", lambda host, p: False)
    try:
        handle = start_server(tmp_path, port=port, timeout_s=60)
    except ServerStartError as err:
        error = err
    else:  # taken for started: stop what it started before failing
        handle.stop()
        pytest.fail(f"the other server's health answer was taken for this one's: {handle}")
    finally:
        other.shutdown()
        other.server_close()
    assert (f"port {port} on 127.0.0.1 was taken by another server" in str(error)
            or "exited with code" in str(error)), error
    assert not (tmp_path / PID_FILE_NAME).exists()
    # The server that lost the port finished migrating its store before it stopped: the next
    # start of this home (on a free port, as `trainforge run` then does) finds the store whole.
    monkeypatch.undo()
    with start_server(tmp_path, port=0, timeout_s=120) as again:
        assert again.url != f"http://127.0.0.1:{port}"

