"""The claims of annotated/training/data.py: downloads, reading, subwords, batches.

The Multi30k files come from $MULTI30K_URL when it is set, else from the
shared copy beside the repository (../shared/data/multi30k/, which is where
.ci/run points the variable); tests that need them skip, saying so, when
neither exists. Every cache lives in a pytest temporary directory.
"""

import contextlib
import gzip
import hashlib
import http.server
import os
import pickle
import random
import socket
import stat
import threading
import unicodedata
import urllib.parse
import urllib.request
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from annotated.tokens import BATCH_ENCODE_FROM, Tokenizer, TokenizerError
from annotated.training import data
from annotated.training.data import (
    BOS,
    EOS,
    PAD,
    SHA256,
    URL_ENV,
    DataError,
    DataWarning,
    collate,
    encode_pairs,
    fetch,
    load_multi30k,
    make_batches,
    read_lines,
    read_parallel,
    split_long,
    train_tokenizer,
)

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "multi30k"


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def base_url():
    """The Multi30k source: $MULTI30K_URL, else the shared copy; skip when the folder is missing."""
    url = os.environ.get(URL_ENV) or SHARED.as_uri() + "/"
    resolved = data.resolve_base_url(url)
    if resolved.startswith("file://"):
        folder = Path(urllib.request.url2pathname(urllib.parse.urlparse(resolved).path))
        if not folder.is_dir():
            pytest.skip(
                f"no Multi30k data source: {folder} does not exist (set {URL_ENV} to a copy of the "
                f"raw files, e.g. file:///path/to/multi30k/)"
            )
    return url


@pytest.fixture(scope="module")
def source(base_url, tmp_path_factory):
    """A verified local copy of the files the tests doctor: name -> bytes."""
    cache = tmp_path_factory.mktemp("source")
    return {name: fetch(name, cache, base_url).read_bytes() for name in ("val.de.gz", "val.en.gz")}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def train_texts(base_url, cache):
    """The first 2000 training pairs, both sides: enough for a small vocabulary in well under a second."""
    pairs = load_multi30k("train", "de", "en", cache_dir=cache, base_url=base_url)[:2000]
    return [s for s, _ in pairs] + [t for _, t in pairs]


@pytest.fixture(scope="module")
def tokenizer(train_texts, cache):
    return train_tokenizer(train_texts, 500, cache_dir=cache)


def serve(folder: Path, name: str, content: bytes) -> str:
    """Put `content` at folder/name and return folder as a file:// base URL."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(content)
    return folder.as_uri() + "/"


def leftovers(folder: Path) -> list[str]:
    """Everything in a cache folder (temporary .part files included)."""
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def closed_port() -> int:
    """A local TCP port nobody listens on: bind to a free one, then release it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def doctored(gz: bytes) -> bytes:
    """A valid gzip file whose text differs from the original in one character."""
    text = gzip.decompress(gz)
    return gzip.compress(text.replace(b"A", b"a", 1), mtime=0)


# ---------------------------------------------------------------- downloads


def test_pinned_hashes_match_the_shared_sums(base_url):
    """The SHA256SUMS beside the files the tests read ($MULTI30K_URL, else the shared copy) lists the pinned hashes."""
    url = data.resolve_base_url(base_url) + "SHA256SUMS"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            text = response.read().decode("utf-8")
    except OSError as e:  # URLError is an OSError
        pytest.skip(f"no SHA256SUMS beside the Multi30k files to compare the pinned hashes with ({url}: {e})")
    sums = dict(reversed(line.split()) for line in text.splitlines() if line)
    assert sums == SHA256
    assert set(SHA256) == {f"{s}.{l}.gz" for s in data.SPLITS for l in data.LANGS}


def test_fetch_verifies_and_caches(base_url, tmp_path):
    path = fetch("val.de.gz", tmp_path, base_url)
    assert path == tmp_path / "val.de.gz"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA256["val.de.gz"]
    assert leftovers(tmp_path) == ["val.de.gz"]  # no temporary file left behind


def test_cached_files_get_the_mode_a_plain_open_would_give(base_url, tmp_path):
    old = os.umask(0o027)
    try:
        path = fetch("val.de.gz", tmp_path, base_url)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # 0o666 less the umask, not mkstemp's private 0o600


