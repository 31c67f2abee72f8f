"""annotated/training/train.py with several processes: torchrun, DistributedDataParallel, gloo on the loopback.

Every multi-process run here is `python -m torch.distributed.run` with 2 CPU processes rendezvousing on
127.0.0.1 (port 0: the operating system picks a free one), started in its own session with a time limit;
on a timeout the launcher and every worker under it are killed, so no test leaves a process behind.

Tolerances. Two processes with DDP compute a step's gradient as ((2/N) g_0 + (2/N) g_1) / 2, one process
with accum=2 as g_0/N + g_1/N: scaling by 2 is exact in binary floating point and a sum of two terms does
not depend on their order, so on the CPU the parameters agree bit for bit (measured: max difference 0.0,
loss logs identical). The comparisons still allow rtol 1e-5 / atol 1e-6 for an all-reduce that rounds
differently (another DDP version or bucketing): float32 rounding changes a gradient element by a relative
~6e-8 per operation, and Adam's update, m / sqrt(v), then moves by about that fraction of the learning
rate (<= 0.016 in the smoke preset): ~1e-9 a step, far below atol over a dozen steps.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from annotated.checkpoint import load_checkpoint, read_checkpoint
from annotated.decoding.search import translate_ids
from annotated.training import train
from annotated.training.data import collate
from annotated.transformer import make_model

REPO = Path(__file__).resolve().parents[2]
TOL = dict(rtol=1e-5, atol=1e-6)  # see the module docstring
HAVE_PROC = Path("/proc/self/stat").exists()
STEPS = 9  # the smoke preset has 14 batches an epoch: 7 steps of 2, so step 7 ends epoch 1 (an evaluation)


# --- one step: the normalisation rule, in one process ------------------------


def test_step_tokens_counts_each_step_of_the_epoch():
    batches = [collate([([5], [6] * n)], [0]) for n in (3, 1, 4, 2, 6)]  # n + 1 predicted tokens each
    assert train.step_tokens(batches, accum=1) == [4, 2, 5, 3, 7]
    assert train.step_tokens(batches, accum=2) == [6, 8, 7]  # the last step takes what is left
    assert train.step_tokens([], accum=2) == []


# --- whole runs: torchrun with 2 processes against one process ----------------


def _descendants(pid: int) -> list[int]:
    """Every process below pid (read from Linux's /proc; none found elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if HAVE_PROC else []:
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    # torchrun starts each worker in a session of its own: kill them by pid, not by process group
    for pid in [*_descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)


def _launch(args, data_url, cache, script="train_wmt.py") -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        f"--rdzv-id={uuid.uuid4()}",
        str(script),
        "--preset",
        "smoke",
        "--data-url",
        data_url,
        "--cache-dir",
        str(cache),
        "--no-progress",
        *map(str, args),
    ]
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
        TORCH_ELASTIC_SHUTDOWN_TIMEOUT="20",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO),  # the package and train_wmt, from the checkout
    )
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        pytest.fail(f"torchrun did not finish within {timeout} s; killed it and its workers")
    return proc.returncode, out


def torchrun(*args, data_url, cache, timeout=120) -> str:
    """Run train_wmt.py under torchrun with 2 processes; its output (the test fails if it fails)."""
    code, out = _finish(_launch(args, data_url, cache), timeout)
    assert code == 0, out[-3000:]
    return out


def single(run_dir: Path, data_url, cache, resume=False, **overrides) -> None:
    cfg = dataclasses.replace(train.PRESETS["smoke"], **{"log_every": 1, **overrides})  # a log row per step
    train.train(
        cfg, run_dir, source=train.DataSource(data_url, cache), resume=resume, progress=False, log=lambda s: None
    )


def params(path: Path) -> dict:
    return read_checkpoint(path)["model"]


# The key biases: a softmax row is unchanged by adding q . b_K to every score in it, so their gradient is zero in
# exact arithmetic and only rounding noise in floats, which Adam scales up to steps of the learning rate's size.
# Their values follow the order of the rounding (the kernels, the threads, the buffers' alignment), not the
# training, so they are left out of the comparison; every weight that changes a model's output is in it.
ROUNDING_ONLY = (".b_K",)


