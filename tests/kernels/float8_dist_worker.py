"""float8 (torchao, emulated) composed with FSDP2 and TP on 2 gloo ranks, against float8 on one process.

Every rank builds the same seeded model, converts it with ``float8.recipe`` and trains it alone on the whole
global batch (the reference), then builds it again and trains it under each layout through titanlike's own
``parallelize_model`` (conversion included) for the same AdamW steps; prints one JSON line with the
per-step losses of the reference and of each layout, plus what the composition applied (the TP styles, whether
FSDP's weights are float8-all-gathered).

Run by ``test_float8.py``: ``python tests/kernels/float8_dist_worker.py CKPT_DIR`` prints ``RESULT {...}`` on rank 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: dist_utils

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dist_utils import spawn  # noqa: E402

from titanlike.config import JobConfig  # noqa: E402
from titanlike.models.llama import Transformer  # noqa: E402

STEPS = 4
# name -> (dp_shard, tp, sequence parallel, recipe, float8 all-gather + precompute, model)
LAYOUTS = {
    "fsdp2_tensorwise": (2, 1, False, "tensorwise", False, "llama3"),
    "fsdp2_tensorwise_f8allgather": (2, 1, False, "tensorwise", True, "llama3"),
    "tp2_tensorwise": (1, 2, False, "tensorwise", False, "llama3"),
    "tp2_sp_tensorwise": (1, 2, True, "tensorwise", False, "llama3"),
    "fsdp2_rowwise": (2, 1, False, "rowwise", False, "llama3"),
    "tp2_rowwise": (1, 2, False, "rowwise", False, "llama3"),
    "qwen3_tp2_tensorwise": (1, 2, False, "tensorwise", False, "qwen3"),
}


def _cfg(recipe: str, f8ag: bool, sp: bool) -> JobConfig:
    cfg = JobConfig()
    cfg.float8.recipe = recipe
    cfg.float8.emulate = True
    cfg.float8.enable_fsdp_float8_all_gather = f8ag
    cfg.float8.precompute_float8_dynamic_scale_for_fsdp = f8ag
    cfg.parallelism.enable_sequence_parallel = sp
    return cfg


def _model(name: str = "llama3") -> Transformer:
    """The seeded tiny Llama, or Qwen3 (q/k norms between the float8 projections; q 128 wide, dim 64)."""
    from titanlike.models import get_spec

    torch.manual_seed(0)
    spec = get_spec(name)
    args = spec.flavors["tiny"].replace(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    model = spec.build(args)
    model.init_weights()
    return model


def _batches(global_batch: int = 4, seq: int = 16):
    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, 128, (STEPS, global_batch, seq + 1), generator=g)
    return [(b[:, :-1], b[:, 1:]) for b in t]


def _train(model, loss_fn, batches, dp_rank: int, dp: int, micro: int = 1, after_step=None) -> list[float]:
    """AdamW steps on this rank's slice of each global batch, in ``micro`` accumulated micro-batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, foreach=True)
    losses = []
    for inputs, labels in batches:
        n = inputs.shape[0] // dp
        x, y = inputs[dp_rank * n : (dp_rank + 1) * n], labels[dp_rank * n : (dp_rank + 1) * n]
        opt.zero_grad()
        loss = 0.0
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            part = loss_fn(model(xm), ym) / labels.numel()  # sum(CE) / global tokens: gradients sum over dp
            part.backward()
            loss = loss + part.detach()
        opt.step()
        if after_step is not None:
            after_step(model)
        total = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(total)
        losses.append(float(total))
    return losses


def _checkpoint_into_plain(model, dims, ckpt_dir: str) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from titanlike.parallel import parallelize_model

    sd = get_model_state_dict(model)
    dcp.save(sd, checkpoint_id=ckpt_dir)
    plain = parallelize_model(_model(), dims, JobConfig())  # no float8
    target = get_model_state_dict(plain)
    assert sorted(target) == sorted(sd), "float8 changed the state-dict keys"
    dcp.load(target, checkpoint_id=ckpt_dir)
    set_model_state_dict(plain, target)
    a, b = get_model_state_dict(model), get_model_state_dict(plain)
    return max(float((_full(a[k]) - _full(b[k])).abs().max()) for k in a)


def _full(t):
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.to_original_precision() if hasattr(t, "to_original_precision") else torch.as_tensor(t)


def worker(rank: int, world_size: int, ckpt_dir: str) -> None:
    from titanlike.kernels.float8 import is_float8_linear, precompute_float8_scales
    from titanlike.parallel import ParallelDims, build_loss_fn, parallelize_model

    batches = _batches()
    out: dict = {"reference": {}, "layouts": {}}
    one = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    for name, recipe, micro in [
        *(("llama3", r, m) for r in ("tensorwise", "rowwise") for m in (1, 2)),  # whole batch, or the dp halves
        ("qwen3", "tensorwise", 1),
    ]:
        cfg = _cfg(recipe, False, False)
        model = parallelize_model(_model(name), one, cfg)
        key = f"{'' if name == 'llama3' else name + '_'}{recipe}_micro{micro}"
        out["reference"][key] = _train(model, build_loss_fn(cfg, one), batches, 0, 1, micro)
        out.setdefault("converted", {}).setdefault(name, sorted(model._float8_converted))
    built: dict = {}  # mesh shape -> ParallelDims with its meshes (one set of process groups per shape)
    for name, (dp, tp, sp, recipe, f8ag, model_name) in LAYOUTS.items():
        if rank == 0:
            print(f"layout {name}", file=sys.stderr, flush=True)
        dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, world_size=world_size)
        if dims.shape not in built:
            dims.build_mesh("cpu")
            built[dims.shape] = dims
        dims = built[dims.shape]
        cfg = _cfg(recipe, f8ag, sp)
        model = parallelize_model(_model(model_name), dims, cfg)
        wq = model.layers["0"].attention.wq
        seen = []  # what reaches wq after the TP input hook: float8 styles hand it a float8 (DTensor) tensor
        wq.register_forward_pre_hook(
            lambda m, a, seen=seen: seen.append(type(getattr(a[0], "_local_tensor", a[0])).__name__)
        )
        local_w = wq.weight._local_tensor if hasattr(wq.weight, "_local_tensor") else wq.weight
        info = {"float8_linear": is_float8_linear(wq), "weight_kind": type(local_w).__name__, "wq_input": None}
        dp_rank = dims.get_mesh("dp_shard_cp").get_local_rank() if dp > 1 else 0
        loss_fn = build_loss_fn(cfg, dims)
        losses = _train(model, loss_fn, batches, dp_rank, dp, after_step=precompute_float8_scales if f8ag else None)
        info["wq_input"] = seen[0]
        if f8ag:  # DCP round trip: the float8 (all-gather) model's checkpoint loads into a plain FSDP model
            info["checkpoint_max_diff"] = _checkpoint_into_plain(model, dims, ckpt_dir)
        ref = f"{'' if model_name == 'llama3' else model_name + '_'}{recipe}_micro{dp}"
        out["layouts"][name] = {"recipe": recipe, "dp": dp, "reference": ref, "losses": losses, **info}
        dist.barrier()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(spawn(worker, 2, sys.argv[1], timeout_s=120.0))
