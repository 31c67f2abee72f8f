const DATA = JSON.parse(document.getElementById('circuits-data').textContent);
const $ = id => document.getElementById(id);
const KINDS = Object.keys(DATA.kind_names);
const keyOf = r => `${r.site[0]}:${r.site[1]}:${r.head}`;
const RECORDS = new Map(DATA.heads.map(r => [keyOf(r), r]));
const LAYERS = Math.max(...DATA.heads.map(r => r.site[1])) + 1;
// what a query and a key are at each kind, in the direct path's terms: the token embedded at that position
const ROLES = {
  enc_self: ['a source token', 'a source token of the same sentence'],
  dec_self: ['the target token fed in at the looking position (the word just written)',
             'a target token fed in at or before it'],
  cross: ['the target token fed in at the decoder\'s position', 'a source token'],
};
const state = {key: null, q: null, k: null, find: ''};

// ---------------------------------------------------------------- numbers and colours
const fmt = (v, d = 2) => (typeof v === 'number' ? v.toFixed(d) : '-');

function colourOf(x) {  // x in [0, 1] -> the colour table sampled from the pictures' colour map
  const n = DATA.colours.length;
  return DATA.colours[Math.round(Math.min(1, Math.max(0, x)) * (n - 1))];
}

function inkOn(hex) {  // black or white text, whichever reads better on `hex`
  const [r, g, b] = [1, 3, 5].map(i => parseInt(hex.slice(i, i + 2), 16) / 255);
  return 0.299 * r + 0.587 * g + 0.114 * b > 0.55 ? '#000' : '#fff';
}

const signed = (v, bound) => colourOf(0.5 + 0.5 * v / (bound || 1));  // -bound..bound -> the colour map

// ---------------------------------------------------------------- heads: counts, labels, the picker
function headCount(kind, layer) { return DATA.heads.filter(r => r.site[0] === kind && r.site[1] === layer).length; }

function prunedNote() {  // the attentions that keep fewer heads than the others
  const counts = KINDS.flatMap(kind => Array.from({length: LAYERS}, (_, l) => [kind, l, headCount(kind, l)]));
  const most = Math.max(...counts.map(c => c[2]));
  const short = counts.filter(c => c[2] < most);
  if (!short.length) return '';
  return 'heads removed by pruning have no circuit: ' +
    short.map(([kind, l, n]) => `${DATA.kind_names[kind]} layer ${l} keeps ${n} of ${most}`).join('; ') +
    ' (its heads numbered as the pruned model numbers them)';
}

// the role measured on the real attention (score_terms.py), the weights' position label beside it where they differ
function roleLabel(r) {
  const measured = r.roles ? r.roles.label : null, weights = r.positions.label;
  if (measured === null) return weights;
  return measured === weights ? measured : `${measured} (weights: ${weights})`;
}

function headLabel(r) {
  const rho = r.faithfulness ? r.faithfulness.rho[0] : null;
  let text = `head ${r.head}: ${roleLabel(r)}, rho ${fmt(rho)}`;
  if (r.site[0] === 'cross') {
    if (typeof r.aer === 'number') text += `, AER ${fmt(r.aer)}`;
    if (r.dictionary) text += `, OV P@1 ${fmt(r.dictionary.ov_precision[0])}`;
  }
  return text + (r.exact_direct_path ? ' (exact)' : '');
}

function buildHeads() {
  const sel = $('head');
  for (const kind of KINDS) {
    for (let l = 0; l < LAYERS; l++) {
      const rows = DATA.heads.filter(r => r.site[0] === kind && r.site[1] === l).sort((a, b) => a.head - b.head);
      const group = document.createElement('optgroup');
      group.label = `${DATA.kind_names[kind]}, layer ${l}` + (rows.length ? '' : ': every head removed');
      for (const r of rows) {
        const o = document.createElement('option'); o.value = keyOf(r); o.textContent = headLabel(r);
        group.appendChild(o);
      }
      sel.appendChild(group);
    }
  }
  sel.addEventListener('change', e => { choose(e.target.value); render(); });
  $('find').addEventListener('input', e => { state.find = e.target.value; renderTokens(); renderDictionary(); });
  $('colour-bar').style.background = `linear-gradient(to right, ${DATA.colours.join(', ')})`;
}

// ---------------------------------------------------------------- state <-> address
function choose(key) {  // a head; keep the chosen tokens where the new head has them
  const r = RECORDS.get(key) || RECORDS.get(defaultKey());
  state.key = keyOf(r);
  const qs = r.qk_rows.map(x => x[0]), ks = r.ov_rows.map(x => x[0]);
  if (!qs.includes(state.q)) state.q = qs.length ? qs[0] : null;
  if (!ks.includes(state.k)) state.k = ks.length ? ks[0] : null;
}