def assert_same_params(a: Path, b: Path) -> float:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    pa = {k: v for k, v in pa.items() if not k.endswith(ROUNDING_ONLY)}
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], **TOL, msg=lambda m: f"{k}: {m}")
    return max((pa[k].float() - pb[k].float()).abs().max().item() for k in pa)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [line.split("\t") for line in (run_dir / "train_loss.tsv").read_text().splitlines()]
    return [(int(step), float(loss)) for step, loss in rows]


def assert_same_losses(a: Path, b: Path) -> None:
    la, lb = losses(a), losses(b)
    assert [s for s, _ in la] == [s for s, _ in lb]
    for (_, x), (_, y) in zip(la, lb):
        assert abs(x - y) <= 1e-5 * abs(y)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_url, cache):
    """STEPS steps of the smoke preset: 2 processes (accum 1), and 1 process with accum 2.

    Returns (runs directory, torchrun's output, [(parameters, gradient) just before each Adam step of the
    1-process run]).
    """
    root = tmp_path_factory.mktemp("runs")
    out = torchrun("--max-steps", STEPS, "--log-every", 1, "--run-dir", root / "ddp", data_url=data_url, cache=cache)
    recorded = []
    make_optimizer = train.make_optimizer

    def recording(model, cfg):
        opt, sched = make_optimizer(model, cfg)
        opt.register_step_pre_hook(
            lambda o, args, kwargs: recorded.append(
                [(p.detach().clone(), p.grad.detach().clone()) for p in o.param_groups[0]["params"]]
            )
        )
        return opt, sched

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "make_optimizer", recording)
        single(root / "one", data_url, cache, accum=2, max_steps=STEPS)
    assert len(recorded) == STEPS
    return root, out, recorded


def test_each_step_applies_the_gradient_of_the_union_of_the_two_shards(runs, data_url, cache):
    """The gradient train() applies at step s (accum 2, so also 2 processes: next test) is that of one
    batch holding both ranks' batch s, loss summed over its tokens and divided by their number.

    The union batch pads every row to its longest; padded positions are masked out of attention and loss,
    so only float32 rounding differs: sums of a few thousand terms, relative ~1e-6 of the gradient's
    scale (measured <= 1.1e-6). Averaging each batch's own mean instead (the rule we do not use) misses
    by >= 1e-3 of the scale on these batches.
    """
    from annotated.training import data

    _, _, recorded = runs
    cfg = train.PRESETS["smoke"]
    tokenizer, pairs, _, _ = train.prepare_data(cfg, train.DataSource(data_url, cache))
    encoded = data.encode_pairs(pairs, tokenizer)
    encoded = [encoded[i] for i in data.split_long(encoded, cfg.max_len)[0]]
    model = make_model(cfg.model_for(tokenizer.vocab_size))
    epoch, steps_left = -1, []
    for s, step in enumerate(recorded):
        if not steps_left:  # the next epoch: (rank 0's batch, rank 1's batch) of each step
            epoch += 1
            steps_left = list(
                zip(
                    *[
                        data.make_batches(
                            encoded, cfg.max_tokens, shuffle=True, seed=cfg.seed + epoch, rank=r, world_size=2
                        )
                        for r in (0, 1)
                    ]
                )
            )
        union = collate(encoded, [i for b in steps_left.pop(0) for i in b.index.tolist()])
        with torch.no_grad():
            for p, (value, _) in zip(model.parameters(), step):
                p.copy_(value)
        model.zero_grad()
        loss, n = train.batch_loss(model, union.src, union.tgt, cfg.label_smoothing)
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
        scale = max(p.grad.abs().max().item() for p in model.parameters())
        worst = max((p.grad - g).abs().max().item() for p, (_, g) in zip(model.parameters(), step))
        assert worst <= 1e-5 * scale, f"step {s + 1}: gradients differ by {worst:.3g}, scale {scale:.3g}"


