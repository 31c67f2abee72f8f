# %% [markdown]
# # The chapter as a notebook that shows its work
#
# `make notebook` turns `annotated/transformer.py` into
# `docs/_build/transformer.ipynb` and runs it, so that a reader who opens the
# file sees what the Annotated Transformer's readers see: the examples with
# their results, and the pictures, inline, next to the prose.
#
# * **The chapter's cells, unchanged.** jupytext splits the module into its
#   prose and code cells, the same split `make docs` uses.
# * **The prose's examples, run.** The doctest examples inside a prose cell
#   (`>>> ...`) become a code cell right after it. They stay doctests in the
#   module, where `make test` checks their printed results; in the notebook
#   they run again and show those results.
# * **Figures drawn by the chapter's own code.** The chapter's figures of the
#   page (`docs/figures.py`), drawn by cells that call what the code above
#   them defines: the score variance with and without `sqrt(d_k)`, the
#   masks, the positional encoding, the learning-rate schedule, and the
#   attention of a copy-task model trained by `train_copy_task` (400 steps,
#   about half a minute on a CPU), recorded by `record_attention`
#   (`annotated/recording.py`) and drawn in the colour map and with the
#   colour bar of every attention picture (`CMAP` of
#   `annotated/attention/pictures.py`).
# * **A few "try it" cells.** Short cells that call the code just defined
#   and show the result: a multi-head attention's output shape, the largest
#   difference between a per-head attention and its fused conversion, a
#   small model's parameter count and logits, greedy decoding with it, and
#   the exact-match accuracy of the copy model of the figure (`TRIES`).
# * **A trained translator at the end.** After the chapter, cells load the
#   de -> en model shipped in the package (`annotated/shipped/`, the `cpu`
#   preset's, its sha256 checked), translate two sentences as `make
#   translate` does, and draw the last layer's most peaked cross-attention
#   head (`SHIPPED`; left out of a copy without the model).
# * **Nothing that only a command does.** The chapter's command
#   `python -m annotated.transformer`, its block under
#   `if __name__ == "__main__":` (it trains both attention forms, about a
#   minute and a half), is left out of its cell: "Run All" runs the
#   chapter, and a prose cell after it says how to run the command.
# * **Runs where it lies.** The chapter imports `annotated.tokens`, so the
#   cell after the title puts the checkout on `sys.path` when the package is
#   not installed: the first folder, from the notebook's working folder up
#   to `/`, that holds `annotated/transformer.py`. No path of the machine
#   that built it is written into the notebook; opened outside a checkout,
#   the cell says what to do (`test_the_setup_cell_finds_the_checkout_it_sits_in`).
# * **Executed at build time, by Jupyter's own executor.** nbclient runs the
#   cells in order in a fresh IPython kernel (ipykernel), from the
#   repository's root folder, exactly as "Run All" would: printed text, the
#   value of a cell's last expression and every matplotlib figure (the
#   inline backend) become the cell's outputs. A cell that fails stops the
#   build naming the cell.
#
# ```sh
# make notebook    # docs/_build/transformer.ipynb, executed; says how to open it
# make jupyter     # installs JupyterLab into .venv (requirements-notebook.txt) and opens the notebook
# ```
#
# (`tests/test_notebook.py` builds it and checks what it shows.)

# %%
from __future__ import annotations

import ast
import doctest
import re
import sys
import tempfile
from pathlib import Path

import jupytext
import nbformat

from annotated.plumbing.scripts import name_of

ROOT = Path(__file__).resolve().parent.parent

# %% [markdown]
# ## Examples out of the prose
#
# An example whose expected output is exact (no `...`) ends a code cell, so
# that its value is the cell's last expression and shows. Examples whose
# output doctest only matches loosely (a `<torch._C.Generator object at ...>`)
# are run as plain statements.

# %%
_DIRECTIVE = re.compile(r"\s*#\s*doctest:.*$", re.MULTILINE)


