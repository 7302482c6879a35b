"""The host-read counter (each kind of read caught and named, a planted read in a block's forward caught by its
file:line), and a training step that reads nothing on the host: the non-finite skip decided on the device leaves
weights, AdamW / Muon state and the LR schedule exactly as the host-side skip did."""

import copy
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from data_files import documents
from dist_utils import worker_env

import titanlike.training.step as step_module
from titanlike.config import load_config
from titanlike.loss import ScaledLoss, cross_entropy_loss
from titanlike.models import FLAVORS, Transformer
from titanlike.parallel.clip import plain_clip_grad_norm_
from titanlike.training.host_reads import count_host_reads
from titanlike.training.optim import build_lr_scheduler, build_optimizer
from titanlike.training.step import StepResult, train_step


def _kinds(reads):
    return [(r.kind, r.where.split(":")[1].split()[0]) for r in reads.reads]


def _line(offset=0):
    import sys

    return str(sys._getframe(1).f_lineno + offset)


def test_each_kind_of_read_is_caught_and_named():
    x = torch.randn(6)
    with count_host_reads() as reads:
        a = _line(1)
        x.sum().item(), bool(x.sum() > 0), int(x[0]), float(x[1])
        b = _line(1)
        x.tolist(), x.cpu(), x.numpy()
        c = _line(1)
        torch.nonzero(x), x[x > 0], x.masked_select(x > 0), torch.repeat_interleave(torch.tensor([1, 2]))
        y = x * 2 + 1  # no read
        y.sum().to(torch.float64)  # no read
    assert (
        _kinds(reads)
        == [("item", a)] * 4 + [("tolist", b), ("cpu", b), ("numpy", b)] + [("data-dependent shape", c)] * 4
    )
    assert all(r.where.startswith("tests/training/test_host_reads.py:") for r in reads.reads), reads.summary()
    assert torch.Tensor.tolist is not None and not hasattr(torch.Tensor.tolist, "__wrapped__")  # patches undone


