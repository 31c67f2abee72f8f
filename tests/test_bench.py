"""benchmarks/bench.py: the harness at a tiny size, the FLOP formula, fixed-length decoding, the targets.

No test here asserts a speed: timings depend on the machine. They check that
the harness measures what it says it measures.
"""
import doctest
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from annotated import transformer
from annotated.decoding import search as decoding
from annotated.tokens import BOS, EOS, PAD
from annotated.training.config import TrainConfig, joint_model
from annotated.training.train import batch_loss
from benchmarks import bench

# A tiny size: big enough vocabulary that the tied embedding table (2000 x 32
# floats, 250 KiB) is one block the CPU memory probe can see.
TINY = bench.Size("tiny", TrainConfig(model=joint_model(2000, N=1, d_model=32, d_ff=64, h=2, dropout=0.1, max_len=256),
                                      warmup=10),
                  {"cpu": 6, "cuda": 6}, {"cpu": 3, "cuda": 3})


@pytest.fixture(scope="module")
def result():
    settings = bench.Settings(torch.device("cpu"), reps=2, window=1e-6, train_batches=2, decode_batches=1)
    return bench.run_benchmarks([TINY], settings, log=lambda s: None)


def test_training_rows_compare_against_the_reference_of_the_same_run(result):
    rows = {r["key"]: r for r in result["train"]}
    assert set(rows) == set(bench.VARIANTS)
    ref = rows["reference"]
    for r in rows.values():
        # identical work: the same batches for every implementation
        for k in ("sentences", "batches", "src_shape", "tgt_shape", "target_tokens_per_step", "flops_per_step"):
            assert r[k] == ref[k], k
        assert "error" not in r, r.get("error")
        assert len(r["step_s_rounds"]) == 2 and r["calls_per_round"] == 1  # window 1e-6: one call per round
        assert r["step_s"] == pytest.approx(sorted(r["step_s_rounds"])[0] / 2 + sorted(r["step_s_rounds"])[1] / 2)
        # the ratio is the reference's median step time over this row's, both from this result
        assert r["ratio_vs_reference"] == pytest.approx(ref["step_s"] / r["step_s"])
        assert r["tokens_per_s"] == pytest.approx(r["target_tokens_per_step"] / r["step_s"])
        assert r["mfu"] is None  # no peak is known for a CPU
    assert ref["ratio_vs_reference"] == pytest.approx(1.0)
    # predicted tokens: every non-pad position of tgt[:, 1:], averaged over the batches
    batches = bench.make_batches(2, TINY.train_sentences["cpu"], TINY.train.vocab_size, 0)
    assert ref["target_tokens_per_step"] == sum(int((t[:, 1:] != PAD).sum()) for _, t in batches) / 2


def test_cpu_arithmetic_rows_compare_against_fp32_on_every_core(result):
    """fp32 and bf16, one thread and every core, for the first size's fused SDPA step; each row's speed-up is
    the fp32-on-every-core row's median step time over its own, both from this result (no speed asserted)."""
    from annotated.plumbing.devices import all_cores, cpu_has_bf16

    rows = {(r["precision"], r["threads"]): r for r in result["cpu_arithmetic"]}
    assert set(rows) == {(p, n) for p in ("fp32", "bf16") for n in (1, all_cores())}
    base = rows[("fp32", all_cores())]
    assert base["speedup_vs_fp32_all_threads"] == pytest.approx(1.0)
    for (precision, _), r in rows.items():
        if precision == "bf16" and not cpu_has_bf16():
            assert r["step_s"] is None and "no bf16 instructions" in r["note"]
            continue
        assert "error" not in r and len(r["step_s_rounds"]) == 2, r
        assert r["speedup_vs_fp32_all_threads"] == pytest.approx(base["step_s"] / r["step_s"])
    assert "| tiny | bf16 | 1 |" in bench.markdown(result)
    assert torch.get_num_threads() == result["meta"]["threads"]  # the thread count is given back


def test_memory_columns(result):
    model = transformer.make_model(TINY.model_config())
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    for r in result["train"]:
        assert "memory_error" not in r, r.get("memory_error")
        # parameters plus Adam's two moments, all float32 (the tied table counted once)
        assert r["resident_bytes"] == 3 * param_bytes
        # the step's gradients are all alive at the end of backward, the tied table's among them
        assert r["step_peak_bytes"] >= largest


def test_decode_rows_run_a_fixed_number_of_steps(result):
    rows = {r["key"]: r for r in result["decode"]}
    assert set(rows) == set(bench.DECODERS)
    base = rows["greedy_recompute"]
    batches = bench.make_batches(1, TINY.decode_sentences["cpu"], TINY.train.vocab_size, 1)
    for r in rows.values():
        assert "error" not in r, r.get("error")
        assert r["steps"] == batches[0][1].size(1) - 1 and r["sentences"] == 3
        assert r["ratio_vs_recompute"] == pytest.approx(base["seconds"] / r["seconds"])
        assert r["sentences_per_s"] == pytest.approx(3 / r["seconds"])


