"""mlflow_setup's stores: argument checks (pure), and a real server on a real PostgreSQL backend
store with artifacts proxied into a real S3-compatible server (moto), both on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from trainforge.mlflow_setup import ServerConfig, StoreArgumentError, StoreUnreachableError, build_server_command
from trainforge.mlflow_setup.home import PID_FILE_NAME
from trainforge.mlflow_setup.processes import free_port
from trainforge.mlflow_setup.server import server_env, wait_healthy
from trainforge.mlflow_setup.stores import check_stores, redact

REPO_ROOT = Path(__file__).parents[2]

BAD_ARGUMENTS = [
    ("mysql://u:topsecret@db/mlflow", "/a", "--backend-store-uri 'mysql://u:***@db/mlflow': expected "
                                            "sqlite:///ABSOLUTE/PATH.db or postgresql://"),
    ("http://db:5432/x", "/a", "--backend-store-uri 'http://db:5432/x': expected sqlite:///"),
    ("sqlite://", "/a", "--backend-store-uri 'sqlite://': expected sqlite:///ABSOLUTE/PATH.db"),
    ("postgresql://u:topsecret@db:5432", "/a", "--backend-store-uri 'postgresql://u:***@db:5432': expected "
                                               "a database name"),
    ("sqlite:////a/m.db", "gs://bucket/x", "--artifacts-destination 'gs://bucket/x': expected a local folder, "
                                           "file:///ABSOLUTE/PATH or s3://BUCKET[/PREFIX]"),
    ("sqlite:////a/m.db", "s3://Bad_Bucket/x", "--artifacts-destination 's3://Bad_Bucket/x': expected "
                                               "s3://BUCKET[/PREFIX]"),
]


@pytest.mark.parametrize(("store", "artifacts", "fragment"), BAD_ARGUMENTS,
                         ids=[f"{r[0]}|{r[1]}" for r in BAD_ARGUMENTS])
def test_bad_store_arguments_are_named_without_the_password(store, artifacts, fragment):
    with pytest.raises(StoreArgumentError) as info:
        check_stores(store, artifacts)
    assert fragment in str(info.value)
    assert "topsecret" not in str(info.value)


def test_redact_hides_only_the_password():
    assert redact("postgresql://mlflow:p%40ss@db.internal:5432/mlflow?sslmode=require") == \
        "postgresql://mlflow:***@db.internal:5432/mlflow?sslmode=require"
    assert redact("postgresql://mlflow@/mlflow?host=/run/pg") == "postgresql://mlflow@/mlflow?host=/run/pg"
    assert redact("sqlite:////var/mlflow.db") == "sqlite:////var/mlflow.db"


def test_a_password_goes_through_the_environment_not_the_command_line(tmp_path):
    uri = "postgresql://mlflow:topsecret@db:5432/mlflow"
    config = ServerConfig(home=tmp_path, backend_store_uri=uri, artifacts_destination="s3://bucket/mlflow")
    argv = build_server_command(config, 5000)
    assert "--backend-store-uri" not in argv and not any("topsecret" in a for a in argv)
    assert argv[argv.index("--artifacts-destination") + 1] == "s3://bucket/mlflow"
    assert server_env({}, config)["MLFLOW_BACKEND_STORE_URI"] == \
        "postgresql+psycopg2://mlflow:topsecret@db:5432/mlflow"  # the installed driver
    no_password = ServerConfig(home=tmp_path, backend_store_uri="postgresql://mlflow@db/mlflow")
    assert "postgresql+psycopg2://mlflow@db/mlflow" in build_server_command(no_password, 5000)
    assert "MLFLOW_BACKEND_STORE_URI" not in server_env({}, no_password)


def test_serve_exits_2_on_a_bad_scheme(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainforge.mlflow_setup", "serve", "--home", str(tmp_path),
                           "--backend-store-uri", "mysql://u:topsecret@db/m"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert proc.returncode == 2
    assert "error: --backend-store-uri 'mysql://u:***@db/m': expected sqlite:///" in proc.stderr
    assert "topsecret" not in proc.stderr + proc.stdout


@pytest.mark.integration
def test_unreachable_database_is_named_without_the_password(postgres_server, tmp_path):
    closed = free_port("127.0.0.1")
    uri = f"postgresql://mlflow:topsecret@127.0.0.1:{closed}/mlflow"
    with pytest.raises(StoreUnreachableError) as info:
        check_stores(uri, str(tmp_path))
    message = str(info.value)
    assert message.startswith(f"cannot reach postgresql://mlflow:***@127.0.0.1:{closed}/mlflow: ")
    assert "topsecret" not in message
    wrong = postgres_server["uri"].replace(postgres_server["password"], "not-the-password")
    with pytest.raises(StoreUnreachableError, match="password authentication failed") as info:
        check_stores(wrong, str(tmp_path))
    assert "not-the-password" not in str(info.value)
    missing_db = postgres_server["uri"].rsplit("/", 1)[0] + "/no_such_db"
    with pytest.raises(StoreUnreachableError, match='database "no_such_db" does not exist'):
        check_stores(missing_db, str(tmp_path))


@pytest.mark.integration
def test_missing_artifact_bucket_is_named(s3_server, monkeypatch, tmp_path):
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "MLFLOW_S3_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(StoreUnreachableError, match=rf"cannot reach s3://no-such-bucket-x/mlflow: HeadBucket "
                                                    rf"no-such-bucket-x at {s3_server}: 404"):
        check_stores(f"sqlite:///{tmp_path}/m.db", "s3://no-such-bucket-x/mlflow")


@pytest.fixture
def postgres_s3_server(postgres_server, s3_server, tmp_path):
    """``python -m trainforge.mlflow_setup serve`` on a PostgreSQL backend store with S3 artifacts, as a
    container would run it; yields (url, bucket, home, pid) and stops its process group."""
    import boto3

    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "MLFLOW_S3_ENDPOINT_URL": s3_server}
    env.pop("AWS_ENDPOINT_URL", None)
    bucket = f"mlflow-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    port = free_port("127.0.0.1")
    home = tmp_path / "home"
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainforge.mlflow_setup", "serve", "--home", str(home), "--port", str(port),
         "--backend-store-uri", postgres_server["uri"], "--artifacts-destination", f"s3://{bucket}/mlflow"],
        env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, timeout_s=180, process=proc, log_file=tmp_path / "serve.log")
        except Exception:
            print((tmp_path / "serve.log").read_text(errors="replace")[-4000:])
            raise
        yield url, bucket, home, proc.pid, s3_server
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.mark.integration
def test_server_on_postgres_with_s3_artifacts(postgres_s3_server, postgres_server, monkeypatch):
    import boto3
    import psycopg2
    from mlflow import MlflowClient

    from trainforge.mlflow_setup import bootstrap

    url, bucket, home, pid, s3_endpoint = postgres_s3_server
    # The password is in no command line of the server's processes.
    for member in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        assert postgres_server["password"] not in " ".join(member.cmdline())
    client = MlflowClient(url)
    experiment_id = client.create_experiment(f"pg-s3-{uuid.uuid4().hex[:6]}")
    run = client.create_run(experiment_id)
    client.log_metric(run.info.run_id, "loss", 1.5, step=1)
    client.log_dict(run.info.run_id, {"hello": "s3"}, "reports/hello.json")
    client.set_terminated(run.info.run_id)
    # The artifact went through the server into the bucket.
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="mlflow/").get("Contents", [])]
    wanted = [k for k in keys if k.endswith(f"{run.info.run_id}/artifacts/reports/hello.json")]
    assert len(wanted) == 1, keys
    assert json.loads(s3.get_object(Bucket=bucket, Key=wanted[0])["Body"].read()) == {"hello": "s3"}
    # Runs and metrics live in PostgreSQL.
    with psycopg2.connect(postgres_server["uri"]) as conn, conn.cursor() as cur:
        cur.execute("SELECT value FROM metrics WHERE run_uuid = %s AND key = 'loss'", (run.info.run_id,))
        assert cur.fetchall() == [(1.5,)]
    # Bootstrap is idempotent against this server.
    first = bootstrap(url, ["pg-boot"], [("pg-model", "made by bootstrap")])
    second = bootstrap(url, ["pg-boot"], [("pg-model", "made by bootstrap")])
    assert first.experiment_ids == second.experiment_ids
    assert len(client.search_registered_models("name='pg-model'")) == 1
    assert client.get_registered_model("pg-model").description == "made by bootstrap"


@pytest.mark.integration
def test_start_on_postgres_keeps_the_password_out_of_files_and_is_idempotent(postgres_server, tmp_path):
    from trainforge.mlflow_setup import start_server

    uri = postgres_server["uri"]
    with start_server(tmp_path, port=0, backend_store_uri=uri, timeout_s=180) as server:
        record = (tmp_path / PID_FILE_NAME).read_text()
        assert postgres_server["password"] not in record
        assert json.loads(record)["backend_store_uri"] == redact(uri)
        assert postgres_server["password"] not in (tmp_path / "mlflow-server.log").read_text(errors="replace")
        again = start_server(tmp_path, port=0, backend_store_uri=uri, timeout_s=60)
        assert again.reused and again.url == server.url
