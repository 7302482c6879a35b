"""Generation under tensor parallelism (2 gloo ranks, in the session's shared 2-rank launch: ``shared_launch``): each
tiny model saved by rank 0 as a DCP seed checkpoint and a Hugging Face folder, loaded tp2 by ``load_model``
(``tp_mesh``), greedy and sampled tokens against the same model in one process; the MoE model's refusal."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from titanlike.errors import ConfigError

PROMPTS = [[5, 9, 33, 2, 7, 61], [100, 3], [8, 8, 8, 9, 10, 11, 12, 1, 77]]
NEW = 8


def _tiny(name: str):
    from titanlike.models import get_spec

    spec = get_spec(name)
    args = spec.flavors["tiny"].replace(vocab_size=256)
    model = spec.build(args)
    model.init_weights(seed=7)
    return model.eval(), args


def rank_main(rank: int, world_size: int, out: str) -> None:
    from titanlike.checkpoint import write_seed_checkpoint
    from titanlike.generate import Sampling, generate, load_model
    from titanlike.hf import save_hf

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    root = Path(out).parent / "generate-tp"
    hot = Sampling(temperature=1.2, top_k=20, top_p=0.9, seed=5)
    results = {}
    for name in ("llama3", "gpt2", "qwen3"):
        model, args = _tiny(name)
        if rank == 0:
            write_seed_checkpoint(dict(model.state_dict()), args, root / f"{name}-dcp")
            save_hf(model.state_dict(), args, root / f"{name}-hf")
        dist.barrier()
        tp = load_model(root / f"{name}-dcp", tp_mesh=mesh).model
        tp_hf = load_model(root / f"{name}-hf", tp_mesh=mesh).model
        results[name] = {
            "sharded": all(isinstance(p, DTensor) for p in tp.parameters())
            and any(p.to_local().numel() < p.numel() for p in tp.parameters()),
            "single_greedy": generate(model, PROMPTS, NEW),
            "single_sampled": generate(model, PROMPTS, NEW, sampling=hot),
            "tp_greedy": generate(tp, PROMPTS, NEW),
            "tp_sampled": generate(tp, PROMPTS, NEW, sampling=hot),
            "tp_hf_greedy": generate(tp_hf, PROMPTS, NEW),
        }
    model, args = _tiny("qwen3_moe")
    if rank == 0:
        write_seed_checkpoint(dict(model.state_dict()), args, root / "moe-dcp")
    dist.barrier()
    try:
        load_model(root / "moe-dcp", tp_mesh=mesh)
        results["qwen3_moe_refusal"] = ""
    except ConfigError as e:
        results["qwen3_moe_refusal"] = str(e)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":  # alone: python tests/generate/generate_worker.py
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dist_utils import spawn

    target = Path(tempfile.mkdtemp()) / "generate2.json"
    rc = spawn(rank_main, 2, str(target), timeout_s=60)
    print(target.read_text() if rc == 0 else "failed")
    sys.exit(rc)
