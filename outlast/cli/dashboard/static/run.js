// outlast dashboard: a run's page (its timeline, chart and tables), over app.js's helpers.
"use strict";

// ---- A run -----------------------------------------------------------------------------

const R = { data: null, chart: null, x: "step", metric: null, sig: {} };

function runApi() { const b = document.body.dataset; return `/api/runs/${b.storage}/${encodeURIComponent(b.name)}`; }

async function runPage() {
  R.data = await getJSON(runApi());
  renderRun();
  return !TERMINAL.has(R.data.status);
}

function section(id, build, signature) {
  // Rebuilt only when what it shows changed: an open <details> or a loaded log stays as it is.
  let el = document.getElementById(id);
  if (el && R.sig[id] === signature) return;
  R.sig[id] = signature;
  const fresh = h("section", { id }, build());
  if (el) el.replaceWith(fresh); else main().append(fresh);
}

function renderRun() {
  const d = R.data;
  if (!document.getElementById("run-head")) main().replaceChildren();
  section("run-head", () => [h("h1", {}, d.name, " ", status(d.status)),
    h("div", { class: "facts" },
      h("span", {}, h("b", {}, "at "), d.location), h("span", {}, h("b", {}, "attempts "), d.attempts.length),
      h("span", {}, h("b", {}, "failures by kind "), counts(d.failure_counts)),
      h("span", {}, h("b", {}, "latest checkpoint "), d.checkpoints.filter((c) => c.latest).map((c) => c.dir)[0] || "none"),
      h("span", {}, h("b", {}, "last metrics "), metrics(d.last_metrics))),
    d.error ? h("div", { class: "error-box" }, d.error) : null,
    d.waiting_for ? h("div", { class: "muted" }, `waiting for ${d.waiting_for}`) : null],
    JSON.stringify([d.status, d.attempts.length, d.failure_counts, d.last_metrics, d.error, d.waiting_for]));
  section("timeline-section", () => [h("h2", {}, "Timeline"), timeline(d), legend(), goodputBar(d.goodput)],
    JSON.stringify([d.attempts, d.drains, d.checkpoints.length, d.resizes, TERMINAL.has(d.status) ? 0 : Math.floor(d.now),
                    d.goodput.parts.map((p) => p.seconds.toFixed(1))]));
  section("chart-section", () => chartSection(d), JSON.stringify(d.series.names));
  drawChart();
  section("attempts-section", () => attemptsTable(d), JSON.stringify(d.attempts));
  section("failures-section", () => failures(d), JSON.stringify(d.attempts.map((a) => a.failures.length)));
  section("hangs-section", () => hangs(d), String(d.hangs.length));
  section("checkpoints-section", () => checkpoints(d), JSON.stringify(d.checkpoints.map((c) => [c.dir, c.latest, c.memory, c.memory_at])));
  section("logs-section", () => logs(d), JSON.stringify(d.attempts.map((a) => a.ranks)));
  section("notes-section", () => notes(d), String(d.notes.length + d.skipped.length));
}

function legend() {
  const item = (color, text) => h("span", {}, h("i", { style: `background:${color}` }), text);
  return h("div", { class: "legend" }, item(OUTCOME_COLORS.finished, "attempt finished"), item(OUTCOME_COLORS.failed, "attempt failed"),
    item(OUTCOME_COLORS.resized, "resized"), item(OUTCOME_COLORS.running, "running"), item("#c62828", "▼ failure (rank, cause)"),
    item("rgba(239,108,0,.5)", "drain to its deadline"), item("#6a1b9a", "| checkpoint commit"), item("#1565c0", "● restore"),
    item("#00838f", "◆ resize (steps lost)"));
}

