// crossfed coordinator status page: renders the state inlined in the page, then polls
// /v1/ui/state (same origin, session cookie) every few seconds. No libraries, no network
// beyond the coordinator. Text goes in with textContent only.
"use strict";

const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const COLOURS = ["#e76f51", "#2a9d8f", "#e9c46a", "#8d5fd3", "#f4a261", "#457b9d"];

function $(id) { return document.getElementById(id); }

function fmt(value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (typeof value !== "number") return String(value);
  return digits === undefined ? String(value) : value.toFixed(digits);
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "never";
  if (seconds < 90) return `${seconds.toFixed(0)} s ago`;
  if (seconds < 5400) return `${(seconds / 60).toFixed(0)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function fill(tableId, items, build) {
  const body = $(tableId).querySelector("tbody");
  const rows = items.map((item) => {
    const tr = document.createElement("tr");
    build(tr, item);
    return tr;
  });
  body.replaceChildren(...rows);
}

function progressCell(row, consumed, total) {
  const td = cell(row, `${consumed}/${total}`);
  const bar = document.createElement("div");
  bar.className = "bar";
  const inner = document.createElement("div");
  inner.className = "fill";
  inner.style.width = `${total ? (100 * consumed) / total : 0}%`;
  bar.appendChild(inner);
  td.appendChild(bar);
}

function renderSummary(state) {
  const s = state.status;
  $("round").textContent = fmt(s.round);
  $("generation").textContent = fmt(s.generation);
  $("global-step").textContent = fmt(s.global_step);
  $("epoch").textContent = fmt(s.epoch);
  $("epochs-before").textContent =
    s.epoch > 0 ? `${s.epoch} full epoch${s.epoch > 1 ? "s" : ""} before it` : "the first";
  $("epoch-blocks").textContent = `${s.blocks_committed_in_epoch} / ${s.blocks_total}`;
  $("epoch-bar").style.width = `${(100 * s.blocks_committed_in_epoch) / s.blocks_total}%`;
  $("live-sites").textContent = String(state.sites.filter((x) => x.live).length);
}

function renderSites(state) {
  fill("sites", state.sites, (tr, site) => {
    tr.dataset.site = site.site;
    cell(tr, site.site);
    cell(tr, site.live ? "live" : "gone", site.live ? "live" : "gone");
    cell(tr, fmt(site.ranks));
    cell(tr, fmt(site.rtt_ms, 1));
    cell(tr, fmt(site.t_step_s, 3));
    const lease = site.leases[0];
    if (lease) {
      cell(tr, `#${lease.lease_id} (round ${lease.round})`);
      progressCell(tr, lease.consumed, lease.n_blocks);
      cell(tr, `${Math.max(0, lease.expires_in_s).toFixed(1)} s`);
    } else {
      cell(tr, "–");
      cell(tr, "–");
      cell(tr, "–");
    }
    cell(tr, ago(site.seen_s_ago));
  });
}

function renderLedger(state) {
  const columns = ["ranks", "rtt_ms", "entries", "grants", "blocks_granted",
    "blocks_committed", "blocks_lost", "ttl_expiries"];
  fill("ledger", state.ledger, (tr, row) => {
    tr.dataset.site = row.site;
    if (row.site === "total") tr.className = "total";
    cell(tr, row.site);
    for (const c of columns) cell(tr, fmt(row[c], c === "rtt_ms" && row[c] !== null ? 1 : undefined));
  });
}

function renderRounds(state) {
  const recent = state.history.slice(-12).reverse();
  fill("rounds", recent, (tr, r) => {
    tr.dataset.round = String(r.round);
    cell(tr, String(r.round));
    cell(tr, fmt(r.generation));
    cell(tr, fmt(r.reason));
    cell(tr, (r.contributors || []).join(", "));
    cell(tr, fmt(r.tokens));
    cell(tr, fmt(r.loss, 4));
    cell(tr, fmt(r.merge_s, 2));
  });
}

