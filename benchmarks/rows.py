# %% [markdown]
# # Result rows (`make bench`)
#
# One dataclass per kind of row: what was run (size, implementation,
# batch) and the seconds of each timed round. The figures a table shows
# (median step time, tokens/s, ratios, FLOP/s) are properties computed from
# those, so they cannot disagree with the rounds; `to_json` writes both.

# %%
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from benchmarks.timing import median

VARIANTS = {  # training-step implementation key -> label
    "fused_sdpa": "ours, fused, SDPA",
    "fused_explicit": "ours, fused, explicit softmax",
    "per_head": "ours, per-head",
    "reference": "torch.nn.Transformer",
}

DECODERS = {  # decoder key -> label
    "greedy_cached": "greedy, key/value cache",
    "greedy_recompute": "greedy, recompute prefix",
    "beam4_cached": "beam search (4), cache",
}


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def _json(row, **derived) -> dict:
    """The row's fields, without the empty optional ones, and its derived figures."""
    optional = ("error", "note", "memory_error", "resident_bytes", "step_peak_bytes")
    d = {k: v for k, v in dataclasses.asdict(row).items() if not (k in optional and v is None)}
    return dict(d, **derived)


@dataclass
class TrainRow:
    """One implementation's training step at one size, with its rounds and memory."""

    size: str
    key: str  # a key of VARIANTS
    device: str
    dtype: str
    compiled: bool
    sentences: int
    batches: int
    src_shape: list
    tgt_shape: list
    target_tokens_per_step: float
    flops_per_step: float
    step_s_rounds: list = field(default_factory=list)
    calls_per_round: int | None = None
    reference_step_s: float | None = None  # the torch.nn.Transformer row's median, same run
    peak_tflops: float | None = None  # the device's peak, for MFU
    error: str | None = None
    resident_bytes: int | None = None
    step_peak_bytes: int | None = None
    memory_error: str | None = None

    @property
    def label(self) -> str:
        return VARIANTS[self.key]

    @property
    def step_s(self) -> float | None:
        return median(self.step_s_rounds)

    @property
    def tokens_per_s(self) -> float | None:
        return _ratio(self.target_tokens_per_step, self.step_s)

    @property
    def ratio_vs_reference(self) -> float | None:
        return _ratio(self.reference_step_s, self.step_s)

    @property
    def achieved_tflops(self) -> float | None:
        return self.step_s and self.flops_per_step / self.step_s / 1e12

    @property
    def mfu(self) -> float | None:
        return _ratio(self.achieved_tflops, self.peak_tflops)

    def to_json(self) -> dict:
        return _json(
            self,
            label=self.label,
            step_s=self.step_s,
            tokens_per_s=self.tokens_per_s,
            ratio_vs_reference=self.ratio_vs_reference,
            achieved_tflops=self.achieved_tflops,
            mfu=self.mfu,
        )


@dataclass
class DecodeRow:
    """One decoder at one size: every sentence of the batch decoded for exactly `steps` steps."""

    size: str
    key: str  # a key of DECODERS
    device: str
    dtype: str
    sentences: int
    steps: int
    src_shape: list
    seconds_rounds: list = field(default_factory=list)
    calls_per_round: int | None = None
    recompute_s: float | None = None  # the recomputing greedy decoder's median, same run
    error: str | None = None

    @property
    def label(self) -> str:
        return DECODERS[self.key]

    @property
    def seconds(self) -> float | None:
        return median(self.seconds_rounds)

    @property
    def sentences_per_s(self) -> float | None:
        return _ratio(self.sentences, self.seconds)

    @property
    def ratio_vs_recompute(self) -> float | None:
        return _ratio(self.recompute_s, self.seconds)

    def to_json(self) -> dict:
        return _json(
            self,
            label=self.label,
            seconds=self.seconds,
            sentences_per_s=self.sentences_per_s,
            ratio_vs_recompute=self.ratio_vs_recompute,
        )


@dataclass
class ArithmeticRow:
    """The fused SDPA training step on the CPU at one precision and thread count, beside the same CPU's
    matmul peak at that precision and thread count, both timed in the same interleaved rounds."""

    size: str
    precision: str  # "fp32" or "bf16" (autocast)
    threads: int
    target_tokens_per_step: float
    flops_per_step: float  # model FLOPs (flops.training_flops)
    step_s_rounds: list = field(default_factory=list)
    baseline_step_s: float | None = None  # fp32 on every core, same rounds
    peak_n: int = 0  # the peak's square matmul: (n x n) @ (n x n), 2 n^3 FLOPs
    peak_s_rounds: list = field(default_factory=list)  # seconds per matmul, same rounds as the step
    note: str | None = None  # why the row was not measured
    error: str | None = None

    @property
    def step_s(self) -> float | None:
        return median(self.step_s_rounds)

    @property
    def tokens_per_s(self) -> float | None:
        return _ratio(self.target_tokens_per_step, self.step_s)

    @property
    def speedup_vs_fp32_all_threads(self) -> float | None:
        return _ratio(self.baseline_step_s, self.step_s)

    @property
    def achieved_flops(self) -> float | None:
        return _ratio(self.flops_per_step, self.step_s)

    @property
    def peak_flops(self) -> float | None:
        """The CPU's measured matmul FLOP/s at this precision and thread count (the roofline's flat part)."""
        return _ratio(2 * self.peak_n**3, median(self.peak_s_rounds))

    @property
    def share_of_peak(self) -> float | None:
        return _ratio(self.achieved_flops, self.peak_flops)

    def to_json(self) -> dict:
        return _json(
            self,
            key="fused_sdpa",
            step_s=self.step_s,
            tokens_per_s=self.tokens_per_s,
            speedup_vs_fp32_all_threads=self.speedup_vs_fp32_all_threads,
            achieved_flops=self.achieved_flops,
            peak_flops=self.peak_flops,
            share_of_peak=self.share_of_peak,
        )
