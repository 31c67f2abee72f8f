const DATA = JSON.parse(document.getElementById('attention-data').textContent);
const VIEWS = {head: 'head view: one heatmap', lines: 'lines view: heads overlaid (bertviz)',
               model: 'model view: every kind, layer and head'};
const state = {s: 0, kind: DATA.kinds[0], layer: 0, head: 0, view: 'head', shown: null};
const ROW_PX = 22;  // the lines view: height of one token
const $ = id => document.getElementById(id);
// heads of one kind and layer: a pruned model keeps fewer in some layers
const headsOf = (kind, layer) => DATA.head_counts[kind][layer];
const mostHeads = kind => Math.max(...DATA.head_counts[kind]);

// ---------------------------------------------------------------- colours: the pictures' colour map, sampled
function colourOf(w) {  // the colour of weight w in [0, 1], from the table sampled from CMAP
  const n = DATA.colours.length, i = Math.round(Math.min(1, Math.max(0, w)) * (n - 1));
  return DATA.colours[i];
}

function inkOn(hex) {  // black or white text, whichever reads better on `hex`
  const [r, g, b] = [1, 3, 5].map(i => parseInt(hex.slice(i, i + 2), 16) / 255);
  return 0.299 * r + 0.587 * g + 0.114 * b > 0.55 ? '#000' : '#fff';
}

function paint(el, w) {
  const c = colourOf(w);
  el.style.background = c; el.style.color = inkOn(c); el.dataset.w = w.toFixed(4);
}

// ---------------------------------------------------------------- state <-> address
function clampHead() {
  if (state.head !== 'mean') state.head = Math.min(state.head, headsOf(state.kind, state.layer) - 1);
}

function readHash() {
  const hash = location.hash.replace(/^#/, '') || DATA.start;
  for (const part of hash.split('&')) {
    const [k, v] = part.split('=');
    if (k === 'kind' && DATA.kinds.includes(v)) state.kind = v;
    else if (k === 'view' && v in VIEWS) state.view = v;
    else if (k === 'head' && v === 'mean') state.head = 'mean';
    else if (['s', 'layer', 'head'].includes(k) && v !== undefined && /^\d+$/.test(v)) state[k] = parseInt(v, 10);
  }
  state.s = Math.min(state.s, DATA.sentences.length - 1);
  state.layer = Math.min(state.layer, DATA.layers - 1);
  state.shown = null;
  clampHead();
}

function writeHash() {
  history.replaceState(null, '',
    `#s=${state.s}&kind=${state.kind}&layer=${state.layer}&head=${state.head}&view=${state.view}`);
}

function option(sel, value, text) {
  const o = document.createElement('option'); o.value = value; o.textContent = text; sel.appendChild(o);
}

function buildControls() {
  DATA.sentences.forEach((s, i) => option($('sentence'), i, `${i}: ${s.source}`));
  DATA.kinds.forEach(k => option($('kind'), k, DATA.kind_names[k]));
  for (let l = 0; l < DATA.layers; l++) option($('layer'), l, `layer ${l}`);
  for (const [v, text] of Object.entries(VIEWS)) option($('view'), v, text);
  for (const [id, key] of [['view', 'view'], ['sentence', 's'], ['kind', 'kind'], ['layer', 'layer'],
                           ['head', 'head']]) {
    $(id).addEventListener('change', e => {
      const v = e.target.value;
      state[key] = (key === 'kind' || key === 'view' || v === 'mean') ? v : parseInt(v, 10);
      state.shown = null;
      render();
    });
  }
  $('colour-bar').style.background = `linear-gradient(to right, ${DATA.colours.join(', ')})`;
  document.addEventListener('keydown', arrowKey);
  window.addEventListener('resize', () => render());
}

function arrowKey(e) {  // left/right: head ("mean" first), up/down: layer
  const step = {ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0]}[e.key];
  if (!step || e.altKey || e.ctrlKey || e.metaKey) return;
  if (e.target instanceof HTMLSelectElement) return;  // a focused menu keeps its own keys
  e.preventDefault();
  state.layer = Math.min(DATA.layers - 1, Math.max(0, state.layer + step[0]));
  clampHead();
  const order = ['mean', ...Array.from({length: headsOf(state.kind, state.layer)}, (_, h) => h)];
  state.head = order[Math.min(order.length - 1, Math.max(0, order.indexOf(state.head) + step[1]))];
  state.shown = null;
  render();
}

