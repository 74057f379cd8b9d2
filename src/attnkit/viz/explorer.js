/* attnkit attention explorer: draws the data in each .attnkit-explorer element.
 *
 * Data (the JSON element of class ak-data inside each explorer element):
 *   layers L, heads H, nq I (queries), nk J (keys), queryTokens[I], keyTokens[J];
 *   weights: row-major (L, H, I, J), rollout: null or (L, I, I), both stored as
 *     base64(deflate(low bytes ++ high bytes of the 16-bit integers k = round(w * scale)));
 *     a weight is k / scale (scale 4096, so within 2^-13 of the original);
 *   layer, head (null: the mean of the layer's heads): what to show first;
 *   segments: null, or 0 (sentence A) / 1 (sentence B) per token for the pair filter.
 * Tokens are user input: they only ever reach the page through textContent or DOM
 * properties, never through innerHTML.
 */
(function () {
  "use strict";
  var MAX_DOM_CELLS = 1600;   // beyond I*J = 1600 the heat map is drawn on a <canvas>
  var ANNOTATE_MAX = 12;      // cells show their value up to 12 tokens a side
  var THUMB = 64;             // overview thumbnails, CSS pixels
  var BUCKETS = 32;           // line opacities are grouped into this many strokes
  var MEAN = -1;              // state.head of the head-average view
  var STOPS = [[247, 251, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]];
  var ONE_HEAD = [33, 113, 181];
  // one colour per head in the overlay (Tableau 10, then two more; further heads: hues apart)
  var HEAD_RGB = [[31, 119, 180], [255, 127, 14], [44, 160, 44], [214, 39, 40], [148, 103, 189],
                  [140, 86, 75], [227, 119, 194], [127, 127, 127], [188, 189, 34], [23, 190, 207],
                  [57, 59, 121], [99, 121, 57]];

  function bytesOf(b64) {
    var bin = atob(b64), n = bin.length, bytes = new Uint8Array(n);
    for (var k = 0; k < n; k++) bytes[k] = bin.charCodeAt(k);
    return bytes;
  }
  function inflate(b64) {  // a promise of the decompressed bytes
    var stream = new Blob([bytesOf(b64)]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Response(stream).arrayBuffer().then(function (buf) { return new Uint8Array(buf); });
  }
  function dequantise(planes, scale) {  // low bytes, then high bytes -> k / scale (exact)
    var n = planes.length >> 1, out = new Float32Array(n);
    for (var k = 0; k < n; k++) out[k] = (planes[k] | (planes[n + k] << 8)) / scale;
    return out;
  }
  function fmt(w) { return w.toFixed(3); }
  function rgb(v) {
    v = v < 0 ? 0 : v > 1 ? 1 : v;
    var x = v * (STOPS.length - 1), k = Math.min(Math.floor(x), STOPS.length - 2), t = x - k;
    var a = STOPS[k], b = STOPS[k + 1];
    return [Math.round(a[0] + (b[0] - a[0]) * t), Math.round(a[1] + (b[1] - a[1]) * t),
            Math.round(a[2] + (b[2] - a[2]) * t)];
  }
  function css(c) { return "rgb(" + c[0] + "," + c[1] + "," + c[2] + ")"; }
  function headRgb(h) {
    if (h < HEAD_RGB.length) return HEAD_RGB[h];
    var hue = (h * 137.508) % 360, s = 0.65, l = 0.45;  // golden-angle hues, HSL -> RGB
    var f = function (n) {
      var k = (n + hue / 30) % 12;
      return Math.round(255 * (l - s * Math.min(l, 1 - l) * Math.max(-1, Math.min(k - 3, 9 - k, 1))));
    };
    return [f(0), f(8), f(4)];
  }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }
  function maxOf(m) {
    var mx = 0;
    for (var n = 0; n < m.length; n++) if (m[n] > mx) mx = m[n];
    return mx;
  }

  function Explorer(root, data, W, R) {
    var $ = function (s) { return root.querySelector(s); };
    var L = data.layers, H = data.heads, I = data.nq, J = data.nk;
    var qTok = data.queryTokens, kTok = data.keyTokens, seg = data.segments;
    var state = { view: "heads", layer: data.layer, head: data.head === null ? MEAN : data.head,
                  stretch: false, overlay: false, pair: "all", cur: null, max: 1,
                  readout: null, focusQ: null, focusK: null };
    var shown = [];  // the heads drawn in the overlay
    for (var h0 = 0; h0 < H; h0++) shown.push(true);
    var viewSel = $(".ak-view"), layerSel = $(".ak-layer"), headSel = $(".ak-head");
    var stretchBox = $(".ak-stretch"), overlayBox = $(".ak-overlay"), pairSel = $(".ak-pair");
    var readout = $(".ak-readout"), swatches = $(".ak-swatches");
    var domMode = I * J <= MAX_DOM_CELLS, annotate = domMode && Math.max(I, J) <= ANNOTATE_MAX;

    var means = [];
    function meanOf(l) {  // (I, J): the mean of layer l's heads, made once
      if (!means[l]) {
        var n = I * J, acc = new Float64Array(n), out = new Float32Array(n), k;
        for (var h = 0; h < H; h++) {
          var m = mapOf("heads", l, h);
          for (k = 0; k < n; k++) acc[k] += m[k];
        }
        for (k = 0; k < n; k++) out[k] = acc[k] / H;
        means[l] = out;
      }
      return means[l];
    }
    function mapOf(view, l, h) {  // one (I, J) map as a view into the big array
      if (view === "rollout") return R.subarray(l * I * I, (l + 1) * I * I);
      if (h === MEAN) return meanOf(l);
      var start = (l * H + h) * I * J;
      return W.subarray(start, start + I * J);
    }
    function scaleMax(m) {
      var mx = maxOf(m);
      if (state.stretch) return mx > 0 ? mx : 1;
      return mx > 1 ? mx : 1;
    }
    function overlaid() { return state.overlay && state.view === "heads"; }
    function where(lines) {
      if (state.view === "rollout") return "rollout through layer " + state.layer;
      if (lines && overlaid()) return "layer " + state.layer + ", every head";
      if (state.head === MEAN) return "layer " + state.layer + ", mean of " + H + " heads";
      return "layer " + state.layer + ", head " + state.head;
    }
    function say(parts) {  // parts: strings, or [className, text(, colour)] for a styled span
      readout.textContent = "";
      parts.forEach(function (p) {
        if (typeof p === "string") { readout.appendChild(document.createTextNode(p)); return; }
        var s = readout.appendChild(el("span", p[0], p[1]));
        if (p[2]) s.style.borderColor = css(p[2]);
      });
      readout.dataset.layer = state.layer;
      readout.dataset.head = state.view === "rollout" ? "rollout" : state.head === MEAN ? "mean" : state.head;
    }
    // the pair filter: which queries (left) and keys (right) the lines show
    function qOn(q) { return !seg || state.pair === "all" || seg[q] === (state.pair[0] === "A" ? 0 : 1); }
    function kOn(k) { return !seg || state.pair === "all" || seg[k] === (state.pair[1] === "A" ? 0 : 1); }

    // ---- controls ----
    for (var l = 0; l < L; l++) layerSel.appendChild(el("option", null, String(l))).value = l;
    headSel.appendChild(el("option", null, "mean of heads")).value = "mean";
    for (var h = 0; h < H; h++) headSel.appendChild(el("option", null, String(h))).value = h;
    if (R) viewSel.appendChild(el("option", null, "rollout")).value = "rollout";
    else viewSel.disabled = true;
    layerSel.value = state.layer;
    headSel.value = state.head === MEAN ? "mean" : state.head;
    if (seg) $(".ak-pair-label").hidden = false;
    viewSel.addEventListener("change", function () {
      state.view = viewSel.value; buildOverview(); show();
    });
    layerSel.addEventListener("change", function () { state.layer = +layerSel.value; show(); });
    headSel.addEventListener("change", function () {
      state.head = headSel.value === "mean" ? MEAN : +headSel.value; show();
    });
    stretchBox.addEventListener("change", function () {
      state.stretch = stretchBox.checked; show(); drawThumbs();
    });
    overlayBox.addEventListener("change", function () {
      state.overlay = overlayBox.checked; show();
    });
    pairSel.addEventListener("change", function () { state.pair = pairSel.value; show(); });
    for (h = 0; h < H; h++) {
      var sw = swatches.appendChild(el("button", "ak-swatch", "H" + h));
      sw.type = "button"; sw.dataset.head = h; sw.setAttribute("aria-pressed", "true");
      sw.style.borderLeftColor = css(headRgb(h));
      sw.title = "show or hide head " + h;
      sw.addEventListener("click", function (ev) {
        var k = +ev.currentTarget.dataset.head;
        shown[k] = !shown[k];
        ev.currentTarget.setAttribute("aria-pressed", String(shown[k]));
        renderLines(); renderReadout();
      });
    }

    // ---- readout: always describes the map on show, re-made whenever it changes ----
    var prevCell = null;
    function renderReadout() {
      var r = state.readout;
      if (prevCell) { prevCell.classList.remove("ak-hot"); prevCell = null; }
      if (r === null) {
        say(["Hover a cell or a token to read its weight (shown to three decimals)."]);
      } else if (r.kind === "cell") {
        var q = r.q, k = r.k;
        say([where(false) + " · query " + q + " ", ["ak-tok", qTok[q]], " → key " + k + " ",
             ["ak-tok", kTok[k]], ": weight ", ["ak-weight", fmt(state.cur[q * J + k])]]);
        readout.dataset.q = q; readout.dataset.k = k;
        if (domMode) { prevCell = cells[q * J + k]; prevCell.classList.add("ak-hot"); }
      } else if (r.kind === "query") {
        describe(r.q, true);
      } else {
        describe(r.k, false);
      }
    }
    function best(get, count, on, top) {  // the `top` largest get(n) over n with on(n)
      var idx = [];
      for (var n = 0; n < count; n++) if (on(n)) idx.push(n);
      idx.sort(function (x, y) { return get(y) - get(x); });
      return idx.slice(0, top);
    }
    function describe(t, isQuery) {  // a token of the lines: where it looks, or who looks at it
      var parts = [where(true) + (isQuery ? " · query " : " · key ") + t + " ",
                   ["ak-tok", isQuery ? qTok[t] : kTok[t]],
                   isQuery ? " looks most at: " : " is looked at most by: "];
      var other = isQuery ? kTok : qTok, count = isQuery ? J : I, on = isQuery ? kOn : qOn;
      var at = function (m) {
        return function (n) { return isQuery ? m[t * J + n] : m[n * J + t]; };
      };
      if (overlaid()) {  // each shown head's strongest link
        var first = true;
        for (var h = 0; h < H; h++) {
          if (!shown[h]) continue;
          var get = at(mapOf("heads", state.layer, h)), n = best(get, count, on, 1)[0];
          if (n === undefined) continue;
          parts.push(first ? "" : "; ", ["ak-head-mark", "H" + h, headRgb(h)], " ",
                     ["ak-tok", other[n]], " ", ["ak-weight", fmt(get(n))]);
          first = false;
        }
      } else {
        var g = at(state.cur);
        best(g, count, on, 3).forEach(function (n, r) {
          parts.push(r ? ", " : "", ["ak-tok", other[n]], " ", ["ak-weight", fmt(g(n))]);
        });
      }
      say(parts);
    }

    // ---- heat map ----
    var cells = [], canvas = null, cellPx = 0;
    function hoverCell(q, k) { state.readout = { kind: "cell", q: q, k: k }; renderReadout(); }
    function buildMatrix() {
      var box = $(".ak-matrix");
      if (domMode) {
        var grid = el("div", annotate ? "ak-grid ak-annotated" : "ak-grid");
        grid.style.gridTemplateColumns = "max-content repeat(" + J + ", var(--ak-cell))";
        grid.appendChild(el("div", "ak-corner"));
        for (var k = 0; k < J; k++) grid.appendChild(el("div", "ak-col-label", kTok[k])).title = kTok[k];
        for (var q = 0; q < I; q++) {
          grid.appendChild(el("div", "ak-row-label", qTok[q])).title = qTok[q];
          for (k = 0; k < J; k++) {
            var c = el("div", "ak-cell");
            c.dataset.q = q; c.dataset.k = k;
            grid.appendChild(c); cells.push(c);
          }
        }
        grid.addEventListener("mouseover", function (ev) {
          var t = ev.target;
          if (t.classList.contains("ak-cell")) hoverCell(+t.dataset.q, +t.dataset.k);
        });
        box.appendChild(grid);
      } else {
        cellPx = Math.max(2, Math.min(20, Math.floor(640 / Math.max(I, J))));
        box.appendChild(el("p", "ak-note", I + " × " + J + " cells drawn on a canvas; " +
                           "hover to read the tokens and the weight."));
        var wrap = el("div", "ak-canvas-wrap");
        canvas = el("canvas", "ak-matrix-canvas");
        canvas.width = J * cellPx; canvas.height = I * cellPx;
        canvas.addEventListener("mousemove", function (ev) {
          var r = canvas.getBoundingClientRect();
          var k = Math.floor((ev.clientX - r.left) * J / r.width);
          var q = Math.floor((ev.clientY - r.top) * I / r.height);
          if (q >= 0 && q < I && k >= 0 && k < J) hoverCell(q, k);
        });
        wrap.appendChild(canvas); box.appendChild(wrap);
      }
    }
    function renderMatrix() {
      var m = state.cur, mx = state.max, n, v, c;
      if (domMode) {
        for (n = 0; n < m.length; n++) {
          v = m[n] / mx; c = cells[n];
          c.style.background = css(rgb(v));
          if (annotate) { c.textContent = m[n].toFixed(2); c.style.color = v > 0.55 ? "#fff" : "#111"; }
        }
        return;
      }
      var off = document.createElement("canvas");
      off.width = J; off.height = I;
      var octx = off.getContext("2d"), img = octx.createImageData(J, I), px = img.data;
      for (n = 0; n < m.length; n++) {
        c = rgb(m[n] / mx);
        px[4 * n] = c[0]; px[4 * n + 1] = c[1]; px[4 * n + 2] = c[2]; px[4 * n + 3] = 255;
      }
      octx.putImageData(img, 0, 0);
      var ctx = canvas.getContext("2d");
      ctx.imageSmoothingEnabled = false;
      ctx.drawImage(off, 0, 0, canvas.width, canvas.height);
    }
    function renderLegend() {
      var box = $(".ak-legend");
      box.textContent = "";
      var bar = el("canvas", "ak-legend-bar");
      bar.width = 160; bar.height = 10;
      var ctx = bar.getContext("2d");
      for (var x = 0; x < 160; x++) { ctx.fillStyle = css(rgb(x / 159)); ctx.fillRect(x, 0, 1, 10); }
      box.appendChild(el("span", null, "0 "));
      box.appendChild(bar);
      box.appendChild(el("span", null, " " + fmt(state.max)));
    }

    // ---- lines (head view; every head of the layer in the overlay) ----
    var linesCanvas, qLabels = [], kLabels = [], LINE_W = 150;
    var rowH = Math.max(I, J) > 60 ? 12 : 18, height = Math.max(I, J) * rowH;
    function buildLines() {
      var box = $(".ak-lines");
      var wrap = el("div", "ak-lines-wrap");
      var inner = el("div", "ak-lines-inner");
      inner.style.height = height + "px";
      var left = el("div", "ak-col ak-col-q"), right = el("div", "ak-col ak-col-k");
      var hq = height / I, hk = height / J;
      for (var q = 0; q < I; q++) {
        var t = left.appendChild(el("div", "ak-ltok", qTok[q]));
        t.style.top = q * hq + "px"; t.style.height = hq + "px"; t.style.lineHeight = hq + "px";
        t.dataset.q = q; t.title = qTok[q]; qLabels.push(t);
      }
      for (var k = 0; k < J; k++) {
        var u = right.appendChild(el("div", "ak-ltok", kTok[k]));
        u.style.top = k * hk + "px"; u.style.height = hk + "px"; u.style.lineHeight = hk + "px";
        u.dataset.k = k; u.title = kTok[k]; kLabels.push(u);
      }
      if (Math.max(I, J) > 60) inner.classList.add("ak-small");
      linesCanvas = el("canvas", "ak-lines-canvas");
      linesCanvas.width = LINE_W; linesCanvas.height = height;
      inner.appendChild(left); inner.appendChild(linesCanvas); inner.appendChild(right);
      inner.addEventListener("mouseover", function (ev) {
        var t = ev.target;
        if (!t.classList || !t.classList.contains("ak-ltok")) return;
        if (t.dataset.q !== undefined && qOn(+t.dataset.q)) focus(+t.dataset.q, null);
        else if (t.dataset.k !== undefined && kOn(+t.dataset.k)) focus(null, +t.dataset.k);
      });
      inner.addEventListener("mouseleave", function () {
        state.focusQ = state.focusK = null; paintLabels(); renderLines();
      });
      var heads = el("div", "ak-lines-heads");
      heads.appendChild(el("span", null, "queries (i)"));
      heads.appendChild(el("span", null, "keys (j)"));
      wrap.appendChild(heads); wrap.appendChild(inner); box.appendChild(wrap);
    }
    function focus(q, k) {
      state.focusQ = q; state.focusK = k;
      state.readout = q !== null ? { kind: "query", q: q } : { kind: "key", k: k };
      paintLabels(); renderLines(); renderReadout();
    }
    function renderLines() {
      var ctx = linesCanvas.getContext("2d"), hq = height / I, hk = height / J;
      ctx.clearRect(0, 0, LINE_W, height);
      var heads = [];
      if (overlaid()) { for (var h = 0; h < H; h++) if (shown[h]) heads.push(h); }
      else heads.push(null);
      ctx.lineWidth = Math.max(I, J) > 60 ? 1 : 2;
      heads.forEach(function (h) {
        var m = h === null ? state.cur : mapOf("heads", state.layer, h);
        var mx = h === null ? state.max : scaleMax(m), colour = h === null ? ONE_HEAD : headRgb(h);
        // each head's lines end at its own height within a token's row, so they lie side by side
        var dq = h === null ? 0 : ((h + 0.5) / H - 0.5) * 0.8 * hq;
        var dk = h === null ? 0 : ((h + 0.5) / H - 0.5) * 0.8 * hk;
        var buckets = [], b, q, k, a;
        for (b = 0; b < BUCKETS; b++) buckets.push([]);
        for (q = 0; q < I; q++) {
          if (!qOn(q) || (state.focusQ !== null && q !== state.focusQ)) continue;
          for (k = 0; k < J; k++) {
            if (!kOn(k) || (state.focusK !== null && k !== state.focusK)) continue;
            a = m[q * J + k] / mx;
            if (a < 0.02) continue;
            buckets[Math.min(BUCKETS - 1, Math.floor(a * BUCKETS))].push(q, k);
          }
        }
        for (b = 0; b < BUCKETS; b++) {
          var list = buckets[b];
          if (!list.length) continue;
          ctx.strokeStyle = "rgba(" + colour.join(",") + "," + ((b + 1) / BUCKETS) + ")";
          ctx.beginPath();
          for (var n = 0; n < list.length; n += 2) {
            ctx.moveTo(0, (list[n] + 0.5) * hq + dq);
            ctx.lineTo(LINE_W, (list[n + 1] + 0.5) * hk + dk);
          }
          ctx.stroke();
        }
      });
    }
    function shade(label, w) {  // a label's background shows a weight (or nothing: w === null)
      label.style.background = w === null ? "" : css(rgb(w / state.max));
      label.style.color = w !== null && w / state.max > 0.55 ? "#fff" : "";
    }
    function paintLabels() {
      var m = state.cur, fq = state.focusQ, fk = state.focusK, n;
      for (n = 0; n < J; n++) {
        shade(kLabels[n], fq === null || overlaid() ? null : m[fq * J + n]);
        kLabels[n].classList.toggle("ak-hot", n === fk);
        kLabels[n].classList.toggle("ak-off", !kOn(n));
      }
      for (n = 0; n < I; n++) {
        shade(qLabels[n], fk === null || overlaid() ? null : m[n * J + fk]);
        qLabels[n].classList.toggle("ak-hot", n === fq);
        qLabels[n].classList.toggle("ak-off", !qOn(n));
      }
    }

    // ---- overview: a thumbnail per head, and each layer's mean ----
    var thumbs = [];
    function buildOverview() {
      var box = $(".ak-overview");
      box.textContent = ""; thumbs = [];
      var roll = state.view === "rollout", rows = roll ? 1 : L, cols = roll ? L : H + 1;
      var grid = el("div", "ak-thumbs");
      grid.style.gridTemplateColumns = "max-content repeat(" + cols + ", " + (THUMB + 6) + "px)";
      grid.appendChild(el("div"));
      for (var c = 0; c < cols; c++) {
        grid.appendChild(el("div", "ak-thumb-head", roll ? "L" + c : c === H ? "mean" : "H" + c));
      }
      for (var r = 0; r < rows; r++) {
        grid.appendChild(el("div", "ak-thumb-row", roll ? "rollout" : "L" + r));
        for (c = 0; c < cols; c++) {
          var cv = el("canvas", "ak-thumb");
          cv.width = Math.min(J, THUMB); cv.height = Math.min(I, THUMB);
          var l = roll ? c : r, h = roll ? 0 : c === H ? "mean" : c;
          cv.dataset.layer = l; cv.dataset.head = h;
          cv.title = roll ? "rollout through layer " + l
                          : "layer " + l + (h === "mean" ? ", mean of the heads" : ", head " + h);
          cv.addEventListener("click", function (ev) {
            var d = ev.target.dataset;
            state.layer = +d.layer;
            state.head = d.head === "mean" ? MEAN : +d.head;
            layerSel.value = state.layer; headSel.value = d.head; show();
          });
          grid.appendChild(cv); thumbs.push(cv);
        }
      }
      box.appendChild(grid);
      drawThumbs();
    }
    function thumbHead(cv) { return cv.dataset.head === "mean" ? MEAN : +cv.dataset.head; }
    function drawThumbs() {
      thumbs.forEach(function (cv) {
        var m = mapOf(state.view, +cv.dataset.layer, thumbHead(cv));
        var tw = cv.width, th = cv.height, ctx = cv.getContext("2d");
        var img = ctx.createImageData(tw, th), px = img.data, mx = scaleMax(m);
        for (var y = 0; y < th; y++) {
          var q0 = Math.floor(y * I / th), q1 = Math.max(q0 + 1, Math.floor((y + 1) * I / th));
          for (var x = 0; x < tw; x++) {
            var k0 = Math.floor(x * J / tw), k1 = Math.max(k0 + 1, Math.floor((x + 1) * J / tw));
            var v = 0;  // the strongest weight in the block, so sharp patterns survive shrinking
            for (var q = q0; q < q1; q++) for (var k = k0; k < k1; k++) if (m[q * J + k] > v) v = m[q * J + k];
            var c = rgb(v / mx), o = 4 * (y * tw + x);
            px[o] = c[0]; px[o + 1] = c[1]; px[o + 2] = c[2]; px[o + 3] = 255;
          }
        }
        ctx.putImageData(img, 0, 0);
      });
      markThumb();
    }
    function markThumb() {
      thumbs.forEach(function (cv) {
        var on = +cv.dataset.layer === state.layer &&
                 (state.view === "rollout" || thumbHead(cv) === state.head);
        cv.classList.toggle("ak-current", on);
      });
    }

    function show() {
      state.cur = mapOf(state.view, state.layer, state.head);
      state.max = scaleMax(state.cur);
      headSel.disabled = state.view === "rollout";
      overlayBox.disabled = state.view === "rollout";
      swatches.hidden = !overlaid();
      root.dataset.layer = state.layer; root.dataset.view = state.view;
      root.dataset.head = state.head === MEAN ? "mean" : state.head;
      renderMatrix(); renderLegend(); paintLabels(); renderLines(); markThumb(); renderReadout();
    }

    buildMatrix(); buildLines(); buildOverview(); show();
  }

  function start(root) {
    var data = JSON.parse(root.querySelector(".ak-data").textContent);
    if (typeof DecompressionStream === "undefined") {
      throw new Error("this browser has no DecompressionStream (Chrome 80, Firefox 113, " +
                      "Safari 16.4 or later have it)");
    }
    var jobs = [inflate(data.weights)];
    if (data.rollout) jobs.push(inflate(data.rollout));
    return Promise.all(jobs).then(function (planes) {
      var W = dequantise(planes[0], data.scale);
      var R = data.rollout ? dequantise(planes[1], data.scale) : null;
      Explorer(root, data, W, R);
      root.dataset.ready = "1";
    });
  }

  function fail(root, err) {
    var box = root.querySelector(".ak-readout");
    if (box) box.textContent = "The explorer could not start: " + err;
    throw err;
  }
  // Inside a notebook's iframe (AttentionExplorer._repr_html_) the page tells the notebook its
  // height whenever it changes, so the frame can grow to show all of it instead of clipping it.
  if (window.parent !== window && typeof ResizeObserver !== "undefined") {
    var tellHeight = function () {
      window.parent.postMessage({attnkitExplorerHeight: document.documentElement.scrollHeight}, "*");
    };
    new ResizeObserver(tellHeight).observe(document.body);
  }
  var roots = document.querySelectorAll(".attnkit-explorer");
  for (var n = 0; n < roots.length; n++) {
    if (roots[n].dataset.ready || roots[n].dataset.started) continue;
    roots[n].dataset.started = "1";
    (function (root) {
      try { start(root).catch(function (err) { fail(root, err); }); } catch (err) { fail(root, err); }
    })(roots[n]);
  }
})();
