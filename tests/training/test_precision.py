"""--precision: the rule that picks fp32 or bf16 (annotated/plumbing/devices.py), and a bf16 step on the CPU."""

import copy
import dataclasses

import pytest
import torch

import train_wmt
from annotated.plumbing import devices
from annotated.training import data, train
from annotated.transformer import make_model

CPU = torch.device("cpu")


@pytest.fixture
def avx512_torch(monkeypatch):
    """A torch that runs AVX512 kernels, whatever this machine's torch does: the rule reads the flags alone."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")


def test_auto_is_bf16_only_where_the_cpu_has_bf16_instructions(avx512_torch):
    for flags in ({"avx512_bf16"}, {"amx_bf16", "avx512f"}):
        assert devices.resolve_precision("auto", CPU, flags=frozenset(flags))[0] == "bf16"
    for flags in (set(), {"avx2", "avx512f", "avx512_vnni"}):
        precision, reason = devices.resolve_precision("auto", CPU, flags=frozenset(flags))
        assert precision == "fp32" and "no bf16 instructions" in reason


def test_auto_is_fp32_on_a_torch_without_avx512_kernels(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert devices.resolve_precision("auto", CPU, flags=frozenset({"avx512_bf16"}))[0] == "fp32"


def test_fp32_when_asked_and_bf16_refused_where_unsupported(avx512_torch):
    assert devices.resolve_precision("fp32", CPU, flags=frozenset({"avx512_bf16"})) == (
        "fp32",
        "fp32 as set (by --precision or the preset)",
    )
    with pytest.raises(
        ValueError,
        match=r"--precision bf16: this CPU has no bf16 instructions .*use "
        "--precision fp32 or auto",
    ):
        devices.resolve_precision("bf16", CPU, flags=frozenset({"avx2"}))
    with pytest.raises(ValueError, match="precision must be auto, fp32 or bf16, got 'fp16'"):
        devices.resolve_precision("fp16", CPU)


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    )
    assert devices.cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert devices.cpu_flags(tmp_path / "absent") == frozenset()


def test_bf16_on_a_cpu_without_it_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset({"avx2"}))
    code = train_wmt.main(
        [
            "--preset",
            "smoke",
            "--precision",
            "bf16",
            "--run-dir",
            str(tmp_path / "run"),
            "--data-url",
            "file:///nonexistent/",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--precision bf16: this CPU has no bf16 instructions" in err, err
    assert not (tmp_path / "run").exists()


def test_the_run_log_and_print_config_name_precision_and_threads(capsys):
    assert train_wmt.main(["--preset", "smoke", "--print-config", "--threads", "1", "--precision", "fp32"]) == 0
    shown = capsys.readouterr().out
    assert (
        '"precision": "fp32"' in shown and '"precision_reason": "fp32 as set (by --precision or the preset)"' in shown
    )
    assert '"threads": 1' in shown


def toy_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = lambda: [
        int(t) for t in torch.randint(4, 60, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen)
    ]
    return data.make_batches([(ids(), ids()) for _ in range(32)], 400)[0]


@pytest.mark.parametrize("seed", [0, 3, 4])
def test_a_bf16_step_on_the_cpu_gives_the_fp32_loss_to_bf16_rounding(seed):
    """The same step (same weights, same batch) in fp32 and under bf16 autocast. The loss comes back in fp32 in
    both, finite, and differs (bf16 did run) by less than 2^-9 of its value: one bf16 rounding of the loss
    itself. Each bf16 input carries a relative error up to 2^-9, but the loss is a mean over a few hundred
    tokens whose errors partly cancel; measured: at most 2.2e-4 relative over seeds 0-4. The parameters and
    Adam's moments stay fp32."""
    cfg = train.PRESETS["smoke"].with_model(dropout=0.0)
    torch.manual_seed(seed)
    model = make_model(src_vocab=60, tgt_vocab=60, N=2, d_model=64, d_ff=128, h=4, dropout=0.0, max_len=64)
    batch, losses = toy_batch(seed), {}
    for precision in ("fp32", "bf16"):
        m = copy.deepcopy(model)
        opt, sched = train.make_optimizer(m, cfg)
        loss, n, _, found_inf = train.train_step(m, opt, sched, [batch], batch.ntokens, cfg, CPU, precision=precision)
        assert loss.dtype == torch.float32 and torch.isfinite(loss) and found_inf == 0
        assert all(p.dtype == torch.float32 for p in m.parameters())
        assert all(v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items() if k != "step")
        losses[precision] = loss.item() / n.item()
    assert losses["bf16"] != losses["fp32"]
    assert abs(losses["bf16"] - losses["fp32"]) <= 2**-9 * losses["fp32"], losses


def test_the_loss_is_fp32_under_bf16_autocast():
    """Under autocast the logits come out in bf16; label_smoothed_loss takes the log-softmax in fp32."""
    model = make_model(src_vocab=60, tgt_vocab=60, N=1, d_model=32, d_ff=64, h=2, dropout=0.0, max_len=64)
    batch = toy_batch(0)
    with devices.autocast(CPU, "bf16"):
        logits = model(batch.src, batch.tgt[:, :-1], None, None)
        loss, _ = train.batch_loss(model, batch.src, batch.tgt, 0.1)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert dataclasses.replace(train.PRESETS["smoke"]).precision == "fp32"  # the tests' preset: the same on every CPU


def test_threads_default_to_every_core_shared_among_torchruns_processes(monkeypatch):
    monkeypatch.setattr(devices, "all_cores", lambda: 16)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert devices.default_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert devices.default_threads() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert devices.default_threads() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert devices.default_threads() == 1


@pytest.mark.parametrize(
    "gpu, capability, expected",
    [
        ("Tesla T4", (7, 5), "fp32"),
        ("Tesla V100", (7, 0), "fp32"),
        ("NVIDIA A100", (8, 0), "bf16"),
        ("NVIDIA H100", (9, 0), "bf16"),
    ],
)
def test_auto_on_a_gpu_is_bf16_only_where_it_multiplies_bf16_in_hardware(gpu, capability, expected, monkeypatch):
    """A faked CUDA device: torch's own `is_bf16_supported()` says True on all four (emulation counts), so it
    cannot be the rule; `bf16` on a T4 or V100 is refused, naming the GPU and the reason."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    cuda = torch.device("cuda")
    assert devices.resolve_precision("auto", cuda)[0] == expected
    assert devices.resolve_precision("fp32", cuda)[0] == "fp32"
    if expected == "fp32":
        with pytest.raises(ValueError, match=f"{gpu} has no bf16.*use fp32"):
            devices.resolve_precision("bf16", cuda)
    else:
        assert devices.resolve_precision("bf16", cuda)[0] == "bf16"
