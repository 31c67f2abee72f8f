# %% [markdown]
# # Data, subwords and batches, annotated
#
# The first chapter (`annotated/transformer.py`) built a model that maps
# token ids to token ids. This chapter gets it real sentences to learn from:
# the files of the Multi30k corpus (Elliott et al., 2016: image captions in
# English, German, French and Czech, line `i` of each language translating
# line `i` of the others), read as parallel text (or any pair of files the
# user brings), a subword vocabulary shared by both languages, and batches
# of about the same number of tokens.
#
# Every way this can go wrong that we can foresee ends in a `DataError` that
# names the file, the line or the setting to change, and leaves nothing
# half-written in the cache (`docs/faults.md` lists them). The claims are
# checked in `tests/training/test_data.py` (test names given in brackets).

# %%
from __future__ import annotations

import gzip
import hashlib
import http.client
import io
import json
import os
import random
import re
import urllib.error
import urllib.request
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
from torch import Tensor

from annotated.door import MAKE_TARGET, Door
from annotated.plumbing.files import atomic_write, sha256_of
from annotated.tokens import BOS, EOS, PAD, UNK, Tokenizer, TokenizerError

PathLike = Union[str, "os.PathLike[str]"]


class DataError(ValueError):
    """An expected problem with the data: the message says which file, line or setting, and what to do."""


class DataWarning(UserWarning):
    """Something the user should know about the data that does not stop the run."""


# %% [markdown]
# ## 1. Getting the files
#
# Multi30k task 1 has three splits we use: `train` (29,000 sentences), `val`
# (1,014) and `test_2016_flickr` (1,000), each in four languages, gzipped. The
# files live in the dataset's GitHub repository. Two things about downloads
# deserve care:
#
# - **The bytes must be the bytes we expect.** A mirror can serve an HTML
#   error page with status 200, a proxy can cut a file short, and a dataset
#   repository can change under us. We pin the sha256 of each file in the
#   code below and refuse anything else. The numbers you get then depend
#   only on the code, never on the day you downloaded.
# - **The location must be changeable without editing code**: a machine
#   without internet (the CI, a GPU node) reads a local copy
#   (`resolve_base_url`, `--data-url`).

# %%
DEFAULT_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
URL_ENV = "MULTI30K_URL"
CACHE_ENV = "ANNOTATED_CACHE"
SPLITS = ("train", "val", "test_2016_flickr")
LANGS = ("en", "de", "fr", "cs")

SHA256 = {
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "train.cs.gz": "a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
    "val.cs.gz": "b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
    "test_2016_flickr.cs.gz": "200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1",
}


def check_languages(src_lang: str, tgt_lang: str) -> None:
    """DataError (a ValueError) unless the two are different languages of `LANGS` (training's and Multi30k's)."""
    if src_lang not in LANGS or tgt_lang not in LANGS or src_lang == tgt_lang:
        raise DataError(
            f"src_lang and tgt_lang must be two different languages of {LANGS}, got {src_lang!r} -> {tgt_lang!r}"
        )


