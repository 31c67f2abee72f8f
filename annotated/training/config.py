# %% [markdown]
# # A run's settings
#
# One frozen dataclass, `TrainConfig`, holds every setting of a training run:
# the language pair, the model (a `TransformerConfig` of the first chapter,
# whose own checks apply), the optimisation budget and schedule, evaluation
# and reproducibility. The model has one joint sentencepiece vocabulary
# (`vocab_size`) and tied embeddings (section 3.4).
#
# A preset is defined by its number of optimizer steps, `max_steps`, never by
# wall time: the same command gives the same model on an idle and on a busy
# machine, on a CPU or a GPU. `max_minutes` stays available as an optional cap.
#
# * `cpu`: a small model, its steps as many as two CPU cores train
#   within the goal of half an hour, testing included;
# * `gpu`: the same model with more data per step (a model this small is
#   bound by kernel launches on a GPU, so a bigger batch costs little);
# * `smoke`: a few hundred sentences, for the tests, in fp32 on every machine.
#
# What each holds and why, and their measured runs: `docs/training.md#presets`.
#
# Every setting a user may change from `train_wmt.py`'s command line is in
# `OPTIONS`: its option, what it means and the values it takes. The command
# line is generated from that table, choices included (`PRESETS`,
# `PRECISIONS`, the chapter's attention forms and norms), so a setting and its
# option cannot drift apart (`test_every_option_sets_a_setting_and_every_choice_is_the_configs`).

# %%
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import get_args

from annotated.decoding.settings import PAPER_LENGTH_PENALTY, Decoding
from annotated.training.data import LANGS, check_languages
from annotated.training.evaluate import LENGTH_PENALTIES
from annotated.transformer import AttentionForm, Norm, TransformerConfig

PRECISIONS = ("auto", "fp32", "bf16")


def joint_model(vocab_size: int, **fields) -> TransformerConfig:
    """A model over one joint vocabulary of `vocab_size` subwords, embeddings and generator tied."""
    return TransformerConfig(
        src_vocab=vocab_size, tgt_vocab=vocab_size, share_embeddings=True, tie_generator=True, **fields
    )