// The run's held time by part (outlast/storage/goodput.py, worked out by the server): one bar, as wide as the timeline.
const GOODPUT_COLORS = { productive: "#2e7d32", startup: "#90a4ae", waiting: "#fbc02d", restarts: "#c62828",
  live_recoveries: "#f48fb1",
  replayed: "#ef9a9a", checkpoint_stalls: "#6a1b9a", drains: "#ef6c00", hangs: "#4e342e", ending: "#b0bec5",
  in_flight: "#a5d6a7" };

function goodputBar(g) {
  const pct = (v) => (100 * v / g.held_s).toFixed(1) + "%";
  if (!(g.held_s > 0)) return h("div", { id: "goodput", class: "muted", "data-held": "0" }, "goodput: nothing held yet");
  const shown = g.parts.filter((p) => p.seconds > 0);
  const seg = (p) => h("span", { class: "gp-part", "data-part": p.part, "data-seconds": p.seconds,
    style: `width:${pct(p.seconds)};background:${GOODPUT_COLORS[p.part] || "#757575"}`,
    title: `${p.label}: ${p.seconds.toFixed(1)} s, ${pct(p.seconds)} of the held time` });
  const key = (p) => h("span", {}, h("i", { style: `background:${GOODPUT_COLORS[p.part] || "#757575"}` }),
    `${p.label} ${p.seconds.toFixed(1)} s (${pct(p.seconds)})`);
  return h("div", { id: "goodput", "data-held": g.held_s, "data-fraction": g.fraction },
    h("h3", {}, `Goodput ${(100 * g.fraction).toFixed(1)}%`,
      h("span", { class: "muted" }, ` of ${g.held_s.toFixed(1)} s held went into steps that stayed (${g.steps} steps` +
        (g.replayed_steps ? `, ${g.replayed_steps} trained again)` : ")") +
        (g.complete ? "" : "; a restored checkpoint is no longer in the history: its replayed steps count as productive"))),
    h("div", { class: "gp-bar" }, shown.map(seg)), h("div", { class: "legend" }, shown.map(key)));
}