def test_result_is_json_and_written_atomically(result, tmp_path):
    path = tmp_path / "sub" / "out.json"
    bench.write_json(result, path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]  # no temporary file left behind
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
        "fused >= 1.0x torch.nn.Transformer", "cached greedy >= 3x recompute"}
    gpu_targets = [t for t in result["targets"] if "cuda" in t["device"] or "H100" in t["device"]]
    assert gpu_targets and all(t["status"] == "not measured" for t in gpu_targets)


def test_flop_formula_matches_flop_counter():
    # no padding, so real lengths are the computed lengths; the explicit path runs plain matmuls
    cfg = transformer.TransformerConfig(src_vocab=50, tgt_vocab=50, N=2, d_model=32, d_ff=48, h=4, d_k=6, d_v=10,
                               dropout=0.0, share_embeddings=True, tie_generator=True)
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 6))
    for attention in ("fused", "per_head"):
        model = transformer.make_model(cfg, attention=attention)
        with transformer.fast_path(False), FlopCounterMode(display=False) as counter:
            loss, _ = batch_loss(model, src, tgt, 0.1)
            loss.backward()
        assert counter.get_total_flops() == bench.training_flops(cfg, [7] * 3, [5] * 3), attention


def test_reference_has_the_same_parameters_and_runs():
    cfg = TINY.model_config()
    ours, ref = transformer.make_model(cfg), bench.TorchTransformerReference(cfg)
    # the same number of weights (torch packs W_Q, W_K, W_V into one in_proj_weight, so compare totals),
    # and the same LayerNorms: none after a post-norm stack
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    layer_norms = lambda m: sum(isinstance(x, torch.nn.LayerNorm) for x in m.modules())
    assert layer_norms(ours) == layer_norms(ref) == 5 * cfg.N
    assert ref.generator.weight is ref.src_embed.weight is ref.tgt_embed.weight
    src, tgt = bench.make_batches(1, 4, cfg.src_vocab, 0)[0]
    loss, n = bench.reference_batch_loss(ref, src, tgt, 0.1)
    assert torch.isfinite(loss) and n == int((tgt[:, 1:] != PAD).sum())
    with pytest.raises(ValueError, match="d_k = d_v"):
        bench.TorchTransformerReference(transformer.TransformerConfig(src_vocab=10, tgt_vocab=10, d_model=32, h=2, d_k=8))


def test_make_batches_look_like_training_batches():
    a = bench.make_batches(3, 10, 100, seed=5)
    assert all(torch.equal(x, y) for p, q in zip(a, bench.make_batches(3, 10, 100, seed=5)) for x, y in zip(p, q))
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
        bench.make_batches(1, 0, 100, 0)


def test_suppressed_eos_forces_full_length_decoding():
    torch.manual_seed(0)
    model = transformer.make_model(TINY.model_config()).eval()
    with torch.no_grad():
        model.generator.bias[EOS] = 1e4  # eos is every step's most likely token
    src = bench.make_batches(1, 2, TINY.train.vocab_size, 0)[0][0]
    mask = transformer.padding_mask(src, PAD)
    assert decoding.greedy(model, src, mask, 9).size(1) == 1  # stops at once
    bench.suppress_eos(model)
    for out in (decoding.greedy(model, src, mask, 9), decoding.greedy(model, src, mask, 9, use_cache=False),
                decoding.beam_search(model, src, mask, 9, beam_size=4)):
        assert out.shape == (2, 9) and not (out == EOS).any()


def test_interleaving_and_errors_without_timing():
    calls, syncs = [], []

    def fn(name):
        return lambda: calls.append(name)

    def broken():
        raise RuntimeError("out of memory")

    fns = {"a": fn("a"), "b": fn("b"), "c": fn("c"), "bad": broken}
    times, iters, errors = bench.interleaved_times(fns, reps=3, window=1e-9, sync=lambda: syncs.append(1))
    assert set(times) == {"a", "b", "c"} and all(len(v) == 3 for v in times.values())
    assert iters == {"a": 1, "b": 1, "c": 1} and errors == {"bad": "RuntimeError: out of memory"}
    # warm-up and calibration call each once, twice; then the order rotates from round to round
    assert calls == ["a", "a", "b", "b", "c", "c"] + ["a", "b", "c"] + ["b", "c", "a"] + ["c", "a", "b"]


def test_times_are_per_call_medians_of_the_clock():
    now = [0.0]  # a fake clock: each function advances it by its cost, so the expected times are exact
    fns = {"a": lambda: now.__setitem__(0, now[0] + 0.5), "b": lambda: now.__setitem__(0, now[0] + 2.0)}
    times, iters, errors = bench.interleaved_times(fns, reps=3, window=3.0, sync=lambda: None, clock=lambda: now[0])
    assert iters == {"a": 6, "b": 2} and not errors  # calls per window: window / cost of one calibration call
    assert times == {"a": [0.5, 0.5, 0.5], "b": [2.0, 2.0, 2.0]}


