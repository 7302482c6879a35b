"""How Qwen3 splits over tensor parallelism (titanlike.sharding entries): Llama's Megatron plan, plus the per-head
q/k norms as ``HeadNorm``: their weights are replicated, but each tp rank normalises its own heads, so their
gradients are summed over tp (a norm over heads is not a norm on a replicated stream: ``ReplicateParallel`` there
would train wrong, silently). Every block projection may train in float8."""

from titanlike.sharding import Colwise, Head, HeadNorm, Norm, Region, Rowwise, VocabEmbedding

SHARDING = {
    "tok_embeddings": VocabEmbedding(),
    "layers.*.attention_norm": Norm(),
    "layers.*.attention": Region(),
    "layers.*.attention.wq": Colwise(),
    "layers.*.attention.wk": Colwise(),
    "layers.*.attention.wv": Colwise(),
    "layers.*.attention.q_norm": HeadNorm(),
    "layers.*.attention.k_norm": HeadNorm(),
    "layers.*.attention.wo": Rowwise(),
    "layers.*.ffn_norm": Norm(),
    "layers.*.feed_forward": Region(),
    "layers.*.feed_forward.w1": Colwise(),
    "layers.*.feed_forward.w3": Colwise(),
    "layers.*.feed_forward.w2": Rowwise(),
    "norm": Norm(),
    "output": Head(),
}
