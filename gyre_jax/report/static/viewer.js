/* gyre_jax run report viewer: reads window.GYRE_RUN and window.GYRE_INDEX (data/run.js, data/index.js) and
 * loads a group's rollouts (data/rollouts/<group>.js, which calls gyreRollouts({...})) when one is opened.
 * Plain DOM and Plotly; no build step, no network: the page works from file://. */
(function () {
  "use strict";
  const RUN = window.GYRE_RUN || {};
  const IDX = window.GYRE_INDEX || { columns: [], rows: [] };
  const C = {};
  IDX.columns.forEach((c, i) => { C[c] = i; });
  const ROWS = IDX.rows;
  const ROLE_COLORS = (RUN.roles && RUN.roles.colors) || {};
  const ROLE_LABELS = (RUN.roles && RUN.roles.labels) || {};
  const STATUS_COLORS = { completed: "#2e9d57", timeout: "#c99a06", infra_error: "#d64545",
    verifier_error: "#b0306d", running: "#7a8694" };
  const PAGE = 200;
  const $ = (s, r) => (r || document).querySelector(s);
  const $$ = (s, r) => Array.from((r || document).querySelectorAll(s));
  const cache = {}; // rollout id -> detail
  const loading = {}; // shard -> [callbacks]
  const drawn = {};
  const state = { sortKey: "t_end", sortDir: -1, page: 0, filtered: [], selected: null };

  function esc(s) {
    return String(s == null ? "" : s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  }
  function fmt(v, d) {
    if (v == null || v === "") return "\u2013";
    if (typeof v !== "number") return esc(v);
    if (Number.isInteger(v)) return String(v);
    return v.toFixed(d == null ? 3 : d);
  }
  function statusBadge(s) { return `<span class="st ${esc(s)}">${esc(s || "running")}</span>`; }
  function delta(a, b) {
    if (a == null || b == null) return "\u2013";
    const d = b - a;
    return `<span class="${d > 1e-9 ? "up" : d < -1e-9 ? "down" : ""}">${d > 0 ? "+" : ""}${d.toFixed(3)}</span>`;
  }
  const LAYOUT = { margin: { l: 50, r: 20, t: 10, b: 40 }, legend: { orientation: "h", y: -0.22 },
    font: { size: 11 }, hovermode: "closest" };
  const CONFIG = { displaylogo: false, responsive: true, displayModeBar: false };
  function plot(el, traces, layout, config) {
    if (!window.Plotly) { el.innerHTML = '<p class="hint">plotly.js did not load (assets/plotly-basic.min.js)</p>'; return; }
    const lay = Object.assign({}, LAYOUT, layout || {});
    const xs = traces.flatMap((t) => (t.x || []).filter((x) => typeof x === "number"));
    if (xs.length && !(lay.xaxis && lay.xaxis.type)) { // integer ticks for steps and versions
      const span = Math.max(...xs) - Math.min(...xs);
      lay.xaxis = Object.assign({ dtick: Math.max(1, Math.ceil(span / 12)) }, lay.xaxis || {});
    }
    window.Plotly.newPlot(el, traces, lay, Object.assign({}, CONFIG, config || {}));
  }

  // ------------------------------------------------------------------ header
  function header() {
    const st = RUN.state || {};
    $("#run-title").textContent = "gyre_jax run report: " + (RUN.title || "");
    const badge = $("#run-state");
    badge.textContent = st.status || "unknown";
    badge.className = "badge " + (st.status || "");
    if (st.error) { const e = $("#run-error"); e.hidden = false; e.textContent = "error: " + st.error; }
    const gen = RUN.generated_unix ? new Date(RUN.generated_unix * 1000).toLocaleString() : "";
    const store = RUN.store || {};
    $("#run-meta").innerHTML = `${esc(RUN.mode_dir || "")} &middot; ${ROWS.length} rollouts` +
      (store.unfinished ? ` (${store.unfinished} running or cut off)` : "") +
      (store.quarantined ? ` &middot; ${store.quarantined} quarantined records` : "") +
      ` &middot; ${st.attempts || 0} attempt(s) &middot; built ${esc(gen)}`;
  }

  // ------------------------------------------------------------------ overview
  function col(name) { const m = (RUN.metrics || {}).columns || {}; return m[name] || []; }
  function evcol(name) { const m = (RUN.evals || {}).columns || {}; return m[name] || []; }
  function cards() {
    const s = RUN.summary || {};
    const statuses = {};
    ROWS.forEach((r) => { const k = r[C.status] || "running"; statuses[k] = (statuses[k] || 0) + 1; });
    const steps = col("step");
    const rew = col("reward").filter((x) => x != null);
    const ev = evcol("eval/reward").filter((x) => x != null);
    const out = [
      ["run", (RUN.state || {}).status || "?"], ["steps", steps.length], ["rollouts", ROWS.length],
      ["reward first \u2192 last", rew.length ? `${fmt(rew[0])} \u2192 ${fmt(rew[rew.length - 1])}` : "\u2013"],
      ["eval first \u2192 last", ev.length ? `${fmt(ev[0])} \u2192 ${fmt(ev[ev.length - 1])}` :
        (s.eval_first != null ? `${fmt(s.eval_first)} \u2192 ${fmt(s.eval_last)}` : "\u2013")],
      ["statuses", Object.entries(statuses).map(([k, v]) => `${k} ${v}`).join(", ") || "\u2013"],
    ];
    if (s.staleness_max != null) out.push(["staleness max", fmt(s.staleness_max, 0)]);
    $("#cards").innerHTML = out.map(([k, v]) => `<div class="card"><div class="k">${esc(k)}</div><div class="v">${typeof v === "string" && v.includes("<") ? v : esc(v)}</div></div>`).join("");
  }
  function drawOverview() {
    const steps = col("step");
    const traces = [];
    if (steps.length) {
      traces.push({ x: steps, y: col("reward"), name: "train reward (step's rollouts)",
        mode: "lines+markers", line: { color: "#2f6fde" }, hovertemplate: "step %{x}<br>reward %{y:.3f}<extra></extra>" });
      if (col("exact").length) traces.push({ x: steps, y: col("exact"), name: "train exact (score 1)", mode: "lines",
        line: { color: "#9bb8ee", dash: "dot" } });
    }
    const ev = evcol("step");
    if (ev.length) {
      traces.push({ x: ev, y: evcol("eval/reward"), name: "held-out eval: mean score", mode: "lines+markers",
        line: { color: "#e45756", width: 2.5 }, hovertemplate: "version %{x}<br>eval %{y:.3f}<extra></extra>" });
      if (evcol("eval/exact").length) traces.push({ x: ev, y: evcol("eval/exact"), name: "eval pass@1", mode: "lines",
        line: { color: "#f0a0a0", dash: "dot" } });
      if (evcol("eval/pass_at_k").length) traces.push({ x: ev, y: evcol("eval/pass_at_k"), name: "eval pass@k", mode: "lines",
        line: { color: "#b33", dash: "dash" } });
    } else if (col("eval/reward").length) { // first-call evals live in the step records
      const xs = [], ys = [];
      col("eval/reward").forEach((y, i) => { if (y != null) { xs.push(col("eval/version")[i]); ys.push(y); } });
      col("eval/reward_start").forEach((y, i) => { if (y != null) { xs.unshift(col("eval/version_start")[i]); ys.unshift(y); } });
      traces.push({ x: xs, y: ys, name: "held-out eval (first call)", mode: "lines+markers", line: { color: "#e45756" } });
    }
    if (!traces.length) { $("#chart-curves").innerHTML = '<p class="hint">no step finished yet (metrics.jsonl is empty)</p>'; }
    else plot($("#chart-curves"), traces, { xaxis: { title: { text: "policy version (step)" } }, yaxis: { title: { text: "score" } } });
    // metric picker
    const names = Object.keys((RUN.metrics || {}).columns || {}).filter((k) => k !== "step" && k !== "time").sort();
    const pick = $("#metric-pick");
    pick.innerHTML = names.map((n) => `<option ${n === "loss" ? "selected" : ""}>${esc(n)}</option>`).join("");
    const drawMetric = () => {
      const n = pick.value;
      if (!n) { $("#chart-metric").innerHTML = '<p class="hint">no metrics yet</p>'; return; }
      plot($("#chart-metric"), [{ x: steps, y: col(n), mode: "lines+markers", name: n, line: { color: "#555" } }],
        { xaxis: { title: { text: "step" } }, showlegend: false });
    };
    pick.onchange = drawMetric;
    drawMetric();
    // statuses per step (stacked)
    const keys = Object.keys(RUN.steps || {}).sort((a, b) => stepOrder(a) - stepOrder(b));
    const sts = new Set();
    keys.forEach((k) => Object.keys(RUN.steps[k].statuses).forEach((s) => sts.add(s)));
    plot($("#chart-status"), Array.from(sts).map((s) => ({ type: "bar", name: s, x: keys, y: keys.map((k) => RUN.steps[k].statuses[s] || 0),
      marker: { color: STATUS_COLORS[s] || "#888" } })), { barmode: "stack", xaxis: { type: "category", title: { text: "step" } } });
  }
  function stepOrder(k) { const n = Number(k); return Number.isFinite(n) ? n : k === "pending" ? 1e9 : 1e9 + 1; }

  // ------------------------------------------------------------------ tasks
  function taskRows() {
    const ev = (RUN.evals || {}).tasks || {}, tr = RUN.tasks || {};
    const names = new Set([...Object.keys(ev), ...Object.keys(tr)]);
    const out = [];
    names.forEach((t) => {
      const e = ev[t] || {}, r = tr[t] || {};
      const ev_v = Object.keys(e).map(Number).sort((a, b) => a - b), tr_v = Object.keys(r).map(Number).sort((a, b) => a - b);
      const rate = (c) => (c && c[0] ? c[1] / c[0] : null);
      const e0 = ev_v.length ? rate(e[ev_v[0]]) : null, e1 = ev_v.length ? rate(e[ev_v[ev_v.length - 1]]) : null;
      const t0 = tr_v.length ? r[tr_v[0]][2] : null, t1 = tr_v.length ? r[tr_v[tr_v.length - 1]][2] : null;
      const n = tr_v.reduce((a, v) => a + r[v][0] + r[v][3], 0);
      out.push({ task: t, e0, e1, ed: e0 != null && e1 != null ? e1 - e0 : null, ev: ev_v, t0, t1,
        td: t0 != null && t1 != null && tr_v.length > 1 ? t1 - t0 : null, tv: tr_v, n,
        held: ev_v.length > 0 });
    });
    out.sort((a, b) => (b.held - a.held) || ((b.ed ?? b.td ?? -9) - (a.ed ?? a.td ?? -9)) || a.task.localeCompare(b.task));
    return out;
  }
  function drawTasks() {
    const rows = taskRows();
    $("#task-table thead").innerHTML = "<tr><th>task</th><th class=num>eval pass, first version</th><th class=num>last</th><th class=num>change</th>" +
      "<th class=num>train mean score, first version</th><th class=num>last</th><th class=num>change</th><th class=num>training rollouts</th></tr>";
    $("#task-table tbody").innerHTML = rows.map((r) => `<tr data-task="${esc(r.task)}"><td>${esc(r.task)}</td>` +
      `<td class=num>${fmt(r.e0)}${r.ev.length ? ` <span class=muted>v${r.ev[0]}</span>` : ""}</td>` +
      `<td class=num>${fmt(r.e1)}${r.ev.length ? ` <span class=muted>v${r.ev[r.ev.length - 1]}</span>` : ""}</td>` +
      `<td class=num>${delta(r.e0, r.e1)}</td>` +
      `<td class=num>${fmt(r.t0)}${r.tv.length ? ` <span class=muted>v${r.tv[0]}</span>` : ""}</td>` +
      `<td class=num>${fmt(r.t1)}${r.tv.length ? ` <span class=muted>v${r.tv[r.tv.length - 1]}</span>` : ""}</td>` +
      `<td class=num>${r.tv.length > 1 ? delta(r.t0, r.t1) : "\u2013"}</td><td class=num>${r.n}</td></tr>`).join("");
    $$("#task-table tbody tr").forEach((tr) => { tr.onclick = () => taskChart(tr.dataset.task); tr.ondblclick = () => showTaskRollouts(tr.dataset.task); });
    if (rows.length) taskChart(rows[0].task);
    else $("#chart-task").innerHTML = '<p class="hint">no task finished a rollout yet</p>';
  }
  function taskChart(task) {
    const e = ((RUN.evals || {}).tasks || {})[task] || {}, r = (RUN.tasks || {})[task] || {};
    const ev = Object.keys(e).map(Number).sort((a, b) => a - b), tv = Object.keys(r).map(Number).sort((a, b) => a - b);
    plot($("#chart-task"), [
      { x: tv, y: tv.map((v) => r[v][2]), name: "train mean score", mode: "lines+markers", line: { color: "#2f6fde" },
        text: tv.map((v) => `${r[v][0]} scored, ${r[v][3]} failed`) },
      { x: ev, y: ev.map((v) => (e[v][0] ? e[v][1] / e[v][0] : null)), name: "held-out pass rate", mode: "lines+markers",
        line: { color: "#e45756" }, text: ev.map((v) => `${e[v][1]}/${e[v][0]} passed, mean ${fmt(e[v][2])}`) },
    ], { title: { text: task + '  <span style="font-size:11px">(double-click its row for its rollouts)</span>', font: { size: 12 } },
      margin: { l: 50, r: 20, t: 30, b: 40 }, xaxis: { title: { text: "policy version" } }, yaxis: { range: [-0.05, 1.05] } });
  }
  function showTaskRollouts(task) { $("#f-text").value = task; go("rollouts"); applyFilters(); }

  // ------------------------------------------------------------------ steps
  function drawSteps() {
    const keys = Object.keys(RUN.steps || {}).sort((a, b) => stepOrder(a) - stepOrder(b));
    const sts = new Set();
    keys.forEach((k) => Object.keys(RUN.steps[k].statuses).forEach((s) => sts.add(s)));
    const cols = Array.from(sts).sort();
    $("#step-table thead").innerHTML = `<tr><th>step</th>${cols.map((s) => `<th class=num>${statusBadge(s)}</th>`).join("")}<th>top failure reasons (count, an example)</th></tr>`;
    $("#step-table tbody").innerHTML = keys.map((k) => {
      const d = RUN.steps[k];
      const reasons = d.reasons.map(([why, n, ex]) => `<div>${n}&times; <code>${esc(why)}</code> <a href="#rollout=${encodeURIComponent(ex)}" class="ex">${esc(ex)}</a></div>`).join("");
      return `<tr><td>${esc(k)}</td>${cols.map((s) => `<td class=num>${d.statuses[s] || ""}</td>`).join("")}<td>${reasons || '<span class="muted">none</span>'}</td></tr>`;
    }).join("");
  }

  // ------------------------------------------------------------------ timeline
  function drawTimeline() {
    const tl = RUN.timeline || {};
    const segs = tl.segments || [];
    if (!segs.length) { $("#chart-timeline").innerHTML = '<p class="hint">no attempt record yet (attempts/*.json: written after each step)</p>'; }
    else {
      const byRole = {};
      segs.forEach(([c, t0, t1, r]) => {
        const d = byRole[r] || (byRole[r] = { x: [], y: [], text: [] });
        d.x.push(t0, t1, null); d.y.push(c, c, null);
        const s = `cell ${c}: ${ROLE_LABELS[r] || r}, ${t0.toFixed(1)}-${t1.toFixed(1)} s (${(t1 - t0).toFixed(1)} s)`;
        d.text.push(s, s, null);
      });
      const n = Math.max(tl.n_cells || 1, 1);
      const width = Math.max(4, Math.min(28, 260 / n));
      const traces = Object.entries(byRole).map(([r, d]) => ({ x: d.x, y: d.y, text: d.text, name: ROLE_LABELS[r] || r,
        mode: "lines", line: { color: ROLE_COLORS[r] || "#999", width }, hoverinfo: "text", connectgaps: false }));
      const ends = tl.step_ends || [];
      if (ends.length) {
        const x = [], y = [], text = [];
        ends.forEach(([s, t]) => { x.push(t, t, null); y.push(-0.5, n - 0.5, null); text.push(`step ${s} done at ${t.toFixed(1)} s`, "", null); });
        traces.push({ x, y, text, mode: "lines", name: "step done", line: { color: "rgba(0,0,0,0.35)", width: 1 }, hoverinfo: "text" });
      }
      (tl.restarts || []).forEach(([t, a, s]) => traces.push({ x: [t, t], y: [-0.5, n - 0.5], mode: "lines", name: `attempt ${a} (from step ${s})`,
        line: { color: "#d62728", width: 2, dash: "dash" }, hoverinfo: "name" }));
      plot($("#chart-timeline"), traces, { yaxis: { autorange: "reversed", tickvals: [...Array(n).keys()],
        ticktext: [...Array(n).keys()].map((c) => `cell ${c}${c === 0 ? " (core)" : ""}`), zeroline: false },
        xaxis: { title: { text: "seconds of RL (attempts laid end to end)" }, dtick: null }, dragmode: "zoom",
        margin: { l: 95, r: 20, t: 10, b: 40 } },
        { displayModeBar: true });
    }
    $("#attempts").innerHTML = (tl.attempts || []).length ? `<table class="grid"><thead><tr><th>attempt</th><th>status</th><th class=num>first step</th><th class=num>set-up s</th><th class=num>RL s</th><th>error</th></tr></thead><tbody>` +
      tl.attempts.map((a) => `<tr><td>${a.attempt}</td><td>${esc(a.status)}</td><td class=num>${a.phase === "start" ? "(set-up)" : fmt(a.first_step)}</td><td class=num>${fmt(a.setup_s, 1)}</td><td class=num>${fmt(a.duration_s, 1)}</td><td><code>${esc(a.error || "")}</code></td></tr>`).join("") + "</tbody></table>" : "";
  }

  // ------------------------------------------------------------------ rollouts: table, filters
  const TABLE = [["id", "rollout"], ["task", "task"], ["status", "status"], ["score", "score", 1], ["advantage", "adv", 1],
    ["step", "step", 1], ["version_min", "version", 1], ["staleness", "stale", 1], ["calls", "calls", 1],
    ["trained_tokens", "trained tok", 1], ["branch_points", "branches", 1], ["reason", "reason"]];
  function setupFilters() {
    const uniq = (k) => Array.from(new Set(ROWS.map((r) => r[C[k]] || ""))).filter((x) => x !== "").sort();
    $("#f-status").innerHTML += uniq("status").map((s) => `<option>${esc(s)}</option>`).join("") + '<option value="running">running</option>';
    $("#f-state").innerHTML += uniq("state").map((s) => `<option>${esc(s)}</option>`).join("");
    ["#f-text", "#f-status", "#f-state", "#f-smin", "#f-smax", "#f-vmin", "#f-vmax", "#f-branch"].forEach((s) => {
      $(s).addEventListener("input", () => { state.page = 0; applyFilters(); });
    });
    $("#rollout-table thead").innerHTML = "<tr>" + TABLE.map(([k, label, num]) => `<th data-k="${k}" class="${num ? "num" : ""}">${esc(label)}</th>`).join("") + "</tr>";
    $$("#rollout-table th").forEach((th) => { th.onclick = () => {
      const k = th.dataset.k; state.sortDir = state.sortKey === k ? -state.sortDir : (k === "id" || k === "task" ? 1 : -1);
      state.sortKey = k; applyFilters(); }; });
  }
  function num(sel) { const v = $(sel).value; return v === "" ? null : Number(v); }
  function applyFilters() {
    const text = $("#f-text").value.trim().toLowerCase(), st = $("#f-status").value, stt = $("#f-state").value;
    const smin = num("#f-smin"), smax = num("#f-smax"), vmin = num("#f-vmin"), vmax = num("#f-vmax"), br = $("#f-branch").checked;
    const out = ROWS.filter((r) => {
      if (st && (r[C.status] || "running") !== st) return false;
      if (stt && r[C.state] !== stt) return false;
      const s = r[C.score];
      if (smin != null && !(s != null && s >= smin)) return false;
      if (smax != null && !(s != null && s <= smax)) return false;
      if (vmin != null && !(r[C.version_max] != null && r[C.version_max] >= vmin)) return false;
      if (vmax != null && !(r[C.version_min] != null && r[C.version_min] <= vmax)) return false;
      if (br && !(r[C.branch_points] > 0)) return false;
      if (text && !`${r[C.id]} ${r[C.task]} ${r[C.group]} ${r[C.reason] || ""}`.toLowerCase().includes(text)) return false;
      return true;
    });
    const k = C[state.sortKey], dir = state.sortDir;
    out.sort((a, b) => {
      const x = a[k], y = b[k];
      if (x == null && y == null) return 0; if (x == null) return 1; if (y == null) return -1;
      return (x < y ? -1 : x > y ? 1 : 0) * dir;
    });
    state.filtered = out;
    $("#f-count").textContent = `${out.length} of ${ROWS.length} rollouts`;
    renderTable();
  }
  function renderTable() {
    const rows = state.filtered, pages = Math.max(1, Math.ceil(rows.length / PAGE));
    state.page = Math.min(state.page, pages - 1);
    const part = rows.slice(state.page * PAGE, (state.page + 1) * PAGE);
    $("#rollout-table tbody").innerHTML = part.map((r) => `<tr data-id="${esc(r[C.id])}" class="${r[C.id] === state.selected ? "selected" : ""}">` +
      TABLE.map(([key, , isNum]) => {
        const v = r[C[key]];
        if (key === "status") return `<td>${statusBadge(v || "running")}</td>`;
        if (key === "reason") return `<td class="reason" title="${esc(v || "")}">${esc(v || "")}</td>`;
        if (key === "version_min") return `<td class=num>${v == null ? "\u2013" : v === r[C.version_max] ? v : `${v}-${r[C.version_max]}`}</td>`;
        return `<td class="${isNum ? "num" : ""}">${fmt(v, key === "advantage" ? 2 : 3)}</td>`;
      }).join("") + "</tr>").join("");
    $$("#rollout-table tbody tr").forEach((tr) => { tr.onclick = () => { location.hash = "rollout=" + encodeURIComponent(tr.dataset.id); }; });
    $("#pager").innerHTML = pages > 1 ? `<button ${state.page ? "" : "disabled"} data-p="-1">previous</button>` +
      `page ${state.page + 1} of ${pages} <button ${state.page < pages - 1 ? "" : "disabled"} data-p="1">next</button>` : "";
    $$("#pager button").forEach((b) => { b.onclick = () => { state.page += Number(b.dataset.p); renderTable(); }; });
  }

  // ------------------------------------------------------------------ rollout detail
  window.gyreRollouts = function (group) { Object.assign(cache, group); };
  function load(id, cb) {
    if (cache[id]) return cb(cache[id]);
    const row = ROWS.find((r) => r[C.id] === id);
    if (!row) return cb(null, `no rollout ${id} in this report`);
    const shard = row[C.shard];
    if (loading[shard]) { loading[shard].push(() => cb(cache[id])); return; }
    loading[shard] = [() => cb(cache[id], cache[id] ? null : `data/rollouts/${shard}.js does not hold ${id}`)];
    const s = document.createElement("script");
    s.src = `data/rollouts/${encodeURIComponent(shard)}.js`;
    s.onload = () => { const cbs = loading[shard]; delete loading[shard]; cbs.forEach((f) => f()); };
    s.onerror = () => { delete loading[shard]; cb(null, `data/rollouts/${shard}.js is not built yet: the report is still building its rollouts (reload in a moment), or was stopped (run the report command again)`); };
    document.head.appendChild(s);
  }
  function openRollout(id) {
    state.selected = id;
    $$("#rollout-table tbody tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.id === id));
    $("#detail").innerHTML = `<p class="hint">loading ${esc(id)}...</p>`;
    load(id, (d, err) => { if (err || !d) { $("#detail").innerHTML = `<p class="error-line">${esc(err || "not found")}</p>`; return; } renderDetail(d); });
  }
  function renderDetail(d) {
    const st = (d.tree && d.tree.stats) || {};
    const kv = [["task", d.task], ["group", d.group], ["score", fmt(d.score)], ["advantage", fmt(d.advantage, 3)],
      ["trainer", d.state + (d.step != null ? ` at step ${d.step}` : "") + (d.dropped_reason ? ` (${d.dropped_reason})` : "")],
      ["policy versions", (d.versions || []).join(", ") || "\u2013"], ["staleness", fmt(d.staleness)],
      ["calls", (d.calls || []).length], ["tokens recorded / in tree", `${st.recorded_tokens || 0} / ${st.unique_tokens || 0}`],
      ["trainable / trained tokens", `${st.trainable_tokens || 0} / ${st.trainable_kept != null ? st.trainable_kept : "\u2013"}`],
      ["paths kept / total", `${st.paths_selected != null ? st.paths_selected : "\u2013"} / ${st.paths_total || 0}`]];
    let html = `<h3>${esc(d.id)} ${statusBadge(d.status)}</h3><div class="kv">` +
      kv.map(([k, v]) => `<span>${esc(k)}: <b>${esc(v)}</b></span>`).join("") + "</div>";
    if (d.reason) html += `<div class="error-line">${esc(((d.details || {}).error) || d.reason)}</div>`;
    if (d.log) html += `<details ${d.status && d.status !== "completed" ? "open" : ""}><summary>harness log (${esc(d.log.source)})</summary><pre class="log">${esc(d.log.text)}</pre></details>`;
    const grader = (d.details || {}).grader;
    if (grader && grader.tests && Object.keys(grader.tests).length) { // the per-test verdict: each named test's outcome
      html += `<table class="grid" style="width:auto;margin:4px 0"><thead><tr><th>test</th><th>outcome</th></tr></thead><tbody>` +
        Object.entries(grader.tests).map(([t, v]) => `<tr><td><code>${esc(t)}</code></td><td><span class="st ${v === "passed" ? "completed" : "infra_error"}">${esc(v)}</span></td></tr>`).join("") +
        "</tbody></table>";
    }
    const refused = grader && grader.tree && grader.tree.refused ? Object.entries(grader.tree.refused).filter(([, n]) => n) : [];
    if (refused.length) html += `<div class="error-line">the graded tree refused what the workspace wrote: ${esc(refused.map(([k, n]) => `${k} ${n}`).join(", "))}</div>`;
    if (grader && Object.keys(grader).length) html += `<details><summary>grader output</summary><pre class="log">${esc(JSON.stringify(grader, null, 1))}</pre></details>`;
    const harness = (d.details || {}).harness;
    if (harness && Object.keys(harness).length) html += `<details><summary>harness counters</summary><pre class="log">${esc(JSON.stringify(harness, null, 1))}</pre></details>`;
    if (d.tree) {
      html += `<h4>Tree <span class="hint">${d.tree.trained ? "green: the selected paths, trained" : "not trained: " + esc(d.status === "running" ? "still running" : d.status)}; click a node for the calls through it</span></h4><div id="tree" class="tree"></div>`;
      html += `<h4>Calls <span class="hint">in order; click one for its prompt (by role) and completion</span></h4><table id="calls" class="grid calls"><thead><tr><th>#</th><th>agent</th><th>role</th><th>why here</th><th class=num>version</th><th class=num>prompt</th><th class=num>output</th><th>finish</th><th class=num>logp mean</th></tr></thead><tbody></tbody></table><div id="call-view"></div>`;
    } else html += '<p class="hint">no model call was recorded for this rollout</p>';
    $("#detail").innerHTML = html;
    if (d.tree) { renderTree(d); renderCalls(d); if (d.calls.length) showCall(d, d.calls[d.calls.length - 1].i); }
  }
  function nodeText(n, max) {
    const t = n.pieces.filter((p) => !(p[2] & 2)).map((p) => p[1]).join("").replace(/\s+/g, " ").trim();
    return t.length > max ? "\u2026" + t.slice(t.length - max) : t;
  }
  function renderTree(d) {
    const nodes = d.tree.nodes, kids = nodes.map(() => []);
    nodes.forEach((n, i) => { if (n.p >= 0) kids[n.p].push(i); });
    const ends = {};
    d.calls.forEach((c) => { (ends[c.end] = ends[c.end] || []).push(c.i); });
    const kind = {};
    d.calls.forEach((c) => { kind[c.i] = c.kind; });
    const out = [];
    const stack = [[0, 0, null]];
    while (stack.length) {
      const [i, depth, label] = stack.pop();
      const n = nodes[i];
      const e = ends[i] ? ` <span class="lbl">\u2192 call ${ends[i].join(", ")} ends</span>` : "";
      const tr = n.trainable ? ` <span class="lbl">${n.kept ? "trained" : "trainable"} ${n.trainable}</span>` : "";
      const stale = n.stale != null ? ` <span class="lbl">stale ${n.stale}</span>` : "";
      out.push(`<div class="node ${n.kept ? "kept" : ""}" data-i="${i}" style="margin-left:${depth * 18}px" title="node ${i}: ${n.n} tokens, role ${esc(n.role)}, agent ${n.agent}, version ${n.version}; calls ${n.calls.join(", ")}">` +
        `${label ? `<span class="branch ${esc(label)}">${esc(label)}</span>` : ""}<span class="role role-${esc(n.role)}"></span>` +
        `<span>${n.n} tok</span> <span class="lbl">v${n.version}</span>${tr}${stale}${e} <span class="muted">${esc(nodeText(n, 70))}</span></div>`);
      // At a branch point the child holding the earliest call continues the line; the others are branches,
      // labelled with why their first call is there (retry, drift, compacted, subagent, ...).
      const ks = kids[i], line = Math.min(...ks.map((c) => nodes[c].first));
      for (let k = ks.length - 1; k >= 0; k--) {
        const c = ks[k];
        const k2 = kind[nodes[c].first];
        const label = ks.length > 1 && nodes[c].first !== line ? (k2 || "branch")
          : nodes[c].first !== n.first && k2 && k2 !== "continue" ? k2 : null; // a summary continues a context
        stack.push([c, ks.length > 1 ? depth + 1 : depth, label]);
      }
    }
    $("#tree").innerHTML = out.join("");
    $$("#tree .node").forEach((el) => { el.onclick = () => {
      const i = Number(el.dataset.i);
      const through = d.calls.filter((c) => pathOf(d, c.end).includes(i)).map((c) => c.i);
      $$("#tree .node").forEach((x) => x.classList.toggle("sel", x === el));
      $$("#calls tbody tr").forEach((tr) => { tr.style.fontWeight = through.includes(Number(tr.dataset.i)) ? "600" : ""; });
      if (through.length) showCall(d, through[0]);
    }; });
  }
  function pathOf(d, end) { const p = []; for (let i = end; i >= 0; i = d.tree.nodes[i].p) p.push(i); return p.reverse(); }
  function renderCalls(d) {
    $("#calls tbody").innerHTML = d.calls.map((c) => `<tr data-i="${c.i}"><td>${c.i}</td><td>${c.agent}${c.parent != null ? ` <span class=muted>(of ${c.parent})</span>` : ""}</td>` +
      `<td><span class="role role-${esc(c.role)}" style="display:inline-block;width:8px;height:8px;border-radius:50%"></span> ${esc(c.role)}</td>` +
      `<td><span class="branch ${esc(c.kind)}">${esc(c.kind)}</span></td><td class=num>${c.version}</td><td class=num>${c.prompt_tokens}</td>` +
      `<td class=num>${c.output_tokens}</td><td>${esc(c.finish)}</td><td class=num>${fmt(c.logprob_mean, 2)}</td></tr>`).join("");
    $$("#calls tbody tr").forEach((tr) => { tr.onclick = () => showCall(d, Number(tr.dataset.i)); });
  }
  function turnsOf(d, c) {
    // The prompt's pieces along the call's path, grouped into turns (a START piece opens one and names its
    // role); turn markers and the template's filler between turns are left out (flags: 1 start, 2 special,
    // 4 turn end). Pieces past the prompt are the completion, shown parsed instead.
    const turns = [];
    let pos = 0, cur = null;
    for (const i of pathOf(d, c.end)) {
      for (const [role, text, flags, ntok] of d.tree.nodes[i].pieces) {
        if (pos >= c.prompt_tokens) return turns.filter((t) => t.html.trim());
        if (flags & 1) { cur = { role, start: pos, html: "" }; turns.push(cur); }
        else if (flags & 4) cur = null;
        else if (!role) { // outside any turn: a template's own text is shown, its markers and newlines are not
          if (!(flags & 2) && text.trim()) {
            if (!cur || cur.role) { cur = { role: "", start: pos, html: "" }; turns.push(cur); }
            cur.html += esc(text);
          }
        } else {
          if (!cur) { cur = { role, start: pos, html: "" }; turns.push(cur); }
          cur.html += (flags & 2) ? `<span class="sp">${esc(text)}</span>` : esc(text);
        }
        pos += ntok;
      }
    }
    return turns.filter((t) => t.html.trim());
  }
  function showCall(d, i) {
    const c = d.calls.find((x) => x.i === i);
    if (!c) return;
    $$("#calls tbody tr").forEach((tr) => tr.classList.toggle("selected", Number(tr.dataset.i) === i));
    const turns = turnsOf(d, c);
    const fresh = turns.filter((t) => t.start >= c.shared), old = turns.filter((t) => t.start < c.shared);
    const turnHtml = (t, cls) => `<div class="turn ${esc(t.role)} ${cls || ""}"><span class="who">${esc(t.role || "template")}</span>${t.html}</div>`;
    const comp = c.completion || {};
    const tools = (comp.tool_calls || []).map((tc) => `<div class="toolcall"><b>tool call</b> ${esc(tc.name)} <code>${esc(JSON.stringify(tc.arguments))}</code></div>`).join("");
    const st = c.version != null && d.step != null ? ` &middot; staleness at training ${d.step - c.version}` : "";
    $("#call-view").innerHTML = `<h4>Call ${c.i} <span class="hint">agent ${c.agent}, ${esc(c.role)}, policy version ${c.version}${st}; ${c.prompt_tokens} prompt + ${c.output_tokens} output tokens; ${esc(c.kind)}` +
      `${c.kind === "continue" || c.kind === "drift" ? `, ${c.shared} tokens shared with this agent's previous call` : ""}</span></h4>` +
      (old.length ? `<details><summary>${old.length} earlier turn(s), as in this agent's previous call</summary>${old.map((t) => turnHtml(t)).join("")}</details>` : "") +
      fresh.map((t) => turnHtml(t, "new")).join("") +
      `<div class="turn assistant completion"><span class="who">completion (${esc(c.finish)})</span>${esc(comp.content || "")}${tools}${comp.error ? `<div class="error-line">${esc(comp.error)}</div>` : ""}</div>`;
  }

  // ------------------------------------------------------------------ tabs, routing
  const DRAW = { overview: () => { cards(); drawOverview(); }, tasks: drawTasks, steps: drawSteps, timeline: drawTimeline,
    rollouts: () => { setupFilters(); applyFilters(); } };
  function go(tab) {
    $$(".tab").forEach((s) => { s.hidden = s.id !== "tab-" + tab; });
    $$("#tabs a").forEach((a) => a.classList.toggle("active", a.dataset.tab === tab));
    if (!drawn[tab]) { drawn[tab] = true; DRAW[tab](); }
  }
  function route() {
    const h = decodeURIComponent(location.hash.slice(1));
    if (h.startsWith("rollout=")) { go("rollouts"); openRollout(h.slice(8)); return; }
    go(DRAW[h] ? h : "overview");
  }
  header();
  window.addEventListener("hashchange", route);
  route();
})();