def default_cache_dir() -> Path:
    """$ANNOTATED_CACHE, else ~/.cache/annotated (downloads and tokenizers live below it)."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/annotated").expanduser()


def resolve_base_url(base_url: str | None = None) -> str:
    """The base URL to download from, ending in '/'. A plain path becomes a file:// URL.

    >>> resolve_base_url("file:///data/multi30k")
    'file:///data/multi30k/'
    >>> resolve_base_url("/data/multi30k/")
    'file:///data/multi30k/'
    """
    base = base_url or os.environ.get(URL_ENV) or DEFAULT_URL
    if "://" not in base:
        base = Path(base).expanduser().absolute().as_uri()
    return base if base.endswith("/") else base + "/"


# %% [markdown]
# ### Downloading without ever caching a bad file
#
# `fetch` is the only function that writes into the download cache, and it
# follows one rule: **a file appears in the cache only complete and
# verified.** The bytes stream, hashed on the way, into `atomic_write`'s
# temporary file (`annotated/plumbing/files.py`); the gzip stream is
# decompressed to its end (a truncated download fails here with a message
# that says so) and the sha256 compared with the pinned one before the file
# takes its name. On any failure, Ctrl-C included, nothing is cached.
#
# A file already in the cache is hashed again before use (a few milliseconds
# for these sizes); if it no longer matches (a disk error, a hand edit) it is
# downloaded again, with a warning (`test_damaged_cache_is_downloaded_again`).
# (`test_pinned_hashes_match_the_shared_sums`, `test_fetch_verifies_and_caches`,
# `test_second_fetch_reads_only_the_cache`,
# `test_sha_mismatch_is_rejected_and_nothing_cached`,
# `test_truncated_gzip_is_rejected_and_nothing_cached`,
# `test_unreachable_or_missing_source_names_the_variable`,
# `test_loopback_http_server_good_and_corrupted`.)


# %%
def _how_to_fix() -> str:
    path = "file:///path/to/multi30k/"
    if os.environ.get(MAKE_TARGET):  # under make: the make line with the variable set
        return f"{Door.make_line((), **{URL_ENV: path})} (a reachable copy of the Multi30k raw files, or {DEFAULT_URL})"
    return (
        f"set {URL_ENV} to a reachable copy of the Multi30k raw files, "
        f"e.g. {URL_ENV}={path} or the default {DEFAULT_URL}"
    )


def _download(url: str, out, name: str, timeout: float) -> str:
    """Stream `url` into the open binary file `out` with a progress bar; return the sha256."""
    from tqdm.auto import tqdm

    try:
        response = urllib.request.urlopen(url, timeout=timeout)
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:  # HTTPError among them
        reason = f"HTTP {e.code} {e.reason}" if isinstance(e, urllib.error.HTTPError) else getattr(e, "reason", e)
        raise DataError(f"cannot download {name} from {url}: {reason}; {_how_to_fix()}") from None
    h, received = hashlib.sha256(), 0
    with (
        response,
        tqdm(
            total=int(response.headers.get("Content-Length") or 0) or None,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"download {name}",
            leave=False,
            disable=None,
        ) as bar,
    ):
        expected = response.headers.get("Content-Length")
        try:
            for block in iter(lambda: response.read(1 << 16), b""):
                out.write(block)
                h.update(block)
                received += len(block)
                bar.update(len(block))
        except (OSError, http.client.HTTPException) as e:
            raise DataError(
                f"download of {name} from {url} broke off after {received} bytes ({e}); "
                f"nothing was cached; try again or {_how_to_fix()}"
            ) from None
    if expected is not None and expected.isdigit() and int(expected) != received:
        raise DataError(
            f"download of {name} from {url} is incomplete: {received} of {expected} bytes; "
            f"nothing was cached; try again or {_how_to_fix()}"
        )
    return h.hexdigest()


def _check_gzip(fd: int, name: str, url: str) -> None:
    """Decompress the open file `fd` to the end: a truncated or damaged gzip stream raises DataError."""
    try:
        with open(fd, "rb", closefd=False) as raw:
            raw.seek(0)
            with gzip.open(raw, "rb") as f:
                while f.read(1 << 20):
                    pass
    except (EOFError, OSError, zlib.error) as e:
        raise DataError(
            f"{name} from {url} is not a complete gzip file ({e}): the download was cut short "
            f"or the server sent something else; nothing was cached; {_how_to_fix()}"
        ) from None


def fetch(name: str, cache_dir: PathLike, base_url: str | None = None, *, timeout: float = 60.0) -> Path:
    """The verified local copy of the Multi30k file `name` (e.g. "train.de.gz") in `cache_dir`."""
    if name not in SHA256:
        raise DataError(f"unknown Multi30k file {name!r}; the pinned files are {', '.join(SHA256)}")
    cache_dir = Path(cache_dir)
    target = cache_dir / name
    if target.is_file():
        if sha256_of(target) == SHA256[name]:
            return target
        warnings.warn(
            f"cached {target} does not match its pinned sha256 (damaged?); downloading it again",
            DataWarning,
            stacklevel=2,
        )
    url = resolve_base_url(base_url) + name

    def download_and_verify(out) -> None:  # runs inside atomic_write: raising here caches nothing
        digest = _download(url, out, name, timeout)
        out.flush()
        _check_gzip(out.fileno(), name, url)
        if digest != SHA256[name]:
            raise DataError(
                f"{name} from {url} has sha256 {digest}, but annotated/training/data.py pins "
                f"{SHA256[name]}: the file is damaged or not the Multi30k release this code "
                f"expects; nothing was cached; {_how_to_fix()}"
            )

    atomic_write(target, download_and_verify)
    return target


# %% [markdown]
# ## 2. Reading parallel text
#
# A parallel corpus here is two files with one sentence a line: line `i` of
# the source translates line `i` of the target. The reader is deliberately
# strict, because the usual failure of parallel data is silent: one extra
# line shifts every later pair by one and the model learns from garbage.
#
# - **Lines end at `\n` only** (a `\r` right before it, from Windows files,
#   is removed too). We read bytes and split on `b"\n"`, never with Python's
#   text mode (which also ends a line at a lone `\r`) or `str.splitlines`
#   (which also breaks at `\x0b`, `\x0c`, `\x1c`-`\x1e`, `\x85`, `\u2028`
#   and `\u2029`): such characters do occur inside sentences of web-crawled
#   corpora, and one extra break shifts the alignment. Nothing else is
#   stripped; spaces are kept as they are.
# - **Strict UTF-8**: a line that is not valid UTF-8 is an error naming the
#   file, the line number and the byte, not a replacement character that
#   quietly becomes part of the vocabulary. A UTF-8 byte-order mark at the
#   start of a file is dropped.
# - **gzip is recognised by its first two bytes** (`1f 8b`), whatever the
#   file's name; a damaged gzip file is an error naming it.
# - **Both files must have the same number of lines.**
# - **Empty lines** (empty or only whitespace, on either side): by default an
#   error naming the file and line, since in a sentence-aligned corpus an
#   empty line is most often the sign of a misalignment, and a pair with an
#   empty side teaches nothing useful. `empty="skip"` drops such pairs and
#   warns with their count; `empty="keep"` keeps them (for a test set, where
#   every line must be translated to stay aligned with its reference).
#   Multi30k has no empty lines.
#
# (`test_non_utf8_names_file_and_line`, `test_line_counts_must_match`,
# `test_line_breaks_and_gzip_detection`, `test_empty_line_rule`,
# `test_unreadable_user_files_are_data_errors`.)


# %%
def read_lines(path: PathLike) -> list[str]:
    """The lines of a UTF-8 text file (plain or gzip), without their line terminators."""
    path = Path(path)
    lines: list[str] = []
    try:
        with open(path, "rb") as raw:
            is_gzip = raw.read(2) == b"\x1f\x8b"
        with gzip.open(path, "rb") if is_gzip else open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if line.endswith(b"\n"):
                    line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
                if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                    line = line[3:]  # UTF-8 byte-order mark
                try:
                    lines.append(line.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{path}: line {number} is not valid UTF-8 (byte 0x{line[e.start]:02x} at "
                        f"byte offset {e.start} of the line); convert the file to UTF-8, "
                        f"e.g. with iconv"
                    ) from None
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path} is a directory, not a text file") from None
    except (EOFError, zlib.error, OSError) as e:
        raise DataError(f"{path}: cannot read it ({e}); if it is gzipped, it is truncated or damaged") from None
    return lines


def read_parallel(src_path: PathLike, tgt_path: PathLike, *, empty: str = "error") -> list[tuple[str, str]]:
    """(source, target) sentence pairs from two line-aligned files (plain text or gzip)."""
    if empty not in ("error", "skip", "keep"):
        raise ValueError(f"empty must be 'error', 'skip' or 'keep', got {empty!r}")
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(
            f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: a parallel corpus "
            f"needs exactly one target line per source line"
        )
    pairs = list(zip(src, tgt))
    blank = [i for i, (s, t) in enumerate(pairs) if not s.strip() or not t.strip()]
    if blank and empty == "error":
        i = blank[0]
        where = src_path if not pairs[i][0].strip() else tgt_path
        raise DataError(
            f"{where}: line {i + 1} is empty ({len(blank)} pair(s) of {src_path} / {tgt_path} have "
            f"an empty side); an empty line usually means the files are misaligned; remove those "
            f"pairs, or read with empty='skip' or empty='keep' (train_wmt.py --empty-lines skip|keep)"
        )
    if blank and empty == "skip":
        warnings.warn(
            f"{src_path} / {tgt_path}: skipped {len(blank)} pair(s) with an empty side "
            f"(lines {', '.join(str(i + 1) for i in blank[:5])}{', ...' if len(blank) > 5 else ''})",
            DataWarning,
            stacklevel=2,
        )
        skip = set(blank)
        pairs = [p for i, p in enumerate(pairs) if i not in skip]
    return pairs


# %% [markdown]
# Loading a Multi30k split is then: fetch both sides (section 1) into
# `<cache_dir>/multi30k/` and read them as a parallel corpus, in any two
# different languages of `LANGS` (`test_load_multi30k_val_has_one_pair_per_line`).


# %%
def load_multi30k(
    split: str,
    src_lang: str = "de",
    tgt_lang: str = "en",
    cache_dir: PathLike | None = None,
    base_url: str | None = None,
) -> list[tuple[str, str]]:
    """(source, target) pairs of one Multi30k split, downloaded and verified on first use."""
    if split not in SPLITS:
        raise DataError(f"unknown Multi30k split {split!r}; choose one of {SPLITS}")
    check_languages(src_lang, tgt_lang)
    root = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "multi30k"
    src = fetch(f"{split}.{src_lang}.gz", root, base_url)
    tgt = fetch(f"{split}.{tgt_lang}.gz", root, base_url)
    return read_parallel(src, tgt)


# %% [markdown]
# ### Capitals in training (optional)
#
# Multi30k's sentences are cased as people write. `case_augmented` adds a
# capitals or lower-case copy of a seeded share of the training pairs, so that
# a model can learn to answer a shouted sentence in kind (`--case-augment`; 0
# by default: the translator recases such input, `annotated/decoding/casing.py`).
# The copies join the training pairs before the vocabulary is trained.


# %%
def case_augmented(pairs: Sequence[tuple[str, str]], share: float, seed: int = 0) -> list[tuple[str, str]]:
    """`pairs`, then a capitals or lower-case copy of `round(share * len(pairs))` of them (seeded choice).

    >>> case_augmented([("Ein Hund.", "A dog."), ("Zwei Männer.", "Two men.")], 1.0, seed=0)[2:]
    [('ZWEI MÄNNER.', 'TWO MEN.'), ('ein hund.', 'a dog.')]
    """
    chosen = random.Random(seed).sample(range(len(pairs)), round(share * len(pairs)))
    cased = (str.upper, str.lower)
    return list(pairs) + [(cased[n % 2](pairs[i][0]), cased[n % 2](pairs[i][1])) for n, i in enumerate(chosen)]


# %% [markdown]
# ## 3. Subwords: a shared BPE vocabulary
#
# A word-level vocabulary cannot translate a word it never saw, and a
# character-level one makes sequences long. Subwords sit between: frequent
# words are one token, rare ones are spelled from a few pieces
# (with the 8,000-piece vocabulary of the `cpu` preset, `Wasserballspieler`
# -> `▁Wasser`, `ball`, `spieler`; `▁` marks the start of a word). The paper used byte-pair
# encoding (BPE, Sennrich et al., 2016) with a vocabulary shared by source
# and target; so do we, through sentencepiece. BPE starts from characters
# and repeatedly merges the most frequent adjacent pair into a new symbol
# until the vocabulary has `vocab_size` entries. (sentencepiece's other
# model, unigram, translates about as well; BPE is the paper's choice and
# trains faster: docs/training.md#training-a-translator.)
#
# **Joint vocabulary.** One vocabulary for both languages lets the model tie
# the source embedding, the target embedding and the output layer
# (`share_embeddings`, `tie_generator` in the first chapter), and lets names
# and numbers, which are spelled the same in both languages, map to the same
# ids. The caller passes the training sentences of both sides, **training
# split only**: nothing about val or test may leak into the model, the
# vocabulary included.
#
# **Lossless.** The tokenizer must turn the model's ids back into exactly the
# text a person would write, since BLEU is computed on that text. Our
# settings make it lossless: `decode(encode(s)) == s` for every string
# (`test_tokenizer_round_trip_is_exact`):
#
# - `normalization_rule_name="identity"`: no Unicode normalisation. The
#   default (NFKC) rewrites 44 of the 29,000 German training sentences
#   (their non-breaking spaces become plain spaces), so decoding would not
#   give back the input.
# - `remove_extra_whitespaces=False`: keep leading, trailing and repeated
#   spaces (Multi30k has some); sacreBLEU's own tokenisation ignores them.
# - `byte_fallback=True` with `character_coverage=1.0`: every character of
#   the training text has its own piece, and a character never seen in
#   training (an emoji, a Chinese name) is spelled as its UTF-8 bytes, 256
#   pieces `<0x00>` ... `<0xFF>`, instead of becoming `<unk>`. So the ids are
#   `pad=0, bos=1, eos=2, unk=3`, then the 256 byte pieces, then the merged
#   subwords, then the single characters; `unk` is reserved but never
#   produced
#   (`test_unseen_characters_are_spelled_in_bytes`). The price: the
#   vocabulary must have room for 4 + 256 + (number of distinct characters)
#   entries: 362 for the German and English training split of Multi30k.
#   (`test_prose_numbers_of_the_full_training_split`.)
#
# `Tokenizer` (`annotated/tokens.py`, beside the reserved ids it checks)
# wraps a trained model. It is fully described by the model's bytes
# (`to_bytes`/`from_bytes`), which is what checkpoints store.

# %% [markdown]
# ### Training the vocabulary, once
#
# Training runs in memory (`sentence_iterator=` in, `model_writer=` out), so
# no text file is written. It is **deterministic**: BPE has no randomness
# (the seed is set anyway, for the sampling of corpora above five million
# sentences), and we fix `num_threads` because the model's bytes record it,
# though the pieces do not depend on it.
#
# The result is **cached** under `<cache_dir>/sentencepiece/<key>.model`,
# where the key is the sha256 of everything the result depends on: the
# texts, the settings below, `vocab_size`, and the sentencepiece version. The
# same data and settings load from the cache without training
# (`test_tokenizer_cache_hit_returns_identical_bytes`); any change trains
# anew. The file is written atomically. A cache file that does not load is
# ignored and rewritten, with a warning
# (`test_damaged_tokenizer_cache_is_retrained`).
#
# **A vocabulary size that does not fit the data** is a `DataError` that
# gives the bound (`test_vocab_size_that_does_not_fit_is_explained`).

# %%
SPM_SETTINGS: dict[str, Any] = dict(
    model_type="bpe",
    character_coverage=1.0,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    byte_fallback=True,
    pad_id=PAD,
    bos_id=BOS,
    eos_id=EOS,
    unk_id=UNK,
    input_sentence_size=5_000_000,
    shuffle_input_sentence=True,
    num_threads=4,
    minloglevel=2,
)
SPM_SEED = 0


def tokenizer_cache_key(texts: Sequence[str], vocab_size: int) -> str:
    """sha256 over the sentencepiece version, the settings, vocab_size and the texts."""
    import sentencepiece as spm

    key = {"sentencepiece": spm.__version__, "settings": SPM_SETTINGS, "seed": SPM_SEED, "vocab_size": vocab_size}
    h = hashlib.sha256(json.dumps(key, sort_keys=True).encode())
    for text in texts:
        b = text.encode("utf-8")
        h.update(len(b).to_bytes(8, "little") + b)  # length-prefixed: ["ab", "c"] != ["a", "bc"]
    return h.hexdigest()


def _train_spm(texts: Sequence[str], vocab_size: int) -> bytes:
    import sentencepiece as spm

    spm.set_random_generator_seed(SPM_SEED)
    out = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_writer=out, vocab_size=vocab_size, **SPM_SETTINGS
        )
    except RuntimeError as e:
        msg = str(e)
        high = re.search(r"too high \((\d+)\).*<= (\d+)", msg)
        low = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", msg)
        if high:
            raise DataError(
                f"vocab_size={vocab_size} is too large for these {len(texts)} sentences: they yield "
                f"at most {high.group(2)} subwords; choose vocab_size <= {high.group(2)} or train "
                f"on more text"
            ) from None
        if low:
            raise DataError(
                f"vocab_size={vocab_size} is too small: the vocabulary must hold at least "
                f"{low.group(2)} entries (4 reserved ids, 256 byte pieces and every distinct "
                f"character of the texts); choose vocab_size >= {low.group(2)}"
            ) from None
        raise DataError(
            f"sentencepiece could not train a vocabulary of {vocab_size} on {len(texts)} sentences: {msg}"
        ) from None
    return out.getvalue()


def train_tokenizer(texts: Sequence[str], vocab_size: int, cache_dir: PathLike | None = None) -> Tokenizer:
    """A joint BPE tokenizer of `vocab_size` pieces trained on `texts`, cached in <cache_dir>/sentencepiece."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise DataError(f"vocab_size must be a positive int, got {vocab_size!r}")
    texts = list(texts)
    if not any(t.strip() for t in texts):
        raise DataError(f"cannot train a tokenizer on {len(texts)} texts that are all empty")
    root = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "sentencepiece"
    path = root / f"{tokenizer_cache_key(texts, vocab_size)}.model"
    if path.is_file():
        try:
            return Tokenizer.from_bytes(path.read_bytes())
        except TokenizerError as e:
            warnings.warn(
                f"ignoring the damaged tokenizer cache {path} ({e}); training again", DataWarning, stacklevel=2
            )
    model = _train_spm(texts, vocab_size)
    tokenizer = Tokenizer.from_bytes(model)
    atomic_write(path, model)
    return tokenizer


