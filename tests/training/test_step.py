"""One optimizer step, seen directly in one process: the learning rate it uses, the loss it reports, the clipped
gradient it applies, and how accumulated batches are normalised."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from annotated.tokens import PAD
from annotated.training import data, train
from annotated.transformer import make_model, padding_mask, rate, target_mask

CPU = torch.device("cpu")
CFG = dataclasses.replace(train.PRESETS["smoke"].with_model(dropout=0.0), warmup=5, lr_factor=2.0)


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return make_model(src_vocab=60, tgt_vocab=60, N=1, d_model=32, d_ff=64, h=2, dropout=0.0, max_len=64)


def toy_batches(n_pairs: int = 48, max_tokens: int = 200, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = lambda: [
        int(t) for t in torch.randint(4, 60, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen)
    ]
    return data.make_batches([(ids(), ids()) for _ in range(n_pairs)], max_tokens, shuffle=True, seed=seed)


def applied_gradients(opt) -> list:
    """What the optimizer sees at each step: (learning rate, [gradient of each parameter])."""
    seen = []
    opt.register_step_pre_hook(
        lambda o, args, kwargs: seen.append(
            (o.param_groups[0]["lr"], [p.grad.detach().clone() for p in o.param_groups[0]["params"]])
        )
    )
    return seen


def test_the_optimizer_uses_rate_n_at_step_n():
    """Step n (counted from 1) updates with rate(n, d_model, warmup, factor), the schedule of the first
    chapter; an off-by-one (rate(s) for the scheduler's counter s = n - 1) is caught from step 2 on."""
    model = tiny_model()
    opt, sched = train.make_optimizer(model, CFG)
    seen, batches = applied_gradients(opt), toy_batches(n_pairs=96, max_tokens=100)
    for b in batches[:8]:
        train.train_step(model, opt, sched, [b], b.ntokens, CFG, CPU)
    want = [rate(n, CFG.d_model, CFG.warmup, CFG.lr_factor) for n in range(1, len(seen) + 1)]
    assert len(seen) == 8 and [lr for lr, _ in seen] == pytest.approx(want, rel=1e-12)


def test_the_cooldown_falls_linearly_to_the_last_step():
    """With cooldown 0.25 of 12 steps, steps 1-9 run at rate(n) and steps 10, 11, 12 at 3/4, 2/4, 1/4 of
    rate(9): a straight line from the rate reached towards zero, ending at the budget's last step."""
    cfg = dataclasses.replace(CFG, max_steps=12, cooldown=0.25)
    model = tiny_model()
    opt, sched = train.make_optimizer(model, cfg)
    seen, batches = applied_gradients(opt), toy_batches(n_pairs=96, max_tokens=100)
    for b in batches[:12]:
        train.train_step(model, opt, sched, [b], b.ntokens, cfg, CPU)
    paper = [rate(n, cfg.d_model, cfg.warmup, cfg.lr_factor) for n in range(1, 10)]
    want = paper + [paper[-1] * k / 4 for k in (3, 2, 1)]
    assert cfg.cooldown_steps == 3 and [lr for lr, _ in seen] == pytest.approx(want, rel=1e-12)


def test_the_step_reports_the_label_smoothed_loss_of_its_batch():
    """The summed loss a step returns is the label-smoothed cross-entropy of the batch, as
    F.cross_entropy(label_smoothing=eps) computes it, summed over its non-pad target tokens (float32 sums of a
    few hundred terms: relative 1e-5)."""
    model = tiny_model()
    b = toy_batches()[0]
    with torch.no_grad():  # (B, T-1, V), before the step changes the weights
        logits = model(b.src, b.tgt[:, :-1], padding_mask(b.src, PAD), target_mask(b.tgt[:, :-1], PAD))
    want = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        b.tgt[:, 1:].reshape(-1),
        ignore_index=PAD,
        label_smoothing=CFG.label_smoothing,
        reduction="sum",
    )
    opt, sched = train.make_optimizer(model, CFG)
    loss, tokens, _, _ = train.train_step(model, opt, sched, [b], b.ntokens, CFG, CPU)
    assert int(tokens) == b.ntokens == int((b.tgt[:, 1:] != PAD).sum())
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)


def test_a_gradient_above_clip_norm_is_applied_at_clip_norm():
    """The raw gradient's norm (returned by the step) is above clip_norm; the gradient Adam receives is the raw
    one scaled to norm clip_norm exactly (float32: relative 1e-5)."""
    cfg = dataclasses.replace(CFG, clip_norm=0.05)
    model, b = tiny_model(), toy_batches()[0]
    raw_model = copy.deepcopy(model)
    loss, n = train.batch_loss(raw_model, b.src, b.tgt, cfg.label_smoothing)
    (loss / n).backward()
    raw = [p.grad for p in raw_model.parameters()]
    raw_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in raw]))
    assert raw_norm > 10 * cfg.clip_norm
    opt, sched = train.make_optimizer(model, cfg)
    seen = applied_gradients(opt)
    _, _, gnorm, _ = train.train_step(model, opt, sched, [b], b.ntokens, cfg, CPU)
    [(_, applied)] = seen
    applied_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in applied]))
    assert gnorm.item() == pytest.approx(raw_norm.item(), rel=1e-5)
    assert applied_norm.item() == pytest.approx(cfg.clip_norm, rel=1e-5)
    for g, r in zip(applied, raw):  # the same direction: the raw gradient times clip_norm / raw norm
        torch.testing.assert_close(g, r * (cfg.clip_norm / raw_norm), rtol=1e-4, atol=1e-7)


