"""DeepSeek-V3 against the real transformers ``DeepseekV3ForCausalLM`` (MLA with and without the q low-rank path,
both RoPE layouts, YaRN's softmax scale, sigmoid + correction-bias group-limited routing) and its MTP module
(transformers' ``MtpModel``); a ``save_pretrained`` folder imports by folder, exports back and reloads; the MTP
depths import from and export to the layers after the last decoder layer; unsupported config fields are refused;
the published sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.modeling_layers import MtpModel

from titanlike.config import load_config
from titanlike.data import asset_path, set_loader_position
from titanlike.hf import load_hf, model_args_from_hf_config, save_hf
from titanlike.hf.adapter import GENERIC_FIELDS
from titanlike.loss import IGNORE_INDEX, ScaledLoss, cross_entropy_loss
from titanlike.models import get_spec
from titanlike.models.deepseek_v3 import FLAVORS
from titanlike.models.deepseek_v3 import hf as ds_hf
from titanlike.training.trainer import Trainer

SPEC = get_spec("deepseek_v3")
TOL = 2e-6  # float32: transformers routes, normalises and turns RoPE in float32
CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    vocab_size=128,
    max_position_embeddings=256,
)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)


def _randomize(*modules) -> None:
    """A wide router (the top-k not decided by rounding), non-trivial norms and correction biases."""
    with torch.no_grad():
        for module in modules:
            for n, p in module.named_parameters():
                p.normal_(0, 0.3 if "mlp.gate." in n else 0.05).add_(1.0 if "norm" in n else 0.0)
            for n, b in module.named_buffers():
                if "e_score_correction_bias" in n:
                    b.normal_(0, 0.1)


def _theirs(seed: int = 0, **changes) -> transformers.DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**CONFIG, **changes}))
    _randomize(model)
    return model.eval()


def _fields(model) -> dict:
    drop = {"architectures", "model_type", "quantization_config"}
    return {k: v for k, v in model.config.to_dict().items() if k not in GENERIC_FIELDS and k not in drop}


def _ours(hf_sd: dict, args):
    model = SPEC.build(args)
    model.init_buffers()  # first: it zeroes the expert biases the checkpoint then sets
    model.load_state_dict(ds_hf.from_hf(hf_sd, args))
    return model.eval()


def _tokens(vocab: int = 128):
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "changes",
    [{}, dict(q_lora_rank=None, rope_interleave=False), dict(rope_parameters=YARN)],
    ids=["q_lora-interleaved", "plain_q-rotate_half", "yarn-mscale"],
)
def test_logits_equal_transformers(changes):
    theirs = _theirs(**changes)
    args = ds_hf.args_for_weights(ds_hf.model_args_from_hf_config(_fields(theirs)), theirs.state_dict())
    assert args.mtp_layers == 0 and args.q_lora_rank == (0 if "q_lora_rank" in changes else 32)
    if "rope_parameters" in changes:  # YaRN's mscale(4, 1) ** 2 on the softmax scale, as transformers' scaling
        assert args.softmax_scale == pytest.approx(theirs.model.layers[0].self_attn.scaling, rel=1e-12)
    ours, x = _ours(theirs.state_dict(), args), _tokens()
    assert ours.layers["1"].moe.expert_bias.abs().max() > 0  # the correction bias imported
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max().item() <= TOL


def _with_mtp(theirs, seed: int = 5):
    """transformers' MtpModel on ``theirs`` and the state dict of both as DeepSeek's checkpoints keep it: depth 1 at
    ``model.layers.{num_hidden_layers}``, with the embedding and head copies."""
    torch.manual_seed(seed)
    mtp = MtpModel(theirs, 1).eval()
    _randomize(mtp)
    sd, n = dict(theirs.state_dict()), theirs.config.num_hidden_layers
    for k, v in mtp.state_dict().items():
        rest = k.removeprefix("layers.0.").replace("mtp_block.", "").replace("post_norm", "shared_head.norm")
        if k.startswith("layers.0."):
            sd[f"model.layers.{n}.{rest}"] = v
    sd[f"model.layers.{n}.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    sd[f"model.layers.{n}.shared_head.head.weight"] = sd["lm_head.weight"].clone()
    return mtp, sd


def test_mtp_depth_equals_transformers_mtp_model():
    """Depth 1 = transformers' MTP layer on the main model's last (normed) hidden states and the tokens one ahead."""
    theirs = _theirs(num_hidden_layers=2)
    mtp, sd = _with_mtp(theirs)
    args = ds_hf.args_for_weights(ds_hf.model_args_from_hf_config(_fields(theirs)), sd)
    assert args.mtp_layers == 1
    ours, x = _ours(sd, args), _tokens()
    with torch.no_grad():
        out = theirs(x, output_hidden_states=True)
        pos = torch.arange(x.shape[1])[None].expand(2, -1)
        h = mtp.forward_layer(0, out.hidden_states[-1][:, :-1], pos[:, :-1], None, input_ids=x[:, 1:])
        ours.train()
        logits, depth1 = ours(x)
        ours.eval()
        assert (ours(x) - logits).abs().max() == 0  # eval: the logits only
    assert (logits - out.logits).abs().max().item() <= TOL
    assert (depth1[:, :-1] - mtp._project_to_logits(h)).abs().max().item() <= TOL
    # export writes depth 1 where it was, the copies included; they must equal the main weights on import
    back = ds_hf.to_hf(ours.state_dict(), args)  # every expert apart (the files' form)
    assert all(torch.equal(back[k], sd[k]) for k in sd if ".experts." not in k)
    assert {k for k in back if ".experts." not in k} == {k for k in sd if ".experts." not in k}
    again = ds_hf.from_hf(back, args)
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())
    bad = {**sd, "model.layers.2.embed_tokens.weight": torch.zeros_like(sd["model.embed_tokens.weight"])}
    with pytest.raises(ValueError, match="differs from the main model's model.embed_tokens.weight"):
        ds_hf.from_hf(bad, args)


def test_mtp_loss_is_weighted_beside_the_next_token_loss():
    """ScaledLoss of (logits, depth logits): the value is the next-token loss exactly; the gradient adds
    mtp_loss_weight / D times each depth's loss against the labels shifted by its depth (ignored past the end)."""
    args = FLAVORS["debugmodel"].replace(vocab_size=64, mtp_layers=2)
    model = SPEC.build(args).to(torch.float64)
    model.init_weights(seed=0)
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)
    out = model(x)
    assert isinstance(out, tuple) and len(out) == 3
    loss = ScaledLoss(lambda o, t: cross_entropy_loss(o, t, reduction="sum"), mtp_weight=0.3)
    loss.denominator = 24.0
    value = loss(out, y)
    main = cross_entropy_loss(out[0], y) / 24
    assert value.item() == main.item()
    shifted = [torch.cat([y[:, k:], torch.full((2, k), IGNORE_INDEX)], 1) for k in (1, 2)]
    depths = [cross_entropy_loss(o, t) / 24 for o, t in zip(out[1:], shifted)]
    assert [d.item() for d in loss.mtp_losses] == pytest.approx([d.item() for d in depths], rel=1e-14)
    g = torch.autograd.grad(value, model.mtp["2"].eh_proj.weight, retain_graph=True)[0]
    want = torch.autograd.grad(main + 0.3 / 2 * sum(depths), model.mtp["2"].eh_proj.weight)[0]
    assert (g - want).abs().max().item() <= 1e-15