# %% [markdown]
# ## 4. Batches by token count
#
# A batch is a rectangle: `B` sentences padded to the longest. The cost of a
# training step grows with the rectangle's area, not with the number of
# sentences, so we fix the **number of tokens per batch** (`max_tokens`), as
# the paper did (about 25,000 source and 25,000 target tokens per batch), and
# let the number of sentences vary: many short ones or a few long ones.
#
# **Few shapes.** `make_batches` pads each batch's `S` and the decoder's
# `T - 1` columns to multiples of `pad_to` (`_columns`). Padding is masked
# out of attention and loss, so it changes no result; on a GPU (`pad_to=8`)
# it buys a compiled model few widths and the tensor cores shapes they suit.
# On the CPU, which gains neither, training pads to the longest row
# (`train.columns_multiple`).
#
# **The budget.** A batch obeys `B * max(S, T) <= max_tokens` before that
# padding (the longest row's columns): neither rectangle holds more than
# `max_tokens` entries of its sentences, so the examples a batch holds, and
# hence a training recipe, do not depend on `pad_to`; the padding adds at
# most 7 columns.
#
# **Length bucketing.** Sentences are sorted by length (`max(len(x),
# len(y) + 2)`, the width they force) and cut greedily into consecutive
# runs that fit the budget, so each batch holds sentences of nearly equal
# length and little padding. With `shuffle=True` the sentences are first
# shuffled (so equal lengths come in a different order each epoch) and the
# finished batches are shuffled too (so the model does not see all short
# sentences first); `seed` makes both repeatable (use the epoch number).
#
# **Nothing dropped.** Every example is in exactly one batch. A single
# example wider than `max_tokens` cannot fit any batch; it gets a batch of
# its own, over budget, and a `DataWarning` reports how many there are.
# (Sentences longer than the *model* allows are a different matter: section
# 5.) (`test_every_example_once_and_budget_respected`,
# `test_batches_are_length_buckets_and_seeded`, `test_padding_and_ntokens`,
# `test_over_budget_example_gets_its_own_batch`, and for random lengths,
# budgets and process counts `test_batching_properties`.)


