"""Two-rank probes of the parallel layer, one launch (``test_parallel_probes.py`` asserts on the JSON it writes).

* ``comms``: CommDebugMode counts (and bytes) of the collectives of ONE transformer block's forward and
  backward under tp 2, with and without SP, and of the whole model's training step (embedding, blocks, head,
  loss) for the plan variants.
* ``user_module``: a differently written module (other names, biases, LayerNorm) parallelized with a user
  plan via ``apply_tp``, and with ``apply_fsdp``, trained against one device.
* ``mixed_precision``: ``parallelize_model`` with ``training.dtype = bfloat16`` under FSDP: bf16 compute,
  fp32 master weights and gradients.
* ``clip_pp``: ``clip_grad_norm_`` over two "stages" holding different parameters, with and without the
  cross-stage reduction.
* ``fused``: a user module with a fused q|k|v and a fused gate|up Linear (with biases) under
  ``FusedColwiseParallel``: full_tensor() in the single-device order, the same collectives as the unfused twin's
  plan, training equal to one device, and a DCP checkpoint written at tp 2 read back in one process in order.
* ``fused_gqa``: the same block with grouped-query attention (q|k|v = 16|8|8, unequal chunks: tp-replicated, each
  rank cutting its rows in the forward) under tp 2 and tp 2 + SP: training equal to one device, the unfused
  plan's collectives plus the two gradient all-reduces it costs, DCP round trips, and two planted mutations.
  Its tp 2 x fsdp 2 twin (:func:`probe_fused_gqa_fsdp`) runs in the gate's 4-rank launch (tests/parallel/gate.py).
* ``errors``: apply_tp's errors for a plan key that matches nothing and for tied weights sharded differently, and
  the silent no-ops refused at apply_* time (no default plan, a module left out of a plan, FSDP without blocks).

    python tests/parallel/tp_probe_worker.py OUT.json
"""

from __future__ import annotations

import copy
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gate import GLOBAL_BATCH, Layout, build_model, config, global_batch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402
from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: E402

from titanlike.loss import ScaledLoss
from titanlike.parallel import (  # noqa: E402
    ParallelDims,
    apply_fsdp,
    apply_tp,
    build_loss_fn,
    parallelize_model,  # noqa: E402
)
from titanlike.parallel.tensor_parallel import ReplicateParallel  # noqa: E402
from titanlike.training.step import count_tokens  # noqa: E402


