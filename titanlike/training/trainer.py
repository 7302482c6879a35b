"""The trainer: config -> (process group, meshes) -> model -> parallelize -> data -> train loop.

Runs as one plain process (``python train.py``) or under ``torchrun`` (gloo on CPU, nccl on CUDA, chosen from the
device). Every configuration error is raised before a process group exists.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from titanlike import fault, hang
from titanlike.config import (
    JobConfig,
    architecture_file,
    config_help,
    initial_architecture_of,
    load_config,
    model_args_from_config,
)
from titanlike.errors import ConfigError
from titanlike.layout import (
    batch_split,
    describe_split,
    float8_backend,
    layout_violations,
    master_dtype,
    stage_module_names,
    virtual_dp_degree,
)
from titanlike.layout.rules import resolve_local_batch
from titanlike.loss import IGNORE_INDEX
from titanlike.models import get_spec
from titanlike.parallel import ParallelDims, build_parallel_model, describe_layout
from titanlike.training.metrics import (
    ImbalanceWatch,
    MetricsLogger,
    Throughput,
    data_metrics,
    expert_metrics,
    format_data,
    format_eta,
    peak_host_bytes,
    peak_memory_gib,
    use_color,
    write_expert_load_picture,
)
from titanlike.training.optim import build_lr_scheduler, build_optimizer
from titanlike.training.step import StepResult, eval_loss_sum, train_step

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def resolve_device(cfg: JobConfig) -> torch.device:
    kind = cfg.training.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("training.device: cuda was asked for but no GPU is visible; use --training.device cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def attention_note(cfg: JobConfig, device: torch.device, eos_id: int, model_parts=()) -> str:
    """The start-up line's mask and backend (and the seams' sliding windows and sinks)."""
    from titanlike.models.masking import attention_backend

    backend = {"flex": "FlexAttention with a block mask", "sdpa": "SDPA with an exact boolean mask"}
    seams = [m for part in model_parts for m in part.modules() if getattr(m, "attention_seam", False)]
    windowed = sorted({m.window for m in seams if m.window is not None})
    local = ""
    if windowed:
        n = sum(m.window is not None for m in seams)
        local += f"; sliding window {', '.join(map(str, windowed))} in {n} of {len(seams)} layers"
    if any(m.sinks for m in seams):
        local += "; a learned sink per head" + (" (explicit softmax)" if attention_backend(device) == "sdpa" else "")
    if cfg.model.attn_mask_type == "causal":
        kernel = "SDPA's causal kernel" if not local else backend[attention_backend(device)]
        return f"causal mask ({kernel}){local}"
    reset = ", positions restart per document" if cfg.model.reset_position_ids else ""
    return (
        f"block_causal mask (documents end at EOS id {eos_id}), {backend[attention_backend(device)]} on "
        f"{device.type}{reset}{local}"
    )


def float8_note(model_parts, emulate: bool) -> str | None:
    """The start-up line of a torchao float8 run: what trains in float8 and what does not (None without float8)."""
    from titanlike.kernels.float8 import experts_float8_unavailable
    from titanlike.models.moe import GroupedExperts

    if not any(hasattr(m, "_float8_converted") for m in model_parts):
        return None
    converted = sum(len(getattr(m, "_float8_converted", ())) for m in model_parts)
    recipe = next(m._float8_recipe for m in model_parts if hasattr(m, "_float8_converted"))
    note = f"{converted} Linear layers train in torchao float8 ({recipe})"
    experts = sum(isinstance(mod, GroupedExperts) for m in model_parts for mod in m.modules())
    fp8_experts = sum(
        isinstance(mod, GroupedExperts) and mod.grouped_mm is not None for m in model_parts for mod in m.modules()
    )
    if fp8_experts:
        note += f"; the routed experts of {fp8_experts} MoE block(s) through torchao's float8 rowwise grouped GEMM"
    elif experts:
        note += (
            f"; the routed experts of {experts} MoE block(s) keep high-precision grouped GEMMs "
            f"({experts_float8_unavailable(emulate)})"
        )
    return note


def default_corpus() -> list[str]:
    from titanlike.data import shipped_corpus

    return shipped_corpus()


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


class NonFiniteError(fault.ReportedError):
    """The run stops: too many non-finite steps, or an update made the weights non-finite."""


@dataclass
class TrainState:
    """The run's counters, checkpointed as one ``Stateful`` piece."""

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # non-ignored label tokens trained on
    nonfinite_steps: int = 0  # updates skipped for a non-finite loss or gradient norm

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "nonfinite_steps": self.nonfinite_steps}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen, self.nonfinite_steps = (
            int(state["step"]),
            int(state["tokens_seen"]),
            int(state["nonfinite_steps"]),
        )


@dataclass
class _StepRate:
    """The training loop's throughput meter and what MFU divides by (the device's peak, the model's FLOPs)."""

    peak: float | None
    flops_per_token: float
    throughput: Throughput
    last_logged: int  # the step of the last logged line


def _counter(name: str) -> property:
    return property(
        lambda self: getattr(self.train_state, name),
        lambda self, value: setattr(self.train_state, name, value),
        doc=f"``train_state.{name}``",
    )


