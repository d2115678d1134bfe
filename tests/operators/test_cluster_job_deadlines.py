"""Deadlines across deferral: the wait gets only the time left of the earlier limit."""

from __future__ import annotations

import pytest

from trainforge.cluster_wait import DEADLINE_MARGIN_S, wait_deadline

NOW = 1_000_000.0


@pytest.mark.parametrize(
    "submitted, run_timeout, started, exec_timeout, want_reason, want_left",
    [
        # fresh job, no task timeout: the whole run timeout
        (NOW, 3600, NOW, None, "run_timeout", 3600),
        # an adopted job submitted 20 min ago by an earlier try keeps its own clock
        (NOW - 1200, 3600, NOW, None, "run_timeout", 2400),
        # the task started 50 min ago (first start), its 1 h execution timeout is nearer
        (NOW, 7200, NOW - 3000, 3600, "execution_timeout", 600),
        # run timeout nearer than the execution timeout
        (NOW - 3500, 3600, NOW, 7200, "run_timeout", 100),
        # both already past: at least 1 s, never negative
        (NOW - 9000, 3600, NOW - 9000, 3600, "run_timeout", 1),
        # unknown submission time: the clock starts now
        (None, 600, None, None, "run_timeout", 600),
    ],
)
def test_wait_deadline(submitted, run_timeout, started, exec_timeout, want_reason, want_left):
    deadline, reason, left = wait_deadline(
        now_s=NOW, job_submitted_s=submitted, run_timeout_s=run_timeout,
        task_started_s=started, execution_timeout_s=exec_timeout, poll_interval_s=5,
    )
    assert (reason, left) == (want_reason, want_left)
    # The trigger's own deadline fires one poll and a margin before Airflow's timeout.
    assert deadline == max(NOW, NOW + want_left - 5 - DEADLINE_MARGIN_S) or want_left == 1
    assert deadline >= NOW
