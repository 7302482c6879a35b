"""How GPT-2 splits over tensor parallelism (titanlike.sharding entries): the Llama plan with the fused q|k|v
``c_attn`` chunk-sharded (each rank its heads of q, of k and of v; no reordering of the weight), LayerNorms (weight
and bias) replicated / sequence-parallel, and the learned position table replicated, its output taking the
stream's layout (under SP this rank's positions). Biases: column-wise ones sharded, row-wise ones replicated
(added once, after the reduction). float8 is not proven on GPT-2: no entry is float8-eligible."""

from titanlike.sharding import Colwise, FusedColwise, Head, Norm, PositionTable, Region, Rowwise, VocabEmbedding

SHARDING = {
    "tok_embeddings": VocabEmbedding(),
    "pos_embeddings": PositionTable(),
    "layers.*.ln_1": Norm(),
    "layers.*.attn": Region(),
    "layers.*.attn.c_attn": FusedColwise(3),
    "layers.*.attn.c_proj": Rowwise(float8=False),
    "layers.*.ln_2": Norm(),
    "layers.*.mlp": Region(),
    "layers.*.mlp.c_fc": Colwise(float8=False),
    "layers.*.mlp.c_proj": Rowwise(float8=False),
    "norm": Norm(),
    "output": Head(),
}
