  /* vitexplain explorer, the attention panel (layer x head views, query tokens, matrices, overview).
   * Uses common.js; inlined into one closure (explorer/page.py). */
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
        overviewTile(grid, tiles, "overview-tile", [li, hi], pairName(att, geo, [li, hi]) + ", keys " + gridText(s0.k),
          function (pair, ev) { pick(pair, ev.ctrlKey || ev.metaKey || ev.shiftKey || several.checked); });
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
      prefixButtons.forEach(function (b, i) {  /* a prefix token that this layer's queries lack (PVT v1's class token
                                                 * joins at the last stage) cannot be picked here */
        b.classList.toggle("vx-on", i === q && q < s.q[0]);
        b.disabled = i >= s.q[0];
      });
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