def test_ddp_run_equals_single_process_with_accumulation(runs):
    root, _, _ = runs
    diff = assert_same_params(root / "ddp" / "last.pt", root / "one" / "last.pt")
    assert_same_params(root / "ddp" / "best.pt", root / "one" / "best.pt")  # written at the end of epoch 1
    assert_same_losses(root / "ddp", root / "one")  # rank 0 logs the loss of the whole step, all ranks
    print(f"largest parameter difference after {STEPS} steps: {diff:.3g}")
    ddp, one = (read_checkpoint(root / r / "last.pt")["run_state"] for r in ("ddp", "one"))
    assert (ddp["world_size"], ddp["batch_in_epoch"], one["world_size"], one["batch_in_epoch"]) == (2, 2, 1, 4)
    assert ddp["step"] == one["step"] == STEPS and ddp["epoch"] == one["epoch"] == 1


def test_only_rank_0_writes_and_its_checkpoints_load_in_one_process(runs):
    root, out, _ = runs
    run = root / "ddp"
    results = json.loads((run / "results.json").read_text())
    assert results["test"]["best"]["beam"]["sentences"] == 20
    log = (run / "train.log").read_text()
    assert log.count("world size 2") == 1 and log.count("epoch   1 step      7") == 1  # one writer
    assert out.count("world size 2") == 1  # and one printer
    assert [s for s, _ in losses(run)] == list(range(1, STEPS + 1))
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]
    model, tok, meta = load_checkpoint(run / "best.pt")
    assert not any(k.startswith("module.") for k in model.state_dict())
    assert meta["epoch"] == 1 and tok.vocab_size == model.config.src_vocab
    [hyp] = translate_ids(model, [tok.encode("Ein Hund läuft.")], beam_size=1)
    assert len(hyp) <= model.config.max_len


def test_distributed_checkpoint_resumes_in_one_process(runs, data_url, cache):
    """Resume both step-9 runs in one process to step 12: the same batches and states, the same result.

    last.pt of the 2-process run says 2 batches per rank are done; one process continues at batch 4.
    """
    root, _, _ = runs
    for name in ("ddp", "one"):
        shutil.copytree(root / name, root / f"{name}-then-one")
        single(root / f"{name}-then-one", data_url, cache, resume=True, accum=2, max_steps=STEPS + 3)
    assert_same_params(root / "ddp-then-one" / "last.pt", root / "one-then-one" / "last.pt")
    assert_same_losses(root / "ddp-then-one", root / "one-then-one")
    assert read_checkpoint(root / "ddp-then-one" / "last.pt")["run_state"]["world_size"] == 1


def test_single_process_checkpoint_resumes_under_torchrun_with_accumulation(tmp_path, data_url, cache):
    """2 steps in one process with accum 4, then 2 processes with accum 2 (DDP's no_sync on each step's
    first batch) to step 6: the same as one process with accum 4 all along.

    The resumed run continues after 8 batches, 4 per rank. It sums each step's 4 gradients in another
    order ((g0 + g2) + (g1 + g3) against ((g0 + g1) + g2) + g3), so last bits differ. That is harmless
    except in the key biases b_K: their exact gradient is zero (adding the same q . b_K to every score of a
    query changes no softmax), so all they receive is rounding noise, and Adam, which divides by the
    gradient's own size, turns noise into steps of about the learning rate (measured: 8e-3 apart after 6
    steps, every other parameter <= 1.4e-7). They are left out; all other parameters agree within TOL, and
    every step's loss within 1e-5 relative.
    """
    single(tmp_path / "one", data_url, cache, accum=4, max_steps=6)
    run = tmp_path / "one-then-ddp"
    single(run, data_url, cache, accum=4, max_steps=2)
    out = torchrun(
        "--resume", "--run-dir", run, "--accum", 2, "--max-steps", 6, "--log-every", 1, data_url=data_url, cache=cache
    )
    assert "written by 1 process(es), this run has 2" in out and "resumed" in out
    assert_same_losses(run, tmp_path / "one")
    ddp, one = params(run / "last.pt"), params(tmp_path / "one" / "last.pt")
    compared = [k for k in ddp if not k.endswith(".b_K")]
    assert len(ddp) - len(compared) == 3  # encoder self-, decoder self- and cross-attention
    for k in compared:
        torch.testing.assert_close(ddp[k], one[k], **TOL, msg=lambda m: f"{k}: {m}")
    assert read_checkpoint(run / "last.pt")["run_state"]["world_size"] == 2