def example_cells(prose: str) -> list[str]:
    """The doctest examples of one prose cell, grouped into code cells."""
    cells, current = [], []
    for ex in doctest.DocTestParser().get_examples(prose):
        source = _DIRECTIVE.sub("", ex.source).rstrip("\n")
        shows = ex.want.strip() and "..." not in ex.want
        if ex.want.strip() and not shows and _is_expression(source):
            source = f"_ = {source}"  # run it, show nothing (its printed form is not stable)
        current.append(source)
        if shows:
            cells.append("\n".join(current))
            current = []
    if current:
        cells.append("\n".join(current))
    return cells


def _is_expression(source: str) -> bool:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr)


# %% [markdown]
# ## The figures and the try-it cells
#
# Each figure or try-it cell goes after the first code cell that follows the
# prose heading it illustrates, so everything it calls is defined by then.

# %%
COPY_STEPS = 400  # the copy model's training steps in section 8's cells below (`test_the_copy_steps_agree`)
FIGURES: list[tuple[str, str]] = [
    (
        "## 1. Attention: a soft dictionary lookup",
        """\
# Figure: why divide by sqrt(d_k). Scores of random unit-variance queries and keys.
import matplotlib.pyplot as plt
gen = torch.Generator().manual_seed(0)
dims = [2 ** i for i in range(0, 10)]
var_raw, var_scaled, top_raw, top_scaled = [], [], [], []
for d_k in dims:
    q, k = torch.randn(2000, 1, d_k, generator=gen), torch.randn(2000, 16, d_k, generator=gen)
    v = torch.zeros(2000, 16, 1)
    raw = (q @ k.transpose(-2, -1)).flatten()
    var_raw.append(raw.var().item()); var_scaled.append((raw / math.sqrt(d_k)).var().item())
    top_scaled.append(attention_explicit(q, k, v)[1].amax(-1).mean().item())
    top_raw.append(attention_explicit(q * math.sqrt(d_k), k, v)[1].amax(-1).mean().item())
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
ax1.loglog(dims, var_raw, "o-", label="q.k"); ax1.loglog(dims, var_scaled, "s-", label="q.k / sqrt(d_k)")
ax1.set(xlabel="d_k", ylabel="variance of the score"); ax1.legend()
ax2.semilogx(dims, top_raw, "o-", label="unscaled"); ax2.semilogx(dims, top_scaled, "s-", label="scaled")
ax2.set(xlabel="d_k", ylabel="mean largest of 16 weights", ylim=(0, 1.05)); ax2.legend()
plt.show()""",
    ),
    (
        "## 2. Masks for padding and for the future",
        """\
# Figure: the decoder's mask for a padded target (True = may attend, drawn dark).
import matplotlib.pyplot as plt
tgt = torch.tensor([[1, 7, 8, 9, 2, 0, 0]])  # bos, three words, eos, two pads
fig, axes = plt.subplots(1, 3, figsize=(9, 3))
for ax, (title, m) in zip(axes, [("padding_mask", padding_mask(tgt, 0).expand(1, 7, 7)),
                                 ("subsequent_mask", subsequent_mask(7)), ("target_mask", target_mask(tgt, 0))]):
    ax.imshow(m[0].numpy(), cmap="Greys", vmin=0, vmax=1); ax.set(title=title, xlabel="key position", ylabel="query position")
plt.show()""",
    ),
    (
        "### Embeddings and positional encoding",
        """\
# Figure: the sinusoidal positional encoding (rows: positions, columns: dimensions).
import matplotlib.pyplot as plt
pe = sinusoidal_encoding(100, 64)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
im = ax1.imshow(pe.T.numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1, origin="lower")
ax1.set(xlabel="position", ylabel="dimension"); fig.colorbar(im, ax=ax1, label="PE")
for i in (0, 2, 8, 32):
    ax2.plot(pe[:, i].numpy(), label=f"dim {i}")
ax2.set(xlabel="position", ylabel="PE"); ax2.legend()
plt.show()""",
    ),
    (
        "## 8. A first experiment: learning to copy",
        """\
# Figure: the learning-rate schedule: a linear warm-up to d_model^-0.5 * warmup^-0.5, then step^-0.5.
import matplotlib.pyplot as plt
steps = range(1, 20001, 20)
fig, ax = plt.subplots(figsize=(6, 3.2))
for d_model, warmup in ((512, 4000), (512, 8000), (256, 4000)):
    ax.plot(list(steps), [rate(s, d_model, warmup) for s in steps], label=f"d_model={d_model}, warmup={warmup}")
ax.set(xlabel="step", ylabel="learning rate", title="rate(step, d_model, warmup)"); ax.legend()
plt.show()""",
    ),
    (
        "## 8. A first experiment: learning to copy",
        """\
# Figure: what a small copy model attends to. Trained here for 400 steps (about half a minute on a CPU).
# A row is a query and sums to 1, labelled by the token the decoder predicts there; a column is a source token.
import matplotlib.pyplot as plt
from annotated.recording import record_attention
from annotated.attention.pictures import CMAP, COLOUR_BAR
copy_model = train_copy_task("fused", steps=400)
src, tgt = copy_batch(1, 10, copy_model.config.src_vocab, torch.Generator().manual_seed(3))
src_mask = padding_mask(src, PAD)
ys = torch.cat([torch.full((1, 1), BOS), greedy_decode(copy_model, src, src_mask, 11, BOS, EOS, PAD)], dim=1)
S, n = int(src_mask.sum()), ys.size(1) - 1
# record_attention hooks the package's own classes: the same weights in annotated.transformer's model
import dataclasses, annotated.transformer
recorded = annotated.transformer.make_model(**dataclasses.asdict(copy_model.config))
recorded.load_state_dict(copy_model.state_dict())
with torch.no_grad(), record_attention(recorded.eval()) as probs:
    recorded.decode(recorded.encode(src, src_mask), src_mask, ys[:, :-1], subsequent_mask(n))
cross = probs["cross", copy_model.config.N - 1][0]  # (1, h, n, S)
fig, axes = plt.subplots(1, cross.size(1), figsize=(12, 3.4), layout="constrained")
predicted = [str(t) if t != EOS else "</s>" for t in ys[0, 1:].tolist()]
for i, ax in enumerate(axes):
    im = ax.imshow(cross[0, i, :, :S].numpy(), cmap=CMAP, vmin=0, vmax=1)
    ax.set(title=f"last layer, head {i}", xlabel="key: source token", ylabel="query: predicted token",
           xticks=range(S), xticklabels=src[0, :S].tolist(), yticks=range(n), yticklabels=predicted)
fig.colorbar(im, ax=axes, shrink=0.8, label=COLOUR_BAR)
copied = ys[0, 1:].tolist() == src[0, :S].tolist() + [EOS]
verdict = "a correct copy" if copied else "a WRONG copy: this model has not learnt the task yet"
fig.suptitle(f"heads and positions count from 0; the output is {verdict}")
print("source:", src[0, :S].tolist(), " output:", ys[0, 1:].tolist())
print(f"the output is {verdict}")
plt.show()""",
    ),
]