function fillHeads() {  // the chosen layer's heads only
  const sel = $('head'), n = headsOf(state.kind, state.layer);
  if (sel.options.length === n + 1) return;
  sel.replaceChildren();
  option(sel, 'mean', 'mean over heads');
  for (let h = 0; h < n; h++) option(sel, h, `head ${h}`);
}

// ---------------------------------------------------------------- data
function matrix(layer = state.layer, head = state.head, kind = state.kind) {
  const per = DATA.sentences[state.s].attn[kind][layer];
  if (head !== 'mean') return per[head];
  return per[0].map((row, q) => row.map((_, k) => per.reduce((a, h) => a + h[q][k], 0) / per.length));
}

function importance(layer, head, kind = state.kind) {  // Michel et al.'s score from heads.json, or null
  const table = DATA.importance && DATA.importance[kind];
  const score = table && head !== 'mean' && table[layer] ? table[layer][head] : undefined;
  return typeof score === 'number' ? score : null;
}

function labels(kind = state.kind) {  // [row tokens, column tokens]: see the caption
  const s = DATA.sentences[state.s], [r, c] = DATA.rows_cols[kind];
  return [s[r], s[c]];
}

const blocked = (kind, q, k) => kind === 'dec_self' && k > q;

// ---------------------------------------------------------------- head view: one heatmap, the page's width
function clearHighlight() {
  document.querySelectorAll('th[data-w], span.tok[data-w]').forEach(t => {
    t.style.background = ''; t.style.color = ''; delete t.dataset.w;
  });
  document.querySelectorAll('.hl, .active').forEach(t => t.classList.remove('hl', 'active'));
  document.querySelectorAll('#lines-body path').forEach(p => { p.style.display = ''; });
  $('status').textContent = '';
}

function highlightQuery(q) {
  const W = matrix(), [rows] = labels(); clearHighlight();
  document.querySelectorAll('th.col').forEach((t, k) => paint(t, W[q][k]));
  document.querySelector(`tr[data-q="${q}"]`).classList.add('hl');
  $('status').textContent = `query ${q} (${rows[q]}): its weights over the keys colour the column labels`;
}

function highlightKey(k) {
  const W = matrix(), [, cols] = labels(); clearHighlight();
  document.querySelectorAll('th.row').forEach((t, q) => paint(t, W[q][k]));
  document.querySelector(`th.col[data-k="${k}"]`).classList.add('hl');
  $('status').textContent = `key ${k} (${cols[k]}) is read by the queries whose labels it colours`;
}

function textWidth(tokens, px = 7.5) { return Math.max(...tokens.map(t => t.length)) * px + 14; }

