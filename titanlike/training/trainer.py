"""The trainer: config -> (process group, meshes) -> model -> parallelize -> data -> train loop.

Runs as one plain process (``python train.py``) or under ``torchrun`` (gloo on CPU, nccl on CUDA, chosen from the
device). Every configuration error is raised before a process group exists.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from titanlike import fault
from titanlike.config import JobConfig, config_help, hf_architecture_of, load_config, model_args_from_config
from titanlike.layout import ConfigError, batch_split, float8_backend, layout_violations, master_dtype
from titanlike.loss import IGNORE_INDEX
from titanlike.models import get_spec
from titanlike.parallel import ParallelDims, build_parallel_model, describe_layout
from titanlike.training.metrics import (
    MetricsLogger,
    Throughput,
    format_eta,
    peak_host_bytes,
    peak_memory_gib,
    use_color,
)
from titanlike.training.optim import build_lr_scheduler, build_optimizer
from titanlike.training.step import eval_loss_sum, train_step

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
        self.architecture_note = None
        if hf_architecture_of(cfg) is not None:
            from titanlike.hf import describe_args

            self.architecture_note = (
                f"model: architecture from {cfg.checkpoint.initial_load_path} config.json "
                f"(overrides flavor {cfg.model.flavor}): {describe_args(self.model_args)}"
            )
        self.spec = get_spec(cfg.model.name)
        problems = layout_violations(cfg, self.world_size, self.model_args)
        if problems:
            raise ConfigError(problems[0])
        if cfg.model.kernels == "te":
            from titanlike.kernels import TEUnavailableError, load_te

            try:
                load_te()
            except TEUnavailableError as e:
                raise ConfigError(str(e)) from None
        if cfg.float8.recipe and float8_backend(cfg) == "torchao":
            from titanlike.kernels.float8 import Float8UnavailableError, check_float8_runtime

            try:
                check_float8_runtime(cfg.float8.recipe, cfg.float8.emulate, self.device)
            except Float8UnavailableError as e:
                raise ConfigError(str(e)) from None
        self._check_host_memory()
        data_path = cfg.data.path or None
        if data_path is not None and not Path(data_path).exists():
            raise ConfigError(
                f"data.path: '{data_path}' does not exist; give a text file, a folder of .txt, "
                f"a .jsonl or a .bin from scripts/preprocess_data.py (or leave it empty for the "
                f"shipped corpus)"
            )
        dump = Path(cfg.job.dump_folder)
        if dump.exists() and not dump.is_dir():
            raise ConfigError(f"job.dump_folder: '{dump}' is a file, not a folder; choose another job.dump_folder")
        self._load_data()

        if cfg.training.deterministic:
            set_deterministic()
        self.distributed = self.world_size > 1
        if self.distributed:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            # init_timeout_seconds bounds the start: the rendezvous and the creation of every group (ranks may reach
            # it seconds or minutes apart) and the collectives of the build; once built, every collective on every
            # group is bounded by timeout_seconds (bound_process_groups below).
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.comm.init_timeout_seconds))
        self.rank = dist.get_rank() if self.distributed else 0
        self._build()
        if self.distributed:
            fault.bound_process_groups(self.timeout)  # the default, mesh, pipeline and checkpoint groups

    # ------------------------------------------------------------------ build
    def _build(self) -> None:
        cfg, args = self.cfg, self.model_args
        param_dtype = DTYPES[master_dtype(cfg.training.dtype)]  # bf16 = mixed precision over float32
        if self.rank == 0:
            self._print_start()
        self.dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)  # one process: no mesh
        dp_rank, dp_degree = 0, 1
        self.cp_rank, self.cp_degree = 0, 1
        # dp_group: the loss group (token count, reported and validation loss): dp x cp, every rank that holds a
        # different part of the global batch.
        self.dp_group = None
        if self.distributed:
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

        # The model is built on the meta device and parallelized there; then each rank allocates only its own shards
        # and fills them with the sharded init (each element a pure function of (seed, FQN, index): the same initial
        # weights under every layout, titanlike.init), or leaves them for the checkpoint load when the weights come
        # from one (a resume, or a seed checkpoint / Hugging Face file as checkpoint.initial_load_path). No rank
        # ever holds more than its shards plus one tile: any model size starts from nothing.
        self.meta_init = self._weights_come_from_a_checkpoint()
        init_seed = None if self.meta_init else cfg.training.seed
        torch.manual_seed(cfg.training.seed)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(param_dtype)
        try:
            with torch.device("meta"):
                model = self.spec.build(args)
        finally:
            torch.set_default_dtype(prev)
        if cfg.model.kernels != "torch":
            from titanlike.kernels import convert_kernels

            model = convert_kernels(model, cfg.model.kernels, cfg.float8.recipe if float8_backend(cfg) == "te" else "")
        self.num_params = sum(p.numel() for p in model.parameters())

        # One builder for the trainer, the numerics gate and the benchmark (titanlike.parallel.build).
        t0 = time.perf_counter()
        built = build_parallel_model(model, cfg, self.dims, self.device, init_seed=init_seed)
        self._report_init(time.perf_counter() - t0, init_seed)
        self.pp, self.model_parts, self.loss = built.pp, built.model_parts, built.loss
        self.pp_schedule, self.pp_group, self.has_last_stage = built.pp_schedule, built.pp_group, built.has_last_stage
        self.clip_fn, self.forward_context = built.clip_fn, built.forward_context

        self.optimizer = build_optimizer(self.model_parts, cfg)
        # torchao float8 all-gather: every weight's float8 scale in one all-reduce after each optimizer step.
        self.float8_precompute = cfg.float8.precompute_float8_dynamic_scale_for_fsdp and any(
            getattr(m, "_float8_fsdp_all_gather", False) for m in self.model_parts
        )
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg)

        # Data: the global sample order depends only on the seed; this rank reads its data-parallel slice.
        from titanlike.data import build_dataloader

        train_tokens, val_tokens = self.train_tokens, self.val_tokens_all
        t = cfg.training
        split = batch_split(t.global_batch_size, t.local_batch_size, dp_degree)
        self.global_batch, self.accum_steps = split.global_batch, split.accum_steps
        self.dataloader = build_dataloader(
            train_tokens,
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
        )
        val_windows = max(len(val_tokens) - 1, 0) // t.seq_len
        self.val_tokens = (
            val_tokens if cfg.validation.enable and val_windows >= t.local_batch_size * dp_degree else None
        )
        if cfg.validation.enable and self.val_tokens is None and self.rank == 0:
            print(
                f"validation: skipped, the held-out tail (data.val_fraction {cfg.data.val_fraction}) has "
                f"{len(val_tokens):,} tokens = {val_windows} windows of {t.seq_len + 1}, fewer than one batch of "
                f"{t.local_batch_size} on each of {dp_degree} data-parallel ranks; raise data.val_fraction, lower "
                f"training.local_batch_size, or set validation.enable = false",
                flush=True,
            )
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        if self.rank == 0:
            print(
                f"model {cfg.model.name}/{cfg.model.flavor}: {self.num_params / 1e6:.2f}M parameters, "
                f"vocab {args.vocab_size}; data: {len(train_tokens):,} train / {len(val_tokens):,} val tokens "
                f"(loaded in {self.data_seconds:.1f}s); global batch {self.global_batch} x {t.seq_len} "
                f"tokens, {self.accum_steps} accumulation step(s); {self.world_size} process(es) on "
                f"{self.device.type}, {cfg.training.dtype}",
                flush=True,
            )
            if hasattr(self.optimizer, "describe"):  # Muon: what it orthogonalizes (rank 0's parameters)
                print(f"optimizer: {self.optimizer.describe()}", flush=True)

        self.train_state = TrainState()
        self.checkpointer = None
        c = cfg.checkpoint
        if c.enable or c.initial_load_path or c.create_seed_checkpoint or c.export_safetensors or c.load_step >= 0:
            from titanlike.checkpoint import CheckpointManager

            self.checkpointer = CheckpointManager(
                cfg,
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
        """Check every data file (all of them, each rank on its own: no process group yet), then tokenize; every
        problem is one ConfigError line naming all the bad files."""
        from titanlike.data import check_length, check_sources, load_token_stream, split_stream
        from titanlike.data.check import check_encoding

        d, t = self.cfg.data, self.cfg.training
        why = check_encoding(d.encoding, d.encoding_errors)
        if why:
            raise ConfigError(why)
        sources = d.path or default_corpus()
        bad = check_sources(sources, self.tokenizer, d.text_field, d.encoding, d.encoding_errors)
        if bad:
            raise ConfigError(f"data.path: {len(bad)} bad input{'s' if len(bad) > 1 else ''}: " + "; ".join(bad))
        t0 = time.perf_counter()
        try:
            tokens = load_token_stream(
                sources, self.tokenizer, text_field=d.text_field, encoding=d.encoding, errors=d.encoding_errors
            )
        except ValueError as e:
            raise ConfigError(f"data.path: {e}") from None
        self.train_tokens, self.val_tokens_all = split_stream(tokens, d.val_fraction)
        why = check_length(len(self.train_tokens), t.seq_len, f"data.path '{d.path}'" if d.path else "the corpus")
        if why:
            raise ConfigError(why)
        self.data_seconds = time.perf_counter() - t0

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
    def _next_micro_batches(self, it) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
            for x, y in (next(it) for _ in range(self.accum_steps))
        ]

    def train(self) -> list[float]:
        cfg = self.cfg
        if self.checkpointer is not None:
            if self.checkpointer.maybe_create_seed_checkpoint():
                return []
            self.checkpointer.load()
        logger = MetricsLogger(
            cfg.job.dump_folder,
            enabled=self.rank == 0,
            tensorboard=cfg.metrics.enable_tensorboard,
            start_step=self.step,
            tb_folder=cfg.metrics.save_tb_folder,
            jsonl=cfg.metrics.enable_jsonl,
            color=use_color(cfg.metrics.disable_color_printing),
        )
        from titanlike.training.mfu import device_peak_flops, mfu, peak_key
        from titanlike.training.profiling import maybe_profile

        key = "tf32" if cfg.training.dtype == "float64" else peak_key(cfg.training.dtype, cfg.float8.recipe)
        peak = device_peak_flops(self.device, key, cfg.metrics.peak_tflops)
        flops_per_token = self.spec.flops_per_token(self.model_args, cfg.training.seq_len)
        throughput = Throughput(self.device)
        data_iter = iter(self.dataloader)
        losses: list[float] = []
        last_logged = self.step
        with maybe_profile(cfg, self.rank, cfg.job.dump_folder, global_step=self.step) as profiler:
            while self.step < cfg.training.steps:
                self.step += 1
                with self._op(f"training step {self.step}"):
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
                    )
                    if not res.skipped:
                        self._check_update_finite(res)
                    if self.float8_precompute:
                        from titanlike.kernels.float8 import precompute_float8_scales

                        for m in self.model_parts:
                            precompute_float8_scales(m)
                throughput.add(res.tokens)
                self.tokens_seen += res.tokens
                losses.append(res.loss)
                if res.skipped:
                    self.nonfinite_steps += 1
                    limit = cfg.training.max_nonfinite_steps
                    if self.rank == 0:
                        print(
                            f"step {self.step}: non-finite loss {res.loss} or grad norm {res.grad_norm}: update "
                            f"skipped ({self.nonfinite_steps} of at most {limit})",
                            flush=True,
                        )
                    if self.nonfinite_steps >= limit:
                        raise NonFiniteError(
                            f"stopping at step {self.step}: {self.nonfinite_steps} non-finite steps "
                            f"skipped, training.max_nonfinite_steps={limit}"
                        )
                if self.step % cfg.metrics.log_freq == 0 or self.step == cfg.training.steps or self.step == 1:
                    tps, eta = throughput.measure(self.step - last_logged, cfg.training.steps - self.step)
                    last_logged = self.step
                    tps_dev = tps / self.world_size
                    util = mfu(tps_dev, flops_per_token, peak) if peak else None
                    lr = self.lr_scheduler.get_last_lr()[0]
                    mem = peak_memory_gib(self.device)
                    line = (
                        f"step {self.step:5d}  loss {res.loss:8.4f}  lr {lr:.3e}  grad_norm {res.grad_norm:7.3f}"
                        f"  tok/s {tps:9.0f}"
                        + (f"  mfu {100 * util:5.1f}%" if util is not None else "")
                        + f"  mem {mem:6.2f}GiB  eta {format_eta(eta)}"
                    )
                    logger.log(
                        self.step,
                        {
                            "loss": res.loss,
                            "lr": lr,
                            "grad_norm": res.grad_norm,
                            "tokens_per_s": tps,
                            "tokens_per_s_per_device": tps_dev,
                            "mfu": util,
                            "memory_gib": mem,
                            "skipped": res.skipped,
                        },
                        console=line,
                    )
                if self.val_tokens is not None and (
                    self.step % cfg.validation.freq == 0 or self.step == cfg.training.steps
                ):
                    with self._op(f"the validation at step {self.step}"):
                        val = self.validate()
                    logger.log(self.step, {"val_loss": val}, console=f"step {self.step:5d}  val_loss {val:8.4f}")
                if self.checkpointer is not None:
                    self.checkpointer.maybe_save(self.step, last=self.step == cfg.training.steps)
                profiler.step()
        if self.checkpointer is not None:
            self.checkpointer.finish()
        logger.close()
        return losses

    def _op(self, what: str):
        """A phase whose failed collectives are reported naming the ranks that stopped answering (fault.py)."""
        return fault.operation(
            what,
            rank=self.rank,
            world_size=self.world_size,
            timeout_s=self.timeout.total_seconds(),
            enabled=self.distributed,
        )

    @torch.no_grad()
    def _check_update_finite(self, res) -> None:
        """After an update whose loss and gradient norm were finite, check the parameters are still finite, on every
        rank at this step (AdamW can still make them non-finite, e.g. 0/0 with optimizer.eps = 0 on rows that got
        no gradient). Cheap: one L1 norm per local tensor (a non-finite element makes it non-finite) and one
        all-reduce of a flag; only when it trips are the tensors checked element-wise to name the first one.
        A non-finite update cannot be undone without a copy of the state, so the run stops before saving it."""
        from torch.distributed.tensor import DTensor

        named = [
            (n, p.to_local() if isinstance(p, DTensor) else p)
            for part in self.model_parts
            for n, p in part.named_parameters()
        ]
        named = [(n, t) for n, t in named if t.numel()]
        ok = torch.ones(1, device=self.device)
        if named:
            norms = torch.stack(torch._foreach_norm([t.detach() for _, t in named], 1))
            ok = torch.isfinite(norms).all().to(ok.dtype).reshape(1)
        if self.distributed:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item():
            return
        # A finite tensor whose L1 norm overflows is told apart by the exact check.
        bad = next((n for n, t in named if not torch.isfinite(t).all()), None)
        names = [bad]
        if self.distributed:
            names = [None] * self.world_size
            dist.all_gather_object(names, bad)
        found = [(r, n) for r, n in enumerate(names) if n is not None]
        if not found:
            return
        rank, name = found[0]
        where = f" on rank {rank}" if self.distributed else ""
        raise NonFiniteError(
            f"stopping at step {self.step}: the optimizer update made parameter '{name}' non-finite{where} although "
            f"the loss ({res.loss:.4g}) and the gradient norm ({res.grad_norm:.4g}) were finite; it is not saved "
            f"(resume from the last checkpoint; check optimizer.eps = {self.cfg.optimizer.eps:g} and optimizer.lr)"
        )

    @torch.no_grad()
    def validate(self) -> float:
        """Mean token loss over the held-out tail, identical on every rank."""
        from titanlike.data import build_validation_loader

        cfg = self.cfg
        loader = build_validation_loader(
            self.val_tokens,
            seq_len=cfg.training.seq_len,
            batch_size=cfg.training.local_batch_size,
            dp_rank=self.dp_rank,
            dp_degree=self.dp_degree,
            max_batches=cfg.validation.steps if cfg.validation.steps > 0 else None,
            cp_rank=self.cp_rank,
            cp_degree=self.cp_degree,
        )
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for m in self.model_parts:
            m.eval()
        for inputs, labels in loader:
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            if self.pp is not None:
                loss_sum = self.pp.eval_loss(inputs, labels)
            else:  # eval mode, then FSDP's shards handed back (training continues exactly)
                loss_sum = eval_loss_sum(self.model_parts[0], self.loss.loss_fn, inputs, labels, self.forward_context)
            total[0] += loss_sum.detach().to(torch.float64)
            total[1] += (labels != IGNORE_INDEX).sum()
        for m in self.model_parts:
            m.train()
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        return float(total[0] / total[1].clamp(min=1))

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _print_error(e: ConfigError) -> None:
    """The one line, from global rank 0 only: every rank finds the same problem (so a torchrun job prints it once).
    The other ranks wait a moment before exiting: torchrun tears the job down at the first rank that exits non-zero,
    and a rank that left at once could take rank 0 down before its line was out (seen under load)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {e}", file=sys.stderr, flush=True)
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
    if "--help" in argv or "-h" in argv:
        print(config_help(), end="")
        return 0
    try:
        cfg = load_config(argv)
        trainer = Trainer(cfg)
    except ConfigError as e:
        _print_error(e)
        return 2
    try:
        trainer.train()
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
        os._exit(0)
    return 0
