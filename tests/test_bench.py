"""`make bench` (benchmarks/): the harness at a tiny size, the FLOP formula, the CPU's matmul peak and the step's
share of it, fixed-length decoding, the targets.

No test here asserts a speed: timings depend on the machine. They check that
the harness measures what it says it measures.
"""

import doctest
import json
import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from annotated import transformer
from annotated.decoding import search as decoding
from annotated.tokens import BOS, EOS, PAD
from annotated.training.config import TrainConfig, joint_model
from annotated.training.train import batch_loss
from annotated.transformer import fast_path
from benchmarks import arithmetic, bench, decoders, flops, reference, report, rows, sizes, targets, timing, training

# A tiny size: big enough vocabulary that the tied embedding table (2000 x 32
# floats, 250 KiB) is one block the CPU memory probe can see.
TINY = sizes.Size(
    "tiny",
    TrainConfig(model=joint_model(2000, N=1, d_model=32, d_ff=64, h=2, dropout=0.1, max_len=256), warmup=10),
    {"cpu": 6, "cuda": 6},
    {"cpu": 3, "cuda": 3},
)


@pytest.fixture(scope="module")
def result():
    settings = timing.Settings(torch.device("cpu"), reps=2, window=1e-6, train_batches=2, decode_batches=1, peak_n=64)
    return bench.run_benchmarks([TINY], settings, log=lambda s: None)


def test_training_rows_compare_against_the_reference_of_the_same_run(result):
    train = {r.key: r for r in result["train"]}
    assert set(train) == set(rows.VARIANTS)
    ref = train["reference"]
    for r in train.values():
        # identical work: the same batches for every implementation
        for k in ("sentences", "batches", "src_shape", "tgt_shape", "target_tokens_per_step", "flops_per_step"):
            assert getattr(r, k) == getattr(ref, k), k
        assert r.error is None, r.error
        assert len(r.step_s_rounds) == 2 and r.calls_per_round == 1  # window 1e-6: one call per round
        assert r.step_s == pytest.approx(sorted(r.step_s_rounds)[0] / 2 + sorted(r.step_s_rounds)[1] / 2)
        # the ratio is the reference's median step time over this row's, both from this result
        assert r.ratio_vs_reference == pytest.approx(ref.step_s / r.step_s)
        assert r.tokens_per_s == pytest.approx(r.target_tokens_per_step / r.step_s)
        assert r.mfu is None  # no peak is known for a CPU
    assert ref.ratio_vs_reference == pytest.approx(1.0)
    # predicted tokens: every non-pad position of tgt[:, 1:], averaged over the batches
    batches = sizes.make_batches(2, TINY.train_sentences["cpu"], TINY.train.vocab_size, 0)
    assert ref.target_tokens_per_step == sum(int((t[:, 1:] != PAD).sum()) for _, t in batches) / 2
    src_l, tgt_l, _ = sizes.real_lengths(batches)
    assert ref.flops_per_step == flops.training_flops(TINY.model_config(), src_l, tgt_l) / 2


def test_cpu_arithmetic_rows_compare_against_fp32_on_every_core_and_the_matmul_peak(result):
    """fp32 and bf16, one thread and every core, for the fused SDPA step; each row's speed-up is the
    fp32-on-every-core row's median step time over its own, and its share of the peak is its model FLOP/s over
    the square matmul's 2 n^3 FLOPs per median matmul time at the same precision and threads, all from this
    result (no speed asserted). bf16 is measured only on a CPU with bf16 instructions."""
    from annotated.plumbing.devices import all_cores, cpu_has_bf16

    arith = {(r.precision, r.threads): r for r in result["cpu_arithmetic"]}
    assert set(arith) == {(p, n) for p in ("fp32", "bf16") for n in (1, all_cores())}
    base = arith[("fp32", all_cores())]
    assert base.speedup_vs_fp32_all_threads == pytest.approx(1.0)
    fp32_1 = result["train"][0]  # the training rows ran the same batches: the same model FLOPs per step
    for (precision, _), r in arith.items():
        assert r.flops_per_step == fp32_1.flops_per_step and r.peak_n == 64
        if precision == "bf16" and not cpu_has_bf16():
            assert r.step_s is None and r.peak_flops is None and r.share_of_peak is None
            assert "no bf16 instructions" in r.note
            continue
        assert r.error is None and len(r.step_s_rounds) == 2 and len(r.peak_s_rounds) == 2, r
        assert r.speedup_vs_fp32_all_threads == pytest.approx(base.step_s / r.step_s)
        assert r.achieved_flops == pytest.approx(r.flops_per_step / r.step_s)
        peak = 2 * 64**3 / (sum(r.peak_s_rounds) / 2)  # the median of two rounds is their mean
        assert r.peak_flops == pytest.approx(peak)
        assert r.share_of_peak == pytest.approx(r.flops_per_step / r.step_s / peak)
    table = bench.markdown(result)
    assert "| tiny | bf16 | 1 |" in table and "share of peak" in table
    if not cpu_has_bf16():
        assert "not measured: this CPU has no bf16 instructions" in table
    assert torch.get_num_threads() == result["meta"]["threads"]  # the thread count is given back


