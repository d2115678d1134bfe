"""The worker's health check against a real API server: its task token must be accepted.

The compose stack's worker runs ``python -m trainforge.preflight token`` as part of its health
check; here the session's ``airflow standalone`` is the API server and this process, with the
same configuration (or another JWT secret), stands in for the worker container.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.airflow, pytest.mark.integration]


def _token_check(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainforge.preflight", "token"], env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_token_signed_with_the_shared_secret_is_accepted(airflow_standalone):
    env = dict(airflow_standalone.env, AIRFLOW__CORE__EXECUTION_API_SERVER_URL=(
        f"{airflow_standalone.url}/execution/"))
    done = _token_check(env)
    assert done.returncode == 0, done.stderr


def test_another_jwt_secret_is_refused_naming_the_key(airflow_standalone):
    env = dict(airflow_standalone.env, AIRFLOW__API_AUTH__JWT_SECRET="not-the-deployment-secret")
    done = _token_check(env)
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    assert "refused this container's task token (HTTP 403" in line, done.stderr
    assert "Invalid auth token" in line and "jwt_secret" in line, line


def test_an_unreachable_api_server_is_said(airflow_standalone):
    from faultlib import free_port

    env = dict(airflow_standalone.env, AIRFLOW__CORE__EXECUTION_API_SERVER_URL=(
        f"http://127.0.0.1:{free_port()}/execution/"))
    done = _token_check(env)
    assert done.returncode == 1
    assert "cannot reach the Execution API at http://127.0.0.1:" in done.stderr, done.stderr


@pytest.mark.parametrize("path", ["/wrongpath/", "/api/v2/"])
def test_a_url_that_is_not_the_execution_api_is_said(airflow_standalone, path):
    env = dict(airflow_standalone.env, AIRFLOW__CORE__EXECUTION_API_SERVER_URL=(
        f"{airflow_standalone.url}{path}"))
    done = _token_check(env)
    assert done.returncode == 1, done.stderr
    assert "is not Airflow's Execution API" in done.stderr, done.stderr
