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

  function attentionPanel(data) {
    var att = data.attention;
    if (!att) return null;
    if (!att.probs) return panel("Attention", [el("p", { class: "vx-note", text: att.note })]);
    var geo = layerGeometry(att);
    var first = att.prefix > 0 ? { token: 0 } : { pos: null };
    var state = { layer: att.layers.length - 1, head: 0, sel: first, pinned: first };
    var layerSel = el("select", { "data-vx": "layer" }, att.layers.map(function (name, i) {
      var s = geo.sets[i], where = s.stage === null || s.stage === undefined ? "" :
        ", stage " + s.stage + ": " + s.q[1] + "\u00d7" + s.q[2] + " queries, " + s.k[1] + "\u00d7" + s.k[2] + " keys";
      return el("option", { value: String(i), text: "layer " + att.layerIndex[i] + " (" + name + where + ")" });
    }));
    var headSel = el("select", { "data-vx": "head" });
    function headOptions() {
      var labels = geo.heads(state.layer), H = labels.length;
      var options = labels.map(function (h, i) { return [String(i), h === "mean" ? "mean" : "head " + h]; });
      if (H > 1) options.push(["mean", "mean of heads"]);
      headSel.replaceChildren.apply(headSel, options.map(function (o) { return el("option", { value: o[0], text: o[1] }); }));
      if (state.head !== "mean" && state.head >= H) state.head = H > 1 ? "mean" : 0;
      headSel.value = String(state.head);
    }
    headOptions();
    layerSel.value = String(state.layer);
    layerSel.addEventListener("change", function () { state.layer = +layerSel.value; headOptions(); draw(); });
    headSel.addEventListener("change", function () { state.head = headSel.value === "mean" ? "mean" : +headSel.value; draw(); });
    var prefixButtons = att.tokens.map(function (t, i) {
      var b = el("button", { type: "button", "data-vx": "token", "data-index": String(i), text: t });
      b.addEventListener("click", function () { state.pinned = state.sel = { token: i }; draw(); });
      return b;
    });
    function onPatch(pos, pin) {
      state.sel = pos === null ? state.pinned : { pos: pos };
      if (pin) state.pinned = state.sel;
      draw();
    }
    var attView = heatView(data, "attn", onPatch), rollView = heatView(data, "rollout", onPatch);
    var matrix = el("canvas", { class: "vx-matrix", "data-vx": "matrix" });
    var rowMark = el("div", { class: "vx-rowmark" });
    var matrixBox = el("div", { class: "vx-matrix-box" }, [matrix, rowMark]);
    var matrixInfo = el("p", { class: "vx-info", text: "hover the matrix: query \u2192 key" });
    var matrixCaption = el("figcaption");
    var info = el("p", { class: "vx-info", "data-vx": "query-info" });

    function headRow(layer, head, q) {
      var nq = setSize(geo.sets[layer].q), H = geo.heads(layer).length, rows = geo.probs[layer];
      if (head !== "mean") return rows.full(head * nq + q);
      var acc = null;
      for (var h = 0; h < H; h++) {
        var r = rows.full(h * nq + q);
        if (!acc) acc = new Float32Array(r.length);
        for (var j = 0; j < r.length; j++) acc[j] += r[j] / H;
      }
      return acc;
    }
    function drawMatrix() {
      var s = geo.sets[state.layer], nq = setSize(s.q), nk = setSize(s.k), rows = [];
      for (var q = 0; q < nq; q++) rows.push(headRow(state.layer, state.head, q));
      drawValues(matrix, nq, nk, rows, false, true);
      matrixCaption.textContent = "attention matrix: rows are queries (" + matrixTicks(att, s.q) + "), columns keys (" +
        matrixTicks(att, s.k) + "); each row scaled to its largest value";
    }
    var drawn = null;
    function draw() {
      var key = state.layer + ":" + state.head, s = geo.sets[state.layer];
      if (drawn !== key) { drawMatrix(); drawn = key; }
      var q = queryIndex(s.q, state.sel), row = headRow(state.layer, state.head, q);
      var pinned = queryIndex(s.q, state.pinned) === q;
      var patches = row.subarray(s.k[0]), rrow = geo.roll[state.layer].full(q);
      drawMap(attView.canvas, [s.k[1], s.k[2]], patches, false);
      drawMap(rollView.canvas, att.grid, rrow.subarray(att.prefix), false);
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
    }
    function matrixCell(ev) {
      var r = matrix.getBoundingClientRect(), s = geo.sets[state.layer], nq = setSize(s.q), nk = setSize(s.k);
      return [Math.min(nq - 1, Math.floor((ev.clientY - r.top) / r.height * nq)),
              Math.min(nk - 1, Math.floor((ev.clientX - r.left) / r.width * nk))];
    }
    matrix.addEventListener("mousemove", function (ev) {
      var cell = matrixCell(ev), s = geo.sets[state.layer];
      var v = headRow(state.layer, state.head, cell[0])[cell[1]];
      matrixInfo.textContent = "query " + tokenLabel(att, s.q, cell[0]) + " \u2192 key " + tokenLabel(att, s.k, cell[1]) +
        ": " + v.toFixed(4);
    });
    matrix.addEventListener("click", function (ev) {
      state.pinned = state.sel = selectionOf(geo.sets[state.layer].q, matrixCell(ev)[0]);
      draw();
    });
    draw();
    var views = el("div", { class: "vx-pair" }, [
      el("figure", {}, [attView.view, el("figcaption", { text: "attention of the query (layer, head), on the layer's key grid" })]),
      el("figure", {}, [rollView.view, el("figcaption", { text: "rollout row of the query (up to this layer)" })]),
      el("figure", {}, [matrixBox, matrixCaption, matrixInfo])
    ]);
    var controls = el("div", { class: "vx-controls" }, [layerSel, headSel].concat(
      prefixButtons.length ? [el("span", { text: " query: " })].concat(prefixButtons) : []));
    var note = att.note ? el("p", { class: "vx-note", text: att.note }) : null;
    return panel("Attention", [controls, views, info, el("div", { class: "vx-pair" }, [legend(false, 0), legend(false, 0, true)]), note]);
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