def test_a_cuda_table_says_its_sdpa_rows_train_the_explicit_way():
    for device_type, said in (("cuda", True), ("cpu", False)):
        notes = "".join(report._notes({"meta": {"device_type": device_type}, "train": [], "decode": []}))
        assert ("sdpa_is_safe" in notes) is said, device_type


def test_the_peak_matmul_does_2_n_cubed_flops_at_its_precision():
    """The peak's FLOP count (2 n^3) checked by PyTorch's FlopCounterMode; the call computes a @ b."""
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        fn = arithmetic.matmul(24, precision, seed=3)
        with FlopCounterMode(display=False) as counter:
            out = fn()
        assert counter.get_total_flops() == 2 * 24**3 and out.shape == (24, 24) and out.dtype == dtype, precision
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(24, 24, generator=gen), torch.randn(24, 24, generator=gen)
    assert torch.allclose(arithmetic.matmul(24, "fp32", seed=3)(), a @ b)


def test_arithmetic_runs_once_per_model():
    """The gpu size trains the cpu preset's model on larger batches: one set of arithmetic rows for both."""
    assert [s.name for s in arithmetic.distinct_models([sizes.SIZES[n] for n in ("cpu", "gpu", "base")])] == [
        "cpu",
        "base",
    ]


def test_memory_columns(result):
    model = transformer.make_model(TINY.model_config())
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    for r in result["train"]:
        assert r.memory_error is None, r.memory_error
        # parameters plus Adam's two moments, all float32 (the tied table counted once)
        assert r.resident_bytes == 3 * param_bytes
        # the step's gradients are all alive at the end of backward, the tied table's among them
        assert r.step_peak_bytes >= largest


def test_decode_rows_run_a_fixed_number_of_steps(result):
    decode = {r.key: r for r in result["decode"]}
    assert set(decode) == set(rows.DECODERS)
    base = decode["greedy_recompute"]
    batches = sizes.make_batches(1, TINY.decode_sentences["cpu"], TINY.train.vocab_size, 1)
    for r in decode.values():
        assert r.error is None, r.error
        assert r.steps == batches[0][1].size(1) - 1 and r.sentences == 3
        assert r.ratio_vs_recompute == pytest.approx(base.seconds / r.seconds)
        assert r.sentences_per_s == pytest.approx(3 / r.seconds)


def test_result_is_json_and_written_atomically(result, tmp_path):
    path = tmp_path / "sub" / "out.json"
    report.write_json(result, path)
    written = json.loads(path.read_text())
    assert written == json.loads(json.dumps(report.to_json(result)))
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]  # no temporary file left behind
    # each row: its fields and its derived figures (what gpu_report.py and a reader of the file use)
    row, first = written["train"][0], result["train"][0]
    assert (
        (row["label"], row["step_s"], row["tokens_per_s"], row["compiled"])
        == (first.label, first.step_s, first.tokens_per_s, first.compiled)
        and row["mfu"] is None
        and "error" not in row
    )
    assert written["cpu_arithmetic"][0]["share_of_peak"] == result["cpu_arithmetic"][0].share_of_peak
    assert written["decode"][0]["sentences_per_s"] == result["decode"][0].sentences_per_s
    meta = result["meta"]
    assert meta["device_type"] == "cpu" and meta["torch"] == torch.__version__ and meta["sizes"] == ["tiny"]
    table = bench.markdown(result)
    assert "torch.nn.Transformer" in table and "not measured" in table
    for t in result["targets"]:
        assert t["status"] in ("met", "not met", "not measured")
        assert (t["status"] == "not measured") == (t["measured"] is None) == ("command" in t)
    # on a CPU run the GPU targets are not measured, the CPU ones of the size that ran are
    tiny = [t for t in result["targets"] if t["size"] == "tiny"]
    assert {t["target"] for t in tiny if t["status"] != "not measured"} == {
        "fused >= 1.0x torch.nn.Transformer",
        "cached greedy >= 3x recompute",
    }
    gpu_targets = [t for t in result["targets"] if "cuda" in t["device"] or "H100" in t["device"]]
    assert gpu_targets and all(t["status"] == "not measured" for t in gpu_targets)


