"""LR schedules, and gradient accumulation equal to one big batch (the global-token loss contract)."""

import copy
import math

import pytest
import torch

from titanlike.config import load_config
from titanlike.loss import IGNORE_INDEX, ScaledLoss, cross_entropy_loss
from titanlike.models import FLAVORS, Transformer
from titanlike.parallel.clip import plain_clip_grad_norm_
from titanlike.training.optim import build_lr_scheduler, build_optimizer, lr_factor
from titanlike.training.step import train_step


def cfg_for(*argv):
    return load_config(list(argv))


def torchtitan_lambda(i, total, warmup, ratio, kind, floor):
    """torchtitan v0.2.2's linear_warmup_stable_decay (components/lr_scheduler.py), written out from its formula."""
    warmup = min(warmup, total)
    decay = total - warmup if ratio is None else min(round(total * ratio), total - warmup)
    stable = total + 1 - warmup - decay
    if i < warmup:
        return (i + 1) / warmup
    if i < warmup + stable:
        return 1.0
    p = (i + 1 - warmup - stable) / decay
    adj = {"linear": 1 - p, "sqrt": 1 - math.sqrt(p), "cosine": 0.5 * (1 + math.cos(math.pi * p))}[kind]
    return floor + (1 - floor) * adj


@pytest.mark.parametrize("decay", ["cosine", "linear", "sqrt"])
@pytest.mark.parametrize("ratio", [None, 0.2, 0.8])
def test_lr_schedule_is_torchtitans(decay, ratio):
    extra = ["--lr_scheduler.decay_ratio", str(ratio)] if ratio is not None else []
    cfg = cfg_for(
        "--training.steps",
        "100",
        "--lr_scheduler.warmup_steps",
        "10",
        "--lr_scheduler.decay_type",
        decay,
        "--lr_scheduler.min_lr_factor",
        "0.1",
        *extra,
    )
    f = [lr_factor(s, cfg) for s in range(1, 101)]
    assert f == pytest.approx([torchtitan_lambda(i, 100, 10, ratio, decay, 0.1) for i in range(100)], abs=1e-15)
    assert f[0] == pytest.approx(0.1) and f[9] == 1.0  # linear warmup: step s gets s / warmup
    stable_until = 10 if ratio is None else 100 - round(100 * ratio)  # warmup -> stable -> decay, any decay type
    assert f[9 : stable_until + 1] == [1.0] * (stable_until - 8) and f[stable_until + 1] < 1.0
    assert all(a >= b - 1e-12 for a, b in zip(f[10:], f[11:]))  # monotone decay towards min_lr_factor
    assert 0.1 < f[-1] < 0.2


def test_lr_schedule_wsd_constant_and_the_debug_file_case():
    # torchtitan's debug file (warmup 2, decay_ratio 0.8, linear) run for 100 steps: stable at step 20.
    cfg = cfg_for(
        "--training.steps",
        "100",
        "--lr_scheduler.warmup_steps",
        "2",
        "--lr_scheduler.decay_ratio",
        "0.8",
        "--lr_scheduler.decay_type",
        "cosine",
    )
    assert lr_factor(20, cfg) == 1.0 and lr_factor(22, cfg) < 1.0
    wsd = cfg_for("--training.steps", "100", "--lr_scheduler.warmup_steps", "10", "--lr_scheduler.decay_type", "wsd")
    assert [lr_factor(s, wsd) for s in range(1, 101)] == pytest.approx(
        [torchtitan_lambda(i, 100, 10, 0.2, "linear", 0.0) for i in range(100)]
    )
    const = cfg_for(
        "--training.steps", "50", "--lr_scheduler.warmup_steps", "5", "--lr_scheduler.decay_type", "constant"
    )
    assert [lr_factor(s, const) for s in range(5, 51)] == [1.0] * 46
    # total_steps shorter than the run: the factor stays at min_lr_factor afterwards
    longer = cfg_for(
        "--training.steps",
        "30",
        "--lr_scheduler.total_steps",
        "20",
        "--lr_scheduler.warmup_steps",
        "2",
        "--lr_scheduler.min_lr_factor",
        "0.25",
    )
    assert lr_factor(25, longer) == 0.25 and lr_factor(30, longer) == 0.25


def test_lr_scheduler_drives_the_optimizer():
    cfg = cfg_for("--training.steps", "10", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "1.0")
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer([model], cfg)
    sched = build_lr_scheduler(opt, cfg)
    seen = []
    for _ in range(1, 11):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_factor(s, cfg) for s in range(1, 11)])
    # no weight decay on 1-D parameters (biases, norm weights)
    assert [g["weight_decay"] for g in opt.param_groups] == [cfg.optimizer.weight_decay, 0.0]


