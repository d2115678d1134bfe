"""The Docker engine, the images and the compose stack of docker/, for the tests of tests/docker.

Real components only: Debian's ``dockerd`` (started here as root with ``--bridge=none
--iptables=false`` when none runs), the base image from ``debootstrap`` (docker/base-image.sh),
every image built from the committed Dockerfiles by docker/build.py, and the stack of
docker/compose.yaml with every container on the host's network, on free loopback ports. The
official postgres, redis and S3 images cannot be pulled here: the stand-ins of docker/local/
take their place (the compose file names its images by variable).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from tests.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
VERSION = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def wait_for(what: str, check, timeout_s: float, interval_s: float = 2.0, detail=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{detail()}")
        time.sleep(interval_s)


class Engine:
    """A Docker engine this test session may use: one already running, or dockerd started here."""

    def __init__(self, docker: str, daemon: subprocess.Popen | None, log: Path | None) -> None:
        self.docker = docker
        self.daemon = daemon
        self.log = log

    @staticmethod
    def missing() -> str | None:
        """Why no engine can run here (None: it can)."""
        if shutil.which("docker") is None and not Path("/usr/bin/docker").exists():
            return "no docker client"
        if Engine._answers(Engine._client()):
            return None
        if os.geteuid() != 0:
            return "no running Docker engine, and starting dockerd needs root"
        if shutil.which("dockerd") is None:
            return "no dockerd"
        return None

    @staticmethod
    def _client() -> str:
        return shutil.which("docker") or "/usr/bin/docker"

    @staticmethod
    def _answers(docker: str) -> bool:
        try:
            return subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"],
                                  capture_output=True, timeout=20).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    @classmethod
    def start(cls, tmp: Path) -> Engine:
        docker = cls._client()
        if cls._answers(docker):
            return cls(docker, None, None)
        log = tmp / "dockerd.log"
        daemon = subprocess.Popen(
            ["dockerd", "--bridge=none", "--iptables=false", "--ip-masq=false",
             "--host", "unix:///var/run/docker.sock"],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_for("dockerd to answer", lambda: daemon.poll() is not None or cls._answers(docker), 120,
                 1.0, lambda: log.read_text(errors="replace")[-3000:])
        if daemon.poll() is not None:
            raise RuntimeError(f"dockerd exited {daemon.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        return cls(docker, daemon, log)

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.terminate()
            try:
                self.daemon.wait(60)
            except subprocess.TimeoutExpired:
                self.daemon.kill()

    def run(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.docker, *args], capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)}: exit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return proc


def compose_command() -> list[str] | None:
    """``docker compose`` (v2 plugin) or ``docker-compose`` (v1), whichever is installed."""
    docker = shutil.which("docker") or "/usr/bin/docker"
    if subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    if shutil.which("docker-compose"):
        return [shutil.which("docker-compose")]
    return None


def build_images(log: Path) -> dict[str, float]:
    """Base image, then every image and the stand-ins; seconds per step (warm cache: seconds)."""
    times: dict[str, float] = {}
    start = time.monotonic()
    with log.open("a") as out:
        subprocess.run(["bash", str(ROOT / "docker" / "base-image.sh")], check=True, stdout=out,
                       stderr=subprocess.STDOUT, timeout=1800)
        times["base"] = time.monotonic() - start
        start = time.monotonic()
        proc = subprocess.run([sys.executable, str(ROOT / "docker" / "build.py"), "--local-services"],
                              stdout=out, stderr=subprocess.STDOUT, timeout=3600)
    times["images"] = time.monotonic() - start
    if proc.returncode != 0:
        raise AssertionError(f"docker/build.py failed (exit {proc.returncode}):\n{log.read_text()[-6000:]}")
    return times


def docker_only_checkout(dest: Path) -> Path:
    """The checkout's files as a fresh clone has them (tracked and not ignored: no venv, no
    docker/.env, no data) copied to ``dest``."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in names)):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def docker_only_path(shim: Path) -> str:
    """A PATH with the system's commands but no Python interpreter (``python*``, ``pip*``) and
    no venv: a host where Docker and compose are all there is."""
    shim.mkdir(parents=True, exist_ok=True)
    for folder in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        if not Path(folder).is_dir():
            continue
        for entry in Path(folder).iterdir():
            link = shim / entry.name
            if entry.name.startswith(("python", "pip")) or link.exists() or link.is_symlink():
                continue
            link.symlink_to(entry)
    return str(shim)