def _fake(device_type, device_name, ratio, recompute_ratio, per_head_s, mfu):
    train = [{"size": "gpu", "key": "fused_sdpa", "dtype": "bf16", "compiled": False, "ratio_vs_reference": ratio,
              "step_s": 1.0, "mfu": None},
             {"size": "gpu", "key": "per_head", "dtype": "bf16", "compiled": False, "ratio_vs_reference": 0.5,
              "step_s": per_head_s, "mfu": None},
             {"size": "base", "key": "fused_sdpa", "dtype": "bf16", "compiled": True, "ratio_vs_reference": ratio,
              "step_s": 1.0, "mfu": mfu}]
    decode = [{"size": "gpu", "key": "greedy_cached", "ratio_vs_recompute": recompute_ratio}]
    meta = {"device_type": device_type, "device_name": device_name, "sizes": ["gpu", "base"]}
    return {t["target"] + " " + t["size"] + " " + t["device"]: t["status"]
            for t in bench.evaluate_targets({"meta": meta, "train": train, "decode": decode})}


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


def test_command_line_errors():
    with pytest.raises(SystemExit):
        bench.parse_args(["--sizes", "cpu,huge"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--threads", "0"])
    assert bench.parse_args(["--sizes", "cpu, base"]).sizes == ["cpu", "base"]
    with pytest.raises(ValueError, match="dtype"):
        bench.Settings(dtype="fp16")
    with pytest.raises(ValueError, match="clock"):
        bench.Settings(torch.device("cuda"), clock="cpu")  # CUDA work is timed by the wall clock


def test_module_doctests():
    failures, tried = doctest.testmod(bench)
    assert tried > 0 and failures == 0


def test_host_syncs_per_training_step_is_a_reported_figure(result):
    """`make bench` counts the synchronising operators of the real training step: none on this size."""
    h = result["host_syncs"]
    assert h["size"] == "tiny" and h["steps"] == 8 and h["per_step"] == 0, h
    assert "host syncs per training step: 0 (train.train_step, tiny size, 8 steps counted on cpu)" in \
        bench.markdown(result)


def test_compile_speedup_is_eager_over_compiled_of_the_same_run():
    rows = [{"size": "cpu", "key": k, "compiled": c, "step_s": t}
            for k, c, t in (("fused_sdpa", False, 0.30), ("fused_sdpa", True, 0.25), ("reference", False, 0.4))]
    assert bench.compile_speedups(rows) == [{"size": "cpu", "key": "fused_sdpa", "speedup": 1.2}]
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
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_report.py")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("gpu_report.py: error: no CUDA device")
    after = sorted((root / "benchmarks" / "results").glob("*")) if (root / "benchmarks" / "results").is_dir() else []
    assert after == before
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_report.py"), "--parts", "nope"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--parts 'nope'" in r.stderr, r.stderr


def test_gpu_report_reads_a_training_run_and_tabulates_it(tmp_path, monkeypatch):
    """Part (b)'s figures come from the run's results.json (steps and training seconds, beam BLEU of the
    averaged checkpoint when there is one); the table shows them. No GPU needed: the run is faked."""
    from benchmarks import gpu_report

    monkeypatch.setattr(gpu_report, "ROOT", tmp_path)
    monkeypatch.setattr(gpu_report, "run", lambda cmd, limit, log: {"command": " ".join(cmd), "code": 0,
                                                                    "timed_out": False, "wall_s": 400.0})
    run_dir = tmp_path / "runs" / "gpu-report-x-de-en"
    run_dir.mkdir(parents=True)
    beam = {"bleu": 39.5, "bleu_lowercase": 40.25}
    (run_dir / "results.json").write_text(json.dumps({
        "steps": 4200, "train_s": 300.0, "test_set": "test_2016_flickr",
        "test": {"best": {"checkpoint": "b.pt", "beam": {"bleu": 1, "bleu_lowercase": 1}},
                 "averaged": {"checkpoint": "a.pt", "beam": beam}}}))
    part = gpu_report.train_part(tmp_path, "x", "de", "en", 6.5, None)
    assert (part["steps"], part["steps_per_s"], part["bleu"], part["checkpoint"]) == (4200, 14.0, 39.5, "a.pt")
    table = gpu_report.markdown({"device": "GPU", "torch": "t", "date": "d", "train_de_en": part,
                                 "ddp": gpu_report.ddp_part(tmp_path, "x", 1)})
    assert "| train | gpu preset de->en | test BLEU 39.50 (lowercased 40.25), 4200 steps, 14.0 steps/s | 400.0 |" in table
    assert "needs two" in table
