  /* vitexplain explorer, shared helpers: elements, payload decoding, colours, heat views, tabs.
   * Inlined with attention.js, words.js and explore.js into one closure (explorer/page.py). */
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

  /* A label a person or a model wrote (any script, any length) and a suffix after it (a score): the label in
   * its own <bdi>, so that a right-to-left label does not pull the score in front of it. */
  function labelled(label, suffix) {
    return [el("bdi", { text: String(label) }), document.createTextNode(suffix || "")];
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
   * whole block (overlays; opaque: without the overlay's fading, for small tiles). */
  function drawValues(canvas, rows, cols, valueRows, signed, matrix, fixedMax, opaque) {
    canvas.width = cols; canvas.height = rows;
    var ctx = canvas.getContext("2d"), img = ctx.createImageData(cols, rows), m = 0;
    var lut = signed ? DIV : matrix ? MAT : SEQ;
    if (fixedMax !== undefined) m = fixedMax;  /* several canvases in one scale */
    else if (!matrix) valueRows.forEach(function (r) { m = Math.max(m, maxAbs(r)); });
    valueRows.forEach(function (r, i) {
      var mi = matrix ? maxAbs(r) : m;
      for (var j = 0; j < cols; j++) {
        var c = colour(r[j], mi, signed, lut, !matrix && !opaque), o = 4 * (i * cols + j);
        img.data[o] = c[0]; img.data[o + 1] = c[1]; img.data[o + 2] = c[2]; img.data[o + 3] = c[3];
      }
    });
    ctx.putImageData(img, 0, 0);
  }

  function drawMap(canvas, grid, values, signed) {
    drawValues(canvas, grid[0], grid[1], splitRows(values, grid[0], grid[1]), signed, false);
  }

  /* An opaque tile of a layers x heads overview, in one scale. */
  function drawTile(canvas, grid, values) {
    drawValues(canvas, grid[0], grid[1], splitRows(values, grid[0], grid[1]), false, false, undefined, true);
  }

  /* One tile of a layers x heads overview: a canvas for (layer, head) = pair, appended to the grid and
   * to tiles ({canvas, pair}); a click calls onClick(pair, event). */
  function overviewTile(grid, tiles, kind, pair, title, onClick) {
    var c = el("canvas", { class: "vx-tile", "data-vx": kind, "data-layer": String(pair[0]), "data-head": String(pair[1]),
      title: title });
    c.addEventListener("click", function (ev) { onClick(pair, ev); });
    tiles.push({ canvas: c, pair: pair });
    grid.appendChild(c);
  }

  function splitRows(values, rows, cols) {
    var out = [];
    for (var i = 0; i < rows; i++) out.push(values.subarray(i * cols, (i + 1) * cols));
    return out;
  }

  /* What the info line adds for a map that is zero everywhere (drawn in one faint colour, under a legend
   * that would read "0 .. max"): say so. */
  function zeroNote(values) { return maxAbs(values) === 0 ? " \u2014 this map is zero everywhere" : ""; }

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
      var b = el("button", { type: "button", "data-vx": role, "data-index": String(i) },
        Array.isArray(n) ? n : [document.createTextNode(n)]);
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
    var classes = tabs(preds.map(function (p) { return labelled(p.label, p.score === null ? "" : " " + p.score.toFixed(3)); }),
      "class", function (k) { state.k = k; draw(); });
    function draw() {
      var m = data.methods[state.m], q = maps[state.m], k = m.perClass ? state.k : 0;
      var values = q.row(k);
      drawMap(hv.canvas, m.grid, values, q.signed);
      legendBox.replaceChildren(legend(q.signed, maxAbs(values)));
      classes.node.style.visibility = m.perClass ? "visible" : "hidden";
      info.textContent = m.name + ": " + m.summary + (m.perClass ? " \u2014 target: " + preds[k].label : " (class-agnostic)") +
        zeroNote(values);
    }
    var methodTabs = tabs(data.methods.map(function (m) { return m.name; }), "method-tab",
      function (i) { state.m = i; draw(); });
    draw();
    return panel("Methods", [methodTabs.node, classes.node, hv.view, legendBox, info], true);
  }