function timeline(d) {
  const W = Math.max(700, Math.min(1360, (main().clientWidth || 1200) - 42)), L = 92, Rm = 16;
  const lanes = ["attempts", "failures", "drains", "checkpoints", "restores"];
  const laneH = 30, top = 8, H = top + lanes.length * laneH + 28;
  const ends = [d.created_at, d.updated_at, ...d.attempts.flatMap((a) => [a.start, a.drawn_to]),
    ...d.drains.flatMap((x) => [x.start, x.deadline ?? x.start]), ...d.checkpoints.map((c) => c.time)];
  if (!TERMINAL.has(d.status)) ends.push(d.now);
  const starts = [d.created_at, ...d.attempts.map((a) => a.start)];
  const t0 = Math.min(...starts), t1 = Math.max(t0 + 1, ...ends.filter((t) => t !== null));
  const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - Rm);
  const y = (lane) => top + lanes.indexOf(lane) * laneH;
  const svg = s("svg", { class: "timeline", id: "timeline", width: W, height: H, viewBox: `0 0 ${W} ${H}`,
                          "data-t0": t0, "data-t1": t1 });
  const axisY = top + lanes.length * laneH + 14;
  const every = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400]
    .find((step) => (t1 - t0) / step <= 8) || 86400 * Math.ceil((t1 - t0) / 86400 / 8);
  for (let t = Math.ceil(t0 / every) * every; t <= t1; t += every) {
    svg.append(s("line", { x1: x(t), x2: x(t), y1: top, y2: axisY - 10, stroke: "#f0f0f0" }));
    svg.append(s("text", { x: x(t) - 22, y: axisY + 6 }, clock(t)));
  }
  lanes.forEach((lane, i) => {
    svg.append(s("text", { x: 6, y: y(lane) + 19 }, lane));
    svg.append(s("line", { x1: L, x2: W - Rm, y1: y(lane) + laneH, y2: y(lane) + laneH, stroke: "#eee" }));
  });
  for (const dr of d.drains) {
    const end = dr.deadline ?? (d.attempts.find((a) => a.attempt === dr.attempt) || {}).drawn_to ?? dr.start;
    const x0 = x(dr.start), x1 = Math.max(x0 + 2, x(end));
    svg.append(s("rect", { x: x0, y: top, width: x1 - x0, height: lanes.length * laneH, fill: "rgba(239,108,0,.06)" }));
    svg.append(s("g", { class: "tl-drain", "data-attempt": dr.attempt, "data-x0": x0.toFixed(1), "data-x1": x1.toFixed(1) },
      s("rect", { x: x0, y: y("drains") + 5, width: x1 - x0, height: 20 }),
      s("text", { x: x0 + 3, y: y("drains") + 19 }, `${dr.reason} ${dr.node_ids.join(",")}`),
      s("title", {}, `drain of ${dr.node_ids.join(", ")} (${dr.reason}${dr.message ? ": " + dr.message : ""}) reached attempt ${dr.attempt} at ${clock(dr.start)}; ` +
        (dr.deadline ? `deadline ${clock(dr.deadline)}` : "no deadline") + `; ranks ${dr.ranks.join(", ")}`)));
  }
  d.attempts.forEach((a) => {
    const x0 = x(a.start), x1 = Math.max(x0 + 2, x(a.drawn_to));
    const color = OUTCOME_COLORS[a.outcome] || "#757575";
    const label = `#${a.attempt}` + (a.workers ? ` ×${a.workers}` : "");
    svg.append(s("g", { class: "tl-attempt", "data-attempt": a.attempt, "data-workers": a.workers ?? "", "data-outcome": a.outcome,
                         "data-x0": x0.toFixed(1), "data-x1": x1.toFixed(1) },
      s("rect", { x: x0, y: y("attempts") + 3, width: x1 - x0, height: 24, fill: color, rx: 2 }),
      x1 - x0 > 8 * label.length ? s("text", { x: x0 + 4, y: y("attempts") + 19, style: "fill:#fff" }, label) : s("text", {}, ""),
      s("title", {}, `attempt ${a.attempt}: ${a.outcome}, ${a.workers ?? "?"} worker(s), ${clock(a.start)} to ${a.end ? clock(a.end) : "now"}` +
        (a.restored_from ? `, restored from ${a.restored_from}` : "") + (a.steps_lost ? `, ${a.steps_lost} step(s) lost before it` : ""))));
    a.failures.forEach((f, i) => {
      const fx = x(f.time), fy = y("failures") + 6;
      svg.append(s("g", { class: "tl-failure", "data-attempt": a.attempt, "data-rank": f.rank, "data-x": fx.toFixed(1), "data-root": i === 0 ? "1" : "0" },
        s("path", { d: `M${fx - 6},${fy} L${fx + 6},${fy} L${fx},${fy + 11} Z`, opacity: i === 0 ? 1 : 0.45 }),
        i === 0 ? s("text", { x: fx + 8, y: fy + 10 }, `r${f.rank} ${f.signal || f.exc_type || f.kind || "exit " + f.exit_code}`) : s("text", {}, ""),
        s("title", {}, `attempt ${a.attempt}, rank ${f.rank} on ${f.node_id || "?"} at ${clock(f.time)}: ${f.cause}` + (i ? " (taken down with the root cause)" : " (root cause)"))));
    });
  });
  for (const c of d.checkpoints) {
    const cx = x(c.time);
    svg.append(s("g", { class: "tl-checkpoint", "data-attempt": c.attempt, "data-x": cx.toFixed(1) },
      s("line", { x1: cx, x2: cx, y1: y("checkpoints") + 6, y2: y("checkpoints") + 24 }),
      s("title", {}, `${c.dir} committed at ${clock(c.time)}: ${metrics(c.metrics)}`)));
  }
  for (const r of d.restores) {
    const rx = x(r.time), ry = y("restores") + 15;
    svg.append(s("g", { class: "tl-restore", "data-attempt": r.attempt, "data-x": rx.toFixed(1) },
      s("path", { d: `M${rx - 5},${ry} a5,5 0 1,0 10,0 a5,5 0 1,0 -10,0` }),
      s("title", {}, `attempt ${r.attempt} restored ${r.from}`)));
  }
  for (const r of d.resizes) {
    const rx = x(r.time), ry = y("restores") + 15;
    svg.append(s("g", { class: "tl-resize", "data-attempt": r.attempt, "data-x": rx.toFixed(1) },
      s("path", { d: `M${rx},${ry - 7} L${rx + 7},${ry} L${rx},${ry + 7} L${rx - 7},${ry} Z` }),
      s("text", { x: rx + 9, y: ry + 4 }, `${r.from}→${r.to}, ${r.steps_lost} lost`),
      s("title", {}, `resize to attempt ${r.attempt}: ${r.from} → ${r.to} workers, ${r.steps_lost} step(s) lost: ${r.reason}`)));
  }
  return svg;
}