def test_the_step_result_carries_the_rate_its_update_used():
    """StepResult.lr is the rate optimizer.step() ran with (read by a step pre-hook), not the scheduler's next one
    (which the trainer logged before: every logged lr was one step ahead)."""
    cfg = cfg_for("--training.steps", "6", "--lr_scheduler.warmup_steps", "3", "--optimizer.lr", "0.01")
    m = _model()
    opt = build_optimizer([m], cfg)
    sched = build_lr_scheduler(opt, cfg)
    used = []
    opt.register_step_pre_hook(lambda o, args, kwargs: used.append(o.param_groups[0]["lr"]))
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    logged = []
    for _ in range(6):
        r = train_step(
            [m], opt, [(x[:, :-1], x[:, 1:])], _loss(), max_norm=1.0, clip_fn=plain_clip_grad_norm_, lr_scheduler=sched
        )
        logged.append(r.lr)
    assert logged == used == pytest.approx([0.01 * lr_factor(s, cfg) for s in range(1, 7)])
    assert logged[:3] == pytest.approx([0.01 / 3, 0.02 / 3, 0.01])  # warmup: step s uses s / warmup


def _model():
    torch.manual_seed(0)
    m = Transformer(FLAVORS["tiny"].replace(vocab_size=64)).double()
    m.init_weights()
    return m


def _loss():
    return ScaledLoss(lambda logits, labels: cross_entropy_loss(logits, labels, reduction="sum"))


def test_gradient_accumulation_equals_one_big_batch():
    cfg = cfg_for("--training.steps", "3", "--optimizer.lr", "0.01")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (8, 17), generator=g) for _ in range(3)]
    big, acc = _model(), _model()
    opt_big, opt_acc = build_optimizer([big], cfg), build_optimizer([acc], cfg)
    for b in batches:
        x, y = b[:, :-1], b[:, 1:].clone()
        y[0, :5] = IGNORE_INDEX  # uneven token counts across micro-batches: a mean of means would be wrong
        r1 = train_step([big], opt_big, [(x, y)], _loss(), max_norm=0.5, clip_fn=plain_clip_grad_norm_)
        micro = [(x[i : i + 2], y[i : i + 2]) for i in range(0, 8, 2)]
        r2 = train_step([acc], opt_acc, micro, _loss(), max_norm=0.5, clip_fn=plain_clip_grad_norm_)
        assert abs(r1.loss - r2.loss) <= 1e-12 and abs(r1.grad_norm - r2.grad_norm) <= 1e-12
        assert r1.tokens == r2.tokens == 8 * 16 - 5
        for (n, p), q in zip(big.named_parameters(), acc.parameters()):
            assert (p.grad - q.grad).abs().max() <= 1e-12, n
            assert (p - q).abs().max() <= 1e-12, n


def test_mean_of_means_is_caught():
    """The accumulation test can fail: averaging per micro-batch (the classic bug) changes the update."""
    cfg = cfg_for("--optimizer.lr", "0.01")
    g = torch.Generator().manual_seed(2)
    b = torch.randint(0, 64, (8, 17), generator=g)
    x, y = b[:, :-1], b[:, 1:].clone()
    y[0, :9] = IGNORE_INDEX
    big, acc = _model(), _model()
    train_step([big], build_optimizer([big], cfg), [(x, y)], _loss(), max_norm=0, clip_fn=plain_clip_grad_norm_)
    wrong = ScaledLoss(lambda lg, lb: cross_entropy_loss(lg, lb, reduction="mean") / 4)
    micro = [(x[i : i + 2], y[i : i + 2]) for i in range(0, 8, 2)]
    train_step([acc], build_optimizer([acc], cfg), micro, wrong, max_norm=0, clip_fn=plain_clip_grad_norm_)
    assert max((p.grad - q.grad).abs().max() for p, q in zip(big.parameters(), acc.parameters())) > 1e-6


def test_nonfinite_step_is_skipped():
    cfg = cfg_for()
    m = _model()
    before = copy.deepcopy(m.state_dict())
    opt = build_optimizer([m], cfg)
    x = torch.randint(0, 64, (2, 8))
    nan_loss = ScaledLoss(lambda lg, lb: cross_entropy_loss(lg, lb, reduction="sum") * float("nan"))
    r = train_step([m], opt, [(x, x)], nan_loss, max_norm=1.0, clip_fn=plain_clip_grad_norm_)
    assert r.skipped and not math.isfinite(r.loss)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_clip_scales_like_torch_without_a_copy_per_gradient(dtype):
    """titanlike's clip_grad_norm_ scales exactly as torch.nn.utils.clip_grads_with_norm_ does, but hands the
    foreach kernel a coefficient of the gradients' dtype (float32/64): no dtype-converting copy per gradient."""
    from torch.profiler import profile

    from titanlike.parallel.clip import clip_grad_norm_

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.zeros(37, 13, dtype=dtype)) for _ in range(9)]
    for p in ps:
        p.grad = torch.randn(37, 13, dtype=dtype) * 3
    qs = [torch.nn.Parameter(torch.zeros_like(p)) for p in ps]
    for p, q in zip(ps, qs):
        q.grad = p.grad.clone()
    with profile() as prof:
        norm = clip_grad_norm_(ps, 1.0)
    torch.nn.utils.clip_grads_with_norm_(qs, 1.0, norm)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ps, qs))
    copies = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
    if dtype != torch.bfloat16:
        assert copies <= 3, copies  # the norm's float64 accumulation and the one coefficient cast, not 9+