def test_second_fetch_reads_only_the_cache(base_url, tmp_path):
    first = fetch("val.en.gz", tmp_path, base_url)
    stamp = first.stat().st_mtime_ns
    # a source that cannot be read: the file must come from the cache
    again = fetch("val.en.gz", tmp_path, f"http://127.0.0.1:{closed_port()}/")
    assert again == first and again.stat().st_mtime_ns == stamp
    assert hashlib.sha256(again.read_bytes()).hexdigest() == SHA256["val.en.gz"]


def test_damaged_cache_is_downloaded_again(base_url, source, tmp_path):
    (tmp_path / "val.de.gz").write_bytes(source["val.de.gz"][:100])
    with pytest.warns(DataWarning, match="does not match its pinned sha256"):
        path = fetch("val.de.gz", tmp_path, base_url)
    assert path.read_bytes() == source["val.de.gz"]


def test_sha_mismatch_is_rejected_and_nothing_cached(source, tmp_path):
    url = serve(tmp_path / "mirror", "val.de.gz", doctored(source["val.de.gz"]))
    with pytest.raises(DataError, match=r"val\.de\.gz .*has sha256 .* pins f0cba2f9.*MULTI30K_URL"):
        fetch("val.de.gz", tmp_path / "cache", url)
    assert leftovers(tmp_path / "cache") == []