def test_save_pretrained_folder_imports_exports_and_reloads(tmp_path):
    theirs = _theirs()
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="100KB")  # sharded safetensors
    sd, args = load_hf(tmp_path / "hf", dtype=torch.float32)
    assert args.mtp_layers == 0  # config.json says 1 (num_nextn_predict_layers), transformers writes none
    ours, x = SPEC.build(args), _tokens()
    ours.init_buffers()
    ours.load_state_dict(sd)
    ours.eval()
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max().item() <= TOL
    ours.train()
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    F.cross_entropy(ours(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    ours.eval()
    out = save_hf(ours.state_dict(), args, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        trained = ours(x)
        assert (trained - reloaded(x).logits).abs().max().item() <= TOL
        assert (trained - theirs(x).logits).abs().max().item() > 100 * TOL


def test_unsupported_config_fields_are_refused_one_line_each():
    fields = _fields(_theirs())
    for key, value, message in (
        ("topk_method", "greedy", "topk_method = 'greedy'"),
        ("scoring_func", "softmax", "scoring_func = 'softmax'"),
        ("hidden_act", "gelu", "hidden_act = 'gelu'"),
        ("num_key_value_heads", 2, "num_key_value_heads = 2"),
        ("rope_parameters", {"rope_type": "linear", "factor": 2.0}, "rope type 'linear'"),
        ("moe_layer_freq", 2, "moe_layer_freq = 2"),
        ("some_new_field", 1, "some_new_field = 1"),
    ):
        with pytest.raises(ValueError, match=message):
            ds_hf.model_args_from_hf_config({**fields, key: value})
    quantized = {**_theirs().config.to_dict(), "quantization_config": {"quant_method": "fp8"}}
    with pytest.raises(ValueError, match="quantization_config"):
        model_args_from_hf_config(quantized)
    with pytest.raises(ValueError, match="hidden_act = 'gelu'.*topk_method = 'greedy'"):  # every problem, one line
        ds_hf.model_args_from_hf_config({**fields, "hidden_act": "gelu", "topk_method": "greedy"})


@pytest.mark.parametrize("flavor,total,active", [("16B", 15.7e9, 2.4e9), ("671B", 671e9 + 14e9, 37e9)])
def test_published_sizes(flavor, total, active):
    """DeepSeek-V2-Lite: 15.7B total, 2.4B active; DeepSeek-V3: 671B main + 14B MTP module, 37B active."""
    args = FLAVORS[flavor]
    assert abs(args.num_params() / total - 1) < 0.01
    assert abs(args.num_active_params() / active - 1) < 0.12
    assert sum(p.numel() for p in SPEC.build_meta(args).parameters()) == args.num_params()


def test_training_starts_from_a_save_pretrained_folder_with_no_model_flags(tmp_path, capsys):
    """No --model.* flag: config.json's model_type picks deepseek_v3; step 1's loss is transformers' on that batch."""
    folder = tmp_path / "hf"
    _theirs(seed=3, vocab_size=2048).save_pretrained(folder)
    argv = ["--checkpoint.initial_load_path", str(folder), "--training.steps", "1", "--training.local_batch_size"]
    argv += ["2", "--training.seq_len", "32", "--data.path", str(asset_path("corpus", "tinyshakespeare.txt"))]
    argv += ["--validation.enable", "false", "--metrics.enable_tensorboard", "false", "--job.dump_folder"]
    trainer = Trainer(load_config([*argv, str(tmp_path / "run")], world_size=1))
    assert "architecture from" in capsys.readouterr().out
    x, y = next(iter(trainer.dataloader))
    set_loader_position(trainer.dataloader, 0)
    (loss,) = trainer.train()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        hf_loss = F.cross_entropy(theirs(x).logits.flatten(0, 1), y.flatten()).item()
    assert abs(loss - hf_loss) <= 1e-5, (loss, hf_loss)


def test_bad_shapes_are_refused_one_line_each():
    args = FLAVORS["debugmodel"].replace(vocab_size=64)
    assert SPEC.shape_violations(args) == []
    bad = args.replace(qk_rope_head_dim=7, kv_lora_rank=0, q_lora_rank=-1, mtp_layers=-1, top_k=9, rope_scaling="x")
    problems = SPEC.shape_violations(bad)
    for needle in ("qk_rope_head_dim 7", "kv_lora_rank", "q_lora_rank", "mtp_layers", "top_k 9", "rope_scaling 'x'"):
        assert sum(needle in p for p in problems) == 1, (needle, problems)
    from titanlike.layout.rules import layout_violations

    cfg = load_config(["--model.name", "deepseek_v3"], world_size=1)
    cfg.parallelism.tensor_parallel_degree = 3  # every problem of the layout, one line each
    problems = layout_violations(cfg, 3, args)
    assert any("does not divide n_heads 4" in m for m in problems), problems


def test_sharding_declares_every_module_of_each_flavor():
    from titanlike.sharding import check_sharding

    for flavor, args in FLAVORS.items():
        model = SPEC.build_meta(args.replace(vocab_size=64 if args.vocab_size < 0 else args.vocab_size))
        assert check_sharding(SPEC.sharding_of(args), [n for n, _ in model.named_modules()]) == [], flavor


def test_mtp_layers_below_the_weights_depths_drops_them_and_above_is_refused_naming_the_weights(tmp_path):
    """``--model.mtp_layers 0`` on a Hugging Face folder whose weights hold an MTP depth trains without it (the main
    model's step-1 loss as with it); more depths than the weights hold is refused naming what they hold, for our
    export (1 depth) and for a save_pretrained folder (config.json says 1, the weights hold none)."""
    from titanlike.errors import ConfigError

    args = FLAVORS["tiny"].replace(vocab_size=2048)
    model = SPEC.build(args)
    model.init_weights(seed=2)
    folder = save_hf(model.state_dict(), args, tmp_path / "hf")
    argv = ["--training.steps", "1", "--training.local_batch_size", "2", "--training.seq_len", "32", "--data.path"]
    argv += [str(asset_path("corpus", "tinyshakespeare.txt")), "--validation.enable", "false"]
    argv += ["--metrics.enable_tensorboard", "false", "--checkpoint.initial_load_path"]

    def run(source, dump, *extra):
        return Trainer(load_config([*argv, str(source), "--job.dump_folder", str(tmp_path / dump), *extra]))

    with_mtp, without = run(folder, "a"), run(folder, "b", "--model.mtp_layers", "0")
    assert (with_mtp.model_args.mtp_layers, without.model_args.mtp_layers) == (1, 0)
    assert not any(k.startswith("mtp.") for k in without.model_parts[0].state_dict())
    assert with_mtp.train() == without.train()  # the main model's loss; the depth's is logged beside it
    with pytest.raises(ConfigError, match=r"model.mtp_layers 2: its weights hold 1 MTP depth\(s\)"):
        run(folder, "c", "--model.mtp_layers", "2")
    _theirs(vocab_size=2048).save_pretrained(tmp_path / "theirs")
    with pytest.raises(ConfigError, match=r"model.mtp_layers 1: its weights hold 0 MTP depth\(s\)"):
        run(tmp_path / "theirs", "d", "--model.mtp_layers", "1")
