"""torchtitan v0.2.2 TOMLs as input: the fate of every key torchtitan's ``JobConfig`` defines.

A torchtitan key is either

* **shared**: titanlike has the same key with the same meaning (``training.steps``); set as it is;
* **mapped**: titanlike has the concept under another key or spelling (``comm.train_timeout_seconds`` ->
  ``comm.timeout_seconds``); set there, with a one-line note;
* **inert**: it does not apply to titanlike (some MoE keys, torchft, ...) and is accepted only at values that change
  nothing (its torchtitan default, or "off"), with a note; any other value is refused, saying why;
* **refused**: titanlike cannot honour it; the message names the titanlike equivalent or why it does not apply.

A file that holds a torchtitan-only key is read as a torchtitan file: where it leaves a key out, torchtitan's
default applies where titanlike's own default differs (``TORCHTITAN_DEFAULTS``), including the behaviour torchtitan
has without a key (sequence parallelism whenever tp > 1, bf16 mixed-precision parameters under FSDP).

The table is documented key by key in docs/torchtitan.md; ``tests/config/test_torchtitan.py`` checks each fate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

SHARED, MAPPED, INERT, REFUSED = "shared", "mapped", "inert", "refused"


@dataclass(frozen=True)
class Key:
    fate: str
    target: str | None = None  # the titanlike key (shared / mapped)
    note: str = ""  # why / what it becomes
    ok: tuple = ()  # inert: the values that change nothing
    convert: Callable | None = None  # mapped: torchtitan value -> {titanlike key: value} (default {target: value})
    accept: Callable | None = None  # mapped: value -> None if accepted, else why not (refused with the note)
    source: str = "torchtitan"  # whose option it is (torchtitan, or Megatron for MUON_KEYS' Megatron names)


def _list_of_parts(value):
    return {"parallelism.pipeline_parallel_module_names": [",".join(part) for part in value]} if value else {}


def _dataset(value):
    return {"data.path": ""}


def _mixed_param(value):
    return {"training.dtype": "bfloat16" if value == "bfloat16" else "float32"}


def _hf_tokenizer_folder(value):
    """None when ``value`` is a folder holding a tokenizer.json, else why it cannot be read as a tokenizer."""
    from pathlib import Path

    if not isinstance(value, str) or not value:
        return "set it to a Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json)"
    if not (Path(value).expanduser() / "tokenizer.json").is_file():
        where = "no such folder" if not Path(value).expanduser().is_dir() else "the folder holds no tokenizer.json"
        return (
            f"{where}; point it at a Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json), or set "
            f"model.tokenizer (test, gpt2, cl100k, a .tiktoken path or a tokenizer folder)"
        )
    return None


def _only(*values, why: str):
    return lambda v: None if v in values else why


S = lambda: Key(SHARED)  # noqa: E731 - a key titanlike has, with the same meaning
NO_MOE = "not in titanlike's mixture-of-experts support (expert_parallel_degree only)"

# Every key of torchtitan v0.2.2's torchtitan/config/job_config.py (nested tables flattened with dots).
TORCHTITAN_KEYS: dict[str, Key] = {
    # [job]
    "job.config_file": S(),
    "job.dump_folder": S(),
    "job.description": S(),
    "job.print_config": S(),
    "job.save_config_file": Key(
        INERT, ok=(None, ""), note="titanlike does not write the merged config; job.print_config prints it"
    ),
    "job.custom_config_module": Key(INERT, ok=("",), note="titanlike's config is one fixed dataclass tree"),
    # [profiling]
    "profiling.enable_profiling": S(),
    "profiling.save_traces_folder": S(),
    "profiling.profile_freq": S(),
    "profiling.profiler_active": Key(MAPPED, "profiling.profile_active", "profiling.profile_active (same meaning)"),
    "profiling.profiler_warmup": Key(MAPPED, "profiling.profile_warmup", "profiling.profile_warmup (same meaning)"),
    "profiling.enable_memory_snapshot": S(),
    "profiling.save_memory_snapshot_folder": S(),
    # [metrics]
    "metrics.log_freq": S(),
    "metrics.enable_tensorboard": S(),
    "metrics.disable_color_printing": S(),
    "metrics.save_tb_folder": S(),
    "metrics.save_for_all_ranks": Key(
        INERT, ok=(False,), note="titanlike logs global metrics (all-reduced) from rank 0 only"
    ),
    "metrics.enable_wandb": S(),
    # [model]
    "model.name": S(),
    "model.flavor": S(),
    "model.hf_assets_path": Key(
        MAPPED,
        "model.tokenizer",
        "the tokenizer is the folder's tokenizer.json (BOS/EOS from its tokenizer_config.json / config.json); "
        "for its Hugging Face weights use checkpoint.initial_load_path <folder>",
        convert=lambda v: {"model.tokenizer": v},
        accept=_hf_tokenizer_folder,
    ),
    "model.tokenizer_path": Key(
        REFUSED,
        "model.tokenizer",
        "use model.tokenizer (test, gpt2, cl100k, a .tiktoken path, or a Hugging Face tokenizer folder)",
    ),
    "model.converters": Key(
        MAPPED,
        None,
        "no converters needed",
        convert=lambda v: {},
        accept=_only(
            [],
            why="titanlike's float8 is its [float8] section (float8.recipe = "
            "'tensorwise' | 'rowwise' through torchao, or model.kernels = 'te' for "
            "Transformer Engine); remove model.converters and set float8.recipe",
        ),
    ),
    "model.print_after_conversion": Key(INERT, ok=(False,), note="titanlike has no model converters"),
    # [optimizer]
    "optimizer.name": S(),
    "optimizer.lr": S(),
    "optimizer.beta1": S(),
    "optimizer.beta2": S(),
    "optimizer.eps": S(),
    "optimizer.weight_decay": S(),
    "optimizer.implementation": S(),
    "optimizer.early_step_in_backward": Key(
        INERT,
        ok=(False,),
        note="not implemented: the optimizer steps after the backward (needed for gradient clipping by global norm)",
    ),
    # [lr_scheduler]
    "lr_scheduler.warmup_steps": S(),
    "lr_scheduler.total_steps": S(),
    "lr_scheduler.decay_ratio": S(),
    "lr_scheduler.decay_type": S(),
    "lr_scheduler.min_lr_factor": S(),
    # [training]
    "training.dataset": Key(
        MAPPED,
        "data.path",
        "titanlike's shipped corpus (data.path = ''), the local small test set as torchtitan's c4_test is",
        convert=_dataset,
        accept=_only(
            "c4_test",
            why="titanlike reads local files, never downloads: set data.path (a text file, folder, .jsonl or .bin)",
        ),
    ),
    "training.dataset_path": Key(
        MAPPED, "data.path", "data.path (a file, folder or glob of .txt, .jsonl(.gz/.zst), .parquet or .bin)"
    ),
    "training.local_batch_size": S(),
    "training.global_batch_size": S(),
    "training.seq_len": S(),
    "training.max_norm": S(),
    "training.steps": S(),
    "training.enable_cpu_offload": S(),
    "training.dtype": S(),
    "training.mixed_precision_param": Key(
        MAPPED,
        "training.dtype",
        "training.dtype = 'bfloat16' is titanlike's bf16 parameters over float32 master weights",
        convert=_mixed_param,
    ),
    "training.mixed_precision_reduce": Key(INERT, ok=("float32",), note="titanlike reduces gradients in float32"),
    "training.gc_freq": Key(INERT, ok=(50,), note="titanlike leaves Python's garbage collector alone"),
    "training.gc_debug": Key(INERT, ok=(False,), note="titanlike leaves Python's garbage collector alone"),
    "training.dataloader.num_workers": Key(MAPPED, "data.num_workers", "data.num_workers (same meaning)"),
    "training.dataloader.persistent_workers": Key(INERT, ok=(False,), note="titanlike's loader is built once per run"),
    "training.dataloader.pin_memory": Key(INERT, ok=(False,), note="batches are moved with non_blocking copies"),
    "training.dataloader.prefetch_factor": Key(INERT, ok=(None,), note="torch's default prefetching"),
    # [parallelism]
    "parallelism.data_parallel_replicate_degree": S(),
    "parallelism.data_parallel_shard_degree": S(),
    "parallelism.fsdp_reshard_after_forward": S(),
    "parallelism.tensor_parallel_degree": S(),
    "parallelism.disable_loss_parallel": S(),
    "parallelism.enable_async_tensor_parallel": Key(
        INERT,
        ok=(False,),
        note="async TP (CUDA symmetric memory + "
        "compile) is not implemented; TP runs synchronous collectives "
        "with the same numerics: remove it",
    ),
    "parallelism.pipeline_parallel_degree": S(),
    "parallelism.module_fqns_per_model_part": Key(
        MAPPED,
        "parallelism.pipeline_parallel_module_names",
        "parallelism.pipeline_parallel_module_names (one comma-separated string per stage)",
        convert=_list_of_parts,
    ),
    "parallelism.pipeline_parallel_first_stage_less_layers": S(),
    "parallelism.pipeline_parallel_last_stage_less_layers": S(),
    "parallelism.pipeline_parallel_layers_per_stage": S(),
    "parallelism.pipeline_parallel_schedule": S(),
    "parallelism.pipeline_parallel_schedule_csv": Key(
        INERT, ok=(None, ""), note="schedules are chosen by name (parallelism.pipeline_parallel_schedule)"
    ),
    "parallelism.pipeline_parallel_microbatch_size": S(),
    "parallelism.pipeline_parallel_expert_parallel_overlap": Key(INERT, ok=(True, False), note=NO_MOE),
    "parallelism.context_parallel_degree": S(),
    "parallelism.context_parallel_load_balancer": Key(
        INERT,
        ok=(None, "headtail"),
        note="titanlike's context parallelism always balances head-tail (chunks r and 2cp-1-r)",
    ),
    "parallelism.context_parallel_rotate_method": Key(
        INERT,
        ok=("allgather",),
        note="titanlike chooses its cp attention by parallelism.context_parallel_method "
        "(allgather | alltoall | ring | hybrid)",
    ),
    "parallelism.expert_parallel_degree": S(),
    "parallelism.expert_tensor_parallel_degree": Key(INERT, ok=(1,), note=NO_MOE),
    "parallelism.expert_parallel_comm_backend": Key(INERT, ok=("standard",), note=NO_MOE),
    # [checkpoint]
    "checkpoint.enable": S(),
    "checkpoint.enable_ft_dataloader_checkpoints": Key(
        INERT,
        ok=(True, False),
        note="every checkpoint of a fault-tolerant replica group holds its data position (docs/fault_tolerance.md)",
    ),
    "checkpoint.folder": S(),
    "checkpoint.interval": S(),
    "checkpoint.initial_load_path": S(),
    "checkpoint.initial_load_model_only": Key(
        INERT,
        ok=(True,),
        note="titanlike's initial_load_path loads model "
        "weights only; to resume a full state put the checkpoint in "
        "checkpoint.folder",
    ),
    "checkpoint.initial_load_in_hf": Key(
        INERT, ok=(True, False), note="titanlike tells a Hugging Face folder from a DCP one by its files"
    ),
    "checkpoint.initial_load_in_hf_quantized": Key(
        INERT, ok=(False,), note="quantized Hugging Face weights are not supported"
    ),
    "checkpoint.last_save_model_only": S(),
    "checkpoint.last_save_in_hf": Key(
        MAPPED,
        "checkpoint.export_safetensors",
        "checkpoint.export_safetensors (<folder>/final as Hugging Face safetensors + config.json)",
    ),
    "checkpoint.export_dtype": S(),
    "checkpoint.async_mode": Key(
        MAPPED,
        "checkpoint.async_mode",
        "'async_with_pinned_mem' is 'async' (staged in host memory)",
        convert=lambda v: {"checkpoint.async_mode": "async" if v == "async_with_pinned_mem" else v},
    ),
    "checkpoint.keep_latest_k": S(),
    "checkpoint.load_step": S(),
    "checkpoint.exclude_from_loading": Key(
        INERT,
        ok=([],),
        note="not implemented: a resume loads the whole state (model, optimizer, schedule, data position, RNG)",
    ),
    "checkpoint.enable_first_step_checkpoint": Key(
        INERT,
        ok=(False,),
        note="not implemented: checkpoints are saved every checkpoint.interval steps and at the last step",
    ),
    "checkpoint.create_seed_checkpoint": S(),
    "checkpoint.load_only": Key(INERT, ok=(False,), note="not implemented: a run with checkpoint.enable saves"),
    # [activation_checkpoint]
    "activation_checkpoint.mode": S(),
    "activation_checkpoint.selective_ac_option": S(),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": Key(
        INERT, ok=(["moe.router.gate"], []), note=NO_MOE
    ),
    "activation_checkpoint.early_stop": Key(INERT, ok=(False,), note="not implemented"),
    "activation_checkpoint.memory_budget": Key(INERT, ok=(0.5,), note="mode 'memory_budget' is not implemented"),
    "activation_checkpoint.visualize_memory_budget_pareto": Key(
        INERT, ok=(False,), note="mode 'memory_budget' is not implemented"
    ),
    "activation_checkpoint.preserve_rng_state": Key(
        INERT, ok=(True,), note="titanlike's checkpointing preserves the RNG state"
    ),
    "activation_checkpoint.determinism_check": Key(INERT, ok=("default",), note="torch's default check"),
    "activation_checkpoint.debug": Key(INERT, ok=(False,), note="not implemented"),
    # [compile]
    "compile.enable": S(),
    "compile.backend": S(),
    "compile.components": Key(
        MAPPED,
        None,
        "titanlike compiles every transformer block (the model); the loss runs eager (same numerics)",
        convert=lambda v: {},
        accept=_only(
            ["model", "loss"],
            ["model"],
            ["loss", "model"],
            why="titanlike compiles the model's blocks: use ['model'] or ['model', 'loss'], or compile.enable = false",
        ),
    ),
    # [quantize.*]: torchao float8 / MX. titanlike's float8 is its own [float8] section (torchao or TE).
    **{
        f"quantize.linear.float8.{k}": Key(
            INERT,
            ok=ok,
            note="applies with model.converters = ['float8'] only; "
            "titanlike's float8 is the [float8] section (float8.recipe, "
            f"float8.{k.replace('recipe_name', 'recipe')})",
        )
        for k, ok in (
            ("enable_fsdp_float8_all_gather", (False, True)),
            ("precompute_float8_dynamic_scale_for_fsdp", (False, True)),
            ("recipe_name", (None,)),
            ("filter_fqns", None),
            ("emulate", (False,)),
        )
    },
    **{
        f"quantize.linear.mx.{k}": Key(
            INERT,
            ok=ok,
            note="torchao MX is not supported; titanlike's mxfp8 is model.kernels = 'te' + float8.recipe = 'mxfp8'",
        )
        for k, ok in (
            ("mxfp8_dim1_cast_kernel_choice", ("triton",)),
            ("recipe_name", ("mxfp8_cublas",)),
            ("filter_fqns", (["output"],)),
        )
    },
    "quantize.grouped_mm.float8.fqns": Key(INERT, ok=([], ""), note=NO_MOE),
    "quantize.grouped_mm.mx.recipe_name": Key(INERT, ok=("mxfp8",), note=NO_MOE),
    "quantize.grouped_mm.mx.fqns": Key(INERT, ok=([], ""), note=NO_MOE),
    # [comm]
    "comm.init_timeout_seconds": S(),
    "comm.train_timeout_seconds": Key(MAPPED, "comm.timeout_seconds", "comm.timeout_seconds (every collective)"),
    "comm.trace_buf_size": Key(
        INERT, ok=(20000,), note="NCCL's flight recorder is configured by its environment variables"
    ),
    "comm.save_traces_folder": Key(INERT, ok=("comm_traces",), note="NCCL's flight recorder is not configured here"),
    "comm.save_traces_file_prefix": Key(INERT, ok=("rank_",), note="NCCL's flight recorder is not configured here"),
    "comm.mode": Key(
        INERT,
        ok=("default",),
        note="for a fake-backend dry run use scripts/plan.py (it dry-runs the layout on a fake process group)",
    ),
    # [memory_estimation]
    "memory_estimation.enable": Key(INERT, ok=(False,), note="use scripts/plan.py (memory per rank of any layout)"),
    "memory_estimation.disable_fake_mode": Key(INERT, ok=(False,), note="use scripts/plan.py"),
    # [fault_tolerance]: replica groups through torchft (docs/fault_tolerance.md)
    "fault_tolerance.enable": S(),
    "fault_tolerance.process_group": S(),
    "fault_tolerance.process_group_timeout_ms": S(),
    "fault_tolerance.replica_id": S(),
    # the same count of groups; their data differs from torchtitan's fixed shard per replica_id: each step's group
    # batches follow the groups that take part, and training.global_batch_size is one group's batch
    "fault_tolerance.group_size": S(),
    "fault_tolerance.min_replica_size": S(),
    "fault_tolerance.semi_sync_method": Key(
        MAPPED,
        "fault_tolerance.semi_sync_method",
        "fault_tolerance.semi_sync_method (None: 'none'; torchft's LocalSGD and DiLoCo: 'local_sgd', 'diloco')",
        convert=lambda v: {"fault_tolerance.semi_sync_method": "none" if v is None else v},
        accept=_only(None, "local_sgd", "diloco", why="use None (synchronous), 'local_sgd' or 'diloco'"),
    ),
    # [experimental]
    "experimental.custom_import": Key(INERT, ok=("",), note="titanlike has no plugin imports"),
    "experimental.custom_args_module": Key(INERT, ok=("",), note="titanlike's config is one fixed dataclass tree"),
    # [validation]
    "validation.enable": S(),
    "validation.dataset": Key(
        MAPPED,
        None,
        "titanlike validates on validation.path, or on the held-out tail (data.val_fraction) of the training data",
        convert=lambda v: {},
        accept=_only("c4_validation", why="titanlike validates on the held-out tail (data.val_fraction) of data.path"),
    ),
    "validation.dataset_path": Key(
        REFUSED,
        "validation.path",
        "set titanlike's validation.path (a file, folder or glob of held-out data), or data.val_fraction "
        "(the held-out tail of data.path)",
    ),
    "validation.local_batch_size": Key(
        MAPPED,
        None,
        "equal to training.local_batch_size, which validation uses",
        convert=lambda v: {"_validation.local_batch_size": v},
    ),
    "validation.seq_len": Key(
        MAPPED, None, "equal to training.seq_len, which validation uses", convert=lambda v: {"_validation.seq_len": v}
    ),
    "validation.freq": S(),
    "validation.steps": S(),
    "validation.dataloader.num_workers": Key(INERT, ok=(0,), note="validation batches are read in the process"),
    "validation.dataloader.persistent_workers": Key(
        INERT, ok=(False,), note="validation batches are read in the process"
    ),
    "validation.dataloader.pin_memory": Key(INERT, ok=(False,), note="validation batches are read in the process"),
    "validation.dataloader.prefetch_factor": Key(INERT, ok=(None,), note="validation batches are read in the process"),
    # [debug]
    "debug.seed": Key(
        MAPPED, "training.seed", "training.seed", convert=lambda v: {"training.seed": v} if v is not None else {}
    ),
    "debug.deterministic": Key(MAPPED, "training.deterministic", "training.deterministic"),
    "debug.deterministic_warn_only": Key(INERT, ok=(False,), note="deterministic mode raises on a nondeterministic op"),
    "debug.moe_force_load_balance": Key(INERT, ok=(False,), note=NO_MOE),
}

# Muon options of torchtitan's Muon integrations (not in v0.2.2: the Dion-based experiment's [optimizer] keys and
# the later Muon commit's mu / adjust_lr / muon_fallback_algorithm) and of Megatron-Core's OptimizerConfig (its
# --muon-* flags, as optimizer.muon_* keys): mapped to torch.optim.Muon's names where the meaning is the same,
# accepted where they change nothing, refused with the equivalent otherwise. A file holding only these is not
# read as a torchtitan file.
_ONE_ADAMW = "titanlike trains every parameter that is not a matrix with AdamW, at one lr (optimizer.adamw_lr)"
_PER_CHUNK = "titanlike orthogonalizes a fused q|k|v per chunk, as separate matrices (docs/muon.md)"
_MEGATRON = "Megatron"


def _adjust_lr(value):
    return {"optimizer.adjust_lr_fn": "match_rms_adamw"}


def _scale_mode(value):
    return {"optimizer.adjust_lr_fn": "original"}


def _matmul_prec(value):
    return {"optimizer.ns_dtype": "bfloat16" if value == "medium" else "float32"}


MUON_KEYS: dict[str, Key] = {
    "optimizer.mu": Key(
        MAPPED,
        "optimizer.momentum",
        "torch.optim.Muon's momentum (torchtitan's Muon defaults to nesterov = false, titanlike to torch's true: "
        "set optimizer.nesterov)",
    ),
    "optimizer.adjust_lr": Key(
        MAPPED,
        "optimizer.adjust_lr_fn",
        "rms_norm is 0.2 sqrt(max(rows, cols)), torch's match_rms_adamw",
        convert=_adjust_lr,
        accept=_only(
            "rms_norm",
            why="titanlike adjusts the lr as torch.optim.Muon does: optimizer.adjust_lr_fn = 'original' "
            "(sqrt(max(1, rows / cols)); spectral_norm's sqrt(rows / cols) equals it for rows >= cols) or "
            "'match_rms_adamw' (rms_norm's 0.2 sqrt(max(rows, cols))); set optimizer.adjust_lr_fn instead",
        ),
    ),
    "optimizer.muon_fallback_algorithm": Key(INERT, ok=("adamw",), note=_ONE_ADAMW),
    "optimizer.algorithm": Key(INERT, ok=("muon",), note="optimizer.name = 'Muon' selects Muon (no Dion)"),
    "optimizer.flatten": Key(
        INERT, ok=(False,), note="Muon orthogonalizes 2-D matrices (stacked experts one by one), never a flattened one"
    ),
    "optimizer.use_triton": Key(INERT, ok=(False,), note="Newton-Schulz runs in torch ops (optimizer.ns_dtype)"),
    "optimizer.muon_split": Key(INERT, ok=(False,), note="no per-head Newton-Schulz (titanlike has no MLA)"),
    "optimizer.scalar_optimizer": Key(INERT, ok=("adamw",), note=_ONE_ADAMW),
    "optimizer.embedding_optimizer": Key(INERT, ok=("adamw",), note=_ONE_ADAMW),
    "optimizer.head_optimizer": Key(INERT, ok=("adamw",), note=_ONE_ADAMW),
    "optimizer.expert_optimizer": Key(INERT, ok=(None,), note=NO_MOE),
    "optimizer.routing_optimizer": Key(INERT, ok=(None,), note=NO_MOE),
    "optimizer.head_lr_scaling": Key(INERT, ok=(False,), note=_ONE_ADAMW),
    "optimizer.scalar_lr_factor": Key(INERT, ok=(1.0,), note=_ONE_ADAMW),
    "optimizer.embedding_lr_factor": Key(INERT, ok=(1.0,), note=_ONE_ADAMW),
    "optimizer.head_lr_factor": Key(INERT, ok=(1.0,), note=_ONE_ADAMW),
    "optimizer.expert_lr_factor": Key(INERT, ok=(1.0,), note=NO_MOE),
    "optimizer.routing_lr_factor": Key(INERT, ok=(1.0,), note=NO_MOE),
    "optimizer.state_dtype": Key(
        INERT, ok=("float32",), note="Muon's momentum buffers are kept in the parameters' dtype"
    ),
    # Megatron-Core (megatron.core.optimizer.OptimizerConfig)
    "optimizer.muon_momentum": Key(MAPPED, "optimizer.momentum", "torch.optim.Muon's momentum", source=_MEGATRON),
    "optimizer.muon_use_nesterov": Key(
        MAPPED, "optimizer.nesterov", "Nesterov momentum (Megatron's default false, torch's true)", source=_MEGATRON
    ),
    "optimizer.muon_nesterov": Key(
        MAPPED, "optimizer.nesterov", "Nesterov momentum (Megatron's default false, torch's true)", source=_MEGATRON
    ),
    "optimizer.muon_num_ns_steps": Key(MAPPED, "optimizer.ns_steps", "Newton-Schulz iterations", source=_MEGATRON),
    "optimizer.muon_scale_mode": Key(
        MAPPED,
        "optimizer.adjust_lr_fn",
        "shape_scaling is sqrt(max(1, rows / cols)), torch's original",
        convert=_scale_mode,
        accept=_only(
            "shape_scaling",
            why="titanlike adjusts the lr as torch.optim.Muon does; Megatron's spectral with "
            "muon_extra_scale_factor 0.2 is optimizer.adjust_lr_fn = 'match_rms_adamw' (unit_rms_norm has no "
            "equivalent): set optimizer.adjust_lr_fn and drop muon_scale_mode / muon_extra_scale_factor",
        ),
        source=_MEGATRON,
    ),
    "optimizer.muon_extra_scale_factor": Key(
        INERT,
        ok=(1.0,),
        note="the spectral scale with factor 0.2 is optimizer.adjust_lr_fn = 'match_rms_adamw'; any other factor "
        "is a change of optimizer.lr",
        source=_MEGATRON,
    ),
    "optimizer.muon_fp32_matmul_prec": Key(
        MAPPED,
        "optimizer.ns_dtype",
        "medium runs Newton-Schulz in bfloat16, highest in float32",
        convert=_matmul_prec,
        accept=_only(
            "medium",
            "highest",
            why="TF32 matmuls are not a titanlike precision: optimizer.ns_dtype = 'float32' (highest) or "
            "'bfloat16' (medium)",
        ),
        source=_MEGATRON,
    ),
    "optimizer.muon_coefficient_type": Key(
        INERT,
        ok=("quintic",),
        note="Newton-Schulz takes one (a, b, c) for every iteration: optimizer.ns_coefficients (torch's quintic "
        "by default)",
        source=_MEGATRON,
    ),
    "optimizer.muon_split_qkv": Key(INERT, ok=(True,), note=_PER_CHUNK, source=_MEGATRON),
    "optimizer.muon_tp_mode": Key(
        INERT,
        ok=("duplicated", "distributed"),
        note="titanlike orthogonalizes every matrix whole, once, on one owner rank (duplicated's and distributed's "
        "result; blockwise, Newton-Schulz of each tensor-parallel shard, is a different update)",
        source=_MEGATRON,
    ),
    "optimizer.muon_scalar_optimizer": Key(INERT, ok=("adam",), note=_ONE_ADAMW, source=_MEGATRON),
}


def lookup(dotted: str) -> Key | None:
    """The fate of a foreign key: torchtitan v0.2.2's, or a torchtitan / Megatron Muon option."""
    return TORCHTITAN_KEYS.get(dotted) or MUON_KEYS.get(dotted)