def test_truncated_gzip_is_rejected_and_nothing_cached(source, tmp_path):
    good = source["val.de.gz"]
    url = serve(tmp_path / "mirror", "val.de.gz", good[: len(good) // 2])
    with pytest.raises(DataError, match=r"val\.de\.gz .*not a complete gzip file.*MULTI30K_URL"):
        fetch("val.de.gz", tmp_path / "cache", url)
    assert leftovers(tmp_path / "cache") == []
    # the same file brought by a user is an error naming it
    (tmp_path / "cut.de.gz").write_bytes(good[: len(good) // 2])
    (tmp_path / "full.en.gz").write_bytes(source["val.en.gz"])
    with pytest.raises(DataError, match=r"cut\.de\.gz: cannot read it .*truncated"):
        read_parallel(tmp_path / "cut.de.gz", tmp_path / "full.en.gz")


@pytest.mark.parametrize("where", ["missing folder", "closed port", "folder without the file", "env var"])
def test_unreachable_or_missing_source_names_the_variable(where, tmp_path, monkeypatch):
    url = {
        "missing folder": "file:///nonexistent/multi30k/",
        "closed port": f"http://127.0.0.1:{closed_port()}/",
        "folder without the file": str(tmp_path / "empty"),  # a plain path is accepted too
        "env var": None,
    }[where]
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv(URL_ENV, "file:///nonexistent/from-env/")
    with pytest.raises(
        DataError, match=r"cannot download val\.fr\.gz from .*set MULTI30K_URL to a reachable copy"
    ) as e:
        fetch("val.fr.gz", tmp_path / "cache", url)
    if where == "env var":
        assert "from-env" in str(e.value)
    assert leftovers(tmp_path / "cache") == []


def test_unknown_file_name_is_rejected(tmp_path):
    with pytest.raises(DataError, match=r"unknown Multi30k file 'val\.xx\.gz'"):
        fetch("val.xx.gz", tmp_path)


@contextlib.contextmanager
def http_server(folder: Path):
    """A loopback http.server serving `folder`, quietly, on a free port."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_loopback_http_server_good_and_corrupted(source, tmp_path):
    serve(tmp_path / "good", "val.de.gz", source["val.de.gz"])
    serve(tmp_path / "bad", "val.de.gz", doctored(source["val.de.gz"]))
    with http_server(tmp_path / "good") as url:
        path = fetch("val.de.gz", tmp_path / "cache", url)
        assert path.read_bytes() == source["val.de.gz"]
        with pytest.raises(DataError, match=r"val\.en\.gz .*HTTP 404.*MULTI30K_URL"):
            fetch("val.en.gz", tmp_path / "cache", url)
    assert leftovers(tmp_path / "cache") == ["val.de.gz"]
    with http_server(tmp_path / "bad") as url, pytest.raises(DataError, match=r"val\.de\.gz .*has sha256"):
        fetch("val.de.gz", tmp_path / "cache2", url)
    assert leftovers(tmp_path / "cache2") == []


# ---------------------------------------------------------------- reading


def test_load_multi30k_val_has_one_pair_per_line(base_url, source, cache):
    pairs = load_multi30k("val", "de", "en", cache_dir=cache, base_url=base_url)
    de = gzip.decompress(source["val.de.gz"]).decode("utf-8").split("\n")
    en = gzip.decompress(source["val.en.gz"]).decode("utf-8").split("\n")
    assert de[-1] == en[-1] == ""  # both end in a newline: the lines are the pieces before the last
    assert len(pairs) == len(de) - 1 == len(en) - 1
    assert pairs == list(zip(de[:-1], en[:-1]))
    back = load_multi30k("val", "en", "de", cache_dir=cache, base_url=base_url)
    assert back == [(e, d) for d, e in pairs]


def test_load_multi30k_rejects_bad_split_and_languages(cache):
    with pytest.raises(DataError, match="unknown Multi30k split 'dev'"):
        load_multi30k("dev", cache_dir=cache)
    with pytest.raises(DataError, match="two different languages"):
        load_multi30k("val", "de", "de", cache_dir=cache)
    with pytest.raises(DataError, match="two different languages"):
        load_multi30k("val", "de", "xx", cache_dir=cache)


def test_non_utf8_names_file_and_line(tmp_path):
    (tmp_path / "src.txt").write_bytes(b"eins\nzwei\ndrei \xff\n")
    (tmp_path / "tgt.txt").write_bytes(b"one\ntwo\nthree\n")
    with pytest.raises(DataError, match=r"src\.txt: line 3 is not valid UTF-8 \(byte 0xff"):
        read_parallel(tmp_path / "src.txt", tmp_path / "tgt.txt")
    (tmp_path / "tgt.gz").write_bytes(gzip.compress(b"one\n\xe9two\nthree\n"))  # latin-1, gzipped
    with pytest.raises(DataError, match=r"tgt\.gz: line 2 is not valid UTF-8 \(byte 0xe9"):
        read_parallel(tmp_path / "tgt.txt", tmp_path / "tgt.gz")


def test_line_counts_must_match(tmp_path):
    (tmp_path / "a.txt").write_text("1\n2\n3\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("1\n2\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"a\.txt has 3 lines but .*b\.txt has 2"):
        read_parallel(tmp_path / "a.txt", tmp_path / "b.txt")


def test_line_breaks_and_gzip_detection(tmp_path):
    raw = (
        b"\xef\xbb\xbfa\n"  # a UTF-8 byte-order mark, dropped
        b"b\r\r\n"  # the terminator "\r\n" goes, the "\r" inside stays
        + "c\u2028d\n".encode("utf-8")  # characters str.splitlines() would break at
        + "e\x0cf\x85g\x1ch\n".encode()
        + b" spaced  out \n"  # spaces are kept as they are
        + b"last"
    )  # no newline at the end
    expected = ["a", "b\r", "c\u2028d", "e\x0cf\x85g\x1ch", " spaced  out ", "last"]
    (tmp_path / "plain.txt").write_bytes(raw)
    (tmp_path / "zipped.txt").write_bytes(gzip.compress(raw))  # gzip under a .txt name
    assert read_lines(tmp_path / "plain.txt") == expected
    assert read_lines(tmp_path / "zipped.txt") == expected
    (tmp_path / "crlf.txt").write_bytes(b"x\r\ny\r\n")
    assert read_lines(tmp_path / "crlf.txt") == ["x", "y"]


def test_empty_line_rule(tmp_path):
    (tmp_path / "s.txt").write_text("a\nb\nc\nd\n", encoding="utf-8")
    (tmp_path / "t.txt").write_text("A\n  \nC\n\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"t\.txt: line 2 is empty \(2 pair"):
        read_parallel(tmp_path / "s.txt", tmp_path / "t.txt")
    with pytest.warns(DataWarning, match=r"skipped 2 pair\(s\) with an empty side \(lines 2, 4\)"):
        assert read_parallel(tmp_path / "s.txt", tmp_path / "t.txt", empty="skip") == [("a", "A"), ("c", "C")]
    kept = read_parallel(tmp_path / "s.txt", tmp_path / "t.txt", empty="keep")
    assert kept == [("a", "A"), ("b", "  "), ("c", "C"), ("d", "")]
    with pytest.raises(ValueError, match="empty must be"):
        read_parallel(tmp_path / "s.txt", tmp_path / "t.txt", empty="drop")


def test_unreadable_user_files_are_data_errors(tmp_path):
    (tmp_path / "t.txt").write_text("x\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"nope\.txt: no such file"):
        read_parallel(tmp_path / "nope.txt", tmp_path / "t.txt")
    with pytest.raises(DataError, match="is a directory"):
        read_parallel(tmp_path / "t.txt", tmp_path)


# ---------------------------------------------------------------- subwords


def test_tokenizer_round_trip_is_exact(tokenizer, source):
    hostile = ["", " ", "  two leading", "trailing  ", "a\u00a0b", "ﬁ ligature", "Straße 😀 北京", "\t tab"]
    for name in ("val.de.gz", "val.en.gz"):
        sentences = gzip.decompress(source[name]).decode("utf-8").split("\n")[:-1]
        for s in sentences + hostile:
            ids = tokenizer.encode(s)
            assert data.UNK not in ids and BOS not in ids and EOS not in ids and PAD not in ids
            assert tokenizer.decode(ids) == s


def test_text_that_is_not_unicode_is_named(tokenizer):
    with pytest.raises(ValueError, match=r"text 1 is not valid Unicode: '\\udcff' at position 2"):
        tokenizer.encode_batch(["ok", "ab\udcff"])  # what errors="surrogateescape" makes of byte 0xff
    with pytest.raises(TypeError, match="text 0 is a NoneType, not a str"):
        tokenizer.encode(None)


@pytest.mark.parametrize("n", [3, BATCH_ENCODE_FROM + 1])
def test_both_ways_of_encoding_a_list_give_the_ids_of_one_text_at_a_time(tokenizer, train_texts, n):
    """Below BATCH_ENCODE_FROM texts encode_batch loops, from it on sentencepiece's threaded list call runs: the
    same ids either way, and a bad text is named by its position either way."""
    texts = (train_texts * 2)[:n]
    assert tokenizer.encode_batch(texts) == [tokenizer._sp.encode(t, out_type=int) for t in texts]
    with pytest.raises(ValueError, match=rf"text {n - 1} is not valid Unicode"):
        tokenizer.encode_batch(texts[:-1] + ["ab\udcff"])


def test_prose_numbers_of_the_full_training_split(base_url, cache):
    """The numbers the prose quotes, measured on the German and English training split."""
    pairs = load_multi30k("train", "de", "en", cache_dir=cache, base_url=base_url)
    texts = [s for s, _ in pairs] + [t for _, t in pairs]
    german = [s for s, _ in pairs]
    assert len(german) == 29_000 and sum(unicodedata.normalize("NFKC", s) != s for s in german) == 44
    with pytest.raises(DataError, match="choose vocab_size >= 362"):
        train_tokenizer(texts, 100, cache_dir=cache)
    tok = train_tokenizer(texts, 8000, cache_dir=cache)
    assert tok.pieces(tok.encode("Wasserballspieler")) == ["▁Wasser", "ball", "spieler"]
    # ids: 4 reserved, 256 bytes, then merges, single characters last
    assert tok.pieces(range(4, 260)) == [f"<0x{b:02X}>" for b in range(256)]
    assert len(tok.pieces([260])[0]) >= 2 and len(tok.pieces([8000 - 1])[0]) == 1


def test_unseen_characters_are_spelled_in_bytes(tokenizer):
    ids = tokenizer.encode("😀")
    assert tokenizer.pieces(ids) == ["▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]  # U+1F600 in UTF-8


def test_unseen_characters_are_the_ones_spelled_in_bytes_and_asking_again_answers_the_same(tokenizer):
    text = "Ein Hund 😀 rennt ☃ über die Wiese.\t😀"
    spelled_alone = {c for c in set(text) if not c.isspace() and tokenizer.spells_unseen(tokenizer.encode(c))}
    assert spelled_alone == {"😀", "☃"}
    assert tokenizer.unseen_characters(text) == spelled_alone  # first asked: each character encoded
    assert tokenizer.unseen_characters(text) == spelled_alone  # asked again: from the memo
    assert tokenizer.unseen_characters("Hund") == set() and tokenizer.unseen_characters("") == set()


def test_special_ids_and_decode_rules(tokenizer):
    assert tokenizer.pieces([PAD, BOS, EOS, data.UNK]) == ["<pad>", "<s>", "</s>", "<unk>"]
    ids = tokenizer.encode("Ein Hund.")
    assert tokenizer.decode([BOS, *ids, EOS, *tokenizer.encode("Katze"), PAD]) == "Ein Hund."
    assert tokenizer.decode(torch.tensor([BOS, *ids, PAD, PAD])) == "Ein Hund."
    with pytest.raises(ValueError, match=f"token id {tokenizer.vocab_size} is outside"):
        tokenizer.decode([tokenizer.vocab_size])
    assert tokenizer.vocab_size == 500


def test_tokenizer_bytes_and_pickle_round_trip(tokenizer):
    again = Tokenizer.from_bytes(tokenizer.to_bytes())
    assert again == tokenizer and again.to_bytes() == tokenizer.to_bytes()
    assert pickle.loads(pickle.dumps(tokenizer)) == tokenizer
    s = "Zwei Männer spielen Fußball."
    assert again.encode(s) == tokenizer.encode(s)
    with pytest.raises(TokenizerError, match="not a sentencepiece model"):
        Tokenizer.from_bytes(b"not a model")


def test_tokenizer_cache_hit_returns_identical_bytes(train_texts, tokenizer, cache, tmp_path, monkeypatch):
    model_file = cache / "sentencepiece" / f"{data.tokenizer_cache_key(train_texts, 500)}.model"
    assert model_file.read_bytes() == tokenizer.to_bytes()
    # training is deterministic: a fresh cache gives the same bytes
    assert train_tokenizer(train_texts, 500, cache_dir=tmp_path).to_bytes() == tokenizer.to_bytes()

    def no_training(*args):
        raise AssertionError("trained although the cache holds this tokenizer")

    monkeypatch.setattr(data, "_train_spm", no_training)
    assert train_tokenizer(train_texts, 500, cache_dir=cache).to_bytes() == tokenizer.to_bytes()
    with pytest.raises(AssertionError, match="trained although"):  # other settings: another key
        train_tokenizer(train_texts, 501, cache_dir=cache)
    with pytest.raises(AssertionError, match="trained although"):  # other texts: another key
        train_tokenizer(train_texts[:-1], 500, cache_dir=cache)


def test_damaged_tokenizer_cache_is_retrained(train_texts, tokenizer, tmp_path):
    train_tokenizer(train_texts, 500, cache_dir=tmp_path)
    [path] = (tmp_path / "sentencepiece").glob("*.model")
    path.write_bytes(b"garbage")
    with pytest.warns(DataWarning, match="damaged tokenizer cache"):
        again = train_tokenizer(train_texts, 500, cache_dir=tmp_path)
    assert again == tokenizer and path.read_bytes() == tokenizer.to_bytes()
    assert leftovers(path.parent) == [path.name]


def test_vocab_size_that_does_not_fit_is_explained(train_texts, tmp_path):
    texts = train_texts[:100]
    with pytest.raises(DataError, match=r"vocab_size=100000 is too large for these 100 sentences") as e:
        train_tokenizer(texts, 100_000, cache_dir=tmp_path)
    largest = int(str(e.value).split("choose vocab_size <= ")[1].split()[0])
    assert train_tokenizer(texts, largest, cache_dir=tmp_path).vocab_size == largest  # the bound is exact
    with pytest.raises(DataError, match=r"vocab_size=50 is too small") as e:
        train_tokenizer(texts, 50, cache_dir=tmp_path)
    smallest = int(str(e.value).split("choose vocab_size >= ")[1].split()[0])
    n_chars = len(set("".join(texts)) - {" "}) + 1  # spaces are spelled "▁"
    assert smallest == 4 + 256 + n_chars
    assert train_tokenizer(texts, smallest, cache_dir=tmp_path).vocab_size == smallest
    with pytest.raises(DataError, match="all empty"):
        train_tokenizer(["", " "], 300, cache_dir=tmp_path)
    with pytest.raises(DataError, match="vocab_size must be a positive int"):
        train_tokenizer(texts, 0, cache_dir=tmp_path)


def test_encode_pairs_uses_the_tokenizer(tokenizer):
    pairs = [("Ein Hund.", "A dog."), ("", "Nothing.")]
    assert encode_pairs(pairs, tokenizer) == [(tokenizer.encode(s), tokenizer.encode(t)) for s, t in pairs]


# ---------------------------------------------------------------- batches


def random_encoded(n, max_len, seed):
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(4, 50) for _ in range(rng.randrange(0, max_len))],
            [rng.randrange(4, 50) for _ in range(rng.randrange(0, max_len))],
        )
        for _ in range(n)
    ]


def up8(n):
    return (n + 7) // 8 * 8


def budget(b, encoded):
    """What the budget counts: B * the longest row's columns (source, or target with bos and eos), unpadded."""
    rows = b.index.tolist()
    return len(rows) * max(max(len(encoded[i][0]), len(encoded[i][1]) + 2) for i in rows)


def check_batch(b, encoded, pad_to=8):
    """Rows hold exactly their example: ids then pad; bos + ids + eos then pad. With pad_to=8 (make_batches'
    default) the source and the decoder input tgt[:, :-1] have the longest row's columns rounded up to 8."""
    B, S = b.src.shape
    assert b.src.dtype == b.tgt.dtype == b.index.dtype == torch.long
    assert b.tgt.size(0) == b.index.size(0) == B >= 1
    longest_src = max(1, max(len(encoded[i][0]) for i in b.index.tolist()))
    longest_tgt = max(len(encoded[i][1]) + 2 for i in b.index.tolist())
    if pad_to == 8:
        assert up8(longest_src) == S and b.tgt.size(1) - 1 == up8(longest_tgt - 1)
    else:
        assert longest_src == S and b.tgt.size(1) == longest_tgt
    for r, i in enumerate(b.index.tolist()):
        x, y = encoded[i]
        assert b.src[r].tolist() == x + [PAD] * (S - len(x))
        assert b.tgt[r].tolist() == [BOS, *y, EOS] + [PAD] * (b.tgt.size(1) - len(y) - 2)
    assert b.ntokens == sum(len(encoded[i][1]) + 1 for i in b.index.tolist())


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("max_tokens", [64, 300, 5000])
def test_every_example_once_and_budget_respected(shuffle, max_tokens):
    encoded = random_encoded(500, 30, seed=max_tokens)  # widest: 29 + 2 = 31 <= 64, so none over budget
    batches = make_batches(encoded, max_tokens, shuffle=shuffle, seed=3)
    seen = sorted(i for b in batches for i in b.index.tolist())
    assert seen == list(range(len(encoded)))
    for b in batches:
        assert budget(b, encoded) <= max_tokens
        assert max(b.src.numel(), b.tgt.numel()) <= len(b) * (budget(b, encoded) // len(b) + 7)  # + padding
        check_batch(b, encoded)


def test_batches_are_length_buckets_and_seeded():
    encoded = random_encoded(400, 40, seed=1)
    width = [max(len(x), len(y) + 2) for x, y in encoded]
    batches = make_batches(encoded, 400)
    # without shuffling, batches are consecutive runs of the examples sorted by width
    for a, b in zip(batches, batches[1:]):
        assert max(width[i] for i in a.index.tolist()) <= min(width[i] for i in b.index.tolist())
    # greedy: adding the next example would have broken the budget
    for a, b in zip(batches, batches[1:]):
        nxt = min(b.index.tolist(), key=lambda i: (width[i], len(encoded[i][0])))
        assert (len(a) + 1) * width[nxt] > 400
    # with shuffling the batches stay buckets but come in shuffled order (not sorted by width)
    shuffled = make_batches(encoded, 400, shuffle=True, seed=5)
    widest = [max(width[i] for i in b.index.tolist()) for b in shuffled]
    assert widest != sorted(widest) and sorted(widest) == sorted(
        max(width[i] for i in b.index.tolist()) for b in batches
    )
    order = lambda bs: [b.index.tolist() for b in bs]
    assert order(make_batches(encoded, 400, shuffle=True, seed=5)) == order(
        make_batches(encoded, 400, shuffle=True, seed=5)
    )
    assert order(make_batches(encoded, 400, shuffle=True, seed=5)) != order(
        make_batches(encoded, 400, shuffle=True, seed=6)
    )


def test_padding_and_ntokens():
    encoded = [([5, 6, 7], [8]), ([], [9, 10, 11])]
    [b] = make_batches(encoded, 100, pad_to=1)
    check_batch(b, encoded, pad_to=1)
    assert b.index.tolist() == [0, 1]  # width 3 and 5
    assert b.src.tolist() == [[5, 6, 7], [PAD, PAD, PAD]]
    assert b.tgt.tolist() == [[BOS, 8, EOS, PAD, PAD], [BOS, 9, 10, 11, EOS]]
    assert b.ntokens == 2 + 4
    [empty_src] = make_batches([([], [4])], 10, pad_to=1)  # an empty source still has one (pad) column
    assert empty_src.src.tolist() == [[PAD]]
    # the default pads to 8 source and 8 decoder columns: the same rows, more pad, the same ntokens
    [b8] = make_batches(encoded, 100)
    assert b8.index.tolist() == [0, 1] and b8.src.tolist() == [row + [PAD] * 5 for row in b.src.tolist()]
    assert b8.tgt.tolist() == [row + [PAD] * 4 for row in b.tgt.tolist()] and b8.ntokens == b.ntokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_pinned_batches_hold_the_same_ids():
    [b] = make_batches([([5, 6, 7], [8]), ([], [9, 10, 11])], 100)
    pinned = b.pin_memory()
    assert pinned.src.is_pinned() and pinned.tgt.is_pinned()
    assert torch.equal(pinned.src, b.src) and torch.equal(pinned.tgt, b.tgt) and pinned.ntokens == b.ntokens


def test_padding_never_passes_the_model_length():
    """With max_len given, padding stops at what the model reads: S <= max_len, decoder input T - 1 <= max_len."""
    encoded = [([4] * 10, [5] * 9), ([4] * 3, [5] * 2)]
    for b in make_batches(encoded, 1000, max_len=10):
        assert b.src.size(1) <= 10 and b.tgt[:, :-1].size(1) <= 10
    [b] = make_batches(encoded, 1000, max_len=10)
    assert tuple(b.src.shape) == (2, 10) and tuple(b.tgt.shape) == (2, 11) and b.ntokens == 10 + 3


def test_padded_batches_give_the_same_loss():
    """Padding is masked out of attention and loss: the summed loss of a batch padded to 8 columns equals the
    unpadded one's (float32, a few hundred terms: relative 1e-5 covers the different reduction order)."""
    from annotated.training.train import batch_loss
    from annotated.transformer import make_model

    torch.manual_seed(0)
    model = make_model(src_vocab=60, tgt_vocab=60, N=1, d_model=32, d_ff=64, h=2, dropout=0.0).eval()
    encoded = random_encoded(12, 15, seed=4)
    plain, padded = collate(encoded, range(12)), collate(encoded, range(12), pad_to=8)
    assert padded.src.size(1) % 8 == 0 and (padded.tgt.size(1) - 1) % 8 == 0
    assert padded.src.size(1) > plain.src.size(1) or padded.tgt.size(1) > plain.tgt.size(1)
    (a, n), (b, m) = (batch_loss(model, x.src, x.tgt, 0.1) for x in (plain, padded))
    assert int(n) == int(m) == plain.ntokens
    assert abs(a.item() - b.item()) <= 1e-5 * abs(a.item())


def test_over_budget_example_gets_its_own_batch():
    encoded = [([4] * 3, [5] * 3)] * 6 + [([4] * 50, [5] * 2), ([4] * 3, [5] * 40)]
    with pytest.warns(DataWarning, match=r"2 example\(s\) are wider than max_tokens=20 \(widest: 50"):
        batches = make_batches(encoded, 20)
    alone = [b.index.tolist() for b in batches if budget(b, encoded) > 20]
    assert sorted(alone) == [[6], [7]]
    assert sorted(i for b in batches for i in b.index.tolist()) == list(range(8))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("n", [7, 61, 500])
def test_ranks_share_all_examples_once(world_size, n):
    encoded = random_encoded(n, 25, seed=n)
    for seed in range(3):
        shares = [
            make_batches(encoded, 120, shuffle=True, seed=seed, rank=r, world_size=world_size)
            for r in range(world_size)
        ]
        assert len({len(s) for s in shares}) == 1  # every rank takes the same number of steps
        seen = sorted(i for s in shares for b in s for i in b.index.tolist())
        assert seen == list(range(n))
        for s in shares:
            for b in s:
                assert budget(b, encoded) <= 120
                check_batch(b, encoded)


def test_too_few_examples_for_the_ranks():
    with pytest.raises(DataError, match="cannot share 2 examples equally among 3 processes"):
        make_batches([([4], [5]), ([4], [5])], 100, rank=0, world_size=3)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=40),
    max_tokens=st.integers(1, 80),
    world_size=st.integers(1, 4),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_batching_properties(lengths, max_tokens, world_size, shuffle, seed):
    """For any lengths and budget: each example once over the ranks, equal shares, budget kept or reported."""
    encoded = [([4] * a, [5] * b) for a, b in lengths]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shares = [make_batches(encoded, max_tokens, shuffle, seed, r, world_size) for r in range(world_size)]
    except DataError as e:
        assert "cannot share" in str(e) and world_size > 1
        return
    assert len({len(s) for s in shares}) == 1
    assert sorted(i for s in shares for b in s for i in b.index.tolist()) == list(range(len(encoded)))
    over = {i for i, (x, y) in enumerate(encoded) if max(len(x), len(y) + 2) > max_tokens}
    assert bool(over) == any(issubclass(w.category, DataWarning) for w in caught)
    for s in shares:
        for b in s:
            check_batch(b, encoded)
            if budget(b, encoded) > max_tokens:
                assert len(b) == 1 and b.index.item() in over


def test_bad_batching_arguments():
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        make_batches([([4], [5])], 0)
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        make_batches([([4], [5])], 10, rank=2, world_size=2)
    assert make_batches([], 10) == []


def test_split_long():
    encoded = [([4] * 10, [5] * 9), ([4] * 11, [5]), ([4], [5] * 10), ([], [])]
    kept, long = split_long(encoded, max_len=10)
    assert (kept, long) == ([0, 3], [1, 2])
    # what "fits" means: the model's positional table covers the source and the decoder input bos + y
    for i in kept:
        b = collate(encoded, [i])
        assert b.src.size(1) <= 10 and b.tgt[:, :-1].size(1) <= 10
    for i in long:
        b = collate(encoded, [i])
        assert b.src.size(1) > 10 or b.tgt[:, :-1].size(1) > 10
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        split_long(encoded, 0)


@given(st.lists(st.tuples(st.text(max_size=8), st.text(max_size=8)), max_size=30), st.floats(0, 1), st.integers(0, 3))
def test_case_augmented_adds_capital_or_lower_copies_of_the_pairs(pairs, share, seed):
    out = data.case_augmented(pairs, share, seed)
    assert out[: len(pairs)] == pairs and len(out) == len(pairs) + round(share * len(pairs))
    for n, pair in enumerate(out[len(pairs) :]):  # capitals, lower case, capitals, ...
        cased = str.upper if n % 2 == 0 else str.lower
        assert pair in {(cased(s), cased(t)) for s, t in pairs}
    assert data.case_augmented(pairs, share, seed) == out  # seeded
