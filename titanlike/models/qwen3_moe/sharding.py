"""How Qwen3-MoE splits: Qwen3's entries (attention, norms, a dense layer's SwiGLU, embedding and head) as they are.

The MoE block (``layers.*.moe``: router, stacked experts, shared experts) has no tensor-parallel entry: its experts
split over the expert-parallel axis instead (``titanlike.parallel.expert_parallel``, a ``Shard(0)`` of the stacked
weights, applied by ``parallelize_model`` when ``parallelism.expert_parallel_degree > 1``), and tensor parallelism of
a model with experts is refused by the layout rules (rule ``moe_tp``). Without an entry the router and the experts
train with AdamW under Muon, and stay high precision under float8.
"""

from titanlike.models.qwen3.sharding import SHARDING

__all__ = ["SHARDING"]