def test_failure_on_rank_0_stops_every_rank(tmp_path, data_url, cache):
    """--resume without a checkpoint: rank 0 fails to read it, rank 1 is told so; both exit, nothing hangs."""
    code, out = _finish(_launch(["--resume", "--run-dir", tmp_path / "none"], data_url, cache), timeout=90)
    assert code != 0
    assert "last.pt: no such file" in out and "stopped because rank 0 failed" in out


def _worker(proc: subprocess.Popen, rank: int) -> int:
    for pid in _descendants(proc.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    raise LookupError(f"no worker of rank {rank} under torchrun (pid {proc.pid})")


@pytest.mark.skipif(not HAVE_PROC, reason="finds rank 1's process through Linux's /proc")
def test_ctrl_c_on_one_rank_stops_all_ranks_at_one_step_and_saves(tmp_path, data_url, cache):
    """torchrun forwards Ctrl-C to every worker, and each may see it at another step. The extreme case:
    only rank 1 gets SIGINT. All ranks must still stop after the same step, and rank 0 save it."""
    run = tmp_path / "run"
    proc = _launch(["--max-steps", 100000, "--log-every", 2, "--run-dir", run], data_url, cache)
    deadline = time.monotonic() + 90
    while not ((run / "train_loss.tsv").exists() and len(losses(run)) >= 3):
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_tree(proc)
            pytest.fail(f"no training steps logged: {proc.communicate()[0][-3000:]}")
        time.sleep(0.1)
    os.kill(_worker(proc, 1), signal.SIGINT)
    code, out = _finish(proc, timeout=60)
    assert "interrupted: saved" in out, out[-3000:]
    state = read_checkpoint(run / "last.pt")["run_state"]
    assert state["world_size"] == 2 and state["step"] == losses(run)[-1][0]
    assert code != 0  # the workers exit with 130 (stopped by a signal), which torchrun reports as a failure


# Rank 1's loss becomes NaN at its 3rd training batch of epoch 2; rank 0's stays finite.
POISON_RANK_1 = """
import os, sys
from annotated.training import train
import train_wmt

batch_loss, seen = train.batch_loss, []

def poisoned(model, src, tgt, eps, real=None):
    loss, n = batch_loss(model, src, tgt, eps, real)
    if model.training and os.environ["RANK"] == "1" and os.path.exists({last!r}):
        seen.append(1)
        if len(seen) == 3:
            return loss * float("nan"), n
    return loss, n

train.batch_loss = poisoned
sys.exit(train_wmt.main())
"""


def test_non_finite_loss_on_one_rank_stops_every_rank_at_that_step(tmp_path, data_url, cache):
    """Only rank 1 sees a NaN loss. Both ranks must skip that update and stop together at the next read,
    each saying why (no rank left waiting in an all-reduce), with epoch 1's last.pt untouched."""
    run = tmp_path / "run"
    script = tmp_path / "poison_rank_1.py"
    script.write_text(POISON_RANK_1.format(last=str(run / "last.pt")))
    code, out = _finish(
        _launch(["--epochs", 3, "--log-every", 4, "--run-dir", run], data_url, cache, script=script), timeout=120
    )
    saved = read_checkpoint(run / "last.pt")["run_state"]
    E = saved["step"]  # steps of epoch 1 (7), all saved in last.pt
    assert code != 0 and saved["epoch"] == 1 and E == 7, out[-3000:]
    # the all-reduced gradient is NaN on both ranks: both skip step E + 3 and stop at the next read (step 12)
    message = (
        f"error: the loss became nan at step {E + 3} (epoch 2); 1 step(s) with a non-finite loss or gradient "
        f"were skipped; stopped at step 12, the last good checkpoint {run / 'last.pt'} is kept"
    )
    assert out.count(message) == 2, out[-3000:]
    assert [s for s, _ in losses(run)] == [4, 7, 8]
    assert "TrainingError" not in out, out[-3000:]  # our error is a message; torchrun's own report follows it
