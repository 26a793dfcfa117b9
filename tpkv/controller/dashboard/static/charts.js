// tpkv dashboard: canvas drawing (line charts, block heat map). No data is turned into markup.
"use strict";
window.tpkvCharts = (() => {
  const INK = "#1d2330", MUTE = "#687185", GRID = "#e2e5eb";

  function setup(canvas, cssHeight) {
    const dpr = window.devicePixelRatio || 1;
    const w = Math.max(canvas.clientWidth, 200);
    const h = cssHeight;
    canvas.style.height = h + "px";
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    return { ctx, w, h };
  }

  function niceStep(v) {  // the smallest of 1, 2, 2.5, 5 x 10^k that is >= v
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v * (1 - 1e-9)) return m * p;
    return 10 * p;
  }

  function stepDecimals(step) {  // decimals that print every multiple of `step` exactly
    for (let d = 0; d <= 6; d++) {
      const v = step * Math.pow(10, d);
      if (Math.abs(v - Math.round(v)) < 1e-6 * Math.max(1, v)) return d;
    }
    return 6;
  }

  // The y axis of values up to `ymax`: a unit from `units` ([[scale, name], ...], largest
  // first: the largest that ymax reaches), about 4 nice steps in it, and their labels with
  // the decimals the step needs (0.25 -> 2, 2.5 -> 1, 50 -> 0), so no two labels read alike.
  function axis(ymax, units) {
    const us = units && units.length ? units : [[1, ""]];
    const [scale, unit] = us.find(([k]) => ymax >= k) || us[us.length - 1];
    const top = ymax / scale;
    const step = niceStep(top / 4), n = Math.max(1, Math.ceil(top / step - 1e-9));
    const d = stepDecimals(step);
    const labels = [];
    for (let i = 0; i <= n; i++) labels.push((step * i).toFixed(d));
    return { scale, unit, step, n, max: step * n, labels };
  }

  // xs: seconds relative to now (<= 0); series: {name: [y per x]}; colors: {name: css colour};
  // opts.units: the axis' units (see axis). Returns the axis drawn.
  function lines(canvas, xs, series, colors, opts) {
    const { ctx, w, h } = setup(canvas, opts.height || 190);
    const L = 52, R = 10, T = 8, B = 22, pw = w - L - R, ph = h - T - B;
    const windowS = opts.windowS || 300;
    let peak = 0;
    for (const ys of Object.values(series)) for (const y of ys) peak = Math.max(peak, y);
    const ax = axis(peak, opts.units);
    const ystep = ax.step, nlines = ax.n, ymax = ax.max;
    series = Object.fromEntries(Object.entries(series).map(([k, ys]) => [k, ys.map((y) => y / ax.scale)]));
    canvas.dataset.points = String(xs.length);
    canvas.dataset.ymax = String(ymax * ax.scale);
    canvas.dataset.unit = ax.unit;
    canvas.dataset.ticks = ax.labels.join("|");
    const X = (x) => L + pw * (1 + x / windowS), Y = (y) => T + ph * (1 - y / ymax);
    ctx.strokeStyle = GRID; ctx.fillStyle = MUTE; ctx.lineWidth = 1;
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (let i = 0; i <= nlines; i++) {
      const v = ystep * i, y = Math.round(Y(v)) + 0.5;
      ctx.beginPath(); ctx.moveTo(L, y); ctx.lineTo(L + pw, y); ctx.stroke();
      ctx.fillText(ax.labels[i], L - 6, y);
    }
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    const step = windowS > 200 ? 60 : 30;
    for (let s = 0; s <= windowS; s += step) {
      const x = Math.round(X(-s)) + 0.5;
      ctx.beginPath(); ctx.moveTo(x, T); ctx.lineTo(x, T + ph); ctx.stroke();
      ctx.textAlign = s === 0 ? "right" : s + step > windowS ? "left" : "center";
      ctx.fillText(s === 0 ? "now" : "-" + s + " s", x, T + ph + 5);
    }
    if (!xs.length) {
      ctx.fillStyle = MUTE; ctx.textBaseline = "middle";
      ctx.fillText("no committed plans in the window yet", L + pw / 2, T + ph / 2);
      return ax;
    }
    ctx.save();
    ctx.beginPath(); ctx.rect(L, T - 2, pw, ph + 4); ctx.clip();
    ctx.lineWidth = 1.8; ctx.lineJoin = "round";
    for (const [name, ys] of Object.entries(series)) {
      ctx.strokeStyle = colors[name] || INK;
      ctx.beginPath();
      xs.forEach((x, i) => (i ? ctx.lineTo(X(x), Y(ys[i])) : ctx.moveTo(X(x), Y(ys[i]))));
      ctx.stroke();
    }
    ctx.restore();
    return ax;
  }

  function mix(hex, t) {  // hex colour blended towards white; t = 1 keeps the colour
    const n = parseInt(hex.slice(1), 16);
    const c = [(n >> 16) & 255, (n >> 8) & 255, n & 255].map((v) => Math.round(255 + (v - 255) * t));
    return "rgb(" + c.join(",") + ")";
  }

  // hm: the payload's dashboard.heatmap; returns the layout, for tooltips.
  function heatmap(canvas, hm, tierColors) {
    const rows = hm.tiers.length;
    const rowH = rows > 32 ? 11 : 14, top = 4, axis = 20;
    const { ctx, w } = setup(canvas, Math.max(rows, 1) * rowH + top + axis);
    const labelW = 112, cols = Math.max(hm.columns, 1);
    const cellW = (w - labelW - 8) / cols;
    const codes = { "0": "none", "1": "L1", "2": "L2", "3": "L3" };
    canvas.dataset.rows = String(rows);
    canvas.dataset.columns = String(cols);
    ctx.textBaseline = "middle"; ctx.textAlign = "right";
    for (let r = 0; r < rows; r++) {
      const y = top + r * rowH;
      ctx.fillStyle = hm.exact[r] ? INK : MUTE;
      let name = hm.sessions[r];
      while (name.length > 3 && ctx.measureText(name).width > labelW - 10) name = name.slice(0, -2);
      if (name !== hm.sessions[r]) name += "\u2026";
      ctx.fillText(name, labelW - 6, y + rowH / 2);
      const tiers = hm.tiers[r], heat = hm.heat[r];
      for (let c = 0; c < tiers.length; c++) {
        const code = codes[tiers[c]];
        if (!code) continue;
        const level = heat[c] === "." ? 0 : Number(heat[c]);
        ctx.fillStyle = mix(tierColors[code], code === "none" ? 1 : 0.45 + (0.55 * level) / 9);
        ctx.fillRect(labelW + c * cellW, y + 1, Math.max(cellW - (cellW > 4 ? 1 : 0), 1), rowH - 2);
      }
    }
    ctx.fillStyle = MUTE; ctx.textAlign = "center"; ctx.textBaseline = "top";
    const k = hm.blocks_per_cell, yAxis = top + rows * rowH + 4;
    const tick = Math.max(1, niceStep((cols * k) / 10));
    for (let b = 0; b <= cols * k; b += tick) ctx.fillText(String(b), labelW + (b / k) * cellW, yAxis);
    ctx.textAlign = "right";
    ctx.fillText("block position", labelW - 6, yAxis);
    return { labelW, cellW, rowH, top, rows, cols, k };
  }

  return { lines, heatmap, mix, axis };
})();