function chartSection(d) {
  if (!d.series.names.length) return [h("h2", {}, "Metrics"), h("p", { class: "muted", id: "chart-none" },
    "no numeric metric reported yet (rank 0's reports are kept on storage as they come)")];
  if (!d.series.names.includes(R.metric)) R.metric = d.series.names.includes("loss") ? "loss" : d.series.names[0];
  const pick = h("select", { id: "metric", onchange: (e) => { R.metric = e.target.value; drawChart(true); } },
    d.series.names.map((n) => h("option", { value: n, selected: n === R.metric ? "selected" : null }, n)));
  const axis = h("select", { id: "xaxis", onchange: (e) => { R.x = e.target.value; drawChart(true); } },
    h("option", { value: "step", selected: R.x === "step" ? "selected" : null }, "against step"),
    h("option", { value: "time", selected: R.x === "time" ? "selected" : null }, "against time"));
  R.chart = null;
  return [h("h2", {}, "Metrics"), h("div", { class: "chart-controls" }, "metric ", pick, axis,
    h("span", { class: "muted" }, "one line per attempt; dashed lines: where each attempt began")), h("div", { id: "chart" }),
    h("p", { class: "muted", id: "chart-odd" })];
}

function chartData() {
  const sr = R.data.series, xs = R.x === "step" ? sr.step : sr.time, ys = sr.values[R.metric] || [];
  const per = new Map(), odd = [];  // odd: NaN and infinities, which a chart cannot draw
  for (let i = 0; i < xs.length; i++) {
    if (typeof ys[i] !== "number") { if (typeof ys[i] === "string") odd.push(`${ys[i]} at ${R.x} ${R.x === "time" ? clock(xs[i]) : xs[i]}`); continue; }
    const a = sr.attempt[i];
    if (!per.has(a)) per.set(a, [[], []]);
    per.get(a)[0].push(xs[i]); per.get(a)[1].push(ys[i]);
  }
  const attempts = [...per.keys()];
  const tables = attempts.map((a) => { const [px, py] = per.get(a); const o = px.map((_, i) => i).sort((i, j) => px[i] - px[j]);
                                       return [o.map((i) => px[i]), o.map((i) => py[i])]; });
  const points = tables.reduce((n, t) => n + t[0].length, 0);
  const starts = attempts.map((a) => per.get(a)[0][0]);
  const data = tables.length ? uPlot.join(tables) : [[]];
  return { attempts, data, points, starts, odd };
}

