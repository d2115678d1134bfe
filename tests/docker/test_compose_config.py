"""The deployment's cheap checks, before any image is built: docker/.env.example filled in as a
user would passes ``compose config``, every variable compose requires is in it, and an env file
that still lacks one is refused naming it. No engine needed: seconds, not the build's minutes."""

from __future__ import annotations

import re

import pytest

from tests.conftest import skip_without
from tests.docker.stack import COMPOSE_FILE, ROOT, compose_command, compose_config, example_env


@pytest.fixture(autouse=True)
def _compose():
    if compose_command() is None:
        skip_without("docker", "no docker compose / docker-compose")


def test_the_filled_in_example_env_passes_compose_config(tmp_path):
    proc = compose_config(example_env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_required_variable_is_in_the_example_env():
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", COMPOSE_FILE.read_text()))
    example = {line.partition("=")[0] for line in
               (ROOT / "docker" / ".env.example").read_text().splitlines()
               if "=" in line and not line.startswith("#")}
    assert required and required <= example, sorted(required - example)


def test_an_env_file_missing_a_required_key_is_refused_naming_it(tmp_path):
    env = example_env(tmp_path)
    env.write_text("".join(line + "\n" for line in env.read_text().splitlines()
                           if not line.startswith("MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY=")))
    proc = compose_config(env)
    assert proc.returncode != 0
    assert "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY must be set in docker/.env" in proc.stdout + proc.stderr


def _env_check(tmp_path, text: str | None):
    """`docker/stack-prepare.sh env` (what `make stack-up` runs first) on a copy of docker/."""
    import shutil
    import subprocess

    copy = tmp_path / "checkout"
    shutil.copytree(ROOT / "docker", copy / "docker", ignore=shutil.ignore_patterns(".env"))
    if text is not None:
        (copy / "docker" / ".env").write_text(text)
    return subprocess.run(["bash", str(copy / "docker" / "stack-prepare.sh"), "env"],
                          capture_output=True, text=True, timeout=60)


def _set(text: str, name: str, value: str) -> tuple[str, int]:
    lines = text.splitlines()
    (index,) = [i for i, line in enumerate(lines) if line.startswith(f"{name}=")]
    lines[index] = f"{name}={value}"
    return "\n".join(lines) + "\n", index + 1


def test_the_filled_in_example_env_passes_the_stack_checks(tmp_path):
    done = _env_check(tmp_path, example_env(tmp_path).read_text())
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name,value,says", [
    ("POSTGRES_PASSWORD", "CHANGE-me", "is still the placeholder of .env.example"),
    ("POSTGRES_PASSWORD", "Tr41n@forge/2026#x", "holds characters a connection URL cannot carry"),
    ("AIRFLOW_FERNET_KEY", "my-own-fernet-key-2026", "is not a Fernet key"),
    ("MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY", "c2hvcnQ=", "is not a Fernet key"),
    ("AIRFLOW_JWT_SECRET", "", "is empty"),
])
def test_a_bad_value_is_named_at_its_line_before_anything_starts(tmp_path, name, value, says):
    text, line = _set(example_env(tmp_path).read_text(), name, value)
    done = _env_check(tmp_path, text)
    assert done.returncode == 2
    assert f"docker/.env:{line}: {name} {says}" in done.stderr, done.stderr
    assert (not value) or value not in done.stderr  # values are never printed


def test_a_missing_env_file_or_key_is_said(tmp_path):
    done = _env_check(tmp_path, None)
    assert done.returncode == 2 and "docker/.env is missing: cp docker/.env.example" in done.stderr
    text = "".join(line + "\n" for line in example_env(tmp_path).read_text().splitlines()
                   if not line.startswith("AIRFLOW_JWT_SECRET="))
    (tmp_path / "second").mkdir()
    done = _env_check(tmp_path / "second", text)
    assert done.returncode == 2
    assert "docker/.env: AIRFLOW_JWT_SECRET is missing; compose requires it" in done.stderr