TRIES: list[tuple[str, str]] = [
    (
        "## 3. Multi-head attention, one head at a time",
        """\
# Try it: one PerHeadAttention on a batch of 2 sequences of 5 vectors: (B, T, d_model) in and out.
torch.manual_seed(0)
mha = PerHeadAttention(d_model=16, h=4)
x = torch.randn(2, 5, 16)  # (B, T, d_model)
tuple(mha(x, x).shape), mha.d_k""",
    ),
    (
        "## 5. Converting between the two forms",
        """\
# Try it: the fused conversion of a per-head attention computes the same function (in float64).
torch.manual_seed(0)
per_head = PerHeadAttention(d_model=16, h=4).double()
x = torch.randn(2, 5, 16, dtype=torch.float64)  # (B, T, d_model)
print(f"largest difference: {(fuse(per_head)(x, x) - per_head(x, x)).abs().max().item():.1e}")""",
    ),
    (
        "### Stacks, generator and the encoder-decoder",
        """\
# Try it: a small model, its number of parameters and the shape of its logits for one sentence pair.
torch.manual_seed(0)
model = make_model(src_vocab=11, tgt_vocab=11, N=2, d_model=32, d_ff=64, h=4)
src, tgt_in = torch.tensor([[3, 4, 5, 6]]), torch.tensor([[BOS, 3, 4]])  # (1, S), (1, T)
logits = model(src, tgt_in, padding_mask(src, PAD), target_mask(tgt_in, PAD))  # (1, T, V)
sum(p.numel() for p in model.parameters()), tuple(logits.shape)""",
    ),
    (
        "## 7. Greedy decoding",
        """\
# Try it: greedy decoding with the untrained model above. It has learnt nothing yet: its tokens are no copy
# of the source [3, 4, 5, 6] (section 8 trains one that copies).
greedy_decode(model.eval(), src, padding_mask(src, PAD), max_len=6, bos=BOS, eos=EOS, pad=PAD)""",
    ),
    (
        "## 8. A first experiment: learning to copy",
        """\
# Try it: the exact-match accuracy of the copy model above (400 steps) on 200 fresh sequences.
copy_accuracy(copy_model, n=200)""",
    ),
]

