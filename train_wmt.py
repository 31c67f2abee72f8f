"""Train a Transformer translator on Multi30k (or your own parallel text).

A thin command line over `annotated.training.train.train`; see that module for the
recipe. Examples:

    python train_wmt.py                          # preset gpu if CUDA is available, else cpu
    python train_wmt.py --preset smoke           # a few seconds, for a first look
    python train_wmt.py --preset cpu --help      # every option, with its default under that preset
    python train_wmt.py --print-config --precision fp32   # the settings it would train with; no training
    python train_wmt.py --src en --tgt de --attention per_head
    python train_wmt.py --resume --run-dir runs/cpu-de-en-20261122-1200
    torchrun --nproc_per_node=2 train_wmt.py --preset gpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from annotated.plumbing.options import Parser, at_least, device, number, writable_dir
from annotated.plumbing.scripts import name_of

NAME = name_of(__file__)


def preset_asked(argv) -> str | None:
    """The --preset of `argv` (before the whole parse: the help texts show that preset's defaults)."""
    from annotated.training.config import PRESETS

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=tuple(PRESETS))
    known, _ = pre.parse_known_args(argv)
    return known.preset


def option_type(option):
    """The check that reads an option's value (annotated/plumbing/options.py), from its `Option`."""
    if option.integer:
        return int
    if option.whole_from is not None:
        return at_least(option.whole_from)
    if option.low is not None or option.high is not None:
        read = number(option.low, option.high, above=option.above)
        return read if option.none_word is None else number_or_word(read, option.none_word)
    return None


def number_or_word(read, word: str):
    """`read`'s number, or `word` itself (the setting's None; `config_from_args` turns it into None).

    >>> number_or_word(float, "validation")("validation"), number_or_word(float, "validation")("0.6")
    ('validation', 0.6)
    """

    def parse(text: str):
        if text == word:
            return word
        try:
            return read(text)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{str(e).split(', got ')[0]} or {word!r}, got {text!r}") from None

    return parse


