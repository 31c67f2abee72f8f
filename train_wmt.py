"""Train a Transformer translator on Multi30k (or your own parallel text).

A thin command line over `annotated.training.train.train`; see that module for the
recipe. Examples:

    python train_wmt.py                          # preset gpu if CUDA is available, else cpu
    python train_wmt.py --preset smoke           # a few seconds, for a first look
    python train_wmt.py --src en --tgt de --attention per_head
    python train_wmt.py --resume --run-dir runs/cpu-de-en-20261122-1200
    torchrun --nproc_per_node=2 train_wmt.py --preset gpu
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from annotated.plumbing import interrupts as cli
from annotated.plumbing.options import Parser, at_least, device, number, writable_dir


def parse_args(argv=None):
    """The options; a value that makes no sense is one line on stderr and exit 2, before any work."""
    positive = number(0, None, above=True)  # a finite number > 0
    p = Parser(prog="train_wmt.py", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=("gpu", "cpu", "smoke"),
                   help="settings bundle (default: gpu when CUDA is available, else cpu)")
    p.add_argument("--src", dest="src_lang", help="source language: en, de, fr, cs (default de)")
    p.add_argument("--tgt", dest="tgt_lang", help="target language (default en)")
    p.add_argument("--attention", choices=("fused", "per_head"), help="multi-head attention form")
    p.add_argument("--norm", choices=("post", "pre"), help="layer norm placement")
    p.add_argument("--layers", dest="N", type=at_least(1), help="encoder and decoder layers N")
    p.add_argument("--d-model", dest="d_model", type=at_least(1), help="model width d_model")
    p.add_argument("--d-ff", dest="d_ff", type=at_least(1), help="feed-forward width d_ff")
    p.add_argument("--heads", dest="h", type=at_least(1), help="attention heads h (d_k = d_model / h)")
    p.add_argument("--dropout", type=float)
    p.add_argument("--label-smoothing", type=float)
    p.add_argument("--warmup", type=at_least(1), help="learning-rate warm-up steps")
    p.add_argument("--lr-factor", type=positive, help="scale of the paper's learning-rate schedule (peak lr "
                                                      "= factor * d_model^-0.5 * warmup^-0.5)")
    p.add_argument("--val-bleu-sentences", type=at_least(1),
                   help="translate only the first n val sentences each epoch")
    p.add_argument("--epochs", type=at_least(1), help="an upper bound on epochs")
    p.add_argument("--max-steps", type=at_least(1), help="optimizer steps of the run (the preset's budget)")
    p.add_argument("--max-minutes", type=positive, help="an optional cap on training minutes")
    p.add_argument("--log-every", type=at_least(1), help="steps between two reads of the loss (default 50)")
    p.add_argument("--max-tokens", type=at_least(1), help="tokens per batch")
    p.add_argument("--accum", type=at_least(1), help="batches per optimizer step")
    p.add_argument("--vocab-size", type=at_least(1))
    p.add_argument("--beam-size", type=at_least(1))
    p.add_argument("--average-last", type=at_least(0), help="average the last N epoch checkpoints at the end")
    p.add_argument("--seed", type=int)
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the model (CUDA graphs on a GPU)")
    p.add_argument("--run-dir", type=Path, help="a new folder for checkpoints, logs and results "
                                                "(default runs/<preset>-<src>-<tgt>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from last.pt")
    p.add_argument("--device", type=device, help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--threads", type=at_least(1), help="CPU threads for torch (default: one per core)")
    p.add_argument("--data-url", help="base URL of the Multi30k raw files (default $MULTI30K_URL, "
                                      "else the dataset's GitHub home); file:// URLs work")
    p.add_argument("--cache-dir", type=writable_dir, help="download and tokenizer cache (default "
                                                          "$ANNOTATED_CACHE or ~/.cache/annotated)")
    p.add_argument("--train-files", nargs=2, metavar=("SRC", "TGT"), help="your own parallel text instead")
    p.add_argument("--val-files", nargs=2, metavar=("SRC", "TGT"))
    p.add_argument("--test-files", nargs=2, metavar=("SRC", "TGT"))
    p.add_argument("--empty-lines", choices=("error", "skip", "keep"), default="error",
                   help="pairs of your own files with an empty side: stop with an error naming the line (default), "
                        "skip them with a warning, or keep them")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--dump-attention", type=at_least(0), metavar="N", default=0,
                   help="after training, dump the attention of the first N test sentences into RUN_DIR/attention "
                        "(see annotated/attention/dump.py)")
    args = p.parse_args(argv)
    if args.resume and args.run_dir is None:
        p.error("--resume needs --run-dir (the run to continue)")
    user_files = (args.train_files, args.val_files, args.test_files)
    if any(user_files) and not all(user_files):
        p.error("give all three of --train-files, --val-files and --test-files, or none")
    return args


def config_from_args(args, cuda: bool):
    """(preset name, TrainConfig): the preset, with every flag the user gave laid over it."""
    from annotated.training.train import PRESETS
    preset = args.preset or ("gpu" if cuda else "cpu")
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(PRESETS[preset])
                 if getattr(args, f.name, None) is not None}
    return preset, dataclasses.replace(PRESETS[preset], **overrides)


def main(argv=None) -> int:
    with cli.starting("train_wmt.py"):  # a Ctrl-C while the extensions load: one line, exit 130 (annotated.plumbing.interrupts)
        args = parse_args(argv)
        import sentencepiece  # noqa: F401
        import torch
        import torch.utils.tensorboard  # noqa: F401

        from annotated.plumbing.checkpoint import CheckpointError
        from annotated.training.distributed import RankError
        from annotated.training.train import TrainingError, train

    run_dir = None
    try:
        where = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        preset, cfg = config_from_args(args, cuda=where.type == "cuda")
        if args.threads:
            torch.set_num_threads(args.threads)
        run_dir = args.run_dir or Path("runs") / f"{preset}-{cfg.src_lang}-{cfg.tgt_lang}-{time.strftime('%Y%m%d-%H%M%S')}"
        result = train(cfg, run_dir, data_url=args.data_url, cache_dir=args.cache_dir, device=str(where),
                       resume=args.resume, progress=not args.no_progress and sys.stderr.isatty() or
                       os.environ.get("FORCE_PROGRESS") == "1",
                       train_files=args.train_files, val_files=args.val_files, test_files=args.test_files,
                       empty_lines=args.empty_lines)
        if args.dump_attention and not result.get("interrupted") and result.get("run_dir"):
            from annotated.attention.dump import dump
            out = dump(Path(result["test"]["best"]["checkpoint"]), n=args.dump_attention, data_url=args.data_url,
                       cache_dir=args.cache_dir)
            print(f"attention dump: {out}", flush=True)
    except (ValueError, CheckpointError, TrainingError, RankError) as e:  # DataError is a ValueError
        print(f"train_wmt.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (data, final test), or a second one inside it
        last = Path(run_dir) / "last.pt" if run_dir is not None else None
        if last is not None and last.is_file():
            print(f"train_wmt.py: interrupted; {last} holds the last completed save (checkpoint writes are "
                  f"atomic); continue with --resume --run-dir {run_dir}", file=sys.stderr)
        else:
            print("train_wmt.py: interrupted before the first checkpoint was written; nothing to resume",
                  file=sys.stderr)
        return 130
    return 130 if result.get("interrupted") else 0  # 130: the shell's code for "stopped by Ctrl-C"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # in the instant before main() installs its handler
        print("train_wmt.py: interrupted", file=sys.stderr)
        sys.exit(130)