# Defaults of shared keys where titanlike's own default differs from torchtitan's: applied to a torchtitan file that
# leaves the key out (titanlike's own default is kept for titanlike's configs and the command line; see
# docs/torchtitan.md for why each differs).
TORCHTITAN_DEFAULTS = {
    "training.local_batch_size": 8,
    "training.global_batch_size": -1,
    "training.seq_len": 2048,
    "training.steps": 10000,
    "activation_checkpoint.mode": "selective",
    "activation_checkpoint.selective_ac_option": "2",
    "validation.steps": -1,
    "validation.freq": 10,
    "validation.enable": False,
    "optimizer.implementation": "fused",
    "parallelism.pipeline_parallel_first_stage_less_layers": 1,
    "parallelism.pipeline_parallel_last_stage_less_layers": 1,
    "checkpoint.last_save_model_only": True,
    "comm.timeout_seconds": 100,
    "training.dtype": "bfloat16",  # torchtitan's mixed_precision_param = bfloat16 (bf16 parameters under FSDP)
    "parallelism.enable_sequence_parallel": True,  # torchtitan shards sequences whenever tp > 1 (no key)
}

# Meaning-based suggestions for keys that neither side has (checked before spelling).
SYNONYMS = {
    "training.batch_size": "training.local_batch_size",
    "training.lr": "optimizer.lr",
    "training.learning_rate": "optimizer.lr",
    "optimizer.learning_rate": "optimizer.lr",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
    "training.seed": "training.seed",
    "training.gradient_accumulation_steps": "training.global_batch_size",
    "training.data_path": "data.path",
    "data.dataset": "data.path",
    "data.dataset_path": "data.path",
    "model.vocab_size": "model.tokenizer",
    "model.tokenizer_name": "model.tokenizer",
    "training.grad_clip": "training.max_norm",
    "training.clip_grad_norm": "training.max_norm",
    "parallelism.sequence_parallel": "parallelism.enable_sequence_parallel",
    "parallelism.tp": "parallelism.tensor_parallel_degree",
    "parallelism.pp": "parallelism.pipeline_parallel_degree",
    "parallelism.dp": "parallelism.data_parallel_shard_degree",
    "checkpoint.save_interval": "checkpoint.interval",
    "metrics.log_interval": "metrics.log_freq",
}


