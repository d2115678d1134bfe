"""`make stack-up` on a host with Docker and compose only: a fresh clone's files, no venv, no
Python on PATH. The demo corpus is fetched in a container of the Airflow image (with this
machine's pip configuration), and an image that is not there is named at once, before compose
makes anything. (The stack fixture itself is brought up this way: tests/docker/conftest.py.)"""

from __future__ import annotations

import os
import time

import pytest

from tests.docker.stack import (VERSION, Stack, docker_only_checkout, docker_only_path,
                                example_env)

pytestmark = [pytest.mark.docker, pytest.mark.integration]


@pytest.fixture
def fresh_clone(tmp_path, docker_engine, stack_images):
    """A docker-only copy of the checkout with docker/.env filled in (local stand-in images)."""
    checkout = docker_only_checkout(tmp_path / "clone")
    stack = Stack(docker_engine, tmp_path, tmp_path, tmp_path, checkout)  # its own project name
    env = example_env(tmp_path).read_text()
    env += "".join(f"{name}=trainforge-local/{image}:{VERSION}\n" for name, image in
                   (("POSTGRES_IMAGE", "postgres"), ("REDIS_IMAGE", "redis"), ("S3_IMAGE", "s3")))
    stack.env_file.write_text(env)  # as the user filled in .env.example
    return stack, docker_only_path(tmp_path / "bin")


def test_the_corpus_is_fetched_in_a_container_without_a_venv(fresh_clone):
    from trainforge.data.corpus import verify_corpus

    stack, path = fresh_clone
    assert not (stack.checkout / ".venv").exists()
    done = stack.make("stack-data", path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "no venv here: fetching the corpus in a container of trainforge-airflow" in done.stderr
    corpus = stack.checkout / ".trainforge" / "corpus" / "shakespeare"
    assert verify_corpus(corpus) == [], done.stdout + done.stderr
    assert corpus.stat().st_uid == os.getuid()  # written as the user who ran make, not the image's


def test_an_image_that_is_not_built_is_named_before_anything_starts(fresh_clone):
    stack, path = fresh_clone
    env = stack.checkout / "docker" / ".env"
    env.write_text(env.read_text() + "AIRFLOW_IMAGE=trainforge-airflow:0.0.0-never-built\n")
    started = time.monotonic()
    done = stack.make("stack-up", path)
    assert done.returncode != 0
    assert ("stack: image trainforge-airflow:0.0.0-never-built (AIRFLOW_IMAGE) is not built: "
            f"make images builds the tags of this checkout's version ({VERSION}); set "
            "AIRFLOW_IMAGE in docker/.env to one, or build it" in done.stderr), done.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert stack.containers(all_states=True) == []  # compose made nothing
    assert not (stack.checkout / ".trainforge").exists()  # nor was the corpus fetched
