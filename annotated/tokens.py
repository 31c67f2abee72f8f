"""The four reserved token ids, the same in every vocabulary of the project, and the tokenizer that keeps them.

The chapter's copy task, the sentencepiece tokenizer (`annotated/training/data.py`
trains it with these ids), the decoders and the tools all read them from here.
A checkpoint stores its tokenizer's bytes; `Tokenizer.from_bytes` loads them.

>>> (PAD, BOS, EOS, UNK)
(0, 1, 2, 3)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from torch import Tensor

PAD = 0  # fills a sentence up to the length of the longest in its batch; never attended to
BOS = 1  # "beginning of sentence": the first token fed to the decoder
EOS = 2  # "end of sentence": the decoder's last output
UNK = 3  # a piece the vocabulary cannot spell (the tokenizer falls back to bytes, so it is never produced)
SPECIAL_LABELS = {PAD: "<pad>", BOS: "<s>", EOS: "</s>"}  # how dumps, pictures and pages spell the special ids


BATCH_ENCODE_FROM = 1000  # texts: from here on sentencepiece's threaded list call is faster than a loop


class TokenizerError(ValueError):
    """Bytes that are not a sentencepiece model with the project's reserved ids."""


class Tokenizer:
    """A sentencepiece model with the project's ids: pad=0, bos=1, eos=2, unk=3."""

    def __init__(self, model: bytes):
        import sentencepiece as spm

        self._model = bytes(model)
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=self._model)
        except Exception as e:  # noqa: BLE001 sentencepiece raises RuntimeError with a C++ location only
            raise TokenizerError(f"these {len(self._model)} bytes are not a sentencepiece model ({e})") from None
        ids = (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id(), self._sp.unk_id())
        if ids != (PAD, BOS, EOS, UNK):
            raise TokenizerError(
                f"the sentencepiece model has pad, bos, eos, unk ids {ids}; this project needs "
                f"{(PAD, BOS, EOS, UNK)}: train it with train_tokenizer()"
            )
        self._unseen: dict[str, bool] = {}  # character -> spelled unseen; a pure memo of a fixed model

    @classmethod
    def from_bytes(cls, model: bytes) -> Tokenizer:
        return cls(model)

    def to_bytes(self) -> bytes:
        return self._model

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Subword ids of `text`, without bos or eos."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """encode() for many texts at once. sentencepiece's list call starts a pool of threads each time, which
        pays from about a thousand texts on; fewer are encoded one call each (benchmarks/README.md,
        "Translation against CTranslate2 and `generate`", has what the pool costs)."""
        texts = list(texts)
        try:
            if len(texts) >= BATCH_ENCODE_FROM:
                return self._sp.encode(texts, out_type=int)
            return [self._sp.encode(text, out_type=int) for text in texts]
        except (RuntimeError, TypeError):  # sentencepiece names neither the text nor the reason
            for n, text in enumerate(texts):
                if not isinstance(text, str):
                    raise TypeError(f"text {n} is a {type(text).__name__}, not a str") from None
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(
                        f"text {n} is not valid Unicode: {text[e.start]!r} at position {e.start} "
                        f"(a lone surrogate, e.g. from undecodable input bytes)"
                    ) from None
            raise

    def _check_ids(self, ids) -> list[int]:
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """Text of `ids`: stops at the first eos, skips pad and bos."""
        ids = self._check_ids(ids)
        if EOS in ids:
            ids = ids[: ids.index(EOS)]
        return self._sp.decode([i for i in ids if i not in (PAD, BOS)])

    def pieces(self, ids: Sequence[int] | Tensor) -> list[str]:
        """The subword string of each id, e.g. ['▁Ein', '▁Hund'] ('▁' marks a preceding space)."""
        return [self._sp.id_to_piece(i) for i in self._check_ids(ids)]

    def spells_unseen(self, ids: Sequence[int] | Tensor) -> bool:
        """Whether `ids` hold `unk` or a byte piece: a character the tokenizer never saw in training."""
        return any(i == UNK or self._sp.is_byte(i) for i in self._check_ids(ids))

    def unseen_characters(self, text: str) -> set[str]:
        """The characters of `text` (whitespace aside) this tokenizer has no piece for: it spells each one alone
        in bytes, or unknown. A character's answer never changes, so each is encoded once per tokenizer (the
        translator asks for every character of every line)."""
        characters = set(text)
        for c in characters.difference(self._unseen):
            self._unseen[c] = not c.isspace() and self.spells_unseen(self.encode(c))
        return {c for c in characters if self._unseen[c]}

    def score(self, ids: Sequence[int] | Tensor) -> float:
        """The sum of the pieces' sentencepiece scores (for BPE, higher for pieces merged earlier: more frequent)."""
        return sum(self._sp.get_score(i) for i in self._check_ids(ids))

    def __reduce__(self):  # pickle through the model bytes
        return (Tokenizer.from_bytes, (self._model,))

    def __eq__(self, other) -> bool:
        return isinstance(other, Tokenizer) and other._model == self._model

    def __hash__(self) -> int:
        return hash(self._model)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, sha256={hashlib.sha256(self._model).hexdigest()[:12]})"