function renderHead() {
  const W = matrix(), [rows, cols] = labels(), score = importance(state.layer, state.head);
  $('importance').textContent = score === null ? '' :
    `importance of layer ${state.layer}, head ${state.head}: ${score.toFixed(3)} (heads.json)`;
  const width = $('main').clientWidth, rowHead = Math.min(200, textWidth(rows));
  const cellW = (width - rowHead) / cols.length, cellH = Math.max(18, Math.min(34, Math.round(cellW * 0.6)));
  const vertical = textWidth(cols) > cellW;
  const table = document.createElement('table'); table.className = vertical ? 'heat vertical' : 'heat';
  const group = document.createElement('colgroup'), first = document.createElement('col');
  first.style.width = `${rowHead}px`; group.appendChild(first);
  cols.forEach(() => group.appendChild(document.createElement('col')));
  table.appendChild(group);
  const head = table.insertRow(); head.appendChild(document.createElement('th'));
  cols.forEach((c, k) => {
    const th = document.createElement('th'); th.className = 'col'; th.dataset.k = k; th.textContent = c;
    th.title = `key ${k}: ${c}`;
    th.addEventListener('mouseenter', () => highlightKey(k));
    head.appendChild(th);
  });
  rows.forEach((r, q) => {
    const tr = table.insertRow(); tr.dataset.q = q; tr.style.height = `${cellH}px`;
    const th = document.createElement('th'); th.className = 'row'; th.textContent = r; th.title = `query ${q}: ${r}`;
    tr.appendChild(th);
    cols.forEach((_, k) => {
      const td = tr.insertCell(); td.className = 'cell'; td.dataset.q = q; td.dataset.k = k;
      if (blocked(state.kind, q, k)) {
        td.classList.add('blocked'); td.title = 'blocked by the causal mask';
      } else {
        const c = colourOf(W[q][k]);
        td.style.background = c;
        td.title = `${r} -> ${cols[k]}: ${W[q][k].toFixed(3)}`;
        if (cellW >= 34) { td.textContent = W[q][k].toFixed(2); td.style.color = inkOn(c); }
      }
      td.addEventListener('mouseenter', () => highlightQuery(q));
    });
    th.addEventListener('mouseenter', () => highlightQuery(q));
  });
  table.addEventListener('mouseleave', clearHighlight);
  $('heatmap').replaceChildren(table);
}

// ---------------------------------------------------------------- lines view (bertviz's head view)
function shownHeads() {
  const n = headsOf(state.kind, state.layer);
  if (state.shown === null) {
    state.shown = new Set(state.head === 'mean' ? Array.from({length: n}, (_, h) => h) : [state.head]);
  }
  return state.shown;
}

function tokenColumn(tokens, side) {
  const col = document.createElement('div'); col.className = `tokcol ${side}`;
  tokens.forEach((t, i) => {
    const span = document.createElement('span'); span.className = `tok ${side}`; span.dataset.i = i;
    span.textContent = t;
    span.addEventListener('mouseenter', () => onlyLinesOf(side, i));
    span.addEventListener('mouseleave', clearHighlight);
    col.appendChild(span);
  });
  return col;
}

function onlyLinesOf(side, i) {
  clearHighlight();
  document.querySelectorAll('#lines-body path').forEach(p => {
    if (p.dataset[side] !== String(i)) p.style.display = 'none';
  });
  document.querySelector(`span.tok.${side}[data-i="${i}"]`).classList.add('active');
  const [rows, cols] = labels();
  $('status').textContent = side === 'q' ? `the lines of query ${i} (${rows[i]})` : `the lines into key ${i} (${cols[i]})`;
}

function renderSwatches(n, shown) {
  const box = document.createElement('div'); box.id = 'swatches';
  box.append('heads (click: show or hide, double click: only this one):');
  for (let h = 0; h < n; h++) {
    const sw = document.createElement('div'); sw.className = shown.has(h) ? 'head' : 'head off';
    sw.dataset.h = h; sw.style.background = DATA.head_colours[h % DATA.head_colours.length];
    sw.title = `head ${h}`;
    sw.addEventListener('click', () => { shown.has(h) ? shown.delete(h) : shown.add(h); render(); });
    sw.addEventListener('dblclick', () => { state.shown = new Set([h]); render(); });
    box.appendChild(sw);
  }
  $('swatches').replaceWith(box);
}

