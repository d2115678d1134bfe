"""What each engine tells the ledger: queue wait and image pull, in seconds or why not."""

from __future__ import annotations

import pytest

from trainforge.engines.kubernetes.status import phases as kubernetes_phases
from trainforge.engines.local.backend import local_phases
from trainforge.engines.ray.backend import RAY_PHASES
from trainforge.engines.slurm.backend import slurm_phases


def test_kubernetes_counts_admission_to_pod_start_and_pod_start_to_trainer_start():
    pod = {"status": {"startTime": "2026-01-01T00:00:10Z", "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"startedAt": "2026-01-01T00:00:42Z",
                                                     "exitCode": 0}}}]}}
    submitted = 1767225600.0  # 2026-01-01T00:00:00Z
    found = kubernetes_phases({"submitted_at_epoch_s": submitted}, pod, "trainer")
    assert found == {"queue_wait": pytest.approx(10.0), "image_pull": pytest.approx(32.0)}
    gone = kubernetes_phases({"submitted_at_epoch_s": submitted}, None, "trainer")
    assert all(v.startswith("unknown: rank 0's pod is gone") for v in gone.values())


def test_local_slurm_and_ray_say_what_they_cannot_know():
    local = local_phases({"submitted_at_epoch_s": 100.0}, {"started_at": 100.4})
    assert local["queue_wait"] == pytest.approx(0.4)
    assert local["image_pull"].startswith("not applicable:")
    assert slurm_phases({"submitted_at_epoch_s": 100.0}, 160.0)["queue_wait"] == 60.0
    assert slurm_phases({"submitted_at_epoch_s": 100.0}, None)["queue_wait"].startswith("unknown:")
    assert all(v.startswith("unknown:") for v in RAY_PHASES.values())
