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
