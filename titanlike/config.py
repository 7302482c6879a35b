"""One typed configuration tree: defaults < TOML file < command line, validated before anything is built.

Names follow torchtitan v0.2.2 where the concept matches, so a torchtitan TOML mostly carries over::

    python train.py --job.config_file configs/debug_model.toml --training.steps 100 \
        --parallelism.tensor_parallel_degree=2

This module owns the schema, parsing and per-key ranges; the cross-field rules (degrees, shapes, pipeline, ...)
live in ``titanlike.layout.rules``. Every problem raises :class:`ConfigError` with one line that names the key and
the fix; ``train.py`` prints it and exits with code 2 before a model is built or a process group started.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
import re
import signal
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from titanlike.errors import ConfigError
from titanlike.layout import FLOAT8_RECIPES, SCHEDULES, layout_violations
from titanlike.layout.rules import OVERRIDE, model_keys_read, model_overrides, resolve_local_batch
from titanlike.models import DEFAULT_MODEL, UnknownModelError, get_spec, pad_vocab, registered, spec_for


@dataclass
class Job:
    # a TOML file of [section] tables (titanlike's or torchtitan's); the command line overrides it
    config_file: str | None = None
    dump_folder: str = "./outputs"  # where checkpoints, metrics, traces and exports go
    description: str = "default job"  # printed at the start of the run
    print_config: bool = False  # print the full configuration (after the file and the command line) at the start
    # a run folder's lock (job.dump_folder, checkpoint.folder) without a heartbeat for this long is taken over
    stale_lock_seconds: int = 600


def _override(default):
    """A ``model.<key>`` that overrides the flavor's value; ``default`` keeps the flavor's. A model reads the
    overrides named like a field of its args dataclass; one it does not read is refused (layout rule
    ``model_keys``)."""
    return field(default=default, metadata={OVERRIDE: True})


@dataclass
class Model:
    name: str = DEFAULT_MODEL  # the model: a registered spec (--help model lists them)
    flavor: str = "debugmodel"  # a size of the family (--help model lists each model's)
    # "gpt2", "cl100k", "test" (2k ranks), a .tiktoken rank file, or a Hugging Face tokenizer folder / tokenizer.json
    tokenizer: str = "test"
    vocab_multiple: int = 64  # pad the vocabulary to a multiple of this (keeps vocab % tp == 0 and matmuls aligned)
    kernels: Literal["torch", "te"] = "torch"  # "torch" or "te" (Transformer Engine, CUDA only)
    # causal | block_causal (packed documents, delimited by the tokenizer's EOS, never attend to each other)
    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    reset_position_ids: bool = False  # positions restart at 0 at every document start (needs block_causal)
    # Optional overrides of the flavor's values (0 / "" / None = keep the flavor's), each read by the models whose
    # args dataclass has a field of that name.
    tie_embeddings: bool | None = _override(None)  # None: the flavor's choice
    dim: int = _override(0)  # model width (0: the flavor's)
    n_layers: int = _override(0)  # transformer blocks (0: the flavor's)
    n_heads: int = _override(0)  # attention heads (0: the flavor's)
    n_kv_heads: int = _override(0)  # key/value heads for GQA (0: the flavor's)
    ffn_hidden_dim: int = _override(0)  # SwiGLU hidden size (0: the flavor's rule)
    max_seq_len: int = _override(0)  # longest sequence the RoPE tables cover (0: the flavor's)
    rope_theta: float = _override(0.0)  # RoPE base (0: the flavor's)
    norm_eps: float = _override(0.0)  # RMSNorm epsilon (0: the flavor's)
    # RoPE scaling: "" (the flavor's), "none", or "llama3" (Llama 3.1+ long context) with its four parameters
    # (0: Llama 3.1's 8, 1, 4, 8192).
    rope_scaling: Literal["", "none", "llama3"] = _override("")  # RoPE frequency scaling: none or llama3
    rope_scaling_factor: float = _override(0.0)  # llama3 scaling: the context extension factor (0: the flavor's)
    rope_low_freq_factor: float = _override(0.0)  # llama3 scaling: low-frequency factor (0: the flavor's)
    rope_high_freq_factor: float = _override(0.0)  # llama3 scaling: high-frequency factor (0: the flavor's)
    rope_original_max_seq_len: int = _override(0)  # llama3 scaling: the pre-training context length (0: the flavor's)
    num_experts: int = _override(0)  # routed experts per MoE block (0: the flavor's; models with experts)
    top_k: int = _override(0)  # experts per token (0: the flavor's; models with experts)
    # MoE routing and balancing (models with experts; torchtitan's names; docs/moe.md)
    score_func: Literal["", "softmax", "sigmoid"] = _override("")  # the router's scores ("": the flavor's)
    route_norm: bool | None = _override(None)  # renormalise each token's top-k weights to sum 1 (None: the flavor's)
    route_scale: float = _override(0.0)  # multiply the routing weights by this (0: the flavor's)
    # aux-loss-free balancing: the expert-bias update rate per step (-1: the flavor's; 0: off, no bias)
    load_balance_coeff: float = _override(-1.0)
    aux_loss_coeff: float = _override(-1.0)  # the sequence-wise auxiliary loss's coefficient (-1: the flavor's; 0: off)
    # the window of a model's sliding-window layers, in positions, the query included (0: the flavor's; gpt_oss)
    sliding_window: int = _override(0)
    attention_sinks: bool | None = _override(None)  # a learned sink logit per head (None: the flavor's; gpt_oss)
    # multi-token prediction depths (-1: the flavor's; 0: off; models with MTP: deepseek_v3); the depths' losses
    # weighted by training.mtp_loss_weight
    mtp_layers: int = _override(-1)
    # model.name = "hf": a folder holding a transformers config.json (weights optional): that model, built by
    # transformers (docs/transformers.md)
    hf_config: str = _override("")


@dataclass
class Training:
    steps: int = 1000  # optimizer steps to train for (a resumed run continues up to this step)
    # sequences per data-parallel rank per forward-backward pass (-1: global_batch_size / data-parallel degree, no
    # accumulation; a smaller value accumulates)
    local_batch_size: int = -1
    # sequences per optimizer step, the same under every layout (-1: local_batch_size x data-parallel degree, which
    # changes with the layout: torchtitan's meaning, and what a config that sets only local_batch_size gets); a
    # resume that changes it is refused
    global_batch_size: int = 8
    seq_len: int = 256  # tokens per sequence
    seed: int = 42  # model initialisation and data order
    deterministic: bool = False  # deterministic kernels (repeated runs match bitwise; an op without one raises)
    # the same bits under every data-parallel and pipeline layout (one process, FSDP, HSDP, pp with any schedule, pp x
    # FSDP), float32 and bfloat16 (docs/layout_invariance.md): the batch cut
    # into virtual_dp_degree virtual ranks of canonical microbatches of local_batch_size, every sum in one fixed tree
    layout_invariant: bool = False
    # V of a layout-invariant run: a power of two, at least the largest data-parallel degree to run (each dp rank
    # hosts V/dp virtual ranks); global_batch_size -1 is local_batch_size x V
    virtual_dp_degree: int = 8
    # float32 | bfloat16 (mixed precision over float32 master weights) | float64
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    max_norm: float = 1.0  # gradient clipping by global norm; <= 0 disables clipping
    max_nonfinite_steps: int = 3  # the run stops at the N-th skipped step (non-finite loss or grad norm)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto | cpu | cuda
    # the multi-token-prediction losses' weight (DeepSeek-V3's lambda: 0.3, then 0.1), their mean over the depths
    # added to the next-token loss (a model with model.mtp_layers > 0; the logged loss stays the next-token one)
    mtp_loss_weight: float = 0.3
    # every N steps (and before every checkpoint save) the ranks holding identical state (HSDP replicas, tp-replicated
    # norms, tied copies across pipeline stages, torchft replica groups) compare a fingerprint of it; a mismatch
    # names the rank, the tensor and the step and stops the run unsaved (docs/fault_tolerance.md). 0: off
    sdc_check_interval: int = 0
    # FSDP2's CPUOffloadPolicy: the sharded parameters, their gradients and the optimizer state live in host memory,
    # the optimizer steps on the CPU, each group's parameters are copied to the device for its all-gather (needs
    # FSDP / HSDP: data_parallel_shard_degree or data_parallel_replicate_degree > 1)
    enable_cpu_offload: bool = False


@dataclass
class Optimizer:
    # AdamW, or Muon: the blocks' matrices orthogonalized (docs/muon.md), AdamW for the rest
    name: Literal["AdamW", "Muon"] = "AdamW"
    lr: float = 8e-4  # peak learning rate (Muon: of the matrices; adamw_lr for the rest)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    weight_decay: float = 0.1  # decoupled weight decay (Muon: of the matrices; adamw_weight_decay for the rest)
    # auto (fused on CUDA, foreach otherwise) | fused | foreach | for-loop
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    # Muon (optimizer.name = "Muon"), with torch.optim.Muon's names and defaults:
    momentum: float = 0.95  # Muon momentum
    nesterov: bool = True  # Muon: Nesterov momentum
    ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])  # Newton-Schulz (a, b, c)
    ns_steps: int = 5  # Muon: Newton-Schulz iterations
    muon_eps: float = 1e-7  # torch Muon's eps (the floor of the update's norm); optimizer.eps is AdamW's
    # Muon learning rate per matrix shape: original = sqrt(max(1, rows/cols)); match_rms_adamw = 0.2 sqrt(max(rows,
    # cols)) (AdamW's lr and weight decay carry over)
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = "original"
    ns_dtype: Literal["bfloat16", "float32", "float64"] = "bfloat16"  # Muon: Newton-Schulz precision (torch's bf16)
    adamw_lr: float | None = None  # Muon: peak lr of the AdamW parameters (None: optimizer.lr)
    adamw_weight_decay: float | None = None  # Muon: weight decay of the AdamW parameters (None: weight_decay)
    muon_bucket_mb: float = 128.0  # Muon: megabytes of full matrices per gather / scatter all-to-all pair


@dataclass
class LRScheduler:
    # torchtitan's schedule: linear warmup -> stable -> decay over the last decay_ratio of the steps (all the steps
    # after warmup when decay_ratio is unset), for every decay type.
    warmup_steps: int = 200  # linear warmup steps up to optimizer.lr
    total_steps: int | None = None  # the steps the schedule spans (None: training.steps)
    # linear | sqrt | cosine | wsd (linear, decay_ratio 0.2 if unset) | constant
    decay_type: Literal["linear", "sqrt", "cosine", "wsd", "constant"] = "linear"
    decay_ratio: float | None = None  # the fraction of total_steps spent decaying at the end (None: all after warmup)
    min_lr_factor: float = 0.0  # the final learning rate as a fraction of optimizer.lr


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1  # model copies (HSDP replicas); gradients all-reduced between them
    data_parallel_shard_degree: int = -1  # -1: whatever is left of the world size
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"  # default | always | never
    # ZeRO-1 (Megatron's --use-distributed-optimizer): parameters and gradients replicated over the
    # data_parallel_replicate_degree ranks (shard degree 1), AdamW's moments sharded over them
    distributed_optimizer: bool = False
    tensor_parallel_degree: int = 1  # ranks splitting every matmul (innermost, keep within a node)
    enable_sequence_parallel: bool = False  # shard norms and residuals over the sequence under TP
    disable_loss_parallel: bool = False  # gather the logits instead of the vocab-parallel cross entropy
    loss_chunk_size: int = 0  # tokens per chunk of the cross entropy (0: all at once)
    context_parallel_degree: int = 1  # ranks splitting each sequence (load-balanced chunks)
    # allgather: K/V all-gathered | alltoall: Ulysses, the sequence split turned into a head split around attention |
    # ring: K/V blocks passed around the cp group, merged by log-sum-exp | hybrid: all-to-all inside groups of
    # context_parallel_a2a_degree neighbouring cp ranks, a ring across the groups
    context_parallel_method: Literal["allgather", "alltoall", "ring", "hybrid"] = "allgather"
    context_parallel_a2a_degree: int = 1  # hybrid only: cp ranks per all-to-all group (1 < a2a < cp, dividing cp)
    pipeline_parallel_degree: int = 1  # pipeline ranks (outermost)
    # ranks splitting the routed experts (borrowed from dp_shard x cp; tokens moved by all-to-all; MoE models only)
    expert_parallel_degree: int = 1
    # how rows reach the routed experts: uneven (each expert's exact rows; split sizes read on the host once per MoE
    # layer) | padded (fixed-size per-expert buffers, no host read, static shapes; experts / top_k x the rows)
    expert_dispatch: Literal["uneven", "padded"] = "uneven"
    pipeline_parallel_schedule: Literal[SCHEDULES] = "1F1B"  # a torch.distributed.pipelining schedule
    pipeline_parallel_microbatch_size: int = 1  # sequences per pipeline microbatch
    pipeline_parallel_layers_per_stage: int = 0  # 0: one stage per rank (two for V-shaped schedules)
    pipeline_parallel_stages_per_rank: int = 0  # alternative to layers_per_stage (0: derive)
    pipeline_parallel_first_stage_less_layers: int = 0  # count the embedding as this many layers
    pipeline_parallel_last_stage_less_layers: int = 0  # count the norm + head (+ loss) as this many layers
    pipeline_parallel_module_names: list[str] = field(default_factory=list)  # by hand: "layers.0,layers.1" per stage
    gpus_per_node: int = 0  # 0: the local world size (LOCAL_WORLD_SIZE)


@dataclass
class Checkpoint:
    enable: bool = False  # save every interval steps and resume from the newest complete checkpoint
    folder: str = "checkpoint"  # relative to job.dump_folder unless absolute
    interval: int = 500  # steps between saves
    keep_latest_k: int = 10  # keep the newest k checkpoints, delete older ones once a newer is committed (0: all)
    load_step: int = -1  # -1: the newest complete checkpoint
    async_mode: Literal["disabled", "async"] = "disabled"  # disabled | async
    # a seed / step checkpoint folder, or a Hugging Face folder (its config.json sets the architecture) or
    # .safetensors file, to start from
    initial_load_path: str = ""
    create_seed_checkpoint: bool = False  # write the initial weights as step-0 (each rank its shards, any layout), exit
    export_safetensors: bool = False  # write <folder>/final/model.safetensors + config.json at the end
    checksum: bool = True  # a CRC32C of every entry, computed while it is written and verified while it is read
    # stop | previous: a corrupted newest checkpoint stops the run or is set aside
    on_corrupt: Literal["stop", "previous"] = "stop"
    last_save_model_only: bool = False  # the checkpoint of the last step holds the model weights only
    # dtype of a model-only last save and of export_safetensors
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # on one of these signals (any rank; SIGINT is Ctrl-C) the run finishes its step, saves it and exits with code 75
    # (a second one exits at once; [] to die at once)
    exit_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT"])
    # resume a checkpoint saved with another training.global_batch_size (refused by default: the run would change)
    accept_global_batch_change: bool = False


@dataclass
class Metrics:
    log_freq: int = 10  # steps between log lines
    enable_tensorboard: bool = False  # write tensorboard events
    disable_color_printing: bool = False  # plain console lines (colors are used only on a terminal anyway)
    save_tb_folder: str = "tb"  # tensorboard folder under job.dump_folder
    enable_jsonl: bool = True  # write metrics.jsonl under job.dump_folder
    # log every metric and the config to Weights & Biases (the [wandb] extra; WANDB_MODE=offline: no network)
    enable_wandb: bool = False
    wandb_project: str = ""  # "": $WANDB_PROJECT, else "titanlike"
    wandb_entity: str = ""  # the team or user ("": your default)
    wandb_run_name: str = ""  # "": job.description, else the dump folder's name
    peak_tflops: float = 0.0  # override the peak table (dense bf16 TFLOP/s of one device)
    # warn once when a MoE layer's busiest expert stays above this multiple of the mean load (0: never)
    moe_imbalance_warn: float = 2.0
    moe_imbalance_steps: int = 100  # how many steps in a row above moe_imbalance_warn before the warning


@dataclass
class Data:
    # a file, folder or glob (.txt .jsonl .json.gz .jsonl.zst .parquet .bin ...) or a list; "" = the shipped corpus
    path: str | list[str] = ""
    # one weight per data.path entry: a weighted mixture (empty: the entries are one stream, end to end)
    weights: list[float] = field(default_factory=list)
    text_field: str = "text"  # the JSON field (.jsonl*) or the string column (.parquet) holding the text
    encoding: str = "utf-8"  # of text and .jsonl files (e.g. latin-1 for a corpus that is not UTF-8)
    # strict (a bad byte is an error) | replace (U+FFFD) | ignore (dropped)
    encoding_errors: Literal["strict", "replace", "ignore"] = "strict"
    val_fraction: float = 0.05  # the held-out tail used for validation
    shuffle: bool = True  # shuffle the packed windows (seeded)
    num_workers: int = 0  # loader worker processes per rank


@dataclass
class Eval:
    # run lm-evaluation-harness tasks during training, on the training layout (the [eval] extra)
    enable: bool = False
    freq: int = 1000  # steps between evaluations (and at the last step)
    tasks: list[str] = field(default_factory=list)  # task names: the shipped ones (shakespeare_next_line), include's
    include: list[str] = field(default_factory=list)  # folders of lm-eval task YAMLs whose data_files are local
    limit: int = 0  # documents per task (0: all)
    batch_size: int = 8  # sequences per forward


@dataclass
class Validation:
    enable: bool = True  # compute the validation loss
    # held-out data (file, folder, glob or list; one per data.path entry with weights); "" = each source's tail
    path: str | list[str] = ""
    freq: int = 100  # steps between validations
    steps: int = 4  # batches of local_batch_size per rank (-1: the whole held-out tail)


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"  # none | full | selective
    selective_ac_option: str = "op"  # "op" (save matmul/attention outputs) or an integer N (every N-th block)
    # the tensors the blocks AC leaves alone save for the backward are copied to host memory in the forward and
    # prefetched back to the device one block ahead in the backward (per block); not with tensor parallelism
    offload: bool = False


@dataclass
class Compile:
    enable: bool = False  # torch.compile each transformer block
    backend: str = "inductor"  # the torch.compile backend


@dataclass
class Float8:
    # "" (off), a torchao recipe or a Transformer Engine one (model.kernels=te): titanlike.layout.FLOAT8_RECIPES
    recipe: Literal[("",) + FLOAT8_RECIPES] = ""
    backend: Literal["auto", "torchao", "te"] = "auto"  # auto (te when model.kernels=te, else torchao) | torchao | te
    emulate: bool = False  # torchao's emulation (float8 casts, float32 GEMMs): CPU and tests, no sm_89 needed
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])  # Linear FQNs containing these stay hp
    enable_fsdp_float8_all_gather: bool = False  # FSDP2 all-gathers weights in float8 (tensorwise only)
    precompute_float8_dynamic_scale_for_fsdp: bool = False  # one all-reduce for all weight scales per step


@dataclass
class Comm:
    timeout_seconds: int = 300  # limit of every collective on every group once the model is built
    init_timeout_seconds: int = 300  # limit of the rendezvous, group creation and the collectives of the build


@dataclass
class Profiling:
    enable_profiling: bool = False  # torch.profiler traces
    save_traces_folder: str = "profile_traces"  # under job.dump_folder
    profile_freq: int = 10  # steps between trace windows
    profile_warmup: int = 3  # warm-up steps before each active window
    profile_active: int = 1  # steps recorded per window
    ranks: list[int] = field(default_factory=lambda: [0])  # ranks that trace
    enable_memory_snapshot: bool = False  # CUDA memory snapshots
    save_memory_snapshot_folder: str = "memory_snapshot"  # under job.dump_folder


@dataclass
class FaultTolerance:
    # Replica groups with torchft (docs/fault_tolerance.md): each group is its own torchrun job with the same layout
    # inside; gradients are summed across the groups that take part in a step; a group that dies leaves and rejoins
    # from a healthy group's live state. Needs the optional extra: pip install 'titanlike[ft]'.
    enable: bool = False  # fault-tolerant replica groups through torchft's manager and lighthouse
    process_group: Literal["gloo", "nccl"] = "gloo"  # the process group across the groups: gloo | nccl (CUDA)
    process_group_timeout_ms: int = 10000  # a collective across the groups that takes longer fails the step
    replica_id: int = 0  # this group's id, 0 .. group_size - 1
    group_size: int = 0  # the number of replica groups of the job (the most that take part in one step)
    min_replica_size: int = 1  # a step commits only when at least this many groups took part
    # the lighthouse's address, http://host:port ("": the TORCHFT_LIGHTHOUSE environment variable)
    lighthouse: str = ""
    connect_timeout_seconds: int = 10  # limit of reaching the lighthouse (at start) and the other groups' managers
    # limit of a quorum (who takes part in a step), of waiting for min_replica_size groups or all at the start
    quorum_timeout_seconds: int = 60
    # none (gradients summed every step) | local_sgd (weights averaged every sync_steps) | diloco (outer SGD step)
    semi_sync_method: Literal["none", "local_sgd", "diloco"] = "none"
    sync_steps: int = 5  # local_sgd / diloco: steps between two synchronizations of the groups
    outer_lr: float = 0.7  # diloco: the outer optimizer's learning rate (SGD, Nesterov momentum, as torchtitan)
    outer_momentum: float = 0.9  # diloco: the outer optimizer's momentum


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    comm: Comm = field(default_factory=Comm)
    profiling: Profiling = field(default_factory=Profiling)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# key -> (lowest allowed value, what it means)
MINIMUM = {
    "training.steps": 1,
    "training.seq_len": 1,
    "training.max_nonfinite_steps": 1,
    "optimizer.lr": 0.0,
    "optimizer.eps": 0.0,
    "optimizer.weight_decay": 0.0,
    "optimizer.momentum": 0.0,
    "optimizer.ns_steps": 1,
    "optimizer.muon_eps": 0.0,
    "optimizer.adamw_lr": 0.0,
    "optimizer.adamw_weight_decay": 0.0,
    "optimizer.muon_bucket_mb": 0.0,
    "lr_scheduler.warmup_steps": 0,
    "lr_scheduler.decay_ratio": 0.0,
    "lr_scheduler.min_lr_factor": 0.0,
    "model.vocab_multiple": 1,
    "metrics.moe_imbalance_warn": 0.0,
    "metrics.moe_imbalance_steps": 1,
    "model.dim": 0,
    "model.n_layers": 0,
    "model.n_heads": 0,
    "model.n_kv_heads": 0,
    "model.ffn_hidden_dim": 0,
    "model.max_seq_len": 0,
    "model.norm_eps": 0.0,
    "model.rope_scaling_factor": 0.0,
    "model.rope_low_freq_factor": 0.0,
    "model.rope_high_freq_factor": 0.0,
    "model.rope_original_max_seq_len": 0,
    "model.num_experts": 0,
    "model.top_k": 0,
    "model.sliding_window": 0,
    "parallelism.data_parallel_replicate_degree": 1,
    "parallelism.tensor_parallel_degree": 1,
    "parallelism.context_parallel_degree": 1,
    "parallelism.pipeline_parallel_degree": 1,
    "parallelism.expert_parallel_degree": 1,
    "parallelism.pipeline_parallel_microbatch_size": 1,
    "parallelism.pipeline_parallel_layers_per_stage": 0,
    "parallelism.pipeline_parallel_stages_per_rank": 0,
    "parallelism.loss_chunk_size": 0,
    "parallelism.gpus_per_node": 0,
    "checkpoint.interval": 1,
    "checkpoint.keep_latest_k": 0,
    "metrics.log_freq": 1,
    "validation.freq": 1,
    "eval.freq": 1,
    "eval.limit": 0,
    "eval.batch_size": 1,
    "validation.steps": -1,
    "data.num_workers": 0,
    "comm.timeout_seconds": 1,
    "job.stale_lock_seconds": 1,
    "comm.init_timeout_seconds": 1,
    "profiling.profile_freq": 1,
    "profiling.profile_warmup": 0,
    "profiling.profile_active": 1,
    "fault_tolerance.process_group_timeout_ms": 1,
    "fault_tolerance.replica_id": 0,
    "fault_tolerance.group_size": 0,
    "fault_tolerance.min_replica_size": 1,
    "fault_tolerance.connect_timeout_seconds": 1,
    "fault_tolerance.quorum_timeout_seconds": 1,
    "fault_tolerance.sync_steps": 1,
    "fault_tolerance.outer_lr": 0.0,
    "fault_tolerance.outer_momentum": 0.0,
}
MAXIMUM = {
    "lr_scheduler.decay_ratio": 1.0,
    "lr_scheduler.min_lr_factor": 1.0,
    "data.val_fraction": 0.5,
    "optimizer.beta1": 1.0,
    "optimizer.beta2": 1.0,
    "optimizer.momentum": 1.0,
    "optimizer.ns_steps": 99,
}


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def _field_types(section_cls: type) -> dict[str, typing.Any]:
    return typing.get_type_hints(section_cls)


def choices() -> dict[str, tuple]:
    """``section.key`` -> the allowed values, for every field typed ``Literal[...]``."""
    return {
        f"{s}.{k}": typing.get_args(tp)
        for s, cls in _sections().items()
        for k, tp in _field_types(cls).items()
        if typing.get_origin(tp) is Literal
    }


def _comment_blocks(section_cls: type) -> tuple[dict[str, str], dict[str, str]]:
    """(the doc of each field, the note before each field): a field's doc is the comment after it in the class body,
    else the comment block just above it (every line of the block); a comment block above a field that has a doc of
    its own is a note on the keys that follow (``--help`` prints it before that key)."""
    docs, notes, above = {}, {}, []
    for line in inspect.getsource(section_cls).splitlines():
        m = re.match(r"\s+(\w+): [^#]*?(?:#\s*(.+))?$", line)
        c = re.match(r"\s+#\s*(.+)$", line)
        if m:
            inline = (m.group(2) or "").strip()
            docs[m.group(1)] = inline or " ".join(above)
            if inline and above:
                notes[m.group(1)] = " ".join(above)
            above = []
        elif c:
            above.append(c.group(1).strip())
        else:
            above = []
    return docs, notes


def field_docs(section_cls: type) -> dict[str, str]:
    """The doc of each field: the comment after it in the class body, or the whole comment block just above."""
    return _comment_blocks(section_cls)[0]


def _dynamic_docs() -> dict[str, str]:
    """Docs computed from the registry: every registered model, and each one's flavors."""
    names = registered()
    flavors = "; ".join(
        f"{n}: {', '.join(get_spec(n).flavors)}" if get_spec(n).flavors else f"{n}: none (its own model.* keys)"
        for n in names
    )
    return {
        "model.name": f"the model, one of the registered: {', '.join(names)}",
        "model.flavor": f"a size of the family; the flavors of each model: {flavors}",
    }


