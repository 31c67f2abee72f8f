"""The pruning curve (`heads_pruning.png`): heads removed against held-out validation loss and BLEU.

Greedy pruning's path is the same whatever the threshold (`annotated/attention/prune.py`, section 1), so the
command follows it to one head per attention and draws the held-out loss with the stop rule's ceiling (top) and
the change of greedy BLEU on the test and held-out sentences (bottom): filled markers are removals the stop rule
keeps, open ones the path past the stop, a dotted line the stop; colours from `CMAP`
(docs/heads.md#pruning-and-its-stop-rule; `test_the_pruning_curve_marks_the_stop_and_draws_every_point_of_the_path`).
"""

from __future__ import annotations

from annotated.attention.pictures import LAYOUT, colour_table, figure

LOSS, TEST, HELD_OUT = colour_table(5)[0], colour_table(5)[2], colour_table(5)[3]  # dark, mid, light-mid


def curve_figure(
    curve: list[dict],
    baseline_loss: float,
    max_increase: float,
    stop: int,
    test_sentences: int,
    tuned: dict | None = None,
    title: str = "",
):
    """`curve`: one dict per model on the path (`heads_removed`, `held_out_loss`, `held_out_bleu`, `test_bleu`,
    `kept`), the unpruned model first; `stop`: heads the saved model lost; `tuned`: the fine-tuned model's
    `held_out_loss` and `test_bleu` (and `finetune_steps`), drawn at the stop, or None."""
    if not curve or curve[0]["heads_removed"] != 0:
        raise ValueError("the curve must start with the unpruned model (heads_removed 0)")
    fig = figure(figsize=(7.5, 6.5), layout=LAYOUT)
    top, bottom = fig.subplots(2, 1, sharex=True)
    x = [p["heads_removed"] for p in curve]
    kept = [p["kept"] for p in curve]

    def series(ax, key, shift, colour, label):
        ys = [p[key] - shift for p in curve]
        ax.plot(x, ys, color=colour, lw=1.2, label=label)
        for filled in (True, False):  # filled: kept by the stop rule; open: past the stop
            chosen = [i for i, k in enumerate(kept) if k == filled]
            face = colour if filled else "white"
            ax.scatter([x[i] for i in chosen], [ys[i] for i in chosen], facecolors=face, edgecolors=colour, zorder=3)

    series(top, "held_out_loss", 0.0, LOSS, "held-out validation loss")
    top.axhline(
        baseline_loss + max_increase, color=LOSS, ls="--", lw=0.8, label=f"stop rule: unpruned + {max_increase:g}"
    )
    series(bottom, "test_bleu", curve[0]["test_bleu"], TEST, f"test_2016_flickr ({test_sentences} sentences)")
    series(bottom, "held_out_bleu", curve[0]["held_out_bleu"], HELD_OUT, "held-out validation sentences")
    bottom.axhline(0.0, color="0.5", lw=0.8)
    if tuned is not None:
        after = f"after {tuned['finetune_steps']} fine-tuning steps"
        top.scatter([stop], [tuned["held_out_loss"]], marker="*", s=120, color=LOSS, zorder=4, label=after)
        change = tuned["test_bleu"] - curve[0]["test_bleu"]
        bottom.scatter([stop], [change], marker="*", s=120, color=TEST, zorder=4, label=f"test, {after}")
    for ax in (top, bottom):
        ax.axvline(stop, color="0.3", ls=":", lw=1.0)
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    top.set_ylabel("held-out validation loss\n(nats per target token, no label smoothing)", fontsize=8)
    bottom.set_ylabel("greedy BLEU change from the unpruned model", fontsize=8)
    bottom.set_xlabel(
        f"heads removed, least important first (dotted: the stop rule keeps {stop}; open markers: past the stop)",
        fontsize=8,
    )
    bottom.set_xticks(x)
    fig.suptitle(title or "pruning: the greedy path", fontsize=9)
    return fig
