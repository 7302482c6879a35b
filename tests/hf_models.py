"""Small transformers configs for the gates and the trainer test (model.name = "hf"): written as config.json
folders on first use (no downloads), one folder per content, so every rank and every launch reads the same file."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

_BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.02,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
HF_CONFIGS = {
    # fused q|k|v (grouped-query: chunks 4:2:2 heads) and gate|up; the attention slices with the config's head counts
    "hf_phi3": dict(_BASE, model_type="phi3", architectures=["Phi3ForCausalLM"], tie_word_embeddings=False),
    # the same with as many kv heads as heads: equal chunks (q|k|v _StridedShard over tp)
    "hf_phi3_mha": dict(
        _BASE, model_type="phi3", architectures=["Phi3ForCausalLM"], num_key_value_heads=4, tie_word_embeddings=False
    ),
    # per-head q/k RMSNorm, head_dim 32 (q 128 wide, not dim)
    "hf_qwen3": dict(
        _BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32, tie_word_embeddings=False
    ),
    # q/k/v biases, tied embeddings
    "hf_qwen2_tied": dict(_BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    # sliding-window attention (window 5 of the gates' 16 positions): Mistral's on every layer, Qwen2's
    # use_sliding_window on the layers from max_window_layers on (layer 0 full, layer 1 sliding)
    "hf_mistral_window": dict(
        _BASE, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=5, tie_word_embeddings=False
    ),
    "hf_qwen2_window": dict(
        _BASE,
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=1,
        tie_word_embeddings=False,
    ),
}


def hf_folder(key: str, **changes) -> str:
    """The folder holding ``HF_CONFIGS[key]`` (with ``changes``) as config.json."""
    config = {**HF_CONFIGS[key], **changes}
    text = json.dumps(config, indent=1, sort_keys=True)
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"titanlike-hf-{os.getuid()}" / f"{key}-{digest}"
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"config.json.{os.getpid()}"
        tmp.write_text(text)
        tmp.replace(folder / "config.json")
    return str(folder)