# %%
def real_positions(tgt: Tensor) -> Tensor:
    """The flat indices (n,) of tgt[:, 1:]'s non-pad entries, the positions a step predicts. tgt (B, T).

    >>> real_positions(torch.tensor([[BOS, 7, EOS], [BOS, EOS, PAD]])).tolist()  # tgt[:, 1:] = [7 eos], [eos pad]
    [0, 1, 2]
    """
    return (tgt[:, 1:] != PAD).flatten().nonzero().squeeze(1)  # (n,)


@dataclass
class Batch:
    src: Tensor  # (B, S) source ids, padded with PAD
    tgt: Tensor  # (B, T) BOS + target ids + EOS, padded with PAD
    index: Tensor  # (B,) position of each row in the list given to make_batches
    real: Tensor = None  # type: ignore[assignment]  # (n,) flat indices of tgt[:, 1:]'s non-pad entries

    def __post_init__(self):
        # built here, on the host with the batch, so that a step on a GPU never asks for them (nonzero syncs)
        if self.real is None:
            self.real = real_positions(self.tgt)  # (n,)

    @property
    def ntokens(self) -> int:
        """Target tokens the model predicts: non-pad entries of tgt[:, 1:]."""
        return int((self.tgt[:, 1:] != PAD).sum())

    def __len__(self) -> int:
        return self.src.size(0)

    def pin_memory(self) -> Batch:
        """The same batch in page-locked host memory (needs CUDA; train.py, "A step that never waits")."""
        return Batch(self.src.pin_memory(), self.tgt.pin_memory(), self.index, self.real.pin_memory())