def config_help(section: str | None = None) -> str:
    """``python train.py --help [SECTION]``: every key (of one section) with its type or choices, its default and
    its doc; an unknown section is a ConfigError naming the valid ones."""
    sections = _sections()
    if section is not None and section not in sections:
        raise ConfigError(
            f"--help {section}: no such section{_suggest(section, sections)}; valid sections: {', '.join(sections)}"
        )
    out = [
        "usage: python train.py [--job.config_file FILE] [--section.key VALUE ...]   (torchrun for several ranks)",
        "       python train.py --nproc_per_node N [options]   (N local ranks: torchrun's agent, the config checked "
        "first, the workers' exit code)",
        "       python train.py --help [SECTION]   (one section: " + ", ".join(sections) + ")",
        "Values: defaults < the TOML file < the command line (--section.key value, --section.key=value; a bare",
        "--flag is true; lists: comma-separated, strings ';'-separated, signal names either). Bad input exits 2 with",
        "one line.",
        "",
    ]
    defaults, dynamic = JobConfig(), _dynamic_docs()
    for name, cls in sections.items():
        if section is not None and name != section:
            continue
        out.append(f"[{name}]")
        docs, notes = _comment_blocks(cls)
        for key, tp in _field_types(cls).items():
            kind = (
                "{" + ", ".join(repr(c) for c in typing.get_args(tp)) + "}"
                if typing.get_origin(tp) is Literal
                else _type_name(tp)
            )
            if key in notes:
                out.append(f"  ({notes[key]})")
            default = getattr(getattr(defaults, name), key)
            out.append(f"  --{name}.{key}  {kind}, default {default!r}")
            out.append(f"      {dynamic.get(f'{name}.{key}', docs.get(key, ''))}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _suggest(name: str, valid) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        item = typing.get_args(tp)[0]
        return "a list of " + {int: "integers", float: "numbers", str: "strings"}.get(item, _type_name(item))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "none"}.get(
        tp, str(tp)
    )


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
# A list of strings is ';'-separated on the command line (an entry may hold commas: pipeline_parallel_module_names);
# these keys take commas too.
_LIST_SEPARATORS = {"checkpoint.exit_signals": ";,"}


