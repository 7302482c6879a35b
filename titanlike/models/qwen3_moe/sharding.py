"""How Qwen3-MoE splits over tensor parallelism: Qwen3's entries (attention, norms, a dense layer's SwiGLU, embedding
and head) as they are, and the MoE block (``layers.*.moe``: router, stacked experts, shared experts) as ``TokenLocal``:
under sequence parallelism each tp rank routes its own part of the sequence, the experts split over the
expert-parallel axis (which borrows the tp ranks: ``titanlike.parallel.expert_parallel``), the router and shared
experts data-parallel over tp. Tensor parallelism of this model needs sequence parallelism and ep > 1 (rule
``moe_tp``). Without a Linear entry the router and the experts train with AdamW under Muon, and stay high precision
under float8.
"""

from titanlike.models.qwen3.sharding import SHARDING as QWEN3
from titanlike.sharding import TokenLocal

__all__ = ["SHARDING"]

SHARDING = {**QWEN3, "layers.*.moe": TokenLocal()}