def test_flop_formula_matches_flop_counter():
    # no padding, so real lengths are the computed lengths; the explicit path runs plain matmuls
    cfg = transformer.TransformerConfig(
        src_vocab=50,
        tgt_vocab=50,
        N=2,
        d_model=32,
        d_ff=48,
        h=4,
        d_k=6,
        d_v=10,
        dropout=0.0,
        share_embeddings=True,
        tie_generator=True,
    )
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 6))
    for attention in ("fused", "per_head"):
        model = transformer.make_model(cfg, attention=attention)
        with fast_path(False), FlopCounterMode(display=False) as counter:
            loss, _ = batch_loss(model, src, tgt, 0.1)
            loss.backward()
        assert counter.get_total_flops() == flops.training_flops(cfg, [7] * 3, [5] * 3), attention


def test_reference_has_the_same_parameters_and_runs():
    cfg = TINY.model_config()
    ours, ref = transformer.make_model(cfg), reference.TorchTransformerReference(cfg)
    # the same number of weights (torch packs W_Q, W_K, W_V into one in_proj_weight, so compare totals),
    # and the same LayerNorms: none after a post-norm stack
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    layer_norms = lambda m: sum(isinstance(x, torch.nn.LayerNorm) for x in m.modules())
    assert layer_norms(ours) == layer_norms(ref) == 5 * cfg.N
    assert ref.generator.weight is ref.src_embed.weight is ref.tgt_embed.weight
    src, tgt = sizes.make_batches(1, 4, cfg.src_vocab, 0)[0]
    loss, n = reference.reference_batch_loss(ref, src, tgt, 0.1)
    assert torch.isfinite(loss) and n == int((tgt[:, 1:] != PAD).sum())
    with pytest.raises(ValueError, match="d_k = d_v"):
        reference.TorchTransformerReference(
            transformer.TransformerConfig(src_vocab=10, tgt_vocab=10, d_model=32, h=2, d_k=8)
        )


def test_make_batches_look_like_training_batches():
    a = sizes.make_batches(3, 10, 100, seed=5)
    assert all(torch.equal(x, y) for p, q in zip(a, sizes.make_batches(3, 10, 100, seed=5)) for x, y in zip(p, q))
    shapes = {(s.shape, t.shape) for s, t in a}
    assert len(shapes) == 1  # one common shape
    for src, tgt in a:
        real = src != PAD
        assert (real == (torch.arange(src.size(1)) < real.sum(1, keepdim=True))).all()  # pad only at the end
        assert ((src[real] >= 4) & (src[real] < 100)).all() and (real.sum(1) >= 5).all()
        assert (tgt[:, 0] == BOS).all() and ((tgt == EOS).sum(1) == 1).all()
        eos_at = (tgt == EOS).int().argmax(1)
        pos = torch.arange(tgt.size(1))
        assert ((tgt == PAD) == (pos > eos_at[:, None])).all()
    with pytest.raises(ValueError, match="sentences"):
        sizes.make_batches(1, 0, 100, 0)


def test_suppressed_eos_forces_full_length_decoding():
    torch.manual_seed(0)
    model = transformer.make_model(TINY.model_config()).eval()
    with torch.no_grad():
        model.generator.bias[EOS] = 1e4  # eos is every step's most likely token
    src = sizes.make_batches(1, 2, TINY.train.vocab_size, 0)[0][0]
    mask = transformer.padding_mask(src, PAD)
    assert decoding.greedy(model, src, mask, 9).size(1) == 1  # stops at once
    decoders.suppress_eos(model)
    for out in (
        decoding.greedy(model, src, mask, 9),
        decoding.greedy(model, src, mask, 9, use_cache=False),
        decoding.beam_search(model, src, mask, 9, beam_size=4),
    ):
        assert out.shape == (2, 9) and not (out == EOS).any()