@dataclass
class Reading:
    """What reading torchtitan keys produced: settings for titanlike keys, notes to print, problems to report."""

    settings: list[tuple[str, object]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    torchtitan_only: list[str] = field(default_factory=list)


def read_key(dotted: str, value, reading: Reading) -> None:
    """Apply torchtitan key ``dotted`` (not a titanlike key): settings, a note, or a problem."""
    key = lookup(dotted)
    reading.torchtitan_only.append(dotted)
    if key.fate == REFUSED:
        if value in (None, "", []):  # unset: nothing to honour
            reading.notes.append(f"{dotted} = {value!r} accepted, unset ({key.note})")
        else:
            reading.problems.append(f"{key.source}'s {dotted} = {value!r}: {key.note}")
    elif key.fate == INERT:
        if key.ok is None or value in key.ok:
            reading.notes.append(f"{dotted} = {value!r} accepted, changes nothing here ({key.note})")
        else:
            reading.problems.append(f"{key.source}'s {dotted} = {value!r} does not apply: {key.note}")
    elif key.fate == MAPPED:
        why = key.accept(value) if key.accept else None
        if why:
            reading.problems.append(f"{key.source}'s {dotted} = {value!r}: {why}")
            return
        sets = key.convert(value) if key.convert else {key.target: value}
        reading.settings += list(sets.items())
        if sets == {dotted: value}:
            return  # the same key and value in titanlike: nothing to note
        target = ", ".join(f"{k} = {v!r}" for k, v in sets.items() if not k.startswith("_")) or "nothing to set"
        reading.notes.append(f"{dotted} = {value!r} -> {target}: {key.note}")


def suggestion(dotted: str, titanlike_keys: list[str]) -> str:
    """' (did you mean ...?)' for an unknown key: by meaning first (synonyms, torchtitan's spelling of a titanlike
    key), then by spelling over titanlike's keys and torchtitan's (naming the titanlike equivalent)."""
    import difflib

    if dotted in SYNONYMS:
        return f" (did you mean '{SYNONYMS[dotted]}'?)"
    section, _, name = dotted.rpartition(".")
    for other, key in TORCHTITAN_KEYS.items():  # the same key name in another section of torchtitan's tree
        if other.rpartition(".")[2] == name and key.fate in (SHARED, MAPPED) and (key.target or other):
            target = key.target or other
            if target in titanlike_keys:
                return f" (did you mean '{target}'?)"
    # spelling, over titanlike's keys and torchtitan's (a torchtitan key suggests its titanlike equivalent)
    candidates = {k: k for k in titanlike_keys}
    for other, key in TORCHTITAN_KEYS.items():
        target = key.target or (other if key.fate == SHARED else None)
        if target in titanlike_keys:
            candidates.setdefault(other, target)
    close = difflib.get_close_matches(dotted, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{candidates[close[0]]}'?)" if close else ""