class BytesCommDebugMode(CommDebugMode):
    """CommDebugMode that also records, per collective, the bytes of the full (unsharded) tensor it reduces or
    gathers: all-reduce and reduce-scatter inputs, all-gather outputs."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented or isinstance(func, torch._ops.HigherOrderOperator):
            return out
        packet = func._overloadpacket
        if packet in self.comm_registry or packet in c10d_collective_ops:
            name = _canonical(packet.__name__)
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            nbytes = first.numel() * first.element_size()
            if name == "all_gather_into_tensor":
                nbytes *= args[1] if isinstance(args[1], int) else args[1].size()
            elif name not in ("all_reduce", "reduce_scatter_tensor", "all_to_all_single"):  # the input's bytes
                nbytes = -1  # anything else is reported (and fails the exact-count checks)
            self.records.append((name, nbytes))
        return out

    def summary(self) -> dict[str, list[int]]:
        """``{collective: [count, total bytes]}``."""
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for name, nbytes in self.records:
            out[name][0] += 1
            out[name][1] += nbytes
        return dict(out)


def _canonical(name: str) -> str:
    return {
        "allreduce_": "all_reduce",
        "_reduce_scatter_base_": "reduce_scatter_tensor",
        "_allgather_base_": "all_gather_into_tensor",
    }.get(name, name)


_DIMS: dict = {}  # mesh shape -> ParallelDims with its meshes: one set of process groups per shape in this worker


def built_dims(dims):
    """``dims`` with its meshes built, the same object (and groups) for every later request of its shape."""
    if dims.shape not in _DIMS:
        dims.build_mesh("cpu")
        _DIMS[dims.shape] = dims
    return _DIMS[dims.shape]


def _tp_args(*extra):
    return (
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--training.local_batch_size",
        str(GLOBAL_BATCH),
        *extra,
    )


def _tp2_model(sp: bool, lp: bool):
    extra = (("--parallelism.enable_sequence_parallel", "true") if sp else ()) + (
        () if lp else ("--parallelism.disable_loss_parallel", "true")
    )
    cfg = config(Layout("probe", 2, _tp_args(*extra)), 2)
    dims = built_dims(ParallelDims.from_config(cfg, 2))
    model = parallelize_model(build_model(cfg), dims, cfg)
    return cfg, dims, model


def probe_comms() -> dict:
    out = {}
    inputs, labels = global_batch(1)
    for sp in (False, True):
        cfg, dims, model = _tp2_model(sp, lp=True)
        block = model.layers["0"]
        h = model.tok_embeddings(inputs).detach().requires_grad_()
        with BytesCommDebugMode() as fwd:
            y = block(h, **model.block_kwargs(model.positions(h)))  # the RoPE rows, as the model hands them
        with BytesCommDebugMode() as bwd:
            y.to_local().sum().backward()
        out[f"block sp={sp}"] = {"forward": fwd.summary(), "backward": bwd.summary()}
    for sp, lp in ((False, True), (True, True), (False, False), (True, False)):
        cfg, dims, model = _tp2_model(sp, lp)
        loss = ScaledLoss(build_loss_fn(cfg, dims))
        loss.denominator = count_tokens([(inputs, labels)])
        with BytesCommDebugMode() as fwd:
            value = loss(model(inputs), labels)
        with BytesCommDebugMode() as bwd:
            value.backward()
        out[f"model sp={sp} lp={lp}"] = {"forward": fwd.summary(), "backward": bwd.summary()}
    return out


class UserMLP(nn.Module):
    """Not the Llama block: other names, biases, a LayerNorm, GELU gating."""

    def __init__(self, d: int = 16, h: int = 32):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.gate = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        x = self.ln(x)
        return self.down(F.gelu(self.up(x)) * self.gate(x))


USER_PLAN = {"ln": ReplicateParallel(), "up": ColwiseParallel(), "gate": ColwiseParallel(), "down": RowwiseParallel()}


def _full(t):
    """The whole tensor; a chunk-sharded one through titanlike's gather (torch 2.11's ``full_tensor()`` refuses its
    ``_StridedShard``: probe_fused records that)."""
    from titanlike.parallel.fused import gather_strided, is_strided

    if not isinstance(t, DTensor):
        return t
    return (gather_strided(t) if is_strided(t) else t).full_tensor()


def _train_user(model, batches, n_total, dp_group=None, steps=3, forward=None):
    """AdamW on sum((out - y)^2) / n_total; returns (loss, grads, weights) per step, gathered to full tensors.
    ``forward``: how to call the model (default: ``model``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, foreach=True)
    history = []
    for x, y in batches[:steps]:
        opt.zero_grad()
        out = (forward or model)(x)
        loss = ((out - y) ** 2).sum() / n_total
        loss.backward()
        total = loss.detach().clone()
        if dp_group is not None:
            dist.all_reduce(total, group=dp_group)
        grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
        history.append((total, grads, {n: _full(p).detach().clone() for n, p in model.named_parameters()}))
    return history


def _max_diff(h1, h2) -> float:
    worst = 0.0
    for (l1, g1, w1), (l2, g2, w2) in zip(h1, h2, strict=True):
        worst = max(worst, abs(float(l1) - float(l2)))
        for n in g2:
            worst = max(worst, (g1[n] - g2[n]).abs().max().item(), (w1[n] - w2[n]).abs().max().item())
    return worst


def probe_user_module() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = UserMLP().double()
    g = torch.Generator().manual_seed(5)
    batches = [
        (
            torch.randn(8, 5, 16, generator=g, dtype=torch.float64),
            torch.randn(8, 5, 16, generator=g, dtype=torch.float64),
        )
        for _ in range(3)
    ]
    n_total = batches[0][1].numel()
    one_device = _train_user(copy.deepcopy(reference), batches, n_total)
    # TP 2 with the user's plan: same batches on both ranks.
    tp_dims = built_dims(ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, world_size=2))
    tp_model = apply_tp(copy.deepcopy(reference), tp_dims.get_mesh("tp"), USER_PLAN)
    placements = {
        n: [str(x) for x in p.placements] if isinstance(p, DTensor) else "plain" for n, p in tp_model.named_parameters()
    }
    tp_diff = _max_diff(_train_user(tp_model, batches, n_total), one_device)
    # FSDP 2: each rank trains on half of every batch (the loss still divides by the global count).
    dp_dims = built_dims(ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, world_size=2))
    dp_mesh = dp_dims.get_mesh("dp_shard_cp")
    model = copy.deepcopy(reference)
    fsdp_model = apply_fsdp(model, dp_mesh, blocks=[model.down])
    halves = [(x.chunk(2)[rank], y.chunk(2)[rank]) for x, y in batches]
    fsdp_diff = _max_diff(_train_user(fsdp_model, halves, n_total, dp_group=dp_mesh.get_group()), one_device)
    return {"tp_diff": tp_diff, "fsdp_diff": fsdp_diff, "tp_placements": placements}


