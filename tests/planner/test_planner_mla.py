"""The planner's activation model for DeepSeek-V3's multi-head latent attention (``ModelSpec.attention_activations``:
titanlike.models.deepseek_v3.activations) equals the dry run's FakeTensorMode probe of the real block, as Llama's
softmax formula does (exactly), under the layouts the gate trains: one device in float32 and bf16 (with and without
the query's low-rank path), tp2 + SP x ep2 with and without selective op AC, and the first MoE block of a pp2
stage. Before the hook the tp2 + SP case was 4.52 MiB analytic against the probe's 10.84 MiB."""

from __future__ import annotations

import pytest

from titanlike.config import model_args_from_config, parse_config
from titanlike.planner import block_activation_bytes, dry_run
from titanlike.planner.layout import Layout
from titanlike.planner.memory import moe_layers

DS = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--training.seq_len", "128"]
TP_EP = [
    "--parallelism.tensor_parallel_degree",
    "2",
    "--parallelism.enable_sequence_parallel",
    "--parallelism.expert_parallel_degree",
    "2",
]
CASES = {
    "one_device_fp32": (1, 0, ["--training.dtype", "float32"]),
    "lite_bf16": (1, 0, ["--model.flavor", "debugmodel_lite", "--training.dtype", "bfloat16"]),
    "tp2_sp_ep2_fp32": (2, 0, [*TP_EP, "--training.dtype", "float32"]),
    "tp2_sp_ep2_op_ac_bf16": (
        2,
        0,
        [*TP_EP, "--training.dtype", "bfloat16", "--activation_checkpoint.mode", "selective"],
    ),
    "pp2_moe_block_bf16": (
        2,
        1,
        ["--parallelism.pipeline_parallel_degree", "2", "--model.n_layers", "4", "--training.dtype", "bfloat16"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mla_block_activations_equal_the_probe(name):
    world, rank, extra = CASES[name]
    cfg = parse_config([*DS, "--training.local_batch_size", "2", *extra])
    args = model_args_from_config(cfg, 2048)
    layout = Layout.from_config(cfg, world, args, gpus_per_node=8)
    d = dry_run(cfg, layout, args, rank=rank)
    stage = layout.stages[layout.stage_ids(layout.pp_rank_of(rank))[0]]
    moe = moe_layers(args, stage).get(d.probe_layer)
    assert (moe is not None) == (name == "pp2_moe_block_bf16")  # a pp2 rank 1 stage starts with an MoE block
    tokens = layout.microbatch_size * layout.local_seq_len
    mode = layout.checkpointed(d.probe_layer)
    assert mode == ("op" if "op_ac" in name else "none")
    analytic = block_activation_bytes(layout, args, tokens, mode, moe, probe=True, layer_id=d.probe_layer)
    assert d.block_activation_bytes == analytic, (name, d.block_activation_bytes, analytic)
    # the CUDA estimate (the memory-efficient kernel, no probabilities kept) is below what the CPU math path keeps
    assert block_activation_bytes(layout, args, tokens, mode, moe, layer_id=d.probe_layer) < analytic


def _saved_bytes(args, dtype, batch: int, seq: int) -> int:
    """Bytes of the distinct storages autograd saves in a training forward of the whole model (parameters and
    buffers left out), plus the outputs (the logits the loss would keep), experts routed round-robin."""
    import torch

    from titanlike.models.deepseek_v3 import DeepseekV3
    from titanlike.models.moe import balanced_routing

    torch.manual_seed(0)
    model = DeepseekV3(args)
    model.init_buffers()  # the RoPE tables stay float32, as the trainer keeps them
    for p in model.parameters():
        p.data = p.data.to(dtype)
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    x = torch.randint(0, args.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), balanced_routing():
        out = model(x)
    for o in out if isinstance(out, tuple) else (out,):
        seen.setdefault(o.untyped_storage().data_ptr(), o.untyped_storage().nbytes())
    return sum(seen.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_depth_activations_equal_a_real_forward(dtype):
    """The MTP depth on the last stage (its norms, the concatenation, its MoE block, its norm and the shared head's
    logits: ``prediction_activation_bytes``) equals what a real forward with the depth saves beyond one without."""
    import torch

    from titanlike.planner.memory import prediction_activation_bytes

    cfg = parse_config([*DS, "--training.local_batch_size", "2", "--training.seq_len", "64", "--training.dtype", dtype])
    args = model_args_from_config(cfg, 2048)
    layout = Layout.from_config(cfg, 1, args, gpus_per_node=8)
    (names,) = layout.stages
    torch_dtype = getattr(torch, dtype)
    measured = _saved_bytes(args, torch_dtype, 2, 64) - _saved_bytes(args.replace(mtp_layers=0), torch_dtype, 2, 64)
    # + the depth's MoE block's token counts (int64 per expert: held by the block, which the probe counts, but not
    # saved for the backward, which this measurement counts)
    assert prediction_activation_bytes(layout, args, names, 2 * 64, probe=True) == measured + 8 * args.num_experts
    assert prediction_activation_bytes(layout, args.replace(mtp_layers=0), names, 128) == 0


@pytest.mark.parametrize(
    "pp,ep,local,split",
    [
        (8, 32, 8, "blocks per stage 8 8 8 8 8 7 7 7: [tok_embeddings, layers.0-7] [layers.8-15]"),
        (16, 16, 16, "blocks per stage " + " ".join(["4"] * 13 + ["3"] * 3) + ": [tok_embeddings, layers.0-3]"),
    ],
)
def test_deepseek_v3_671b_pipelines_unevenly_and_is_priced(pp, ep, local, split, capsys):
    """The 671B's 61 layers on pp 8 and pp 16 (torchtitan's split: the first stages one block more) validate on 256
    ranks and are priced stage by stage: every pp rank's memory from its own blocks, the three dense ones on stage 0."""
    import plan as plan_cli

    argv = [
        "--world-size", "256", "--job.config_file", "configs/debug_model.toml", "--model.name", "deepseek_v3",
        "--model.flavor", "671B", "--parallelism.pipeline_parallel_degree", str(pp),
        "--parallelism.expert_parallel_degree", str(ep), "--training.local_batch_size", str(local),
        "--training.global_batch_size", "256", "--no-dry-run",
    ]  # fmt: skip
    rc = plan_cli.main(argv)
    out = capsys.readouterr().out
    assert rc in (0, 1) and "OK: every layout rule holds" in out, out[:2000]  # 1: legal, memory over an H100's
    assert f"  pipeline split: {split}" in out
    per_pp = next(line for line in out.splitlines() if line.startswith("  per pp rank (GiB): "))
    blocks = [int(item.split(": ")[1].split()[0]) for item in per_pp.split("(GiB): ")[1].split(", ")]
    assert blocks == [int(b) for b in split.split(":")[0].split()[3:]]
    gib = [float(item.split()[-1]) for item in per_pp.split("(GiB): ")[1].split(", ")]
    # stage 0 (the embedding and the three dense blocks) is lighter than the other stages of as many blocks
    assert gib[0] < min(g for g, b in zip(gib[1:], blocks[1:]) if b == blocks[0])
