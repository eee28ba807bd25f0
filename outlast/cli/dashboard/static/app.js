// outlast dashboard: draws the JSON documents of /api/... (outlast/cli/dashboard/views.py) as they are.
// This file: what every page shares, the Runs and Cluster pages; run.js: a run's page.
// Every text goes in through textContent: nothing from a run is ever parsed as HTML.
"use strict";

const TERMINAL = new Set(["finished", "errored", "aborted"]);
const COLORS = ["#1565c0", "#2e7d32", "#6a1b9a", "#ef6c00", "#00838f", "#ad1457", "#5d4037", "#455a64"];
const OUTCOME_COLORS = { finished: "#2e7d32", failed: "#c62828", resized: "#00838f", preempted: "#ef6c00",
                         aborted: "#757575", driver_lost: "#8d6e63", running: "#1565c0" };
const SVGNS = "http://www.w3.org/2000/svg";

function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v); else el.setAttribute(k, v);
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === null || kid === undefined) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

function s(tag, attrs, ...kids) {
  const el = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) el.setAttribute(k, v);
  for (const kid of kids) el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  return el;
}

const main = () => document.getElementById("main");
const pad = (n) => String(n).padStart(2, "0");
function clock(t) { const d = new Date(t * 1000); return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`; }
function when(t) { if (!t) return "-"; const d = new Date(t * 1000); return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${clock(t)}`; }
function dur(sec) {
  if (sec === null || sec === undefined) return "-";
  sec = Math.max(0, sec);
  if (sec < 60) return `${sec.toFixed(sec < 10 ? 1 : 0)} s`;
  if (sec < 3600) return `${Math.floor(sec / 60)} min ${Math.round(sec % 60)} s`;
  return `${Math.floor(sec / 3600)} h ${Math.round((sec % 3600) / 60)} min`;
}
function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}
// NaN and the infinities come by name (docs/json.md): shown as the numbers they are, not as strings.
const NONFINITE = new Set(["NaN", "Infinity", "-Infinity"]);
function fmt(v) { return typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(5)) : NONFINITE.has(v) ? v : JSON.stringify(v); }
function metrics(m) { return m ? Object.entries(m).map(([k, v]) => `${k}=${fmt(v)}`).join(", ") : "-"; }
function counts(c) { const e = Object.entries(c || {}); return e.length ? e.map(([k, v]) => `${k}: ${v}`).join(", ") : "none"; }
function status(text) { return h("span", { class: `status ${text}` }, text); }

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  let body;
  try { body = await r.json(); } catch (e) { throw new Error(`the dashboard answered ${r.status} without a document`); }
  if (!r.ok || body.error) throw new Error(body.error || `the dashboard answered ${r.status}`);
  return body;
}

function showError(message) { main().replaceChildren(h("div", { class: "error-box", id: "error" }, message)); }
function stamp() { document.getElementById("updated").textContent = `updated ${clock(Date.now() / 1000)}`; }

function poll(fn, everyMs) {
  let stopped = false;
  const tick = async () => {
    let again = true;
    try { again = (await fn()) !== false; stamp(); } catch (e) { showError(e.message); }
    if (again && !stopped) setTimeout(tick, everyMs);
  };
  tick();
  return () => { stopped = true; };
}

// ---- Runs ------------------------------------------------------------------------------

async function runsPage() {
  const data = await getJSON("/api/runs");
  const kids = [h("h1", {}, "Runs")];
  if (!data.paths.length) kids.push(h("p", { class: "muted" }, "No storage path given: start it as `outlast dashboard STORAGE_PATH ...`."));
  for (const p of data.paths) {
    kids.push(h("h2", {}, p.path));
    if (p.error) { kids.push(h("div", { class: "error-box" }, p.error)); continue; }
    if (!p.runs.length) { kids.push(h("p", { class: "muted" }, `no runs under ${p.path}`)); continue; }
    kids.push(h("table", { class: "runs" },
      h("tr", {}, ["run", "status", "attempts", "workers", "failures by kind", "checkpoints", "latest checkpoint",
                   "last metrics", "updated"].map((t) => h("th", {}, t))),
      p.runs.map((r) => r.unreadable
        ? h("tr", { "data-run": r.name }, h("td", {}, r.name), h("td", { colspan: 8, class: "error-box" }, `unreadable: ${r.unreadable}`))
        : h("tr", { "data-run": r.name },
            h("td", {}, h("a", { href: `/runs/${p.index}/${encodeURIComponent(r.name)}` }, r.name)),
            h("td", {}, status(r.status)), h("td", { class: "num attempts" }, r.attempts),
            h("td", { class: "num" }, r.workers ?? "-"), h("td", {}, counts(r.failure_counts)),
            h("td", { class: "num" }, r.checkpoints), h("td", {}, r.latest_checkpoint || "-"),
            h("td", {}, metrics(r.last_metrics)), h("td", {}, when(r.updated_at))))));
  }
  main().replaceChildren(...kids);
}

