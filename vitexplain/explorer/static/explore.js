/* vitexplain explorer: draws the page from the JSON payload in <script id="vx-data">.
 * No network: every image is a data: URI, every array base64 in the payload.
 * Quantised rows (see vitexplain/explorer/quantize.py): {rows, cols, signed, scale, data};
 * value = code * scale / 255 (non-negative) or (code - 128) * scale / 127 (signed).
 * Heat canvases have one pixel per patch (opaque colours from the embedded lookup tables;
 * CSS scales them up and sets the overlay opacity), so a drawn pixel is exactly the colour of
 * its patch's value. Sets data-vx-ready="1" on <body> once every card has drawn. */
(function () {
  "use strict";
  var PAYLOAD = JSON.parse(document.getElementById("vx-data").textContent);
  var SEQ = PAYLOAD.colormaps.sequential, DIV = PAYLOAD.colormaps.diverging, MAT = PAYLOAD.colormaps.matrix;

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "text") node.textContent = attrs[k];
      else if (k === "class") node.className = attrs[k];
      else node.setAttribute(k, attrs[k]);
    });
    (children || []).forEach(function (c) { if (c) node.appendChild(c); });
    return node;
  }

  function bytes(b64) {
    var bin = atob(b64), out = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  /* Quantised rows -> {rows, cols, signed, row(i) -> Float32Array}. */
  function decodeQ(q) {
    if (!q) return null;
    var codes = bytes(q.data), scale = new Float32Array(bytes(q.scale).buffer);
    return {
      rows: q.rows, cols: q.cols, signed: q.signed,
      row: function (i) {
        var out = new Float32Array(q.cols), zero = q.signed ? 128 : 0;
        var step = scale[i] / (q.signed ? 127 : 255), off = i * q.cols;
        for (var j = 0; j < q.cols; j++) out[j] = (codes[off + j] - zero) * step;
        return out;
      }
    };
  }

  /* A row stored as prefix-key and patch-key parts (attention.py, _split). */
  function decodeSplit(s) {
    if (!s) return null;
    var pre = decodeQ(s.prefix), pat = decodeQ(s.patches);
    return {
      patches: function (r) { return pat.row(r); },
      full: function (r) {
        var a = pre ? pre.row(r) : new Float32Array(0), b = pat.row(r);
        var out = new Float32Array(a.length + b.length);
        out.set(a, 0); out.set(b, a.length);
        return out;
      }
    };
  }

  function maxAbs(v) { var m = 0; for (var i = 0; i < v.length; i++) m = Math.max(m, Math.abs(v[i])); return m; }

  /* Colour [r, g, b, a] of value v in a map whose largest |value| is m. Lookup index
   * k = round(255 t), t = v / m (non-negative maps) or 0.5 + 0.5 v / m (signed maps, which use
   * the diverging table). Overlays (ramp) fade low values: alpha = 51 + round(0.8 k) for
   * non-negative maps, min(255, 4 |k - 128|) for signed ones (zero is transparent); matrices
   * are opaque. */
  function colour(v, m, signed, lut, ramp) {
    var t = signed ? (m > 0 ? 0.5 + 0.5 * v / m : 0.5) : (m > 0 ? v / m : 0);
    var k = Math.max(0, Math.min(255, Math.round(t * 255)));
    var alpha = !ramp ? 255 : signed ? Math.min(255, 4 * Math.abs(k - 128)) : 51 + Math.round(0.8 * k);
    return [lut[3 * k], lut[3 * k + 1], lut[3 * k + 2], alpha];
  }

  /* Draw rows x cols values into a canvas of that many pixels, each row scaled by its own
   * largest |value| (matrices: rowwise, opaque, the matrix table) or all by the largest of the
   * whole block (overlays). */
  function drawValues(canvas, rows, cols, valueRows, signed, matrix) {
    canvas.width = cols; canvas.height = rows;
    var ctx = canvas.getContext("2d"), img = ctx.createImageData(cols, rows), m = 0;
    var lut = signed ? DIV : matrix ? MAT : SEQ;
    if (!matrix) valueRows.forEach(function (r) { m = Math.max(m, maxAbs(r)); });
    valueRows.forEach(function (r, i) {
      var mi = matrix ? maxAbs(r) : m;
      for (var j = 0; j < cols; j++) {
        var c = colour(r[j], mi, signed, lut, !matrix), o = 4 * (i * cols + j);
        img.data[o] = c[0]; img.data[o + 1] = c[1]; img.data[o + 2] = c[2]; img.data[o + 3] = c[3];
      }
    });
    ctx.putImageData(img, 0, 0);
  }

  function drawMap(canvas, grid, values, signed) {
    drawValues(canvas, grid[0], grid[1], splitRows(values, grid[0], grid[1]), signed, false);
  }

  function splitRows(values, rows, cols) {
    var out = [];
    for (var i = 0; i < rows; i++) out.push(values.subarray(i * cols, (i + 1) * cols));
    return out;
  }

  /* A colour bar with its end labels. */
  function legend(signed, scale, matrix) {
    var bar = el("canvas", { class: "vx-bar", width: 256, height: 1 }), ctx = bar.getContext("2d");
    var img = ctx.createImageData(256, 1);
    for (var i = 0; i < 256; i++) {
      var lut = signed ? DIV : matrix ? MAT : SEQ;
      img.data[4 * i] = lut[3 * i]; img.data[4 * i + 1] = lut[3 * i + 1]; img.data[4 * i + 2] = lut[3 * i + 2];
      img.data[4 * i + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
    var s = scale ? scale.toPrecision(3) : "max";
    var ends = signed ? ["\u2212" + s + " (against)", "0", "+" + s + " (for)"] : ["0", "", s];
    return el("div", { class: "vx-legend" }, [bar, el("div", { class: "vx-ends" },
      ends.map(function (t) { return el("span", { text: t }); }))]);
  }

  /* An image with a heat canvas on top; onPatch(index, pin) for hover (pin=false) and click. */
  function heatView(data, role, onPatch) {
    var h = data.size[0], w = data.size[1];
    var canvas = el("canvas", { class: "vx-heat", "data-vx": role });
    var marker = el("div", { class: "vx-marker" });
    var view = el("div", { class: "vx-view", style: "aspect-ratio:" + w + "/" + h },
      [el("img", { src: data.image, alt: data.name, draggable: "false" }), canvas, marker]);
    if (onPatch) {
      var at = function (ev) {
        var r = view.getBoundingClientRect();
        return [(ev.clientX - r.left) / r.width, (ev.clientY - r.top) / r.height];
      };
      view.addEventListener("mousemove", function (ev) { onPatch(at(ev), false); });
      view.addEventListener("click", function (ev) { onPatch(at(ev), true); });
      view.addEventListener("mouseleave", function () { onPatch(null, false); });
    }
    return { view: view, canvas: canvas, marker: marker };
  }

  function mark(marker, grid, patch) {
    if (patch === null || patch < 0) { marker.style.display = "none"; return; }
    var r = Math.floor(patch / grid[1]), c = patch % grid[1];
    marker.style.display = "block";
    marker.style.left = (100 * c / grid[1]) + "%"; marker.style.top = (100 * r / grid[0]) + "%";
    marker.style.width = (100 / grid[1]) + "%"; marker.style.height = (100 / grid[0]) + "%";
  }

  function tabs(names, role, onPick) {
    var bar = el("div", { class: "vx-tabs", role: "tablist" });
    var buttons = names.map(function (n, i) {
      var b = el("button", { type: "button", "data-vx": role, "data-index": String(i), text: n });
      b.addEventListener("click", function () { select(i); onPick(i); });
      bar.appendChild(b);
      return b;
    });
    function select(i) { buttons.forEach(function (b, j) { b.classList.toggle("vx-on", i === j); }); }
    select(0);
    return { node: bar, select: select };
  }

  function panel(title, children, narrow) {
    return el("div", { class: narrow ? "vx-panel vx-narrow" : "vx-panel" }, [el("h3", { text: title })].concat(children));
  }

  /* --- methods: one tab per method, one button per class ------------------------------- */
  function methodsPanel(data) {
    if (!data.methods.length) return null;
    var state = { m: 0, k: 0 };
    var maps = data.methods.map(function (m) { return decodeQ(m.maps); });
    var hv = heatView(data, "method", null);
    var legendBox = el("div"), info = el("p", { class: "vx-info" });
    var preds = data.targets || [];
    var classes = tabs(preds.map(function (p) { return p.label + (p.score === null ? "" : " " + p.score.toFixed(3)); }),
      "class", function (k) { state.k = k; draw(); });
    function draw() {
      var m = data.methods[state.m], q = maps[state.m], k = m.perClass ? state.k : 0;
      var values = q.row(k);
      drawMap(hv.canvas, m.grid, values, q.signed);
      legendBox.replaceChildren(legend(q.signed, maxAbs(values)));
      classes.node.style.visibility = m.perClass ? "visible" : "hidden";
      info.textContent = m.name + ": " + m.summary + (m.perClass ? " \u2014 target: " + preds[k].label : " (class-agnostic)");
    }
    var methodTabs = tabs(data.methods.map(function (m) { return m.name; }), "method-tab",
      function (i) { state.m = i; draw(); });
    draw();
    return panel("Methods", [methodTabs.node, classes.node, hv.view, legendBox, info], true);
  }

  /* --- attention: layer x head, query patches/tokens, rollout row, matrix ---------------- */
  /* A token set is [prefix, rows, cols]. ViT pages (attention.py) hold one N x N set for every
   * layer (att.grid) in one block of rows; hierarchical pages (stages.py) give every layer its
   * own query and key sets (att.sets), its own rows and, per layer, its heads. */
  function setSize(s) { return s[0] + s[1] * s[2]; }

  function layerGeometry(att) {
    var base = [att.prefix, att.grid[0], att.grid[1]], perLayer = Array.isArray(att.heads[0]);
    var sets = att.sets || att.layers.map(function () { return { q: base, k: base, stage: null }; });
    var heads = function (l) { return perLayer ? att.heads[l] : att.heads; };
    var probs, roll;
    if (Array.isArray(att.probs)) {
      probs = att.probs.map(decodeSplit); roll = att.rollout.map(decodeSplit);
    } else {
      var p = decodeSplit(att.probs), r = decodeSplit(att.rollout), n = setSize(base), H = att.heads.length;
      probs = sets.map(function (s, l) { return { full: function (i) { return p.full(l * H * n + i); } }; });
      roll = sets.map(function (s, l) { return { full: function (i) { return r.full(l * n + i); } }; });
    }
    return { sets: sets, heads: heads, probs: probs, roll: roll };
  }

  function tokenLabel(att, set, i) {
    if (i < set[0]) return att.tokens[i];
    var p = i - set[0];
    return "patch (" + Math.floor(p / set[2]) + "," + (p % set[2]) + ")";
  }

  /* The query of layer l for a selection: a prefix token {token: i} or a point {pos: [x, y]}
   * (fractions of the image), so a selection survives a switch to a layer on another grid. */
  function queryIndex(set, sel) {
    if (sel.token !== undefined && sel.token < set[0]) return sel.token;
    var pos = sel.pos || [0.5 / set[2], 0.5 / set[1]];
    var r = Math.max(0, Math.min(set[1] - 1, Math.floor(pos[1] * set[1])));
    var c = Math.max(0, Math.min(set[2] - 1, Math.floor(pos[0] * set[2])));
    return set[0] + r * set[2] + c;
  }

  function selectionOf(set, q) {
    if (q < set[0]) return { token: q };
    var p = q - set[0];
    return { pos: [((p % set[2]) + 0.5) / set[2], (Math.floor(p / set[2]) + 0.5) / set[1]] };
  }

  /* A small opaque heat tile (sequential table, scaled to its own largest value). */
  function drawTile(canvas, grid, values) {
    canvas.width = grid[1]; canvas.height = grid[0];
    var ctx = canvas.getContext("2d"), img = ctx.createImageData(grid[1], grid[0]), m = maxAbs(values);
    for (var j = 0; j < values.length; j++) {
      var c = colour(values[j], m, false, SEQ, false), o = 4 * j;
      img.data[o] = c[0]; img.data[o + 1] = c[1]; img.data[o + 2] = c[2]; img.data[o + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
  }

  function pairName(att, geo, pair) {
    var h = geo.heads(pair[0])[pair[1]];
    return "L" + att.layerIndex[pair[0]] + (h === "mean" ? " mean" : " H" + h);
  }

  function gridText(set) { return set[1] + "\u00d7" + set[2] + (set[0] ? " + " + set[0] + " prefix" : ""); }

  /* Several (layer, head) pairs are shown as the entrywise mean of their attention matrices, so
   * they must share the same query set and the same key set (prefix tokens and grid). Pairs on
   * other grids (another stage of a hierarchical model, or pooled keys) are refused rather than
   * resampled: the page does not carry the footprints (strided, overlapping convs) that would map
   * one grid onto another, and a nearest-neighbour guess would change the values shown. On ViT
   * pages every layer shares one set, so any pairs may be combined. */
  function sameSets(geo, a, b) {
    var s = geo.sets[a], t = geo.sets[b];
    return s.q.join() === t.q.join() && s.k.join() === t.k.join();
  }

  function attentionPanel(data) {
    var att = data.attention;
    if (!att) return null;
    if (!att.probs) return panel("Attention", [el("p", { class: "vx-note", text: att.note })]);
    var geo = layerGeometry(att), L = att.layers.length;
    var first = att.prefix > 0 ? { token: 0 } : { pos: null };
    /* query/pinned: the selected query as a token or an image point (queryIndex).
     * pairs: the (layer, head) pairs whose mean the views show; set by the layer and head menus
     * (one pair, or every head of the layer for "mean of heads") or by the overview (click: one
     * pair; ctrl/shift-click or "select several": add or remove a pair, across layers on the
     * same token sets, see sameSets). layer/head: the menus; the rollout and the matrix's rows
     * follow state.layer (the latest pair selected). */
    var state = { layer: L - 1, head: 0, query: first, pinned: first, pairs: [[L - 1, 0]], refused: "" };
    var layerSel = el("select", { "data-vx": "layer" }, att.layers.map(function (name, i) {
      var s = geo.sets[i], where = s.stage === null || s.stage === undefined ? "" :
        ", stage " + s.stage + ": " + s.q[1] + "\u00d7" + s.q[2] + " queries, " + s.k[1] + "\u00d7" + s.k[2] + " keys";
      return el("option", { value: String(i), text: "layer " + att.layerIndex[i] + " (" + name + where + ")" });
    }));
    var headSel = el("select", { "data-vx": "head" });
    /* The head menu of state.layer: its heads, their mean, and "selected heads" (enabled only
     * while several pairs are shown). A head that the layer lacks falls back to the mean. */
    function headOptions() {
      var labels = geo.heads(state.layer), H = labels.length;
      var options = labels.map(function (h, i) { return [String(i), h === "mean" ? "mean" : "head " + h]; });
      if (H > 1) options.push(["mean", "mean of heads"]);
      options.push(["sel", "selected heads"]);
      headSel.replaceChildren.apply(headSel, options.map(function (o) { return el("option", { value: o[0], text: o[1] }); }));
      headSel.lastChild.disabled = state.pairs.length === 1;
      if (state.head !== "mean" && state.head >= H) state.head = H > 1 ? "mean" : 0;
    }
    function fromMenus() {
      var H = geo.heads(state.layer).length;
      if (state.head === "mean") { state.pairs = []; for (var h = 0; h < H; h++) state.pairs.push([state.layer, h]); }
      else state.pairs = [[state.layer, state.head]];
      syncMenus();
    }
    function syncMenus() {
      var one = state.pairs.length === 1, H;
      if (one) { state.layer = state.pairs[0][0]; state.head = state.pairs[0][1]; }
      headOptions();
      H = geo.heads(state.layer).length;
      layerSel.value = String(state.layer);
      headSel.value = one ? String(state.head) : (state.head === "mean" && state.pairs.length === H &&
        state.pairs.every(function (p) { return p[0] === state.layer; })) ? "mean" : "sel";
    }
    syncMenus();
    layerSel.addEventListener("change", function () {
      state.layer = +layerSel.value; headOptions(); state.refused = ""; fromMenus(); draw();
    });
    headSel.addEventListener("change", function () {
      if (headSel.value === "sel") return;
      state.head = headSel.value === "mean" ? "mean" : +headSel.value; state.refused = ""; fromMenus(); draw();
    });
    var prefixButtons = att.tokens.map(function (t, i) {
      var b = el("button", { type: "button", "data-vx": "token", "data-index": String(i), text: t });
      b.addEventListener("click", function () { state.pinned = state.query = { token: i }; draw(); });
      return b;
    });
    function onPatch(pos, pin) {
      state.query = pos === null ? state.pinned : { pos: pos };
      if (pin) state.pinned = state.query;
      draw();
    }
    var attView = heatView(data, "attn", onPatch), rollView = heatView(data, "rollout", onPatch);
    var matrix = el("canvas", { class: "vx-matrix", "data-vx": "matrix" });
    var rowMark = el("div", { class: "vx-rowmark" });
    var matrixBox = el("div", { class: "vx-matrix-box" }, [matrix, rowMark]);
    var matrixInfo = el("p", { class: "vx-info", text: "hover the matrix: query \u2192 key" });
    var matrixCaption = el("figcaption");
    var info = el("p", { class: "vx-info", "data-vx": "query-info" });

    /* --- overview: every layer x head for the chosen query, each tile on its layer's key grid */
    var several = el("input", { type: "checkbox", "data-vx": "several" });
    var cols = 0, labels = geo.heads(0).join();
    for (var l0 = 0; l0 < L; l0++) {
      cols = Math.max(cols, geo.heads(l0).length);
      if (geo.heads(l0).join() !== labels) labels = null;
    }
    var tiles = [], grid = el("div", { class: "vx-overview", "data-vx": "overview",
      style: "grid-template-columns:auto repeat(" + cols + ", 1fr)" });
    grid.appendChild(el("span"));
    for (var c0 = 0; c0 < cols; c0++) {
      var h0 = labels ? geo.heads(0)[c0] : String(c0);
      grid.appendChild(el("span", { class: "vx-ov-label", text: h0 === "mean" ? "mean" : "h" + h0 }));
    }
    for (var li = 0; li < L; li++) {
      var s0 = geo.sets[li], Hl = geo.heads(li).length;
      grid.appendChild(el("span", { class: "vx-ov-label", text: "L" + att.layerIndex[li],
        title: "queries " + gridText(s0.q) + ", keys " + gridText(s0.k) }));
      for (var hi = 0; hi < cols; hi++) {
        if (hi >= Hl) { grid.appendChild(el("span")); continue; }  /* this layer has fewer heads */
        (function (layer, head) {
          var c = el("canvas", { class: "vx-tile", "data-vx": "overview-tile", "data-layer": String(layer),
            "data-head": String(head), title: pairName(att, geo, [layer, head]) + ", keys " + gridText(geo.sets[layer].k) });
          c.addEventListener("click", function (ev) { pick([layer, head], ev.ctrlKey || ev.metaKey || ev.shiftKey || several.checked); });
          tiles.push({ canvas: c, pair: [layer, head] });
          grid.appendChild(c);
        })(li, hi);
      }
    }
    function pick(pair, add) {
      var at = -1;
      state.refused = "";
      state.pairs.forEach(function (p, i) { if (p[0] === pair[0] && p[1] === pair[1]) at = i; });
      if (add && at < 0 && !sameSets(geo, state.pairs[0][0], pair[0])) {
        var s = geo.sets[pair[0]], t = geo.sets[state.pairs[0][0]];
        state.refused = "not added: " + pairName(att, geo, pair) + " has queries " + gridText(s.q) + " and keys " +
          gridText(s.k) + ", the selection queries " + gridText(t.q) + " and keys " + gridText(t.k) +
          "; only pairs on the same token sets are averaged (click it alone to show it)";
        draw();
        return;
      }
      if (!add) state.pairs = [pair];
      else if (at >= 0 && state.pairs.length > 1) state.pairs.splice(at, 1);
      else if (at < 0) state.pairs.push(pair);
      var last = state.pairs[state.pairs.length - 1];  /* the menus follow the latest pair still selected */
      state.layer = last[0];
      state.head = last[1];
      syncMenus();
      draw();
    }
    var selInfo = el("p", { class: "vx-info", "data-vx": "selection" });

    function pairRow(pair, q) { return geo.probs[pair[0]].full(pair[1] * setSize(geo.sets[pair[0]].q) + q); }
    /* The views' row of query q (an index into the query set that every selected pair shares):
     * the mean over the selected (layer, head) pairs. */
    function selRow(q) {
      if (state.pairs.length === 1) return pairRow(state.pairs[0], q);
      var acc = null, k = state.pairs.length;
      state.pairs.forEach(function (pair) {
        var r = pairRow(pair, q);
        if (!acc) acc = new Float32Array(r.length);
        for (var j = 0; j < r.length; j++) acc[j] += r[j] / k;
      });
      return acc;
    }
    function drawMatrix() {
      var s = geo.sets[state.layer], nq = setSize(s.q), nk = setSize(s.k), rows = [];
      for (var q = 0; q < nq; q++) rows.push(selRow(q));
      drawValues(matrix, nq, nk, rows, false, true);
      matrixCaption.textContent = "attention matrix: rows are queries (" + matrixTicks(att, s.q) + "), columns keys (" +
        matrixTicks(att, s.k) + "); each row scaled to its largest value";
    }
    var drawn = null;
    function draw() {
      var key = state.layer + ":" + JSON.stringify(state.pairs), s = geo.sets[state.layer];
      if (drawn !== key) { drawMatrix(); drawn = key; }
      var q = queryIndex(s.q, state.query), row = selRow(q);
      var pinned = queryIndex(s.q, state.pinned) === q;
      var patches = row.subarray(s.k[0]), rrow = geo.roll[state.layer].full(q);
      drawMap(attView.canvas, [s.k[1], s.k[2]], patches, false);
      drawMap(rollView.canvas, att.grid, rrow.subarray(att.prefix), false);
      tiles.forEach(function (t) {
        var ts = geo.sets[t.pair[0]];
        drawTile(t.canvas, [ts.k[1], ts.k[2]], pairRow(t.pair, queryIndex(ts.q, state.query)).subarray(ts.k[0]));
        t.canvas.classList.toggle("vx-on", state.pairs.some(function (p) { return p[0] === t.pair[0] && p[1] === t.pair[1]; }));
        t.canvas.classList.toggle("vx-apart", !sameSets(geo, state.pairs[0][0], t.pair[0]));
      });
      var patch = q - s.q[0], qgrid = [s.q[1], s.q[2]];
      mark(attView.marker, qgrid, patch); mark(rollView.marker, qgrid, patch);
      prefixButtons.forEach(function (b, i) { b.classList.toggle("vx-on", i === q && q < s.q[0]); });
      var nq = setSize(s.q);
      rowMark.style.top = (100 * q / nq) + "%"; rowMark.style.height = Math.max(100 / nq, 0.4) + "%";
      var onPrefix = 0;
      for (var i = 0; i < s.k[0]; i++) onPrefix += row[i];
      var grids = s.stage === null || s.stage === undefined ? "" : "; stage " + s.stage + ": queries on a " + s.q[1] +
        "\u00d7" + s.q[2] + " grid, keys on " + s.k[1] + "\u00d7" + s.k[2] + ", rollout on the " + att.grid[0] +
        "\u00d7" + att.grid[1] + " input grid";
      info.textContent = "query " + tokenLabel(att, s.q, q) + (pinned ? " (pinned)" : "") +
        ": largest patch weight " + maxAbs(patches).toPrecision(3) +
        (s.k[0] ? ", on prefix tokens " + onPrefix.toFixed(3) : "") + "; colours scaled to each row's largest patch value" +
        grids;
      selInfo.textContent = "showing " + state.pairs.map(function (p) { return pairName(att, geo, p); }).join(" + ") +
        (state.pairs.length > 1 ? " (mean of " + state.pairs.length + ")" : "") + (state.refused ? "; " + state.refused : "");
    }
    function matrixCell(ev) {
      var r = matrix.getBoundingClientRect(), s = geo.sets[state.layer], nq = setSize(s.q), nk = setSize(s.k);
      return [Math.min(nq - 1, Math.floor((ev.clientY - r.top) / r.height * nq)),
              Math.min(nk - 1, Math.floor((ev.clientX - r.left) / r.width * nk))];
    }
    matrix.addEventListener("mousemove", function (ev) {
      var cell = matrixCell(ev), s = geo.sets[state.layer];
      var v = selRow(cell[0])[cell[1]];
      matrixInfo.textContent = "query " + tokenLabel(att, s.q, cell[0]) + " \u2192 key " + tokenLabel(att, s.k, cell[1]) +
        ": " + v.toFixed(4);
    });
    matrix.addEventListener("click", function (ev) {
      state.pinned = state.query = selectionOf(geo.sets[state.layer].q, matrixCell(ev)[0]);
      draw();
    });
    draw();
    var views = el("div", { class: "vx-pair" }, [
      el("figure", {}, [attView.view, el("figcaption", { text: "attention of the query (selected layers and heads), on the layer's key grid" })]),
      el("figure", {}, [rollView.view, el("figcaption", { text: "rollout row of the query (up to this layer)" })]),
      el("figure", {}, [matrixBox, matrixCaption, matrixInfo])
    ]);
    var controls = el("div", { class: "vx-controls" }, [layerSel, headSel].concat(
      prefixButtons.length ? [el("span", { text: " query: " })].concat(prefixButtons) : []));
    var overview = el("div", { class: "vx-ov-box" }, [
      el("h4", { text: "all layers \u00d7 heads for this query, each on its layer's key grid (click: show one; " +
        "ctrl/shift-click or \u201cselect several\u201d: add or remove; dimmed tiles are on other token sets and cannot be added)" }),
      el("label", { class: "vx-info" }, [several, el("span", { text: " select several" })]), grid, selInfo]);
    var note = att.note ? el("p", { class: "vx-note", text: att.note }) : null;
    return panel("Attention", [controls, views, info, overview,
      el("div", { class: "vx-pair" }, [legend(false, 0), legend(false, 0, true)]), note]);
  }

  function matrixTicks(att, set) {
    var parts = att.tokens.slice(0, set[0]).map(function (t, i) { return t + " = " + i; });
    parts.push("patch (r,c) = " + set[0] + " + r\u00b7" + set[2] + " + c");
    return parts.join(", ");
  }

  /* --- captioners: words, per-word maps, word x patch alignment -------------------------- */
  function captionPanel(data) {
    var cap = data.caption;
    if (!cap || !cap.methods.length) return null;
    var state = { m: 0, w: 0 };
    var maps = cap.methods.map(function (m) { return decodeQ(m.maps); });
    var hv = heatView(data, "word-map", null);
    var align = el("canvas", { class: "vx-align", "data-vx": "align" });
    var alignMark = el("div", { class: "vx-rowmark" });
    var info = el("p", { class: "vx-info" }), legendBox = el("div");
    var wordButtons = cap.words.map(function (word, i) {
      var b = el("button", { type: "button", "data-vx": "word", "data-index": String(i), text: word });
      b.addEventListener("click", function () { state.w = i; draw(); });
      return b;
    });
    var prev = el("button", { type: "button", "data-vx": "prev-word", text: "\u25c0" });
    var next = el("button", { type: "button", "data-vx": "next-word", text: "\u25b6" });
    prev.addEventListener("click", function () { step(-1); });
    next.addEventListener("click", function () { step(1); });
    function step(d) { state.w = Math.max(0, Math.min(cap.words.length - 1, state.w + d)); draw(); }
    var drawnAlign = -1;
    function draw() {
      var m = cap.methods[state.m], q = maps[state.m], t = Math.max(cap.words.length, 1);
      var cols = m.grid[0] * m.grid[1];
      if (drawnAlign !== state.m) {
        var rows = [];
        for (var i = 0; i < t; i++) rows.push(q.row(i));
        drawValues(align, t, cols, rows, q.signed, true);
        align.style.height = (18 * t) + "px";
        drawnAlign = state.m;
      }
      var values = q.row(Math.min(state.w, t - 1));
      drawMap(hv.canvas, m.grid, values, q.signed);
      legendBox.replaceChildren(legend(q.signed, maxAbs(values)));
      wordButtons.forEach(function (b, i) { b.classList.toggle("vx-on", i === state.w); });
      alignMark.style.top = (100 * state.w / t) + "%"; alignMark.style.height = (100 / t) + "%";
      info.textContent = m.name + ": " + m.summary + " \u2014 word " + (state.w + 1) + " of " + cap.words.length +
        ": \u201c" + (cap.words[state.w] || "") + "\u201d";
    }
    var methodTabs = tabs(cap.methods.map(function (m) { return m.name; }), "caption-tab",
      function (i) { state.m = i; draw(); });
    align.addEventListener("click", function (ev) {
      var r = align.getBoundingClientRect();
      state.w = Math.min(cap.words.length - 1, Math.floor((ev.clientY - r.top) / r.height * cap.words.length));
      draw();
    });
    var box = el("div", { class: "vx-caption", tabindex: "0" });
    box.addEventListener("keydown", function (ev) {
      if (ev.key === "ArrowLeft") step(-1);
      if (ev.key === "ArrowRight") step(1);
    });
    draw();
    var labels = el("div", { class: "vx-align-labels" }, cap.words.map(function (w) { return el("span", { text: w }); }));
    [methodTabs.node, el("div", { class: "vx-words" }, [prev].concat(wordButtons, [next])), hv.view, legendBox, info,
      el("h4", { text: "word \u00d7 patch alignment (rows: words, columns: patches in reading order)" }),
      el("div", { class: "vx-align-box" }, [labels, el("div", { class: "vx-matrix-box" }, [align, alignMark])])
    ].forEach(function (c) { box.appendChild(c); });
    return panel("Caption, word by word", [box]);
  }

  /* --- one card per image ---------------------------------------------------------------- */
  function card(data, index) {
    var preds = (data.predictions || []).map(function (p) {
      return el("li", { text: p.label + (p.score === null ? "" : " \u2014 " + p.score.toFixed(3)) });
    });
    var head = el("header", {}, [el("h2", { text: data.name }),
      el("ol", { class: "vx-preds", "data-vx": "predictions" }, preds)]);
    var notes = (data.notes || []).map(function (t) { return el("p", { class: "vx-note", text: t }); });
    var panels = [captionPanel(data), methodsPanel(data), attentionPanel(data)];
    return el("section", { class: "vx-card", "data-vx-card": String(index) },
      [head].concat(notes, [el("div", { class: "vx-panels" }, panels)]));
  }

  function start() {
    var root = document.getElementById("vx-root");
    var opacity = document.getElementById("vx-opacity"), smooth = document.getElementById("vx-smooth");
    opacity.addEventListener("input", function () { document.body.style.setProperty("--vx-alpha", opacity.value / 100); });
    smooth.addEventListener("change", function () { document.body.classList.toggle("vx-smooth", smooth.checked); });
    PAYLOAD.images.forEach(function (data, i) { root.appendChild(card(data, i)); });
    var images = Array.prototype.slice.call(document.images);
    Promise.all(images.map(function (im) { return im.decode().catch(function () {}); })).then(function () {
      requestAnimationFrame(function () { document.body.setAttribute("data-vx-ready", "1"); });
    });
  }

  start();
})();
