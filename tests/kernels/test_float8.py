"""float8 training through torchao (the real package from the registry, run in its emulation mode on CPU).

* conversion touches exactly the intended layers (block projections; not the head, not misaligned or tied
  linears, not what ``filter_fqns`` names), keeps every parameter name, object and value;
* a float8 run of the debug model tracks the run without float8 (same seed, same data);
* float8 x FSDP2 (with and without float8 all-gather) and float8 x TP2 (with and without SP) on 2 gloo ranks
  give the losses of float8 on one process; the float8-all-gathered FSDP checkpoint loads into a plain model;
* a float8 checkpoint resumes without float8 and the other way round (names and values unchanged);
* bad inputs are one-line errors before anything starts.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchao  # noqa: E402,F401  (the [float8] extra, installed by .ci/run: a missing torchao fails, not skips)
from torch import nn

from titanlike.config import ConfigError, load_config  # noqa: E402
from titanlike.data import asset_path  # noqa: E402
from titanlike.kernels import float8 as f8  # noqa: E402
from titanlike.models.llama import FLAVORS, Transformer  # noqa: E402
from titanlike.training.trainer import Trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("float8_dist_worker.py")
CORPUS = str(asset_path("corpus", "tinyshakespeare.txt"))
BLOCK_LINEARS = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)


def _transformer(**kw) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(FLAVORS["tiny"].replace(vocab_size=128, dim=64, n_layers=2, max_seq_len=32).replace(**kw))
    m.init_weights()
    return m


# ---------------------------------------------------------------------------------------------- conversion
def test_conversion_touches_exactly_the_block_projections_and_keeps_every_name_and_value():
    model = _transformer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    converted = f8.convert_to_float8(model, "tensorwise", emulate=True)
    assert converted == sorted(f"layers.{i}.{n}" for i in range(2) for n in BLOCK_LINEARS)
    assert all(f8.is_float8_linear(model.get_submodule(n)) for n in converted)
    assert type(model.output) is nn.Linear  # the vocab head stays high precision
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(p is params[n] for n, p in model.named_parameters())  # same Parameter objects: optimizers unchanged


def test_shape_fqn_and_tie_filters_on_a_user_module():
    class UserNet(nn.Module):  # written the way an outside user would: no Transformer, own names
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 64)
            self.proj_in = nn.Linear(64, 128, bias=False)
            self.odd = nn.Linear(128, 40, bias=False)  # 40 % 16 != 0: stays high precision
            self.gate = nn.Linear(40, 64, bias=True)  # 40 % 16 != 0 on the input side
            self.router = nn.Linear(64, 64)  # excluded by name below
            self.output = nn.Linear(64, 112, bias=False)
            self.tied = nn.Linear(64, 100, bias=False)
            self.tied.weight = self.embed.weight  # shared weight: never converted

        def forward(self, x):
            h = self.embed(x)
            h = self.router(self.gate(self.odd(self.proj_in(h))))
            return self.output(h)[..., :100] + self.tied(h)

    net = UserNet()
    converted = f8.convert_to_float8(net, "rowwise", emulate=True, filter_fqns=["output", "router"])
    assert converted == ["proj_in"]
    # filter_fqns=[]: the head is converted too (a user's explicit choice); misaligned and tied still are not
    net2 = UserNet()
    assert f8.convert_to_float8(net2, "tensorwise", emulate=True, filter_fqns=[]) == ["output", "proj_in", "router"]
    x = torch.randint(0, 100, (2, 8))
    net2(x).sum().backward()
    assert net2.proj_in.weight.grad is not None


def test_block_filter_by_fqn_on_the_transformer():
    model = _transformer()
    converted = f8.convert_to_float8(model, "tensorwise", emulate=True, filter_fqns=["output", "feed_forward"])
    assert converted == sorted(f"layers.{i}.attention.{n}" for i in range(2) for n in ("wq", "wk", "wv", "wo"))


@pytest.mark.parametrize("recipe", f8.TORCHAO_RECIPES)
def test_every_recipe_trains_under_cpu_autocast(recipe):
    """torchao applies only the CUDA autocast dtype; titanlike's subclass makes CPU bf16 autocast work (all three
    recipes, including rowwise_with_gw_hp, whose high-precision weight-gradient GEMM failed without it)."""
    model = _transformer()
    f8.convert_to_float8(model, recipe, emulate=True)
    x = torch.randint(0, 128, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten())
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


# ---------------------------------------------------------------------------------------------- training
def _run(dump: Path, steps: int, *extra: str, flavor: str = "tiny") -> tuple[Trainer, list[float]]:
    args = [
        "--model.flavor",
        flavor,
        "--training.steps",
        str(steps),
        "--training.local_batch_size",
        "4",
        "--training.seq_len",
        "32",
        "--data.path",
        CORPUS,
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.log_freq",
        "100",
        "--lr_scheduler.warmup_steps",
        "2",
        "--job.dump_folder",
        str(dump),
        *extra,
    ]
    trainer = Trainer(load_config(args, world_size=1))
    return trainer, trainer.train()


def test_float8_run_of_the_debug_model_tracks_the_run_without_float8(tmp_path):
    """12 steps of the debug model (CI); the 30- and 50-step numbers are in docs/performance.md."""
    common = [
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "8",
        "--optimizer.lr",
        "3e-3",
        "--lr_scheduler.warmup_steps",
        "4",
    ]
    _, ref = _run(tmp_path / "ref", 12, *common, flavor="debugmodel")
    trainer, fp8 = _run(
        tmp_path / "f8", 12, *common, "--float8.recipe", "tensorwise", "--float8.emulate", flavor="debugmodel"
    )
    assert len(trainer.model_parts[0]._float8_converted) == 4 * 7
    rel = [abs(a - b) / b for a, b in zip(fp8, ref)]
    assert max(rel) < 0.01, rel  # 30 steps at seq 128 measured <= 0.12% per step (docs/performance.md)
    assert fp8[-1] < fp8[0] - 0.5  # and it learns


def test_the_start_up_line_says_what_trains_in_float8_and_that_routed_experts_do_not(tmp_path, capsys):
    """Qwen3-MoE tiny (layer 0 dense, layer 1 MoE): its attention and dense SwiGLU Linears train in float8; the
    routed experts' grouped GEMMs stay high precision, and the start-up line says so (nothing silently ignored)."""
    trainer, losses = _run(
        tmp_path, 1, "--model.name", "qwen3_moe", "--float8.recipe", "tensorwise", "--float8.emulate"
    )
    converted = trainer.model_parts[0]._float8_converted
    assert math.isfinite(losses[0]) and not [n for n in converted if ".moe." in n]
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("float8:"))
    assert line == (
        f"float8: {len(converted)} Linear layers train in torchao float8 (tensorwise); the routed experts of 1 MoE "
        f"block(s) keep high-precision grouped GEMMs (torchao's float8 grouped GEMM has no emulation)"
    )
    assert f8.experts_float8_unavailable(emulate=False) == (
        "torchao's float8 grouped GEMM needs CUDA compute capability 9.0+"  # this machine: no GPU
    )


