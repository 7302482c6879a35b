"""Muon on one device: torch.optim.Muon + torch.optim.AdamW for the split the model declares, fused projections per
chunk, stacked experts per expert, the split itself, the configuration (rules, torchtitan / Megatron names) and the
checkpoint's record of the optimizer. The distributed layouts are in the float64 gate (tests/parallel/gate.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from titanlike.config import ConfigError, load_config, model_args_from_config, parse_config
from titanlike.loss import ScaledLoss, cross_entropy_loss
from titanlike.models import get_spec
from titanlike.parallel.clip import plain_clip_grad_norm_
from titanlike.parallel.muon import Muon, muon_matrices, newton_schulz
from titanlike.sharding import Colwise, FusedColwise, Rowwise, stacked_matrices
from titanlike.training.optim import build_lr_scheduler, build_optimizer
from titanlike.training.step import train_step

VOCAB = 128


def _cfg(*argv: str):
    return load_config(["--model.flavor", "tiny", "--training.seq_len", "16", "--training.dtype", "float64", *argv])


def _model(cfg) -> nn.Module:
    model = get_spec(cfg.model.name).build(model_args_from_config(cfg, vocab_size=VOCAB)).double()
    model.init_weights(seed=0)
    return model


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (4, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model, opt, steps=3, sched=None):
    for step in range(1, steps + 1):
        train_step(
            [model],
            opt,
            [_batch(step)],
            ScaledLoss(lambda out, y: cross_entropy_loss(out, y, reduction="sum")),
            max_norm=0.05,
            clip_fn=plain_clip_grad_norm_,
            lr_scheduler=sched,
        )


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize(
    "extra",
    [
        (),  # torch's defaults: Nesterov, adjust_lr_fn original, bfloat16 Newton-Schulz
        ("--optimizer.nesterov", "false", "--optimizer.adjust_lr_fn", "match_rms_adamw", "--optimizer.ns_steps", "3"),
    ],
    ids=["defaults", "plain_momentum_rms"],
)
def test_one_device_muon_is_torch_muon_plus_adamw_for_the_split(extra):
    """The trainer's optimizer (build_optimizer) with the LR schedule, float64, 3 steps with clipping: every weight
    equals torch.optim.Muon on the block matrices + torch.optim.AdamW on the rest (decay on the embedding and
    head, none on the norms), to 1e-12 (it is bitwise equal)."""
    cfg = _cfg(
        "--optimizer.name",
        "Muon",
        "--optimizer.lr",
        "0.02",
        "--optimizer.adamw_lr",
        "0.003",
        "--optimizer.adamw_weight_decay",
        "0.05",
        "--lr_scheduler.warmup_steps",
        "2",
        *extra,
    )
    ours = _model(cfg)
    ref = copy.deepcopy(ours)
    opt = build_optimizer([ours], cfg)
    _train(ours, opt, sched=build_lr_scheduler(opt, cfg))

    o = cfg.optimizer
    names = {n for n, p in ref.named_parameters() if n.startswith("layers.") and n.endswith("weight") and p.ndim == 2}
    mats = [p for n, p in ref.named_parameters() if n in names]
    rest = [p for n, p in ref.named_parameters() if n not in names]
    muon = torch.optim.Muon(
        mats,
        lr=o.lr,
        weight_decay=o.weight_decay,
        momentum=o.momentum,
        nesterov=o.nesterov,
        ns_steps=o.ns_steps,
        adjust_lr_fn=o.adjust_lr_fn,
    )
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.ndim >= 2], "weight_decay": 0.05},
            {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=0.003,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        foreach=True,
    )

    class Both(torch.optim.Optimizer):  # one object for the LR schedule, torch's two optimizers inside
        def __init__(self):
            super().__init__(mats, {})
            self.param_groups = muon.param_groups + adamw.param_groups

        def step(self, closure=None):
            muon.step()
            adamw.step()

    both = Both()
    _train(ref, both, sched=build_lr_scheduler(both, cfg))
    assert len(names) == 14 and {id(p) for p in mats} == {id(p) for p in ref.parameters() if p.ndim == 2} - {
        id(ref.tok_embeddings.weight),
        id(ref.output.weight),
    }
    assert _max_diff(ours, ref) <= 1e-12
    assert _max_diff(ours, _model(cfg)) > 1e-4  # it trained


def test_newton_schulz_is_torchs_bit_for_bit():
    """Our Newton-Schulz in bfloat16 is torch.optim.Muon's (square, tall and wide matrices); in float64 it is the
    same iteration, closer to the exact polar factor's scale."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.Generator().manual_seed(0)
    for shape in [(16, 16), (48, 16), (16, 40)]:
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        theirs = _zeropower_via_newtonschulz(x, (3.4445, -4.775, 2.0315), 5, 1e-7)
        assert torch.equal(newton_schulz(x), theirs)
        exact = newton_schulz(x, dtype=torch.float64)
        assert exact.dtype == torch.float64 and (exact - theirs.double()).abs().max() < 0.05


