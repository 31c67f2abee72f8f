const DATA = JSON.parse(document.getElementById('attention-data').textContent);
const state = {s: 0, kind: 'encoder', layer: 0, head: 0, view: 'head'};
const COLOUR = '33, 102, 172';  // one hue; the weight is its opacity on white (the legend shows the scale)
const $ = id => document.getElementById(id);
// heads of one kind and layer: a pruned model keeps fewer in some layers
const headsOf = (kind, layer) => DATA.head_counts[kind][layer];
const mostHeads = kind => Math.max(...DATA.head_counts[kind]);

function clampHead() {
  if (state.head !== 'mean') state.head = Math.min(state.head, headsOf(state.kind, state.layer) - 1);
}

function readHash() {
  for (const part of location.hash.replace(/^#/, '').split('&')) {
    const [k, v] = part.split('=');
    if (k === 'kind' && DATA.kinds.includes(v)) state.kind = v;
    else if (k === 'view' && (v === 'head' || v === 'model')) state.view = v;
    else if (k === 'head' && v === 'mean') state.head = 'mean';
    else if (k in state && v !== undefined && /^\d+$/.test(v)) state[k] = parseInt(v, 10);
  }
  state.s = Math.min(state.s, DATA.sentences.length - 1);
  state.layer = Math.min(state.layer, DATA.layers - 1);
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
  option($('view'), 'head', 'one head');
  option($('view'), 'model', 'model view: every layer x head');
  for (const [id, key] of [['view', 'view'], ['sentence', 's'], ['kind', 'kind'], ['layer', 'layer'],
                           ['head', 'head']]) {
    $(id).addEventListener('change', e => {
      const v = e.target.value;
      state[key] = (key === 'kind' || key === 'view' || v === 'mean') ? v : parseInt(v, 10);
      render();
    });
  }
}

function fillHeads() {  // the chosen layer's heads only
  const sel = $('head'), n = headsOf(state.kind, state.layer);
  if (sel.options.length === n + 1) return;
  sel.replaceChildren();
  option(sel, 'mean', 'mean over heads');
  for (let h = 0; h < n; h++) option(sel, h, `head ${h}`);
}

function matrix(layer = state.layer, head = state.head) {
  const per = DATA.sentences[state.s].attn[state.kind][layer];
  if (head !== 'mean') return per[head];
  return per[0].map((row, q) => row.map((_, k) => per.reduce((a, h) => a + h[q][k], 0) / per.length));
}

function importance(layer, head) {  // Michel et al.'s score from heads.json, or null
  const table = DATA.importance && DATA.importance[state.kind];
  const score = table && head !== 'mean' && table[layer] ? table[layer][head] : undefined;
  return typeof score === 'number' ? score : null;
}

function labels() {
  const s = DATA.sentences[state.s], [r, c] = DATA.rows_cols[state.kind];
  return [s[r], s[c]];
}

function shade(el, w, rgb) {
  el.style.background = `rgba(${rgb}, ${w.toFixed(3)})`;
  el.dataset.w = w.toFixed(4);
}

function clearHighlight() {
  document.querySelectorAll('span.tok').forEach(t => {
    t.style.background = ''; delete t.dataset.w; t.classList.remove('active');
  });
  document.querySelectorAll('.hl').forEach(t => t.classList.remove('hl'));
  $('status').textContent = '';
}

function highlightQuery(q) {
  const W = matrix(); clearHighlight();
  document.querySelectorAll('span.tok.k').forEach((t, k) => shade(t, W[q][k], '230, 120, 0'));
  document.querySelector(`span.tok.q[data-i="${q}"]`).classList.add('active');
  document.querySelector(`tr[data-q="${q}"]`).classList.add('hl');
  const [rows] = labels();
  $('status').textContent = `query ${q} (${rows[q]}) attends to the keys shaded on the right`;
}

function highlightKey(k) {
  const W = matrix(); clearHighlight();
  document.querySelectorAll('span.tok.q').forEach((t, q) => shade(t, W[q][k], '0, 110, 200'));
  document.querySelector(`span.tok.k[data-i="${k}"]`).classList.add('active');
  document.querySelector(`th.col[data-k="${k}"]`).classList.add('hl');
  const [, cols] = labels();
  $('status').textContent = `key ${k} (${cols[k]}) is read by the queries shaded on the left`;
}

function thumbnail(layer, head) {
  // one canvas pixel per (query, key), scaled up without smoothing; the same colours as the big heatmap
  const W = matrix(layer, head), q = W.length, k = W[0].length;
  const canvas = document.createElement('canvas'); canvas.width = k; canvas.height = q;
  const scale = Math.max(1, Math.min(8, Math.floor(110 / Math.max(q, k))));
  canvas.style.width = `${k * scale}px`; canvas.style.height = `${q * scale}px`;
  const ctx = canvas.getContext('2d');
  for (let r = 0; r < q; r++) {
    for (let c = 0; c < k; c++) {
      const blocked = state.kind === 'decoder_self' && c > r;
      ctx.fillStyle = blocked ? '#d8d8d8' : `rgba(${COLOUR}, ${W[r][c].toFixed(4)})`;
      ctx.fillRect(c, r, 1, 1);
    }
  }
  return canvas;
}

function renderModel() {
  const table = document.createElement('table'); table.className = 'model';
  const top = table.insertRow(); top.appendChild(document.createElement('th'));
  const most = mostHeads(state.kind), uneven = DATA.head_counts[state.kind].some(n => n !== most);
  for (let h = 0; h < most; h++) {
    const th = document.createElement('th'); th.textContent = `head ${h}`; top.appendChild(th);
  }
  for (let l = 0; l < DATA.layers; l++) {
    const tr = table.insertRow(), n = headsOf(state.kind, l);
    const th = document.createElement('th'); tr.appendChild(th);
    th.textContent = uneven ? `layer ${l} (${n} head${n === 1 ? '' : 's'})` : `layer ${l}`;
    for (let h = 0; h < n; h++) {
      const td = tr.insertCell(); td.className = 'thumb'; td.dataset.layer = l; td.dataset.head = h;
      td.title = `layer ${l}, head ${h}: click to zoom`;
      td.appendChild(thumbnail(l, h));
      const score = importance(l, h);
      if (score !== null) {
        const div = document.createElement('div'); div.className = 'score';
        div.textContent = `importance ${score.toFixed(3)}`; td.appendChild(div);
      }
      td.addEventListener('click', () => { state.view = 'head'; state.layer = l; state.head = h; render(); });
    }
    if (n < most) {  // the heads this layer does not have (pruned): one empty cell
      const td = tr.insertCell(); td.className = 'gone'; td.colSpan = most - n;
      td.title = `layer ${l} keeps ${n} of the model's ${DATA.heads} heads (pruned)`;
    }
  }
  $('model').replaceChildren(table);
  $('importance').textContent = DATA.importance ? "importance: each head's score from heads.json " +
    '(Michel et al. 2019; higher = the loss depends more on the head)'
    : 'no heads.json beside the checkpoint (make heads writes one: each head\'s importance score)';
  document.body.dataset.rendered = `${state.s}/${state.kind}/model`;
}

function render() {
  clampHead(); fillHeads(); writeHash();
  $('view').value = state.view; $('sentence').value = state.s; $('kind').value = state.kind;
  $('layer').value = state.layer; $('head').value = state.head;
  const s = DATA.sentences[state.s], [rname, cname] = DATA.rows_cols[state.kind];
  $('caption').textContent =
    `source: ${s.source}  |  translation: ${s.translation}  |  rows: ${rname}, columns: ${cname}`;
  const model = state.view === 'model';
  $('main').hidden = model; $('model').hidden = !model;
  $('layer').disabled = $('head').disabled = model;
  clearHighlight();
  if (model) return renderModel();
  const W = matrix(), [rows, cols] = labels(), score = importance(state.layer, state.head);
  $('importance').textContent = score === null ? '' :
    `importance of layer ${state.layer}, head ${state.head}: ${score.toFixed(3)} (heads.json)`;
  const table = document.createElement('table'); table.className = 'heat';
  const head = table.insertRow(); head.appendChild(document.createElement('th'));
  cols.forEach((c, k) => {
    const th = document.createElement('th'); th.className = 'col'; th.dataset.k = k; th.textContent = c;
    head.appendChild(th);
  });
  rows.forEach((r, q) => {
    const tr = table.insertRow(); tr.dataset.q = q;
    const th = document.createElement('th'); th.className = 'row'; th.textContent = r; tr.appendChild(th);
    cols.forEach((_, k) => {
      const td = tr.insertCell(); td.className = 'cell'; td.dataset.q = q; td.dataset.k = k;
      if (state.kind === 'decoder_self' && k > q) {
        td.classList.add('blocked'); td.title = 'blocked by the causal mask';
      } else {
        td.style.background = `rgba(${COLOUR}, ${W[q][k].toFixed(3)})`;
        td.title = `${r} -> ${cols[k]}: ${W[q][k].toFixed(3)}`;
      }
      td.addEventListener('mouseenter', () => highlightQuery(q));
    });
    th.addEventListener('mouseenter', () => highlightQuery(q));
  });
  table.addEventListener('mouseleave', clearHighlight);
  $('heatmap').replaceChildren(table);
  const qcol = document.createElement('div'), kcol = document.createElement('div');
  qcol.className = kcol.className = 'tokcol';
  qcol.innerHTML = '<h4>queries (hover)</h4>'; kcol.innerHTML = '<h4>keys (hover)</h4>';
  rows.forEach((r, q) => {
    const t = document.createElement('span'); t.className = 'tok q'; t.dataset.i = q; t.textContent = r;
    if (state.kind === 'cross') t.title = `reads ${s.tgt_in_tokens[q]}, produces ${s.tgt_out_tokens[q]}`;
    t.addEventListener('mouseenter', () => highlightQuery(q)); t.addEventListener('mouseleave', clearHighlight);
    qcol.appendChild(t);
  });
  cols.forEach((c, k) => {
    const t = document.createElement('span'); t.className = 'tok k'; t.dataset.i = k; t.textContent = c;
    t.addEventListener('mouseenter', () => highlightKey(k)); t.addEventListener('mouseleave', clearHighlight);
    kcol.appendChild(t);
  });
  $('tokens').replaceChildren(qcol, kcol);
  document.body.dataset.rendered = `${state.s}/${state.kind}/${state.layer}/${state.head}`;
}

readHash(); buildControls(); render();
window.addEventListener('hashchange', () => { readHash(); render(); });