function renderLines() {
  const [rows, cols] = labels(), n = headsOf(state.kind, state.layer), shown = shownHeads();
  renderSwatches(n, shown);
  const per = DATA.sentences[state.s].attn[state.kind][state.layer];
  const width = Math.max(240, Math.min(520, $('lines').clientWidth - textWidth(rows) - textWidth(cols) - 40));
  const height = Math.max(rows.length, cols.length) * ROW_PX;
  const NS = 'http://www.w3.org/2000/svg', svg = document.createElementNS(NS, 'svg');
  svg.setAttribute('width', width); svg.setAttribute('height', height);
  for (const h of [...shown].sort()) {
    for (let q = 0; q < rows.length; q++) {
      for (let k = 0; k < cols.length; k++) {
        const w = per[h][q][k];
        if (w < DATA.line_min) continue;
        const path = document.createElementNS(NS, 'path'), y1 = (q + 0.5) * ROW_PX, y2 = (k + 0.5) * ROW_PX;
        path.setAttribute('d', `M0,${y1} C${width / 2},${y1} ${width / 2},${y2} ${width},${y2}`);
        path.setAttribute('fill', 'none'); path.setAttribute('stroke-width', '2');
        path.setAttribute('stroke', DATA.head_colours[h % DATA.head_colours.length]);
        path.setAttribute('stroke-opacity', w.toFixed(3));
        Object.assign(path.dataset, {h, q, k, w: w.toFixed(4)});
        svg.appendChild(path);
      }
    }
  }
  $('lines-body').replaceChildren(tokenColumn(rows, 'q'), svg, tokenColumn(cols, 'k'));
  const score = importance(state.layer, state.head);
  $('importance').textContent = score === null ? '' :
    `importance of layer ${state.layer}, head ${state.head}: ${score.toFixed(3)} (heads.json)`;
}

// ---------------------------------------------------------------- model view: every kind, layer x head
function thumbnail(kind, layer, head, scale) {
  // one canvas pixel per (query, key), scaled up without smoothing; the same colours as the heatmap
  const W = matrix(layer, head, kind), q = W.length, k = W[0].length;
  const canvas = document.createElement('canvas'); canvas.width = k; canvas.height = q;
  canvas.style.width = `${k * scale}px`; canvas.style.height = `${q * scale}px`;
  const ctx = canvas.getContext('2d');
  for (let r = 0; r < q; r++) {
    for (let c = 0; c < k; c++) {
      ctx.fillStyle = blocked(kind, r, c) ? DATA.masked : colourOf(W[r][c]);
      ctx.fillRect(c, r, 1, 1);
    }
  }
  return canvas;
}

function labelStrip(tokens, scale, across) {
  const strip = document.createElement('div'); strip.className = across ? 'clabels' : 'rlabels';
  const font = Math.min(11, scale - 1);
  tokens.forEach(t => {
    // a label is as long as its token: a subword is short, and a cut one (orangefarbe) reads as another word
    const span = document.createElement('span'); span.textContent = t; span.style.fontSize = `${font}px`;
    if (across) span.style.width = `${scale}px`; else span.style.height = `${scale}px`;
    strip.appendChild(span);
  });
  return strip;
}