class Trainer:
    step = _counter("step")
    tokens_seen = _counter("tokens_seen")
    nonfinite_steps = _counter("nonfinite_steps")

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.timeout = datetime.timedelta(seconds=cfg.comm.timeout_seconds)
        self.device = resolve_device(cfg)

        # Everything that can be wrong with the input is checked before the process group starts.
        from titanlike.data import build_tokenizer

        try:
            self.tokenizer = build_tokenizer(cfg.model.tokenizer)
        except (ValueError, OSError) as e:
            raise ConfigError(f"model.tokenizer: {e}") from None
        self.model_args = model_args_from_config(cfg, self.tokenizer.vocab_size)
        self.spec = get_spec(cfg.model.name)
        self._describe_architecture()
        resolve_local_batch(cfg, self.world_size)  # training.local_batch_size -1: the global batch over dp
        problems = layout_violations(cfg, self.world_size, self.model_args)
        if problems:
            raise ConfigError.of(problems)
        self._check_runtime_requirements()
        self._check_host_memory()
        self._check_fault_tolerance()
        dump = Path(cfg.job.dump_folder)
        if dump.exists() and not dump.is_dir():
            raise ConfigError(f"job.dump_folder: '{dump}' is a file, not a folder; choose another job.dump_folder")
        self._load_data()

        if cfg.training.deterministic or cfg.training.layout_invariant:
            set_deterministic()
        self.distributed = self.world_size > 1
        self.run_lock = self._lock_run_folders()
        try:
            self._init_process_group()
            self.rank = dist.get_rank() if self.distributed else 0
            # a collective that times out (or SIGUSR2) writes a hang report into job.dump_folder/hang (hang.py)
            self.hang_report = (
                hang.HangReport(cfg.job.dump_folder, self.rank, self.world_size, cfg.comm.timeout_seconds)
                if self.distributed
                else None
            )
            self._build()
            if self.distributed:
                fault.bound_process_groups(self.timeout)  # the default, mesh, pipeline and checkpoint groups
            self.replicas = self._replica_groups()
            self.sentinel = self._build_sentinel()
            if self.hang_report is not None:
                self.hang_report.install(self.model_parts, self.optimizer)
                if self.checkpointer is not None:  # its saves' failed collectives report too
                    self.checkpointer.hang_report = self.hang_report
        except BaseException:
            self.release_lock()
            raise

    def _describe_architecture(self) -> None:
        """The start-up line saying where the model's architecture came from (an initial checkpoint's file, a
        transformers config.json) when it is not a flavor."""
        cfg = self.cfg
        self.architecture_note = None
        self.architecture_from = None  # the file the architecture came from, instead of a flavor
        if initial_architecture_of(cfg) is not None:
            from titanlike.hf import describe_args

            self.architecture_from = f"{cfg.checkpoint.initial_load_path} {architecture_file(cfg)}"
            unused = (
                f" (model.flavor {cfg.model.flavor} not used)" if "model.flavor" in getattr(cfg, "explicit", ()) else ""
            )
            self.architecture_note = (
                f"model: architecture from {self.architecture_from}{unused}: {describe_args(self.model_args)}"
            )
        if self.spec.args_from_overrides is not None and self.spec.hf_adapter:  # model.name = "hf": its config.json
            from titanlike.hf import describe_args

            self.architecture_note = f"model: transformers {describe_args(self.model_args)}"

    def _check_runtime_requirements(self) -> None:
        """What the config needs installed or reachable: Transformer Engine, W&B and lm-eval, torchao's float8 on
        this device; one line (every problem of W&B and lm-eval in it), exit 2."""
        cfg = self.cfg
        if cfg.model.kernels == "te":
            from titanlike.kernels import TEUnavailableError, load_te

            try:
                load_te()
            except TEUnavailableError as e:
                raise ConfigError(str(e)) from None
        from titanlike.training.eval_tasks import eval_problems
        from titanlike.training.trackers import wandb_problem

        problems = [p for p in (wandb_problem(cfg.metrics), *eval_problems(cfg)) if p]
        if problems:
            raise ConfigError.of(problems)
        if cfg.float8.recipe and float8_backend(cfg) == "torchao":
            from titanlike.kernels.float8 import Float8UnavailableError, check_float8_runtime

            try:
                check_float8_runtime(cfg.float8.recipe, cfg.float8.emulate, self.device)
            except Float8UnavailableError as e:
                raise ConfigError(str(e)) from None

    def _init_process_group(self) -> None:
        """The default process group (nccl on CUDA, and gloo for CPU tensors under training.enable_cpu_offload; gloo
        otherwise) with the flight recorder on; a single process
        starts none.

        ``comm.init_timeout_seconds`` bounds the start: the rendezvous and the creation of every group (ranks may
        reach it seconds or minutes apart) and the collectives of the build; once built, every collective on every
        group is bounded by ``comm.timeout_seconds`` (``fault.bound_process_groups``)."""
        if not self.distributed:
            return
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        hang.enable_flight_recorder()  # torch's record of every collective, for a hang report
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl" and self.cfg.training.enable_cpu_offload:
            # FSDP's CPU offload keeps the gradients on the host: the gradient-norm all-reduce of their DTensors runs
            # on CPU tensors, which NCCL does not take (torchtitan does the same)
            backend = "cuda:nccl,cpu:gloo"
        fault.init_process_group(backend, datetime.timedelta(seconds=self.cfg.comm.init_timeout_seconds))
        # the exit-signal agreement of every step, on host tensors: a gloo group beside nccl (none needed on gloo)
        self.host_group = dist.new_group(backend="gloo") if backend == "nccl" else None

    def _check_fault_tolerance(self) -> None:
        """[fault_tolerance]: every problem of the section in one line, torchft installed, the lighthouse reachable
        (titanlike/training/fault_tolerance.py)."""
        from titanlike.training import fault_tolerance

        problems = fault_tolerance.config_problems(self.cfg)
        if problems:
            raise ConfigError("; ".join(problems))
        if self.cfg.fault_tolerance.enable:
            fault_tolerance.check_runtime(self.cfg)

    def _replica_groups(self):
        """This group's torchft manager (fault_tolerance.enable), else None."""
        if not self.cfg.fault_tolerance.enable:
            return None
        from titanlike.training.fault_tolerance import ReplicaGroups

        return ReplicaGroups(
            self.cfg,
            model_parts=self.model_parts,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            train_state=self.train_state,
            dataloader=self.dataloader,
            global_batch=self.global_batch,
            rank=self.rank,
        )

    def _build_sentinel(self):
        """training.sdc_check_interval: the silent-corruption sentinel (titanlike/training/sentinel.py), else None."""
        if not self.cfg.training.sdc_check_interval:
            return None
        from titanlike.training.sentinel import Sentinel

        return Sentinel(
            self.cfg.training.sdc_check_interval,
            model_parts=self.model_parts,
            optimizer=self.optimizer,
            pp=self.pp,
            replicas=self.replicas,
            rank=self.rank,
            device=self.device,
        )

    def _sdc_check(self, logger, saving: bool) -> None:
        """The sentinel's check of this step (every sdc_check_interval steps and before a save): its cost logged; a
        mismatch stops the run here, before the step is saved."""
        from titanlike.training.sentinel import CorruptionError

        if not self.sentinel.due(self.step, saving):
            return
        try:
            with self._op(f"the silent-corruption check of step {self.step}"), hang.phase("sdc check"):
                cost = self.sentinel.check(self.step)
        except CorruptionError as e:
            from titanlike.checkpoint import checkpoint_folder, committed_checkpoints

            kept = list(committed_checkpoints(checkpoint_folder(self.cfg))) if self.cfg.checkpoint.enable else []
            raise CorruptionError(
                f"{e}; the run stops before saving step {self.step}"
                + (f" (the newest checkpoint, step {kept[-1]}, is kept: resume from it" if kept else " (no checkpoint")
                + " once the machine of the rank named is replaced or checked)"
            ) from None
        logger.log(
            self.step,
            {"sdc_check_seconds": cost.seconds, "sdc_check_bytes": cost.bytes, "sdc_check_tensors": cost.tensors},
            console=None
            if self.sentinel.checks > 1
            else f"sdc: step {self.step}: {cost.tensors} tensors identical across {'; '.join(cost.groups)} "
            f"({cost.seconds * 1e3:.1f} ms, {cost.bytes} bytes sent by this rank)",
        )

    def _lock_run_folders(self):
        """Rank 0 locks job.dump_folder (and checkpoint.folder when it writes checkpoints) before anything is
        written: a second job into them is refused in one line (titanlike/training/run_lock.py)."""
        if int(os.environ.get("RANK", "0")) != 0:
            return None
        from titanlike.checkpoint import checkpoint_folder
        from titanlike.training.run_lock import RunLock

        c = self.cfg.checkpoint
        folders = [Path(self.cfg.job.dump_folder)]
        if c.enable or c.create_seed_checkpoint:
            folders.append(checkpoint_folder(self.cfg))
        lock = RunLock(folders, self.cfg.job.stale_lock_seconds).acquire()
        weakref.finalize(self, lock.release)  # a Trainer dropped without close() lets go of its folders too
        return lock

    def release_lock(self) -> None:
        if getattr(self, "run_lock", None) is not None:
            self.run_lock.release()

    # ------------------------------------------------------------------ build
    def _build(self) -> None:
        cfg = self.cfg
        if self.rank == 0:
            self._print_start()
        dp_rank, dp_degree = self._build_mesh()
        # The model is built on the meta device and parallelized there; then each rank allocates only its own shards
        # and fills them with the sharded init (each element a pure function of (seed, FQN, index): the same initial
        # weights under every layout, titanlike.init), or leaves them for the checkpoint load when the weights come
        # from one (a resume, or a seed checkpoint / Hugging Face file as checkpoint.initial_load_path). No rank
        # ever holds more than its shards plus one tile: any model size starts from nothing.
        self.meta_init = self._weights_come_from_a_checkpoint()
        init_seed = None if self.meta_init else cfg.training.seed
        model = self._build_meta_model()
        # One builder for the trainer, the numerics gate and the benchmark (titanlike.parallel.build).
        t0 = time.perf_counter()
        built = build_parallel_model(model, cfg, self.dims, self.device, init_seed=init_seed)
        self._report_init(time.perf_counter() - t0, init_seed)
        self.pp, self.model_parts, self.loss = built.pp, built.model_parts, built.loss
        self.pp_schedule, self.pp_group, self.has_last_stage = built.pp_schedule, built.pp_group, built.has_last_stage
        self.clip_fn, self.forward_context = built.clip_fn, built.forward_context
        self.moe = built.moe  # a model with MoE blocks: the aux-loss denominator and the expert-bias update
        self.reduction = built.reduction  # training.layout_invariant: the step's sums in the canonical tree

        self.optimizer = build_optimizer(self.model_parts, cfg)
        # torchao float8 all-gather: every weight's float8 scale in one all-reduce after each optimizer step.
        self.float8_precompute = cfg.float8.precompute_float8_dynamic_scale_for_fsdp and any(
            getattr(m, "_float8_fsdp_all_gather", False) for m in self.model_parts
        )
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg)
        self._build_data(dp_rank, dp_degree)
        if self.rank == 0:
            self._print_model()
        self.train_state = TrainState()
        self.checkpointer = self._build_checkpointer()
        if self.checkpointer is not None:
            self._check_global_batch_of_the_resume()

    def _build_mesh(self) -> tuple[int, int]:
        """The parallel dims and meshes (none on one process), the loss group, this rank's cp coordinates; returns
        this rank's data-parallel (rank, degree)."""
        cfg = self.cfg
        self.dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)  # one process: no mesh
        dp_rank, dp_degree = 0, 1
        self.cp_rank, self.cp_degree = 0, 1
        # dp_group: the loss group (token count, reported and validation loss): dp x cp, every rank that holds a
        # different part of the global batch.
        self.dp_group = None
        if not self.distributed:
            return dp_rank, dp_degree
        self.dims = ParallelDims.from_config(cfg, self.world_size)
        self.dims.build_mesh(self.device.type)
        if self.rank == 0:
            gpn = cfg.parallelism.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
            print(describe_layout(self.dims, gpn), flush=True)
        from titanlike.parallel import loss_group

        self.dp_group = loss_group(self.dims)
        if self.dims.dp_enabled:
            dp_mesh = self.dims.get_mesh("dp")
            dp_rank, dp_degree = dp_mesh.get_local_rank(), dp_mesh.size()
        if self.dims.cp_enabled:  # cp ranks read the same samples, each its two chunks of every sequence
            cp_mesh = self.dims.get_mesh("cp")
            self.cp_rank, self.cp_degree = cp_mesh.get_local_rank(), cp_mesh.size()
        return dp_rank, dp_degree

    def _build_meta_model(self) -> torch.nn.Module:
        """The single-device model on the meta device, in the master dtype, with its kernels swapped in."""
        cfg = self.cfg
        param_dtype = DTYPES[master_dtype(cfg.training.dtype)]  # bf16 = mixed precision over float32
        torch.manual_seed(cfg.training.seed)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(param_dtype)
        try:
            with torch.device("meta"):
                model = self.spec.build(self.model_args)
        finally:
            torch.set_default_dtype(prev)
        model.reset_position_ids = cfg.model.reset_position_ids  # read by the decoder's forward (every stage)
        # Document masking: the loaders derive each token's document start from the tokenizer's EOS.
        self.mask_eos_id = self.tokenizer.eos_id if cfg.model.attn_mask_type == "block_causal" else None
        if cfg.model.kernels != "torch":
            from titanlike.kernels import convert_kernels

            model = convert_kernels(model, cfg.model.kernels, cfg.float8.recipe if float8_backend(cfg) == "te" else "")
        self.num_params = sum(p.numel() for p in model.parameters())
        return model

    def _build_data(self, dp_rank: int, dp_degree: int) -> None:
        """The training loader and the validation streams. The global sample order depends only on the seed (and,
        for a mixture, the weights); this rank reads its data-parallel slice."""
        from titanlike.data import build_dataloader

        cfg, t = self.cfg, self.cfg.training
        split = batch_split(t.global_batch_size, t.local_batch_size, dp_degree, virtual_dp_degree(t))
        self.global_batch, self.accum_steps = split.global_batch, split.accum_steps
        self.dataloader = build_dataloader(
            self.corpus.windows(t.seed, cfg.data.shuffle),
            seq_len=t.seq_len,
            global_batch_size=self.global_batch,
            local_batch_size=t.local_batch_size,
            dp_rank=dp_rank,
            dp_degree=dp_degree,
            seed=t.seed,
            shuffle=cfg.data.shuffle,
            num_workers=cfg.data.num_workers,
            cp_rank=self.cp_rank,
            cp_degree=self.cp_degree,
            eos_id=self.mask_eos_id,
        )
        self.val_sources = self._validation_sources(dp_degree)
        self.dp_rank, self.dp_degree = dp_rank, dp_degree

    def _print_model(self) -> None:
        """Rank 0: the model, the data, the batch and the devices; the attention, float8 and optimizer notes."""
        cfg, args, corpus, t = self.cfg, self.model_args, self.corpus, self.cfg.training
        n_train = sum(len(s.train) for s in corpus.sources)
        n_val = sum(len(v) for _, v in corpus.validation)
        print(f"data: {self._data_source()}", flush=True)
        if corpus.is_mixture:
            print(f"data: mixture of {len(corpus.sources)} sources: {corpus.describe()}", flush=True)
        active = getattr(args, "num_active_params", None)  # a model with experts: what one token uses
        active_note = f" ({active() / 1e6:.2f}M active per token)" if active is not None else ""
        flavor = f"/{cfg.model.flavor}" if self.spec.flavors and self.architecture_from is None else ""
        print(
            f"model {cfg.model.name}{flavor}: "
            f"{self.num_params / 1e6:.2f}M parameters{active_note}, "
            f"vocab {args.vocab_size}; data: {n_train:,} train / {n_val:,} val tokens "
            f"(loaded in {self.data_seconds:.1f}s); global batch {self.global_batch} x {t.seq_len} "
            f"tokens ({t.local_batch_size} per data-parallel rank and pass, {self.dp_degree} data-parallel), "
            f"{self.accum_steps} accumulation step(s); {self.world_size} process(es) on "
            f"{self.device.type}, {cfg.training.dtype}",
            flush=True,
        )
        if self.pp is not None:
            split = describe_split(stage_module_names(cfg, args), spec=self.spec)  # the stages as split
            print(f"pipeline: {self._pipeline_note()}; {split}", flush=True)
        print(f"attention: {attention_note(cfg, self.device, self.tokenizer.eos_id, self.model_parts)}", flush=True)
        f8 = float8_note(self.model_parts, cfg.float8.emulate)
        if f8:
            print(f"float8: {f8}", flush=True)
        if self.reduction is not None:  # training.layout_invariant: the decomposition to keep across layouts
            r = self.reduction
            print(
                f"layout invariant: {r.virtual} virtual ranks x {r.m} canonical microbatch(es) of {r.canonical_size} "
                f"sequence(s), {r.virtual // max(self.dp_degree, 1)} virtual rank(s) per data-parallel rank; "
                f"deterministic algorithms, {torch.get_num_threads()} thread(s) per rank",
                flush=True,
            )
        if hasattr(self.optimizer, "describe"):  # Muon: what it orthogonalizes (rank 0's parameters)
            print(f"optimizer: {self.optimizer.describe()}", flush=True)

    def _pipeline_note(self) -> str:
        """The schedule, the stages and the microbatches of a pipeline-parallel run (rank 0's view)."""
        p, pp = self.cfg.parallelism, self.pp
        m = self.cfg.training.local_batch_size // p.pipeline_parallel_microbatch_size
        per_rank = len(pp.stage_ids)
        return (
            f"{pp.schedule_name}, {pp.num_stages} stages over pp {self.dims.pp} ranks ({per_rank} per rank; rank 0 "
            f"holds stage{'s' if per_rank > 1 else ''} {', '.join(map(str, pp.stage_ids))}), {m} microbatch"
            f"{'es' if m != 1 else ''} of {p.pipeline_parallel_microbatch_size} sequence"
            f"{'s' if p.pipeline_parallel_microbatch_size != 1 else ''} per pass"
        )

    def _data_source(self) -> str:
        """What the run reads: the shipped corpus, or each data.path entry's files used and skipped (and why)."""
        from titanlike.data.corpus import entries
        from titanlike.data.formats import describe_entries

        d = self.cfg.data
        if not entries(d.path):
            return "the shipped corpus (tinyshakespeare.txt and 13 books of Project Gutenberg, titanlike/assets/corpus)"
        text = describe_entries(entries(d.path))
        if entries(self.cfg.validation.path):
            text += f"; validation.path {describe_entries(entries(self.cfg.validation.path))}"
        return text

    def _build_checkpointer(self):
        """The checkpoint manager, when anything loads, saves or exports weights (None otherwise)."""
        c = self.cfg.checkpoint
        if not (
            c.enable or c.initial_load_path or c.create_seed_checkpoint or c.export_safetensors or c.load_step >= 0
        ):
            return None
        from titanlike.checkpoint import CheckpointManager

        return CheckpointManager(
            self.cfg,
            model_parts=self.model_parts,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.dataloader,
            train_state=self.train_state,
            model_args=self.model_args,
            tokenizer=self.tokenizer,
            device=self.device,
            rank=self.rank,
            world_size=self.world_size,
            dp_degree=self.dp_degree,
        )

    def _check_global_batch_of_the_resume(self) -> None:
        """Every checkpoint records its global batch; a resume with another one is refused (the run would change
        silently: another layout with training.global_batch_size -1, another batch on the command line) unless
        checkpoint.accept_global_batch_change, which rank 0 announces."""
        from titanlike.checkpoint import read_meta

        self.checkpointer.meta_extra["global_batch_size"] = self.global_batch
        plan = self.checkpointer.plan
        if plan is None or plan.action != "resume":
            return
        saved = read_meta(plan.path).get("global_batch_size")
        if saved is None or saved == self.global_batch:
            return
        if not self.cfg.checkpoint.accept_global_batch_change:
            raise ConfigError(
                f"checkpoint '{plan.path}' was trained with a global batch of {saved} sequences per step, this run's "
                f"is {self.global_batch} (training.global_batch_size {self.cfg.training.global_batch_size}, local "
                f"{self.cfg.training.local_batch_size} x {self.dp_degree} data-parallel); resume with "
                f"--training.global_batch_size {saved}, or set checkpoint.accept_global_batch_change to change it"
            )
        if self.rank == 0:
            print(
                f"checkpoint: the global batch changes from {saved} to {self.global_batch} sequences per step at "
                f"step {plan.step} (checkpoint.accept_global_batch_change)",
                flush=True,
            )

    def _report_init(self, seconds: float, init_seed: int | None) -> None:
        """Rank 0: how the weights started, the build's time and the largest peak host memory (RSS) of any rank."""
        peak = torch.tensor([float(peak_host_bytes())], dtype=torch.float64, device=self.device)
        if self.distributed:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if self.rank == 0:
            how = (
                f"sharded init from seed {init_seed}"
                if init_seed is not None
                else "shards allocated for the checkpoint load"
            )
            full = self.num_params * DTYPES[master_dtype(self.cfg.training.dtype)].itemsize
            print(
                f"init: {how} in {seconds:.1f}s; peak host memory of a rank {_gib(peak.item())} (the whole "
                f"model is {_gib(full)})",
                flush=True,
            )

    def _load_data(self) -> None:
        """Check every data file of every source (all of them, each rank on its own: no process group yet), then
        tokenize text and index .bin shards (titanlike.data.build_corpus); every problem is one ConfigError line."""
        from titanlike.data import build_corpus
        from titanlike.data.check import check_encoding

        d, t = self.cfg.data, self.cfg.training
        why = check_encoding(d.encoding, d.encoding_errors)
        if why:
            raise ConfigError(why)
        t0 = time.perf_counter()
        try:
            self.corpus = build_corpus(
                d.path,
                self.tokenizer,
                seq_len=t.seq_len,
                weights=d.weights,
                validation_path=self.cfg.validation.path,
                val_fraction=d.val_fraction,
                text_field=d.text_field,
                encoding=d.encoding,
                errors=d.encoding_errors,
                default=default_corpus(),
            )
        except ValueError as e:
            from titanlike.data.corpus import entries
            from titanlike.data.formats import describe_entries, skipped_files

            skipped = any(skipped_files(p) for p in entries(d.path))
            raise ConfigError(
                str(e) + (f" (data.path {describe_entries(entries(d.path))})" if skipped else "")
            ) from None
        self.data_seconds = time.perf_counter() - t0

    def _validation_sources(self, dp_degree: int) -> list:
        """The validation streams with at least one batch on every data-parallel rank; rank 0 says why any other
        is skipped."""
        cfg, t = self.cfg, self.cfg.training
        if not cfg.validation.enable:
            return []
        need, usable = t.local_batch_size * dp_degree, []
        streams = self.corpus.validation or [("", self.corpus.sources[0].train[:0])]
        for name, tokens in streams:
            windows = max(len(tokens) - 1, 0) // t.seq_len
            if windows >= need:
                usable.append((name, tokens))
            elif self.rank == 0:
                what = (
                    f"validation.path{f' ({name})' if name else ''}"
                    if cfg.validation.path
                    else f"the held-out tail{f' of {name}' if name else ''} (data.val_fraction {cfg.data.val_fraction})"
                )
                fix = "give more held-out data" if cfg.validation.path else "raise data.val_fraction"
                print(
                    f"validation: skipped, {what} has {len(tokens):,} tokens = {windows} windows of {t.seq_len + 1}, "
                    f"fewer than one batch of {t.local_batch_size} on each of {dp_degree} data-parallel ranks; "
                    f"{fix}, lower training.local_batch_size, or set validation.enable = false",
                    flush=True,
                )
        return usable

    def _print_start(self) -> None:
        """Rank 0: the job's description, the notes on torchtitan keys read, the full config if asked, the
        architecture taken from a Hugging Face config.json."""
        cfg = self.cfg
        print(f"job: {cfg.job.description}" + (f" ({cfg.job.config_file})" if cfg.job.config_file else ""), flush=True)
        for note in getattr(cfg, "notes", []):
            print(f"config: {note}", flush=True)
        if cfg.job.print_config:
            from titanlike.config import format_config

            print(format_config(cfg), flush=True)
        if self.architecture_note:
            print(self.architecture_note, flush=True)

    def _check_host_memory(self) -> None:
        """On a CPU device: refuse up front when the state of this node's ranks (the planner's per-rank number:
        parameter shards, gradients, AdamW states, FSDP's gathered groups) does not fit the host. The full model is
        never held, so the model's size alone refuses nothing (titanlike/planner/host.py)."""
        from titanlike.planner import host

        problem = host.host_memory_problem(
            self.cfg,
            self.world_size,
            self.model_args,
            local_ranks=host.local_world_size(self.world_size),
            host_bytes=host.host_memory_bytes(),
            device_type=self.device.type,
        )
        if problem:
            raise ConfigError(problem)

    def _weights_come_from_a_checkpoint(self) -> bool:
        c = self.cfg.checkpoint
        if c.create_seed_checkpoint:
            return False
        if c.initial_load_path:
            return True
        if not c.enable:
            return False
        from titanlike.checkpoint import checkpoint_folder, committed_checkpoints

        return bool(committed_checkpoints(checkpoint_folder(self.cfg)))

    # ------------------------------------------------------------------ loop
    def _next_micro_batches(self, it) -> list[tuple[torch.Tensor, ...]]:
        """(inputs, labels) or, with document masking, (inputs, labels, document_starts) per micro-batch."""
        return [
            tuple(t.to(self.device, non_blocking=True) for t in batch)
            for batch in (next(it) for _ in range(self.accum_steps))
        ]

    def train(self) -> list[float]:
        """Train to ``training.steps``; return the losses of this run's steps. On an exit signal
        (``checkpoint.exit_signals``) the step is saved and :class:`Preempted` raised (``main`` exits with 75)."""
        try:
            return self._train()
        finally:
            self.release_lock()  # the run writes nothing after this

    def _train(self) -> list[float]:
        cfg = self.cfg
        if self.checkpointer is not None:
            if self.checkpointer.maybe_create_seed_checkpoint():
                return []
            self.checkpointer.load()
        if self.replicas is not None:
            self.replicas.load_checkpointed_position()
        logger = self._metrics_logger()
        from titanlike.data import loader_position
        from titanlike.training.profiling import maybe_profile

        rate = self._step_rate()
        imbalance = ImbalanceWatch(cfg.metrics.moe_imbalance_warn, cfg.metrics.moe_imbalance_steps)
        if self.step >= cfg.training.steps and self.rank == 0:
            print(
                f"nothing to do: the run is at step {self.step} and training.steps is {cfg.training.steps}; raise "
                f"training.steps to train further",
                flush=True,
            )
        start_step, t_start, tokens_start = self.step, time.perf_counter(), self.tokens_seen
        epochs = self.corpus.epochs(loader_position(self.dataloader))
        data_iter = iter(self.dataloader)
        losses: list[float] = []
        pending: list[tuple[int, StepResult]] = []  # (step, result): numbers still on the device
        exit_signals = self._install_exit_signals()
        with (
            exit_signals,
            contextlib.closing(logger),
            maybe_profile(cfg, self.rank, cfg.job.dump_folder, global_step=self.step) as profiler,
        ):
            while self.step < cfg.training.steps:
                if self.replicas is not None:  # the quorum (a group behind heals to the others' step), the data
                    data_iter = self.replicas.begin_step(self.step)
                    if self.step >= cfg.training.steps:
                        break
                self.step += 1
                pending.append((self.step, self._run_step(data_iter)))
                res, signum = pending[-1][1], self._agree_on_exit_signal(exit_signals)
                if signum or self._settle_due():  # the steps' numbers read on the host here only (log, save steps)
                    self._settle(pending, losses, rate, imbalance)
                    pending = []
                if not res.committed:  # a replica group failed in the step: redone with the groups that are left
                    self.step -= 1
                    if signum:
                        self._stop_on_exit_signal(signum, exit_signals, losses)
                    continue
                position = loader_position(self.dataloader)
                epochs = self._log_epochs(epochs, position)
                if self._log_due():
                    self._log_step(logger, res, rate, position)
                self._maybe_validate(logger)
                self._maybe_evaluate(logger)
                if self.sentinel is not None:  # before a save: a corrupt state is never written
                    last = self.step == cfg.training.steps
                    self._sdc_check(
                        logger, bool(signum) or bool(self.checkpointer and self.checkpointer.save_due(self.step, last))
                    )
                if self.checkpointer is not None:
                    with hang.phase("checkpoint"):
                        self.checkpointer.maybe_save(self.step, last=self.step == cfg.training.steps)
                profiler.step()
                if signum:
                    self._stop_on_exit_signal(signum, exit_signals, losses)
        if self.checkpointer is not None:
            self.checkpointer.finish()
        if self.rank == 0 and self.step > start_step:
            print(self._summary(start_step, time.perf_counter() - t_start, self.tokens_seen - tokens_start, losses))
        return losses

    def _metrics_logger(self) -> MetricsLogger:
        """Rank 0's console / TensorBoard / JSONL / tracker logger, from this run's step on; silent elsewhere."""
        m = self.cfg.metrics
        return MetricsLogger(
            self.cfg.job.dump_folder,
            enabled=self.rank == 0,
            tensorboard=m.enable_tensorboard,
            start_step=self.step,
            tb_folder=m.save_tb_folder,
            jsonl=m.enable_jsonl,
            color=use_color(m.disable_color_printing),
            trackers=self._trackers(),
        )

    def _maybe_validate(self, logger: MetricsLogger) -> None:
        """The validation losses every ``validation.freq`` steps and at the last step, logged and kept."""
        cfg = self.cfg
        if not self.val_sources or (self.step % cfg.validation.freq and self.step != cfg.training.steps):
            return
        with self._op(f"the validation at step {self.step}"), hang.phase("validation"):
            vals = self.validate()
        self.last_validation = vals
        console = f"step {self.step:5d}  " + "  ".join(f"{k} {v:8.4f}" for k, v in vals.items())
        logger.log(self.step, vals, console=console)

    def _summary(self, start_step: int, seconds: float, tokens: int, losses: list[float]) -> str:
        """Rank 0's last line: the steps of this run, their time and throughput, the loss, where the weights are."""
        n = self.step - start_step
        line = (
            f"done: steps {start_step + 1}-{self.step} ({n}) in {format_eta(seconds)}, {seconds / n:.3f}s per step, "
            f"{tokens / seconds:,.0f} tok/s ({tokens / seconds / self.world_size:,.0f}/device); loss "
            f"{losses[0]:.4f} -> {losses[-1]:.4f}"
        )
        vals = getattr(self, "last_validation", None)
        if vals:
            line += f", val_loss {vals['val_loss']:.4f}"
        if self.checkpointer is not None and self.cfg.checkpoint.enable and self.checkpointer.last_step is not None:
            line += f"; checkpoint {self.checkpointer.folder / f'step-{self.checkpointer.last_step}'}"
        return line

    def _maybe_evaluate(self, logger) -> None:
        """The [eval] tasks at every eval.freq-th step and the last, on the training layout; rank 0 logs them."""
        cfg = self.cfg
        if not cfg.eval.enable or (self.step % cfg.eval.freq and self.step != cfg.training.steps):
            return
        from titanlike.training.eval_tasks import run_eval

        t0 = time.perf_counter()
        with self._op(f"the evaluation at step {self.step}"):
            scores = run_eval(cfg, self.model_parts[0], self.tokenizer, self.forward_context, cfg.training.seed)
        shown = "  ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in scores.items())
        logger.log(self.step, scores, console=f"step {self.step:5d}  eval  {shown}  ({time.perf_counter() - t0:.1f}s)")

    def _trackers(self) -> tuple:
        """Rank 0's trackers (metrics.enable_wandb): the run id comes from the checkpoint resumed, else is new, and
        goes into every checkpoint this run saves."""
        if self.rank != 0 or not self.cfg.metrics.enable_wandb:
            return ()
        from titanlike.checkpoint import read_meta
        from titanlike.training.trackers import RUN_ID_KEY, WandbTracker, new_run_id

        plan = self.checkpointer.plan if self.checkpointer is not None else None
        resumed = read_meta(plan.path).get(RUN_ID_KEY) if plan is not None and plan.action == "resume" else None
        run_id = resumed or new_run_id()
        if self.checkpointer is not None:
            self.checkpointer.meta_extra[RUN_ID_KEY] = run_id
        return (WandbTracker(self.cfg, run_id, resumed=resumed is not None),)

    def _step_rate(self) -> _StepRate:
        """What the logged throughput and MFU of a step are measured against."""
        from titanlike.training.mfu import device_peak_flops, peak_key

        cfg = self.cfg
        key = "tf32" if cfg.training.dtype == "float64" else peak_key(cfg.training.dtype, cfg.float8.recipe)
        return _StepRate(
            peak=device_peak_flops(self.device, key, cfg.metrics.peak_tflops),
            flops_per_token=self.spec.flops_per_token(self.model_args, cfg.training.seq_len),
            throughput=Throughput(self.device),
            last_logged=self.step,
        )

    def _run_step(self, data_iter) -> StepResult:
        """One optimizer step on every rank and its float8 scales (nothing read on the host: see ``_settle``)."""
        cfg = self.cfg
        hang.WHERE.step = self.step
        with self._op(f"training step {self.step}"):
            with hang.phase("data", after="forward"):
                micro_batches = self._next_micro_batches(data_iter)
            res = train_step(
                self.model_parts,
                self.optimizer,
                micro_batches,
                self.loss,
                max_norm=cfg.training.max_norm,
                clip_fn=self.clip_fn,
                lr_scheduler=self.lr_scheduler,
                dp_group=self.dp_group,
                pp_schedule=self.pp_schedule,
                pp_group=self.pp_group,
                has_last_stage=self.has_last_stage,
                forward_ctx=self.forward_context,
                moe=self.moe,
                replicas=self.replicas,
                reduction=self.reduction,
            )
            hang.set_where("end of step", "")
            if self.float8_precompute:
                from titanlike.kernels.float8 import precompute_float8_scales

                for m in self.model_parts:
                    precompute_float8_scales(m)
        return res

    def _log_due(self) -> bool:
        """Every metrics.log_freq steps, the first and the last."""
        step = self.step
        return step % self.cfg.metrics.log_freq == 0 or step == self.cfg.training.steps or step == 1

    def _settle_due(self) -> bool:
        """Whether this step reads the numbers of the steps since the last one that did: a log step, the last step,
        a step about to be saved or checked by the sentinel, every step of replica groups (they read anyway)."""
        cfg, step = self.cfg, self.step
        last = step == cfg.training.steps
        return (
            self._log_due()
            or self.replicas is not None
            or bool(self.checkpointer and self.checkpointer.save_due(step, last))
            or bool(self.sentinel and self.sentinel.due(step, False))
        )

    def _agree_on_exit_signal(self, exit_signals) -> int:
        """The number of an exit signal some rank received (0: none), agreed by every rank at the end of every step
        (then every rank stops after the same step): one all-reduce (MAX) of one host tensor, on gloo (a group of
        its own beside nccl), so that it waits for no device work."""
        if not self.distributed:
            return exit_signals.received
        from titanlike.training.host_reads import on_the_host

        flag = on_the_host(torch.tensor(exit_signals.received))
        with self._op(f"the end of step {self.step}"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=getattr(self, "host_group", None))
        return int(flag.item())

    def _settle(self, pending, losses: list[float], rate, imbalance) -> None:
        """The steps since the last settled one, on the host: their numbers in one read, the non-finite-parameter
        check (``_end_of_step``), then the token count, the losses, the MoE imbalance watch and the skipped steps,
        in step order."""
        StepResult.read_together([r for _, r in pending])
        with self._op(f"the end of step {self.step}"):
            self._end_of_step(pending)
        for step, res in pending:
            if not res.committed:
                continue
            rate.throughput.add(res.tokens)
            self.tokens_seen += res.tokens
            losses.append(res.loss)
            warning = imbalance.update(res.moe, step) if res.moe is not None else None
            if warning and self.rank == 0:
                print(warning, flush=True)
            if res.skipped:
                self._count_skipped_step(res, step)

    def _count_skipped_step(self, res, step: int) -> None:
        """A non-finite loss or gradient norm skipped the update: say so, and stop past training.max_nonfinite_steps."""
        self.nonfinite_steps += 1
        limit = self.cfg.training.max_nonfinite_steps
        if self.rank == 0:
            print(
                f"step {step}: non-finite loss {res.loss} or grad norm {res.grad_norm}: update "
                f"skipped ({self.nonfinite_steps} of at most {limit})",
                flush=True,
            )
        if self.nonfinite_steps >= limit:
            raise NonFiniteError(
                f"stopping at step {step}: {self.nonfinite_steps} non-finite steps "
                f"skipped, training.max_nonfinite_steps={limit}"
            )

    def _log_step(self, logger: MetricsLogger, res, rate: _StepRate, position: int) -> None:
        """The step's line and metrics: loss, lr, grad norm, throughput, MFU, memory, data and MoE metrics."""
        from titanlike.training.mfu import mfu

        cfg = self.cfg
        steps = self.step - rate.last_logged
        elapsed = time.perf_counter() - rate.throughput.last
        tps, eta = rate.throughput.measure(steps, cfg.training.steps - self.step)
        step_time = elapsed / max(steps, 1)
        rate.last_logged = self.step
        tps_dev = tps / self.world_size
        util = mfu(tps_dev, rate.flops_per_token, rate.peak) if rate.peak else None
        lr = res.lr  # the rate of this step's update, not the scheduler's next one
        mem = peak_memory_gib(self.device)
        line = (
            f"step {self.step:5d}  loss {res.loss:8.4f}  lr {lr:.3e}  grad_norm {res.grad_norm:7.3f}"
            f"  tok/s {tps:9.0f} ({tps_dev:.0f}/device)  step {step_time:6.3f}s"
            + (f"  mfu {100 * util:5.1f}%" if util is not None else "")
            + f"  mem {mem:6.2f}GiB  eta {format_eta(eta)}"
        )
        seen = self.corpus.seen(position)
        if self.corpus.is_mixture:
            line += "\n" + format_data(seen)
        moe_metrics = expert_metrics(res.moe) if res.moe is not None else {}
        if moe_metrics:
            line += (
                f"  aux {moe_metrics['moe_aux_loss']:.3e}  load max/mean {moe_metrics['moe_load_max_over_mean']:.2f}"
            )
            if self.rank == 0:  # the layers x experts picture (every rank holds the global loads)
                write_expert_load_picture(cfg.job.dump_folder, res.moe["loads"], self.step)
        # each MTP depth's loss beside the next-token loss (the logged loss)
        mtp_metrics = {f"mtp_loss_{k}": v for k, v in enumerate(res.mtp or [], 1)}
        if mtp_metrics:
            line += "  mtp " + " ".join(f"{v:.4f}" for v in mtp_metrics.values())
        logger.log(
            self.step,
            {
                "loss": res.loss,
                "lr": lr,
                "grad_norm": res.grad_norm,
                "tokens_per_s": tps,
                "tokens_per_s_per_device": tps_dev,
                "step_time_s": step_time,
                "mfu": util,
                "memory_gib": mem,
                "skipped": res.skipped,
                **data_metrics(seen),
                **moe_metrics,
                **mtp_metrics,
                **(self.replicas.metrics() if self.replicas is not None else {}),
            },
            console=line,
        )

    def _install_exit_signals(self):
        """checkpoint.exit_signals, when there is a checkpoint to save them into (checkpoint.enable)."""
        from titanlike.training.exit_signals import ExitSignals

        names = self.cfg.checkpoint.exit_signals if self.cfg.checkpoint.enable else []
        lock = self.run_lock
        return ExitSignals(names, on_exit=lock.release_now if lock is not None else None)

    def _stop_on_exit_signal(self, signum: int, exit_signals, losses: list[float]) -> None:
        """Every rank has finished this step: save it synchronously (committed on every rank before any leaves) and
        raise Preempted. A further signal during the save exits at once (exit_signals.py)."""
        from titanlike.training.exit_signals import EXIT_PREEMPTED, Preempted, signal_name

        name = signal_name(signum)
        exit_signals.saving = True
        self.checkpointer.quiet_commit = True  # one line: this one
        with self._op(f"the checkpoint save of step {self.step} on {name}"):
            self.checkpointer.save_now(self.step)
        ctrl_c = " (Ctrl-C)" if name == "SIGINT" else ""
        saved = f": {self.checkpointer.saved_note}" if self.checkpointer.saved_note else ""
        raise Preempted(
            f"checkpoint: stopped on {name}{ctrl_c} after saving step {self.step}; exit code {EXIT_PREEMPTED}: the "
            f"same command resumes at step {self.step} (nothing is recomputed){saved}",
            step=self.step,
            signal_name=name,
            losses=losses,
        )

    def _op(self, what: str):
        """A phase whose failed collectives are reported naming the ranks that stopped answering (fault.py)."""
        return fault.job_operation(self, what)

    @torch.no_grad()
    def _end_of_step(self, pending) -> None:
        """Whether an update whose loss and gradient norm were finite left a parameter non-finite (AdamW still can,
        e.g. 0/0 with optimizer.eps = 0 on rows that got no gradient; a skipped step changes nothing, so a
        non-finite parameter is always such an update's), on every rank alike: one fused norm over the local
        tensors (non-finite when an element is) and one all-reduce (MAX), the names gathered only when it trips; a
        non-finite update cannot be undone without a copy of the state, so the run stops before saving it."""
        from torch.distributed.tensor import DTensor

        named = [
            (n, p.to_local() if isinstance(p, DTensor) else p)
            for part in self.model_parts
            for n, p in part.named_parameters()
        ]
        bad = fault.first_non_finite(named)
        flag = torch.tensor(0 if bad is None else 1, device=self.device)
        if self.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        nonfinite = int(flag.item())
        if nonfinite:
            names = [bad]
            if self.distributed:
                names = [None] * self.world_size
                dist.all_gather_object(names, bad)
            rank, name = next((r, n) for r, n in enumerate(names) if n is not None)
            where = f" on rank {rank}" if self.distributed else ""
            updated = [(s, r) for s, r in pending if r.committed and not r.skipped] or pending
            (first, res), last = updated[0], updated[-1][0]
            steps = f"step {first}" if first == last else f"steps {first} to {last} (checked at log steps)"
            raise NonFiniteError(
                f"stopping at step {self.step}: the optimizer update made parameter '{name}' non-finite{where} "
                f"although the loss ({res.loss:.4g}) and the gradient norm ({res.grad_norm:.4g}) were finite "
                f"({steps}); it is not saved (resume from the last checkpoint; check optimizer.eps = "
                f"{self.cfg.optimizer.eps:g} and optimizer.lr)"
            )

    def _log_epochs(self, before: list[int], position: int) -> list[int]:
        """Rank 0 says when a source ran out and started its next epoch (a new order of its windows)."""
        now = self.corpus.epochs(position)
        if self.rank == 0:
            for source, a, b in zip(self.corpus.sources, before, now):
                if b > a:
                    print(
                        f"data: {'source ' + repr(source.name) if self.corpus.is_mixture else 'the corpus'} ran out "
                        f"in step {self.step} (all its {source.n_windows:,} windows read): epoch {b + 1} follows, "
                        f"in a new order",
                        flush=True,
                    )
        return now

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Mean token loss over every validation stream (``val_loss``) and, with several, over each
        (``val_loss.<source>``); identical on every rank."""
        from titanlike.data import build_validation_loader

        cfg = self.cfg
        totals = torch.zeros(len(self.val_sources), 2, dtype=torch.float64, device=self.device)
        for m in self.model_parts:
            m.eval()
        for k, (_, tokens) in enumerate(self.val_sources):
            loader = build_validation_loader(
                tokens,
                seq_len=cfg.training.seq_len,
                batch_size=cfg.training.local_batch_size,
                dp_rank=self.dp_rank,
                dp_degree=self.dp_degree,
                max_batches=cfg.validation.steps if cfg.validation.steps > 0 else None,
                cp_rank=self.cp_rank,
                cp_degree=self.cp_degree,
                eos_id=self.mask_eos_id,
            )
            for batch in loader:  # the same mask as training (document starts with each batch)
                inputs, labels, *starts = (t.to(self.device) for t in batch)
                starts = starts[0] if starts else None
                if self.pp is not None:
                    loss_sum = self.pp.eval_loss(inputs, labels, starts)
                else:  # eval mode, then FSDP's shards handed back (training continues exactly)
                    loss_sum = eval_loss_sum(
                        self.model_parts[0], self.loss.loss_fn, inputs, labels, self.forward_context, starts
                    )
                totals[k, 0] += loss_sum.detach().to(torch.float64)
                totals[k, 1] += (labels != IGNORE_INDEX).sum()
        for m in self.model_parts:
            m.train()
        if self.dp_group is not None:
            dist.all_reduce(totals, group=self.dp_group)
        out = {"val_loss": float(totals[:, 0].sum() / totals[:, 1].sum().clamp(min=1))}
        if len(self.val_sources) > 1:
            for (name, _), (loss, n) in zip(self.val_sources, totals.tolist()):
                out[f"val_loss.{name}"] = loss / max(n, 1)
        return out

    def close(self) -> None:
        self.release_lock()
        if getattr(self, "replicas", None) is not None:
            self.replicas.shutdown()
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _print_error(e: ConfigError) -> None:
    """The one line, from local rank 0 only: every rank finds the same problem (so a torchrun job prints it once per
    node). Under torchrun it also goes into the worker's error file (``TORCHELASTIC_ERROR_FILE``), so that torchrun's
    own failure report names it as the root cause instead of a link to its docs. The other ranks wait a moment
    before exiting: torchrun tears the job down at the first rank that exits non-zero, and a rank that left at once
    could take local rank 0 down before its line was out (seen under load); once local rank 0 has exited, torchrun
    ends them at once."""
    line = f"error: {e}"
    if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0":
        print(line, file=sys.stderr, flush=True)
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file and not os.path.exists(error_file):
            import json

            with contextlib.suppress(OSError):
                # torchelastic's own format (errors/error_handler.py): its report prints py_callstack as the cause
                info = {"py_callstack": line, "timestamp": str(int(time.time()))}
                Path(error_file).write_text(json.dumps({"message": {"message": line, "extraInfo": info}}))
    else:
        time.sleep(_ERROR_GRACE_SECONDS)


_ERROR_GRACE_SECONDS = 5.0


def set_deterministic() -> None:
    """``training.deterministic``: deterministic kernels (an op without one raises instead of running), no cuDNN
    autotuning, cuBLAS's deterministic workspace. (Loader workers are always seeded from ``training.seed``.)"""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:  # --help [SECTION]
        i = max(i for i, a in enumerate(argv) if a in ("--help", "-h"))
        section = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else None
        try:
            print(config_help(section), end="")
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
        return 0
    try:
        from titanlike.training.launch import launch, split_launch_flag

        nproc, argv = split_launch_flag(argv) if "TORCHELASTIC_RUN_ID" not in os.environ else (None, argv)
        if nproc is not None:  # python train.py --nproc_per_node N: torchrun's agent, our checks and exit codes
            return launch(nproc, argv, sys.argv[0])
        cfg = load_config(argv)
        trainer = Trainer(cfg)
    except ConfigError as e:
        _print_error(e)
        if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: nothing to tear down; leave at once, so that
            os._exit(2)  # local rank 0 is not ended by torchrun before it exits 2 itself
        return 2
    except KeyboardInterrupt:  # Ctrl-C before training started
        if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0":
            print("interrupted (Ctrl-C) during the start-up: nothing trained", file=sys.stderr, flush=True)
        if "TORCHELASTIC_RUN_ID" in os.environ:
            os._exit(128 + signal.SIGINT)
        return 128 + signal.SIGINT
    from titanlike.training.exit_signals import EXIT_PREEMPTED, Preempted

    code = 0
    try:
        trainer.train()
    except KeyboardInterrupt:  # Ctrl-C with nothing to save it into (checkpoint.enable off, or [] exit signals)
        if trainer.rank == 0:
            print(
                f"interrupted (Ctrl-C) in step {trainer.step}: nothing saved (saving on Ctrl-C needs "
                f"checkpoint.enable and SIGINT in checkpoint.exit_signals)",
                file=sys.stderr,
                flush=True,
            )
        code = 128 + signal.SIGINT
    except Preempted as e:  # an exit signal: the step is saved, the same command resumes it
        if trainer.rank == 0:
            print(e, flush=True)
        code = EXIT_PREEMPTED
    except ConfigError as e:  # input found bad once training started (e.g. a corrupted checkpoint file)
        _print_error(e)
        return 2
    except fault.ReportedError as e:  # one line says it all (a silent rank, a failed save, non-finite weights)
        print(f"error: {e}", file=sys.stderr, flush=True)
        if trainer.distributed:  # no teardown: a peer may be stopped or gone, and the launcher ends the job
            sys.stdout.flush()
            os._exit(1)
        return 1
    finally:
        distributed = trainer.distributed
        trainer.close()
    if distributed:
        # Avoid a rare SIGABRT at interpreter exit after gloo shutdown (docs/facts.md, "Gloo exit abort"): leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
