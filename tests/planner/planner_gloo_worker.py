"""Gloo ranks that run titanlike's real parallelisms and compare what they do with what the planner predicts.

For every case (a layout of 4 ranks on a small model), each rank parallelizes the model with
``parallelize_model``, runs one forward + loss + backward under a ``CommDebugMode`` that also records each
collective's size and group, takes one optimizer step, and then compares:

* per (dim, op, phase): the number of collectives and their total size against ``planner.messages``;
* the bytes it holds in parameters, gradients and AdamW states against ``planner.rank_memory``.

Rank 0 writes ``{"cases": {name: {rank: {...}}}}`` (every rank's measured and planned numbers) to the JSON file
named on the command line; tests/test_planner_gloo.py asserts on it. The ranks are fresh interpreters (one
``python`` per rank, like torchrun without its start-up cost), not forks of a parent that runs threads.

    python tests/planner_gloo_worker.py OUT.json
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

WORLD = 4
# name -> config overrides (small model: the model section is set below)
CASES = {
    "tp2_sp_fsdp2_bf16": [
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.enable_sequence_parallel",
        "--training.dtype",
        "bfloat16",
    ],
    "tp2_fsdp2_fp32_fullac_chunked": [
        "--parallelism.tensor_parallel_degree",
        "2",
        "--activation_checkpoint.mode",
        "full",
        "--parallelism.loss_chunk_size",
        "24",
    ],
    "hsdp2x2_bf16_accum2": [
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--training.dtype",
        "bfloat16",
        "--training.global_batch_size",
        "16",
    ],
    "tp2_sp_fsdp2_bf16_ac_every2": [
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.enable_sequence_parallel",
        "--training.dtype",
        "bfloat16",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "2",
    ],
    "tp2_sp_fsdp2_selective_always": [
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.enable_sequence_parallel",
        "--activation_checkpoint.mode",
        "selective",
        "--parallelism.fsdp_reshard_after_forward",
        "always",
    ],
    "pp2_fsdp2_1f1b_bf16_tied": [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--training.dtype",
        "bfloat16",
        "--training.local_batch_size",
        "4",
        "--model.tie_embeddings",
        "true",
        "--model.n_layers",
        "4",
    ],
    "pp2_tp2_sp_interleaved_accum2": [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.enable_sequence_parallel",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "8",
        "--model.n_layers",
        "4",
    ],
    "cp2_fsdp2": ["--parallelism.context_parallel_degree", "2"],
    "cp2_tp2_sp_fullac": [
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.enable_sequence_parallel",
        "--activation_checkpoint.mode",
        "full",
    ],
    # Qwen3-MoE (layer 0 dense, layer 1 MoE: 8 experts, top-2, the bias and the sequence-wise aux loss on), routed
    # round-robin (titanlike.models.moe.balanced_routing: the planner's balanced load), experts over ep
    "moe_ep2_fsdp4_bf16": ["--parallelism.expert_parallel_degree", "2", "--training.dtype", "bfloat16"],
    "moe_tp2_sp_ep4_fsdp2_fullac": [
        "--parallelism.expert_parallel_degree",
        "4",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.enable_sequence_parallel",
        "--activation_checkpoint.mode",
        "full",
    ],
    # gpt-oss (a sliding-window layer, window 4 of 16 positions, and a full one): under cp2 the windowed layer
    # all-gathers the last 3 keys / values of each chunk (2 cp x 3 tokens), the full one all 16
    "gpt_oss_cp2_fsdp2": ["--parallelism.context_parallel_degree", "2"],
    # Qwen3-Next (a Gated DeltaNet layer, a gated attention one, MoE): the state maps and conv halos on the cp group
    # beside the attention layer's K/V, recomputed under full AC, FSDP over dp_shard x cp
    "qnext_cp2_fsdp2_fullac": ["--parallelism.context_parallel_degree", "2", "--activation_checkpoint.mode", "full"],
    "pp2_moe_ep2_1f1b": [  # stage 0: the dense layer and an MoE one, stage 1: two MoE layers
        "--parallelism.expert_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--model.n_layers",
        "4",
    ],
    # DeepSeek-V3 tiny (MLA, a dense and an MoE layer, one MTP depth with an MoE block on the last stage) under
    # TP+SP 2 x ep 4 x FSDP 2 (ep borrowing tp): the MTP depth's block, norms, projection, head and loss
    # collectives beside the decoder blocks'
    "ds_mtp_tp2_sp_ep4_fsdp2": [
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.enable_sequence_parallel",
        "--parallelism.expert_parallel_degree",
        "4",
    ],
    # DeepSeek-V3 tiny with one MTP depth under CP 2 x FSDP 2: the latent gathers of the three blocks, the window's
    # token ids and the depth's labels gathered
    "ds_mtp_cp2_fsdp2": ["--parallelism.context_parallel_degree", "2"],
    # context parallelism by all-to-all over heads (Ulysses): q, k, v and the output of every block through 4
    # all-to-alls forward and 4 backward; at cp 4 Llama's 2 kv heads repeated to 4; under full AC with tp 2 + SP
    # (a tp rank's 2 heads split over cp 2, its one kv head repeated to 2) the forward's 4 again in the backward;
    # gpt-oss under block_causal (the document starts gathered once per forward); DeepSeek-V3 (MLA: the expanded
    # heads travel, q and k 24 wide, v 16) with its MTP depth's block
    "a2a_cp4": ["--parallelism.context_parallel_degree", "4", "--parallelism.context_parallel_method", "alltoall"],
    "a2a_cp2_tp2_sp_fullac": [
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_method",
        "alltoall",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.enable_sequence_parallel",
        "--activation_checkpoint.mode",
        "full",
    ],
    "gpt_oss_a2a_block_cp2_fsdp2": [
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_method",
        "alltoall",
        "--model.attn_mask_type",
        "block_causal",
    ],
    # ring attention: K and V (then dK, dV) blocks sent to the ranks of the steps a block needs; at cp 4, under
    # tp 2 + SP with op AC (the ring rerun in the recomputation), MLA's latent and RoPE key, and gpt-oss at cp 4 with
    # a window of 2 (one chunk): its windowed layer sends 2 blocks where the full one sends 3
    "ring_cp4": ["--parallelism.context_parallel_degree", "4", "--parallelism.context_parallel_method", "ring"],
    "gpt_oss_ring_cp4": [
        "--parallelism.context_parallel_degree",
        "4",
        "--parallelism.context_parallel_method",
        "ring",
        "--model.sliding_window",
        "2",
    ],
    "ring_cp2_tp2_sp_opac": [
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_method",
        "ring",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.enable_sequence_parallel",
        "--activation_checkpoint.mode",
        "selective",
    ],
    "ds_ring_cp2_fsdp2": [
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_method",
        "ring",
        "--model.mtp_layers",
        "0",
    ],
    "ds_mtp_a2a_cp2_fsdp2": [
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_method",
        "alltoall",
    ],
    # hybrid: all-to-all in groups of 2 ranks, a ring across the 2 groups, under block_causal (the group's document
    # starts gathered once per forward)
    "hybrid_block_cp4_a2a2": [
        "--parallelism.context_parallel_degree",
        "4",
        "--parallelism.context_parallel_method",
        "hybrid",
        "--parallelism.context_parallel_a2a_degree",
        "2",
        "--model.attn_mask_type",
        "block_causal",
    ],
}
MOE = ["--model.name", "qwen3_moe"]
DS = [
    "--model.name",
    "deepseek_v3",
    "--model.flavor",
    "tiny",
    "--model.max_seq_len",
    "32",
    "--training.seq_len",
    "16",
    "--training.local_batch_size",
    "2",
]
QNEXT = ["--model.name", "qwen3_next"]
MODEL = [
    "--model.flavor",
    "tiny",
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "2",
    "--model.ffn_hidden_dim",
    "96",
    "--model.max_seq_len",
    "32",
    "--training.seq_len",
    "16",
    "--training.local_batch_size",
    "2",
]
VOCAB = 250  # with vocab_multiple 2: 250 rows, uneven FSDP chunks under tp 2 x dp_shard 2 (125 -> 63 / 62)


def case_config(name: str):
    from titanlike.config import model_args_from_config, parse_config

    model = MODEL
    if name.startswith("gpt_oss"):  # its own tiny shapes (window 4, biased clamped experts: no ffn_hidden_dim)
        model = ["--model.name", "gpt_oss", *[a for a in MODEL if a not in ("--model.ffn_hidden_dim", "96")]]
    if name.startswith("ds_"):  # its own tiny shapes (MLA widths, the MTP depth)
        model = DS
    extra = MOE if "moe" in name else QNEXT if "qnext" in name else []
    cfg = parse_config(extra + model + ["--model.vocab_multiple", "2"] + CASES[name])
    return cfg, model_args_from_config(cfg, VOCAB)


def _recorder():
    """A dispatch mode that records (op, bytes, group ranks, phase) of every collective and pipeline send.

    CommDebugMode counts the same collectives but its module tracker does not survive a pipeline schedule
    (multi-grad hooks under ``autograd.grad``), so it runs alongside, outside pipelines, as a cross-check.
    The phase is "backward" while the autograd engine runs a graph task.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    c10d = dist.distributed_c10d
    ops = {
        torch.ops._c10d_functional.all_gather_into_tensor,
        torch.ops._c10d_functional.reduce_scatter_tensor,
        torch.ops._c10d_functional.all_reduce,
        torch.ops._c10d_functional.all_to_all_single,
        torch.ops.c10d._allgather_base_,
        torch.ops.c10d._reduce_scatter_base_,
        torch.ops.c10d.allreduce_,
        torch.ops.c10d.send,
    }

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.records = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is DTensor for t in types):  # let DTensor run the op with this mode on: its redistributions
                return NotImplemented  # inside the op (e.g. Replicate += Partial) are collectives too
            if func._overloadpacket in ops:
                phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
                # FSDP issues c10d ops, TP / SP and CP functional ones: that tells a cp group from FSDP's
                # dp_shard_cp group when dp_shard is 1 (the same ranks).
                functional = "_c10d_functional" in str(func)
                self.records.append((*_describe(func, args, phase, c10d), functional))
            return func(*args, **(kwargs or {}))

    return Recorder()


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _describe(func, args, phase: str, c10d) -> tuple[str, int, tuple[int, ...], str]:
    name = func._overloadpacket.__name__
    if name == "all_gather_into_tensor":  # functional: (input, group_size, group_name)
        pg = c10d._resolve_process_group(args[2])
        return "all_gather", _nbytes(args[0]) * args[1], tuple(c10d.get_process_group_ranks(pg)), phase
    if name == "reduce_scatter_tensor":  # (input, op, group_size, group_name)
        pg = c10d._resolve_process_group(args[3])
        return "reduce_scatter", _nbytes(args[0]), tuple(c10d.get_process_group_ranks(pg)), phase
    if name == "all_reduce":  # (input, op, group_name)
        pg = c10d._resolve_process_group(args[2])
        return "all_reduce", _nbytes(args[0]), tuple(c10d.get_process_group_ranks(pg)), phase
    if name == "all_to_all_single":  # (input, output_split_sizes, input_split_sizes, group_name): bytes sent away
        pg = c10d._resolve_process_group(args[3])
        ranks, rows = tuple(c10d.get_process_group_ranks(pg)), args[0].shape[0]
        kept = args[2][pg.rank()] if args[2] else rows // len(ranks)
        return "all_to_all", _nbytes(args[0]) * (rows - kept) // max(rows, 1), ranks, phase

    def ranks(script_pg):  # c10d ops carry the process group as a TorchScript object
        return tuple(c10d.get_process_group_ranks(c10d.ProcessGroup.unbox(script_pg)))

    if name == "_allgather_base_":  # c10d: (output, input, pg, ...)
        return "all_gather", _nbytes(args[0]), ranks(args[2]), phase
    if name == "_reduce_scatter_base_":  # (output, input, pg, ...)
        return "reduce_scatter", _nbytes(args[1]), ranks(args[2]), phase
    if name == "send":  # (tensors, pg, dst, tag): pipeline p2p, which CommDebugMode does not count
        return "send", sum(map(_nbytes, args[0])), ranks(args[1]), phase
    if name == "allreduce_":  # (tensors, pg, ...)
        return "all_reduce", sum(map(_nbytes, args[0])), ranks(args[1]), phase
    raise AssertionError(f"collective {func} not described")