function svg(tag, attrs, parent) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (parent) parent.appendChild(node);
  return node;
}

function renderLoss(state) {
  const width = 720, height = 260, left = 52, right = 110, top = 12, bottom = 32;
  const points = state.history.filter((r) => typeof r.loss === "number");
  const sites = [...new Set(state.history.flatMap((r) => Object.keys(r.site_loss || {})))].sort();
  const all = points.map((r) => r.loss);
  for (const r of state.history) {
    for (const v of Object.values(r.site_loss || {})) if (typeof v === "number") all.push(v);
  }
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
  svg("title", {}, root).textContent = "token-weighted training loss per outer round";
  if (all.length === 0) {
    const t = svg("text", { x: left, y: height / 2 }, root);
    t.textContent = "no closed round yet";
    $("loss").replaceChildren(root);
    return;
  }
  const rounds = state.history.map((r) => r.round);
  const x0 = Math.min(...rounds), x1 = Math.max(...rounds, x0 + 1);
  let y0 = Math.min(...all), y1 = Math.max(...all);
  if (y1 - y0 < 1e-6) { y0 -= 0.5; y1 += 0.5; }
  const px = (x) => left + ((x - x0) / (x1 - x0)) * (width - left - right);
  const py = (y) => top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    svg("line", { x1: left, x2: width - right, y1: py(y), y2: py(y), class: "grid" }, root);
    svg("text", { x: 4, y: py(y) + 4 }, root).textContent = y.toFixed(2);
  }
  svg("line", { x1: left, x2: width - right, y1: height - bottom, y2: height - bottom, class: "axis" }, root);
  svg("line", { x1: left, x2: left, y1: top, y2: height - bottom, class: "axis" }, root);
  svg("text", { x: left, y: height - 8 }, root).textContent = `round ${x0}`;
  svg("text", { x: width - right - 50, y: height - 8 }, root).textContent = `round ${x1}`;
  sites.forEach((site, i) => {
    const colour = COLOURS[i % COLOURS.length];
    for (const r of state.history) {
      const v = (r.site_loss || {})[site];
      if (typeof v === "number") {
        svg("circle", { cx: px(r.round), cy: py(v), r: 3, fill: colour, "data-site": site }, root);
      }
    }
    svg("circle", { cx: width - right + 14, cy: top + 30 + 16 * i, r: 4, fill: colour }, root);
    svg("text", { x: width - right + 24, y: top + 34 + 16 * i }, root).textContent = site;
  });
  const line = points.map((r) => `${px(r.round).toFixed(1)},${py(r.loss).toFixed(1)}`).join(" ");
  svg("polyline", { points: line, class: "mean" }, root);
  svg("line", { x1: width - right + 8, x2: width - right + 20, y1: top + 12, y2: top + 12, class: "mean" }, root);
  svg("text", { x: width - right + 24, y: top + 16 }, root).textContent = "round mean";
  $("loss").replaceChildren(root);
}

function render(state) {
  const http = state.http || {};
  $("http-errors").textContent = `${fmt(http.http_4xx)} / ${fmt(http.http_5xx)}`;
  $("updated").textContent = `updated ${new Date(state.now * 1000).toLocaleTimeString()}`;
  $("norun").hidden = state.run;
  if (!state.run) return;
  renderSummary(state);
  renderSites(state);
  renderLedger(state);
  renderRounds(state);
  renderLoss(state);
}

async function poll() {
  try {
    const response = await fetch("/v1/ui/state", { credentials: "same-origin", cache: "no-store" });
    if (response.status === 401) {
      $("updated").textContent = "signed out: reload /v1/ui to sign in again";
      return;
    }
    if (response.ok) render(await response.json());
    else $("updated").textContent = `coordinator answered ${response.status}`;
  } catch (err) {
    $("updated").textContent = "coordinator unreachable; retrying";
  }
  setTimeout(poll, POLL_MS);
}

render(JSON.parse($("state").textContent));
setTimeout(poll, POLL_MS);
