"""``apply_pp`` in a one-rank process group (pp = 1: one stage holding the whole model): the plumbing without
launching processes. The stage keeps the model's FQNs and values, a schedule step gives the plain model's loss
and gradients, and bf16 without FSDP makes each stage's forward autocast (the schedule interleaves forward and
backward, so the trainer cannot wrap the forward alone)."""

import pytest
import torch
import torch.distributed as dist

from titanlike.config import JobConfig
from titanlike.loss import cross_entropy_loss
from titanlike.models import ModelArgs, Transformer
from titanlike.parallel import ParallelDims
from titanlike.parallel.pipeline import apply_pp

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)


@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    dims.build_mesh("cpu")
    yield dims
    dist.destroy_process_group()


def _model(tied: bool = False) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS.replace(tie_embeddings=tied))
    model.init_weights()
    return model


def _cfg(dtype: str) -> JobConfig:
    cfg = JobConfig()
    cfg.training.dtype = dtype
    cfg.training.local_batch_size = 4
    cfg.parallelism.pipeline_parallel_microbatch_size = 2
    cfg.parallelism.pipeline_parallel_schedule = "GPipe"
    return cfg


@pytest.mark.parametrize("tied", [False, True])
def test_one_stage_pipeline_is_the_model(one_rank, tied):
    dims = one_rank
    model = _model(tied)
    pp = apply_pp(model, dims, _cfg("float32"), torch.device("cpu"))
    (stage,) = pp.model_parts
    assert pp.stage_ids == [0] and pp.has_first_stage and pp.has_last_stage
    assert dict(stage.named_parameters()).keys() == dict(model.named_parameters()).keys()
    assert pp.tied_sets == []  # one stage holding embedding and head: one tied parameter, nothing to sum
    if tied:
        assert stage.output.weight is stage.tok_embeddings.weight
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)
    pp.loss.denominator = 32.0
    losses = []
    pp.schedule.step(x, target=y, losses=losses)
    expected = cross_entropy_loss(model(x), y, reduction="sum") / 32.0
    expected.backward()
    torch.testing.assert_close(sum(losses), expected, rtol=1e-6, atol=0)  # microbatch losses add up: no 1/m
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, model.get_parameter(name).grad, rtol=1e-5, atol=1e-7)
    norm = pp.finalize_grads_and_clip_(list(stage.parameters()), 0.0)
    torch.testing.assert_close(norm.float(), torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    assert abs(pp.eval_loss(x, y).item() - 32.0 * expected.item()) < 1e-3


@pytest.mark.parametrize("dtype,compute", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_bf16_stages_autocast_over_float32_weights(one_rank, dtype, compute):
    dims = one_rank
    pp = apply_pp(_model(), dims, _cfg(dtype), torch.device("cpu"))
    (stage,) = pp.model_parts
    assert all(p.dtype == torch.float32 for p in stage.parameters())
    assert stage(torch.randint(0, 64, (2, 8))).dtype == compute


class _NoCopy(torch.nn.Linear):
    """A module that must never be copied (stands for the other stages' share of a large model)."""

    def __deepcopy__(self, memo):
        raise AssertionError("a module the stage does not keep was copied")


def test_a_user_split_stage_copies_only_what_it_keeps():
    from nanogpt import NanoGPT

    from titanlike.parallel.pipeline import build_stage

    torch.manual_seed(0)
    model = NanoGPT(vocab=64, block_size=8, d=16, n_head=2, n_layer=4)
    model.h[3].mlp.c_fc = _NoCopy(16, 64)
    split = [["wte", "wpe", "h.0", "h.1"], ["h.2", "h.3", "ln_f", "lm_head"]]
    first = build_stage(model, split[0])
    assert first.lm_head is None and first.ln_f is None and list(first.h._modules) == ["0", "1"]
    names = {n for n, _ in first.named_parameters()}
    assert names == {
        n
        for n, _ in model.named_parameters(remove_duplicate=False)
        if n.split(".")[0] in ("wte", "wpe") or n.startswith(("h.0.", "h.1."))
    }
    for n, p in first.named_parameters():
        original = model.get_parameter(n)
        assert torch.equal(p, original) and p.data_ptr() != original.data_ptr()  # a copy, equal
    with pytest.raises(AssertionError, match="was copied"):  # the trap works: stage 1 keeps h.3
        build_stage(model, split[1])
    model.h[3].mlp.c_fc = torch.nn.Linear(16, 64)
    last = build_stage(model, split[1])
    assert last.wte is None and list(last.h._modules) == ["2", "3"]
    assert torch.equal(last.lm_head.weight, model.wte.weight)  # the tied weight: this stage's own copy
