"""The pages in a real browser: Debian's Chromium driven by Playwright, against
``airflow standalone`` (tests/faults/faultlib.py) running the tiny fault-suite pipeline, with
the plugin loaded from the installed package's entry point.

One test walks what a user does: sign in on Airflow's login page, open Training from the
navigation, trigger a run and see it appear, watch its loss curve gain points while it
trains, look at the Cluster page, and after the run ends find the checkpoints, the gate's
decision and the goodput chart in the run view. Screenshots of each page are saved under the
test's ``artifacts`` folder (its path is printed). Another test asks the same API server for
the plugin's health route, as a monitoring check would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.faults.faultlib import AirflowStandalone, make_home, wait_for

pytestmark = pytest.mark.airflow

SPEC = Path(__file__).resolve().parents[2] / "faults" / "fault_tiny.yaml"
DAG = "fault_tiny"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-gpu",
                 "--disable-component-update", "--disable-sync"]
MAX_STEPS = 4000  # half a minute or more of training: time to watch the curve grow and the job run
DOCS_SCREENSHOTS = "TRAINFORGE_UI_DOCS"  # a folder: screenshots are copied there as ui-*.png


@pytest.fixture(scope="module")
def standalone(tmp_path_factory, shakespeare_corpus, mlflow_server):
    home = make_home(tmp_path_factory.mktemp("ui-home"), shakespeare_corpus)
    server = AirflowStandalone(home, mlflow_server, [SPEC])
    try:
        server.start()
        yield server
    finally:
        try:
            server.end_leftovers()
        finally:
            server.stop()


@pytest.fixture
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"needs Debian's Chromium at {CHROMIUM} "
                    "(sudo apt-get install -y --no-install-recommends chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def test_the_health_route_answers_through_the_api_server(standalone):
    """``GET /trainforge/api/health`` through Airflow's own API server: the plugin's JSON with
    the installed trainforge and the Airflow version Airflow's REST API reports, behind auth."""
    url = f"{standalone.url}/trainforge/api/health"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=30)
    assert refused.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {standalone.token()}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["content-type"] == "application/json"
        health = json.loads(response.read())
    assert health == {"status": "ok", "trainforge": metadata.version("trainforge"),
                      "airflow": standalone.api("GET", "/api/v2/version")["version"]}


def _shot(page, folder: Path, name: str) -> None:
    page.screenshot(path=str(folder / f"ui-{name}.png"), full_page=True)
    docs = os.environ.get(DOCS_SCREENSHOTS)
    if docs:
        shutil.copy(folder / f"ui-{name}.png", Path(docs) / f"ui-{name}.png")


def test_training_cluster_and_run_view_in_the_airflow_ui(standalone, browser, tmp_path):
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    print(f"screenshots in {artifacts}")
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

    # sign in through Airflow's own login page
    page.goto(f"{standalone.url}/auth/login")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", "admin")
    page.click("button[type=submit]")
    page.wait_for_url(lambda url: "/auth/login" not in url, timeout=60_000)

    # Training from Airflow's navigation: an iframe of the plugin's page
    page.goto(f"{standalone.url}/plugin/trainforge-training")
    frame = page.frame_locator("iframe")
    frame.locator("section.pipeline[data-dag='fault_tiny']").wait_for(timeout=60_000)
    run_id = standalone.trigger(DAG, {"max_steps": MAX_STEPS})
    frame.locator(f"tr[data-run='{run_id}']").wait_for(timeout=60_000)
    frame.locator("#training-now .bar").wait_for(timeout=300_000)  # its job is training
    _shot(page, artifacts, "training")

    # the run view while it trains: the loss curve gains points
    run_q = quote(run_id, safe="")
    page.goto(f"{standalone.url}/trainforge/run?dag_id={DAG}&run_id={run_q}")
    loss = page.locator("#loss-chart")

    def points() -> int:
        return int(loss.get_attribute("data-points") or 0) if loss.count() else 0

    first = wait_for("the loss curve's first points", points, 120, 1.0)
    later = wait_for("the loss curve to gain points", lambda: points() > first and points(),
                     120, 1.0)
    assert standalone.run_state(DAG, run_id) == "running", "the curve must grow while training"
    assert later > first

    # The job trains from its submit on, while the task process (starved by the training
    # ranks on a small machine) may still be on its way to deferring: until it defers, Airflow
    # holds no handle and the row says so. Once deferred, the row shows the job's engine.
    def cluster_row() -> str:
        page.goto(f"{standalone.url}/plugin/trainforge-cluster")
        job = page.frame_locator("iframe").locator("#jobs tbody tr", has_text=run_id)
        job.wait_for(timeout=60_000)
        text = job.inner_text()
        assert "local" in text or "no job handle in Airflow" in text, text
        return text if "local" in text else ""

    row = wait_for("the cluster page to show the deferred task's job", cluster_row, 120, 2.0)
    assert row.startswith("local") and "running" in row, row  # the engine's answer: it runs
    _shot(page, artifacts, "cluster")

    # after the run: checkpoints, gate decision, goodput chart
    state = wait_for("the run to end", lambda: standalone.run_state(DAG, run_id)
                     in ("success", "failed") and standalone.run_state(DAG, run_id), 600, 3)
    assert state == "success", standalone.tail()
    page.goto(f"{standalone.url}/dags/{DAG}/runs/{run_q}/plugin/trainforge-run")
    view = page.frame_locator("iframe")
    view.locator("#checkpoints tbody tr td", has_text="step").first.wait_for(timeout=60_000)
    assert view.locator("#checkpoints tbody tr").count() >= 1
    # The session's MLflow server is shared: an earlier test's champion of this model may be
    # better, so either decision is right; the card must say which, why, and against what.
    gate = view.locator("#gate").inner_text()
    decision = re.search(r"Decision\s+(pass|fail)\s+Reason\s+(\S.*)", gate)
    assert decision, gate
    assert "val_bits_per_byte: candidate" in gate and "Champion after" in gate, gate
    assert int(view.locator("#goodput-chart").get_attribute("data-bars")) >= 1
    assert int(view.locator("#loss-chart").get_attribute("data-points")) >= later
    page.goto(f"{standalone.url}/trainforge/run?dag_id={DAG}&run_id={run_q}")
    page.locator("#checkpoints tbody tr").first.wait_for(timeout=60_000)
    _shot(page, artifacts, "run")
    assert not [e for e in errors if "Content Security Policy" in e], errors
