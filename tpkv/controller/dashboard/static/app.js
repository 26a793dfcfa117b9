// tpkv dashboard: polls /api/snapshot and renders it. Every string from the controller goes
// into the page as text (textContent, canvas), never as markup.
"use strict";
(() => {
  const REFRESH_MS = 2000;
  const TIER_COLORS = { L1: "#1f9e89", L2: "#3b6fd8", L3: "#e0912f", none: "#b9bec8" };
  const DIR_COLORS = { "L1->L2": "#d1453b", "L2->L1": "#1f9e89", "L2->L3": "#e0912f",
                       "L3->L2": "#3b6fd8" };
  const $ = (id) => document.getElementById(id);
  const BYTE_UNITS = [[1e9, "GB/s"], [1e6, "MB/s"], [1e3, "kB/s"], [1, "B/s"]];
  const CHOICES = {  // the cost model's choice for a session resumed now, in words
    none: ["all in L1", "every block is in L1: nothing to bring back"],
    load: ["load", "bring its blocks back from L2/L3 (cheaper than recomputing them)"],
    recompute: ["recompute", "recompute its missing blocks in a prefill (cheaper than loading)"] };
  const state = { data: null, renders: 0, sortKey: null, sortDir: -1, query: "", heat: null,
                  idle: false, clock: null, countPrefix: "" };
  let token = null;

  // ---- small helpers -------------------------------------------------------------------------
  function el(tag, opts, ...kids) {
    const node = document.createElement(tag);
    const o = opts || {};
    if (o.cls) node.className = o.cls;
    if (o.text !== undefined && o.text !== null) node.textContent = String(o.text);
    if (o.title) node.title = String(o.title);
    for (const [k, v] of Object.entries(o.data || {})) node.dataset[k] = String(v);
    for (const kid of kids) node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    return node;
  }
  const td = (text, cls, opts) => el("td", Object.assign({ text, cls }, opts || {}));
  const fill = (tbody, rows) => tbody.replaceChildren(...rows);
  const isNum = (x) => typeof x === "number" && isFinite(x);
  const fixed = (x, d) => (isNum(x) ? x.toFixed(d) : "-");
  const int = (x) => (isNum(x) ? String(Math.round(x)) : "-");
  const ms = (s) => (isNum(s) ? (s * 1e3).toFixed(2) : "-");
  function bytes(b) {
    if (!isNum(b)) return "-";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(b) >= 1024 && i < u.length - 1) { b /= 1024; i++; }
    return (i ? b.toFixed(1) : String(b)) + " " + u[i];
  }
  // three significant digits in the largest unit x reaches: "2.5 MB/s", "94.4 MB" (strip "/s")
  function sig(x, units, strip) {
    if (!isNum(x)) return "-";
    const [k, u] = units.find(([s]) => Math.abs(x) >= s) || units[units.length - 1];
    const v = x / k, d = v === 0 ? 0 : Math.max(0, 2 - Math.floor(Math.log10(Math.abs(v))));
    return String(Number(v.toFixed(d))) + " " + (strip ? u.replace(strip, "") : u);
  }
  function duration(s) {
    if (!isNum(s)) return "-";
    if (s < 120) return s.toFixed(0) + " s";
    if (s < 7200) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  const hhmmss = (unix) => new Date(unix * 1000).toLocaleTimeString();
  // controller time t_s as "N s ago" while steps run; once idle, the clock time it happened
  // (a growing "ago" would read as if the controller still confirmed things)
  const since = (t, now) => (!isNum(t) || !isNum(now) ? "-" : state.idle && state.clock
    ? "at " + hhmmss(state.clock - (now - t)) : duration(now - t) + " ago");
  const ago = (t, now) => (isNum(t) && isNum(now) ? fixed(t, 1) + " (" + duration(now - t) + " ago)" : "-");
  function kv(dl, pairs) {
    dl.replaceChildren(...pairs.flatMap(([k, v, bad]) => [
      el("dt", { text: k }), el("dd", { text: v, cls: bad ? "bad" : "" })]));
  }

  // ---- sections ------------------------------------------------------------------------------
  function renderHeader(d) {
    $("h-epoch").textContent = String(d.epoch.committed);
    $("h-sessions").textContent = String(d.num_sessions);
    $("h-tick").textContent = String(d.tick);
    $("h-uptime").textContent = duration(d.uptime_s);
    $("h-updated").textContent = new Date().toLocaleTimeString();
  }

  function tierCell(t, name) {
    const cell = el("td", { data: { tier: name } });
    if (!t || !t.enabled) { cell.append(el("span", { cls: "note", text: "disabled" })); return cell; }
    const occ = isNum(t.occupancy) ? t.occupancy : 0;
    const bar = el("div", { cls: "bar", title: name + ": low " + t.low_watermark + ", high " + t.high_watermark });
    const f = el("div", { cls: "fill " + name + (occ > t.high_watermark ? " over" : "") });
    f.style.width = Math.min(occ * 100, 100) + "%";
    const lo = el("div", { cls: "mark low" }), hi = el("div", { cls: "mark high" });
    lo.style.left = t.low_watermark * 100 + "%";
    hi.style.left = "calc(" + t.high_watermark * 100 + "% - 2px)";
    bar.append(f, lo, hi);
    const label = el("div", { cls: "cell-label" }, el("span", { cls: "num", text: t.used + " / " + t.slots }),
      " blocks \u00b7 " + fixed(occ * 100, 1) + "%");
    if (t.draining) label.append(" \u00b7 ", el("span", { cls: "drain", text: "draining" }));
    cell.append(bar, label);
    return cell;
  }

  function renderTiers(d) {
    const names = ["L1", "L2", "L3"];
    const ranks = Object.entries(d.ranks || {});
    const rows = ranks.length ? ranks : [["node", "no rank registered"]];
    $("tier-table").tHead.replaceChildren(el("tr", {}, el("th", { text: "rank", cls: "n" }),
      el("th", { text: "host" }), ...names.map((n) => el("th", { text: n }))));
    fill($("tier-table").tBodies[0], rows.map(([rank, host]) => el("tr", { data: { rank } },
      td(rank, "n"), td(host), ...names.map((n) => tierCell(d.tiers[n], n)))));
    const info = (d.dashboard && d.dashboard.info) || {};
    const per = isNum(info.block_bytes) ? names.filter((n) => d.tiers[n] && d.tiers[n].enabled)
      .map((n) => n + " " + bytes(d.tiers[n].used * info.block_bytes)).join(", ") : "";
    $("tier-note").textContent = "One slot mapping serves every rank: each holds its " +
      (info.tp_size ? "1/" + info.tp_size + " " : "") + "shard of the same blocks" +
      (per ? " (per rank: " + per + ")" : "") + ". Blocks in no tier: " +
      ((d.tiers.none || {}).blocks ?? 0) + ".";
    const acc = (d.dashboard && d.dashboard.accounting) || {};
    $("tier-accounting").replaceChildren(...Object.entries(acc).map(([n, a]) => el("div",
      { data: { tier: n }, title: a.parts.map((p) => p.name + ": " + p.what).join("\n") },
      el("b", { text: n + ": " }), a.text)));
  }

  function renderHealth(d) {
    const lat = d.plan_latency_us || {}, r = d.rates || {}, t = d.table || {};
    kv($("health-list"), [
      ["epoch committed / next", d.epoch.committed + " / " + d.epoch.next],
      ["plans pending", String(d.epoch.num_pending), d.epoch.num_pending > 8],
      ["restarts", String(d.restarts), d.restarts > 0],
      ["awaiting rebuild", d.awaiting_rebuild ? "yes" : "no", d.awaiting_rebuild],
      ["plan latency p50 / p99 / max", fixed(lat.p50 / 1e3, 2) + " / " + fixed(lat.p99 / 1e3, 2) +
        " / " + fixed(lat.max / 1e3, 2) + " ms (" + int(lat.count) + " steps)"],
      ...["h2d", "ssd_read", "prefill"].map((k) => {
        const x = (d.dashboard && d.dashboard.rates || {})[k];
        const names = { h2d: ["L2\u2192L1 per rank", r.h2d_bytes_per_s, "B/s"],
          ssd_read: ["L3\u2192L2 per rank", r.ssd_read_bytes_per_s, "B/s"],
          prefill: ["prefill", r.prefill_tokens_per_s, "tokens/s"] }[k];
        return [names[0], x ? x.text : fixed(names[1], 0) + " " + names[2]];
      }),
      ["block table", int(t.live_blocks) + " live of " + int(t.capacity) + " rows, " + bytes(t.metadata_bytes)],
      ["ranks registered", String(Object.keys(d.ranks || {}).length)],
      ["uptime", duration(d.uptime_s)],
    ]);
  }

  function renderTraffic(d) {
    const tr = d.dashboard && d.dashboard.traffic;
    const body = $("traffic-table").tBodies[0];
    if (!tr) { fill(body, [el("tr", {}, td("not recorded by this server", "note"))]); return; }
    const now = d.dashboard.now_s;
    const xs = tr.t_s.map((t) => t - now);
    $("traffic-window").textContent = "last " + duration(tr.window_s) + ", " + tr.totals.plans + " plans committed";
    window.tpkvCharts.lines($("chart-moves"), xs, tr.moves_per_s, DIR_COLORS, { windowS: tr.window_s });
    const ax = window.tpkvCharts.lines($("chart-bytes"), xs, tr.bytes_per_s, DIR_COLORS,
      { windowS: tr.window_s, units: BYTE_UNITS });
    $("bytes-caption").textContent = ax.unit + " (all ranks)";
    fill(body, tr.directions.map((dir) => el("tr", { data: { direction: dir } },
      el("td", {}, el("span", { cls: "swatch", title: dir }), dir),
      td(fixed(tr.latest.moves_per_s[dir], 1), "n"), td(sig(tr.latest.bytes_per_s[dir], BYTE_UNITS), "n"),
      td(String(tr.totals.moves[dir]), "n"), td(sig(tr.totals.bytes[dir], BYTE_UNITS, "/s"), "n"))));
    body.querySelectorAll(".swatch").forEach((s) => { s.style.background = DIR_COLORS[s.title] || "#888"; });
  }

  function sessionRow(s) {
    const t = s.tiers || {}, cost = s.cost || {};
    return { s, session: String(s.session), tokens: s.tokens, blocks: s.blocks, l1: t.L1 || 0,
      l2: t.L2 || 0, l3: t.L3 || 0, none: t.none || 0, tiers: (t.L1 || 0) / Math.max(s.blocks, 1),
      heat: s.heat, last_run_tick: s.last_run_tick, ticks_idle: s.ticks_idle ?? Infinity,
      pinned_blocks: (s.pinned_blocks || 0) + (s.auto_pinned_blocks || 0),
      choice: String(cost.choice), load_ms: cost.load_s, recompute_ms: cost.recompute_s };
  }

  function stack(r) {
    const bar = el("div", { cls: "stack", title: "L1 " + r.l1 + ", L2 " + r.l2 + ", L3 " + r.l3 + ", none " + r.none });
    for (const [k, n] of [["L1", r.l1], ["L2", r.l2], ["L3", r.l3], ["none", r.none]]) {
      if (!n) continue;
      const part = el("span", { cls: "sw-" + k });
      part.style.width = (100 * n) / Math.max(r.blocks, 1) + "%";
      bar.append(part);
    }
    return bar;
  }

  // With no session open, the last state that had some (dashboard.last_active) is shown,
  // labelled as such: a workload that closed them all leaves something to look at.
  function shownSessions(d) {
    const kept = d.dashboard && d.dashboard.last_active;
    if (d.num_sessions || !kept) return { d, kept: null };
    return { kept, d: Object.assign({}, d, { sessions: kept.sessions, num_sessions: kept.num_sessions,
      dashboard: Object.assign({}, d.dashboard, { heatmap: kept.heatmap }) }) };
  }

  function keptNote(id, kept) {
    $(id).hidden = !kept;
    $(id).textContent = kept ? "No session is open now. Shown: the " + kept.num_sessions +
      " sessions open at " + hhmmss(kept.t_unix_s) + " (step " + kept.tick + "), the fullest state " +
      "of the last minute with sessions open." : "";
  }

  // "rows a-b of n in view": the rows wholly inside the scrolled box, under its header
  function countVisible() {
    const box = $("session-scroll"), rows = [...$("session-table").tBodies[0].rows];
    const r = box.getBoundingClientRect(), head = $("session-table").tHead.getBoundingClientRect();
    const top = Math.max(r.top, head.bottom) - 1, bottom = r.bottom + 1;
    const seen = rows.map((x, i) => [i, x.getBoundingClientRect()])
      .filter(([, b]) => b.top >= top && b.bottom <= bottom).map(([i]) => i);
    const n = rows.length, c = $("session-count");
    c.dataset.visible = String(seen.length);
    c.dataset.listed = String(n);
    const view = !n ? "no rows" : seen.length === n ? "all " + n + " rows in view"
      : seen.length ? "rows " + (seen[0] + 1) + "\u2013" + (seen[seen.length - 1] + 1) + " of " + n +
        " in view (scroll the table for the rest)" : "0 of " + n + " rows in view (scroll the table)";
    c.textContent = state.countPrefix + view;
  }

  function renderSessions(data) {
    const { d, kept } = shownSessions(data);
    keptNote("sessions-kept", kept);
    const q = state.query.trim().toLowerCase();
    let rows = (d.sessions || []).map(sessionRow).filter((r) => !q || r.session.toLowerCase().includes(q));
    if (state.sortKey) {
      const k = state.sortKey, dir = state.sortDir;
      rows = rows.slice().sort((a, b) => {
        const x = a[k], y = b[k];
        if (typeof x === "string" || typeof y === "string") return dir * String(x).localeCompare(String(y));
        return dir * ((isNum(x) ? x : -Infinity) - (isNum(y) ? y : -Infinity)) || a.session.localeCompare(b.session);
      });
    }
    const listed = (d.sessions || []).length;
    state.countPrefix = (kept ? kept.num_sessions + " open at " + hhmmss(kept.t_unix_s) : d.num_sessions + " open") +
      (listed < d.num_sessions ? ", the " + listed + " most recent listed" : "") +
      (q ? ", " + rows.length + " match" : "") + "; ";
    fill($("session-table").tBodies[0], rows.map((r) => {
      const pins = (r.s.pins || []).map((p) => "[" + p[0] + ", " + p[1] + ")").join(" ");
      return el("tr", { data: { session: r.session } }, td(r.session, "name"), td(r.tokens, "n"),
        td(r.blocks, "n"), el("td", {}, stack(r)), td(r.l1, "n"), td(r.l2, "n"), td(r.l3, "n"),
        td(r.none, "n"), td(fixed(r.heat, 3), "n"), td(r.last_run_tick, "n"),
        td(isNum(r.s.ticks_idle) ? r.s.ticks_idle : "-", "n"),
        td(pinText(r.s), "n", { title: (r.s.pinned_blocks || 0) + " pinned by the caller" +
          (pins ? " (blocks " + pins + ")" : "") + ", " + (r.s.auto_pinned_blocks || 0) +
          " auto-pinned (attention above the threshold)" }),
        td((CHOICES[r.choice] || [r.choice])[0], "choice-" + r.choice,
          { title: (CHOICES[r.choice] || ["", ""])[1], data: { choice: r.choice } }),
        td(ms(r.load_ms), "n"), td(ms(r.recompute_ms), "n"));
    }));
    countVisible();
  }

  function pinText(s) {  // "-", "8", "2 auto", "8 + 2 auto"
    const p = s.pinned_blocks || 0, a = s.auto_pinned_blocks || 0;
    return !p && !a ? "-" : !a ? String(p) : (p ? p + " + " : "") + a + " auto";
  }

  function renderHeatmap(data) {
    const { d, kept } = shownSessions(data);
    keptNote("heat-kept", kept);
    const hm = d.dashboard && d.dashboard.heatmap;
    if (!hm) return;
    $("heat-sub").textContent = hm.rows_shown + " most recent sessions, " + hm.blocks_per_cell +
      " block" + (hm.blocks_per_cell > 1 ? "s" : "") + " per cell; stronger colour = hotter" +
      (hm.exact.every(Boolean) ? "" : "; grey names: tier counts only, positions unknown");
    fill($("heat-legend"), ["L1", "L2", "L3", "none"].map((k) => {
      const sw = el("span", { cls: "swatch sw-" + k });
      return el("span", { data: { tier: k } }, sw, k + " ", el("b", { cls: "count", text: hm.counts[k] }), " blocks");
    }));
    state.heat = { hm, layout: window.tpkvCharts.heatmap($("heat-canvas"), hm, TIER_COLORS) };
  }

  function heatTip(ev) {
    const tip = $("heat-tip"), h = state.heat;
    if (!h) return;
    const { hm, layout: g } = h, rect = ev.target.getBoundingClientRect();
    const x = ev.clientX - rect.left, y = ev.clientY - rect.top;
    const r = Math.floor((y - g.top) / g.rowH), c = Math.floor((x - g.labelW) / g.cellW);
    const code = r >= 0 && r < g.rows && c >= 0 ? hm.tiers[r][c] : undefined;
    if (!code || code === ".") { tip.hidden = true; return; }
    const first = c * g.k, last = Math.min(first + g.k, hm.blocks[r]) - 1;
    tip.textContent = hm.sessions[r] + " \u00b7 block" + (last > first ? "s " + first + "-" + last : " " + first) +
      " \u00b7 " + ({ 0: "none", 1: "L1", 2: "L2", 3: "L3" })[code] + " \u00b7 heat " + hm.heat[r][c] + "/9" +
      (hm.exact[r] ? "" : " (tier counts only)");
    tip.hidden = false;
    tip.style.left = Math.min(x + 12, rect.width - tip.offsetWidth) + "px";
    tip.style.top = y + 14 + "px";
  }

  function renderConsistency(d) {
    const c = d.dashboard && d.dashboard.consistency, now = d.dashboard && d.dashboard.now_s;
    const events = (d.events || []).filter((e) => e.kind === "mismatch" || e.kind === "resync");
    const incidents = c ? c.incidents : events.slice().reverse();
    const last = (k) => incidents.find((i) => i.kind === k);
    const lm = last("mismatch"), lr = last("resync");
    kv($("consistency-summary"), [
      ["committed epoch", String(d.epoch.committed)],
      ["mismatches", (c ? c.mismatches : events.filter((e) => e.kind === "mismatch").length) +
        (lm ? " (last: epoch " + lm.epoch + " at " + ago(lm.t_s, now) + ")" : ""), !!lm],
      ["resyncs", (c ? c.resyncs : events.filter((e) => e.kind === "resync").length) +
        (lr ? " (last: epoch " + lr.epoch + " at " + ago(lr.t_s, now) + ")" : "")],
    ]);
    const ranks = c ? c.ranks : Object.entries(d.ranks || {}).map(([rank, host]) => ({ rank, host }));
    fill($("rank-table").tBodies[0], ranks.map((r) => el("tr", { data: { rank: r.rank } },
      td(r.rank, "n"), td(r.host), td(r.confirmed_epoch ?? "-", "n"), td(since(r.confirmed_t_s, now), "n"),
      td(r.mismatches ?? "-", "n" + (r.mismatches ? " drain" : "")),
      td(isNum(r.last_mismatch_epoch) ? "epoch " + r.last_mismatch_epoch + ", " + since(r.last_mismatch_t_s, now) : "-"))));
    fill($("incident-table").tBodies[0], incidents.length ? incidents.slice(0, 12).map((i) => el("tr", {},
      td(fixed(i.t_s, 1), "n"), td(i.kind, "kind-" + i.kind), td("epoch " + i.epoch),
      td(i.ranks ? "ranks " + i.ranks.join(", ") : i.blocks !== undefined ? i.blocks + " blocks restored" : "", "details")))
      : [el("tr", {}, td("none", "note"))]);
  }

  function renderEvents(d) {
    const evs = (d.events || []).slice().reverse();
    fill($("event-table").tBodies[0], evs.map((e) => {
      const rest = Object.entries(e).filter(([k]) => !["t_s", "tick", "kind"].includes(k))
        .map(([k, v]) => k + "=" + (typeof v === "object" ? JSON.stringify(v)
          : typeof v === "number" && !Number.isInteger(v) ? v.toPrecision(4) : String(v))).join(" ");
      return el("tr", {}, td(fixed(e.t_s, 1), "n"), td(e.tick, "n"), td(e.kind, "kind-" + e.kind), td(rest, "details"));
    }));
  }

  // A vLLM instance (TpkvConnector with dashboard_port): each rank's host store and disk tier as
  // its last report said, and the scheduler's counters; the controller's sections stay hidden.
  function usage(used, cap, tier, text) {
    const cell = el("td", { data: { tier } });
    const bar = el("div", { cls: "bar" }), f = el("div", { cls: "fill " + tier });
    f.style.width = (cap > 0 ? Math.min((100 * used) / cap, 100) : 0) + "%";
    bar.append(f);
    cell.append(bar, el("div", { cls: "cell-label", text }));
    return cell;
  }

  function renderVllm(d) {
    const v = d.vllm || {}, c = v.counters || {}, ix = v.index || {};
    document.querySelectorAll("main > section").forEach((s) => { s.hidden = s.id !== "vllm"; });
    $("h-kind").textContent = "vLLM connector";
    $("h-epoch").textContent = "-";
    $("h-sessions").textContent = "-";
    $("h-tick").textContent = String(d.tick);
    $("h-uptime").textContent = duration(d.uptime_s);
    $("h-updated").textContent = new Date().toLocaleTimeString();
    $("vllm-sub").textContent = (v.model ? v.model + ", " : "") + v.num_ranks + " rank" +
      (v.num_ranks === 1 ? "" : "s") + ", " + v.block_tokens + " tokens and " + bytes(v.block_bytes) +
      " a block per rank";
    const ranks = v.ranks || [];
    fill($("vllm-tier-table").tBodies[0], ranks.length ? ranks.map((r) => el("tr", { data: { rank: r.rank } },
      td(r.rank, "n"),
      usage(r.host_bytes, r.host_capacity_bytes, "L2", r.host_blocks + " blocks, " + bytes(r.host_bytes) +
        " of " + bytes(r.host_capacity_bytes) + (r.queued_blocks ? " (" + r.queued_blocks + " queued for disk)" : "") +
        (r.pinned_bytes ? ", " + bytes(r.pinned_bytes) + " pinned" : "")),
      r.disk_enabled ? usage(r.disk_bytes, r.disk_capacity_bytes, "L3", r.disk_blocks + " blocks, " +
        bytes(r.disk_bytes) + " of " + bytes(r.disk_capacity_bytes)) : td("off", "note"),
      td(r.dropped_blocks ? r.dropped_blocks + " (" + bytes(r.dropped_bytes) + "; the queue needed " +
        bytes(r.needed_queue_bytes) + ")" : "0", "n" + (r.dropped_blocks ? " drain" : "")),
      td(r.reported_step, "n"))) : [el("tr", {}, td("no rank has reported yet", "note"))]);
    $("vllm-note").textContent = "The scheduler's index holds " + int(ix.blocks) + " blocks of " +
      int(ix.capacity) + (ix.pending ? " (" + ix.pending + " being written)" : "") + "; every rank holds " +
      "its shard of them. A block read back from disk is in both tiers until memory gives it up.";
    const pct = isNum(c.hit_rate) ? " (" + fixed(c.hit_rate * 100, 1) + "% of prompt tokens)" : "";
    kv($("vllm-counters"), [
      ["requests looked up", int(c.lookups)],
      ["prompt tokens", int(c.prompt_tokens)],
      ["in vLLM's own prefix cache", int(c.vllm_cached_tokens) + " tokens"],
      ["loaded from tpkv (hits)", int(c.hit_tokens) + " tokens" + pct],
      ["of them from disk", int(c.disk_hit_tokens) + " tokens"],
      ["prefill saved", int(c.saved_prefill_tokens) + " tokens"],
      ["loads failed (recomputed)", int(c.failed_load_blocks) + " blocks, " + int(c.recomputed_tokens) +
        " tokens recomputed", c.failed_load_blocks > 0],
      ["disk queue drops", int(c.disk_queue_dropped_blocks) + " blocks (" + bytes(c.disk_queue_dropped_bytes) +
        ")", c.disk_queue_dropped_blocks > 0],
      ["blocks written", int(ix.written) + " (" + int(ix.deduplicated) + " saves skipped: held already)"],
      ["blocks evicted / forgotten", int(ix.evicted) + " / " + int(ix.forgotten)],
    ]);
  }

  function render(d) {
    const act = (d.dashboard && d.dashboard.activity) || {};
    state.idle = act.state === "idle" || act.state === "waiting";
    state.clock = d.dashboard ? d.dashboard.snapshot_unix_s : null;
    if (d.kind === "vllm") {
      renderVllm(d);
      $("footer").textContent = "Read-only; refreshes every " + REFRESH_MS / 1000 + " s. JSON: /api/snapshot, " +
        "Prometheus: /metrics.";
      state.renders += 1;
      return;
    }
    renderHeader(d); renderTiers(d); renderHealth(d); renderTraffic(d); renderSessions(d);
    renderHeatmap(d); renderConsistency(d); renderEvents(d);
    const info = (d.dashboard && d.dashboard.info) || {};
    $("footer").textContent = "Read-only; refreshes every " + REFRESH_MS / 1000 + " s. JSON: /api/snapshot, " +
      "Prometheus: /metrics." + (d.dashboard && d.dashboard.geometry_text ? " KV cache: " +
      d.dashboard.geometry_text + "." : "");
    state.renders += 1;
  }

  function setStatus(cls, text) { const s = $("status"); s.className = "pill " + cls; s.textContent = text; }

  async function refresh() {
    try {
      const r = await fetch("/api/snapshot", { cache: "no-store", headers: token ? { Authorization: "Bearer " + token } : {} });
      if (r.status === 401) { $("token-box").hidden = false; setStatus("error", "token needed"); return; }
      if (!r.ok) throw new Error("HTTP " + r.status);
      state.data = await r.json();
      render(state.data);
      const act = (state.data.dashboard && state.data.dashboard.activity) || {};
      if (act.state === "idle") setStatus("idle", "idle since " + hhmmss(act.last_step_unix_s));
      else if (act.state === "waiting") setStatus("idle", "idle: no step yet");
      else setStatus("live", "live");
    } catch (e) {
      setStatus("stale", "offline: " + e.message);
    }
  }

  function init() {
    const m = /(?:^#|&)token=([^&]*)/.exec(location.hash);
    if (m) {
      token = decodeURIComponent(m[1]);
      sessionStorage.setItem("tpkv-token", token);
      history.replaceState(null, "", location.pathname);  // keep the token out of the address bar
    } else token = sessionStorage.getItem("tpkv-token");
    $("token-button").addEventListener("click", () => {
      token = $("token-input").value; sessionStorage.setItem("tpkv-token", token);
      $("token-box").hidden = true; refresh();
    });
    $("search").addEventListener("input", (e) => { state.query = e.target.value; if (state.data) renderSessions(state.data); });
    document.querySelectorAll("#session-table th[data-key]").forEach((th) => th.addEventListener("click", () => {
      const k = th.dataset.key, first = k === "session" || k === "choice" ? 1 : -1;
      if (state.sortKey !== k) { state.sortKey = k; state.sortDir = first; }
      else if (state.sortDir === first) state.sortDir = -first;
      else state.sortKey = null;  // third click: back to the snapshot's order (most recent first)
      document.querySelectorAll("#session-table th").forEach((h) => h.classList.remove("asc", "desc"));
      if (state.sortKey) th.classList.add(state.sortDir > 0 ? "asc" : "desc");
      if (state.data) renderSessions(state.data);
    }));
    $("session-scroll").addEventListener("scroll", countVisible);
    $("heat-canvas").addEventListener("mousemove", heatTip);
    $("heat-canvas").addEventListener("mouseleave", () => { $("heat-tip").hidden = true; });
    window.addEventListener("resize", () => { if (state.data) render(state.data); });
    refresh();
    setInterval(refresh, REFRESH_MS);
  }

  window.tpkvDashboard = { refresh, data: () => state.data, renders: () => state.renders };
  init();
})();