def build_parser(chosen: str | None = None) -> Parser:
    """The command line: one option per entry of `OPTIONS` (annotated/training/config.py), each help naming the
    setting's value in every preset, or only in `chosen`; then the options of the run itself."""
    from annotated.training.config import OPTIONS, PRESETS, setting
    from annotated.training.config import flag as option_flag

    def default(name: str) -> str:  # "(gpu: 128, cpu: 128, smoke: 32)" or, with --preset, that preset's value
        shown = lambda v: (OPTIONS[name].none_word or "none") if v is None else v
        if chosen:
            return f" (default under --preset {chosen}: {shown(setting(PRESETS[chosen], name))})"
        return " (" + ", ".join(f"{p}: {shown(setting(c, name))}" for p, c in PRESETS.items()) + ")"

    p = Parser(
        command=__file__,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    p.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        help="settings bundle (default: gpu when CUDA is available, else cpu); every option below "
        "changes one of its settings and shows each preset's value",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved settings (preset and options, device, precision, threads) and exit without training",
    )
    for name, option in OPTIONS.items():
        flag, help_ = option_flag(name), option.help + default(name)
        if option.switch:
            p.add_argument(flag, dest=name, action="store_true", default=None, help=help_)
        else:
            p.add_argument(flag, dest=name, type=option_type(option), choices=option.choices, help=help_)
    p.add_argument(
        "--run-dir",
        type=Path,
        help="a new folder for checkpoints, logs and results "
        "(default runs/<preset>-<src>-<tgt>-<time>; runs/latest points "
        "to the newest run in runs/)",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from last.pt")
    p.add_argument("--device", type=device, help="cuda, cuda:1, cpu (default: cuda when available)")
    p.add_argument(
        "--threads",
        type=at_least(1),
        help="CPU threads for torch (default: $OMP_NUM_THREADS where set, else every core this process may use)",
    )
    p.add_argument(
        "--data-url",
        help="base URL of the Multi30k raw files (default $MULTI30K_URL, "
        "else the dataset's GitHub home); file:// URLs work",
    )
    p.add_argument(
        "--cache-dir",
        type=writable_dir,
        help="download and tokenizer cache (default $ANNOTATED_CACHE or ~/.cache/annotated)",
    )
    p.add_argument("--train-files", nargs=2, metavar=("SRC", "TGT"), help="your own parallel text instead")
    p.add_argument(
        "--val-files", nargs=2, metavar=("SRC", "TGT"), help="your own validation pairs (with --train-files)"
    )
    p.add_argument("--test-files", nargs=2, metavar=("SRC", "TGT"), help="your own test pairs (with --train-files)")
    p.add_argument(
        "--empty-lines",
        choices=("error", "skip", "keep"),
        default="error",
        help="pairs of your own files with an empty side: stop with an error naming the line (default), "
        "skip them with a warning, or keep them",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--dump-attention",
        type=at_least(0),
        metavar="N",
        default=0,
        help="after training, dump the attention of the first N test sentences into RUN_DIR/attention "
        "(see annotated/attention/dump.py)",
    )
    return p


def parse_args(argv=None):
    """The options; a value that makes no sense is one line on stderr and exit 2, before any work."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser(preset_asked(argv) if "--help" in argv or "-h" in argv else None)
    args = p.parse_args(argv)
    if args.resume and args.run_dir is None:
        p.error("--resume needs --run-dir (the run to continue)")
    user_files = (args.train_files, args.val_files, args.test_files)
    if any(user_files) and not all(user_files):
        p.error("give all three of --train-files, --val-files and --test-files, or none")
    return args


EPILOG = """Each option's help names its value in every preset (gpu, cpu, smoke); with --preset, the value under that
preset. --print-config shows the settings a command would train with."""


def config_from_args(args, cuda: bool):
    """(preset name, TrainConfig): the preset, with every flag the user gave laid over it."""
    from annotated.training.config import OPTIONS, PRESETS, with_settings

    preset = args.preset or ("gpu" if cuda else "cpu")
    words = {name: option.none_word for name, option in OPTIONS.items() if option.none_word}
    given = {k: None if words.get(k) == v else v for k, v in vars(args).items() if v is not None and k in OPTIONS}
    return preset, with_settings(PRESETS[preset], given)


def resolved_settings(preset: str, cfg, where, threads: int, run_dir: Path) -> dict:
    """What --print-config prints: the settings a run would train with, and the arithmetic it would use."""
    from annotated.plumbing.devices import resolve_precision
    from annotated.training.config import config_dict

    precision, reason = resolve_precision(cfg.precision, where)
    return {
        "preset": preset,
        "run_dir": str(run_dir),
        "device": str(where),
        "precision": precision,
        "precision_reason": reason,
        "threads": threads,
        "train_config": config_dict(cfg),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import sentencepiece  # noqa: F401 loaded inside main(): a Ctrl-C in its C start-up exits at once
    import torch
    import torch.utils.tensorboard

    from annotated.attention.dump import log_alignment_image  # the epochs' alignment pictures (matplotlib)
    from annotated.checkpoint import CheckpointError
    from annotated.plumbing.devices import default_device, default_threads
    from annotated.run_folder import LAST, RUNS
    from annotated.training.distributed import RankError
    from annotated.training.train import DataSource, TrainingError, train

    run_dir, threads_before = None, torch.get_num_threads()
    try:
        where = default_device(args.device)
        preset, cfg = config_from_args(args, cuda=where.type == "cuda")
        torch.set_num_threads(args.threads or default_threads())
        run_dir = args.run_dir or RUNS / f"{preset}-{cfg.src_lang}-{cfg.tgt_lang}-{time.strftime('%Y%m%d-%H%M%S')}"
        if args.print_config:
            print(json.dumps(resolved_settings(preset, cfg, where, torch.get_num_threads(), run_dir), indent=2))
            return 0
        result = train(
            cfg,
            run_dir,
            source=DataSource(
                args.data_url, args.cache_dir, args.train_files, args.val_files, args.test_files, args.empty_lines
            ),
            device=str(where),
            resume=args.resume,
            progress=(not args.no_progress and sys.stderr.isatty()) or os.environ.get("FORCE_PROGRESS") == "1",
            alignment_image=log_alignment_image,
        )
        if args.dump_attention and not result.get("interrupted") and result.get("run_dir"):
            from annotated.attention.dump import dump

            out = dump(
                Path(result["test"]["best"]["checkpoint"]),
                n=args.dump_attention,
                data_url=args.data_url,
                cache_dir=args.cache_dir,
            )
            print(f"attention dump: {out}", flush=True)
    except (ValueError, CheckpointError, TrainingError, RankError) as e:  # DataError is a ValueError
        print(f"{NAME}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (data, final test), or a second one inside it
        last = Path(run_dir) / LAST if run_dir is not None else None
        if last is not None and last.is_file():
            print(
                f"{NAME}: interrupted; {last} holds the last completed save (checkpoint writes are "
                f"atomic); continue with --resume --run-dir {run_dir}",
                file=sys.stderr,
            )
        else:
            print(f"{NAME}: interrupted before the first checkpoint was written; nothing to resume", file=sys.stderr)
        return 130
    finally:  # main() called from Python leaves the caller's thread count as it found it
        torch.set_num_threads(threads_before)
    return 130 if result.get("interrupted") else 0  # 130: the shell's code for "stopped by Ctrl-C"


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