class Stack:
    """One compose project of docker/compose.yaml: its env file, its REST APIs, its containers."""

    def __init__(self, engine: Engine, workdir: Path, specs: Path, data: Path,
                 checkout: Path = ROOT) -> None:
        self.engine = engine
        self.checkout = checkout
        self.project = f"tfstack{secrets.token_hex(3)}"
        self.compose = compose_command()
        names = ("AIRFLOW_PORT", "MLFLOW_PORT", "POSTGRES_PORT", "REDIS_PORT", "S3_PORT",
                 "AIRFLOW_SCHEDULER_HEALTH_PORT")
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        self.password = secrets.token_urlsafe(16)
        self.aws = {"AWS_ACCESS_KEY_ID": "trainforge", "AWS_SECRET_ACCESS_KEY": secrets.token_urlsafe(16)}
        self.bucket = "trainforge"
        self.env_file = (checkout / "docker" / ".env") if checkout != ROOT else workdir / "stack.env"
        values = {
            **self.ports, **self.aws,
            "TRAINFORGE_BIND": "127.0.0.1",
            "AIRFLOW_IMAGE": f"trainforge-airflow:{VERSION}",
            "MLFLOW_IMAGE": f"trainforge-mlflow:{VERSION}",
            "POSTGRES_IMAGE": f"trainforge-local/postgres:{VERSION}",
            "REDIS_IMAGE": f"trainforge-local/redis:{VERSION}",
            "S3_IMAGE": f"trainforge-local/s3:{VERSION}",
            "POSTGRES_USER": "trainforge",
            "POSTGRES_PASSWORD": secrets.token_urlsafe(16),
            "AWS_DEFAULT_REGION": "us-east-1",
            "TRAINFORGE_BUCKET": self.bucket,
            "AIRFLOW_ADMIN_PASSWORD": self.password,
            "AIRFLOW_FERNET_KEY": __import__("base64").urlsafe_b64encode(os.urandom(32)).decode(),
            "AIRFLOW_JWT_SECRET": secrets.token_urlsafe(32),
            "AIRFLOW_API_SECRET_KEY": secrets.token_urlsafe(32),
            "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY":
                __import__("base64").urlsafe_b64encode(os.urandom(32)).decode(),
            "AIRFLOW_WORKER_CONCURRENCY": "4",
            "AIRFLOW_TASK_HEARTBEAT_TIMEOUT": "60",
            "AIRFLOW_DAG_REFRESH_INTERVAL": "10",
            "TRAINFORGE_SPECS": str(specs),
            "TRAINFORGE_DATA": str(data),
            # The store answers like one without the newer flexible checksums (as some
            # S3-compatible stores do): the stack must work with it.
            "S3_REFUSE_FLEXIBLE_CHECKSUMS": "1",
        }
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
        self.airflow = f"http://127.0.0.1:{self.ports['AIRFLOW_PORT']}"
        self.mlflow = f"http://127.0.0.1:{self.ports['MLFLOW_PORT']}"
        self.s3 = f"http://127.0.0.1:{self.ports['S3_PORT']}"
        self._token: str | None = None

    # --- compose ---------------------------------------------------------------------------
    def compose_run(self, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
        compose_file = self.checkout / "docker" / "compose.yaml"
        argv = [*self.compose, "--env-file", str(self.env_file), "-p", self.project, "-f", str(compose_file), *args]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=compose_file.parent)
        if check and proc.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)}: exit {proc.returncode}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
        return proc

    def make(self, target: str, path: str, timeout: float = 900) -> subprocess.CompletedProcess:
        """``make TARGET`` in the checkout as its user would run it, on the PATH given, for this
        stack's compose project."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TRAINFORGE_", "AIRFLOW", "VIRTUAL_ENV", "PYTHON"))}
        env.update(PATH=path, COMPOSE_PROJECT_NAME=self.project)
        return subprocess.run(["make", "--no-print-directory", target], cwd=self.checkout, env=env,
                              capture_output=True, text=True, timeout=timeout)

    def containers(self, service: str | None = None, all_states: bool = False) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        out = self.engine.run("ps", *(["-a"] if all_states else []), "-q", *filters).stdout
        return out.split()

    def logs(self, service: str, tail: int = 80) -> str:
        return self.compose_run("logs", "--no-color", "--tail", str(tail), service, check=False).stdout

    def diagnostics(self) -> str:
        parts = [self.compose_run("ps", check=False).stdout]
        for service in ("airflow-init", "airflow-api-server", "airflow-scheduler", "airflow-triggerer",
                        "airflow-worker", "airflow-dag-processor", "mlflow"):
            parts.append(f"--- {service}\n{self.logs(service, 40)}")
        return "\n".join(parts)[-12000:]

    # --- REST -------------------------------------------------------------------------------
    def _http(self, method: str, url: str, body: Any = None, headers: dict | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method, headers={**(headers or {})})
        if data is not None:
            req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read()
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw.decode(errors="replace")

    def token(self) -> str:
        if self._token is None:
            out = self._http("POST", f"{self.airflow}/auth/token",
                             {"username": "admin", "password": self.password})
            self._token = out["access_token"]
        return self._token

    def api(self, method: str, path: str, body: Any = None) -> Any:
        return self._http(method, f"{self.airflow}/api/v2{path}", body,
                          {"Authorization": f"Bearer {self.token()}"})

    def mlflow_api(self, method: str, path: str, body: Any = None) -> Any:
        if method == "GET" and body:
            from urllib.parse import urlencode
            return self._http("GET", f"{self.mlflow}/api/2.0/mlflow/{path}?{urlencode(body)}")
        return self._http(method, f"{self.mlflow}/api/2.0/mlflow/{path}", body)

    def healthy(self) -> bool:
        try:
            health = self._http("GET", f"{self.airflow}/api/v2/monitor/health")
            self._http("GET", f"{self.mlflow}/health")
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return all(health.get(part, {}).get("status") == "healthy"
                   for part in ("metadatabase", "scheduler", "triggerer", "dag_processor"))

    def has_dag(self, dag_id: str) -> bool:
        try:
            self.api("GET", f"/dags/{dag_id}")
            return True
        except urllib.error.HTTPError:
            return False

    def trigger(self, dag_id: str) -> str:
        self.api("PATCH", f"/dags/{dag_id}", {"is_paused": False})
        return self.api("POST", f"/dags/{dag_id}/dagRuns", {"logical_date": None})["dag_run_id"]

    def run_state(self, dag_id: str, run_id: str) -> str:
        from urllib.parse import quote
        return self.api("GET", f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}")["state"]

    def task(self, dag_id: str, run_id: str, task_id: str) -> dict:
        from urllib.parse import quote
        return self.api("GET", f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}")

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        from urllib.parse import quote
        out = self.api("GET", f"/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances/"
                              f"{task_id}/logs/{try_number}?full_content=true")
        if isinstance(out, dict):
            content = out.get("content", "")
            if isinstance(content, list):
                return "\n".join(c.get("event", "") if isinstance(c, dict) else str(c) for c in content)
            return str(content)
        return str(out)

    def wait_run(self, dag_id: str, run_id: str, timeout_s: float) -> str:
        return wait_for(f"DAG run {run_id} to end", lambda: (
            state if (state := self.run_state(dag_id, run_id)) in ("success", "failed") else None),
            timeout_s, 5.0, self.diagnostics)

    def s3_client(self, config=None):
        """A boto3 client of the stack's store; checksums only where S3 requires them unless
        ``config`` says otherwise (the store refuses the newer ones)."""
        import boto3
        from botocore.config import Config

        config = config or Config(request_checksum_calculation="when_required",
                                  response_checksum_validation="when_required")
        return boto3.client("s3", endpoint_url=self.s3, region_name="us-east-1", config=config,
                            aws_access_key_id=self.aws["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.aws["AWS_SECRET_ACCESS_KEY"])

    def s3_keys(self, prefix: str) -> list[str]:
        keys: list[str] = []
        for page in self.s3_client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys += [obj["Key"] for obj in page.get("Contents", [])]
        return keys


def example_env(tmp: Path) -> Path:
    """docker/.env.example with every CHANGE placeholder replaced by a generated value, as a
    user would fill it in; the file's path."""
    import base64

    lines = []
    for line in (ROOT / "docker" / ".env.example").read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.startswith("#") and value.startswith("CHANGE-"):
            key = name.endswith(("FERNET_KEY", "ENCRYPTION_KEY"))
            value = (base64.urlsafe_b64encode(os.urandom(32)).decode() if key
                     else secrets.token_urlsafe(24))
        lines.append(f"{name}{sep}{value}" if sep else line)
    path = tmp / "example.env"
    path.write_text("\n".join(lines) + "\n")
    return path


def compose_config(env_file: Path) -> subprocess.CompletedProcess:
    """``compose config -q`` of docker/compose.yaml with ``env_file``: interpolation and schema,
    no engine and no image needed (seconds)."""
    compose = compose_command()
    if compose is None:
        raise AssertionError("no docker compose / docker-compose")
    return subprocess.run([*compose, "--env-file", str(env_file), "-f", str(COMPOSE_FILE),
                           "config", "-q"], capture_output=True, text=True, timeout=120,
                          cwd=COMPOSE_FILE.parent)
