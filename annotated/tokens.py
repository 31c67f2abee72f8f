"""The four reserved token ids, the same in every vocabulary of the project.

The chapter's copy task, the sentencepiece tokenizer (`annotated/training/data.py`
trains it with these ids), the decoders and the tools all read them from here.

>>> (PAD, BOS, EOS, UNK)
(0, 1, 2, 3)
"""

PAD = 0  # fills a sentence up to the length of the longest in its batch; never attended to
BOS = 1  # "beginning of sentence": the first token fed to the decoder
EOS = 2  # "end of sentence": the decoder's last output
UNK = 3  # a piece the vocabulary cannot spell (the tokenizer falls back to bytes, so it is never produced)
