"""The wait on a Kubernetes job whose pod log endpoint fails: the job's status decides.

The emulated API (kmock) of tests/operators/engines/kubernetes/test_kubernetes_emulated_api.py:
the TrainJob is Complete and rank 0 exited 0, but the first GET of the pod's log answers
HTTP 500. The trigger rebuilds the real Kubernetes backend by name, as in the triggerer.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import kmock as kmocklib
import pytest

from tests.operators.engines.kubernetes.test_kubernetes_common import demo_job
from tests.operators.engines.kubernetes.test_kubernetes_emulated_api import (  # noqa: F401
    NAME, NS_DEMO, TRAINJOB_RANK0, TRAINJOBS, cluster, run)
from trainforge.triggers import TrainingJobTrigger


def _text(record) -> str:
    args = record.get("positional_args") or ()
    return record["event"] % args if args else record["event"]


@pytest.mark.asyncio
async def test_http_500_from_the_log_endpoint_is_a_warning_and_the_job_succeeds(cluster):
    from structlog.testing import capture_logs

    backend = cluster.backend()
    handle = await run(backend.submit, demo_job("trainjob"))
    pod = f"{NAME}-node-0-0-abcde"
    result = {"status": "success", "exit_code": 0, "message": "finished at step 40",
              "final_step": 40}
    cluster.pod(NS_DEMO, pod, TRAINJOB_RANK0, "Succeeded", "node",
                state={"terminated": {"exitCode": 0, "message": json.dumps(result)}})
    cluster.conditions(TRAINJOBS, NS_DEMO, NAME, ("Complete", "True", "JobSetCompleted", "done"))
    base = int(time.time()) * 10**9
    cluster.logs[pod] = [(base + i * 1000, f"step {i}") for i in range(3)]
    failures = iter([kmocklib.KubernetesError(status=500, reason="InternalError",
                                              message="etcdserver: request timed out")])
    # Ahead of the fixture's pod log reaction (priority 10); None falls through to it.
    log_path = re.compile(rf"^/api/v1/namespaces/{NS_DEMO}/pods/{pod}/log$")
    (cluster.server ** 10)["get", log_path] << (lambda: next(failures, None))

    trigger = TrainingJobTrigger(
        engine="kubernetes",
        backend_kwargs={"namespace": NS_DEMO, "kubeconfig": str(cluster.kubeconfig_path),
                        "request_timeout_s": 10, "poll_interval_s": 0.1},
        handle=handle, poll_interval_s=0.5, deadline_epoch_s=time.time() + 60, log_timeout_s=5)

    async def first():
        async for event in trigger.run():
            return event.payload

    with capture_logs() as records:
        event = await asyncio.wait_for(first(), timeout=30)
    assert event["status"] == "success", event["message"]
    assert event["result"] == result
    warned = [_text(r) for r in records if r.get("log_level") == "warning"]
    assert len(warned) == 1, warned
    assert handle["key"] in warned[0] and pod in warned[0] and "HTTP 500" in warned[0]
    # The next read (the drain of the finished job) passed the lines on.
    shown = [_text(r) for r in records if "step " in _text(r)]
    assert [line.split("] ", 1)[1] for line in shown] == ["step 0", "step 1", "step 2"]