def _key(dim: str, op: str, phase: str, pipelined: bool) -> str:
    """Comparison key. The phase of a pipeline send, and of FSDP's reductions that the pipeline schedule issues
    after the last backward ("step" in the plan), cannot be told apart from a forward by the autograd state."""
    if op == "send" or (pipelined and dim.startswith("dp")):
        phase = "any"
    return f"{dim} {op} {phase}"


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    return _nbytes(t.to_local() if isinstance(t, DTensor) else t)


def run_case(rank: int, name: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from titanlike.loss import ScaledLoss
    from titanlike.models import spec_for
    from titanlike.models.moe import MoE, balanced_routing, set_aux_loss_denominator
    from titanlike.parallel import ParallelDims, build_loss_fn, parallelize_model, rank_groups
    from titanlike.parallel.build import mtp_loss
    from titanlike.parallel.expert_parallel import ExpertBalancing
    from titanlike.planner.cost import messages
    from titanlike.planner.layout import Layout
    from titanlike.planner.memory import rank_memory
    from titanlike.training.optim import build_optimizer

    cfg, args = case_config(name)
    layout = Layout.from_config(cfg, WORLD, args, gpus_per_node=WORLD)
    dims = ParallelDims.from_config(cfg, WORLD)
    dims.build_mesh("cpu")
    dim_of = {}
    for dim in ("tp", "cp", "dp_shard_cp" if dims.cp > 1 else "dp_shard", "dp_replicate", "pp"):
        for g in rank_groups(dims, dim):
            if rank in g and len(g) > 1:
                dim_of.setdefault(tuple(g), []).append(dim)
    if dims.cp > 1 and cfg.parallelism.context_parallel_method == "hybrid":  # its all-to-all and ring groups: cp's
        from titanlike.parallel.context_parallel import hybrid_meshes

        for mesh in hybrid_meshes(dims.get_mesh("cp"), cfg.parallelism.context_parallel_a2a_degree):
            dim_of.setdefault(tuple(dist.get_process_group_ranks(mesh.get_group())), []).append("cp")
    for dim in ("dp_shard_mod_ep", "dp_shard_cp_tp") if dims.ep > 1 else ():  # the experts' and MoE blocks' FSDP
        if dim != "dp_shard_cp_tp" or dims.ep_tp > 1:
            g = tuple(dist.get_process_group_ranks(dims.get_mesh(dim).get_group()))
            if len(g) > 1:
                dim_of.setdefault(g, []).append(dim)

    torch.manual_seed(0)
    model = spec_for(args).build(args)
    model.init_weights()
    layers = [n for n, m in model.named_modules() if isinstance(m, MoE)]  # before pp cuts the stages
    pp = None
    if dims.pp > 1:
        from titanlike.parallel.pipeline import apply_pp

        pp = apply_pp(model, dims, cfg, torch.device("cpu"))
        parts = pp.model_parts
    else:
        parts = [parallelize_model(model, dims, cfg)]
        loss_fn = mtp_loss(ScaledLoss(build_loss_fn(cfg, dims)), model, cfg, dims)  # the MTP depths' losses too
    optimizer = build_optimizer(parts, cfg)
    for part in parts:  # an MoE model's sequence-wise aux loss: the global batch's sequences
        set_aux_loss_denominator(part, cfg.training.local_batch_size * dims.dp)
    g = torch.Generator().manual_seed(rank // (dims.tp * dims.cp) % dims.dp)
    if dims.cp > 1:  # every cp rank draws its dp rank's batch and keeps its two chunks of each row
        from titanlike.parallel.context_parallel import cp_shard

        cp_mesh = dims.get_mesh("cp")
        cut = lambda t: cp_shard(t, cp_mesh.size(), cp_mesh.get_local_rank())  # noqa: E731
    else:
        cut = lambda t: t  # noqa: E731
    shape = (cfg.training.local_batch_size, cfg.training.seq_len)
    measured, comm_debug, recorded = defaultdict(lambda: [0, 0]), 0, 0
    # CommDebugMode's module tracker registers a forward hook on every call of a module, so a module called twice
    # in one forward (the shared head of MTP depths) pops its parent list twice and raises (torch 2.13): the
    # recorder alone counts those models
    # (nor the ring over MLA's latent: it calls the up-projection once per ring step, the same failure)
    ring_latent = cfg.parallelism.context_parallel_method == "ring" and getattr(args, "cp_gathered", None)
    cross_check = pp is None and not getattr(args, "mtp_layers", 0) and not ring_latent

    def run(fn, phase=None, named=None):  # named: ranks -> dim, for groups that are no mesh dim of dim_of
        nonlocal comm_debug, recorded
        recorder = _recorder()
        if cross_check:  # CommDebugMode's own count must agree with the recorder's
            cdm = CommDebugMode()
            with cdm, recorder, balanced_routing():
                fn()
            comm_debug += cdm.get_total_counts()
            recorded += sum(op != "send" for op, *_ in recorder.records)
        else:
            with recorder, balanced_routing():
                fn()
        for op, nbytes, ranks, is_phase, functional in recorder.records:
            if op == "all_to_all" and dims.ep > 1:  # expert parallelism's dispatch, combine and counts
                measured[f"ep all_to_all {phase or is_phase}"][0] += 1
                measured[f"ep all_to_all {phase or is_phase}"][1] += nbytes
                continue
            if len(ranks) == 1:  # a group of one (the experts' FSDP when ep takes every token rank)
                continue
            dims_here = [named[ranks]] if ranks in (named or {}) else dim_of[ranks]
            dim = dims_here[0] if len(dims_here) == 1 else ("cp" if functional else dims_here[-1])
            if op == "send" and "cp" in dims_here:  # ring attention's blocks (FSDP sends nothing point to point)
                dim = "cp"
            key = _key(dim, op, phase or is_phase, pp is not None)
            measured[key][0] += 1
            measured[key][1] += nbytes

    if pp is not None:  # the first schedule step also infers the stages' shapes (meta forwards, object sends)
        x = torch.randint(0, args.vocab_size, shape, generator=g)
        pp.schedule.step(x, target=x if pp.has_last_stage else None, losses=[])
        for part in parts:
            part.zero_grad(set_to_none=True)
    for _ in range(layout.accum_steps):  # one CommDebugMode per pass: its module tracker handles one forward
        x = torch.randint(0, args.vocab_size, shape, generator=g)
        y = torch.randint(0, args.vocab_size, shape, generator=g)
        if pp is None:
            docs = {}
            if cfg.model.attn_mask_type == "block_causal":  # packed documents: token 1 ends one
                from titanlike.models.masking import document_starts

                docs = {"document_starts": cut(document_starts(x, 1))}
            run(lambda: loss_fn(parts[0](cut(x), **docs), cut(y)).backward())
        else:
            run(lambda: pp.schedule.step(x, target=y if pp.has_last_stage else None, losses=[]))
    if pp is not None:
        run(pp.finalize_grads, "step")
    optimizer.step()
    if layers:  # the step's MoE balancing, as train_step ends it (ExpertBalancing.end_step)
        group = dims.expert_load_group()
        balancing = ExpertBalancing(
            parts, group, dims.dp, layers=layers, num_experts=args.num_experts, pp_group=pp and pp.pp_group
        )
        named = {tuple(dist.get_process_group_ranks(group)): dims.expert_load_dim} if group is not None else {}
        run(balancing.end_step, "step", named)
    planned = defaultdict(lambda: [0, 0])
    for m in messages(layout, args, rank):
        key = _key(m.dim, m.op, m.phase, pp is not None)
        planned[key][0] += m.count
        planned[key][1] += m.count * m.nbytes
    params = [p for part in parts for p in part.parameters()]
    held = {
        "parameters": sum(_local_bytes(p) for p in params),
        "gradients": sum(_local_bytes(p.grad) for p in params),
        "optimizer": sum(_local_bytes(v) for p in params for v in optimizer.state[p].values()),
    }
    plan_mem = {it.name: it.bytes for it in rank_memory(layout, args, rank) if it.name in held}
    return {
        "measured": dict(measured),
        "planned": dict(planned),
        "held": held,
        "plan_memory": plan_mem,
        "comm_debug_total": comm_debug if cross_check else None,
        "recorded_total": recorded if cross_check else None,
    }


def main(rank: int, world_size: int, out_path: str) -> None:
    import torch.distributed as dist

    results = {name: run_case(rank, name) for name in CASES}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out_path).write_text(
            json.dumps({"cases": {name: {str(r): gathered[r][name] for r in range(world_size)} for name in CASES}})
        )


def _rank_entry(rank: int, world_size: int, port: int, out_path: str) -> None:
    """One rank: a gloo group through a TCPStore hosted by rank 0, a short timeout, ``os._exit`` at the end."""
    code = 1
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=90)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        main(rank, world_size, out_path)
        dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: BLE001 - report anything, exit non-zero
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch(out_path: str, timeout_s: float = 240.0) -> int:
    """Start WORLD fresh interpreters (no fork of a process with threads), wait, kill the rest if one fails."""
    import subprocess
    import time

    from dist_utils import unused_port  # below the ephemeral range: no other job's connection can take it first

    port = unused_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(port), out_path], env=env)
        for r in range(WORLD)
    ]
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    return 0 if all(p.wait() == 0 for p in procs) else 1


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        _rank_entry(int(sys.argv[2]), WORLD, int(sys.argv[3]), sys.argv[4])
    sys.exit(launch(sys.argv[1]))