SETUP = """\
# The chapter imports `annotated.tokens`. Unless the package is installed, put the checkout this notebook
# sits in on sys.path: the first folder, from here up, that holds annotated/transformer.py.
import importlib.util
import sys
from pathlib import Path
if importlib.util.find_spec("annotated") is None:
    _here = Path.cwd().resolve()
    _root = next((p for p in (_here, *_here.parents) if (p / "annotated" / "transformer.py").is_file()), None)
    if _root is None:
        raise ModuleNotFoundError("the chapter needs the package `annotated`: open this notebook from inside "
                                  "the repository's checkout (docs/_build/ is inside it), or run "
                                  "`pip install -e .` in the checkout")
    sys.path.insert(0, str(_root))"""

COMMAND_NOTE = """\
*The chapter ends with the command, under `if __name__ == "__main__":`, `python -m annotated.transformer`
(`make copy`): it trains the copy task with both attention forms, about a minute and a half on a CPU, and
prints each form's exact-match accuracy. It is left out here so that "Run All" runs the chapter only; to run
it, type `make copy` in a terminal, or `!python -m annotated.transformer` in a cell.*"""


SHIPPED_INTRO = """\
## After the chapter: a trained translator from the box

The package ships two translators trained by `train_wmt.py` (the `cpu` preset's model: this chapter's with N = 2,
d_model = 128, h = 4, about 1.6 million parameters), de -> en and en -> de, in `annotated/shipped/`, each with a
card (`de-en.json`) that says how it was made and what it scores. They learnt from Multi30k, about 29,000 image
captions: they translate descriptions of photos, not everyday language. The cells below load the de -> en
model (its sha256 checked against its card), translate two sentences with beam search as `make translate`
does, and draw what one of its cross-attention heads looks at."""

SHIPPED: list[str] = [
    """\
# Try it: the de -> en model of the box, loaded as float32; its card says how it was made and what it scores.
from annotated.shipped import load_shipped, read_card
from annotated.decoding.translate import translate
translator, tokenizer, _ = load_shipped("de-en")
card, sentences = read_card("de-en"), ["Ein Hund rennt über die Wiese.", "Zwei Männer spielen Fußball im Park."]
test = card["scores"]["test"]
print(f"{card['parameters']:,} parameters; test_2016_flickr BLEU {test['bleu']:.2f} "
      f"({test['bleu_lowercase']:.2f} lowercased), beam 4; made by: {card['made']['command']}")
for sentence in sentences:
    print(f"{sentence}  ->  {translate(translator, tokenizer, sentence)[0]}")""",
    """\
# Figure: one cross-attention head of the shipped model on the first sentence: the last layer's most peaked
# head (its rows nearest to one-hot). A row is a query and sums to 1, labelled by the token the decoder
# predicts there; a column is a source subword (\u2581 starts a word). Layers and heads count from 0.
import matplotlib.pyplot as plt
from annotated.attention.dump import collect_attention, token_labels
from annotated.attention.pictures import CMAP, COLOUR_BAR
from annotated.decoding.search import translate_ids
src_ids = tokenizer.encode(sentences[0])
tgt_ids = translate_ids(translator, [src_ids], beam_size=4)[0] + [EOS]  # the translation printed above
layer = translator.config.N - 1
cross = collect_attention(translator, src_ids, tgt_ids)["cross"][layer][0]  # (h, T, S)
head = int(cross.max(axis=-1).mean(axis=-1).argmax())
fig, ax = plt.subplots(figsize=(5.5, 4.5), layout="constrained")
im = ax.imshow(cross[head], cmap=CMAP, vmin=0, vmax=1)
ax.set(title=f"cross-attention, layer {layer}, head {head}", xlabel="key: source token",
       ylabel="query: predicted token", xticks=range(len(src_ids)), yticks=range(len(tgt_ids)))
ax.set_xticklabels(token_labels(tokenizer, src_ids), rotation=90)
ax.set_yticklabels(token_labels(tokenizer, tgt_ids))
fig.colorbar(im, ax=ax, label=COLOUR_BAR)
plt.show()""",
]