def probe_mixed_precision() -> dict:
    """FSDP 2 with training.dtype = bfloat16: bf16 forward, fp32 sharded parameters and gradients."""
    cfg = config(
        Layout(
            "bf16",
            2,
            (
                "--training.dtype",
                "bfloat16",
                "--parallelism.data_parallel_shard_degree",
                "2",
                "--training.local_batch_size",
                "4",
            ),
        ),
        2,
    )
    dims = built_dims(ParallelDims.from_config(cfg, 2))
    reference = build_model(cfg).float()
    model = parallelize_model(copy.deepcopy(reference), dims, cfg)
    inputs, labels = global_batch(1)
    rows = slice(dist.get_rank() * 4, dist.get_rank() * 4 + 4)
    logits = model(inputs[rows])
    loss = build_loss_fn(cfg, dims)(logits, labels[rows])
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    expected = build_loss_fn(cfg, ParallelDims(1, 1, 1, 1, 1, 1))(reference(inputs), labels)
    return {
        "logits_dtype": str(logits.dtype),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "param_types": sorted({type(p).__name__ for p in model.parameters()}),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
        "loss_rel_diff": abs(total.item() - expected.item()) / expected.item(),
    }


def probe_clip_pp() -> dict:
    """Two "stages" (the two ranks) with different parameters: the norm must cover both."""
    from gate import patched

    import titanlike.parallel.clip as clip

    rank = dist.get_rank()
    out = {}
    for reduce in (True, False):
        p, extra = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.full((4,), float(rank + 1))  # squared norms 4 and 16: global sqrt(20)
        extra.grad = torch.full((2,), 10.0)  # clipped, but left out of the norm via norm_parameters
        with patched(clip, "reduce_across_stages", clip.reduce_across_stages if reduce else lambda sq, group: sq):
            norm = clip.clip_grad_norm_([p, extra], 1.0, pp_group=dist.group.WORLD, norm_parameters=[p])
        norms = [None, None]
        dist.all_gather_object(norms, norm.item())
        out[f"reduce={reduce}"] = {"norms": norms, "grad0": p.grad[0].item(), "extra": extra.grad[0].item()}
    return out


def probe_errors() -> dict:
    from titanlike.models import ModelArgs, Transformer

    mesh = built_dims(ParallelDims(1, 1, 1, 2, 1, 2)).world_mesh
    out = {}
    for name, plan, tied in (
        ("unknown key", {"layers.*.attention.wqq": ColwiseParallel()}, False),
        ("tied different layouts", {"tok_embeddings": ColwiseParallel(), "output": ColwiseParallel()}, True),
    ):
        args = ModelArgs(
            dim=16, n_layers=1, n_heads=2, vocab_size=32, multiple_of=16, max_seq_len=8, tie_embeddings=tied
        )
        try:
            apply_tp(Transformer(args), mesh["tp"], plan)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    from titanlike.parallel.fused import FusedColwiseParallel

    dp_mesh = built_dims(ParallelDims(1, 2, 1, 1, 1, 2)).get_mesh("dp_shard")
    silent = {
        "no default plan": lambda: apply_tp(UserMLP(), mesh["tp"]),
        "module left out of the plan": lambda: apply_tp(
            UserMLP(), mesh["tp"], {k: v for k, v in USER_PLAN.items() if k != "ln"}
        ),
        "fsdp without blocks": lambda: apply_fsdp(UserMLP(), dp_mesh),
        "fused chunks not divisible by tp": lambda: apply_tp(
            nn.Linear(16, 18), mesh["tp"], FusedColwiseParallel([12, 3, 3])
        ),
        "fused kv heads not divisible by tp": lambda: apply_tp(
            nn.Linear(16, 32), mesh["tp"], FusedColwiseParallel([16, 8, 8], head_dim=8)
        ),
        "fused unequal chunks as a DTensor output": lambda: FusedColwiseParallel([16, 8, 8], use_local_output=False),
    }
    for name, fn in silent.items():
        try:
            fn()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


