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
# * **Figures drawn by the chapter's own code.** A few cells plot what the code
#   above them defines: the score variance with and without `sqrt(d_k)`, the
#   masks, the positional encoding, and the attention of a copy-task model
#   trained by `train_copy_task` (300 steps, about 20 s on a CPU).
# * **Executed at build time.** Each code cell runs in one fresh namespace, in
#   order, as a kernel would run it; printed text, the value of a cell's last
#   expression and every matplotlib figure are stored as the cell's outputs.
#   A cell that fails stops the build naming the cell. The last cell, the
#   copy-task demo under `if __name__ == "__main__":`, does not run here
#   (in Jupyter it does, about a minute).

# %%
from __future__ import annotations

import ast
import base64
import codeop
import contextlib
import doctest
import io
import re
import sys
import types
from pathlib import Path

import jupytext
import nbformat

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
# ## The figures
#
# Each figure cell goes after the first code cell that follows the prose
# heading it illustrates, so everything it calls is defined by then.

# %%
FIGURES: dict[str, str] = {
    "## 1. Attention: a soft dictionary lookup": '''\
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
plt.show()''',
    "## 2. Masks for padding and for the future": '''\
# Figure: the decoder's mask for a padded target (True = may attend, drawn dark).
import matplotlib.pyplot as plt
tgt = torch.tensor([[1, 7, 8, 9, 2, 0, 0]])  # bos, three words, eos, two pads
fig, axes = plt.subplots(1, 3, figsize=(9, 3))
for ax, (title, m) in zip(axes, [("padding_mask", padding_mask(tgt, 0).expand(1, 7, 7)),
                                 ("subsequent_mask", subsequent_mask(7)), ("target_mask", target_mask(tgt, 0))]):
    ax.imshow(m[0].numpy(), cmap="Greys", vmin=0, vmax=1); ax.set(title=title, xlabel="key position", ylabel="query position")
plt.show()''',
    "### Embeddings and positional encoding": '''\
# Figure: the sinusoidal positional encoding (rows: positions, columns: dimensions).
import matplotlib.pyplot as plt
pe = sinusoidal_encoding(100, 64)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
ax1.imshow(pe.T.numpy(), aspect="auto", cmap="RdBu"); ax1.set(xlabel="position", ylabel="dimension")
for i in (0, 2, 8, 32):
    ax2.plot(pe[:, i].numpy(), label=f"dim {i}")
ax2.set(xlabel="position", ylabel="PE"); ax2.legend()
plt.show()''',
    "## 8. A first experiment: learning to copy": '''\
# Figure: what a small copy model attends to. Trained here for 300 steps (about 20 s on a CPU).
import matplotlib.pyplot as plt
copy_model = train_copy_task("fused", steps=300)
src, tgt = copy_batch(1, 10, copy_model.config.src_vocab, torch.Generator().manual_seed(3))
src_mask = padding_mask(src, PAD)
ys = torch.cat([torch.full((1, 1), BOS), greedy_decode(copy_model, src, src_mask, 11, BOS, EOS, PAD)], dim=1)
S, n = int(src_mask.sum()), ys.size(1) - 1
with torch.no_grad():
    memory = copy_model.encode(src, src_mask)
    *_, cross = copy_model.decode_with_attention(memory, src_mask, ys[:, :-1], subsequent_mask(n))
fig, axes = plt.subplots(1, cross[-1].size(1), figsize=(12, 3.2))
for i, ax in enumerate(axes):
    ax.imshow(cross[-1][0, i, :, :S].numpy(), cmap="viridis", vmin=0, vmax=1)
    ax.set(title=f"last layer, head {i}", xlabel="source position", ylabel="output step")
print("source:", src[0, :S].tolist(), " output:", ys[0, 1:].tolist())
plt.show()''',
}


def notebook_cells(module_path: Path) -> list:
    """The chapter's cells, each prose cell followed by its examples, and the figure cells."""
    nb = jupytext.read(module_path, fmt="py:percent")
    cells, pending = [], []
    for cell in nb.cells:
        cells.append(cell)
        if cell.cell_type == "markdown":
            cells += [nbformat.v4.new_code_cell(src, metadata={"tags": ["example"]})
                      for src in example_cells(cell.source)]
            for heading, code in FIGURES.items():
                if cell.source.lstrip("# ").startswith(heading.lstrip("# ")) or \
                        f"\n{heading}" in f"\n{cell.source}":
                    pending.append(code)
        else:
            cells += [nbformat.v4.new_code_cell(code, metadata={"tags": ["figure"]}) for code in pending]
            pending = []
    return cells


# %% [markdown]
# ## Running the cells
#
# A small stand-in for a kernel: one module namespace, the cells compiled in
# order by `codeop` (which carries `from __future__ import annotations` from
# the first cell to the later ones, as IPython does), matplotlib's `Agg`
# backend with `plt.show()` collected as PNG outputs.

# %%
class CellError(RuntimeError):
    """A notebook cell raised; the message names the cell."""


def execute(cells: list, name: str = "transformer_notebook") -> None:
    """Run the code cells in order and store their outputs in place."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    compiler = codeop.Compile()
    count = 0
    try:
        for cell in cells:
            if cell.cell_type != "code":
                continue
            count += 1
            cell.execution_count, cell.outputs = count, []
            stdout = io.StringIO()
            try:
                with contextlib.redirect_stdout(stdout):
                    value = _run(compiler, cell.source, module.__dict__, f"<notebook cell {count}>")
            except Exception as e:
                raise CellError(f"notebook cell {count} failed: {type(e).__name__}: {e}\n{cell.source}") from e
            if stdout.getvalue():
                cell.outputs.append(nbformat.v4.new_output("stream", name="stdout", text=stdout.getvalue()))
            for num in plt.get_fignums():
                buf = io.BytesIO()
                plt.figure(num).savefig(buf, format="png", dpi=80, bbox_inches="tight", metadata={"Software": None})
                cell.outputs.append(nbformat.v4.new_output(
                    "display_data", data={"image/png": base64.b64encode(buf.getvalue()).decode("ascii"),
                                          "text/plain": "<Figure>"}))
            plt.close("all")
            if value is not None:
                cell.outputs.append(nbformat.v4.new_output("execute_result", data={"text/plain": repr(value)},
                                                           execution_count=count))
    finally:
        sys.modules.pop(name, None)


def _run(compiler, source: str, ns: dict, where: str):
    """Execute a cell; return the value of its last statement if that is an expression (as Jupyter shows)."""
    tree = ast.parse(source)
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        *body, last = tree.body
        exec(compiler(ast.unparse(ast.Module(body=body, type_ignores=[])) if body else "pass", where, "exec"), ns)
        return eval(compiler(ast.unparse(last), where, "eval"), ns)
    exec(compiler(source, where, "exec"), ns)
    return None


def render_notebook(src: Path, run: bool = True) -> str:
    """The chapter `src` as notebook JSON, with its examples and figures, executed unless `run=False`."""
    nb = nbformat.v4.new_notebook(cells=notebook_cells(src))
    nb.metadata.update(jupytext.read(src, fmt="py:percent").metadata)
    nb.metadata.pop("jupytext", None)
    if run:
        execute(nb.cells, f"{src.stem}_notebook")
    nbformat.validate(nb)
    return nbformat.writes(nb)