def shipped_cells() -> list:
    """The cells of the shipped translator, at the notebook's end; none in a copy without the de -> en model."""
    if not (ROOT / "annotated" / "shipped" / "de-en.pt").is_file():
        return []
    return [nbformat.v4.new_markdown_cell(SHIPPED_INTRO, metadata={"tags": ["shipped"]})] + [
        nbformat.v4.new_code_cell(code, metadata={"tags": ["shipped"]}) for code in SHIPPED
    ]


def without_command(source: str) -> tuple[str, bool]:
    """`source` less its top-level `if __name__ == "__main__":` block, and whether it had one.

    >>> without_command('x = 1\\n\\n\\nif __name__ == "__main__":\\n    print(x)\\n')
    ('x = 1', True)
    """
    lines = source.splitlines()
    for node in ast.parse(source).body:
        test = node.test if isinstance(node, ast.If) else None
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "__name__"
            and [getattr(c, "value", None) for c in test.comparators] == ["__main__"]
        ):
            del lines[node.lineno - 1 : node.end_lineno]
            return "\n".join(lines).rstrip(), True
    return source, False


def notebook_cells(module_path: Path) -> list:
    """The chapter's cells (each prose cell followed by its examples), the setup cell after the title (before
    the first code cell), the figure and try-it cells."""
    nb = jupytext.read(module_path, fmt="py:percent")
    cells: list[nbformat.NotebookNode] = []
    pending: list[tuple[str, str]] = []
    for cell in nb.cells:
        command = False
        if cell.cell_type == "code":
            cell.source, command = without_command(cell.source)
            if not any(c.cell_type == "code" for c in cells):
                cells.append(nbformat.v4.new_code_cell(SETUP, metadata={"tags": ["setup"]}))
        cells.append(cell)
        if command:
            cells.append(nbformat.v4.new_markdown_cell(COMMAND_NOTE, metadata={"tags": ["note"]}))
        if cell.cell_type == "markdown":
            cells += [
                nbformat.v4.new_code_cell(src, metadata={"tags": ["example"]}) for src in example_cells(cell.source)
            ]
            for heading, code, tag in [(h, c, "figure") for h, c in FIGURES] + [(h, c, "try") for h, c in TRIES]:
                if cell.source.lstrip("# ").startswith(heading.lstrip("# ")) or f"\n{heading}" in f"\n{cell.source}":
                    pending.append((code, tag))
        else:
            cells += [nbformat.v4.new_code_cell(code, metadata={"tags": [tag]}) for code, tag in pending]
            pending = []
    return cells + shipped_cells()


# %% [markdown]
# ## Running the cells
#
# nbclient starts a kernel (the `python3` kernel of ipykernel, in this
# interpreter), runs every code cell in order and stores its outputs in the
# cell, as Jupyter's "Run All" does. The kernel's working folder is the
# repository's root, so the setup cell finds the checkout wherever `--out`
# is; matplotlib draws with the inline backend, which turns each shown
# figure into a PNG output. The copy model's 400 steps are the longest
# cell; `TIMEOUT` bounds every cell. The console shows the cells executed
# so far (plumbing/progress.py); the kernel's own stderr (ipykernel's
# `[IPKernelApp] WARNING` lines) goes to a file, shown only if the kernel
# dies (`test_execution_shows_cells_done_and_keeps_the_kernels_stderr_to_itself`).

# %%
TIMEOUT = 900  # seconds one cell may run (the copy model trains in about 20 s; a loaded machine is slower)


class CellError(RuntimeError):
    """A notebook cell raised; the message names the cell."""