class FusedUser(nn.Module):
    """A nanoGPT-style block written by a user: fused q|k|v and fused gate|up projections with biases. With
    ``kv_heads < heads`` the attention is grouped-query (HF / Llama convention: q head ``i`` uses kv head
    ``i // (heads / kv_heads)``), its q|k|v chunks unequal; the heads are inferred from the shapes, as they must be
    under tensor parallelism (each rank holds ``[q_r | k_r | v_r]``)."""

    def __init__(self, d: int = 16, heads: int = 4, h: int = 24, kv_heads: int | None = None):
        super().__init__()
        kv_heads = kv_heads or heads
        self.hd, self.groups, self.shape_args = d // heads, heads // kv_heads, (d, heads, h, kv_heads)
        self.qkv_sizes = [d, kv_heads * self.hd, kv_heads * self.hd]
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.qkv, self.attn.proj = nn.Linear(d, sum(self.qkv_sizes)), nn.Linear(d, d)
        self.ffn = nn.Module()
        self.ffn.gate_up, self.ffn.down = nn.Linear(d, 2 * h), nn.Linear(h, d)

    def sdpa(self, x, q, k, v):
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, -1, self.hd).transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        return self.attn.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))

    def attention(self, x):
        qkv = self.attn.qkv(x)
        kv = qkv.shape[-1] // (self.groups + 2)
        return self.sdpa(x, *qkv.split([self.groups * kv, kv, kv], -1))

    def mlp(self, x):
        g, u = self.ffn.gate_up(x).chunk(2, -1)
        return self.ffn.down(F.silu(g) * u)

    def forward(self, x):
        x = x + _call(self.attn, self.attention, self.norm1(x))
        return x + _call(self.ffn, self.mlp, self.norm2(x))


def _call(holder: nn.Module, fn, x):
    """Run ``fn(x)`` through ``holder``'s forward hooks (where the plan puts Megatron's f operator)."""
    holder.forward = fn
    return holder(x)


class SplitUser(FusedUser):
    """The same function with separate q, k, v and gate, up projections (the unfused plan to compare against)."""

    def __init__(self, fused: FusedUser):
        super().__init__(*fused.shape_args)
        h = fused.ffn.down.in_features
        self.double()
        self.load_state_dict(fused.state_dict())
        fused_layers = ((self.attn, "qkv", ("q", "k", "v"), fused.qkv_sizes), (self.ffn, "gate_up", ("g", "u"), [h, h]))
        for holder, name, parts, widths in fused_layers:
            src = getattr(holder, name)
            for part, w, rows in zip(parts, src.weight.split(widths), src.bias.split(widths), strict=True):
                lin = nn.Linear(src.in_features, w.shape[0]).double()
                with torch.no_grad():
                    lin.weight.copy_(w)
                    lin.bias.copy_(rows)
                setattr(holder, part, lin)
            delattr(holder, name)

    def attention(self, x):
        return self.sdpa(x, *(getattr(self.attn, n)(x) for n in "qkv"))

    def mlp(self, x):
        return self.ffn.down(F.silu(self.ffn.g(x)) * self.ffn.u(x))


