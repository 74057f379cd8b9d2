/* attnkit attention explorer: draws the data in each .attnkit-explorer element.
 *
 * Data (the JSON element of class ak-data inside each explorer element):
 *   layers L, heads H, nq I (queries), nk J (keys), queryTokens[I], keyTokens[J],
 *   weights: base64 float32, row-major (L, H, I, J); rollout: null or base64 (L, I, I);
 *   layer, head: what to show first.
 * Tokens are user input: they only ever reach the page through textContent or DOM
 * properties, never through innerHTML.
 */
(function () {
  "use strict";
  var MAX_DOM_CELLS = 1600;   // beyond I*J = 1600 the heat map is drawn on a <canvas>
  var ANNOTATE_MAX = 12;      // cells show their value up to 12 tokens a side
  var THUMB = 64;             // overview thumbnails, CSS pixels
  var BUCKETS = 32;           // line opacities are grouped into this many strokes
  var STOPS = [[247, 251, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]];

  function decode(b64) {
    var bin = atob(b64), n = bin.length, bytes = new Uint8Array(n);
    for (var k = 0; k < n; k++) bytes[k] = bin.charCodeAt(k);
    return new Float32Array(bytes.buffer);
  }
  function fmt(w) { return w === 0 ? "0" : String(Number(w.toPrecision(7))); }
  function rgb(v) {
    v = v < 0 ? 0 : v > 1 ? 1 : v;
    var x = v * (STOPS.length - 1), k = Math.min(Math.floor(x), STOPS.length - 2), t = x - k;
    var a = STOPS[k], b = STOPS[k + 1];
    return [Math.round(a[0] + (b[0] - a[0]) * t), Math.round(a[1] + (b[1] - a[1]) * t),
            Math.round(a[2] + (b[2] - a[2]) * t)];
  }
  function css(c) { return "rgb(" + c[0] + "," + c[1] + "," + c[2] + ")"; }
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

  function Explorer(root) {
    var $ = function (s) { return root.querySelector(s); };
    var data = JSON.parse($(".ak-data").textContent);
    var L = data.layers, H = data.heads, I = data.nq, J = data.nk;
    var qTok = data.queryTokens, kTok = data.keyTokens;
    var W = decode(data.weights), R = data.rollout ? decode(data.rollout) : null;
    var state = { view: "heads", layer: data.layer, head: data.head, stretch: false,
                  cur: null, max: 1, hover: null, focusQ: null, focusK: null };
    var viewSel = $(".ak-view"), layerSel = $(".ak-layer"), headSel = $(".ak-head");
    var stretchBox = $(".ak-stretch"), readout = $(".ak-readout");
    var domMode = I * J <= MAX_DOM_CELLS, annotate = domMode && Math.max(I, J) <= ANNOTATE_MAX;

    function mapOf(view, l, h) {  // one (I, J) map as a view into the big array
      if (view === "rollout") return R.subarray(l * I * I, (l + 1) * I * I);
      var start = (l * H + h) * I * J;
      return W.subarray(start, start + I * J);
    }
    function scaleMax(m) {
      var mx = maxOf(m);
      if (state.stretch) return mx > 0 ? mx : 1;
      return mx > 1 ? mx : 1;
    }
    function where() {
      return state.view === "rollout" ? "rollout through layer " + state.layer
                                      : "layer " + state.layer + ", head " + state.head;
    }
    function say(parts) {  // parts: strings, or [className, text] for a styled span
      readout.textContent = "";
      parts.forEach(function (p) {
        readout.appendChild(typeof p === "string" ? document.createTextNode(p)
                                                  : el("span", p[0], p[1]));
      });
    }

    // ---- controls ----
    for (var l = 0; l < L; l++) layerSel.appendChild(el("option", null, String(l))).value = l;
    for (var h = 0; h < H; h++) headSel.appendChild(el("option", null, String(h))).value = h;
    if (R) viewSel.appendChild(el("option", null, "rollout")).value = "rollout";
    else viewSel.disabled = true;
    layerSel.value = state.layer;
    headSel.value = state.head;
    viewSel.addEventListener("change", function () {
      state.view = viewSel.value; buildOverview(); show();
    });
    layerSel.addEventListener("change", function () { state.layer = +layerSel.value; show(); });
    headSel.addEventListener("change", function () { state.head = +headSel.value; show(); });
    stretchBox.addEventListener("change", function () {
      state.stretch = stretchBox.checked; show(); drawThumbs();
    });

    // ---- heat map ----
    var cells = [], prevCell = null, canvas = null, cellPx = 0;
    function hoverCell(q, k) {
      state.hover = [q, k];
      var w = state.cur[q * J + k];
      say([where() + " · query " + q + " ", ["ak-tok", qTok[q]], " → key " + k + " ",
           ["ak-tok", kTok[k]], ": weight ", ["ak-weight", fmt(w)]]);
      readout.dataset.q = q; readout.dataset.k = k;
      if (domMode) {
        if (prevCell) prevCell.classList.remove("ak-hot");
        prevCell = cells[q * J + k]; prevCell.classList.add("ak-hot");
      }
    }
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

    // ---- lines (head view) ----
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
        if (t.dataset && t.dataset.q !== undefined && t.classList.contains("ak-ltok")) focusQuery(+t.dataset.q);
        else if (t.dataset && t.dataset.k !== undefined && t.classList.contains("ak-ltok")) focusKey(+t.dataset.k);
      });
      inner.addEventListener("mouseleave", function () {
        state.focusQ = state.focusK = null; paintLabels(); renderLines();
      });
      var heads = el("div", "ak-lines-heads");
      heads.appendChild(el("span", null, "queries (i)"));
      heads.appendChild(el("span", null, "keys (j)"));
      wrap.appendChild(heads); wrap.appendChild(inner); box.appendChild(wrap);
    }
    function renderLines() {
      var ctx = linesCanvas.getContext("2d"), m = state.cur, mx = state.max;
      var hq = height / I, hk = height / J, buckets = [], b, q, k, a;
      ctx.clearRect(0, 0, LINE_W, height);
      for (b = 0; b < BUCKETS; b++) buckets.push([]);
      for (q = 0; q < I; q++) {
        if (state.focusQ !== null && q !== state.focusQ) continue;
        for (k = 0; k < J; k++) {
          if (state.focusK !== null && k !== state.focusK) continue;
          a = m[q * J + k] / mx;
          if (a < 0.02) continue;
          buckets[Math.min(BUCKETS - 1, Math.floor(a * BUCKETS))].push(q, k);
        }
      }
      ctx.lineWidth = Math.max(I, J) > 60 ? 1 : 2;
      for (b = 0; b < BUCKETS; b++) {
        var list = buckets[b];
        if (!list.length) continue;
        ctx.strokeStyle = "rgba(33,113,181," + ((b + 1) / BUCKETS) + ")";
        ctx.beginPath();
        for (var n = 0; n < list.length; n += 2) {
          ctx.moveTo(0, (list[n] + 0.5) * hq);
          ctx.lineTo(LINE_W, (list[n + 1] + 0.5) * hk);
        }
        ctx.stroke();
      }
    }
    function paintLabels() {
      var m = state.cur, mx = state.max, n;
      for (n = 0; n < kLabels.length; n++) {
        kLabels[n].style.background = state.focusQ === null ? "" : css(rgb(m[state.focusQ * J + n] / mx));
        kLabels[n].style.color = state.focusQ !== null && m[state.focusQ * J + n] / mx > 0.55 ? "#fff" : "";
      }
      for (n = 0; n < qLabels.length; n++) {
        qLabels[n].style.background = state.focusK === null ? "" : css(rgb(m[n * J + state.focusK] / mx));
        qLabels[n].style.color = state.focusK !== null && m[n * J + state.focusK] / mx > 0.55 ? "#fff" : "";
      }
      qLabels.forEach(function (t, n) { t.classList.toggle("ak-hot", n === state.focusQ); });
      kLabels.forEach(function (t, n) { t.classList.toggle("ak-hot", n === state.focusK); });
    }
    function top3(get, count) {
      var idx = [];
      for (var n = 0; n < count; n++) idx.push(n);
      idx.sort(function (x, y) { return get(y) - get(x); });
      return idx.slice(0, 3);
    }
    function focusQuery(q) {
      state.focusQ = q; state.focusK = null; paintLabels(); renderLines();
      var parts = [where() + " · query " + q + " ", ["ak-tok", qTok[q]], " looks most at: "];
      top3(function (k) { return state.cur[q * J + k]; }, J).forEach(function (k, r) {
        parts.push(r ? ", " : "", ["ak-tok", kTok[k]], " ", ["ak-weight", fmt(state.cur[q * J + k])]);
      });
      say(parts);
    }
    function focusKey(k) {
      state.focusK = k; state.focusQ = null; paintLabels(); renderLines();
      var parts = [where() + " · key " + k + " ", ["ak-tok", kTok[k]], " is looked at most by: "];
      top3(function (q) { return state.cur[q * J + k]; }, I).forEach(function (q, r) {
        parts.push(r ? ", " : "", ["ak-tok", qTok[q]], " ", ["ak-weight", fmt(state.cur[q * J + k])]);
      });
      say(parts);
    }

    // ---- overview ----
    var thumbs = [];
    function buildOverview() {
      var box = $(".ak-overview");
      box.textContent = ""; thumbs = [];
      var rows = state.view === "rollout" ? 1 : L, cols = state.view === "rollout" ? L : H;
      var grid = el("div", "ak-thumbs");
      grid.style.gridTemplateColumns = "max-content repeat(" + cols + ", " + (THUMB + 6) + "px)";
      grid.appendChild(el("div"));
      for (var c = 0; c < cols; c++) grid.appendChild(el("div", "ak-thumb-head", state.view === "rollout" ? "L" + c : "H" + c));
      for (var r = 0; r < rows; r++) {
        grid.appendChild(el("div", "ak-thumb-row", state.view === "rollout" ? "rollout" : "L" + r));
        for (c = 0; c < cols; c++) {
          var cv = el("canvas", "ak-thumb");
          cv.width = Math.min(J, THUMB); cv.height = Math.min(I, THUMB);
          var l = state.view === "rollout" ? c : r, h = state.view === "rollout" ? 0 : c;
          cv.dataset.layer = l; cv.dataset.head = h;
          cv.title = state.view === "rollout" ? "rollout through layer " + l : "layer " + l + ", head " + h;
          cv.addEventListener("click", function (ev) {
            state.layer = +ev.target.dataset.layer; state.head = +ev.target.dataset.head;
            layerSel.value = state.layer; headSel.value = state.head; show();
          });
          grid.appendChild(cv); thumbs.push(cv);
        }
      }
      box.appendChild(grid);
      drawThumbs();
    }
    function drawThumbs() {
      thumbs.forEach(function (cv) {
        var m = mapOf(state.view, +cv.dataset.layer, +cv.dataset.head);
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
        var on = +cv.dataset.layer === state.layer && (state.view === "rollout" || +cv.dataset.head === state.head);
        cv.classList.toggle("ak-current", on);
      });
    }

    function show() {
      state.cur = mapOf(state.view, state.layer, state.head);
      state.max = scaleMax(state.cur);
      headSel.disabled = state.view === "rollout";
      root.dataset.layer = state.layer; root.dataset.head = state.head; root.dataset.view = state.view;
      renderMatrix(); renderLegend(); paintLabels(); renderLines(); markThumb();
      if (state.hover) hoverCell(state.hover[0], state.hover[1]);
    }

    buildMatrix(); buildLines(); buildOverview(); show();
    root.dataset.ready = "1";
  }

  var roots = document.querySelectorAll(".attnkit-explorer");
  for (var n = 0; n < roots.length; n++) {
    if (roots[n].dataset.ready) continue;
    try { Explorer(roots[n]); } catch (err) {
      var box = roots[n].querySelector(".ak-readout");
      if (box) box.textContent = "The explorer could not start: " + err;
      throw err;
    }
  }
})();
