// The Training, run and Cluster pages: fetch the page's JSON, draw it, poll while it changes.
// DOM built with createElement/textContent only (values from MLflow or specs are never HTML).
(function () {
"use strict";
const { lineChart, barChart, fmtNum } = window.TFCharts;
const POLL_MS = { training: 5000, run: 3000, cluster: 5000 };

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v; else el.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
  }
  return el;
}
const state = (s) => h("span", { class: `state state-${s || "none"}` }, s || "none");
const ext = (href, text) => href ? h("a", { href, target: "_blank", rel: "noopener noreferrer" }, text) : null;
const top = (href, text) => h("a", { href, target: "_top" }, text);
const num = (v) => (v === null || v === undefined || v === "" ? null : Number(v));
const when = (iso) => iso ? new Date(iso).toLocaleString() : "–";
function dur(s) {
  if (s === null || s === undefined) return "–";
  s = Math.round(s);
  if (s < 90) return `${s} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}
const kv = (pairs) => h("dl", { class: "kv" }, pairs.filter(Boolean).flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
// A long run id (manual__2026-12-01T09:30:00.123456+00:00) stays on one line, cut with an
// ellipsis; the whole id is the link's title.
const runLink = (dag, run) => h("a", { class: "run-id", title: run, href: `run?dag_id=${encodeURIComponent(dag)}&run_id=${encodeURIComponent(run)}` }, run);

function banner(data) {
  if (!data.partial) return null;
  return h("div", { class: "banner", id: "partial" }, h("strong", {}, "Partial answer: "),
    data.unavailable.map((u) => h("div", {}, `${u.source} did not answer — ${u.error}`)),
    h("div", { class: "muted" }, "Everything else on this page is current."));
}

function progressBar(p) {
  if (!p || !p.step) return h("span", { class: "muted" }, "no step logged yet");
  const pct = p.max_steps ? Math.min(100, (100 * p.step) / p.max_steps) : 0;
  const bar = h("div", { class: "bar", role: "progressbar", "aria-valuenow": pct.toFixed(0) }, h("span", {}));
  bar.firstChild.setAttribute("data-pct", pct.toFixed(1));
  bar.firstChild.style.width = `${pct}%`; // CSSOM, allowed by style-src 'self'
  return h("div", {}, bar, h("div", { class: "muted" },
    `step ${p.step}${p.max_steps ? " / " + p.max_steps : ""} · ETA ${dur(p.eta_s)} · ` +
    `${fmtNum(p.tokens_per_s)} tokens/s · loss ${fmtNum(p.loss)}`));
}

// -- Training -------------------------------------------------------------------------------
// The last 30 days come from api/training/totals, fetched after the page's first answer: the
// newest figures by DAG id, "…" until they arrive.
let totals = {};
function totalsText(t30) {
  if (!t30) return "…";
  return `${t30.runs} tracked runs · ${t30.gpu_hours === 0 ? "no GPU-h (CPU jobs)" : fmtNum(t30.gpu_hours) + " GPU-h"} · cost ${fmtNum(t30.cost)} · ` +
    `${fmtNum(t30.energy_kwh)} kWh · goodput ${t30.goodput_percent === null ? "not recorded" : fmtNum(t30.goodput_percent) + " %"}`;
}
async function loadTotals(app) {
  const resp = await fetch("api/training/totals", { credentials: "same-origin", headers: { Accept: "application/json" } });
  const data = resp.ok ? await resp.json() : { last_30d: {}, partial: true };
  totals = data.last_30d;
  app.querySelectorAll(".last-30d").forEach((el) => {
    el.textContent = totals[el.dataset.dag] ? totalsText(totals[el.dataset.dag]) : (data.partial ? "not available (MLflow)" : "…");
  });
}
function renderTraining(data) {
  const nowTraining = data.pipelines.flatMap((p) => p.runs.filter((r) => r.training).map((r) => [p, r]));
  const cards = data.pipelines.map((p) => {
    const trend = (p.trend || []).filter((t) => t.value !== null);
    const t30 = totals[p.dag_id];
    return h("section", { class: "card pipeline", "data-dag": p.dag_id },
      h("h3", {}, top(`/dags/${encodeURIComponent(p.dag_id)}`, p.dag_id), p.paused ? h("span", { class: "muted" }, " (paused)") : null),
      p.description ? h("div", { class: "muted" }, p.description) : null,
      kv([
        ["Champion", p.champion ? h("span", {}, ext(p.champion.url, `${p.champion.model} v${p.champion.version}`),
          ` · ${p.champion.metric || "metric"} ${fmtNum(p.champion.value)}`) : h("span", { class: "muted" }, p.model ? "no champion yet" : "no registered model yet")],
        [`Last ${data.window_days} days`, h("span", { class: "last-30d", "data-dag": p.dag_id }, totalsText(t30))],
      ]),
      trend.length ? h("div", {}, h("div", { class: "muted" }, `${trend[0].metric} by registered version`),
        lineChart(`trend-${p.dag_id}`, [{ name: "value", points: trend.map((t) => [Number(t.version), t.value]) }],
          { height: 120, xLabel: "version" })) : null,
      h("table", { class: "runs" }, h("thead", {}, h("tr", {}, h("th", {}, "Run"), h("th", {}, "State"), h("th", {}, "Started"), h("th", {}, "Progress"))),
        h("tbody", {}, p.runs.length ? p.runs.map((r) => h("tr", { "data-run": r.run_id },
          h("td", {}, runLink(p.dag_id, r.run_id)), h("td", {}, state(r.state)), h("td", {}, when(r.start_date)),
          h("td", {}, r.training ? progressBar(r.progress) : (r.progress && r.progress.loss !== null ? `loss ${fmtNum(r.progress.loss)}` : ""))))
          : h("tr", {}, h("td", { colspan: 4, class: "muted" }, "no runs yet")))));
  });
  return [h("h1", {}, "Training"), banner(data),
    h("h2", {}, "Training now"),
    nowTraining.length ? h("div", { id: "training-now" }, nowTraining.map(([p, r]) => h("div", { class: "card" },
      h("h3", {}, `${p.dag_id} · `, runLink(p.dag_id, r.run_id)), progressBar(r.progress))))
      : h("p", { class: "muted", id: "training-now" }, "Nothing is training."),
    h("h2", {}, "Pipelines"),
    data.pipelines.length ? h("div", { class: "grid" }, cards) : h("p", { class: "muted" }, "No trainforge pipeline you may read."),
    h("p", { class: "muted" }, `Updated ${when(data.generated_at)}`)];
}

// -- run view -------------------------------------------------------------------------------
function goodputChart(f, tasks) {
  if (f && (f.goodput_percent !== null || Object.keys(f.badput_s).length)) {
    const rows = Object.entries(f.badput_s).sort((a, b) => b[1] - a[1]).map(([k, v]) => ({ label: k.replace(/_/g, " "), value: v }));
    return h("div", {}, h("div", { class: "muted" }, `Goodput ${fmtNum(f.goodput_percent)} % · seconds lost by cause`),
      barChart("goodput-chart", rows, { unit: "s", label: "badput by bucket" }));
  }
  const byTask = {};
  tasks.filter((t) => t.duration).forEach((t) => { byTask[t.task_id] = (byTask[t.task_id] || 0) + t.duration; });
  const rows = Object.entries(byTask).map(([k, v]) => ({ label: k, value: v, cls: k.startsWith("train") ? "seg-productive" : "seg-alt" }));
  return h("div", {}, h("div", { class: "muted" }, "The goodput ledger was not recorded for this run: wall time by task (all tries)"),
    barChart("goodput-chart", rows, { unit: "s", label: "time by task" }));
}

function renderRun(d) {
  const r = d.run, f = d.figures, g = d.gate;
  const loss = d.curves.train_loss.map((p) => [p.step, p.value]);
  const lr = d.curves.learning_rate.map((p) => [p.step, p.value]);
  const maxSteps = d.progress && d.progress.max_steps;
  const marks = d.disruptions.filter((x) => x.kind === "task try").map((x) => ({ x: null, label: x.reason }));
  const energy = f && Object.keys(f.energy_source).length ? Object.entries(f.energy_source).map(([k, v]) => `${k}: ${v}`).join(", ") : "–";
  const partial = (status) => status === "partial" ? " · partial" : "";
  const reasons = f && f.energy_reason ? Object.entries(f.energy_reason).map(([k, v]) => `${k}: ${v}`).join("; ") : "";
  return [
    h("h1", {}, `${r.dag_id} · ${r.run_id}`), banner(d),
    kv([["State", state(r.state)], ["Started", when(r.start_date)], ["Ended", when(r.end_date)],
      ["Progress", d.training ? progressBar(d.progress) : (d.progress && d.progress.step ? `step ${d.progress.step}${maxSteps ? " / " + maxSteps : ""}` : "–")],
      ["Links", h("span", {}, d.mlflow ? ext(d.mlflow.url, "MLflow run") : "no MLflow run", " · ",
        d.model.url ? ext(d.model.url, `${d.model.name} v${d.model.version}`) : h("span", { class: "muted" }, "no model version"), " · ",
        top(`/dags/${encodeURIComponent(r.dag_id)}/runs/${encodeURIComponent(r.run_id)}`, "DAG run in Airflow"))]]),
    h("div", { class: "grid" },
      h("section", { class: "card" }, h("h3", {}, "Training loss"), lineChart("loss-chart", [{ name: "train_loss", points: loss }], { xMax: maxSteps, marks })),
      h("section", { class: "card" }, h("h3", {}, "Learning rate"), lineChart("lr-chart", [{ name: "learning_rate", points: lr }], { xMax: maxSteps })),
      h("section", { class: "card", id: "goodput" }, h("h3", {}, "Goodput"), goodputChart(f, d.tasks)),
      h("section", { class: "card", id: "usage" }, h("h3", {}, "GPU-hours, cost, energy"), f ? kv([
        ["GPU-hours", f.gpu_hours === 0 ? "0 (no GPU allocated: a CPU job)" :
          `${fmtNum(f.gpu_hours)}${f.gpu_hours_productive !== null ? ` (productive ${fmtNum(f.gpu_hours_productive)})` : ""}`],
        ["Cost", `${fmtNum(f.cost)}${partial(f.cost_status)}`],
        ["Energy", `${fmtNum(f.energy_kwh)} kWh${partial(f.energy_status)} (${energy})`],
        reasons ? ["Energy not measured", reasons] : null,
        ["Wall time", dur(f.wall_s)], f.tps !== null ? ["Tokens/s", fmtNum(f.tps)] : null,
        f.mfu_pct !== null ? ["MFU", `${fmtNum(f.mfu_pct)} %`] : null,
        f.disruptions !== null ? ["Disruptions", `${f.disruptions} (recovery mean ${dur(f.recovery_mean_s)}, max ${dur(f.recovery_max_s)})`] : null,
      ]) : h("p", { class: "muted" }, "not available"))),
    h("h2", {}, "Eval gate"),
    h("section", { class: "card", id: "gate" }, g ? kv([["Decision", state(g.decision)], ["Reason", g.reason || "–"],
      ["Metric", `${g.metric || "–"}: candidate ${fmtNum(num(g.candidate_value))} vs champion ${g.champion_version ? "v" + g.champion_version + " " + fmtNum(num(g.champion_value)) : "none"}`],
      ["Aliases set", d.model.aliases.length ? d.model.aliases.join(", ") : "none"], ["Champion after", g.champion_after ? `v${g.champion_after}` : "–"]])
      : h("p", { class: "muted" }, "no gate decision yet")),
    h("h2", {}, "Checkpoints"),
    h("table", { id: "checkpoints" }, h("thead", {}, h("tr", {}, ["Checkpoint", "Step", "Valid", "val_loss", "Chosen", "Quarantine"].map((x) => h("th", {}, x)))),
      h("tbody", {}, d.checkpoints.length ? d.checkpoints.map((c) => h("tr", {}, h("td", {}, c.checkpoint.split("/").slice(-1)[0] || c.checkpoint),
        h("td", {}, c.step), h("td", {}, state(c.ok ? "pass" : "fail")), h("td", {}, fmtNum(c.val_loss)), h("td", {}, c.chosen ? "✓" : ""),
        h("td", {}, c.quarantined_to ? `${c.quarantine_reasons.join("; ")} → ${c.quarantined_to}` : (c.failed.length ? c.failed.join(", ") : "–"))))
        : h("tr", {}, h("td", { colspan: 6, class: "muted" }, "not validated yet")))),
    h("h2", {}, "Restarts and disruptions"),
    h("ul", { id: "disruptions" }, d.disruptions.length ? d.disruptions.map((x) => h("li", {}, x.kind === "task try" ?
      `${when(x.at)} · ${x.task_id} try ${x.try_number} ${x.state}${x.reason ? ": " + x.reason : ""}` : x.reason)) : h("li", { class: "muted" }, "none")),
    h("h2", {}, "Tasks"),
    h("table", { id: "tasks" }, h("thead", {}, h("tr", {}, ["Task", "Try", "State", "Started", "Duration", "Log"].map((x) => h("th", {}, x)))),
      h("tbody", {}, d.tasks.map((t) => h("tr", {}, h("td", {}, t.task_id), h("td", {}, t.try_number), h("td", {}, state(t.state)),
        h("td", {}, when(t.start_date)), h("td", {}, dur(t.duration)), h("td", {}, top(t.log_url, "log")))))),
  ];
}

// -- Cluster --------------------------------------------------------------------------------
function renderCluster(d) {
  return [h("h1", {}, "Cluster"), banner(d),
    h("p", { class: "muted" }, d.engines.length ? `Engines in use: ${d.engines.join(", ")}` : "No training job is live."),
    h("table", { id: "jobs" }, h("thead", {}, h("tr", {}, ["Engine", "Job", "State", "Reason / message", "DAG run", "Task", "Since"].map((x) => h("th", {}, x)))),
      h("tbody", {}, d.jobs.map((j) => h("tr", {}, h("td", {}, j.engine || "–"), h("td", {}, j.job || "–"),
        h("td", {}, state(j.state || j.task_state)), h("td", {}, j.message || ""), h("td", {}, runLink(j.dag_id, j.run_id)),
        h("td", {}, `${j.task_id} (try ${j.try_number})`), h("td", {}, when(j.started)))))),
    h("p", { class: "muted" }, `Updated ${new Date().toLocaleString()}`)];
}

// -- plumbing -------------------------------------------------------------------------------
function followAirflowTheme() {
  let root;
  try { root = window.parent !== window ? window.parent.document.documentElement : null; } catch (e) { root = null; }
  if (!root) return;
  const apply = () => {
    const dark = root.classList.contains("dark") || root.dataset.theme === "dark" || root.style.colorScheme === "dark";
    const light = root.classList.contains("light") || root.dataset.theme === "light" || root.style.colorScheme === "light";
    document.documentElement.classList.toggle("dark", dark);
    document.documentElement.classList.toggle("light", light && !dark);
  };
  apply();
  new MutationObserver(apply).observe(root, { attributes: true, attributeFilter: ["class", "data-theme", "style"] });
}

async function load(page, app) {
  const q = new URLSearchParams(location.search);
  const url = page === "run" ? `api/runs/${encodeURIComponent(q.get("dag_id"))}/${encodeURIComponent(q.get("run_id"))}` : `api/${page}`;
  const resp = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
  if (!resp.ok) {
    const body = await resp.json().catch(() => ({}));
    app.replaceChildren(h("h1", {}, document.title), h("p", { class: "banner", id: "error" }, `HTTP ${resp.status}: ${body.detail || resp.statusText}`));
    return false;
  }
  const data = await resp.json();
  const render = { training: renderTraining, run: renderRun, cluster: renderCluster }[page];
  app.replaceChildren(...render(data).filter(Boolean));
  app.dataset.loaded = String(Date.now());
  if (page === "training") loadTotals(app).catch(() => {});
  return page !== "run" || data.training || ["running", "queued"].includes(data.run.state);
}

function main() {
  followAirflowTheme();
  const app = document.getElementById("app");
  const page = app.dataset.page;
  const tick = async () => {
    let again = true;
    try { again = await load(page, app); } catch (e) {
      app.replaceChildren(h("h1", {}, document.title), h("p", { class: "banner", id: "error" }, `Could not load: ${e}`));
    }
    if (again) setTimeout(tick, POLL_MS[page]);
  };
  tick();
}
document.addEventListener("DOMContentLoaded", main);
})();