def test_interleaving_and_errors_without_timing():
    calls, syncs = [], []

    def fn(name):
        return lambda: calls.append(name)

    def broken():
        raise RuntimeError("out of memory")

    fns = {"a": fn("a"), "b": fn("b"), "c": fn("c"), "bad": broken}
    times, iters, errors = timing.interleaved_times(fns, reps=3, window=1e-9, sync=lambda: syncs.append(1))
    assert set(times) == {"a", "b", "c"} and all(len(v) == 3 for v in times.values())
    assert iters == {"a": 1, "b": 1, "c": 1} and errors == {"bad": "RuntimeError: out of memory"}
    # warm-up and calibration call each once, twice; then the order rotates from round to round
    assert calls == ["a", "a", "b", "b", "c", "c"] + ["a", "b", "c"] + ["b", "c", "a"] + ["c", "a", "b"]


def test_times_are_per_call_medians_of_the_clock():
    now = [0.0]  # a fake clock: each function advances it by its cost, so the expected times are exact
    fns = {"a": lambda: now.__setitem__(0, now[0] + 0.5), "b": lambda: now.__setitem__(0, now[0] + 2.0)}
    times, iters, errors = timing.interleaved_times(fns, reps=3, window=3.0, sync=lambda: None, clock=lambda: now[0])
    assert iters == {"a": 6, "b": 2} and not errors  # calls per window: window / cost of one calibration call
    assert times == {"a": [0.5, 0.5, 0.5], "b": [2.0, 2.0, 2.0]}


def _train_row(size, key, compiled, step_s, ratio, mfu=None):
    """A TrainRow whose derived figures are these: one round of `step_s`, the reference at `ratio` x, `mfu`."""
    return rows.TrainRow(
        size=size,
        key=key,
        device="-",
        dtype="bf16",
        compiled=compiled,
        sentences=1,
        batches=1,
        src_shape=[1, 1],
        tgt_shape=[1, 1],
        target_tokens_per_step=1.0,
        flops_per_step=(mfu or 0.0) * 1e12 * step_s,
        step_s_rounds=[step_s],
        reference_step_s=ratio * step_s,
        peak_tflops=1.0 if mfu else None,
    )


def _fake(device_type, device_name, ratio, recompute_ratio, per_head_s, mfu, bf16_share=None):
    train = [
        _train_row("gpu", "fused_sdpa", False, 1.0, ratio),
        _train_row("gpu", "per_head", False, per_head_s, 0.5),
        _train_row("base", "fused_sdpa", True, 1.0, ratio, mfu),
    ]
    decode = [
        rows.DecodeRow(
            size="gpu",
            key="greedy_cached",
            device="-",
            dtype="bf16",
            sentences=1,
            steps=1,
            src_shape=[1, 1],
            seconds_rounds=[1.0],
            recompute_s=recompute_ratio,
        )
    ]
    measured = bf16_share is not None  # a CPU without bf16 instructions: rows without rounds
    arith = [
        rows.ArithmeticRow(
            size="cpu",
            precision="bf16",
            threads=n,
            target_tokens_per_step=1.0,
            flops_per_step=share or 0.0,
            step_s_rounds=[1.0] if measured else [],
            peak_n=1,
            peak_s_rounds=[2.0] if measured else [],
        )
        for n, share in ((2, bf16_share), (1, 0.99))
    ]
    meta = {"device_type": device_type, "device_name": device_name, "sizes": ["gpu", "base"]}
    return {
        t["target"] + " " + t["size"] + " " + t["device"]: t["status"]
        for t in targets.evaluate_targets({"meta": meta, "train": train, "decode": decode, "cpu_arithmetic": arith})
    }


def test_targets_met_not_met_not_measured():
    cuda = _fake("cuda", "NVIDIA H100 80GB HBM3", 1.2, 5.0, 2.5, 0.31)
    assert cuda["fused >= 1.0x torch.nn.Transformer gpu cuda bf16"] == "met"
    assert cuda["fused >= 1.0x torch.nn.Transformer gpu cpu"] == "not measured"
    assert cuda["cached greedy >= 3x recompute gpu cpu"] == "not measured"  # the target is about the CPU
    assert cuda["per-head step time <= 2x fused gpu cuda, eager"] == "not met"  # 2.5x
    assert cuda["MFU >= 30% (fused) base one H100, bf16"] == "met"
    other_gpu = _fake("cuda", "NVIDIA A100-SXM4-80GB", 0.9, 5.0, 1.5, 0.31)
    assert other_gpu["fused >= 1.0x torch.nn.Transformer gpu cuda bf16"] == "not met"
    assert other_gpu["per-head step time <= 2x fused gpu cuda, eager"] == "met"
    assert other_gpu["MFU >= 30% (fused) base one H100, bf16"] == "not measured"  # not an H100
    cpu = _fake("cpu", "AMD EPYC", 1.0, 2.9, 1.5, None)
    assert cpu["fused >= 1.0x torch.nn.Transformer gpu cpu bf16"] == "met"  # exactly 1.0x meets ">= 1.0x"
    assert cpu["cached greedy >= 3x recompute gpu cpu"] == "not met"
    assert cpu["per-head step time <= 2x fused gpu cuda, eager"] == "not measured"
    assert cpu["share of the bf16 matmul peak >= 40% cpu cpu bf16, every core"] == "not measured"
    # a step of 0.39 or 0.41 peak-matmul FLOPs a second on every core (the one-thread row does not count)
    for share, status in ((0.39, "not met"), (0.41, "met")):
        with_bf16 = _fake("cpu", "AMD EPYC", 1.0, 3.0, 1.5, None, bf16_share=share)
        assert with_bf16["share of the bf16 matmul peak >= 40% cpu cpu bf16, every core"] == status


