"""Issue 27, item 7: ``trainforge[postgres]`` is all a venv needs for a PostgreSQL metadata database.

A fresh Python 3.11 venv gets the wheel's closure with the ``postgres`` extra
(:func:`~tests.packaging.dependencies.place_dependencies`, placed from this environment at the
lock) and ``pip install --no-index <wheel>[postgres]``; then ``airflow db migrate`` against the
session's PostgreSQL server on loopback (``postgres_server``, tests/conftest.py), in a database of
its own, and ``airflow db check`` plus Airflow's tables prove it worked.

Without the extra it fails, checked here and not only argued: the wheel's closure without extras
holds neither psycopg2 nor asyncpg (Airflow core requires no PostgreSQL driver), so after
uninstalling the two drivers from the same venv ``airflow db check`` exits non-zero naming the
missing module.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.packaging.dependencies import place_dependencies
from tests.packaging.layout import REPO
from tests.packaging.test_wheel import Venv

pytestmark = [pytest.mark.wheel, pytest.mark.airflow, pytest.mark.integration]

DATABASE = "airflow_wheel"
#: The extra's distributions (pyproject.toml, [project.optional-dependencies] postgres).
DRIVERS = ("psycopg2-binary", "asyncpg")


def _create_database(server: dict) -> str:
    import psycopg2

    admin = psycopg2.connect(host=server["host"], port=server["port"], user=server["user"],
                             password=server["password"], dbname="postgres", connect_timeout=10)
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {DATABASE}")
        cur.execute(f"CREATE DATABASE {DATABASE}")
    admin.close()
    return (f"postgresql+psycopg2://{server['user']}:{server['password']}"
            f"@{server['host']}:{server['port']}/{DATABASE}")


def _tables(server: dict) -> set[str]:
    import psycopg2

    with psycopg2.connect(host=server["host"], port=server["port"], user=server["user"],
                          password=server["password"], dbname=DATABASE) as conn, \
            conn.cursor() as cur:
        cur.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {row[0] for row in cur.fetchall()}


def test_db_migrate_on_postgres_with_the_postgres_extra(tmp_path: Path, built_wheel: Path,
                                                       postgres_server: dict):
    venv = Venv(tmp_path)
    subprocess.run(["python3.11", "-m", "venv", str(venv.root / "venv")], check=True, timeout=300)
    venv.work.mkdir()
    placed = place_dependencies(built_wheel, venv.root / "venv", extras=frozenset({"postgres"}))
    assert set(DRIVERS) <= set(placed), placed
    installed = venv.run("pip", "install", "--no-index", "-c", str(REPO / "requirements.lock"),
                         f"{built_wheel}[postgres]", timeout_s=600)
    assert "Installing collected packages: trainforge\n" in installed.stdout, installed.stdout
    venv.run("pip", "check")

    settings = {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": _create_database(postgres_server)}
    venv.run("airflow", "db", "migrate", timeout_s=600, **settings)
    venv.run("airflow", "db", "check", timeout_s=120, **settings)
    tables = _tables(postgres_server)
    assert {"alembic_version", "dag", "dag_run", "task_instance"} <= tables, sorted(tables)

    # The same venv without the extra's drivers: Airflow cannot reach the database.
    venv.run("pip", "uninstall", "--yes", *DRIVERS)
    without = venv.run("airflow", "db", "check", timeout_s=120, check=False, **settings)
    assert without.returncode != 0
    assert "No module named 'psycopg2'" in without.stdout + without.stderr, (
        without.stdout[-3000:] + without.stderr[-3000:])