@dataclass(frozen=True)
class TrainConfig:
    # data
    src_lang: str = "de"
    tgt_lang: str = "en"
    train_limit: int | None = None  # use only the first n training pairs (smoke tests)
    case_augment: float = 0.0  # share of training pairs added again in capitals or lower case (data.py)
    # the model; its vocabulary is the joint sentencepiece vocabulary to train
    model: TransformerConfig = field(
        default_factory=lambda: joint_model(8000, N=3, d_model=256, d_ff=1024, h=8, max_len=256)
    )
    # optimisation
    max_tokens: int = 4096  # tokens per batch (source or target, whichever is larger, before padding)
    accum: int = 1  # batches per optimizer step
    max_steps: int | None = None  # optimizer steps of the run (in total); the budget that defines a preset
    epochs: int | None = 20  # an upper bound on epochs (None: max_steps alone decides)
    max_minutes: float | None = None  # an optional cap on training wall time (checked between steps)
    warmup: int = 2000
    lr_factor: float = 1.0
    cooldown: float = 0.0  # share of max_steps, at the end, over which the rate falls linearly to 0
    label_smoothing: float = 0.1
    clip_norm: float | None = 1.0
    log_every: int = 50  # steps between two reads of the running loss (the only host syncs)
    precision: str = "auto"  # auto, fp32 or bf16 (annotated/plumbing/devices.py)
    # evaluation
    beam_size: int = Decoding.beam
    length_penalty: float | None = (
        PAPER_LENGTH_PENALTY  # beam search's GNMT alpha (the paper's); None: chosen on validation
    )
    val_bleu_sentences: int | None = None  # translate only the first n val sentences each epoch
    test_sentences: int | None = None  # score only the first n test sentences (smoke runs)
    average_last: int = 0  # average the last n epoch checkpoints at the end
    # hardware / reproducibility
    compile: bool = False
    seed: int = 0

    def __post_init__(self):
        check_languages(self.src_lang, self.tgt_lang)
        if self.model.src_vocab != self.model.tgt_vocab or not self.model.share_embeddings:
            raise ValueError(
                "training uses one joint vocabulary with shared embeddings: model needs "
                "src_vocab == tgt_vocab and share_embeddings (see joint_model)"
            )
        if not 0 <= self.case_augment <= 1:
            raise ValueError(f"case_augment must be in [0, 1], got {self.case_augment}")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if min(self.max_tokens, self.accum, self.log_every, self.beam_size) < 1 or self.vocab_size < 8:
            raise ValueError(f"max_tokens, accum, log_every, beam_size must be >= 1 and vocab_size >= 8: {self}")
        for name in ("max_steps", "epochs", "val_bleu_sentences", "test_sentences"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (or None), got {getattr(self, name)}")
        if self.max_steps is None and self.epochs is None:
            raise ValueError("a run needs a budget: max_steps (or epochs)")
        if self.max_minutes is not None and not (math.isfinite(self.max_minutes) and self.max_minutes > 0):
            raise ValueError(f"max_minutes must be a positive number (or None), got {self.max_minutes}")
        if self.warmup < 1 or not self.lr_factor > 0:
            raise ValueError(
                f"warmup must be >= 1 and lr_factor > 0, got warmup={self.warmup}, lr_factor={self.lr_factor}"
            )
        if not 0 <= self.cooldown < 1 or (self.cooldown and self.max_steps is None):
            raise ValueError(
                f"cooldown is a share of max_steps in [0, 1) and needs max_steps, got "
                f"cooldown={self.cooldown}, max_steps={self.max_steps}"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.length_penalty is not None and not 0 <= self.length_penalty < float("inf"):
            raise ValueError(
                f"length_penalty must be a finite number >= 0 (0: none, {PAPER_LENGTH_PENALTY}: the paper's) or None "
                f"(chosen on validation), got {self.length_penalty}"
            )

    # the model settings a reader of the training code asks for most, by their paper names
    vocab_size = property(lambda self: self.model.src_vocab, doc="the joint sentencepiece vocabulary")
    d_model = property(lambda self: self.model.d_model)
    dropout = property(lambda self: self.model.dropout)
    max_len = property(lambda self: self.model.max_len, doc="the longest subword sequence the model accepts")

    cooldown_steps = property(
        lambda self: round(self.cooldown * self.max_steps) if self.cooldown else 0,
        doc="the budget's last steps, over which the learning rate falls towards 0",
    )

    def model_for(self, vocab: int) -> TransformerConfig:
        """The model's settings over the vocabulary the tokenizer actually has."""
        return dataclasses.replace(self.model, src_vocab=vocab, tgt_vocab=vocab)

    def with_model(self, **fields) -> TrainConfig:
        """A copy with model fields changed; `vocab_size` sets both vocabularies.

        >>> PRESETS["smoke"].with_model(d_model=64, vocab_size=600).model.tgt_vocab
        600
        """
        vocab = fields.pop("vocab_size", None)
        if vocab is not None:
            fields.update(src_vocab=vocab, tgt_vocab=vocab)
        return dataclasses.replace(self, model=dataclasses.replace(self.model, **fields))


MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(TransformerConfig))
RUN_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name != "model")


def config_dict(cfg: TrainConfig) -> dict:
    """The settings as JSON-ready data, the model's under "model" (checkpoints, config.json, results.json)."""
    return dataclasses.asdict(cfg)


def config_from_dict(saved: dict) -> TrainConfig:
    """`config_dict`'s inverse; also reads the flat form of older runs (model fields beside the others, the
    vocabulary as `vocab_size`, tied embeddings as `tie_embeddings`).

    >>> config_from_dict(config_dict(PRESETS["cpu"])) == PRESETS["cpu"]
    True
    >>> flat = dict(src_lang="de", tgt_lang="en", vocab_size=500, N=1, d_model=32, d_ff=64, h=2, dropout=0.0,
    ...             max_len=64, attention="fused", norm="post", tie_embeddings=True, max_steps=28, epochs=None)
    >>> config_from_dict(flat).model == joint_model(500, N=1, d_model=32, d_ff=64, h=2, dropout=0.0, max_len=64)
    True
    """
    if "model" in saved:
        model = TransformerConfig(**saved["model"])
    else:
        vocab, tied = saved["vocab_size"], saved.get("tie_embeddings", True)
        model = TransformerConfig(
            src_vocab=vocab,
            tgt_vocab=vocab,
            share_embeddings=tied,
            tie_generator=tied,
            **{k: saved[k] for k in MODEL_FIELDS if k in saved},
        )
    return TrainConfig(model=model, **{k: saved[k] for k in RUN_FIELDS if k in saved})