def test_command_line_errors():
    with pytest.raises(SystemExit):
        bench.parse_args(["--sizes", "cpu,huge"])
    for bad in (["--threads", "0"], ["--reps", "0"], ["--window", "-1"], ["--device", "tpu"], ["--peak-tflops", "0"]):
        with pytest.raises(SystemExit):  # refused at the door, before any work
            bench.parse_args(bad)
    assert bench.parse_args(["--sizes", "cpu, base"]).sizes == ["cpu", "base"]
    with pytest.raises(ValueError, match="dtype"):
        timing.Settings(dtype="fp16")
    with pytest.raises(ValueError, match="clock"):
        timing.Settings(torch.device("cuda"), clock="cpu")  # CUDA work is timed by the wall clock


def test_module_doctests():
    failures, tried = doctest.testmod(flops)
    assert tried > 0 and failures == 0


def test_host_syncs_per_training_step_is_a_reported_figure(result):
    """`make bench` counts the synchronising operators of the real training step: none on this size."""
    h = result["host_syncs"]
    assert h["size"] == "tiny" and h["steps"] == 8 and h["per_step"] == 0, h
    assert "host syncs per training step: 0 (train.train_step, tiny size, 8 steps counted on cpu)" in bench.markdown(
        result
    )


def test_compile_speedup_is_eager_over_compiled_of_the_same_run():
    measured = [
        _train_row("cpu", k, c, t, 1.0)
        for k, c, t in (("fused_sdpa", False, 0.30), ("fused_sdpa", True, 0.25), ("reference", False, 0.4))
    ]
    assert training.compile_speedups(measured) == [{"size": "cpu", "key": "fused_sdpa", "speedup": 1.2}]
    assert bench.parse_args([]).compile is None  # main() then measures both; on the CPU the fused SDPA row only


def test_gpu_report_without_cuda_says_so_in_one_line_and_exits_2(tmp_path):
    """`make gpu-report` on a machine without CUDA: one line, exit 2, nothing written."""
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the report would run")
    root = Path(__file__).resolve().parents[1]
    before = sorted((root / "benchmarks" / "results").glob("*")) if (root / "benchmarks" / "results").is_dir() else []
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_report"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(root)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("gpu-report: error: no CUDA device")
    after = sorted((root / "benchmarks" / "results").glob("*")) if (root / "benchmarks" / "results").is_dir() else []
    assert after == before
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_report", "--parts", "nope"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(root)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--parts 'nope'" in r.stderr, r.stderr


