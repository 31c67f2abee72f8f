"""`python -m annotated.training.pack RUN_DIR [--out FOLDER] [--force]`: a training run's model, packed for the box.

From a finished run (its `results.json` and its model, `averaged.pt` where the run averaged its last epochs, else
`best.pt`, the rule of `run_model`) it writes two files into the box (`annotated/shipped/`, or `--out`):

* `<src>-<tgt>.pt`: the checkpoint for the box (`compact_state`: float16 weights loaded as float32, no training
  state, no paths of the machine it was trained on);
* `<src>-<tgt>.json`: its card: how it was made (the command that trains it again, the commit, seed, steps,
  precision, threads, machine and every package's version, from the run's `results.json`), what it was trained
  on, the sha256 of the `.pt` file (which loading checks), and what the packed model, scored again here, scores on
  all of test_2016_flickr with beam 4 at the checkpoint's length penalty (`model_length_penalty`; the figures
  `tests/shipped/test_shipped.py` checks), beside the run's own float32 figures for that checkpoint
  (`test_the_card_of_a_run_that_averaged_gives_averaged_pts_scores`).

Existing files are replaced only with `--force`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

from annotated.checkpoint import (
    FORMAT,
    atomic_torch_save,
    case_table_in,
    load_checkpoint,
    read_checkpoint,
    stored_case_table,
)
from annotated.decoding.settings import Decoding, model_length_penalty
from annotated.door import Door
from annotated.plumbing.files import atomic_write, sha256_of
from annotated.plumbing.options import at_least
from annotated.plumbing.provenance import code_commit
from annotated.plumbing.scripts import name_of, usage_of
from annotated.run_folder import AVERAGED, run_model
from annotated.shipped import CARD_FORMAT, FOLDER
from annotated.training.config import PRESETS, config_from_dict, options_between
from annotated.training.data import load_multi30k
from annotated.training.evaluate import evaluate_bleu

NAME = name_of(__file__)
MAX_BYTES = 4 << 20  # each shipped model at most 4 MiB
BEAM = Decoding.beam  # as `make translate` decodes, at the model's length penalty (model_length_penalty)
TRAINED_ON = (
    "Multi30k (Elliott et al., 2016): about 29,000 English descriptions of Flickr photos and their "
    "German translations. The model knows photo captions (people, animals, clothes, streets, sports); "
    "everyday language outside them, such as 'Ich habe heute keine Zeit, weil ich arbeiten muss.', is "
    "out of its domain and comes back as nonsense."
)


class PackError(ValueError):
    """A run that cannot be packed; the message names what is missing and the fix."""


def compact_state(state: dict) -> dict:
    """The checkpoint `state` for the box: float weights as float16 (tied ones stored once), the tokenizer and
    case table kept, training state and local paths dropped."""
    model: dict = {}
    halves: list = []
    for name, tensor in state["model"].items():
        if not tensor.is_floating_point():
            model[name] = tensor
            continue
        same = [h for t, h in halves if t.shape == tensor.shape and torch.equal(t, tensor)]
        if not same:
            half = tensor.to(torch.float16)
            if not torch.isfinite(half).all():
                raise PackError(f"{name} has values beyond float16's range (65504); it cannot be packed in 16 bits")
            halves.append((tensor, half))
            same = [half]
        model[name] = same[0]
    meta = {
        k: v
        for k, v in state.get("meta", {}).items()
        if k in ("src_lang", "tgt_lang", "train_config", "epoch", "step", "length_penalty")
    }
    if "averaged" in state.get("meta", {}):
        meta["averaged"] = [Path(p).name for p in state["meta"]["averaged"]]
    meta["weights"] = "float16 on disk, float32 when loaded"
    table = case_table_in(state, "being packed")  # read as any checkpoint reads it, then stored as text
    return {
        "format": FORMAT,
        "config": state["config"],
        "model": model,
        "tokenizer": state.get("tokenizer"),
        "casing": None if table is None else stored_case_table(table),
        "meta": meta,
    }


def training_command(results: dict) -> str:
    """The command that trains the run again: the preset it differs least from (on a tie, the one `train_wmt.py`
    picks on the run's device) and the options it differs by (`options_between`), its precision and threads as
    resolved (so a CPU with bf16 computes in fp32 as this run did)."""
    cfg = config_from_dict(results["train_config"])
    default = "gpu" if str(results.get("device", "cpu")).startswith("cuda") else "cpu"
    commands = []
    for preset, base in PRESETS.items():
        try:
            words = options_between(
                dataclasses.replace(
                    base, src_lang=cfg.src_lang, tgt_lang=cfg.tgt_lang, seed=cfg.seed, precision=cfg.precision
                ),
                cfg,
            )
        except ValueError:
            continue
        command = " ".join(
            ["python train_wmt.py --preset", preset, "--src", cfg.src_lang, "--tgt", cfg.tgt_lang, *words]
            + ["--seed", str(cfg.seed), "--precision", results["precision"], "--threads", str(results["threads"])]
        )
        commands.append((len(words), preset != default, command))
    if not commands:
        raise PackError(
            "the run's settings differ from every preset's in something no option of train_wmt.py "
            "sets; give the command that trained it with --command"
        )
    return min(commands)[2]


def generate_note(alpha: float) -> str:
    """What transformers' `generate` can do of GNMT's alpha (annotated/interop/folders.py)."""
    return (
        "generate divides by |Y|^length_penalty, this project's translator by GNMT's ((5 + |Y|) / 6)^alpha: no "
        f"length_penalty of generate ranks as alpha {alpha:g} does. For the same translations outside this project "
        "decode at 0 on both sides (generate's length_penalty=0.0, make translate ARGS='--length-penalty 0'), where "
        "the two searches agree but for translations cut at the length limit (section 5 of "
        "annotated/interop/marian.py)."
    )


def make_card(results: dict, source: Path, packed: Path, state: dict, test: dict, command: str) -> dict:
    """The card of a packed model (see the module's docstring)."""
    cfg = config_from_dict(results["train_config"])
    env = results.get("environment", {})
    run_scores = next((s for n, s in results["test"].items() if Path(s["checkpoint"]).name == source.name), None)
    alpha = model_length_penalty(state["meta"])
    run = (
        None
        if run_scores is None
        else {k: run_scores["beam"][k] for k in ("bleu", "bleu_lowercase", "chrf")}
        | {"beam": run_scores["beam"]["beam_size"], "sentences": run_scores["beam"]["sentences"]}
    )
    return {
        "format": CARD_FORMAT,
        "direction": f"{cfg.src_lang}-{cfg.tgt_lang}",
        "src_lang": cfg.src_lang,
        "tgt_lang": cfg.tgt_lang,
        "file": packed.name,
        "sha256": sha256_of(packed),
        "bytes": packed.stat().st_size,
        "weights": "float16 on disk, float32 when loaded",
        "parameters": sum(t.numel() for t in {id(t): t for t in state["model"].values()}.values()),
        "model": state["config"],
        "trained_on": TRAINED_ON,
        "made": {
            "command": command,
            "model": source.name + (" (the mean of the last epochs' checkpoints)" if source.name == AVERAGED else ""),
            "commit": env.get("commit"),
            "seed": cfg.seed,
            "steps": results.get("steps"),
            "epoch": state["meta"].get("epoch"),
            "precision": results.get("precision"),
            "precision_reason": results.get("precision_reason"),
            "threads": results.get("threads"),
            "train_minutes": round(results.get("train_s", 0.0) / 60, 1),
            "device": results.get("device"),
            "machine": env.get("machine"),
            "cpu": env.get("cpu"),
            "python": env.get("python"),
            "packages": env.get("packages"),
            "train_config": results["train_config"],
        },
        "length_penalty": {  # as the run's results.json records it, and how to decode so with transformers
            **(results.get("length_penalty") or {"chosen": alpha, "chosen_on": "the checkpoint's meta"}),
            "transformers": generate_note(alpha),
        },
        "scores": {
            "test_set": results.get("test_set"),
            "beam": BEAM,
            "length_penalty": alpha,
            "test": {k: v for k, v in test.items() if k != "signatures"},
            "run_model_float32": run,
            "signatures": test["signatures"],
            "note": "test: this packed model as loaded (float16 weights in float32); "
            "run_model_float32: the run's model before packing, from its results.json",
        },
        "packed": {
            "by": f"{usage_of(__file__)} {results.get('run_dir', 'RUN_DIR')}",
            "commit": code_commit(),
            "torch": torch.__version__,
        },
    }


def pack(
    run_dir: Path,
    out: Path = FOLDER,
    *,
    force: bool = False,
    command: str | None = None,
    data_url: str | None = None,
    pairs: list | None = None,
    progress: bool = False,
    say=print,
) -> tuple[Path, Path]:
    """Pack the model of `run_dir` into `out`; returns (model file, card). `pairs`: the test pairs to score
    (default: test_2016_flickr in the run's languages)."""
    results_path = run_dir / "results.json"
    if not results_path.is_file():
        raise PackError(f"{results_path} is missing: the run has not finished (its test scores are written last)")
    results = json.loads(results_path.read_text(encoding="utf-8"))
    source = run_model(run_dir)
    if source is None:
        raise PackError(f"{run_dir} holds neither averaged.pt nor best.pt")
    cfg = config_from_dict(results["train_config"])
    direction = f"{cfg.src_lang}-{cfg.tgt_lang}"
    targets = (out / f"{direction}.pt", out / f"{direction}.json")
    existing = [t for t in targets if t.exists()]
    if existing and not force:
        raise PackError(f"{existing[0]} exists; {Door.typed('--force')} to replace it")
    command = command or training_command(results)
    state = compact_state(read_checkpoint(source))
    if pairs is None:
        pairs = load_multi30k("test_2016_flickr", cfg.src_lang, cfg.tgt_lang, base_url=data_url)
    with tempfile.TemporaryDirectory() as tmp:
        packed = Path(tmp) / targets[0].name
        atomic_torch_save(state, packed)
        if packed.stat().st_size > MAX_BYTES:
            raise PackError(f"the packed model has {packed.stat().st_size:,} bytes, more than {MAX_BYTES:,}")
        model, tokenizer, meta = load_checkpoint(packed)
        alpha = model_length_penalty(meta)
        say(
            f"{NAME}: scoring the packed {direction} model on {len(pairs)} test sentences, beam {BEAM}, length "
            f"penalty {alpha:g}"
        )
        full, _ = evaluate_bleu(model, tokenizer, pairs, BEAM, alpha, progress=progress)
        test = {k: full[k] for k in ("bleu", "bleu_lowercase", "chrf", "sentences")} | {"signatures": full["signature"]}
        card = make_card(results, source, packed, state, test, command)
        atomic_write(targets[0], packed.read_bytes())
    atomic_write(targets[1], json.dumps(card, indent=2, ensure_ascii=False) + "\n")
    run = card["scores"]["run_model_float32"]
    say(
        f"{NAME}: wrote {targets[0]} ({card['bytes']:,} bytes) and {targets[1]}: test BLEU {test['bleu']:.2f} "
        f"(lowercased {test['bleu_lowercase']:.2f}), chrF {test['chrf']:.2f} packed"
        + (
            f"; {run['bleu']:.2f} ({run['bleu_lowercase']:.2f}), chrF {run['chrf']:.2f} for {source.name} in float32 "
            f"(beam {run['beam']})"
            if run
            else ""
        )
    )
    return targets


def main(argv: list[str] | None = None) -> int:
    door = Door(__file__)
    p = door.parser(description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("run_dir", type=Path, help="a finished training run (runs/<run>/ with results.json)")
    door.output_options(p, type=Path, help=f"where to write the two files (default {FOLDER})")
    p.add_argument("--command", help="the command that trained the run (default: worked out from its preset)")
    p.add_argument("--data-url", help="base URL of the Multi30k files (default $MULTI30K_URL, else GitHub)")
    p.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        pack(
            args.run_dir,
            args.out or FOLDER,
            force=args.force,
            command=args.command,
            data_url=args.data_url,
            progress=sys.stderr.isatty(),
        )
    except (ValueError, OSError, KeyError) as e:  # PackError, CheckpointError, DataError; a results.json without a key
        door.say(f"error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    from annotated.plumbing.scripts import run_main

    run_main(main)