function drawChart(rebuild) {
  const box = document.getElementById("chart");
  if (!box || typeof uPlot === "undefined") return;
  const c = chartData();
  box.dataset.points = c.points;
  box.dataset.attempts = c.attempts.join(",");
  box.dataset.metric = R.metric;
  const note = document.getElementById("chart-odd");
  if (note) note.textContent = c.odd.length ? `not drawn, ${R.metric} was not a finite number: ${c.odd.slice(0, 5).join(", ")}` +
    (c.odd.length > 5 ? ` and ${c.odd.length - 5} more` : "") : "";
  const key = `${R.metric}|${R.x}|${c.attempts.join(",")}`;
  R.starts = c.starts;
  if (R.chart && !rebuild && R.chartKey === key) { R.chart.setData(c.data); return; }
  if (R.chart) R.chart.destroy();
  box.replaceChildren();
  R.chartKey = key;
  const opts = {
    width: Math.max(600, Math.min(1360, (main().clientWidth || 1200) - 42)), height: 300,
    scales: { x: { time: R.x === "time" } },
    axes: [{ label: R.x === "time" ? "time" : "step" }, { label: R.metric }],
    legend: { show: false }, cursor: { drag: { x: true, y: false } },
    series: [{}, ...c.attempts.map((a, i) => ({ label: `attempt ${a}`, stroke: COLORS[i % COLORS.length], width: 1.5,
                                                points: { show: c.points < 400 }, spanGaps: true }))],
    hooks: { draw: [(u) => {
      const ctx = u.ctx; ctx.save(); ctx.setLineDash([5, 4]); ctx.strokeStyle = "#9e9e9e"; ctx.lineWidth = 1;
      for (const xv of R.starts || []) {
        const px = u.valToPos(xv, "x", true);
        ctx.beginPath(); ctx.moveTo(px, u.bbox.top); ctx.lineTo(px, u.bbox.top + u.bbox.height); ctx.stroke();
      }
      ctx.restore();
    }] },
  };
  R.chart = new uPlot(opts, c.data, box);
}

function attemptsTable(d) {
  return [h("h2", {}, "Attempts"), h("table", { id: "attempts" },
    h("tr", {}, ["#", "started", "took", "outcome", "workers", "restored from", "steps lost before it", "reports", "failures"].map((t) => h("th", {}, t))),
    d.attempts.map((a) => h("tr", { "data-attempt": a.attempt },
      h("td", {}, a.attempt), h("td", {}, when(a.start)), h("td", {}, a.end ? dur(a.end - a.start) : "running"),
      h("td", {}, status(a.outcome)), h("td", { class: "num" }, a.workers ?? "-"), h("td", {}, a.restored_from || "nothing"),
      h("td", { class: "num" }, a.steps_lost), h("td", { class: "num" }, a.reports), h("td", { class: "num" }, a.failures.length))))];
}

function failures(d) {
  const all = d.attempts.flatMap((a) => a.failures);
  return [h("h2", {}, `Failures (${all.length})`), all.length ? all.map((f) => h("details", { class: "failure" },
    h("summary", {}, `attempt ${f.attempt} · rank ${f.rank} · node ${f.node_id || "?"} · pid ${f.pid} · ${clock(f.time)} · ${f.cause}`
      + (f.phase ? ` (in ${f.phase})` : "")),
    f.traceback ? h("pre", {}, f.traceback) : h("p", { class: "muted" }, "no traceback: the process ended without raising in Python"),
    f.oom_report ? h("pre", {}, f.oom_report) : null)) : h("p", { class: "muted" }, "none")];
}

function hangs(d) {
  return [h("h2", {}, `Hangs (${d.hangs.length})`), d.hangs.length ? d.hangs.map((x) => h("details", { class: "hang" },
    h("summary", {}, `attempt ${x.attempt} at ${clock(x.time)}: ${x.summary}`),
    x.stacks.map((g) => [h("div", {}, `${g.ranks.length === 1 ? "rank " + g.ranks[0] : "ranks " + g.ranks.join(", ")} in ${g.where}`),
                         h("pre", {}, g.text)]))) : h("p", { class: "muted" }, "none")];
}

// Where a checkpoint is held: in storage ("durable"), and in which nodes' memory (one copy until two
// nodes in different failure domains hold every rank's files).
function level(c) {
  const memory = (c.memory || []).length ? `memory: ${c.memory.join(", ")}${c.memory_at == null ? " (one copy)" : ""}` : "";
  return [c.durable === false ? "not in storage" : "durable", memory].filter(Boolean).join("; ");
}

