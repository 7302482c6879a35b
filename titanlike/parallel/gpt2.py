"""GPT-2's tensor-parallel plan (Megatron-style, like the Llama plan in titanlike/parallel/tensor_parallel.py).

=============================  =======================================================================
``tok_embeddings``             RowwiseParallel: vocab-sharded table, output ``seq`` (Replicate, or Shard(1) under SP)
``pos_embeddings``             replicated table; its output joins the stream's layout (under SP the local sequence
                               slice, no communication forward, an all-gather of its (seq, dim) gradient backward)
``layers.*.ln_1/ln_2, norm``   SP: SequenceParallel (weight and bias replicated); else ReplicateParallel
``layers.*.attn/mlp``          PrepareModuleInput(seq -> Replicate): Megatron's f
``attn.c_attn``                FusedColwiseParallel(3): each rank its heads of q, of k and of v; no user reordering
``mlp.c_fc``                   ColwiseParallel
``attn.c_proj, mlp.c_proj``    RowwiseParallel, output ``seq``: Megatron's g (bias added once, after the reduction)
``output``                     ColwiseParallel from ``seq`` (vocab-sharded logits for the vocab-parallel loss)
=============================  =======================================================================
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from titanlike.parallel.fused import FusedColwiseParallel
from titanlike.parallel.tensor_parallel import ReplicateParallel, _norm_style


class PositionEmbeddingParallel(ReplicateParallel):
    """A replicated position table whose (seq, dim) output takes the residual stream's layout: ``Replicate``, or
    under sequence parallelism ``Shard(0)`` (this rank's positions), so that adding it to the token embedding's
    ``Shard(1)`` output is local. ``use_local_output=True``: that layout's local tensor (for a plan whose residual
    stream is plain local tensors, like torchtitan's): the ``(seq / tp, dim)`` rows of this rank under SP."""

    def __init__(self, sequence_parallel: bool, *, use_local_output: bool = False):
        super().__init__(use_local_output=False)
        self.sequence_parallel = sequence_parallel
        self.local_output = use_local_output

    def _apply(self, module, device_mesh):
        sp, local = self.sequence_parallel, self.local_output

        def output_fn(mod, inputs, output):
            if sp and isinstance(output, DTensor):
                output = output.redistribute(device_mesh, [Shard(0)])
            return output.to_local() if local and isinstance(output, DTensor) else output

        module = super()._apply(module, device_mesh)
        module.register_forward_hook(output_fn)
        return module


def tp_plan(args=None, sequence_parallel: bool = False, loss_parallel: bool = True, *, fused_style=None) -> dict:
    seq = Shard(1) if sequence_parallel else Replicate()
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False),
        "pos_embeddings": PositionEmbeddingParallel(sequence_parallel),
        "layers.*.ln_1": _norm_style(sequence_parallel),
        "layers.*.attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.attn.c_attn": fused_style if fused_style is not None else FusedColwiseParallel(3),
        "layers.*.attn.c_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "layers.*.ln_2": _norm_style(sequence_parallel),
        "layers.*.mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "layers.*.mlp.c_fc": ColwiseParallel(),
        "layers.*.mlp.c_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        "norm": _norm_style(sequence_parallel),
        "output": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