def test_gpu_report_reads_a_training_run_and_tabulates_it(tmp_path, monkeypatch):
    """Part (b)'s figures come from the run's results.json (steps and training seconds, beam BLEU of the
    averaged checkpoint when there is one); the table shows them. No GPU needed: the run is faked."""
    from benchmarks import gpu_report

    monkeypatch.setattr(gpu_report, "ROOT", tmp_path)
    calls = []

    def fake_run(cmd, limit, log):
        calls.append((cmd, limit))
        return {"command": " ".join(cmd), "code": 0, "timed_out": False, "wall_s": 400.0}

    monkeypatch.setattr(gpu_report, "run", fake_run)
    run_dir = tmp_path / "runs" / "gpu-report-x-de-en"
    run_dir.mkdir(parents=True)
    beam = {"bleu": 39.5, "bleu_lowercase": 40.25}
    (run_dir / "results.json").write_text(
        json.dumps(
            {
                "steps": 4200,
                "train_s": 300.0,
                "test_set": "test_2016_flickr",
                "test": {
                    "best": {"checkpoint": "b.pt", "beam": {"bleu": 1, "bleu_lowercase": 1}},
                    "averaged": {"checkpoint": "a.pt", "beam": beam},
                },
            }
        )
    )
    part = gpu_report.train_part(tmp_path, "x", "de", "en", 6.5, None)
    assert (part["steps"], part["steps_per_s"], part["bleu"], part["checkpoint"]) == (4200, 14.0, 39.5, "a.pt")
    ((cmd, limit),) = calls  # eager, as `make train` runs it; the cap plus 2.5 minutes for data, compiling and test
    assert "--compile" not in cmd and cmd[cmd.index("--max-minutes") + 1] == "6.5" and limit == 540
    compiled = gpu_report.train_part(tmp_path, "x", "de", "en", 2, None, compiled=True)
    assert "--compile" in calls[-1][0] and calls[-1][1] == 270
    assert "gpu preset de->en, compiled |" in gpu_report.markdown(
        {"device": "GPU", "torch": "t", "date": "d", "train_de_en": compiled}
    )
    table = gpu_report.markdown(
        {"device": "GPU", "torch": "t", "date": "d", "train_de_en": part, "ddp": gpu_report.ddp_part(tmp_path, "x", 1)}
    )
    assert (
        "| train | gpu preset de->en | test BLEU 39.50 (lowercased 40.25), 4200 steps, 14.0 steps/s | 400.0 |" in table
    )
    assert "needs two" in table


def test_profiling_ranks_the_steps_operators_by_self_time():
    """`python -m benchmarks.profiling`'s ranking: shares of all self CPU time, largest first, matrix products
    among the top operators of a training step (no time asserted beyond the ranking)."""
    from benchmarks import profiling

    averages = profiling.profile_step(TINY, steps=1).averages
    top = profiling.top_operators(averages, 10)
    shares = [share for _, share, _ in top]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    assert {name for name, _, _ in top} & {"aten::mm", "aten::addmm", "aten::bmm"}
    assert sum(e.self_cpu_time_total for e in averages) > 0


def test_profiling_counts_the_fresh_pages_a_step_touches_with_and_without_the_profiler():
    """`profiled` counts minor page faults per step outside and under the profiler, each for its own steps: a
    step that maps and writes 8 MiB of fresh memory, but only in the calls that run under the profiler (the
    two untimed and two unprofiled calls come first), is seen faulting about 2,048 pages (4 KiB) a step under
    it and almost none outside it; its milliseconds are timed both ways."""
    import mmap

    pytest.importorskip("resource", reason="this platform does not count page faults")
    from benchmarks import profiling

    size, calls = 8 << 20, []

    def step():
        calls.append(1)
        if len(calls) > 2 + 2:  # the profiled calls only
            with mmap.mmap(-1, size) as m:  # fresh anonymous pages, handed back to the kernel at the end
                for offset in range(0, size, mmap.PAGESIZE):
                    m[offset] = 1

    r = profiling.profiled(step, steps=2)
    pages = size // mmap.PAGESIZE
    assert len(calls) == 2 + 2 + 2
    assert r.faults_per_step < pages * 0.1
    assert pages * 0.9 <= r.faults_per_step_profiled <= pages * 1.5
    assert r.ms_per_step > 0 and r.ms_per_step_profiled > 0
    assert f"{r.faults_per_step_profiled:,.0f} under it" in r.summary()


def test_the_profilers_cost_line_gives_the_extra_fresh_pages_in_mib_from_the_page_size():
    """The extra minor page faults a profiled step takes, stated in MiB: pages times the page size (4 KiB on
    x86-64 Linux, 16 KiB on Apple silicon), whichever the platform's is, in the line the commands print."""
    import mmap

    from benchmarks import profiling

    assert profiling.fresh_mib(2048, 4096) == 8.0 and profiling.fresh_mib(2048, 16384) == 32.0
    assert profiling.fresh_mib(2560) == 2560 * mmap.PAGESIZE / 2**20  # the platform's page size by default
    r = profiling.Profiled(None, 10.0, 12.0, 100.0, 100.0 + 2560)  # 2,560 extra pages a step under the profiler
    mib = 2560 * mmap.PAGESIZE / 2**20  # 10 MiB with 4 KiB pages
    assert f"(about {mib:,.0f} MiB more of fresh pages a step, " in r.summary()
    assert "MiB" not in profiling.Profiled(None, 10.0, 12.0, 100.0, 90.0).summary()  # no extra pages: no figure