def encode_pairs(pairs: Sequence[tuple[str, str]], tokenizer: Tokenizer) -> list[tuple[list[int], list[int]]]:
    """Subword ids (without bos/eos) of each (source, target) pair."""
    src = tokenizer.encode_batch([s for s, _ in pairs])
    tgt = tokenizer.encode_batch([t for _, t in pairs])
    return list(zip(src, tgt))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _columns(src_len: int, tgt_len: int, pad_to: int = 1, max_len: int | None = None) -> tuple[int, int]:
    """(S, T) of a batch whose longest source has src_len ids and longest target tgt_len ids (bos/eos excluded):
    S and the decoder's T - 1 rounded up to multiples of pad_to, capped at max_len.

    >>> _columns(5, 9), _columns(5, 9, pad_to=8), _columns(5, 9, pad_to=8, max_len=12)
    ((5, 11), (8, 17), (8, 13))
    """
    S, T = max(1, src_len), tgt_len + 2
    if pad_to > 1:
        S, T = _round_up(S, pad_to), _round_up(T - 1, pad_to) + 1
        if max_len is not None:
            S, T = min(S, max(max_len, src_len, 1)), min(T, max(max_len + 1, tgt_len + 2))
    return S, T


def _width(pair: tuple[Sequence[int], Sequence[int]]) -> int:
    """Columns this pair needs: its source, or its target with bos and eos."""
    return max(len(pair[0]), len(pair[1]) + 2)