function defaultKey() {
  const best = DATA.best_cross_head;
  return best && RECORDS.has(best.join(':')) ? best.join(':') : keyOf(DATA.heads[0]);
}

function readHash() {
  const parts = Object.fromEntries(location.hash.replace(/^#/, '').split('&').filter(p => p.includes('='))
    .map(p => { const i = p.indexOf('='); return [p.slice(0, i), decodeURIComponent(p.slice(i + 1))]; }));
  if (parts.q !== undefined) state.q = parts.q;
  if (parts.k !== undefined) state.k = parts.k;
  choose(parts.kind !== undefined ? `${parts.kind}:${parts.layer}:${parts.head}` : defaultKey());
  if ((parts.q === undefined) !== (parts.k === undefined)) link(parts.q !== undefined ? 'q' : 'k');
}

function writeHash() {
  const [kind, layer, head] = state.key.split(':');
  const tokens = ['q', 'k'].filter(s => state[s] !== null).map(s => `&${s}=${encodeURIComponent(state[s])}`);
  history.replaceState(null, '', `#kind=${kind}&layer=${layer}&head=${head}${tokens.join('')}`);
}

// ---------------------------------------------------------------- the token lists and the bars
function matches(token) {
  const f = state.find.trim().toLowerCase();
  return !f || token.toLowerCase().includes(f) || token.replace(/^\u2581/, '').toLowerCase().startsWith(f);
}

function link(side) {  // self-attention: queries and keys are one language, so one token serves both
  const r = RECORDS.get(state.key), token = state[side];
  if (r.site[0] === 'cross') return;
  const other = side === 'q' ? r.ov_rows : r.qk_rows;
  if (other.some(x => x[0] === token)) state[side === 'q' ? 'k' : 'q'] = token;
}

function pick(side, token) {
  state[side] = token;
  link(side);
  render();
}

function tokenList(side, rows) {
  const box = $(side === 'q' ? 'qk-tokens' : 'ov-tokens');
  const shown = rows.filter(x => matches(x[0]));
  const list = shown.map(([token]) => {
    const b = document.createElement('button'); b.type = 'button'; b.className = 'tok'; b.textContent = token;
    b.dataset.token = token;
    if (token === state[side]) b.classList.add('chosen');
    b.addEventListener('click', () => pick(side, token));
    return b;
  });
  const count = document.createElement('div'); count.className = 'count';
  count.textContent = `${shown.length} of ${rows.length} tokens`;
  box.replaceChildren(count, ...list);
  const chosen = box.querySelector('button.chosen');  // in sight inside its list, without scrolling the page
  if (chosen) box.scrollTop = Math.max(0, chosen.offsetTop - box.clientHeight / 2);
}

function renderTokens() {
  const r = RECORDS.get(state.key);
  tokenList('q', r.qk_rows);
  tokenList('k', r.ov_rows);
}

function bars(box, entries, unit) {
  const bound = Math.max(1e-12, ...entries.map(e => Math.abs(e[1])));
  const rows = entries.map(([token, value]) => {
    const row = document.createElement('div'); row.className = 'barrow';
    row.dataset.token = token; row.dataset.value = value;
    const label = document.createElement('span'); label.className = 'label'; label.textContent = token;
    const track = document.createElement('span'); track.className = 'track';
    const fill = document.createElement('span'); fill.className = 'fill';
    fill.style.width = `${(100 * Math.abs(value) / bound).toFixed(1)}%`;
    fill.style.background = signed(value, bound);
    track.appendChild(fill);
    const number = document.createElement('span'); number.className = 'number'; number.textContent = fmt(value);
    row.title = `${token}: ${unit} ${value}`;
    row.append(label, track, number);
    return row;
  });
  box.replaceChildren(...rows);
}

function renderBars() {
  const r = RECORDS.get(state.key), [query, key] = ROLES[r.site[0]];
  const q = r.qk_rows.find(x => x[0] === state.q), k = r.ov_rows.find(x => x[0] === state.k);
  $('qk-title').textContent = q ? `QK: the keys the query \u201c${q[0]}\u201d matches best` : 'QK: no query token';
  $('ov-title').textContent = k ? `OV: what the head writes when it reads \u201c${k[0]}\u201d` : 'OV: no key token';
  $('qk-how').textContent = `A query is ${query}; a key is ${key}. W_QK = W_Q W_K\u1d40 scores each pair ` +
    'through the embeddings (divided by \u221ad_k, centred over the keys): the higher, the more attention.';
  $('ov-how').textContent = `When the head attends to a key (${key}), W_OV = W_V W_O is what it adds: here the ` +
    'output tokens whose logits it raises most (through the norms after it and the generator, centred).';
  bars($('qk-bars'), q ? q[1] : [], 'centred score');
  bars($('ov-bars'), k ? k[1] : [], 'logit raise');
}

// ---------------------------------------------------------------- positions and singular values
function renderPositions(r) {
  const t = r.positions.table, n = t.length;
  const bound = Math.max(1e-12, ...t.flat().filter(v => v !== null).map(Math.abs));
  const table = document.createElement('table'); table.className = 'positions';
  const top = table.insertRow(); top.appendChild(document.createElement('th'));
  for (let b = 0; b < n; b++) {
    const th = document.createElement('th'); th.textContent = b % 5 === 0 ? b : ''; top.appendChild(th);
  }
  t.forEach((row, a) => {
    const tr = table.insertRow(), th = document.createElement('th');
    th.textContent = a % 5 === 0 ? a : ''; tr.appendChild(th);
    row.forEach((v, b) => {
      const td = tr.insertCell();
      if (v === null) { td.style.background = DATA.masked; td.title = `query ${a}, key ${b}: the future, blocked`; }
      else { td.style.background = signed(v, bound); td.title = `query ${a}, key ${b}: ${v}`; }
    });
  });
  $('positions').replaceChildren(table);
  const exact = r.exact_direct_path ? 'exact here' : 'through the norms, an approximation';
  $('positions-how').textContent = `The QK circuit between positions alone (the sinusoids; ${exact}): query ` +
    'position down, key position across, each row centred, divided by the largest (-1 to 1). ' +
    `Label ${r.positions.label}: the offset (or key) at least half the queries prefer, else mixed.`;
  $('mask-key').hidden = r.site[0] !== 'dec_self';
}

function spectrumSvg(values, colour, rank) {
  const NS = 'http://www.w3.org/2000/svg', svg = document.createElementNS(NS, 'svg');
  const w = Math.max(2, Math.min(6, Math.floor(260 / values.length))), h = 70;
  svg.setAttribute('width', values.length * w); svg.setAttribute('height', h);
  const top = Math.log10(values[0] || 1), floor = top - 4;  // four decades on a log scale
  values.forEach((v, i) => {
    const y = v > 0 ? Math.max(0, Math.min(1, (Math.log10(v) - floor) / (top - floor))) : 0;
    const rect = document.createElementNS(NS, 'rect');
    rect.setAttribute('x', i * w); rect.setAttribute('width', Math.max(1, w - 1));
    rect.setAttribute('y', h - y * h); rect.setAttribute('height', Math.max(1, y * h));
    rect.setAttribute('fill', i < rank ? colour : DATA.masked);
    const title = document.createElementNS(NS, 'title'); title.textContent = `${i + 1}: ${v}`;
    rect.appendChild(title); svg.appendChild(rect);
  });
  return svg;
}

function renderSpectrum(r) {
  const parts = [['qk', 'W_QK', 0.3], ['ov', 'W_OV', 0.7]].map(([name, label, at]) => {
    const c = r[name], sv = c.singular_values, div = document.createElement('div'); div.className = 'spectrum';
    const text = document.createElement('div');
    text.textContent = `${label}: rank ${c.rank} of ${c.inner}; largest ${fmt(sv[0])}, ` +
      `smallest ${fmt(sv[sv.length - 1], 4)}`;
    div.append(text, spectrumSvg(sv, colourOf(at), c.rank));
    return div;
  });
  $('spectrum').replaceChildren(...parts);
  $('spectrum-how').textContent = 'How many directions the head really uses of the d_k it has: each circuit\'s ' +
    'singular values, largest first, on a log scale over four decades (grey: below the rank threshold).';
}

// ---------------------------------------------------------------- a cross head's dictionaries
function renderDictionary() {
  const r = RECORDS.get(state.key), d = r.dictionary, panel = $('dictionary-panel');
  panel.hidden = r.site[0] !== 'cross';
  if (panel.hidden) return;
  if (!d) {
    $('dictionary-how').textContent = 'No dictionary: the command ran without the aligner (--no-aligner).';
    $('dictionary').replaceChildren();
    return;
  }
  const coverage = d.coverage ? ` (the ${d.coverage[0]} of the lexicon's ${d.coverage[1]} most frequent that ` +
    `occur in the pairs read` + (d.ov_unmatchable ? `; for ${d.ov_unmatchable[0]} of them no accepted ` +
    `translation is one word-initial piece, so OV cannot be right there` : '') + ')' : '';
  const controls = d.ov_controls ? ' OV controls, precision@1: ' + Object.entries(d.ov_controls)
    .map(([name, p]) => `${name} ${fmt(p[0])}`).join(', ') + '.' : '';
  $('dictionary-how').textContent = `For the most frequent source words, averaged over training pairs: ` +
    `what the head writes when it reads the word (OV: precision@1 ${fmt(d.ov_precision[0])}, ` +
    `@5 ${fmt(d.ov_precision[1])} against the aligner's lexicon over ${d.words} words${coverage}) and the ` +
    `target words whose queries pick it (QK: @1 ${fmt(d.qk_precision[0])}, @5 ${fmt(d.qk_precision[1])})` +
    (typeof r.aer === 'number' ? `; its attention's alignment error rate: ${fmt(r.aer)}.` : '.') + controls +
    interventionText(r);
  const table = document.createElement('table'); table.className = 'dictionary';
  const head = table.insertRow();
  for (const t of ['source word', 'reads -> writes (OV)', 'queries that pick it (QK)']) {
    const th = document.createElement('th'); th.textContent = t; head.appendChild(th);
  }
  for (const word of Object.keys(d.ov).filter(matches)) {
    const tr = table.insertRow(); tr.dataset.word = word;
    tr.insertCell().textContent = word;
    tr.insertCell().textContent = (d.ov[word] || []).join(', ');
    tr.insertCell().textContent = (d.qk[word] || []).join(', ');
  }
  $('dictionary').replaceChildren(table);
}

function interventionText(r) {  // the head's replaced output, when `make circuits` tested it
  const t = (DATA.interventions || []).find(x => x.site[0] === r.site[0] && x.site[1] === r.site[1] &&
    x.head === r.head);
  if (!t) return '';
  const part = (measure, what) => t[measure] ? ` Log-probability of ${what}, change per token when the ` +
    `head's output is replaced: ` + Object.entries(t[measure]).map(([how, p]) =>
      `${how} ${fmt(p.head[0], 3)} [${fmt(p.head[1], 3)}, ${fmt(p.head[2], 3)}] (head ${t.neighbour}: ` +
      `${fmt(p.neighbour[0], 3)})`).join(', ') + '.' : '';
  return part('translation', 'the translation of the word it attends to') +
    part('reference', 'the reference next token');
}

function copyingText(r) {  // the copying score's gloss holds only where input and output are one language
  const score = fmt(r.copying_score);
  if (r.site[0] === 'dec_self') return `copying score ${score} (1: it writes what it reads)`;
  const itself = typeof r.reads_itself === 'number'
    ? `; its top write is the very token it read for ${(100 * r.reads_itself).toFixed(0)}% of the most ` +
      `frequent tokens it reads` : '';
  return `shared-vocabulary score ${score} (it reads the source language and is read in the target's: ` +
    `positive when reading a piece raises that same piece's logit on average, as names and numbers do` +
    itself + (r.site[0] === 'cross' ? '; it translates, see its dictionary' : '') + ')';
}

// ---------------------------------------------------------------- the page
function renderSummary(r) {
  const [kind, layer] = r.site, f = r.faithfulness;
  const faithful = f ? `rank correlation with its real scores on validation sentences rho ${fmt(f.rho[0])} ` +
    `[${fmt(f.rho[1])}, ${fmt(f.rho[2])}], argmax agreement ${fmt(f.argmax[0])} ` +
    `[${fmt(f.argmax[1])}, ${fmt(f.argmax[2])}] (95% intervals)` : 'no faithfulness measured';
  let text = `${DATA.kind_names[kind]}, layer ${layer}, head ${r.head}: positions ${r.positions.label}; ` +
    copyingText(r);
  if (kind === 'cross' && typeof r.aer === 'number') text += `; alignment error rate ${fmt(r.aer)}`;
  $('summary').textContent = text;
  $('exactness').textContent = r.exact_direct_path
    ? `Exact: this head reads the embeddings plus the positions and nothing else (the first layer of a ` +
      `post-norm model), so its scores are exactly the token table plus the position table plus their two ` +
      `cross terms; ${faithful}.`
    : `Weights-only approximation: this head reads what earlier layers wrote` +
      (kind === 'cross' ? ' (its keys come from the encoder\'s last layer)' : '') +
      `, and these tables read it through the embeddings alone; ${faithful}.`;
  $('exactness').className = r.exact_direct_path ? 'exact' : 'approximate';
  $('roles').textContent = DATA.word_mark;
}

function render() {
  const r = RECORDS.get(state.key);
  writeHash();
  $('head').value = state.key;
  renderSummary(r);
  renderTokens();
  renderBars();
  renderPositions(r);
  renderSpectrum(r);
  renderDictionary();
  if (DATA.viewer) {
    const link = $('viewer-link');
    link.hidden = false;
    link.href = `${DATA.viewer}#kind=${r.site[0]}&layer=${r.site[1]}&head=${r.head}&view=head`;
    link.title = 'this head\'s attention on the dumped sentences';
  }
  document.body.dataset.rendered = `${state.key}/${state.q}/${state.k}`;
}

const note = prunedNote();
$('pruned').hidden = !note; $('pruned').textContent = note;
buildHeads(); readHash(); render();
window.addEventListener('hashchange', () => { readHash(); render(); });