def _fused_plan(fused: bool, qkv_sizes: list[int] | None = None, sp: bool = False) -> dict:
    """The user's plan: Megatron's f / g around attention and MLP, norms replicated (SP: sequence-parallel, the
    block's input and output sharded on the sequence), fused projections chunk-sharded (or the split twin's q, k,
    v, g, u ColwiseParallel). ``qkv_sizes``: q|k|v chunk sizes (default: 3 equal chunks)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    from titanlike.parallel.fused import FusedColwiseParallel

    seq = Shard(1) if sp else Replicate()
    f = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    # check="never": these counts are a step's; the replica check's one all-reduce per norm at the first forward
    # is priced by tests/parallel/test_traps.py
    norm = SequenceParallel() if sp else ReplicateParallel(check="never")
    g = RowwiseParallel(output_layouts=seq, use_local_output=not sp)
    plan = {"norm1": norm, "norm2": norm, "attn": f, "ffn": f, "attn.proj": g, "ffn.down": g}
    if fused:
        plan.update({"attn.qkv": FusedColwiseParallel(qkv_sizes or 3), "ffn.gate_up": FusedColwiseParallel([24, 24])})
    else:
        plan.update({f"attn.{n}": ColwiseParallel() for n in "qkv"})
        plan.update({f"ffn.{n}": ColwiseParallel() for n in "gu"})
    return plan


def _seq_sharded(model, mesh):
    """SP's entry and exit around the block: this rank's sequence shard in, the whole output back."""
    from torch.distributed.tensor import Shard

    def forward(x):
        x = DTensor.from_local(x.chunk(mesh.size(), dim=1)[mesh.get_local_rank()], mesh, [Shard(1)], run_check=False)
        return model(x).full_tensor()

    return forward


def probe_fused() -> dict:
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from titanlike.parallel.fused import contiguous_for_dcp_tree, gather_strided, is_strided

    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = FusedUser().double()
    g = torch.Generator().manual_seed(7)
    batches = [
        (
            torch.randn(4, 6, 16, generator=g, dtype=torch.float64),
            torch.randn(4, 6, 16, generator=g, dtype=torch.float64),
        )
        for _ in range(3)
    ]
    n_total = batches[0][1].numel()
    mesh = built_dims(ParallelDims(1, 1, 1, 2, 1, 2)).world_mesh
    out: dict = {}
    # The single-device order, and each rank holding its slice of every chunk.
    model = apply_tp(copy.deepcopy(reference), mesh["tp"], _fused_plan(True))
    w, ref_w = model.attn.qkv.weight, reference.attn.qkv.weight
    out["full_tensor_in_order"] = all(
        torch.equal(_full(p), reference.get_parameter(n)) for n, p in model.named_parameters()
    )
    try:  # torch's own full_tensor() of the _StridedShard parameters
        out["torch_full_tensor_in_order"] = all(
            torch.equal(p.full_tensor(), reference.get_parameter(n)) for n, p in model.named_parameters()
        )
        out["torch_full_tensor_error"] = None
    except ValueError as e:
        out["torch_full_tensor_in_order"], out["torch_full_tensor_error"] = False, str(e).splitlines()[0]
    out["local_is_chunk_slices"] = torch.equal(w.to_local(), torch.cat([c.chunk(2)[rank] for c in ref_w.chunk(3)]))
    # gather_strided (prepare_fused_for_fsdp's and the checkpoints' gather, through a plain Shard view on any torch)
    gathered = {n: gather_strided(p) for n, p in model.named_parameters() if is_strided(p)}
    out["gather_strided"] = {n: str(g.placements) for n, g in gathered.items()}
    out["gather_strided_exact"] = all(
        torch.equal(g.to_local(), reference.get_parameter(n)) for n, g in gathered.items()
    )
    out["placements"] = str(w.placements)
    # Same collectives as the unfused plan (forward + backward of one step).
    x, y = batches[0]
    counts = {}
    for name, m in (
        ("fused", copy.deepcopy(model)),
        ("split", apply_tp(SplitUser(reference), mesh["tp"], _fused_plan(False))),
    ):
        with BytesCommDebugMode() as fwd:
            o = m(x)
        with BytesCommDebugMode() as bwd:
            ((o - y) ** 2).sum().backward()
        counts[name] = {"forward": fwd.summary(), "backward": bwd.summary()}
    out["comms"] = counts
    # Training equals one device.
    out["train_diff"] = _max_diff(
        _train_user(model, batches, n_total), _train_user(copy.deepcopy(reference), batches, n_total)
    )
    # DCP at tp 2 -> one process, no process group: the file holds the single-device order.
    path = [tempfile.mkdtemp(prefix="fused_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(path)
    dcp.save(contiguous_for_dcp_tree(get_model_state_dict(model)), checkpoint_id=path[0])
    trained = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    dist.barrier()
    if rank == 0:
        plain = {k: torch.zeros_like(v) for k, v in reference.state_dict().items()}
        dcp.load(plain, checkpoint_id=path[0], no_dist=True)
        out["dcp_tp2_to_one_process_diff"] = max((plain[k] - trained[k]).abs().max().item() for k in plain)
    return out


# ------------------------------------------------------------------------ grouped-query fused q|k|v (unequal chunks)
def _gqa_case():
    """The fused block with grouped-query attention (4 heads, 2 kv heads, head dim 4: q|k|v = 16|8|8), float64,
    and 3 seeded batches."""
    torch.manual_seed(1)
    reference = FusedUser(kv_heads=2).double()
    g = torch.Generator().manual_seed(8)
    batches = [
        (
            torch.randn(4, 6, 16, generator=g, dtype=torch.float64),
            torch.randn(4, 6, 16, generator=g, dtype=torch.float64),
        )
        for _ in range(3)
    ]
    return reference, batches, batches[0][1].numel()


def _replicated_only(mutated):
    """A mutation of fused._local_rows that acts on the tp-replicated (unequal-chunk) parameters only."""
    from torch.distributed.tensor import Replicate

    import titanlike.parallel.fused as fused

    original = fused._local_rows

    def rows(param, device_mesh, sizes):
        if param is None or not isinstance(param.placements[-1], Replicate):
            return original(param, device_mesh, sizes)
        return mutated(param, device_mesh, sizes)

    return rows


def _rows_rank_major(param, device_mesh, sizes):
    """MUTATION: rank r takes the r-th contiguous block of rows (what ColwiseParallel shards): q heads as k and v."""
    from torch.distributed.tensor import Partial

    return param.to_local(grad_placements=[Partial()]).chunk(device_mesh.size())[device_mesh.get_local_rank()]


def _rows_no_partial(param, device_mesh, sizes):
    """MUTATION: the right rows, but the gradient taken as Replicate: each rank keeps only its rows' gradient."""
    r, tp = device_mesh.get_local_rank(), device_mesh.size()
    return torch.cat([c.chunk(tp)[r] for c in param.to_local().split(sizes)])


