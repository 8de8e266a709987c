/* vitexplain explorer: draws the page from the JSON payload in <script id="vx-data">.
 * No network: every image is a data: URI, every array base64 in the payload.
 * Quantised rows (see vitexplain/explorer/quantize.py): {rows, cols, signed, scale, data};
 * value = code * scale / 255 (non-negative) or (code - 128) * scale / 127 (signed).
 * Heat canvases have one pixel per patch (opaque colours from the embedded lookup tables;
 * CSS scales them up and sets the overlay opacity), so a drawn pixel is exactly the colour of
 * its patch's value. Sets data-vx-ready="1" on <body> once every card has drawn.
 * The page inlines common.js, attention.js, words.js and this file, in that order, inside one
 * "use strict" closure (explorer/page.py, SCRIPTS); this file builds the cards and starts. */
  /* --- one card per image ---------------------------------------------------------------- */
  function card(data, index) {
    var preds = (data.predictions || []).map(function (p) {
      return el("li", {}, labelled(p.label, p.score === null ? "" : " \u2014 " + p.score.toFixed(3)));
    });
    var head = el("header", {}, [el("h2", { text: data.name }),
      el("ol", { class: "vx-preds", "data-vx": "predictions" }, preds)]);
    var notes = (data.notes || []).map(function (t) { return el("p", { class: "vx-note", text: t }); });
    var panels = [vlmPanel(data), captionPanel(data), methodsPanel(data), attentionPanel(data)];
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
