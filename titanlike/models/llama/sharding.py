"""How the Llama model splits over tensor parallelism (titanlike.sharding entries): Megatron-style, q/k/v and the
SwiGLU w1/w3 column-wise, wo and w2 row-wise, norms replicated (sequence-parallel under SP), the embedding and the
head vocab-sharded. Every block projection may train in float8."""

from titanlike.sharding import Colwise, Head, Norm, Region, Rowwise, VocabEmbedding

SHARDING = {
    "tok_embeddings": VocabEmbedding(),
    "layers.*.attention_norm": Norm(),
    "layers.*.attention": Region(),
    "layers.*.attention.wq": Colwise(),
    "layers.*.attention.wk": Colwise(),
    "layers.*.attention.wv": Colwise(),
    "layers.*.attention.wo": Rowwise(),
    "layers.*.ffn_norm": Norm(),
    "layers.*.feed_forward": Region(),
    "layers.*.feed_forward.w1": Colwise(),
    "layers.*.feed_forward.w3": Colwise(),
    "layers.*.feed_forward.w2": Rowwise(),
    "norm": Norm(),
    "output": Head(),
}