def test_object_collectives_and_list_split_sizes_are_caught(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        t = torch.arange(4.0)
        with count_host_reads() as reads:
            out = [None]
            dist.all_gather_object(out, {"a": 1})
            dist.broadcast_object_list([1, 2], src=0)
            dist.all_to_all_single(torch.empty(4), t, [4], [4])  # split sizes as Python lists
            dist.all_to_all_single(torch.empty(4), t)  # even split: no read
            dist.all_reduce(t)  # no read
    finally:
        dist.destroy_process_group()
    assert [(r.kind, r.op) for r in reads.reads] == [
        ("object collective", "all_gather_object"),
        ("object collective", "broadcast_object_list"),
        ("split sizes", "all_to_all_single"),
    ], reads.summary()


def _model():
    torch.manual_seed(0)
    m = Transformer(FLAVORS["tiny"].replace(vocab_size=64)).double()
    m.init_weights()
    return m


def _loss():
    return ScaledLoss(lambda logits, labels: cross_entropy_loss(logits, labels, reduction="sum"))


def test_a_planted_item_in_a_block_is_caught_by_its_file_and_line():
    m = _model()
    block = m.layers["0"] if isinstance(m.layers, torch.nn.ModuleDict) else m.layers[0]
    forward = block.forward
    line = _line(4)

    def planted(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.abs().max().item()  # the planted read
        return out

    block.forward = planted
    x = torch.randint(0, 64, (2, 8))
    with count_host_reads() as reads:
        m(x)
    assert [(r.kind, r.where.split(":")[1].split()[0]) for r in reads.reads] == [("item", line)], reads.summary()
    assert "(planted)" in reads.reads[0].where


def _reference_step(m, opt, sched, x, loss):
    """The host-side skip the step had before: read the loss and the norm, step only when both are finite."""
    for p in m.parameters():
        p.grad = None
    out = loss(m(x), x)
    out.backward()
    norm = plain_clip_grad_norm_(list(m.parameters()), 1.0)
    if torch.isfinite(out) and torch.isfinite(norm):
        opt.step()
    sched.step()


@pytest.mark.parametrize("optimizer", ["foreach", "fused", "muon"])
def test_the_device_side_skip_leaves_what_the_host_side_skip_left(optimizer, monkeypatch):
    """Four steps, the second one's loss NaN (planted): weights, every optimizer state tensor (AdamW's step count
    included) and the learning rate equal the host-side skip's bit for bit; past the first step (Muon's plan), the
    step reads nothing on the host."""
    argv = ["--optimizer.lr", "0.01", "--training.steps", "4", "--lr_scheduler.warmup_steps", "2"]
    argv += ["--optimizer.name", "Muon"] if optimizer == "muon" else ["--optimizer.implementation", optimizer]
    cfg = load_config(argv)
    monkeypatch.setattr(step_module, "COPY_ON_CPU", True)  # the accelerator's copy-and-restore path, on this CPU
    runs = []
    for device_side in (True, False):
        m = _model()
        opt = build_optimizer([m], cfg)
        sched = build_lr_scheduler(opt, cfg)
        g = torch.Generator().manual_seed(3)
        for step in range(4):
            x = torch.randint(0, 64, (2, 8), generator=g)
            scale = float("nan") if step == 1 else 1.0
            loss = ScaledLoss(lambda lg, lb, s=scale: cross_entropy_loss(lg, lb, reduction="sum") * s)
            if not device_side:
                loss.denominator = torch.tensor(16.0, dtype=torch.float64)
                _reference_step(m, opt, sched, x, loss)
                continue
            with count_host_reads() as reads:
                r = train_step(
                    [m], opt, [(x, x)], loss, max_norm=1.0, clip_fn=plain_clip_grad_norm_, lr_scheduler=sched
                )
            assert step == 0 or not reads.reads, reads.summary()  # the first builds Muon's plan from host indices
            assert r.skipped == (step == 1)
        runs.append((m, opt, sched))
    (m, opt, sched), (m0, opt0, sched0) = runs
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m0.state_dict().values()))
    for p, p0 in zip(m.parameters(), m0.parameters()):
        s, s0 = opt.state[p], opt0.state[p0]
        assert s.keys() == s0.keys() and all(torch.equal(s[k], s0[k]) for k in s), (optimizer, s.keys())
    assert sched.last_epoch == sched0.last_epoch and opt.param_groups[0]["lr"] == opt0.param_groups[0]["lr"]


def test_on_a_cpu_a_foreach_step_reads_the_skip_flag_once():
    """Without fused AdamW on a CPU the skip is read on the host (no copy of the weights and state): one read, in
    skip_on_device, and the weights of a NaN step untouched."""
    cfg = load_config(["--optimizer.implementation", "foreach"])
    m = _model()
    opt = build_optimizer([m], cfg)
    before = [p.detach().clone() for p in m.parameters()]
    for scale in (float("nan"), 1.0):
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        loss = ScaledLoss(lambda lg, lb, s=scale: cross_entropy_loss(lg, lb, reduction="sum") * s)
        with count_host_reads() as reads:
            r = train_step([m], opt, [(x, x)], loss, max_norm=1.0, clip_fn=plain_clip_grad_norm_)
        assert [(h.kind, h.where.split("(")[-1]) for h in reads.reads] == [("item", "skip_on_device)")], reads.summary()
        if scale != scale:
            assert r.skipped and all(torch.equal(p, b) for p, b in zip(m.parameters(), before))
    assert not r.skipped and not all(torch.equal(p, b) for p, b in zip(m.parameters(), before))


def test_step_numbers_are_read_once_and_together():
    results = [StepResult(torch.tensor([float(i), 2.0, 16.0, 0.0], dtype=torch.float64)) for i in range(3)]
    with count_host_reads() as reads:
        StepResult.read_together(results)
        assert [r.loss for r in results] == [0.0, 1.0, 2.0] and results[2].tokens == 16 and not results[0].skipped
    assert [r.op for r in reads.reads] == ["Tensor.tolist"]
    assert copy.copy(results[1]).grad_norm == 2.0