def _coerce(key: str, value, tp, from_cli: bool):
    """Convert ``value`` (from TOML, or a string from the command line) to the field type ``tp``."""
    origin = typing.get_origin(tp)
    if origin is Literal:  # the value's type here; membership is checked by value_problems (with a suggestion)
        return _coerce(key, value, type(typing.get_args(tp)[0]), from_cli)
    bad = ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) > 1:  # "X | list[X]": a TOML list, or ';'-separated entries on the command line, is the list
            (listed,) = [a for a in args if typing.get_origin(a) is list]
            if isinstance(value, list) or (from_cli and isinstance(value, str) and ";" in value):
                return _coerce(key, value, listed, from_cli)
            return _coerce(key, value, next(a for a in args if a is not listed), from_cli)
        if value is None or (from_cli and isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(key, value, args[0], from_cli)
    if origin is list:
        (item,) = typing.get_args(tp)
        if from_cli and isinstance(value, str):
            separators = _LIST_SEPARATORS.get(key, ";" if item is str else ",")
            value = [v for v in (p.strip() for p in re.split(f"[{separators}]", value)) if v]
        if not isinstance(value, list):
            raise bad
        return [_coerce(key, v, item, from_cli) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise bad
    if tp in (int, float):
        accepted = (int,) if tp is int else (int, float)
        if isinstance(value, accepted) and not isinstance(value, bool):
            return tp(value)
        if from_cli and isinstance(value, str):
            try:
                return tp(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise bad  # pragma: no cover


def _set(cfg: JobConfig, dotted: str, value, from_cli: bool) -> None:
    section, _, key = dotted.partition(".")
    sections = _sections()
    if section not in sections:
        raise ConfigError(
            f"unknown config section '{section}'{_suggest(section, sections)}; valid sections: {', '.join(sections)}"
        )
    if not key:
        raise ConfigError(f"'{dotted}' names a section, not a key: use --{section}.<key>")
    types_ = _field_types(sections[section])
    if key not in types_:
        full = [f"{section}.{k}" for k in types_]
        other = [f"{s}.{k}" for s, c in sections.items() for k in _field_types(c)]
        hint = _suggest(dotted, full) or _suggest(dotted, other)
        raise ConfigError(f"unknown config key '{dotted}'{hint}")
    setattr(getattr(cfg, section), key, _coerce(dotted, value, types_[key], from_cli))


def _parse_cli(argv: list[str]) -> list[tuple[str, str | None]]:
    """``--a.b value`` / ``--a.b=value`` / a bare boolean ``--a.b`` -> [(dotted, value-or-None)]."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}': options look like --section.key value")
        name = arg[2:]
        if "=" in name:
            name, value = name.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not (
            argv[i + 1].startswith("--") and len(argv[i + 1]) > 2 and not argv[i + 1][2:3].isdigit()
        ):
            value = argv[i + 1]
            i += 2
        else:
            value = None  # a bare flag: true for booleans
            i += 1
        out.append((name, value))
    return out


def load_config(argv: list[str] | None = None, world_size: int | None = None) -> JobConfig:
    """Defaults, then ``--job.config_file``'s TOML, then the other command-line options; then validation.

    ``world_size`` (default: the ``WORLD_SIZE`` environment variable set by torchrun, else 1) is used to check
    the parallel layout before any process group exists.
    """
    cfg = parse_config(argv, raise_problems=False)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        p = cfg.parallelism
        needed = (
            p.tensor_parallel_degree
            * p.pipeline_parallel_degree
            * p.context_parallel_degree
            * p.data_parallel_replicate_degree
            * max(p.data_parallel_shard_degree, 1)
        )
        if "WORLD_SIZE" not in os.environ and needed > 1 and not cfg._problems:
            raise ConfigError(
                f"parallelism: this layout needs {needed} processes and python train.py is one; start it with "
                f"torchrun --nproc_per_node={needed} train.py and the same options"
            )
    problems = cfg._problems
    if problems:  # the values too, so that a file's every problem is in the one message
        problems = problems + value_problems(cfg)
    _raise_all(cfg, problems)
    resolve_local_batch(cfg, world_size)
    validate(cfg, world_size)
    return cfg


def parse_config(argv: list[str] | None = None, raise_problems: bool = True) -> JobConfig:
    """:func:`load_config` without :func:`validate`: keys and types are checked, values and layout are not.

    For tools that report every problem at once (the layout planner) instead of stopping at the first. Keys of
    torchtitan v0.2.2 are read through ``titanlike.torchtitan``'s table; every problem of the file and of the
    command line is reported in one ConfigError; the notes on torchtitan keys are in ``cfg.notes``.
    """
    from titanlike import torchtitan as tt

    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = JobConfig()
    cli = _parse_cli(argv)
    files = [v for k, v in cli if k == "job.config_file"]
    reading = tt.Reading()
    problems: list[str] = []
    explicit: set[str] = set()
    file_pairs: list[tuple[str, object]] = []
    if files:
        path = files[-1]
        if path is None:
            raise ConfigError("--job.config_file needs a path to a TOML file")
        file_pairs = _read_toml(path, problems)
        cfg.job.config_file = path
    torchtitan_file = any(k in tt.TORCHTITAN_KEYS and k not in _all_keys() for k, _ in file_pairs)
    if torchtitan_file:
        file_pairs = _torchtitan_file_defaults(cfg, file_pairs, reading, problems)
    cli_pairs = _cli_pairs(cli, problems)
    # The command line wins before anything is read: a file's value it replaces is never checked.
    _apply_pairs(cfg, _not_on_the_command_line(file_pairs, cli_pairs), False, reading, problems, explicit)
    _apply_pairs(cfg, cli_pairs, True, reading, problems, explicit)
    if "training.local_batch_size" in explicit and "training.global_batch_size" not in explicit:
        cfg.training.global_batch_size = -1  # the per-rank batch is what was given: local x dp (torchtitan's)
    if "model.name" not in explicit and cfg.checkpoint.initial_load_path:
        _model_name_from_hf_config(cfg, reading)
    if torchtitan_file and "model.max_seq_len" not in explicit:
        _torchtitan_max_seq_len(cfg, reading)
    if torchtitan_file and "parallelism.enable_sequence_parallel" not in explicit:
        cfg.parallelism.enable_sequence_parallel = cfg.parallelism.tensor_parallel_degree > 1
        if cfg.parallelism.enable_sequence_parallel:
            reading.notes.append(
                "parallelism.enable_sequence_parallel = True: torchtitan shards sequences "
                "whenever tensor_parallel_degree > 1"
            )
    problems += reading.problems + _validation_size_problems(cfg, reading)
    object.__setattr__(cfg, "notes", reading.notes)
    object.__setattr__(cfg, "explicit", frozenset(explicit))  # the keys the file or the command line set
    object.__setattr__(cfg, "_problems", problems)
    if raise_problems:
        _raise_all(cfg, problems)
    return cfg


def _torchtitan_file_defaults(cfg: JobConfig, file_pairs, reading, problems: list[str]) -> list[tuple[str, object]]:
    """A torchtitan file: torchtitan's defaults where the file is silent and titanlike's default differs, and its
    dtype pair (training.dtype, mixed_precision_param) read as torchtitan means it; returns the pairs to apply."""
    from titanlike import torchtitan as tt

    given = {k for k, _ in file_pairs} | {
        tt.TORCHTITAN_KEYS[k].target for k, _ in file_pairs if k in tt.TORCHTITAN_KEYS and tt.TORCHTITAN_KEYS[k].target
    }
    for key, value in tt.TORCHTITAN_DEFAULTS.items():
        if key not in given and key not in ("training.dtype", "parallelism.enable_sequence_parallel"):
            _set(cfg, key, value, from_cli=False)
            reading.notes.append(f"{key} = {value!r}: torchtitan's default (the file does not set it)")
    tt_dtype = dict(file_pairs).get("training.dtype", "float32")
    mixed = dict(file_pairs).get("training.mixed_precision_param", "bfloat16")
    file_pairs = [(k, v) for k, v in file_pairs if k not in ("training.dtype", "training.mixed_precision_param")]
    if tt_dtype == "bfloat16":
        problems.append(
            "torchtitan's training.dtype = 'bfloat16' trains bf16 weights without float32 master "
            "weights, which titanlike does not do: use training.dtype = 'float32' (torchtitan's "
            "mixed_precision_param = 'bfloat16' is then titanlike's training.dtype = 'bfloat16')"
        )
    elif tt_dtype != "float32":
        problems.append(f"training.dtype: '{tt_dtype}' is not a torchtitan dtype ('float32' or 'bfloat16')")
    else:
        file_pairs.append(("training.mixed_precision_param", mixed))
    return file_pairs


def _key_targets(dotted: str) -> set[str]:
    """The keys a (titanlike or torchtitan) key sets: itself and, for a torchtitan key, its titanlike target."""
    from titanlike import torchtitan as tt

    entry = tt.lookup(dotted)
    return {dotted} | ({entry.target} if entry is not None and entry.target else set())


def _not_on_the_command_line(file_pairs, cli_pairs) -> list[tuple[str, object]]:
    """The file's pairs but those the command line sets too (by the same key, or a key with the same target:
    ``--model.tokenizer`` replaces torchtitan's ``model.hf_assets_path``)."""
    on_cli = set().union(*(_key_targets(k) for k, _ in cli_pairs))
    return [(k, v) for k, v in file_pairs if not (_key_targets(k) & on_cli)]


def _torchtitan_max_seq_len(cfg: JobConfig, reading) -> None:
    """torchtitan sets the model's maximum sequence length from training.seq_len (``update_from_config``): under a
    torchtitan file so does titanlike, for a model that reads model.max_seq_len (model.max_seq_len wins when set)."""
    try:
        reads = model_keys_read(get_spec(cfg.model.name), cfg.model)
    except UnknownModelError:
        return  # reported by validate
    if "max_seq_len" in reads:
        cfg.model.max_seq_len = cfg.training.seq_len
        reading.notes.append(
            f"model.max_seq_len = {cfg.training.seq_len}: torchtitan's model maximum sequence length is "
            f"training.seq_len"
        )


def _cli_pairs(cli, problems: list[str]) -> list[tuple[str, object]]:
    """The command line's (key, value) pairs but --job.config_file; a bare --<bool key> is true."""
    out = []
    for key, value in cli:
        if key == "job.config_file":
            continue
        if value is None:
            section, _, name = key.partition(".")
            sections = _sections()
            tp = _field_types(sections[section]).get(name) if section in sections else None
            if tp is not bool and tp is not None:
                problems.append(f"--{key} needs a value ({_type_name(tp)})")
                continue
            value = "true"
        out.append((key, value))
    return out


def _validation_size_problems(cfg: JobConfig, reading) -> list[str]:
    """torchtitan's validation sizes: titanlike validates with the training's, so they must equal them."""
    out = []
    for key, value in reading.settings:
        if key.startswith("_validation."):
            name = key.rpartition(".")[2]
            if value != getattr(cfg.training, name):
                out.append(
                    f"torchtitan's validation.{name} = {value!r}: titanlike validates with "
                    f"training.{name} ({getattr(cfg.training, name)}); remove it or make them equal"
                )
    return out


def _model_name_from_hf_config(cfg: JobConfig, reading) -> None:
    """``model.name`` left unset and ``checkpoint.initial_load_path`` a Hugging Face folder whose config.json is a
    registered model's (its ``model_type``): that model, so that a ``save_pretrained`` folder trains with no
    ``--model.*`` option. A config.json titanlike cannot read is reported later, by the model arguments."""
    try:
        hf_args = initial_architecture_of(cfg)
    except ConfigError:
        return
    spec = spec_for(hf_args) if hf_args is not None else None
    if spec is not None and spec.name != cfg.model.name:
        cfg.model.name = spec.name
        reading.notes.append(
            f"model.name = {spec.name!r}: the model of {cfg.checkpoint.initial_load_path}'s {architecture_file(cfg)}"
        )


def _raise_all(cfg: JobConfig, problems: list[str]) -> None:
    """One ConfigError line with every problem (numbered when there are several), naming the file if any."""
    if not problems:
        return
    where = cfg.job.config_file
    raise ConfigError.of(problems, where if where or len(problems) == 1 else "the command line")


def format_config(cfg: JobConfig) -> str:
    """The whole configuration as TOML (job.print_config): what the run uses, defaults included."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                lines.append(f"# {key} = (unset)")
            elif isinstance(value, str):
                lines.append(f"{key} = {json.dumps(value)}")
            elif isinstance(value, bool):
                lines.append(f"{key} = {'true' if value else 'false'}")
            else:
                lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines).rstrip()


def _all_keys() -> dict[str, typing.Any]:
    return {f"{s}.{k}": t for s, c in _sections().items() for k, t in _field_types(c).items()}


def _apply_pairs(cfg: JobConfig, pairs, from_cli: bool, reading, problems: list[str], explicit: set[str]) -> None:
    """Set each (dotted key, value): titanlike keys directly, torchtitan keys through their table entry; every
    problem is collected."""
    from titanlike import torchtitan as tt

    known = _all_keys()
    for dotted, value in pairs:
        try:
            entry = tt.lookup(dotted)
            if dotted in known and (entry is None or entry.fate == tt.SHARED):
                _set(cfg, dotted, value, from_cli=from_cli)
                explicit.add(dotted)
            elif entry is not None:
                before = len(reading.settings)
                tt.read_key(dotted, _literal(value) if from_cli else value, reading)
                for key, v in reading.settings[before:]:
                    if not key.startswith("_"):
                        _set(cfg, key, v, from_cli=from_cli and isinstance(v, str))
                        explicit.add(key)
            else:
                section = dotted.partition(".")[0]
                if section not in _sections() and not any(k.startswith(section + ".") for k in tt.TORCHTITAN_KEYS):
                    problems.append(
                        f"unknown config section '{section}'{_suggest(section, _sections())}; "
                        f"valid sections: {', '.join(_sections())}"
                    )
                elif "." not in dotted:
                    problems.append(f"'{dotted}' names a section, not a key: use --{section}.<key>")
                else:
                    problems.append(f"unknown config key '{dotted}'{tt.suggestion(dotted, list(known))}")
        except ConfigError as e:
            problems.append(str(e))


def _literal(value):
    """A command-line value of a torchtitan key as TOML reads it (true, 3, "x", [..]), else the string."""
    if not isinstance(value, str):
        return value
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def _flatten(table: dict, prefix: str, out: list, path: str, problems: list[str]) -> None:
    for key, value in table.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            _flatten(value, dotted, out, path, problems)
        elif not prefix:
            problems.append(f"top-level key '{key}' must be a [section] table{_suggest(key, _sections())}")
        else:
            out.append((dotted, value))


def _read_toml(path: str, problems: list[str]) -> list[tuple[str, object]]:
    p = Path(path)
    if not p.is_file():
        what = "is a folder, not a TOML file" if p.is_dir() else "no such file"
        raise ConfigError(f"job.config_file: {what} '{path}' (configs live in configs/, e.g. configs/debug_model.toml)")
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"job.config_file: '{path}' is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"job.config_file: '{path}' is not UTF-8 text ({e.reason} at byte {e.start})") from None
    out: list[tuple[str, object]] = []
    _flatten(data, "", out, path, problems)
    return out


# Signal names checkpoint.exit_signals may hold: every one this platform defines but the two no process can catch.
CATCHABLE_SIGNALS = sorted(s.name for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP))


def value_problems(cfg: JobConfig) -> list[str]:
    """Every per-key choice and range violation, one line each."""
    out = []
    for dotted, allowed in choices().items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            out.append(
                f"{dotted}: '{value}' is not one of {', '.join(repr(c) for c in allowed)}"
                f"{_suggest(str(value), [str(c) for c in allowed])}"
            )
    for dotted, lo in MINIMUM.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if dotted == "training.steps" and value < lo:
            if not cfg.checkpoint.create_seed_checkpoint:  # a seed checkpoint trains nothing anyway
                out.append(
                    f"training.steps: {value} trains nothing; set training.steps >= 1 (to only write the "
                    f"initial weights use checkpoint.create_seed_checkpoint)"
                )
        elif value is not None and value < lo:
            out.append(f"{dotted}: {value} is below the minimum {lo}")
    bad = [
        f"{name!r} cannot be caught by any process"
        if name in ("SIGKILL", "SIGSTOP")
        else f"{name!r} is not a signal{_suggest(name, CATCHABLE_SIGNALS)}"
        for name in cfg.checkpoint.exit_signals
        if name not in CATCHABLE_SIGNALS
    ]
    if bad:
        out.append(f"checkpoint.exit_signals: {'; '.join(bad)}; give names such as SIGTERM,SIGINT (or '' for none)")
    for dotted, hi in MAXIMUM.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value is not None and value > hi:
            out.append(f"{dotted}: {value} is above the maximum {hi}")
    return out


def setting_problems(cfg: JobConfig) -> list[str]:
    """Every problem of the settings themselves (per-key ranges and choices, then the keys that refuse a value on their
    own), before any layout rule: one line each."""
    problems = value_problems(cfg)
    if problems:
        return problems
    if cfg.validation.steps == 0:
        problems.append(
            "validation.steps: 0 batches validates nothing; use -1 (the whole held-out tail), a "
            "positive count, or validation.enable = false"
        )
    if cfg.lr_scheduler.total_steps is not None and cfg.lr_scheduler.total_steps < 1:
        problems.append(
            f"lr_scheduler.total_steps: {cfg.lr_scheduler.total_steps} must be >= 1 (or unset: training.steps)"
        )
    return problems


def validate(cfg: JobConfig, world_size: int = 1) -> None:
    """The settings (:func:`setting_problems`), then every cross-field rule: a ConfigError with all of a stage's
    problems."""
    problems = setting_problems(cfg) or layout_violations(cfg, world_size, model_args_from_config(cfg))
    if problems:
        raise ConfigError.of(problems)


def model_args_from_config(cfg: JobConfig, vocab_size: int | None = None):
    """The flavor's args (of the spec ``model.name`` selects) with the config's overrides, the vocabulary padded to
    ``model.vocab_multiple``.

    When ``checkpoint.initial_load_path`` is a Hugging Face checkpoint with a config.json, the architecture is that
    file's instead of the flavor's (vocabulary exact, not padded); an explicit ``model.*`` override that disagrees
    with it is refused.
    """
    try:
        spec = get_spec(cfg.model.name)
    except UnknownModelError as e:
        raise ConfigError(f"{e}{_suggest(cfg.model.name, registered())}") from None
    flavors = spec.flavors
    if spec.args_from_overrides is not None:  # no flavors: the args come from the model.<key>s it reads
        return _args_from_overrides(cfg, spec, vocab_size)
    if cfg.model.flavor not in flavors:
        raise ConfigError(
            f"model.flavor: unknown flavor '{cfg.model.flavor}'{_suggest(cfg.model.flavor, flavors)}"
            f"; valid for {spec.name}: {', '.join(flavors)}"
        )
    m = cfg.model
    # Overrides the model does not read are left out here and refused by the layout rule "model_keys".
    reads = model_keys_read(spec, m)
    overrides = {k: v for k, v in model_overrides(m).items() if k in reads}
    if overrides.get("load_balance_coeff") == 0:
        overrides["load_balance_coeff"] = None  # 0: off (the args' None: no expert bias)
    hf_args = initial_architecture_of(cfg)
    if hf_args is not None:
        return _hf_model_args(cfg, hf_args, overrides, vocab_size)
    args = flavors[cfg.model.flavor].replace(**overrides)
    if "n_heads" in overrides and "n_kv_heads" not in overrides and args.n_kv_heads > args.n_heads:
        args = args.replace(n_kv_heads=args.n_heads)
    scaling_params = [k for k in overrides if k.startswith("rope_") and k not in ("rope_theta", "rope_scaling")]
    if getattr(args, "rope_scaling", "none") == "none" and scaling_params:
        raise ConfigError(
            f"model.{scaling_params[0]} is set but RoPE scaling is off; set model.rope_scaling = 'llama3' or drop it"
        )
    vocab = vocab_size if vocab_size is not None else args.vocab_size
    if vocab and vocab > 0:
        args = args.replace(vocab_size=pad_vocab(vocab, m.vocab_multiple))
    return args


def _reads_its_own_config(cfg: JobConfig) -> bool:
    """model.name is a model without flavors whose args come from its own model.<key>s (model.hf_config): a Hugging
    Face checkpoint.initial_load_path holds only its weights (checked against its config at load)."""
    try:
        return get_spec(cfg.model.name).args_from_overrides is not None
    except UnknownModelError:
        return False


def _args_from_overrides(cfg: JobConfig, spec, vocab_size: int | None):
    """The args of a model without flavors (``ModelSpec.args_from_overrides``), its vocabulary exact: a tokenizer
    with more ids than the model is refused."""
    reads = model_keys_read(spec, cfg.model)
    try:
        args = spec.args_from_overrides({k: getattr(cfg.model, k) for k in reads})
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if vocab_size is not None and vocab_size > args.vocab_size:
        raise ConfigError(
            f"model.tokenizer '{cfg.model.tokenizer}' has {vocab_size} ids but the model of model.hf_config has "
            f"only {args.vocab_size}; use its tokenizer or a config.json with a larger vocab_size"
        )
    return args


def initial_architecture_of(cfg: JobConfig):
    """The ModelArgs that ``checkpoint.initial_load_path`` records, else None: a titanlike checkpoint's
    checkpoint.json (a ``from-hf`` seed of any shape: head_dim, MoE sizes, YaRN) or a Hugging Face checkpoint's
    config.json. Training starts from that architecture, not from the flavor."""
    path = cfg.checkpoint.initial_load_path
    if not path or _reads_its_own_config(cfg):
        return None
    if (Path(path) / ".metadata").is_file():
        return _checkpoint_architecture(Path(path))
    from titanlike.hf import hf_architecture

    try:
        return hf_architecture(path)
    except ValueError as e:
        raise ConfigError(f"checkpoint.initial_load_path: {e}") from None


def architecture_file(cfg: JobConfig) -> str:
    """The file of ``checkpoint.initial_load_path`` that :func:`initial_architecture_of` reads."""
    return "checkpoint.json" if (Path(cfg.checkpoint.initial_load_path) / ".metadata").is_file() else "config.json"


def _checkpoint_architecture(path: Path):
    """The model args of a titanlike checkpoint's checkpoint.json (None without one, or one that records none: a
    checkpoint written by hand, checked by shapes at load). The file's format is titanlike.checkpoint.meta's."""
    meta_file = path / "checkpoint.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"checkpoint.initial_load_path: '{meta_file}' is corrupted ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("model_args"), dict):
        return None
    try:
        spec = get_spec(meta.get("model", DEFAULT_MODEL))
        return spec.args_from_record(meta["model_args"])
    except (UnknownModelError, TypeError) as e:
        raise ConfigError(
            f"checkpoint.initial_load_path: '{meta_file}' records a model titanlike cannot build ({e})"
        ) from None


_BALANCING_KEYS = ("load_balance_coeff", "aux_loss_coeff")  # training settings, not part of what the weights mean


def _hf_model_args(cfg: JobConfig, hf_args, overrides: dict, vocab_size: int | None):
    path, record = cfg.checkpoint.initial_load_path, architecture_file(cfg)
    spec = spec_for(hf_args)
    if spec is not None and spec.name != cfg.model.name:
        raise ConfigError(
            f"checkpoint.initial_load_path '{path}' is a {spec.name} model (its {record}), model.name is "
            f"{cfg.model.name}; set model.name = {spec.name}"
        )
    importer = spec.hf() if spec is not None and spec.hf_adapter and record == "config.json" else None
    if importer is not None and hasattr(importer, "import_overrides"):  # optional: options it honours over the file
        try:
            hf_args, overrides = importer.import_overrides(hf_args, overrides)
        except ValueError as e:
            raise ConfigError(f"checkpoint.initial_load_path '{path}': {e}") from None
    # how training balances the experts is not the checkpoint's to say: those options apply over its record
    balancing = {k: overrides.pop(k) for k in _BALANCING_KEYS if k in overrides}
    if balancing:
        hf_args = hf_args.replace(**balancing)
    conflicts = []
    for key, value in overrides.items():
        theirs = hf_args.hidden_dim if key == "ffn_hidden_dim" else getattr(hf_args, key)
        if value != theirs:
            conflicts.append(f"model.{key} {value} ({record} has {theirs})")
    if conflicts:
        raise ConfigError(
            f"checkpoint.initial_load_path '{path}' sets the architecture from its {record}, which disagrees with "
            f"{', '.join(conflicts)}; drop those model.* options"
        )
    if vocab_size is not None and vocab_size > hf_args.vocab_size:
        raise ConfigError(
            f"model.tokenizer '{cfg.model.tokenizer}' has {vocab_size} ids but the model at '{path}' ({record}) only "
            f"{hf_args.vocab_size}; use its tokenizer"
        )
    return hf_args