def collate(
    encoded: Sequence[tuple[Sequence[int], Sequence[int]]],
    index: Sequence[int],
    pad_to: int = 1,
    max_len: int | None = None,
) -> Batch:
    """The padded Batch of the examples encoded[i] for i in index (columns as in `_columns`).

    >>> b = collate([([5, 6, 7], [8]), ([9], [10, 11])], [0, 1])
    >>> b.src.tolist(), b.tgt.tolist(), b.ntokens  # ntokens: 8 eos + 10 11 eos
    ([[5, 6, 7], [9, 0, 0]], [[1, 8, 2, 0], [1, 10, 11, 2]], 5)
    >>> b = collate([([5, 6, 7], [8]), ([9], [10, 11])], [0, 1], pad_to=8)
    >>> tuple(b.src.shape), tuple(b.tgt[:, :-1].shape), b.ntokens  # the same tokens, 8 columns each
    ((2, 8), (2, 8), 5)
    """
    srcs = [list(encoded[i][0]) for i in index]
    tgts = [[BOS, *encoded[i][1], EOS] for i in index]
    S, T = _columns(max(map(len, srcs)), max(map(len, tgts)) - 2, pad_to, max_len)
    src = torch.tensor([s + [PAD] * (S - len(s)) for s in srcs], dtype=torch.long)  # (B, S)
    tgt = torch.tensor([t + [PAD] * (T - len(t)) for t in tgts], dtype=torch.long)  # (B, T)
    return Batch(src, tgt, torch.tensor(list(index), dtype=torch.long))  # index (B,)