_CPU = TrainConfig(
    model=joint_model(5000, N=2, d_model=128, d_ff=512, h=4, dropout=0.1, max_len=256),
    max_tokens=2500,
    epochs=None,
    max_steps=6500,
    warmup=800,
    cooldown=0.3,
    length_penalty=None,
    val_bleu_sentences=300,
    average_last=5,
)
PRESETS = {
    "gpu": dataclasses.replace(
        _CPU,
        max_tokens=8192,
        max_steps=4200,
        lr_factor=2.0,
        length_penalty=PAPER_LENGTH_PENALTY,
        beam_size=5,
        val_bleu_sentences=None,
    ),
    "cpu": _CPU,
    "smoke": TrainConfig(
        model=joint_model(500, N=1, d_model=32, d_ff=64, h=2, dropout=0.0, max_len=64),
        max_tokens=800,
        epochs=None,
        max_steps=28,
        warmup=20,
        train_limit=300,
        beam_size=2,
        val_bleu_sentences=20,
        test_sentences=20,
        precision="fp32",
    ),  # 28 steps: 2 epochs of 14
}


@dataclass(frozen=True)
class Option:
    """How the command line sets one setting: the option, what it means, and the values it takes."""

    help: str
    flag: str | None = None  # default: --name-with-dashes
    integer: bool = False  # any whole number
    whole_from: int | None = None  # a whole number >= this
    low: float | None = None  # a finite number >= low (> low with `above`) and <= high
    high: float | None = None
    above: bool = False
    choices: tuple[str, ...] | None = None
    switch: bool = False  # a flag without a value: on when given
    none_word: str | None = None  # a word that sets the setting to None (beside a number)


OPTIONS = {  # setting -> its command-line option, in the order --help lists them
    "src_lang": Option(f"source language: {', '.join(LANGS)}", flag="--src"),
    "tgt_lang": Option("target language", flag="--tgt"),
    "attention": Option("multi-head attention form", choices=get_args(AttentionForm)),
    "norm": Option("layer norm placement", choices=get_args(Norm)),
    "N": Option("encoder and decoder layers N", flag="--layers", whole_from=1),
    "d_model": Option("model width d_model", whole_from=1),
    "d_ff": Option("feed-forward width d_ff", whole_from=1),
    "h": Option("attention heads h (d_k = d_model / h)", flag="--heads", whole_from=1),
    "dropout": Option("dropout probability, in [0, 1)", low=0, high=1),
    "attention_dropout": Option(
        "dropout on the attention weights, in [0, 1), or 'same': --dropout's (0 lets "
        "scaled_dot_product_attention use its fused CPU kernel in training)",
        low=0,
        high=1,
        none_word="same",
    ),
    "label_smoothing": Option("label smoothing epsilon, in [0, 1)", low=0, high=1),
    "case_augment": Option(
        "share of the training pairs added again with both sides in capitals or lower case, in [0, 1]", low=0, high=1
    ),
    "warmup": Option("learning-rate warm-up steps", whole_from=1),
    "lr_factor": Option(
        "scale of the paper's learning-rate schedule (peak lr = factor * d_model^-0.5 * warmup^-0.5)", low=0, above=True
    ),
    "cooldown": Option(
        "share of --max-steps, at the end, over which the learning rate falls linearly towards 0, "
        "in [0, 1) (0: the paper's schedule to the end)",
        low=0,
        high=1,
    ),
    "val_bleu_sentences": Option("translate only the first n val sentences each epoch", whole_from=1),
    "epochs": Option("an upper bound on epochs", whole_from=1),
    "max_steps": Option("optimizer steps of the run (the preset's budget)", whole_from=1),
    "max_minutes": Option("an optional cap on training minutes", low=0, above=True),
    "log_every": Option("steps between two reads of the loss", whole_from=1),
    "max_tokens": Option("tokens per batch", whole_from=1),
    "accum": Option("batches per optimizer step", whole_from=1),
    "vocab_size": Option("subwords of the joint sentencepiece vocabulary", whole_from=8),
    "beam_size": Option("beam width of the final test translation", whole_from=1),
    "length_penalty": Option(
        "the beam search's GNMT length penalty alpha for the final test translation: a number "
        f">= 0 ({PAPER_LENGTH_PENALTY}: the paper's), or 'validation': the alpha of "
        f"{', '.join(f'{a:g}' for a in LENGTH_PENALTIES)} with the best BLEU on the whole "
        "validation split, chosen at the end of the run",
        low=0,
        none_word="validation",
    ),
    "average_last": Option("average the last N epoch checkpoints at the end", whole_from=0),
    "seed": Option("seed of the initial weights, dropout and the batches' shuffle", integer=True),
    "precision": Option(
        "arithmetic: auto is bf16 autocast on CUDA and on a CPU with bf16 instructions (avx512_bf16 "
        "or AMX), else fp32; the loss and the optimizer stay fp32",
        choices=PRECISIONS,
    ),
    "compile": Option("torch.compile the model (CUDA graphs on a GPU)", switch=True),
}
MODEL_OPTIONS = tuple(name for name in OPTIONS if name in MODEL_FIELDS or name == "vocab_size")  # set in cfg.model


