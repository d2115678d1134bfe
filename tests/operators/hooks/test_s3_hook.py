"""S3 credentials from an Airflow connection (``storage.aws_conn_id``, trainforge.hooks.s3).

Connections are given the way Airflow reads them from the environment
(``AIRFLOW_CONN_<ID>`` as JSON). Unit tests parse connections and check the spec's rules; the
integration tests use the real S3-compatible server on loopback (moto's server mode) with every
ambient ``AWS_*`` variable cleared, so the connection is the only source of credentials: data
preparation reads S3 with them, and a real local job's rank lists a bucket with them while
``request.json``, ``job.json``, the logs and the rendered requests never hold them.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from trainforge.engines.base import JobIdentity, JobState
from trainforge.hooks.s3 import S3ConnectionError, S3Hook, read_connection, spec_child_env
from trainforge.pipeline.loader import load_spec
from trainforge.pipeline.spec import PipelineSpec

REPO = Path(__file__).resolve().parents[3]
KEY_ID = "AKIATRAINFORGETEST01"
SECRET = "s3cr3t-value-never-written-" + "x" * 12
TOKEN = "session-token-never-written"


def aws_conn(**fields: Any) -> str:
    return json.dumps({"conn_type": "aws", **fields})


@pytest.fixture
def no_ambient_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials, region or endpoint from the environment, ~/.aws or an instance role."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def tiny_spec(**updates: Any) -> dict[str, Any]:
    raw = load_spec(REPO / "tests" / "e2e" / "tiny_shakespeare.yaml").model_dump(mode="json")
    for path, value in updates.items():  # "a.b.c": value sets raw["a"]["b"]["c"]
        node = raw
        *parents, leaf = path.split(".")
        for part in parents:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return raw


# -- reading the connection ---------------------------------------------------------------------


def test_connection_fields_map_like_the_amazon_provider(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_MY_S3", aws_conn(
        login=KEY_ID, password=SECRET,
        extra={"region_name": "eu-west-3", "aws_session_token": TOKEN,
               "endpoint_url": "http://general:9000",
               "service_config": {"s3": {"endpoint_url": "http://s3-only:9000/"}}}))
    creds = read_connection("my_s3")
    assert (creds.access_key_id, creds.secret_access_key, creds.session_token) == (
        KEY_ID, SECRET, TOKEN)
    assert creds.region_name == "eu-west-3"
    assert creds.endpoint_url == "http://s3-only:9000"  # service_config.s3 wins, like the provider
    assert creds.session_kwargs() == {"aws_access_key_id": KEY_ID, "aws_secret_access_key": SECRET,
                                      "aws_session_token": TOKEN, "region_name": "eu-west-3"}
    assert SECRET not in repr(creds) and TOKEN not in repr(creds) and KEY_ID not in repr(creds)
    hook = S3Hook("my_s3")
    assert hook.env() == {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET,
                          "AWS_SESSION_TOKEN": TOKEN, "AWS_SECURITY_TOKEN": TOKEN,
                          "AWS_DEFAULT_REGION": "eu-west-3",
                          "AWS_ENDPOINT_URL_S3": "http://s3-only:9000"}
    assert hook.plain_env() == {"AWS_DEFAULT_REGION": "eu-west-3",
                                "AWS_ENDPOINT_URL_S3": "http://s3-only:9000"}


def test_keys_without_a_token_mask_an_inherited_token(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_MY_S3", aws_conn(login=KEY_ID, password=SECRET))
    env = S3Hook("my_s3").child_env({"AWS_SESSION_TOKEN": "someone-elses", "PATH": "/bin"})
    assert env["AWS_SESSION_TOKEN"] == "" and env["AWS_SECURITY_TOKEN"] == ""
    assert env["AWS_ACCESS_KEY_ID"] == KEY_ID and env["PATH"] == "/bin"


def test_an_empty_connection_leaves_credentials_to_the_standard_chain(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_REGION_ONLY", aws_conn(extra={"region_name": "us-west-2"}))
    hook = S3Hook("region_only")
    assert hook.secret_env() == {}
    assert hook.env() == {"AWS_DEFAULT_REGION": "us-west-2"}
    assert hook.session().region_name == "us-west-2"


@pytest.mark.parametrize(("conn", "fragment"), [
    (None, "'missing_conn' (storage.aws_conn_id) could not be read"),
    (json.dumps({"conn_type": "http", "host": "s3"}), "has type 'http'; expected 'aws'"),
    (aws_conn(login=KEY_ID), "has an access key id but no secret access key"),
    (aws_conn(password=SECRET), "has a secret access key but no access key id"),
    (aws_conn(extra={"aws_session_token": TOKEN}), "but no access key id and secret"),
    (aws_conn(login=KEY_ID, password=SECRET, extra={"role_arn": "arn:aws:iam::1:role/x"}),
     "sets role_arn in its extra"),
    (aws_conn(login=KEY_ID, password=SECRET, extra={"endpoint_url": "minio:9000"}),
     "endpoint_url must be http(s)://host[:port] (got 'minio:9000')"),
])
def test_unusable_connections_are_clear_errors_without_secrets(monkeypatch, conn, fragment):
    monkeypatch.delenv("AIRFLOW_CONN_MISSING_CONN", raising=False)
    if conn is not None:
        monkeypatch.setenv("AIRFLOW_CONN_MISSING_CONN", conn)
    with pytest.raises(S3ConnectionError, match=fragment.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")) as info:
        S3Hook("missing_conn").env()
    assert "missing_conn" in str(info.value)
    assert SECRET not in str(info.value) and TOKEN not in str(info.value)


def test_spec_and_connection_endpoints_must_agree(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_MY_S3", aws_conn(
        login=KEY_ID, password=SECRET, extra={"endpoint_url": "http://conn-host:9000"}))
    assert S3Hook("my_s3", "http://CONN-host:9000/").endpoint_url == "http://CONN-host:9000"
    assert S3Hook("my_s3").endpoint_url == "http://conn-host:9000"
    with pytest.raises(S3ConnectionError, match="'http://spec-host:9000' and the endpoint_url "
                                                "'http://conn-host:9000' of Airflow connection "
                                                "'my_s3' differ"):
        _ = S3Hook("my_s3", "http://spec-host:9000").endpoint_url


# -- the spec ----------------------------------------------------------------------------------


def _k8s(**updates: Any) -> dict[str, Any]:
    return tiny_spec(**{"training.engine": "kubernetes", "training.resources.image": "img:1",
                        "data.output_uri": "s3://bkt/datasets",
                        "training.checkpoint.uri": "s3://bkt/ckpt", **updates})


@pytest.mark.parametrize(("raw", "loc", "fragment"), [
    (_k8s(**{"storage.aws_conn_id": "my_s3"}), ("storage", "aws_conn_id"),
     "cannot be used with the kubernetes engine: its secrets would be written into the job "
     "manifest (got 'my_s3'; expected null: give the ranks credentials through "
     "training.kubernetes.secret_env"),
    (tiny_spec(**{"training.engine": "slurm", "storage.aws_conn_id": "my_s3"}),
     ("storage", "aws_conn_id"), "cannot be used with the slurm engine"),
    (tiny_spec(**{"storage.endpoint_url": "http://a:9000",
                  "data.s3_endpoint_url": "http://b:9000"}),
     ("storage", "endpoint_url"), "storage.endpoint_url and data.s3_endpoint_url name different "
     "S3 endpoints (got 'http://a:9000' and 'http://b:9000'"),
    (tiny_spec(**{"storage.aws_conn_id": "aws://AKIA:secret@"}), ("storage", "aws_conn_id"),
     "not an Airflow connection id (got 'aws://AKIA:secret@'"),
    (tiny_spec(**{"storage.endpoint_url": "http://user:pw@minio:9000"}),
     ("storage", "endpoint_url"), "without user or password"),
    (tiny_spec(**{"storage.aws_access_key_id": KEY_ID}), ("storage", "aws_access_key_id"),
     "Extra inputs are not permitted"),
])
def test_spec_rules(raw, loc, fragment):
    with pytest.raises(ValidationError) as info:
        PipelineSpec.model_validate(raw)
    errors = [e for e in info.value.errors() if e["loc"] == loc]
    assert errors and fragment in errors[0]["msg"], info.value.errors()


def test_one_endpoint_in_either_field_or_the_same_in_both():
    both = PipelineSpec.model_validate(tiny_spec(**{
        "storage.endpoint_url": "http://minio:9000", "data.s3_endpoint_url": "http://minio:9000/"}))
    assert both.s3_endpoint_url == "http://minio:9000"
    old = PipelineSpec.model_validate(tiny_spec(**{"data.s3_endpoint_url": "http://m:9000"}))
    assert old.s3_endpoint_url == "http://m:9000"
    k8s = PipelineSpec.model_validate(_k8s(**{"storage.endpoint_url": "http://m:9000"}))
    from trainforge.jobconfig import build_training_job

    job = build_training_job(k8s, "s3://bkt/datasets/d", "s3://bkt/ckpt/x",
                             JobIdentity("d", "r", "train", 1), {"MLFLOW_RUN_ID": "r"})
    assert job.env["AWS_ENDPOINT_URL_S3"] == "http://m:9000" and job.secret_env == {}


# -- against the S3-compatible server ----------------------------------------------------------


@pytest.fixture
def conn_bucket(s3_server: str, monkeypatch: pytest.MonkeyPatch, no_ambient_aws) -> str:
    """A bucket on the moto server, reachable only through AIRFLOW_CONN_MY_S3."""
    monkeypatch.setenv("AIRFLOW_CONN_MY_S3", aws_conn(
        login=KEY_ID, password=SECRET,
        extra={"region_name": "us-east-1", "endpoint_url": s3_server}))
    bucket = f"conn-{uuid.uuid4().hex[:12]}"
    S3Hook("my_s3").client().create_bucket(Bucket=bucket)
    return bucket


@pytest.mark.integration
def test_data_prep_reads_s3_with_the_connection_only(conn_bucket, s3_server, tmp_path,
                                                     monkeypatch):
    from trainforge.data import SourceAccessError, prepare_dataset
    from trainforge.tasks.prepare_data import connection_s3_client, prepare_settings
    from tests.operators.data.conftest import make_text

    client = S3Hook("my_s3").client()
    for i in range(6):
        client.put_object(Bucket=conn_bucket, Key=f"corpus/doc-{i}.txt",
                          Body=(make_text(i) + "\n").encode())
    monkeypatch.setenv("TRAINFORGE_HOME", str(tmp_path))
    raw = tiny_spec(**{"data.sources": [f"s3://{conn_bucket}/corpus/*.txt"],
                       "data.output_uri": str(tmp_path / "datasets"),
                       "data.tokenizer.vocab_size": 300, "data.encode_workers": 1})
    without = PipelineSpec.model_validate(raw)
    # No ambient credentials: boto3's standard chain finds none, and says so.
    with pytest.raises(SourceAccessError, match="NoCredentialsError"):
        prepare_dataset(prepare_settings(without), tmp_path / "datasets",
                        s3_client=connection_s3_client(without))
    spec = PipelineSpec.model_validate({**raw, "storage": {"aws_conn_id": "my_s3"}})
    prepared = prepare_dataset(prepare_settings(spec), tmp_path / "datasets",
                               s3_client=connection_s3_client(spec))
    assert prepared.manifest["stats"]["documents_in"] == 6
    assert all(s["uri"].startswith(f"s3://{conn_bucket}/corpus/")
               for s in prepared.manifest["sources"])
    assert "AWS_ACCESS_KEY_ID" not in os.environ  # the hook never writes os.environ


@pytest.mark.integration
def test_missing_connection_fails_data_prep_naming_it(no_ambient_aws, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from trainforge.tasks.prepare_data import connection_s3_client

    monkeypatch.delenv("AIRFLOW_CONN_NOPE", raising=False)
    spec = PipelineSpec.model_validate(tiny_spec(**{"storage.aws_conn_id": "nope"}))
    with pytest.raises(AirflowFailException, match="Airflow connection 'nope'"):
        connection_s3_client(spec)


PROBE = '''"""Rank workload of the test: list the bucket with whatever credentials the rank has."""
import json, os
import boto3
env = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL_S3",
                                       "AWS_DEFAULT_REGION")}
keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=%r).get("Contents", [])]
if os.environ.get("RANK", "0") == "0":
    with open(os.environ["TRAINFORGE_RESULT_FILE"], "w") as fh:
        json.dump({"status": "success", "exit_code": 0, "keys": keys,
                   "key_id_matches": env["AWS_ACCESS_KEY_ID"] == %r,
                   "endpoint": env["AWS_ENDPOINT_URL_S3"], "region": env["AWS_DEFAULT_REGION"]}, fh)
print("probe listed", len(keys), "objects", flush=True)
'''


def _train_job(spec: PipelineSpec, tmp_path: Path):
    from trainforge.jobconfig import build_training_job
    from trainforge.tasks.train import TrainOperator

    op = TrainOperator(task_id="train", spec=spec.model_dump(mode="json"))
    plain, secret = op.rank_s3_env(spec)
    return build_training_job(
        spec, str(tmp_path / "ds"), str(tmp_path / "ckpt"),
        JobIdentity("tiny_shakespeare", f"manual__{uuid.uuid4().hex[:8]}", "train", 1),
        {"MLFLOW_RUN_ID": "r1", **plain}, secret_env=secret,
        secret_env_source=f"Airflow connection {spec.storage.aws_conn_id}")


@pytest.mark.integration
def test_local_job_ranks_get_the_keys_but_no_file_or_render_holds_them(conn_bucket, s3_server,
                                                                        tmp_path):
    import dataclasses

    from trainforge.engines.local.backend import LocalBackend

    S3Hook("my_s3").client().put_object(Bucket=conn_bucket, Key="marker", Body=b"1")
    spec = PipelineSpec.model_validate(tiny_spec(**{"storage.aws_conn_id": "my_s3",
                                                    "training.resources.processes_per_node": 1}))
    job = _train_job(spec, tmp_path)
    assert job.secret_env["AWS_SECRET_ACCESS_KEY"] == SECRET
    assert job.env["AWS_ENDPOINT_URL_S3"] == s3_server and SECRET not in json.dumps(job.env)
    assert SECRET not in repr(job)
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "s3_probe.py").write_text(PROBE % (conn_bucket, KEY_ID))
    job = dataclasses.replace(job, module="s3_probe")  # in place of trainforge.trainer.train
    backend = LocalBackend(tmp_path / "runs", cwd=str(tmp_path / "probe"))
    rendered = backend.render(job)
    assert rendered["env"]["AWS_SECRET_ACCESS_KEY"] == "<from Airflow connection my_s3>"
    assert rendered["secret_env"] == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                      "AWS_SECURITY_TOKEN", "AWS_SESSION_TOKEN"]
    handle = backend.submit(job)
    deadline = time.monotonic() + 90
    while not (status := backend.status(handle)).state.terminal:
        assert time.monotonic() < deadline, "the local job did not end in 90 s"
        time.sleep(0.3)
    job_dir = Path(handle["job_dir"])
    assert status.state is JobState.SUCCEEDED, (job_dir / "job.log").read_text()
    assert status.result["keys"] == ["marker"] and status.result["key_id_matches"]
    assert (status.result["endpoint"], status.result["region"]) == (s3_server, "us-east-1")
    written = {p.name: p.read_bytes() for p in job_dir.rglob("*") if p.is_file()}
    assert {"request.json", "job.json", "job.log"} <= set(written)
    for name, data in written.items():
        assert SECRET.encode() not in data and KEY_ID.encode() not in data, name
    request = json.loads(written["request.json"])
    assert request["env"]["AWS_ACCESS_KEY_ID"] == "<from Airflow connection my_s3>"


def test_ray_request_shows_placeholders_and_only_the_api_call_has_the_keys(monkeypatch, tmp_path):
    from trainforge.engines.ray.backend import RayBackend

    monkeypatch.setenv("AIRFLOW_CONN_MY_S3", aws_conn(
        login=KEY_ID, password=SECRET, extra={"endpoint_url": "http://minio:9000"}))
    spec = PipelineSpec.model_validate(tiny_spec(**{"storage.aws_conn_id": "my_s3",
                                                    "training.engine": "ray"}))
    job = _train_job(spec, tmp_path)
    backend = RayBackend("http://127.0.0.1:1")
    rendered = backend.render(job)
    env_vars = rendered["submit_job"]["runtime_env"]["env_vars"]
    assert env_vars["AWS_SECRET_ACCESS_KEY"] == "<from Airflow connection my_s3>"
    assert env_vars["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
    assert SECRET not in json.dumps(rendered)

    class RecordingJobApi:  # the two calls submit() makes, recorded
        submitted: dict[str, Any] = {}

        def get_job_info(self, sid: str) -> Any:
            raise RuntimeError(f"Job {sid} does not exist")

        def submit_job(self, **kwargs: Any) -> str:
            self.submitted.update(kwargs)
            return kwargs["submission_id"]

    api = RecordingJobApi()
    backend._client_obj = api
    backend.submit(job)
    sent = api.submitted["runtime_env"]["env_vars"]
    assert sent["AWS_SECRET_ACCESS_KEY"] == SECRET and sent["AWS_ACCESS_KEY_ID"] == KEY_ID
    assert SECRET not in json.dumps(backend.render(job))  # render() stays clean


def test_validator_and_exporter_children_get_the_connection_env(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_MY_S3", aws_conn(login=KEY_ID, password=SECRET))
    spec = PipelineSpec.model_validate(tiny_spec(**{"storage.aws_conn_id": "my_s3",
                                                    "storage.endpoint_url": "http://m:9000"}))
    env = spec_child_env(spec, {"PATH": "/usr/bin"})
    assert env["AWS_SECRET_ACCESS_KEY"] == SECRET and env["AWS_ENDPOINT_URL_S3"] == "http://m:9000"
    assert env["PATH"] == "/usr/bin"
    assert spec_child_env(PipelineSpec.model_validate(tiny_spec())) is None  # inherit as before


def test_kubernetes_with_a_connection_fails_the_train_task():
    from airflow.sdk.exceptions import AirflowFailException

    from trainforge.tasks.train import TrainOperator

    # A spec validated without the connection, the connection added afterwards (model_copy
    # skips validation): the train task still refuses to inline the keys.
    spec = PipelineSpec.model_validate(_k8s())
    spec = spec.model_copy(update={"storage": spec.storage.model_copy(
        update={"aws_conn_id": "my_s3"})})
    op = TrainOperator(task_id="train", spec=spec.model_dump(mode="json"))
    with pytest.raises(AirflowFailException, match="cannot be used with the kubernetes engine"):
        op.rank_s3_env(spec)
