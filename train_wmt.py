"""Train a Transformer translator on Multi30k (or your own parallel text).

A thin command line over `annotated.train.train`; see that module for the
recipe. Examples:

    python train_wmt.py                          # preset gpu if CUDA is available, else cpu
    python train_wmt.py --preset smoke           # a few seconds, for a first look
    python train_wmt.py --src en --tgt de --attention per_head
    python train_wmt.py --resume --run-dir runs/cpu-de-en-20261122-1200
    torchrun --nproc_per_node=2 train_wmt.py --preset gpu
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=("gpu", "cpu", "smoke"),
                   help="settings bundle (default: gpu when CUDA is available, else cpu)")
    p.add_argument("--src", dest="src_lang", help="source language: en, de, fr, cs (default de)")
    p.add_argument("--tgt", dest="tgt_lang", help="target language (default en)")
    p.add_argument("--attention", choices=("fused", "per_head"), help="multi-head attention form")
    p.add_argument("--norm", choices=("post", "pre"), help="layer norm placement")
    p.add_argument("--layers", dest="N", type=int, help="encoder and decoder layers N")
    p.add_argument("--d-model", dest="d_model", type=int, help="model width d_model")
    p.add_argument("--d-ff", dest="d_ff", type=int, help="feed-forward width d_ff")
    p.add_argument("--heads", dest="h", type=int, help="attention heads h (d_k = d_model / h)")
    p.add_argument("--dropout", type=float)
    p.add_argument("--label-smoothing", type=float)
    p.add_argument("--warmup", type=int, help="learning-rate warm-up steps")
    p.add_argument("--lr-factor", type=float, help="scale of the paper's learning-rate schedule (peak lr = "
                                                   "factor * d_model^-0.5 * warmup^-0.5)")
    p.add_argument("--val-bleu-sentences", type=int, help="translate only the first n val sentences each epoch")
    p.add_argument("--epochs", type=int)
    p.add_argument("--max-minutes", type=float, help="stop training after this many minutes")
    p.add_argument("--max-steps", type=int, help="stop training after this many optimizer steps")
    p.add_argument("--max-tokens", type=int, help="tokens per batch")
    p.add_argument("--accum", type=int, help="batches per optimizer step")
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--beam-size", type=int)
    p.add_argument("--average-last", type=int, help="average the last N epoch checkpoints at the end")
    p.add_argument("--seed", type=int)
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    p.add_argument("--run-dir", type=Path, help="where checkpoints, logs and results go "
                                                "(default runs/<preset>-<src>-<tgt>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from last.pt")
    p.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice, one per core)")
    p.add_argument("--data-url", help="base URL of the Multi30k raw files (default $MULTI30K_URL, "
                                      "else the dataset's GitHub home); file:// URLs work")
    p.add_argument("--cache-dir", type=Path, help="download and tokenizer cache (default $ANNOTATED_CACHE "
                                                  "or ~/.cache/annotated)")
    p.add_argument("--train-files", nargs=2, metavar=("SRC", "TGT"), help="your own parallel text instead")
    p.add_argument("--val-files", nargs=2, metavar=("SRC", "TGT"))
    p.add_argument("--test-files", nargs=2, metavar=("SRC", "TGT"))
    p.add_argument("--empty-lines", choices=("error", "skip", "keep"), default="error",
                   help="pairs of your own files with an empty side: stop with an error naming the line (default), "
                        "skip them with a warning, or keep them")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--dump-attention", type=int, metavar="N", default=0,
                   help="after training, dump the attention of the first N test sentences into RUN_DIR/attention "
                        "(see annotated/attention.py)")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace, cuda: bool):
    """(preset name, TrainConfig): the preset, with every flag the user gave laid over it."""
    from annotated.train import PRESETS
    preset = args.preset or ("gpu" if cuda else "cpu")
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(PRESETS[preset])
                 if getattr(args, f.name, None) is not None}
    return preset, dataclasses.replace(PRESETS[preset], **overrides)


@contextlib.contextmanager
def ctrl_c_deferred():
    """Hold a Ctrl-C that arrives inside the block and raise it as KeyboardInterrupt at the block's end.

    Python raises KeyboardInterrupt wherever the interpreter happens to be. Inside a C++ extension's
    initialisation (importing torch, sentencepiece, tensorboard's protobuf) it cannot unwind: once in
    our test suite (torch 2.11's CUDA wheel, a busy machine) a Ctrl-C half a second after start aborted
    the process ("terminate called after throwing an instance of 'pybind11::error_already_set'",
    exit -6, no message). So while the heavy imports run, the handler only takes note.
    """
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    with ctrl_c_deferred():  # the extensions' start-up cannot be interrupted safely (see above)
        import sentencepiece  # noqa: F401
        import torch
        import torch.utils.tensorboard  # noqa: F401

        from annotated.checkpoint import CheckpointError
        from annotated.train import TrainingError, train

    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = None
    try:
        preset, cfg = config_from_args(args, cuda=torch.cuda.is_available())
        if args.resume and args.run_dir is None:
            raise ValueError("--resume needs --run-dir (the run to continue)")
        user_files = (args.train_files, args.val_files, args.test_files)
        if any(user_files) and not all(user_files):
            raise ValueError("give all three of --train-files, --val-files and --test-files, or none")
        run_dir = args.run_dir or Path("runs") / f"{preset}-{cfg.src_lang}-{cfg.tgt_lang}-{time.strftime('%Y%m%d-%H%M%S')}"
        result = train(cfg, run_dir, data_url=args.data_url, cache_dir=args.cache_dir, device=args.device,
              resume=args.resume, progress=not args.no_progress and sys.stderr.isatty() or
              os.environ.get("FORCE_PROGRESS") == "1",
              train_files=args.train_files, val_files=args.val_files, test_files=args.test_files,
              empty_lines=args.empty_lines)
        if args.dump_attention and not result.get("interrupted") and result.get("run_dir"):
            from annotated.attention import dump
            out = dump(Path(result["test"]["best"]["checkpoint"]), n=args.dump_attention, data_url=args.data_url,
                       cache_dir=args.cache_dir)
            print(f"attention dump: {out}", flush=True)
    except (ValueError, CheckpointError, TrainingError) as e:  # DataError and CheckpointError are ValueErrors
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
    except KeyboardInterrupt:  # while starting up (importing torch), before main() can catch it
        print("train_wmt.py: interrupted", file=sys.stderr)
        sys.exit(130)