// ---- Cluster ---------------------------------------------------------------------------

let skew = 0; // the server's clock minus this browser's

function countdown(deadline) {
  if (deadline === null || deadline === undefined) return "no deadline";
  const left = deadline - (Date.now() / 1000 + skew);
  return left >= 0 ? `deadline in ${Math.ceil(left)} s` : `deadline passed ${Math.floor(-left)} s ago`;
}

function tickCountdowns() {
  for (const el of document.querySelectorAll(".countdown[data-deadline]")) el.textContent = countdown(Number(el.dataset.deadline));
}

function res(r) { return Object.entries(r || {}).map(([k, v]) => `${k} ${k === "memory" ? bytes(v) : fmt(v)}`).join(", ") || "-"; }

function memoryBar(used, of) {
  if (!of) return bytes(used);
  const pct = Math.min(100, (100 * used) / of);
  return h("span", {}, h("span", { class: `bar${used > of ? " over" : ""}`, style: `width:${Math.max(2, pct * 0.8)}px` }),
           ` ${bytes(used)} of ${bytes(of)}`);
}

async function clusterPage() {
  const c = await getJSON("/api/cluster");
  skew = c.now - Date.now() / 1000;
  const kids = [h("h1", {}, "Cluster"),
    h("div", { class: "facts" }, h("span", {}, `${c.nodes.length} node(s): ` + Object.entries(c.counts).filter(([, v]) => v).map(([k, v]) => `${v} ${k}`).join(", ")),
      h("span", { class: "muted" }, `through ${c.reached_through}`))];
  kids.push(h("table", { class: "nodes" },
    h("tr", {}, ["node", "state", "", "address", "resources", "held by runs", "workers (memory / reserved)", "isolation"].map((t) => h("th", {}, t))),
    c.nodes.map((n) => h("tr", { "data-node": n.node_id, "data-state": n.state },
      h("td", {}, n.node_id, n.is_head ? h("span", { class: "muted" }, " (head)") : null),
      h("td", {}, status(n.state)),
      h("td", { class: "why" },
        n.draining ? [h("span", { class: "countdown", "data-deadline": n.draining.deadline ?? null }, countdown(n.draining.deadline)),
                      h("div", { class: "muted" }, `${n.draining.reason}${n.draining.message ? ": " + n.draining.message : ""}`
                        + (n.draining.node_ids.length > 1 ? ` (with ${n.draining.node_ids.join(", ")})` : ""))] : null,
        n.state === "dead" ? h("div", {}, `silent since ${clock(n.last_seen)}`) : null,
        n.status_error ? h("div", { class: "muted" }, n.status_error) : null),
      h("td", {}, n.address), h("td", {}, res(n.resources)),
      h("td", { class: "held" }, Object.entries(n.used).map(([run, r]) => h("div", {}, `${run}: ${res(r)}`))),
      h("td", { class: "workers" }, n.workers.map((w) => h("div", {}, `${w.run_id} #${w.attempt} rank ${w.rank} (pid ${w.pid}): `,
        memoryBar(w.memory_bytes || w.rss_bytes, w.reserved_memory)))),
      h("td", {}, n.isolation ? [memoryBar(n.isolation.counted_memory, n.isolation.user_limit),
        h("div", { class: "muted" }, `cgroup v${n.isolation.cgroup_version}, ${n.isolation.kills} kill(s)`)] : "off")))));
  const kills = c.nodes.flatMap((n) => n.kills.map((k) => ({ node: n.node_id, ...k })));
  kids.push(h("h2", {}, "Recent kills for memory"));
  kids.push(kills.length ? kills.map((k) => h("details", { class: "kill" },
    h("summary", {}, `${clock(k.time)} on ${k.node}: killed ${k.selected.join(", ")} (${k.trigger}, ${k.policy})`),
    h("p", {}, k.reason, ` Usage ${bytes(k.usage_bytes)} against a limit of ${bytes(k.limit_bytes)}, target ${bytes(k.target_bytes)}.`),
    h("pre", {}, JSON.stringify(k.considered, null, 1)))) : h("p", { class: "muted" }, "none"));
  main().replaceChildren(...kids);
}

// ---- start -----------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  const page = document.body.dataset.page;
  const nav = document.getElementById(page === "cluster" ? "nav-cluster" : "nav-runs");
  if (nav) nav.classList.add("here");
  if (page === "error") showError(document.body.dataset.error);
  else if (page === "runs") poll(runsPage, 3000);
  else if (page === "cluster") { poll(clusterPage, 1000); setInterval(tickCountdowns, 250); }
  else if (page === "run") poll(runPage, 2000);
});
