// Agentarium's live dashboard: polls /api/state and draws it. No framework, no build step.
// Every text from the broker goes in through textContent, never as HTML.
"use strict";

(() => {
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#2f6fae", "#d9822b", "#2e8b57", "#b8434b", "#7b5ea7", "#8c6d3f", "#d36fa8", "#5f6b7a"];
  const byId = (id) => document.getElementById(id);
  const dashboard = { state: null, renders: 0, errors: 0 };
  window.dashboard = dashboard; // what a test (or a curious user) can inspect

  // ---- formatting -------------------------------------------------------------------------
  function num(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    if (typeof value !== "number") return String(value);
    if (digits === undefined) return Number.isInteger(value) ? String(value) : value.toFixed(2);
    return value.toFixed(digits);
  }
  const clock = (t) => (t ? new Date(t * 1000).toLocaleTimeString([], { hour12: false }) : "–");
  function ago(t, now) {
    if (!t) return "–";
    const s = Math.max(0, now - t);
    return s < 90 ? `${Math.round(s)} s ago` : s < 5400 ? `${Math.round(s / 60)} min ago` : `${Math.round(s / 3600)} h ago`;
  }

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) if (v !== undefined && v !== null) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // columns: [{label, field, show(row) -> string | Node, cls(row) -> class, left}]
  function table(id, columns, rows, key, empty, rowCls) {
    const t = byId(id);
    const head = el("tr");
    for (const c of columns) head.appendChild(el("th", { class: c.left ? "l" : undefined }, c.label));
    const body = [head];
    for (const row of rows) {
      const tr = el("tr", { "data-row": key(row), class: rowCls ? rowCls(row) : undefined });
      for (const c of columns) {
        const shown = c.show ? c.show(row) : num(row[c.field]);
        const cls = [c.left ? "l" : "", c.cls ? c.cls(row) || "" : ""].join(" ").trim();
        const td = el("td", { "data-field": c.field, class: cls || undefined });
        if (shown instanceof Node) td.appendChild(shown);
        else td.textContent = shown;
        tr.appendChild(td);
      }
      body.push(tr);
    }
    if (!rows.length) {
      const tr = el("tr");
      tr.appendChild(el("td", { class: "empty", colspan: String(columns.length) }, empty));
      body.push(tr);
    }
    t.replaceChildren(...body);
  }

  // ---- an SVG line chart ------------------------------------------------------------------
  // series: [{name, xs, ys}] (nulls break the line); opts: {title, time, zero, digits}
  function lineChart(id, series, opts) {
    const svg = byId(id);
    const W = Math.max(svg.clientWidth || 0, 240);
    const H = Math.max(svg.clientHeight || 0, 120);
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const nodes = [];
    const add = (tag, attrs, text) => {
      const n = document.createElementNS(SVG, tag);
      for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
      if (text !== undefined) n.textContent = text;
      nodes.push(n);
      return n;
    };
    add("text", { x: 4, y: 12, class: "title" }, opts.title);
    const pts = series.flatMap((s) => s.xs.map((x, i) => [x, s.ys[i]]).filter((p) => p[1] !== null && p[1] !== undefined));
    const L = 44, R = W - 8, T = 30, B = H - 20;
    if (!pts.length) {
      add("text", { x: L, y: (T + B) / 2 }, "no data yet");
      svg.replaceChildren(...nodes);
      return;
    }
    let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
    let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
    if (opts.zero) y0 = Math.min(0, y0);
    if (opts.digits === 0) y1 = y0 + 3 * Math.max(1, Math.ceil((y1 - y0) / 3)); // whole-number ticks
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) {
      const pad = Math.abs(y0) * 0.1 || 1;
      if (opts.zero && y0 >= 0) y1 += pad; // counts and rates: the axis stays at 0
      else { y0 -= pad; y1 += pad; }
    }
    const px = (x) => L + ((x - x0) / (x1 - x0)) * (R - L);
    const py = (y) => B - ((y - y0) / (y1 - y0)) * (B - T);
    for (let i = 0; i <= 3; i++) {
      const y = y0 + ((y1 - y0) * i) / 3;
      add("line", { x1: L, x2: R, y1: py(y), y2: py(y), class: "grid-line" });
      add("text", { x: L - 4, y: py(y) + 3, "text-anchor": "end" }, num(y, opts.digits ?? 2));
    }
    add("line", { x1: L, x2: L, y1: T, y2: B, class: "axis" });
    add("line", { x1: L, x2: R, y1: B, y2: B, class: "axis" });
    const xl = (x) => (opts.time ? clock(x) : num(x, 0));
    add("text", { x: L, y: H - 6 }, xl(x0));
    add("text", { x: R, y: H - 6, "text-anchor": "end" }, (opts.time ? "" : "step ") + xl(x1));
    // legend, left to right, ending at the right edge (6.2 px per character at 10 px)
    let lx = R - series.reduce((w, s) => w + 8 + 6.2 * s.name.length, 0) + 8;
    series.forEach((s, i) => {
      const color = COLORS[i % COLORS.length];
      let d = "";
      let pen = false;
      const single = [];
      s.xs.forEach((x, j) => {
        const y = s.ys[j];
        if (y === null || y === undefined) { pen = false; return; }
        d += `${pen ? "L" : "M"}${px(x).toFixed(1)},${py(y).toFixed(1)}`;
        pen = true;
        single.push([x, y]);
      });
      if (d) add("path", { d, class: "series", stroke: color });
      if (single.length === 1) add("circle", { cx: px(single[0][0]), cy: py(single[0][1]), r: 3, fill: color });
      const label = add("text", { x: lx, y: 24, fill: color }, s.name);
      lx += 8 + 6.2 * s.name.length;
      label.setAttribute("data-series", s.name);
    });
    svg.replaceChildren(...nodes);
  }

  // ---- the page ---------------------------------------------------------------------------
  function cards(s) {
    const sum = (rows, f) => rows.reduce((a, r) => a + (r[f] || 0), 0);
    const steps = s.runs.map((r) => r.trainer_step).filter((v) => v !== null && v !== undefined);
    const versions = s.runs.map((r) => r.policy_version).filter((v) => v !== null && v !== undefined);
    const items = [
      ["waiting", "waiting", sum(s.agents, "waiting")],
      ["in_flight", "in flight", sum(s.agents, "in_flight")],
      ["dead_lettered", "dead letters", sum(s.agents, "dead_lettered")],
      ["workers", "live workers", s.workers.length],
      ["rollouts_per_s", "rollouts/s", Math.round(sum(s.agents, "rollouts_per_s") * 100) / 100],
      ["trainer_step", "trainer step", steps.length ? Math.max(...steps) : null],
      ["policy_version", "policy version", versions.length ? Math.max(...versions) : null],
    ];
    byId("cards").replaceChildren(
      ...items.map(([key, label, value]) => {
        const card = el("div", { class: key === "dead_lettered" && value ? "card bad" : "card", "data-card": key });
        card.append(el("div", { class: "label" }, label), el("div", { class: "value" }, num(value)));
        return card;
      }),
    );
  }

  function render(s) {
    const now = s.updated_at || Date.now() / 1000;
    const status = byId("status");
    status.textContent = s.error ? s.error : `updated ${clock(s.updated_at)} · read in ${num(s.refresh_s, 2)} s`;
    status.className = s.error ? "status error" : "status";
    byId("prefix").textContent = `prefix ${s.prefix}`;
    byId("notes").replaceChildren(...s.notes.map((n) => el("li", {}, n)));
    cards(s);

    table("agents", [
      { label: "agent", field: "agent", left: true, show: (r) => r.agent },
      { label: "waiting", field: "waiting" },
      { label: "in flight", field: "in_flight" },
      { label: "redelivered", field: "redelivered" },
      { label: "dead", field: "dead_lettered", cls: (r) => (r.dead_lettered ? "bad" : undefined) },
      { label: "stranded", field: "stranded", show: (r) => (r.has_consumer ? num(r.stranded) : "–") },
      { label: "workers", field: "workers" },
      { label: "rollouts/s", field: "rollouts_per_s", show: (r) => num(r.rollouts_per_s, 1) },
    ], s.agents, (r) => r.agent, "no agent has jobs yet");

    const q = s.queues;
    const agentSeries = (f) => Object.entries(q.agents).map(([name, v]) => ({ name, xs: q.t, ys: v[f] }));
    lineChart("chart-waiting", agentSeries("waiting"), { title: "waiting", time: true, zero: true, digits: 0 });
    lineChart("chart-rate", agentSeries("rollouts_per_s"), { title: "rollouts/s", time: true, zero: true, digits: 1 });
    lineChart("chart-reward-agent",
      Object.entries(s.reward).map(([name, v]) => ({ name, xs: v.t, ys: v.mean })),
      { title: "reward (mean per window)", time: true, zero: true, digits: 2 });

    table("runs", [
      { label: "run", field: "run", left: true, show: (r) => r.run },
      { label: "agent", field: "agent", left: true, show: (r) => r.agent || "–" },
      { label: "trajectories", field: "trajectories" },
      { label: "step", field: "trainer_step" },
      { label: "policy", field: "policy_version" },
      { label: "reward", field: "trainer_reward_mean_received", show: (r) => num(r.trainer_reward_mean_received, 3) },
      { label: "loss", field: "trainer_loss", show: (r) => num(r.trainer_loss, 4) },
      { label: "tokens/s", field: "trainer_tokens_per_s", show: (r) => num(r.trainer_tokens_per_s, 0) },
      { label: "stale drops", field: "trainer_dropped_stale" },
      { label: "staleness", field: "trainer_staleness_mean", show: (r) => num(r.trainer_staleness_mean, 2) },
      { label: "last step", field: "trainer_time", show: (r) => ago(r.trainer_time, now) },
    ], s.runs, (r) => r.run, "no run yet");
    const runSeries = (f) => Object.entries(s.metrics).map(([name, m]) => ({ name, xs: m.step, ys: m[f] }));
    lineChart("chart-reward-step", runSeries("reward_mean_received"), { title: "policy reward mean (received)", zero: true, digits: 2 });
    lineChart("chart-loss", runSeries("loss"), { title: "loss", digits: 3 });
    lineChart("chart-stale", runSeries("dropped_stale"), { title: "stale trajectories dropped (total)", zero: true, digits: 0 });

    const policy = Object.fromEntries(s.runs.map((r) => [r.run, r.policy_version]));
    // an engine's weight_version is an identity: "default" (the base, version 0) or
    // "<run>@<version>:<sha16>"; a version of another run is not this run's (null)
    const servedOf = (r) => {
      if (r.weight_version === "default") return 0;
      const m = /^([A-Za-z0-9_-]+)@(\d+):[0-9a-f]{16}$/.exec(r.weight_version ?? "");
      return m && m[1] === r.run ? Number(m[2]) : null;
    };
    const badSync = (r) => ["failed", "mismatch", "conflict"].includes(r.status);
    table("engines", [
      { label: "engine", field: "engine", left: true, show: (r) => r.engine, cls: () => "text mono" },
      { label: "run", field: "run", left: true, show: (r) => r.run },
      { label: "serving", field: "weight_version", show: (r) => r.weight_version ?? "unreachable",
        cls: (r) => (servedOf(r) === null ? "bad mono" : servedOf(r) < (policy[r.run] ?? 0) ? "lag mono" : "ok mono") },
      { label: "policy", field: "policy_version", show: (r) => num(policy[r.run]) },
      { label: "last sync", field: "status", left: true, show: (r) => r.status, cls: (r) => (badSync(r) ? "bad" : undefined) },
      { label: "seen", field: "updated_at", show: (r) => ago(r.updated_at, now) },
    ], s.engines, (r) => `${r.run} ${r.engine}`, "no syncer has reported an engine yet (agentarium sync)",
    (r) => (r.status === "mismatch" ? "bad" : undefined));

    table("workers", [
      { label: "worker", field: "worker_id", left: true, show: (r) => r.worker_id, cls: () => "mono" },
      { label: "agent", field: "agent", left: true, show: (r) => r.agent },
      { label: "in flight", field: "in_flight", show: (r) => `${num(r.in_flight)}/${num(r.concurrency)}` },
      { label: "done", field: "completed" },
      { label: "errors", field: "errors" },
      { label: "dead", field: "dead_lettered" },
      { label: "rollouts/s", field: "rollouts_per_s", show: (r) => num(r.rollouts_per_s, 1) },
    ], s.workers, (r) => r.worker_id, "no live worker");

    table("trajectories", [
      { label: "finished", field: "finished_at", show: (r) => clock(r.finished_at) },
      { label: "run", field: "run", left: true, show: (r) => r.run },
      { label: "agent", field: "agent", left: true, show: (r) => r.agent },
      { label: "job", field: "job_id", left: true, show: (r) => r.job_id, cls: () => "mono" },
      { label: "status", field: "status", left: true, show: (r) => r.status, cls: (r) => (r.status === "ok" ? "ok" : "bad") },
      { label: "reward", field: "reward", show: (r) => num(r.reward, 3) },
      { label: "policy v", field: "weight_version", show: (r) => r.weight_version || "–" },
      { label: "calls", field: "calls" },
      { label: "seconds", field: "seconds", show: (r) => num(r.seconds, 2) },
      { label: "trace", field: "trace", left: true, cls: () => "mono", show: (r) => {
        if (!r.trace_id) return "–";
        if (!r.trace_url) return r.trace_id.slice(0, 12);
        return el("a", { href: r.trace_url, target: "_blank", rel: "noopener noreferrer" }, r.trace_id.slice(0, 12) + "…");
      } },
    ], s.trajectories, (r) => r.job_id, "no trajectory stored yet");

    table("dead", [
      { label: "at", field: "at", show: (r) => clock(r.at) },
      { label: "agent", field: "agent", left: true, show: (r) => r.agent },
      { label: "reason", field: "reason", left: true, show: (r) => r.reason, cls: () => "bad" },
      { label: "job", field: "job_id", left: true, show: (r) => r.job_id || "–", cls: () => "mono" },
      { label: "attempts", field: "attempts" },
      { label: "error", field: "error", left: true, show: (r) => r.error || "–", cls: () => "text mono" },
      { label: "task", field: "task", left: true, show: (r) => r.task || "–", cls: () => "text mono" },
    ], s.dead_letters, (r) => String(r.seq), "no dead letter");

    dashboard.state = s;
    dashboard.renders += 1;
    document.dispatchEvent(new CustomEvent("dashboard:rendered", { detail: s }));
  }

  function showError(text) {
    const status = byId("status");
    status.textContent = text;
    status.className = "status error";
  }

  async function poll() {
    let wait = 1000;
    let state = null;
    try {
      const response = await fetch("/api/state", { cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      state = await response.json();
      wait = state.poll_ms || wait;
    } catch (err) {
      dashboard.errors += 1;
      showError(`dashboard server unreachable: ${err.message}`);
    }
    if (state) {
      try {
        render(state);
      } catch (err) {
        dashboard.errors += 1;
        console.error(err); // a bug here, not in the run: say so rather than show stale numbers
        showError(`cannot draw the state: ${err.message}`);
      }
    }
    setTimeout(poll, wait);
  }

  poll();
})();