WORKER = Path(__file__).with_name("host_reads_worker.py")


def _source_line(path: str, text: str) -> int:
    """The line number of the first line of titanlike/``path`` holding ``text`` (the reads are named by file:line)."""
    lines = (Path(__file__).resolve().parents[2] / "titanlike" / path).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def _expected_moe_floor(layers: int) -> Counter:
    """qwen3_moe under ep 2, per step (one microbatch): per MoE layer, the dispatch's send / receive split sizes
    (two ``tolist``), the all-to-alls of the dispatch and the combine given them as Python lists, and the grouped
    expert loop's per-expert split (one ``tolist``, in ``_split_sizes``)."""
    ep, moe = "parallel/expert_parallel.py", "models/moe.py"
    sites = [
        (
            "tolist",
            f"expert_parallel.py:{_source_line(ep, 'send = counts.view(ep, -1).sum(dim=1).tolist()')} (_dispatch)",
        ),
        ("tolist", f"expert_parallel.py:{_source_line(ep, 'recv = received.sum(dim=1).tolist()')} (_dispatch)"),
        ("split sizes", f"expert_parallel.py:{_source_line(ep, 'autograd(x, recv, send, mesh)')} (_dispatch)"),
        ("split sizes", f"expert_parallel.py:{_source_line(ep, 'autograd(out, send, recv, mesh)')} (_combine)"),
        ("tolist", f"moe.py:{_source_line(moe, 'sizes = counts.tolist()')} (_split_sizes)"),
    ]
    out: Counter = Counter()
    for layer in range(layers):
        for kind, where in sites:
            out[(kind, where, f"forward layers.{layer}.moe.experts")] += 1
    return out


def _key(read: str) -> tuple[str, str, str]:
    kind = read.split(" (")[0]
    where = read.split(" at ")[1].split(" [")[0]
    return kind, "/".join(where.split("/")[-1:]), read.split(" [")[1].rstrip("]") if " [" in read else ""


def test_the_trainer_reads_nothing_on_the_host_between_log_steps(tmp_path):
    """2 ranks, 7 steps, metrics.log_freq 10 (steps 1 and 7 log): llama under FSDP reads nothing in steps 2-5, and
    exactly the planted ``.item()`` in step 6, named by its file:line, function and module; qwen3_moe under ep 2
    reads exactly today's dispatch floor in steps 2-6 (:func:`_expected_moe_floor`), each read named."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(documents(40, seed=5)))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), "--data.path", str(corpus)],
        cwd=Path(__file__).resolve().parents[2],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    logs = "".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("*/rank*.log")))
    assert proc.returncode == 0, proc.stderr[-3000:] + logs
    for rank in (0, 1):
        llama = json.loads((tmp_path / "llama_fsdp2" / f"reads_rank{rank}.json").read_text())
        assert len(llama) == 7 and llama[1:5] == [[]] * 4, llama[1:5]
        (planted,) = llama[5]
        assert planted.startswith("item (aten._local_scalar_dense) at ") and "(planted_forward)" in planted, planted
        assert "host_reads_worker.py:" in planted and "[forward layers.0." in planted, planted
        assert llama[0] and llama[6]  # the log steps read (the step numbers, the end-of-step agreement)
        moe = json.loads((tmp_path / "qwen3_moe_ep2" / f"reads_rank{rank}.json").read_text())
        for step in range(2, 7):
            assert Counter(_key(r) for r in moe[step - 1]) == _expected_moe_floor(2), (step, moe[step - 1])
        padded = json.loads((tmp_path / "qwen3_moe_ep2_padded" / f"reads_rank{rank}.json").read_text())
        assert padded[1:6] == [[]] * 5, padded[1:6]  # the static-shape dispatch: nothing between log steps