def test_a_fused_projection_is_orthogonalized_per_chunk_like_separate_matrices():
    """GPT-2's c_attn (q|k|v in one Linear): Muon's update of it equals torch.optim.Muon on q, k and v as three
    separate matrices; orthogonalizing the fused (3 dim x dim) matrix is a different update."""
    cfg = _cfg("--model.name", "gpt2")
    model = _model(cfg)
    inputs, labels = _batch(1)
    cross_entropy_loss(model(inputs), labels, reduction="sum").backward()
    weight = model.layers["0"].attn.c_attn.weight
    before, grad = weight.detach().clone(), weight.grad.clone()
    mats = muon_matrices([model])
    d = model.args.dim
    assert mats[weight] == (((0, d), (0, d)), ((d, 2 * d), (0, d)), ((2 * d, 3 * d), (0, d)))
    Muon([p for p in model.parameters() if p in mats], matrices=mats, lr=0.02).step()

    def torch_muon(weights, grads):
        params = [nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        torch.optim.Muon(params, lr=0.02).step()
        return torch.cat([p.detach() for p in params])

    assert (weight.detach() - torch_muon(before.chunk(3), grad.chunk(3))).abs().max() <= 1e-12
    assert (weight.detach() - torch_muon([before], [grad])).abs().max() > 1e-4


def test_stacked_expert_weights_are_orthogonalized_per_expert():
    """The mixture-of-experts hook: a user's module whose expert weights are stacked (experts, out, in), declared
    with the sharding vocabulary (an entry returning stacked_matrices), trains each expert's matrix like
    torch.optim.Muon on that matrix alone."""

    class Stacked(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 12, 8, dtype=torch.float64))

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Stacked()

        def forward(self, x):
            return torch.einsum("bi,eoi->beo", x, self.experts.w).square().sum()

    class ExpertEntry(Colwise):
        def matrices(self, leaf, shape):
            return stacked_matrices(shape)

    model = Experts()
    w = model.experts.w
    ref = [nn.Parameter(e.detach().clone()) for e in w]
    model(torch.randn(5, 8, dtype=torch.float64)).backward()
    for p, g in zip(ref, w.grad):
        p.grad = g.clone()
    mats = muon_matrices([model], sharding={"experts": ExpertEntry()})
    assert len(mats[w]) == 4
    Muon([w], matrices=mats, lr=0.05).step()
    torch.optim.Muon(ref, lr=0.05).step()
    assert torch.equal(w.detach(), torch.stack([p.detach() for p in ref]))


def test_the_split_comes_from_the_sharding_entries():
    """Llama: the blocks' seven Linear weights per block (q, k, v, o, w1, w3, w2); GPT-2: its Linear weights, c_attn
    as three chunks (biases, LayerNorms, positions, embeddings and the head stay on AdamW); an entry marked
    muon=False moves a matrix to AdamW; a module that is no registered model needs its own declaration."""
    llama = _model(_cfg())
    names = {n for n, p in llama.named_parameters() if p in muon_matrices([llama])}
    assert names == {f"layers.{i}.{m}.weight" for i in range(2) for m in _LLAMA_MATRICES}
    gpt2 = _model(_cfg("--model.name", "gpt2"))
    mats = muon_matrices([gpt2])
    assert {n for n, p in gpt2.named_parameters() if p in mats} == {
        f"layers.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    assert sum(len(b) for b in mats.values()) == 12
    sharding = {**get_spec("llama3").sharding, "layers.*.feed_forward.w2": Rowwise(muon=False)}
    mats = muon_matrices([llama], sharding=sharding)
    assert not any(p is llama.layers["0"].feed_forward.w2.weight for p in mats) and len(mats) == 12
    assert FusedColwise(3, muon=False).matrices("weight", (6, 2)) is None

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

    with pytest.raises(ValueError, match="not a registered model.*pass sharding="):
        muon_matrices([Plain()])
    assert len(muon_matrices([Plain()], sharding={"fc": Colwise()})) == 1


_LLAMA_MATRICES = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w3",
    "feed_forward.w2",
)


