  /* vitexplain explorer, word-by-word panels of captioners and vision-language models.
   * Uses common.js; inlined into one closure (explorer/page.py). */
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
        ": \u201c" + (cap.words[state.w] || "") + "\u201d" + zeroNote(values);
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

  /* --- vision-language models: words, token grids as layers, attention per layer x head --- */
  function vlmPair(att, pair) {
    var h = att.heads[pair[1]];
    return "L" + att.layerIndex[pair[0]] + (h === "mean" ? " mean" : " H" + h);
  }

  /* A grid's box on the page: a clamped grid (pixels past its box take the edge cells, Florence-2) is drawn
   * one cell larger on every side, its edge cells replicated, and the view clips it to the image. */
  function drawnBox(p) {
    if (!p.clamp) return p.box;
    var ch = (p.box[2] - p.box[0]) / p.grid[0], cw = (p.box[3] - p.box[1]) / p.grid[1];
    return [p.box[0] - ch, p.box[1] - cw, p.box[2] + ch, p.box[3] + cw];
  }

  /* A grid whose box reaches past the piece's own part of the image (Idefics2's padded quadrants) is clipped to
   * that part: the pixels under its padding belong to the next piece. */
  function extentClip(p, b) {
    if (!p.extent) return "";
    var hh = b[2] - b[0], ww = b[3] - b[1];
    function pct(v, size) { return Math.max(0, 100 * v / size) + "%"; }
    return ";clip-path:inset(" + pct(p.extent[0] - b[0], hh) + " " + pct(b[3] - p.extent[3], ww) + " " +
      pct(b[2] - p.extent[2], hh) + " " + pct(p.extent[1] - b[1], ww) + ")";
  }

  function replicateEdges(rows) {
    var out = rows.map(function (r) {
      var x = new Float32Array(r.length + 2);
      x.set(r, 1); x[0] = r[0]; x[r.length + 1] = r[r.length - 1];
      return x;
    });
    return [out[0]].concat(out, [out[out.length - 1]]);
  }

  function vlmPanel(data) {
    var v = data.vlm;
    if (!v) return null;
    var att = v.attention && v.attention.probs ? v.attention : null;
    var probs = att ? decodeQ(att.probs) : null;
    var L = att ? att.layers.length : 0, H = att ? att.heads.length : 0, T = Math.max(v.words.length, 1);
    var maps = v.methods.map(function (m) { return decodeQ(m.maps); });
    var tabNames = v.methods.map(function (m) { return m.name; });
    if (att) tabNames.push("attention (selected heads)");
    var state = { m: 0, w: 0, sel: att ? [[L - 1, 0]] : [], hidden: {} };
    var h = data.size[0], w = data.size[1];
    var layers = v.pieces.map(function (p, i) {
      var b = drawnBox(p);
      return el("canvas", { class: "vx-heat vx-piece", "data-vx": "piece-map", "data-piece": String(i),
        style: "left:" + (100 * b[1]) + "%;top:" + (100 * b[0]) + "%;width:" + (100 * (b[3] - b[1])) +
          "%;height:" + (100 * (b[2] - b[0])) + "%" + extentClip(p, b) });
    });
    var view = el("div", { class: "vx-view vx-vlm-view", style: "aspect-ratio:" + w + "/" + h },
      [el("img", { src: data.image, alt: data.name, draggable: "false" })].concat(layers));
    var pieceButtons = v.pieces.map(function (p, i) {
      var b = el("button", { type: "button", "data-vx": "piece", "data-index": String(i), text: p.name });
      b.classList.add("vx-on");
      b.addEventListener("click", function () { state.hidden[i] = !state.hidden[i]; draw(); });
      return b;
    });
    var wordButtons = v.words.map(function (word, i) {
      var b = el("button", { type: "button", "data-vx": "vlm-word", "data-index": String(i), text: word });
      b.addEventListener("click", function () { state.w = i; draw(); });
      return b;
    });
    var prev = el("button", { type: "button", "data-vx": "vlm-prev", text: "\u25c0" });
    var next = el("button", { type: "button", "data-vx": "vlm-next", text: "\u25b6" });
    function step(d) { state.w = Math.max(0, Math.min(T - 1, state.w + d)); draw(); }
    prev.addEventListener("click", function () { step(-1); });
    next.addEventListener("click", function () { step(1); });
    var info = el("p", { class: "vx-info", "data-vx": "vlm-info" }), legendBox = el("div");
    var selInfo = el("p", { class: "vx-info", "data-vx": "vlm-selection" });

    /* attention of word t's row over the image tokens for one (layer, head) pair, and the mean of the selected */
    function pairRow(pair, t) { return probs.row((pair[0] * H + pair[1]) * T + t); }
    function selRow(t) {
      var acc = new Float32Array(v.tokens), k = state.sel.length;
      state.sel.forEach(function (pair) { var r = pairRow(pair, t); for (var j = 0; j < r.length; j++) acc[j] += r[j] / k; });
      return acc;
    }
    function values() {  /* the chosen word's scores over all image tokens, and whether signed */
      if (state.m < maps.length) return [maps[state.m].row(Math.min(state.w, T - 1)), maps[state.m].signed];
      return [selRow(Math.min(state.w, T - 1)), false];
    }
    var several = el("input", { type: "checkbox", "data-vx": "vlm-several" });
    var tiles = [], grid = null, first = v.pieces[0];
    if (att) {
      grid = el("div", { class: "vx-overview", "data-vx": "vlm-overview", style: "grid-template-columns:auto repeat(" + H + ", 1fr)" });
      grid.appendChild(el("span"));
      att.heads.forEach(function (hd) { grid.appendChild(el("span", { class: "vx-ov-label", text: hd === "mean" ? "mean" : "h" + hd })); });
      for (var li = 0; li < L; li++) {
        grid.appendChild(el("span", { class: "vx-ov-label", text: "L" + att.layerIndex[li] }));
        for (var hi = 0; hi < H; hi++) {
          overviewTile(grid, tiles, "vlm-tile", [li, hi], vlmPair(att, [li, hi]),
            function (pair, ev) { pick(pair, ev.ctrlKey || ev.metaKey || ev.shiftKey || several.checked); });
        }
      }
    }
    function pick(pair, add) {
      var at = -1;
      state.sel.forEach(function (p, i) { if (p[0] === pair[0] && p[1] === pair[1]) at = i; });
      if (!add) state.sel = [pair];
      else if (at >= 0 && state.sel.length > 1) state.sel.splice(at, 1);
      else if (at < 0) state.sel.push(pair);
      state.m = maps.length;  /* show the selected heads */
      methodTabs.select(state.m);
      draw();
    }
    function draw() {
      var got = values(), vals = got[0], signed = got[1], m = 0;
      v.pieces.forEach(function (p, i) {
        if (state.hidden[i]) return;
        var part = vals.subarray(p.start, p.start + p.grid[0] * p.grid[1]);
        m = Math.max(m, maxAbs(part));
      });
      v.pieces.forEach(function (p, i) {
        var part = vals.subarray(p.start, p.start + p.grid[0] * p.grid[1]);
        /* every visible grid in one scale: the word's largest |value| over the visible grids */
        var rows = splitRows(part, p.grid[0], p.grid[1]), e = p.clamp ? 1 : 0;
        if (e) rows = replicateEdges(rows);
        drawValues(layers[i], p.grid[0] + 2 * e, p.grid[1] + 2 * e, rows, signed, false, m);
        layers[i].style.display = state.hidden[i] ? "none" : "block";
        pieceButtons[i].classList.toggle("vx-on", !state.hidden[i]);
      });
      tiles.forEach(function (t) {
        drawTile(t.canvas, first.grid, pairRow(t.pair, Math.min(state.w, T - 1)).subarray(first.start, first.start + first.grid[0] * first.grid[1]));
        t.canvas.classList.toggle("vx-on", state.sel.some(function (p) { return p[0] === t.pair[0] && p[1] === t.pair[1]; }));
      });
      wordButtons.forEach(function (b, i) { b.classList.toggle("vx-on", i === state.w); });
      legendBox.replaceChildren(legend(signed, m));
      var what = state.m < maps.length ? v.methods[state.m].name + ": " + v.methods[state.m].summary :
        "attention of the row that predicts the word, mean of " + state.sel.map(function (p) { return vlmPair(att, p); }).join(" + ");
      info.textContent = what + " \u2014 word " + (state.w + 1) + " of " + v.words.length + ": \u201c" + (v.words[state.w] || "") + "\u201d";
      if (att) selInfo.textContent = "selected heads: " + state.sel.map(function (p) { return vlmPair(att, p); }).join(" + ") +
        (state.sel.length > 1 ? " (mean of " + state.sel.length + ")" : "");
    }
    var methodTabs = tabs(tabNames, "vlm-tab", function (i) { state.m = i; draw(); });
    var box = el("div", { class: "vx-caption", tabindex: "0" });
    box.addEventListener("keydown", function (ev) { if (ev.key === "ArrowLeft") step(-1); if (ev.key === "ArrowRight") step(1); });
    draw();
    var parts = [methodTabs.node, el("div", { class: "vx-words" }, [prev].concat(wordButtons, [next])),
      el("div", { class: "vx-controls" }, [el("span", { text: "token grids (layers): " })].concat(pieceButtons)),
      view, legendBox, info];
    if (v.prompt) parts.unshift(el("p", { class: "vx-info", text: "prompt: " + v.prompt }));
    if (att) parts.push(el("h4", { text: "all layers \u00d7 heads for this word (" + first.name +
      "; click: show one; ctrl/shift-click or \u201cselect several\u201d: add or remove)" }),
      el("label", { class: "vx-info" }, [several, el("span", { text: " select several" })]), grid, selInfo);
    if (att && att.note) parts.push(el("p", { class: "vx-note", text: att.note }));
    parts.forEach(function (c) { box.appendChild(c); });
    return panel("Answer, word by word", [box]);
  }
