"""The preflight of the stack's Airflow containers (trainforge.preflight): shared keys compared
with the fingerprints airflow-init recorded, never printed; unknown AIRFLOW__ variables named
with the closest real one. Against Airflow's own configuration, in this process."""

from __future__ import annotations

import json

import pytest

from trainforge import preflight

KEYS = {"AIRFLOW__API_AUTH__JWT_SECRET": "jwt-secret-of-the-deployment-0123456789",
        "AIRFLOW__CORE__FERNET_KEY": "Zm9vYmFyYmF6cXV4Zm9vYmFyYmF6cXV4Zm9vYmFyYmE=",
        "AIRFLOW__API__SECRET_KEY": "api-secret-key-of-the-deployment-abcdef"}


@pytest.fixture
def deployment(monkeypatch, tmp_path):
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "preflight" / "fingerprints.json"
    preflight.record(path)
    return path


def test_the_recorded_file_holds_fingerprints_never_values(deployment):
    recorded = json.loads(deployment.read_text())
    assert sorted(recorded) == sorted(KEYS)
    assert not any(value in deployment.read_text() for value in KEYS.values())
    # equal values of two keys still differ: the option is part of the fingerprint
    assert preflight.fingerprint("core", "fernet_key", "x") != preflight.fingerprint("api", "secret_key", "x")


def test_the_same_keys_pass_and_another_jwt_secret_is_refused_naming_the_key(
        deployment, monkeypatch, tmp_path, capsys):
    assert preflight.check(deployment, "scheduler") == 0
    monkeypatch.setenv("AIRFLOW__API_AUTH__JWT_SECRET", "another-secret-0123456789abcdef")
    refused = tmp_path / "refused"
    assert preflight.check(deployment, "scheduler", refused) == preflight.REFUSED_EXIT
    err = capsys.readouterr().err
    line = ("trainforge preflight: not starting scheduler: AIRFLOW__API_AUTH__JWT_SECRET differs: "
            "every Airflow container of this deployment must share the value airflow-init "
            "recorded (docker/.env)")
    assert line in err.splitlines() and refused.read_text() == line + "\n"
    assert "another-secret" not in err and KEYS["AIRFLOW__API_AUTH__JWT_SECRET"] not in err


def test_a_key_given_through_cmd_is_the_same_key(deployment, monkeypatch):
    # Airflow keeps a command's output as it is (a trailing newline would be another key)
    monkeypatch.delenv("AIRFLOW__CORE__FERNET_KEY")
    monkeypatch.setenv("AIRFLOW__CORE__FERNET_KEY_CMD", f"printf %s {KEYS['AIRFLOW__CORE__FERNET_KEY']}")
    assert preflight.check(deployment) == 0


def test_no_recorded_file_compares_nothing_and_a_broken_one_refuses(tmp_path, monkeypatch):
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    assert preflight.check(tmp_path / "none.json") == 0
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert preflight.check(broken, "triggerer", tmp_path / "r") == preflight.REFUSED_EXIT
    assert "not starting triggerer: cannot read" in (tmp_path / "r").read_text()


def test_unknown_variables_are_named_with_the_closest_real_one():
    from airflow.configuration import conf

    known = preflight._known_options(conf)
    environ = {
        "AIRFLOW__SECRETS__JWT_SECRET": "x",          # a known option of another section
        "AIRFLOW__SCHEDULR__PARSING_PROCESSES": "2",  # a misspelt section
        "AIRFLOW__CORE__FERNET_KY": "x",              # a misspelt option
        "AIRFLOW__CORE__FERNET_KEY_CMD": "echo x",    # a source suffix: fine
        "AIRFLOW__API_AUTH__JWT_SECRET": "x",         # fine
        "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__MASTER_NAME": "m",  # free-form section
        "AIRFLOW__TRAINFORGE__PIPELINES": "/specs",   # ours
        "AIRFLOW_HOME": "/opt/airflow",               # not of the form
    }
    assert preflight.unknown_variables(environ, known) == [
        "AIRFLOW__CORE__FERNET_KY: Airflow has no option fernet_ky in [core], the variable is "
        "ignored; did you mean AIRFLOW__CORE__FERNET_KEY?",
        "AIRFLOW__SCHEDULR__PARSING_PROCESSES: Airflow has no section [schedulr], the variable "
        "is ignored; [dag_processor] parsing_processes is AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES",
        "AIRFLOW__SECRETS__JWT_SECRET: Airflow has no option jwt_secret in [secrets], the "
        "variable is ignored; [api_auth] jwt_secret is AIRFLOW__API_AUTH__JWT_SECRET",
    ]


@pytest.mark.parametrize("content", ["[]", "null", "42", '{"AIRFLOW__CORE__FERNET_KEY": 1}'])
def test_a_fingerprint_file_of_another_shape_refuses(tmp_path, monkeypatch, content, capsys):
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "f.json"
    path.write_text(content)
    # the refusal file's folder is missing: said, and still refused
    assert preflight.check(path, "worker", tmp_path / "no" / "refused") == preflight.REFUSED_EXIT
    err = capsys.readouterr().err
    assert "not starting worker: cannot read" in err and "not an object of fingerprints" in err
    assert "cannot write" in err and "Traceback" not in err


def test_the_health_check_sees_a_key_recorded_again_by_another_container(
        deployment, monkeypatch, capsys):
    """airflow-init re-run with a new JWT secret (one service recreated alone): a container
    still running with the old value turns unhealthy, naming the key and never the value."""
    assert preflight.health(deployment) == 0
    monkeypatch.setenv("AIRFLOW__API_AUTH__JWT_SECRET", "the-new-secret-0123456789abcdef")
    preflight.record(deployment)  # what the re-run airflow-init did
    monkeypatch.setenv("AIRFLOW__API_AUTH__JWT_SECRET", KEYS["AIRFLOW__API_AUTH__JWT_SECRET"])
    capsys.readouterr()
    assert preflight.health(deployment) == 1
    out = capsys.readouterr().out
    assert out.startswith("trainforge preflight: AIRFLOW__API_AUTH__JWT_SECRET differs from the "
                          "value airflow-init recorded last"), out
    assert "up -d` with no service named" in out and len(out.splitlines()) == 1
    assert "the-new-secret" not in out and KEYS["AIRFLOW__API_AUTH__JWT_SECRET"] not in out


def test_the_health_check_compares_only_keys_set_in_the_environment(deployment, monkeypatch):
    monkeypatch.delenv("AIRFLOW__API__SECRET_KEY")  # e.g. given by a _CMD the check cannot run
    assert preflight.health(deployment) == 0
    assert preflight.health(deployment.with_name("absent.json")) == 0
    deployment.write_text("{not json")
    assert preflight.health(deployment) == 1