def test_muon_configuration_rules():
    """Muon-only keys under AdamW, a wrong number of coefficients, and Muon on a model whose sharding marks no
    matrix are refused in one line each; the defaults are torch.optim.Muon's."""
    o = load_config([]).optimizer
    assert (o.name, o.momentum, o.nesterov, o.ns_steps, o.muon_eps, o.adjust_lr_fn, o.ns_dtype) == (
        "AdamW",
        0.95,
        True,
        5,
        1e-7,
        "original",
        "bfloat16",
    )
    with pytest.raises(ConfigError, match=r"optimizer.momentum, optimizer.ns_steps set but optimizer.name is 'AdamW'"):
        load_config(["--optimizer.momentum", "0.9", "--optimizer.ns_steps", "3"])
    with pytest.raises(ConfigError, match="Newton-Schulz takes 3 coefficients"):
        load_config(["--optimizer.name", "Muon", "--optimizer.ns_coefficients", "3.4,-4.7"])
    with pytest.raises(ConfigError, match="optimizer.ns_steps: 100 is above the maximum 99"):
        load_config(["--optimizer.name", "Muon", "--optimizer.ns_steps", "100"])


def test_torchtitan_and_megatron_muon_options_are_mapped_or_refused_with_the_equivalent():
    cfg = parse_config(
        [
            "--optimizer.name",
            "Muon",
            "--optimizer.mu",
            "0.9",
            "--optimizer.adjust_lr",
            "rms_norm",
            "--optimizer.muon_num_ns_steps",
            "4",
            "--optimizer.muon_use_nesterov",
            "false",
            "--optimizer.muon_fp32_matmul_prec",
            "highest",
            "--optimizer.muon_tp_mode",
            "duplicated",
        ]
    )
    o = cfg.optimizer
    assert (o.momentum, o.adjust_lr_fn, o.ns_steps, o.nesterov, o.ns_dtype) == (
        0.9,
        "match_rms_adamw",
        4,
        False,
        "float32",
    )
    assert any("optimizer.mu = 0.9 -> optimizer.momentum = 0.9" in n for n in cfg.notes)
    with pytest.raises(ConfigError) as e:
        parse_config(
            [
                "--optimizer.adjust_lr",
                "spectral_norm",
                "--optimizer.muon_scale_mode",
                "spectral",
                "--optimizer.muon_tp_mode",
                "blockwise",
                "--optimizer.muon_split_qkv",
                "false",
            ]
        )
    msg = str(e.value)
    assert "4 problems" in msg
    assert "torchtitan's optimizer.adjust_lr = 'spectral_norm'" in msg and "optimizer.adjust_lr_fn" in msg
    assert "Megatron's optimizer.muon_scale_mode = 'spectral'" in msg and "'match_rms_adamw'" in msg
    assert "Megatron's optimizer.muon_tp_mode = 'blockwise' does not apply" in msg
    assert "per chunk" in msg


def test_a_checkpoint_resumes_only_with_the_optimizer_that_wrote_it(tmp_path):
    """An AdamW checkpoint resumed with optimizer.name = Muon is refused in one line naming both ways out (its
    state holds no momentum buffers); the same checkpoint starts a Muon run through initial_load_path."""
    from titanlike.checkpoint import read_meta
    from titanlike.training.trainer import Trainer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    base = [
        "--data.path",
        str(corpus),
        "--model.flavor",
        "tiny",
        "--training.seq_len",
        "16",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "1",
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    trainer = Trainer(load_config(base))
    trainer.train()
    trainer.close()
    step = tmp_path / "run" / "checkpoint" / "step-1"
    assert read_meta(step)["optimizer"] == "AdamW"
    muon = [*base, "--optimizer.name", "Muon", "--training.steps", "2"]
    with pytest.raises(ConfigError, match=r"holds AdamW's optimizer state and this run's optimizer.name is 'Muon'"):
        Trainer(load_config(muon))
    moved = [*muon, "--checkpoint.initial_load_path", str(step), "--checkpoint.folder", str(tmp_path / "muon")]
    trainer = Trainer(load_config(moved))
    losses = trainer.train()
    trainer.close()
    assert len(losses) == 2 and read_meta(tmp_path / "muon" / "step-2")["optimizer"] == "Muon"


def test_the_momentum_buffer_is_never_the_newton_schulz_input():
    """torch.optim.Muon with bfloat16 parameters and plain momentum normalizes its momentum buffer in place (its
    Newton-Schulz starts from ``buf.bfloat16()``, which is the buffer itself: docs/facts.md); ours works on a copy,
    so the buffer stays the momentum."""
    g = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(8, 4, generator=g).bfloat16())
    w.grad = torch.randn(8, 4, generator=g).bfloat16()
    theirs = nn.Parameter(w.detach().clone())
    theirs.grad = w.grad.clone()
    opt = Muon([w], lr=0.01, momentum=0.9, nesterov=False)
    opt.step()
    torch.optim.Muon([theirs], lr=0.01, momentum=0.9, nesterov=False).step()
    assert torch.equal(opt.state[w]["momentum_buffer"], torch.zeros_like(w.grad).lerp_(w.grad, 0.1))
    assert torch.equal(w, theirs)  # the first update is the same; torch's buffer is not its momentum any more