def flag(name: str) -> str:
    """The command-line option of setting `name`.

    >>> flag("N"), flag("max_steps")
    ('--layers', '--max-steps')
    """
    return OPTIONS[name].flag or "--" + name.replace("_", "-")


def with_settings(cfg: TrainConfig, given: dict) -> TrainConfig:
    """`cfg` with the settings in `given` (`OPTIONS`' names, the model's among them) replaced.

    >>> with_settings(PRESETS["smoke"], {"d_model": 64, "max_steps": 5}).model.d_model
    64
    """
    run = {k: v for k, v in given.items() if k not in MODEL_OPTIONS}
    return dataclasses.replace(cfg, **run).with_model(**{k: v for k, v in given.items() if k in MODEL_OPTIONS})


def options_between(base: TrainConfig, cfg: TrainConfig) -> list[str]:
    """The command-line words that turn `base` (a preset) into `cfg`, in `OPTIONS`' order; ValueError where
    `cfg` differs from `base` in something no option sets.

    >>> options_between(PRESETS["cpu"], with_settings(PRESETS["cpu"], {"max_steps": 4200, "lr_factor": 2.0,
    ...                                                                  "length_penalty": 0.6, "N": 3}))
    ['--layers', '3', '--lr-factor', '2', '--max-steps', '4200', '--length-penalty', '0.6']
    """
    words: list[str] = []
    changed = {}
    for name, option in OPTIONS.items():
        value = setting(cfg, name)
        if value == setting(base, name):
            continue
        if option.switch and value is True:
            words.append(flag(name))
        elif value is None and option.none_word:
            words += [flag(name), option.none_word]
        elif isinstance(value, (int, float, str)) and not isinstance(value, bool):
            words += [
                flag(name),
                f"{value:g}" if isinstance(value, float) and float(f"{value:g}") == value else str(value),
            ]
        else:
            raise ValueError(f"{name}={value!r} has no command-line form")
        changed[name] = value
    if with_settings(base, changed) != cfg:
        raise ValueError("the settings differ from the preset's in something no command-line option sets")
    return words


def setting(cfg: TrainConfig, name: str):
    """The value of setting `name` in `cfg` (the model's settings live in cfg.model).

    >>> setting(PRESETS["smoke"], "d_model"), setting(PRESETS["smoke"], "vocab_size"), setting(PRESETS["smoke"], "seed")
    (32, 500, 0)
    """
    if name == "vocab_size":
        return cfg.vocab_size
    return getattr(cfg.model, name) if name in MODEL_OPTIONS else getattr(cfg, name)