def test_accumulated_batches_are_normalised_by_the_steps_token_count():
    """accum 2: the gradient of (L_1 + L_2) / (n_1 + n_2), every token weighing the same; not the mean of the
    two batches' own means (L_1 / n_1 + L_2 / n_2) / 2, which differs here by far more than float32 rounding
    (the batches hold different token counts)."""
    cfg = dataclasses.replace(CFG, accum=2, clip_norm=None)
    model = tiny_model()
    b1, b2 = toy_batches()[:2]
    assert b1.ntokens != b2.ntokens

    def gradient(objective):
        m = copy.deepcopy(model)
        (l1, n1), (l2, n2) = (train.batch_loss(m, b.src, b.tgt, cfg.label_smoothing) for b in (b1, b2))
        objective(l1, n1, l2, n2).backward()
        return [p.grad for p in m.parameters()]

    pooled = gradient(lambda l1, n1, l2, n2: (l1 + l2) / (n1 + n2))
    mean_of_means = gradient(lambda l1, n1, l2, n2: (l1 / n1 + l2 / n2) / 2)
    opt, sched = train.make_optimizer(model, cfg)
    seen = applied_gradients(opt)
    train.train_step(model, opt, sched, [b1, b2], train.step_tokens([b1, b2], cfg.accum)[0], cfg, CPU)
    [(_, applied)] = seen
    scale = max(g.abs().max().item() for g in pooled)
    worst = max((g - p).abs().max().item() for g, p in zip(applied, pooled))
    other = max((m - p).abs().max().item() for m, p in zip(mean_of_means, pooled))
    assert worst <= 1e-5 * scale < other / 100, (worst, other, scale)


def test_scoring_real_positions_only_gives_the_same_loss_and_gradients():
    """`Batch.real` holds exactly the flat indices of tgt[:, 1:]'s non-pad entries; `batch_loss` given them
    projects only those positions onto the vocabulary, and its loss, token count and every gradient equal those
    of scoring every position with the padding masked out (float32: the two paths run the generator's product
    over a different number of rows, so the kernels may sum in another order: relative 1e-5 on the loss, 1e-4
    of the largest gradient entry per parameter)."""
    b = toy_batches()[0]
    flat = b.tgt[:, 1:].flatten()
    assert (flat == PAD).any() and b.real.tolist() == [i for i, t in enumerate(flat.tolist()) if t != PAD]
    losses, grads = [], []
    for real in (None, b.real):
        model = tiny_model()
        loss, n = train.batch_loss(model, b.src, b.tgt, 0.1, real)
        (loss / n).backward()
        losses.append((loss.item(), int(n)))
        grads.append([p.grad for p in model.parameters()])
    assert losses[0][1] == losses[1][1] == b.ntokens
    assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-5)
    for every, only_real in zip(*grads):
        torch.testing.assert_close(only_real, every, rtol=0, atol=1e-4 * every.abs().max().item())


def accumulating_index_writes(step) -> list[str]:
    """The calls of `step()` to the CPU kernels PyTorch names nondeterministic: index_put and put_ with
    accumulate=True (the backward of `weight[tokens]` is one), which on several threads add floats with atomic
    additions, in the order the threads' timing makes (torch.use_deterministic_algorithms' notes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []
    adding = ("index_put", "index_put_", "_index_put_impl_", "put", "put_")  # (self, where, values, accumulate)

    class Calls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket.__name__ in adding and kwargs.get("accumulate", len(args) > 3 and args[3]):
                seen.append(str(func))
            return func(*args, **kwargs)

    with Calls():
        step()
    return seen


def test_a_training_step_adds_no_gradient_with_atomics():
    """A whole optimizer step (forward, backward, clipping, Adam) on the CPU calls no kernel that adds with
    atomics: the embedding tables' gradients come from F.embedding's backward, which gives each thread a block
    of rows and adds each row's gradients in the order of the tokens (annotated/transformer.py, "Embeddings").
    So two runs of a step on two threads give the same bits, which
    `test_two_processes_train_bit_identical_weights` checks over whole runs, where the race shows only when the
    two threads happen to add to one row at once."""
    model = tiny_model()
    opt, sched = train.make_optimizer(model, CFG)
    b = toy_batches()[0]
    step = lambda: train.train_step(model, opt, sched, [b], b.ntokens, CFG, CPU)
    assert accumulating_index_writes(step) == []
    indexed = lambda: model.src_embed.weight[b.src].sum().backward()  # what Embeddings did before
    assert accumulating_index_writes(indexed) == ["aten.index_put.default"]
