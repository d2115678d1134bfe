// Small SVG charts drawn with DOM calls only (no innerHTML, no inline style: the page's
// Content-Security-Policy allows neither). Colours come from the theme's CSS classes.
(function () {
"use strict";
const SVG_NS = "http://www.w3.org/2000/svg";

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

function fmtNum(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (Number.isInteger(v) && Math.abs(v) < 1e6) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  if (a >= 100) return v.toFixed(0);
  if (a >= 1) return v.toFixed(2);
  return v.toPrecision(3);
}

// series: [{name, points: [[x, y], ...]}]; marks: [{x, label}] drawn as red ticks (restarts).
function lineChart(id, series, opts) {
  const o = Object.assign({ width: 440, height: 200, xLabel: "step", yLabel: "" }, opts || {});
  const svg = svgEl("svg", { class: "chart", id, viewBox: `0 0 ${o.width} ${o.height}`,
                             role: "img", "aria-label": o.yLabel || id });
  const all = series.flatMap((s) => s.points);
  if (!all.length) {
    // HTML text, not SVG text: the viewBox scales with the card, so SVG text grew with it.
    const empty = document.createElement("p");
    empty.className = "muted chart-empty";
    empty.id = id;
    empty.dataset.points = "0";
    empty.textContent = "no points yet";
    return empty;
  }
  svg.dataset.points = String(all.length);
  const pad = { l: 56, r: 24, t: 10, b: 28 };
  const w = o.width - pad.l - pad.r, h = o.height - pad.t - pad.b;
  svg.appendChild(svgEl("line", { class: "axis", x1: pad.l, y1: pad.t + h, x2: pad.l + w, y2: pad.t + h }));
  svg.appendChild(svgEl("line", { class: "axis", x1: pad.l, y1: pad.t, x2: pad.l, y2: pad.t + h }));
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]).filter((y) => Number.isFinite(y));
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (o.xMax !== undefined && o.xMax > x1) x1 = o.xMax;
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 += Math.abs(y0) * 0.05 || 1; y0 -= Math.abs(y0) * 0.05 || 1; }
  const sx = (x) => pad.l + ((x - x0) / (x1 - x0)) * w;
  const sy = (y) => pad.t + h - ((y - y0) / (y1 - y0)) * h;
  for (let i = 0; i <= 4; i++) {
    const yv = y0 + ((y1 - y0) * i) / 4;
    svg.appendChild(svgEl("text", { x: 4, y: sy(yv) + 4 }, fmtNum(yv)));
    const xv = x0 + ((x1 - x0) * i) / 4;
    svg.appendChild(svgEl("text", { x: sx(xv) - 10, y: o.height - 8 }, fmtNum(Math.round(xv))));
  }
  (o.marks || []).forEach((m) => {
    if (m.x === null || m.x === undefined) return;
    const line = svgEl("line", { class: "tick-bad", x1: sx(m.x), x2: sx(m.x), y1: pad.t, y2: pad.t + h });
    line.appendChild(svgEl("title", {}, m.label));
    svg.appendChild(line);
  });
  series.forEach((s, i) => {
    const pts = s.points.filter((p) => Number.isFinite(p[1]));
    const d = pts.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
    svg.appendChild(svgEl("path", { class: `series${i % 2}`, d }));
    if (pts.length <= 40) pts.forEach((p) => {
      const c = svgEl("circle", { class: "point", cx: sx(p[0]), cy: sy(p[1]), r: 2.5 });
      c.appendChild(svgEl("title", {}, `${o.xLabel} ${p[0]}: ${fmtNum(p[1])}`));
      svg.appendChild(c);
    });
  });
  return svg;
}

// One horizontal bar per row: rows [{label, value, cls}]; values in the same unit.
function barChart(id, rows, opts) {
  const o = Object.assign({ width: 440, unit: "" }, opts || {});
  const rowH = 22, labelW = 140, height = rows.length * rowH + 8;
  const svg = svgEl("svg", { class: "chart", id, viewBox: `0 0 ${o.width} ${height}`, role: "img",
                             "aria-label": o.label || id });
  svg.dataset.bars = String(rows.length);
  const max = Math.max(1e-9, ...rows.map((r) => r.value || 0));
  const w = o.width - labelW - 70;
  rows.forEach((r, i) => {
    const y = 4 + i * rowH;
    svg.appendChild(svgEl("text", { x: 0, y: y + 14 }, r.label));
    const rect = svgEl("rect", { class: r.cls || "seg", x: labelW, y: y + 3,
                                 width: Math.max(1, ((r.value || 0) / max) * w), height: rowH - 8, rx: 2 });
    rect.appendChild(svgEl("title", {}, `${r.label}: ${fmtNum(r.value)} ${o.unit}`));
    svg.appendChild(rect);
    svg.appendChild(svgEl("text", { x: labelW + w + 6, y: y + 14 }, `${fmtNum(r.value)} ${o.unit}`));
  });
  return svg;
}

window.TFCharts = { lineChart, barChart, fmtNum };
})();
