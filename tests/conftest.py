"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real MLflow server on loopback for the session (SQLite store, proxied artifacts).

    Started with ``mlflow_setup`` on a free port; stopped (whole process group) at the end.
    """
    from mlflow_setup import start_server

    with start_server(tmp_path_factory.mktemp("mlflow"), port=0, timeout_s=120.0) as server:
        yield server.url


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Endpoint URL of a real S3-compatible server on loopback for the session: moto's server
    mode (``python -m moto.server``) on 127.0.0.1 and a free port, stopped at the end.

    Clients need credentials and a region; any values work with moto, e.g.
    ``monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")``.
    """
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path_factory.mktemp("s3") / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60.0
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"moto server on {url} did not start (exit {proc.poll()}): "
                        + log.read_text(errors="replace")[-2000:]
                    ) from None
                time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