function kindBlock(kind) {
  const block = document.createElement('div'); block.className = 'kind-block'; block.dataset.kind = kind;
  const title = document.createElement('h3'); title.textContent = DATA.kind_names[kind];
  const how = document.createElement('div'); how.className = 'how'; how.textContent = DATA.captions[kind];
  const [rows, cols] = labels(kind), most = mostHeads(kind);
  const room = ($('model').clientWidth - 140) / most - 16;
  const scale = Math.max(1, Math.min(14, Math.floor(room / Math.max(rows.length, cols.length))));
  const labelled = scale >= 8;  // token labels where they fit: at least 8 pixels a token
  const table = document.createElement('table'); table.className = 'model';
  const top = table.insertRow(); top.appendChild(document.createElement('th'));
  const uneven = DATA.head_counts[kind].some(n => n !== most);
  for (let h = 0; h < most; h++) {
    const th = document.createElement('th'); th.textContent = `head ${h}`; top.appendChild(th);
  }
  for (let l = 0; l < DATA.layers; l++) {
    const tr = table.insertRow(), n = headsOf(kind, l);
    const th = document.createElement('th'); tr.appendChild(th);
    th.textContent = uneven ? `layer ${l} (${n} head${n === 1 ? '' : 's'})` : `layer ${l}`;
    for (let h = 0; h < n; h++) {
      const td = tr.insertCell(); td.className = 'thumb';
      Object.assign(td.dataset, {kind, layer: l, head: h});
      td.title = `${DATA.kind_names[kind]}, layer ${l}, head ${h}: click to open in the head view`;
      const grid = document.createElement('div'); grid.className = 'thumbgrid';
      grid.append(labelled && h === 0 ? labelStrip(rows, scale, false) : document.createElement('div'),
                  thumbnail(kind, l, h, scale));
      if (labelled && l === DATA.layers - 1) grid.append(document.createElement('div'), labelStrip(cols, scale, true));
      td.appendChild(grid);
      const score = importance(l, h, kind);
      if (score !== null) {
        const div = document.createElement('div'); div.className = 'score';
        div.textContent = `importance ${score.toFixed(3)}`; td.appendChild(div);
      }
      td.addEventListener('click', () => {
        Object.assign(state, {view: 'head', kind, layer: l, head: h, shown: null}); render();
      });
    }
    if (n < most) {  // the heads this layer does not have (pruned): one empty cell
      const td = tr.insertCell(); td.className = 'gone'; td.colSpan = most - n;
      td.title = `layer ${l} keeps ${n} of the model's ${DATA.heads} heads (pruned)`;
    }
  }
  block.append(title, how, table);
  return block;
}

function renderModel() {
  $('model').replaceChildren(...DATA.kinds.map(kindBlock));
  $('importance').textContent = DATA.importance ? "importance: each head's score from heads.json " +
    '(Michel et al. 2019; higher = the loss depends more on the head)'
    : 'no heads.json beside the checkpoint (make heads writes one: each head\'s importance score)';
}

// ---------------------------------------------------------------- the page
function render() {
  clampHead(); fillHeads(); writeHash();
  $('view').value = state.view; $('sentence').value = state.s; $('kind').value = state.kind;
  $('layer').value = state.layer; $('head').value = state.head;
  const s = DATA.sentences[state.s], model = state.view === 'model';
  $('sentence-text').textContent = `source: ${s.source}  |  translation: ${s.translation}` +
    (s.reference ? `  |  reference: ${s.reference}` : '');
  $('caption').textContent = model ? `How to read: ${DATA.reading}.`
    : `How to read: ${DATA.captions[state.kind]}; ${DATA.word_mark}.`;
  $('main').hidden = state.view !== 'head'; $('lines').hidden = state.view !== 'lines'; $('model').hidden = !model;
  // the colour bar where colours are weights (not in the lines view: there a line's opacity is its weight);
  // the grey swatch where the causal mask blanks cells: the decoder's self-attention, and the model view
  $('legend').hidden = state.view === 'lines';
  $('mask-key').hidden = !(model || state.kind === 'dec_self');
  $('kind').disabled = model;
  clearHighlight();
  if (model) renderModel();
  else if (state.view === 'lines') renderLines();
  else renderHead();
  if (DATA.circuits) {  // circuits.html of the same model beside the dump: the chosen head's circuits
    const link = $('circuits-link');
    link.hidden = false;
    link.href = `${DATA.circuits}#kind=${state.kind}&layer=${state.layer}&head=${state.head === 'mean' ? 0 : state.head}`;
  }
  document.body.dataset.rendered = model ? `${state.s}/model`
    : `${state.s}/${state.kind}/${state.layer}/${state.head}${state.view === 'lines' ? '/lines' : ''}`;
  tellHeight();
}

function tellHeight() {  // inside another page's frame: say how tall the page is, so the frame can fit it
  if (window.parent === window || !document.body.classList.contains('embedded')) return;
  window.parent.postMessage({viewerHeight: Math.ceil(document.documentElement.getBoundingClientRect().height)},
                            '*');
}

readHash(); buildControls(); render();
window.addEventListener('hashchange', () => { readHash(); render(); });