function checkpoints(d) {
  const base = runApi();
  const rows = d.checkpoints.slice().reverse().map((c) => {
    const size = h("td", { class: "num size" }, "…"), check = h("td", { class: "check" });
    const load = (verify) => getJSON(`${base}/checkpoints/${encodeURIComponent(c.dir)}${verify ? "?check=1" : ""}`).then((m) => {
      size.textContent = `${bytes(m.bytes)} in ${m.files} file(s)`;
      if (m.check) { check.replaceChildren(h("span", { class: m.check.ok ? "status finished" : "status failed" }, m.check.ok ? "ok" : "failed"), " ", m.check.detail); }
    }).catch((e) => { (verify ? check : size).textContent = e.message; });
    check.append(h("button", { onclick: () => { check.textContent = "checking…"; load(true); } }, "check checksums"));
    if (d.checkpoints.length <= 30) load(false); else size.append(h("button", { onclick: () => load(false) }, "size"));
    return h("tr", { "data-checkpoint": c.dir }, h("td", {}, c.dir, c.latest ? h("span", { class: "muted" }, " (latest)") : null),
      h("td", { class: "num" }, c.attempt), h("td", { class: "num" }, c.report_index), h("td", {}, when(c.time)),
      h("td", { class: "level" }, level(c)), h("td", {}, metrics(c.metrics)), size, check);
  });
  return [h("h2", {}, `Checkpoints (${d.checkpoints.length}, newest first)`), d.checkpoints.length ? h("table", { id: "checkpoints" },
    h("tr", {}, ["checkpoint", "attempt", "report", "committed", "held", "metrics", "size", "checksums"].map((t) => h("th", {}, t))), rows)
    : h("p", { class: "muted" }, "none committed")];
}

function logs(d) {
  const withOutput = d.attempts.filter((a) => a.ranks.length);
  if (!withOutput.length) return [h("h2", {}, "Output"), h("p", { class: "muted" }, "the history names no output file yet")];
  const out = h("pre", { id: "log-lines" }, "choose an attempt's rank");
  const title = h("div", { class: "muted", id: "log-title" });
  const show = (a, r) => getJSON(`${runApi()}/logs/${r}?attempt=${a}&lines=500`).then((l) => {
    title.textContent = `rank ${l.rank}, attempt ${l.attempt}, node ${l.node_id}: the last ${l.lines.length} line(s) of ${l.path}`;
    out.textContent = l.lines.join("\n");
  }).catch((e) => { title.textContent = ""; out.textContent = e.message; });
  return [h("h2", {}, "Output (the lines `outlast runs --logs` shows)"),
    h("table", {}, withOutput.slice().reverse().map((a) => h("tr", {}, h("td", {}, `attempt ${a.attempt}`),
      h("td", {}, a.ranks.map((r) => h("button", { class: "log-button", "data-attempt": a.attempt, "data-rank": r, onclick: () => show(a.attempt, r) }, `rank ${r}`)))))),
    title, out];
}

function notes(d) {
  if (!d.notes.length && !d.skipped.length && !d.drains.length) return [];
  return [h("h2", {}, "Drains, skipped checkpoints and notes"),
    d.drains.map((x) => h("div", { class: "drain" }, `${when(x.start)}  drain of ${x.node_ids.join(", ")} (${x.reason}${x.message ? ": " + x.message : ""}) `
      + `reached attempt ${x.attempt}, ranks ${x.ranks.join(", ")}; ` + (x.deadline ? `deadline ${when(x.deadline)}` : "no deadline"))),
    d.skipped.map((x) => h("div", {}, `${when(x.time)}  skipped ${x.dir}: ${x.reason}`)),
    d.notes.map((x) => h("div", {}, `${when(x.time)}  ${x.text}`))];
}
