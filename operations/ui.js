(() => {
  "use strict";
  const config = JSON.parse(document.getElementById("onceflow-config").textContent);
  const SVG = "http://www.w3.org/2000/svg";
  const BADGE = { width: 190, head: 34, line: 15, pad: 8, gap: 28, spacing: 10 };
  const numbers = new Intl.NumberFormat("en-US");
  const plan = document.querySelector("#plan svg");
  const graph = plan ? plan.querySelector("g.graph") : null;
  let shapes = { receivers: "", lanes: "", kinds: "" };
  let seen = false;

  // --- formatting -------------------------------------------------------------------
  function duration(ms) {
    const s = Math.round(Math.abs(ms) / 1000);
    const parts = (big, bigUnit, small, smallUnit) =>
      big + " " + bigUnit + (small ? " " + small + " " + smallUnit : "");
    if (s < 60) return s + " s";
    if (s < 3600) return parts(Math.floor(s / 60), "min", s % 60, "s");
    if (s < 100 * 3600) return parts(Math.floor(s / 3600), "h", Math.floor((s % 3600) / 60), "min");
    return parts(Math.floor(s / 86400), "d", Math.floor((s % 86400) / 3600), "h");
  }
  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
  }
  function utc(ms) {
    return new Date(ms).toISOString().slice(0, 19).replace("T", " ") + " UTC";
  }
  const FORMATS = {
    count: (v) => numbers.format(Number(v)),
    time: (v) => (Number(v) ? utc(Number(v)) : "none"),
    ago: (v) => (Number(v) ? duration(Date.now() - Number(v)) + " ago" : "never"),
    duration: (v) => duration(Number(v)),
    bytes: (v) => bytes(Number(v)),
    text: (v) => String(v),
  };
  function show(el, value) {
    if (value === null || value === undefined || value === "") {
      return el.dataset.empty || "\u2013";
    }
    return (FORMATS[el.dataset.format] || FORMATS.text)(value);
  }

  // --- where each number comes from ---------------------------------------------------
  function values(s) {
    const out = new Map();
    for (const [name, v] of Object.entries(s)) {
      if (v === null || typeof v !== "object") out.set(name, v);
    }
    for (const [rx, counters] of Object.entries(s.receivers || {})) {
      for (const [c, v] of Object.entries(counters)) out.set(rx + "." + c, v);
    }
    for (const [lane, v] of Object.entries(s.lanes || {})) {
      for (const [k, x] of Object.entries(v)) out.set("lanes:" + lane + "." + k, x);
    }
    for (const [k, v] of Object.entries(s.gc || {})) out.set("gc:" + k, v);
    for (const [k, v] of Object.entries(s.memory_by_kind || {})) {
      out.set("memory_by_kind:" + k, v);
    }
    return out;
  }
  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function svgEl(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function number(tag, field, format, extra) {
    return el(tag, Object.assign({ "data-field": field, "data-format": format,
      "data-value": "" }, extra || {}), "\u2013");
  }

  // --- the drawing: stages and sinks by name --------------------------------------------
  function anchorOf(rx) {
    if (!plan) return null;
    const byName = (attr, name) => {
      for (const g of plan.querySelectorAll("[" + attr + "]")) {
        if (g.getAttribute(attr) === name) return g;
      }
      return null;
    };
    if (rx.endsWith(config.delivered_suffix)) {
      const sink = rx.slice(0, -config.delivered_suffix.length);
      const g = byName("data-node", sink);
      if (g) return { g, where: "sink " + sink + " \u00b7 delivery" };
    }
    const stage = byName("data-stage", rx);
    if (stage) return { g: stage, where: "stage " + rx };
    const node = byName("data-node", rx);
    return node ? { g: node, where: "node " + rx } : null;
  }
  function byCounterOrder(a, b) {
    const order = config.counter_order;
    const ia = order.indexOf(a) < 0 ? order.length : order.indexOf(a);
    const ib = order.indexOf(b) < 0 ? order.length : order.indexOf(b);
    return ia - ib || a.localeCompare(b);
  }
  function countersOf(receivers, rx) {
    return Object.keys(receivers[rx]).sort(byCounterOrder);
  }
  function receiverOrder(receivers) {
    const top = (rx) => {
      const a = anchorOf(rx);
      return a ? a.g.getBBox().y : Infinity;
    };
    return Object.keys(receivers).sort((a, b) => top(a) - top(b) || a.localeCompare(b));
  }
  function drawBadges(receivers, order) {
    if (!plan || !graph) return;
    plan.querySelectorAll(".rx-badge, .rx-leader").forEach((n) => n.remove());
    const box = graph.getBBox();
    const x = box.x + box.width + BADGE.gap;
    let next = -Infinity;
    for (const rx of order) {
      const a = anchorOf(rx);
      if (!a) continue;
      const at = a.g.getBBox();
      const counters = countersOf(receivers, rx);
      const h = BADGE.head + counters.length * BADGE.line + BADGE.pad;
      const y = Math.max(at.y, next + BADGE.spacing);
      next = y + h;
      graph.appendChild(svgEl("path", { class: "rx-leader",
        d: `M${at.x + at.width},${at.y + Math.min(at.height / 2, 16)} L${x},${y + 16}` }));
      const badge = svgEl("g", { class: "rx-badge", "data-badge": rx,
        transform: `translate(${x},${y})` });
      badge.appendChild(svgEl("rect", { class: "frame", width: BADGE.width, height: h,
        rx: 6 }));
      badge.appendChild(svgEl("rect", { class: "head", x: 1, y: 1, width: BADGE.width - 2,
        height: BADGE.head - 6, rx: 5 }));
      badge.appendChild(svgEl("text", { class: "name", x: 10, y: 14 }, rx));
      badge.appendChild(svgEl("text", { class: "kind", x: 10, y: 25 }, a.where));
      counters.forEach((c, i) => {
        const ty = BADGE.head + 8 + i * BADGE.line;
        badge.appendChild(svgEl("text", { class: "label", x: 10, y: ty },
          config.counter_labels[c] || c));
        badge.appendChild(svgEl("text", { class: "value", x: BADGE.width - 10, y: ty,
          "text-anchor": "end", "data-field": rx + "." + c, "data-format": "count",
          "data-value": "" }, "\u2013"));
      });
      graph.appendChild(badge);
    }
    const all = plan.getBBox();
    plan.setAttribute("viewBox", [all.x - 6, all.y - 6, all.width + 12, all.height + 12]
      .join(" "));
    plan.style.maxWidth = Math.round((all.width + 12) * 1.25) + "px";
  }
  function fitPlan() {
    if (!plan) return;
    plan.removeAttribute("width");
    plan.removeAttribute("height");
    const all = plan.getBBox();
    plan.style.maxWidth = Math.round(all.width * 1.25) + "px";
  }

  // --- tables whose rows follow the data --------------------------------------------------
  function buildReceivers(receivers) {
    const order = receiverOrder(receivers);
    const columns = [];
    for (const rx of order) {
      for (const c of countersOf(receivers, rx)) if (!columns.includes(c)) columns.push(c);
    }
    columns.sort(byCounterOrder);
    const table = document.getElementById("receivers");
    const head = el("tr");
    head.appendChild(el("th", {}, "receiver"));
    for (const c of columns) {
      head.appendChild(el("th", { title: c }, config.counter_labels[c] || c));
    }
    table.tHead.replaceChildren(head);
    const body = document.createDocumentFragment();
    for (const rx of order) {
      const row = el("tr", { "data-receiver": rx });
      const name = el("th", {}, rx);
      const a = anchorOf(rx);
      name.appendChild(el("span", { class: "where" }, a ? a.where : "not in the drawing"));
      row.appendChild(name);
      for (const c of columns) {
        row.appendChild(c in receivers[rx] ? number("td", rx + "." + c, "count")
          : el("td", { class: "none" }, "\u00b7"));
      }
      body.appendChild(row);
    }
    if (!order.length) {
      body.appendChild(el("tr")).appendChild(el("td", { class: "empty" }, "no counters yet"));
    }
    table.tBodies[0].replaceChildren(body);
    drawBadges(receivers, order);
  }
  function buildLanes(lanes) {
    const body = document.createDocumentFragment();
    for (const lane of Object.keys(lanes).sort()) {
      const row = el("tr", { "data-lane": lane });
      row.appendChild(el("th", {}, lane));
      row.appendChild(number("td", "lanes:" + lane + ".event_time_ms", "time"));
      row.appendChild(number("td", "lanes:" + lane + ".active_ms", "ago"));
      body.appendChild(row);
    }
    if (!Object.keys(lanes).length) {
      body.appendChild(el("tr")).appendChild(el("td", { class: "empty", colspan: 3 },
        "none yet"));
    }
    document.querySelector("#lanes tbody").replaceChildren(body);
  }
  function buildKinds(kinds) {
    const body = document.createDocumentFragment();
    for (const kind of Object.keys(kinds).sort((a, b) => kinds[b] - kinds[a])) {
      const row = el("tr", { "data-kind": kind });
      row.appendChild(el("td", { title: kind }, config.kind_labels[kind] || kind));
      const bar = el("td", { class: "barcell" });
      bar.appendChild(el("div", { class: "bar" })).appendChild(el("span", {
        "data-share": kind }));
      row.appendChild(bar);
      row.appendChild(number("td", "memory_by_kind:" + kind, "bytes"));
      body.appendChild(row);
    }
    document.querySelector("#memory-kinds tbody").replaceChildren(body);
  }
  function shape(obj, inner) {
    return JSON.stringify(Object.keys(obj || {}).sort().map(
      (k) => (inner ? [k, Object.keys(obj[k]).sort()] : k)));
  }

  // --- one update ---------------------------------------------------------------------------
  function flash(node) {
    node.classList.add("bump");
    setTimeout(() => node.classList.remove("bump"), 600);
  }
  function update(s) {
    const next = { receivers: shape(s.receivers, true), lanes: shape(s.lanes),
      kinds: shape(s.memory_by_kind) };
    if (next.receivers !== shapes.receivers) buildReceivers(s.receivers || {});
    if (next.lanes !== shapes.lanes) buildLanes(s.lanes || {});
    if (next.kinds !== shapes.kinds) buildKinds(s.memory_by_kind || {});
    shapes = next;
    const found = values(s);
    for (const node of document.querySelectorAll("[data-field]")) {
      const value = found.get(node.dataset.field);
      const raw = value === null || value === undefined ? "" : String(value);
      const before = node.dataset.value;
      if (raw !== before || !seen || node.dataset.format === "ago") {
        node.dataset.value = raw;
        node.textContent = show(node, value);
        if (seen && before !== "" && Number(raw) > Number(before)) flash(node);
      }
    }
    const kept = document.querySelector('[data-derived="generations_kept"]');
    const generations = Object.keys(s.generations || {}).length;
    kept.dataset.value = String(generations);
    kept.textContent = String(generations);
    const lag = document.querySelector('[data-derived="watermark_lag_ms"]');
    if (s.watermark_ms) {
      const ms = Date.now() - s.watermark_ms;
      lag.dataset.value = String(ms);
      lag.textContent = duration(ms) + (ms >= 0 ? " behind now" : " ahead of now");
    } else {
      lag.dataset.value = "";
      lag.textContent = "none yet";
    }
    const total = s.memory_bytes || 0;
    for (const bar of document.querySelectorAll("[data-share]")) {
      const part = (s.memory_by_kind || {})[bar.dataset.share] || 0;
      bar.style.width = (total ? (100 * part) / total : 0).toFixed(1) + "%";
    }
    seen = true;
  }

  // --- polling ------------------------------------------------------------------------------
  const conn = document.getElementById("conn");
  const updated = document.getElementById("updated");
  const banner = document.getElementById("error");
  async function poll() {
    try {
      const answer = await fetch("status.json", { cache: "no-store" });
      const body = await answer.json();
      if (!answer.ok) throw new Error(body.error || "HTTP " + answer.status);
      if (body.waiting) {  // no state in Redis yet: the pipeline has not started
        conn.className = "conn";
        conn.textContent = "waiting";
        banner.className = "waiting";
        banner.textContent = "waiting for the pipeline to start \u00b7 " + body.waiting;
        banner.hidden = false;
        return;
      }
      update(body);
      conn.className = "conn ok";
      conn.textContent = "live";
      updated.dataset.value = String(Date.now());
      updated.textContent = "\u00b7 updated " + utc(Date.now()).slice(11);
      banner.hidden = true;
    } catch (err) {
      conn.className = "conn bad";
      conn.textContent = "no data";
      banner.className = "";
      banner.textContent = String(err.message || err);
      banner.hidden = false;
    } finally {
      setTimeout(poll, config.poll_ms);
    }
  }
  fitPlan();
  poll();
})();