def execute(cells: list, name: str = "transformer_notebook", cwd: Path = ROOT, stream=None) -> None:
    """Run the code cells in order in a fresh kernel (nbclient) and store their outputs in place.

    Progress goes to `stream` (stderr by default): the cells executed of all, through plumbing/progress.py (a
    bar on a terminal, plain lines in a log). The kernel's own stderr (ipykernel's `[IPKernelApp] WARNING`
    lines and the like) goes to a file of its own, shown only when a cell fails or the kernel dies."""
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    from annotated.plumbing.progress import progress

    nb = nbformat.v4.new_notebook(
        cells=cells, metadata={"kernelspec": {"name": "python3", "language": "python", "display_name": "Python 3"}}
    )
    sockets = tempfile.TemporaryDirectory(prefix="notebook-kernel-")  # local sockets: no TCP port is opened
    kernel = KernelManager(kernel_name="python3", transport="ipc", ip=str(Path(sockets.name) / "kernel"))
    bar = progress(sum(c.cell_type == "code" for c in cells), f"{name}: cells executed", unit="cell", stream=stream)
    client = NotebookClient(
        nb,
        km=kernel,
        timeout=TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(cwd)}},
        on_cell_executed=lambda **_: bar.update(),
    )
    kernel_log = Path(sockets.name) / "kernel.log"
    try:
        with open(kernel_log, "wb") as log:
            client.execute(stderr=log)
    except CellExecutionError as e:
        code = [c for c in nb.cells if c.cell_type == "code"]
        failed = next(i for i, c in enumerate(code) if any(o.get("output_type") == "error" for o in c.outputs))
        raise CellError(
            f"{name}: notebook cell {failed + 1} failed: {e.ename}: {e.evalue}\n{code[failed].source}"
        ) from None
    except (CellTimeoutError, DeadKernelError) as e:  # a cell past TIMEOUT, a kernel killed or crashed
        done = sum(1 for c in nb.cells if c.cell_type == "code" and c.get("execution_count"))
        said = kernel_log.read_text(encoding="utf-8", errors="replace")[-2000:] if kernel_log.exists() else ""
        raise CellError(
            f"{name}: notebook cell {done} did not finish ({type(e).__name__}: {e})"
            + (f"\nthe kernel's stderr ended with:\n{said}" if said.strip() else "")
        ) from None
    finally:  # new_notebook copied the cells: their outputs go back into the caller's
        bar.close()
        sockets.cleanup()
        for mine, ran in zip(cells, nb.cells):
            if mine.cell_type == "code":
                mine.outputs, mine.execution_count = ran.outputs, ran.execution_count


def render_notebook(src: Path, run: bool = True) -> str:
    """The chapter `src` as notebook JSON, with its examples and figures, executed unless `run=False`."""
    nb = nbformat.v4.new_notebook(cells=notebook_cells(src))
    nb.metadata.update(jupytext.read(src, fmt="py:percent").metadata)
    nb.metadata.pop("jupytext", None)
    if run:
        execute(nb.cells, f"{src.stem}.ipynb")
    nbformat.validate(nb)
    return nbformat.writes(nb)


# %% [markdown]
# ## The command
#
# `python -m docs.notebook` (`make notebook`) builds the notebook with
# `build_notebook` of `docs/build.py` and says how to open it.


# %%
def main(argv=None) -> int:
    from annotated.plumbing.options import Parser, writable_dir

    p = Parser(
        command=__file__,
        description="Write annotated/transformer.py as an executed Jupyter notebook, its prose examples "
        "and figures inline: docs/_build/transformer.ipynb (minutes: a Jupyter kernel trains the "
        f"copy model, {COPY_STEPS} steps; longer on a busy machine).",
    )
    p.add_argument(
        "--out", type=writable_dir, default=ROOT / "docs" / "_build", help="output folder (default docs/_build)"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace a transformer.ipynb in --out that no docs build wrote"
    )
    args = p.parse_args(argv)
    from docs.build import DocsError, build_notebook

    try:
        path = build_notebook("transformer", args.out, overwrite=args.overwrite)
    except (DocsError, CellError) as e:
        print(f"{name_of(__file__)}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, DocsError) else 1
    print(
        f"wrote {path}\nopen it with `make jupyter` (installs JupyterLab into .venv from "
        f"requirements-notebook.txt, once) or, with Jupyter installed, `jupyter lab {path}`"
    )
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