def _bucket(encoded, max_tokens: int, rng: random.Random | None) -> list[list[int]]:
    """Indices sorted by width, cut greedily into runs with B * width <= max_tokens."""
    order = list(range(len(encoded)))
    if rng is not None:
        rng.shuffle(order)
    order.sort(key=lambda i: (_width(encoded[i]), len(encoded[i][0])))  # stable: ties stay shuffled
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        w = _width(encoded[i])  # the widest so far, since the order is sorted
        if current and (len(current) + 1) * w > max_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


# %% [markdown]
# ### Several processes: every example once per epoch
#
# With `world_size` processes (one per GPU, `torchrun`), all of them build
# the same list of batches from the same `seed`, and process `rank` takes
# every `world_size`-th batch: `batches[rank::world_size]`. The shares are
# disjoint and together hold every example exactly once.
#
# `DistributedDataParallel` averages gradients at every step, so **every
# process must take the same number of steps**: a process with one batch
# fewer would leave the others waiting forever. Our rule: while the number
# of batches is not a multiple of `world_size`, the batch with the most
# sentences is split into two halves (each half still fits the budget). This
# needs at most `world_size - 1` splits, and no example is repeated or
# dropped. If there are too few examples to split into a multiple of
# `world_size` (fewer examples than processes, say) it is a `DataError`.
# (`test_ranks_share_all_examples_once`, `test_too_few_examples_for_the_ranks`;
# the doctest of `make_batches` shows a split.)