GQA_MUTATIONS = {"rank_major_rows": _rows_rank_major, "no_partial_grad": _rows_no_partial}


def _run_mutation(name, build, batches, n_total, one_device, dp_group=None):
    from gate import patched

    import titanlike.parallel.fused as fused

    with patched(fused, "_local_rows", _replicated_only(GQA_MUTATIONS[name])):
        hist = _train_user(build(), batches, n_total, dp_group=dp_group)
    return {"loss_step1": abs(float(hist[0][0]) - float(one_device[0][0])), "diff": _max_diff(hist, one_device)}


def _dcp_round_trip(model, build_fresh, tag: str) -> dict:
    """Save ``model`` with DCP; load into a freshly initialised model of the same layout and (rank 0) into the plain
    single-device module with no process group. Returns the max |diff| of each to ``model``'s weights."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from titanlike.parallel.fused import contiguous_for_dcp_tree, restore_layout

    path = [tempfile.mkdtemp(prefix=f"fused_gqa_{tag}_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    dcp.save(contiguous_for_dcp_tree(get_model_state_dict(model)), checkpoint_id=path[0])
    trained = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    fresh, plain = build_fresh()
    before = max((_full(p) - trained[n]).abs().max().item() for n, p in fresh.named_parameters())
    originals = get_model_state_dict(fresh)
    target = contiguous_for_dcp_tree(originals)
    dcp.load(target, checkpoint_id=path[0])
    set_model_state_dict(fresh, restore_layout(target, originals))
    out = {
        "fresh_differs_before_load": before,
        "same_layout_diff": max((_full(p) - trained[n]).abs().max().item() for n, p in fresh.named_parameters()),
    }
    dist.barrier()
    if dist.get_rank() == 0:
        state = {k: torch.zeros_like(v) for k, v in plain.state_dict().items()}
        dcp.load(state, checkpoint_id=path[0], no_dist=True)
        out["one_process_diff"] = max((state[k] - trained[k]).abs().max().item() for k in state)
    dist.barrier()
    return out


def probe_fused_gqa() -> dict:
    """tp 2 (and tp 2 + SP): grouped-query fused q|k|v (unequal chunks, tp-replicated) against one device."""
    rank = dist.get_rank()
    reference, batches, n_total = _gqa_case()
    sizes = reference.qkv_sizes
    mesh = built_dims(ParallelDims(1, 1, 1, 2, 1, 2)).get_mesh("tp")
    one_device = _train_user(copy.deepcopy(reference), batches, n_total)
    out: dict = {"sizes": sizes}

    def build(sp=False):
        return apply_tp(copy.deepcopy(reference), mesh, _fused_plan(True, sizes, sp))

    model = build()
    out["placements"] = {
        n: str(model.get_parameter(n).placements) for n in ("attn.qkv.weight", "attn.qkv.bias", "ffn.gate_up.weight")
    }
    out["full_tensor_in_order"] = all(
        torch.equal(_full(p), reference.get_parameter(n)) for n, p in model.named_parameters()
    )
    x, y = batches[0]
    mine = torch.cat([c.chunk(2, -1)[rank] for c in reference.attn.qkv(x).split(sizes, -1)], -1)
    out["local_output_vs_chunk_slices"] = (model.attn.qkv(x) - mine).abs().max().item()
    for sp in (False, True):
        counts = {}
        split = apply_tp(SplitUser(reference), mesh, _fused_plan(False, sp=sp))
        for name, m in (("fused", build(sp)), ("split", split)):
            call = _seq_sharded(m, mesh) if sp else m
            with BytesCommDebugMode() as fwd:
                o = call(x)
            with BytesCommDebugMode() as bwd:
                ((o - y) ** 2).sum().backward()
            counts[name] = {"forward": fwd.summary(), "backward": bwd.summary()}
        out[f"comms sp={sp}"] = counts
        m = build(sp)
        out[f"train_diff sp={sp}"] = _max_diff(
            _train_user(m, batches, n_total, forward=_seq_sharded(m, mesh) if sp else None), one_device
        )
        if not sp:
            trained = m

    def fresh():
        torch.manual_seed(2)
        other = FusedUser(kv_heads=2).double()
        return apply_tp(copy.deepcopy(other), mesh, _fused_plan(True, sizes)), other

    out["dcp"] = _dcp_round_trip(trained, fresh, "tp2")
    for name in GQA_MUTATIONS:
        out[f"mutation {name}"] = _run_mutation(name, build, batches, n_total, one_device)
    return out


def probe_fused_gqa_fsdp() -> dict:
    """tp 2 x fsdp 2 (4 ranks; run in the gate's 4-rank launch, tests/parallel/gate.py): the tp-replicated
    grouped-query q|k|v sharded by FSDP over dp like any replicated parameter, against one device."""
    reference, batches, n_total = _gqa_case()
    sizes = reference.qkv_sizes
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, world_size=4)
    mesh = dims.build_mesh("cpu")
    dp_mesh, tp_mesh = dims.get_mesh("dp_shard_cp"), mesh["tp"]
    one_device = _train_user(copy.deepcopy(reference), batches, n_total)

    def build(source=reference):
        m = apply_tp(copy.deepcopy(source), tp_mesh, _fused_plan(True, sizes))
        return apply_fsdp(m, dp_mesh, blocks=[m.attn, m.ffn])

    model = build()
    out: dict = {
        "placements": {
            n: str(model.get_parameter(n).placements)
            for n in ("attn.qkv.weight", "attn.qkv.bias", "ffn.gate_up.weight")
        }
    }
    out["full_tensor_in_order"] = all(
        torch.equal(_full(p), reference.get_parameter(n)) for n, p in model.named_parameters()
    )
    dp_rank, group = dp_mesh.get_local_rank(), dp_mesh.get_group()
    halves = [(x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]) for x, y in batches]
    out["train_diff"] = _max_diff(_train_user(model, halves, n_total, dp_group=group), one_device)

    def fresh():
        torch.manual_seed(2)
        other = FusedUser(kv_heads=2).double()
        return build(other), other

    out["dcp"] = _dcp_round_trip(model, fresh, "tp2_fsdp2")
    out["mutation no_partial_grad"] = _run_mutation("no_partial_grad", build, halves, n_total, one_device, group)
    return out


def main_probe(rank: int, world_size: int, out: str) -> None:
    results = {
        "comms": probe_comms(),
        "user_module": probe_user_module(),
        "mixed_precision": probe_mixed_precision(),
        "clip_pp": probe_clip_pp(),
        "errors": probe_errors(),
        "fused": probe_fused(),
        "fused_gqa": probe_fused_gqa(),
    }
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    from dist_utils import spawn

    sys.exit(spawn(main_probe, 2, sys.argv[1], timeout_s=60.0))