def test_routed_experts_take_a_float8_grouped_gemm_with_torchs_operand_layouts():
    """convert_experts_to_float8 swaps torchao's float8 grouped GEMM into every GroupedExperts (CUDA 9.0+ only, so
    here a stand-in with the same contract runs torch._grouped_mm): it is called 3 times per forward with a row-major
    left operand, column-major per-expert weights, int32 group ends on 16-row boundaries, and the block then equals
    the per-expert loop (float32) in output and every gradient. Refused in one line: experts whose dims are not
    multiples of 16 (each named), the loop implementation."""
    from titanlike.kernels.float8 import convert_experts_to_float8, float8_grouped_mm
    from titanlike.models.moe import MoE, MoEArgs

    calls = []

    def contract(a, b_t, offs):
        assert a.is_contiguous() and b_t.stride(-2) == 1 and offs.dtype == torch.int32  # row- / column-major
        ends = offs.tolist()
        assert all(e % 16 == 0 for e in ends) and ends[-1] == a.shape[0]
        calls.append(b_t.shape)
        return torch._grouped_mm(a, b_t, offs=offs)

    torch.manual_seed(0)
    args = MoEArgs(dim=32, hidden_dim=48, num_experts=4, top_k=2, route_norm=True)
    block, ref = MoE(args), MoE(args.replace(experts_impl="loop"))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ref.load_state_dict(block.state_dict())
    assert convert_experts_to_float8(block, grouped_mm=contract) == ["experts"]
    x = torch.randn(2, 24, 32)
    y, y_ref = block(x), ref(x)
    assert len(calls) == 3 and calls[0] == (4, 32, 48) and calls[2] == (4, 48, 32)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    assert torch.allclose(y, y_ref, atol=1e-6)
    for (name, p), q in zip(block.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    assert MoE(args).experts.grouped_mm is None  # the default: torch's own grouped matmul or the loop
    default = MoE(args)
    convert_experts_to_float8(default)
    assert default.experts.grouped_mm is float8_grouped_mm and default.experts.grouped_mm_align == 16
    with pytest.raises(ValueError) as e:
        convert_experts_to_float8(
            torch.nn.ModuleDict({"a": MoE(args.replace(dim=24)), "b": MoE(args.replace(experts_impl="loop"))})
        )
    assert str(e.value) == (
        "float8 routed experts: 'a.experts' has dim 24 / hidden 48, not multiples of 16; 'b.experts' runs the "
        "per-expert loop (experts_impl 'loop'); use 'auto' or 'grouped'"
    )


@pytest.mark.parametrize("first,second", [("float8", "plain"), ("plain", "float8")])
def test_a_float8_checkpoint_resumes_without_float8_and_back(tmp_path, first, second):
    flags = {"float8": ("--float8.recipe", "tensorwise", "--float8.emulate"), "plain": ()}
    ck = ("--checkpoint.enable", "--checkpoint.interval", "2")
    a, _ = _run(tmp_path, 2, *ck, *flags[first])
    b, losses = _run(tmp_path, 2, *ck, *flags[second])  # resumes at step-2: nothing left to train
    assert b.meta_init and losses == [] and b.step == 2
    sa, sb = a.model_parts[0].state_dict(), b.model_parts[0].state_dict()
    assert list(sa) == list(sb)  # the same names with and without float8
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert hasattr(b.model_parts[0], "_float8_converted") == (second == "float8")
    c, losses = _run(tmp_path, 3, *ck, *flags[second])  # and trains on from it
    assert c.step == 3 and len(losses) == 1 and math.isfinite(losses[0])


# ---------------------------------------------------------------------------------------------- composition
def test_float8_composes_with_fsdp2_and_tp2_like_one_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path / "ckpt")], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    ref = res["reference"]
    for name, lay in res["layouts"].items():
        assert lay["float8_linear"], name
        # FSDP: each rank casts its own micro-batch (tensorwise activation scales are per local batch), so the
        # reference is one process accumulating the same two halves: bitwise equal, float8 all-gather included.
        # TP: row-parallel partial sums add in another order (float32, ~1e-7 relative). Step 1's loss (no update
        # yet) sees only that: bar 1e-5. A sum that crosses a float8 rounding boundary changes a gradient element
        # by one float8 step, and AdamW (lr 1e-2) turns a near-zero element's changed sign into a full-lr update:
        # the later losses part by up to 1.8e-3 (qwen3 tensorwise, step 3, on an AVX2 Xeon; 2.4e-6 on another
        # CPU) - a dropped or doubled TP reduction moves step 1 by far more than 1e-5: bar 1e-2 after step 1.
        want = ref[lay["reference"]]
        diffs = [abs(a - b) for a, b in zip(lay["losses"], want)]
        assert len(diffs) == len(want) == 4, (name, lay["losses"], want)
        if lay["dp"] > 1:
            assert max(diffs) == 0.0, (name, lay["losses"], want)
        else:
            assert diffs[0] <= 1e-5 and max(diffs[1:]) <= 1e-2, (name, lay["losses"], want)
    lays = res["layouts"]
    assert lays["fsdp2_tensorwise_f8allgather"]["weight_kind"] == "WeightWithDynamicFloat8CastTensor"
    assert lays["fsdp2_tensorwise"]["weight_kind"] == "Tensor"
    assert lays["fsdp2_tensorwise_f8allgather"]["checkpoint_max_diff"] == 0.0
    # torchao's float8 TP styles hand wq an already-cast float8 activation (tensorwise, no SP); under SP on gloo,
    # which cannot all-gather float8 dtypes, and with rowwise scaling the plain styles are used
    assert lays["tp2_tensorwise"]["wq_input"] == "Float8TrainingTensor"
    assert lays["tp2_sp_tensorwise"]["wq_input"] == "Tensor"
    assert lays["tp2_rowwise"]["wq_input"] == "Tensor"
    # Qwen3: its sharding marks the 7 block projections float8-eligible (not the q / k norms between them), and its
    # attention region takes the float8 activation like Llama's
    assert res["converted"]["qwen3"] == res["converted"]["llama3"]
    assert lays["qwen3_tp2_tensorwise"]["wq_input"] == "Float8TrainingTensor"
    # tensorwise: one scale per (local) tensor, so whole-batch and half-batch runs differ; rowwise: per row, equal
    assert ref["tensorwise_micro1"] != ref["tensorwise_micro2"]
    assert max(abs(a - b) for a, b in zip(ref["rowwise_micro1"], ref["rowwise_micro2"])) < 1e-5


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--float8.recipe", "tensorwise", "--training.dtype", "float64"],
            "float8.recipe=tensorwise does not combine with training.dtype=float64",
        ),
        (
            ["--float8.recipe", "current"],
            "float8.recipe=current is a Transformer Engine recipe; with float8.backend=torchao",
        ),
        (
            ["--float8.recipe", "rowwise", "--float8.backend", "te"],
            "float8.backend=te needs Transformer Engine kernels",
        ),
        (
            ["--float8.recipe", "rowwise", "--model.kernels", "te", "--float8.backend", "torchao"],
            "float8.backend=torchao converts nn.Linear layers, but model.kernels=te",
        ),
        (
            ["--float8.recipe", "rowwise", "--float8.enable_fsdp_float8_all_gather"],
            "float8.enable_fsdp_float8_all_gather needs float8.recipe=tensorwise",
        ),
        (
            ["--float8.recipe", "tensorwise", "--float8.precompute_float8_dynamic_scale_for_fsdp"],
            "float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather=true",
        ),
        (
            ["--float8.emulate", "--float8.enable_fsdp_float8_all_gather"],
            "float8.emulate, float8.enable_fsdp_float8_all_gather set but float8.recipe is empty",
        ),
        (
            ["--float8.recipe", "delayed", "--model.kernels", "te", "--float8.emulate"],
            "float8.emulate apply to float8.backend=torchao only",
        ),
        (["--float8.recipe", "tensorwse"], "did you mean 'tensorwise'"),
    ],
)
def test_bad_float8_config_is_one_line(argv, message):
    with pytest.raises(ConfigError) as e:
        load_config(argv, world_size=1)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_runtime_refusals_are_one_line(monkeypatch):
    with pytest.raises(f8.Float8UnavailableError, match="set float8.emulate=true to run torchao's emulation on cpu"):
        f8.check_float8_runtime("tensorwise", False, "cpu")
    with pytest.raises(f8.Float8UnavailableError, match="needs compute capability >= 8.9 .* this GPU has 8.0"):
        f8.check_float8_runtime("rowwise", False, "cuda", capability=(8, 0))
    f8.check_float8_runtime("rowwise", False, "cuda", capability=(9, 0))  # H100 / H200: fine
    monkeypatch.setattr(f8, "offered_recipes", lambda: ("tensorwise", "rowwise"))  # an older torchao
    with pytest.raises(
        f8.Float8UnavailableError, match="float8.recipe=rowwise_with_gw_hp is not offered by the installed torchao"
    ):
        f8.check_float8_runtime("rowwise_with_gw_hp", True, "cpu")
    monkeypatch.setattr(f8, "_cached_torchao", lambda: "ModuleNotFoundError: No module named 'torchao'")
    with pytest.raises(f8.Float8UnavailableError) as e:
        f8.check_float8_runtime("tensorwise", True, "cpu")
    msg = str(e.value)
    assert "\n" not in msg and "float8.backend=torchao needs torchao" in msg and "pip install" in msg
    with pytest.raises(f8.Float8UnavailableError):
        f8.convert_to_float8(_transformer(), "tensorwise", emulate=True)


def test_train_py_refuses_float8_without_a_float8_gpu_before_anything_starts(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--job.config_file",
            "configs/debug_model.toml",
            "--float8.recipe",
            "tensorwise",
            "--training.device",
            "cpu",
            "--job.dump_folder",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: float8.recipe=tensorwise without emulation needs a CUDA GPU"), r.stderr
    assert not out.exists()


def test_te_stays_behind_the_same_keys():
    from titanlike.layout import float8_backend

    cfg = load_config(["--model.kernels", "te", "--float8.recipe", "current"], world_size=1)
    assert float8_backend(cfg) == "te"  # auto: TE's fp8 when model.kernels=te
    cfg = load_config(["--float8.recipe", "rowwise"], world_size=1)
    assert float8_backend(cfg) == "torchao"  # auto: torchao otherwise
    cfg = load_config(["--model.kernels", "te", "--float8.recipe", "block", "--float8.backend", "te"], world_size=1)
    assert float8_backend(cfg) == "te"