# %%
def _split_to_multiple(groups: list[list[int]], world_size: int) -> list[list[int]]:
    groups = list(groups)
    while len(groups) % world_size:
        j = max(range(len(groups)), key=lambda k: len(groups[k]))  # the first of the largest
        g = groups[j]
        if len(g) < 2:
            n = sum(map(len, groups))
            raise DataError(
                f"cannot share {n} examples equally among {world_size} processes: each process "
                f"needs the same number of batches and no batch can be split further; use more "
                f"data, fewer processes or a larger max_tokens"
            )
        groups[j : j + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return groups


def make_batches(
    encoded: Sequence[tuple[Sequence[int], Sequence[int]]],
    max_tokens: int,
    shuffle: bool = False,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    pad_to: int = 8,
    max_len: int | None = None,
) -> list[Batch]:
    """This process's batches: length-bucketed, B * max(S, T) <= max_tokens, each example once over all ranks.

    Seven pairs of widths 3 ... 9 (n source ids, n target ids + bos + eos) in three batches of at most 18
    entries; for two processes the largest batch is split, giving each two batches:

    >>> encoded = [([7] * n, [8] * n) for n in range(1, 8)]
    >>> [b.index.tolist() for b in make_batches(encoded, max_tokens=18, pad_to=1)]
    [[0, 1, 2], [3, 4], [5, 6]]
    >>> [[b.index.tolist() for b in make_batches(encoded, 18, rank=r, world_size=2, pad_to=1)] for r in (0, 1)]
    [[[0], [3, 4]], [[1, 2], [5, 6]]]

    With the default `pad_to=8` the same batches are 9 target columns wide (8 for the decoder):

    >>> [(b.index.tolist(), tuple(b.tgt.shape)) for b in make_batches(encoded, max_tokens=18)]
    [([0, 1, 2], (3, 9)), ([3, 4], (2, 9)), ([5, 6], (2, 9))]
    """
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
    if not encoded:
        return []
    rng = random.Random(seed) if shuffle else None
    groups = _bucket(encoded, max_tokens, rng)
    over = [g[0] for g in groups if _width(encoded[g[0]]) > max_tokens]
    if over:
        warnings.warn(
            f"{len(over)} example(s) are wider than max_tokens={max_tokens} "
            f"(widest: {max(_width(encoded[i]) for i in over)} columns); each gets a batch of its own",
            DataWarning,
            stacklevel=2,
        )
    if world_size > 1:
        groups = _split_to_multiple(groups, world_size)
    if rng is not None:
        rng.shuffle(groups)
    return [collate(encoded, g, pad_to, max_len) for g in groups[rank::world_size]]


# %% [markdown]
# ## 5. Sentences longer than the model
#
# The model has a positional table of `max_len` rows
# (`TransformerConfig.max_len`), so the encoder reads at most `max_len`
# source tokens and the decoder at most `max_len` positions. In training the
# decoder reads `bos y_1 ... y_n`, `n + 1` positions. A pair **fits** when
#
# $$\mathrm{len}(x) \le \mathrm{max\_len} \quad\text{and}\quad \mathrm{len}(y) + 1 \le \mathrm{max\_len}.$$
#
# The rule for pairs that do not fit, never silent:
#
# - **Training**: such a pair is left out of training, and the training loop
#   reports how many with a warning in its log. Truncating it instead would
#   teach the model a source and a target that no longer translate each
#   other.
# - **Evaluation**: every sentence is translated (a missing line would shift
#   the rest against the references), a long source truncated (evaluate.py).
#
# `split_long` is the helper for the first rule; it only sorts indices and
# reports nothing itself (its doctest, `test_split_long`).


# %%
def split_long(encoded: Sequence[tuple[Sequence[int], Sequence[int]]], max_len: int) -> tuple[list[int], list[int]]:
    """(indices of pairs that fit a model with this max_len, indices of those that do not).

    >>> split_long([([1] * 4, [2] * 3), ([1] * 5, [2] * 3), ([1] * 4, [2] * 4)], max_len=4)
    ([0], [1, 2])
    """
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    kept: list[int] = []
    long: list[int] = []
    for i, (x, y) in enumerate(encoded):
        (kept if len(x) <= max_len and len(y) + 1 <= max_len else long).append(i)
    return kept, long
