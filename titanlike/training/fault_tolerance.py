"""Fault-tolerant replica groups through torchft (``[fault_tolerance]``, docs/fault_tolerance.md).

HSDP's replicate dimension becomes ``group_size`` replica groups, each its own torchrun job with the same layout
inside (FSDP / TP / PP / ...). Each step:

1. :meth:`ReplicaGroups.begin_step`: torchft's quorum (synchronous): which groups take part. A group that is behind
   (restarted) fetches the live state of a healthy group through torchft's checkpoint transport first: weights,
   optimizer, LR schedule, counters (the step), RNG and the data position, so it is bitwise equal from then on.
2. The data: the job reads one stream of *group batches* (``training.global_batch_size`` samples each); a step
   with ``n`` groups taking part consumes the next ``n`` of them, the group of quorum rank ``r`` the ``r``-th. The
   position (group batches committed) is torchft's ``batches_committed``: no sample is skipped or read twice.
3. :meth:`sum_tokens` / :meth:`sum_gradients`: the token count, then every local gradient shard and the loss, are
   summed across the groups that take part through torchft's manager (its reconfigurable process group): the
   global-token loss contract over the groups of the step.
4. :meth:`should_commit`: every rank of the group agrees the step succeeded before its optimizer steps; a step
   that failed (a peer died in a collective) is not committed and is redone with the groups that are left, on the
   same data.

``semi_sync_method = local_sgd / diloco``: torchft's LocalSGD / DiLoCo instead (each group steps alone on its own
group batches, their optimizer hook synchronizes the groups every ``sync_steps``); the hooks above do nothing then.

Everything that can be wrong with the input is found by :func:`config_problems` and :func:`check_runtime` before a
process group starts.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from titanlike.errors import ConfigError
from titanlike.fault import ReportedError
from titanlike.sharding import local_tensor

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


class NothingToRejoinError(ReportedError):
    """A restarted group found no healthy group to recover from."""


class RecoveryError(ReportedError):
    """The ranks of a group disagree on the step after a recovery that failed on some of them."""


class QuorumError(ReportedError):
    """The quorum failed: the lighthouse is gone or did not answer in time."""


def lighthouse_address(cfg) -> str:
    return cfg.fault_tolerance.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")


def config_problems(cfg) -> list[str]:
    """Every problem of ``[fault_tolerance]`` with the rest of the config, one line each (disabled: only keys set
    that would be ignored)."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return _set_while_disabled(ft)
    out = _group_problems(ft) + _semi_sync_problems(ft)
    if cfg.parallelism.data_parallel_replicate_degree != 1:
        out.append(
            f"parallelism.data_parallel_replicate_degree: {cfg.parallelism.data_parallel_replicate_degree} with "
            f"fault_tolerance.enable: the replica groups are the replicate dimension; set it to 1 and start "
            f"fault_tolerance.group_size groups"
        )
    if ft.process_group == "nccl" and cfg.training.device == "cpu":
        out.append("fault_tolerance.process_group: nccl needs CUDA; use gloo with training.device = cpu")
    if cfg.optimizer.name != "AdamW":
        out.append(
            f"optimizer.name: {cfg.optimizer.name} with fault_tolerance.enable: a rejoining group copies the "
            f"optimizer state of torch's AdamW only; use optimizer.name = AdamW"
        )
    if not lighthouse_address(cfg):
        out.append(
            f"fault_tolerance.lighthouse: no lighthouse address; set it (http://host:29510) or {LIGHTHOUSE_ENV} "
            f"(scripts/ft_lighthouse.sh starts one)"
        )
    elif not _host_port(lighthouse_address(cfg)):
        out.append(f"fault_tolerance.lighthouse: '{lighthouse_address(cfg)}' is not an address like http://host:29510")
    if "MASTER_ADDR" not in os.environ:
        out.append(
            "fault_tolerance.enable: run each replica group under torchrun (torchft's manager meets its ranks in "
            "the group's store)"
        )
    return out


def _set_while_disabled(ft) -> list[str]:
    import dataclasses

    default = type(ft)()
    keys = [f.name for f in dataclasses.fields(ft) if getattr(ft, f.name) != getattr(default, f.name)]
    if not keys:
        return []
    return [
        f"fault_tolerance: {', '.join('fault_tolerance.' + k for k in keys)} set while fault_tolerance.enable is "
        f"false (it would be ignored); set fault_tolerance.enable = true or remove them"
    ]


def _group_problems(ft) -> list[str]:
    out = []
    if ft.group_size < 1:
        out.append(
            "fault_tolerance.group_size: set the number of replica groups of the job (>= 1) with fault_tolerance.enable"
        )
    elif not 0 <= ft.replica_id < ft.group_size:
        out.append(
            f"fault_tolerance.replica_id: {ft.replica_id} is not a group of the job; give each group an id in "
            f"0 .. {ft.group_size - 1} (fault_tolerance.group_size = {ft.group_size})"
        )
    if ft.group_size >= 1 and ft.min_replica_size > ft.group_size:
        out.append(
            f"fault_tolerance.min_replica_size: {ft.min_replica_size} groups can never take part in a step of a "
            f"job of fault_tolerance.group_size = {ft.group_size}; lower it to at most {ft.group_size}"
        )
    return out


def _semi_sync_problems(ft) -> list[str]:
    """sync_steps is read by local_sgd and diloco, outer_lr / outer_momentum by diloco only."""
    readers = {"sync_steps": ("local_sgd", "diloco"), "outer_lr": ("diloco",), "outer_momentum": ("diloco",)}
    default = type(ft)()
    unread = [
        k
        for k, methods in readers.items()
        if getattr(ft, k) != getattr(default, k) and ft.semi_sync_method not in methods
    ]
    if not unread:
        return []
    return [
        f"{', '.join('fault_tolerance.' + k for k in unread)}: not read with fault_tolerance.semi_sync_method = "
        f"{ft.semi_sync_method} (sync_steps: local_sgd and diloco; outer_*: diloco); set the method or remove them"
    ]


def _host_port(address: str) -> tuple[str, int] | None:
    parsed = urlparse(address if "://" in address else f"http://{address}")
    try:
        port = parsed.port
    except ValueError:
        return None
    return (parsed.hostname, port) if parsed.hostname and port else None


def check_runtime(cfg) -> None:
    """torchft installed and the lighthouse reachable (within ``connect_timeout_seconds``), else one ConfigError
    line. Called before any process group starts."""
    ft = cfg.fault_tolerance
    try:
        import torchft  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"fault_tolerance.enable needs torchft, which is not installed ({e}); pip install 'titanlike[ft]' "
            f"(torchft 0.2.0) or set fault_tolerance.enable = false"
        ) from None
    address = lighthouse_address(cfg)
    host, port = _host_port(address)
    t0 = time.perf_counter()
    try:
        socket.create_connection((host, port), timeout=ft.connect_timeout_seconds).close()
    except OSError as e:
        raise ConfigError(
            f"fault_tolerance.lighthouse: cannot reach the lighthouse at {address} within "
            f"{ft.connect_timeout_seconds} s ({e.strerror or e} after {time.perf_counter() - t0:.1f} s); start it "
            f"first (scripts/ft_lighthouse.sh) or fix the address"
        ) from None


class ReplicaGroups:
    """This group's torchft manager and the per-step hooks of the trainer and ``train_step``."""

    def __init__(self, cfg, *, model_parts, optimizer, lr_scheduler, train_state, dataloader, global_batch, rank):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's manager logs every quorum and commit at info
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        ft = cfg.fault_tolerance
        self.cfg, self.rank = cfg, rank
        self.params = [p for m in model_parts for p in m.parameters()]
        self.optimizer, self.lr_scheduler, self.train_state = optimizer, lr_scheduler, train_state
        self.dataloader, self.global_batch = dataloader, global_batch
        self.group_world = int(os.environ.get("WORLD_SIZE", "1"))
        base = ProcessGroupNCCL if ft.process_group == "nccl" else ProcessGroupGloo
        pg = _recording(base)(timeout=datetime.timedelta(milliseconds=ft.process_group_timeout_ms))
        self.pg = pg
        kwargs = dict(
            pg=pg,
            load_state_dict=self._load_live_state,
            state_dict=self._live_state,
            min_replica_size=ft.min_replica_size,
            use_async_quorum=False,  # the quorum decides the step's data, so it comes first
            timeout=datetime.timedelta(seconds=cfg.comm.timeout_seconds),
            quorum_timeout=datetime.timedelta(seconds=ft.quorum_timeout_seconds),
            connect_timeout=datetime.timedelta(seconds=ft.connect_timeout_seconds),
            rank=rank,
            world_size=self.group_world,
            lighthouse_addr=lighthouse_address(cfg),
            replica_id=f"titanlike_group_{ft.replica_id}",
            init_sync=False,  # every group starts from the same seeded weights (or the same checkpoint)
        )
        # torchrun's store outlives a restart of the group with the previous attempt's keys in it: rank 0 writes
        # this attempt's manager address before the others read it.
        if rank == 0:
            self.manager = Manager(**kwargs)
        if self.group_world > 1:
            dist.barrier()
        if rank != 0:
            self.manager = Manager(**kwargs)
        self.semi_sync = None  # torchft's LocalSGD or DiLoCo (semi_sync_method)
        self._torchft_start_quorum, self.manager.start_quorum = self.manager.start_quorum, self._start_quorum
        self.semi_sync = self._semi_sync(model_parts, optimizer)
        self.quorum_changes, self.recovery_seconds, self.participants, self.failed_steps = 0, 0.0, 0, 0
        self.quorum_seconds = 0.0
        self.replica_ids: list[int] = []

    def _semi_sync(self, model_parts, optimizer):
        """torchft's LocalSGD or DiLoCo (their optimizer hook synchronizes every sync_steps), else None."""
        from torch import nn

        ft = self.cfg.fault_tolerance
        if ft.semi_sync_method == "local_sgd":
            from torchft.local_sgd import LocalSGD

            return LocalSGD(self.manager, _Parameters(self.params), optimizer, ft.sync_steps).__enter__()
        if ft.semi_sync_method == "diloco":
            from torchft.local_sgd import DiLoCo

            model = nn.ModuleList(model_parts)
            outer = torch.optim.SGD(model.parameters(), lr=ft.outer_lr, momentum=ft.outer_momentum, nesterov=True)
            return DiLoCo(self.manager, [model], optimizer, outer, sync_every=ft.sync_steps).__enter__()
        return None

    # ------------------------------------------------------------------ the step
    def begin_step(self, step: int):
        """The quorum of the next step (a group behind heals here; too few groups: :meth:`_wait_for_groups`); then the
        loader at this group's group batch. Returns the step's data iterator."""
        from titanlike.data import set_loader_position

        if self.semi_sync is not None:  # no quorum but at the averagings; group g reads every group_size-th batch
            ft = self.cfg.fault_tolerance
            set_loader_position(self.dataloader, (step * ft.group_size + ft.replica_id) * self.global_batch)
            return iter(self.dataloader)
        t0 = time.perf_counter()
        self._quorum(step)
        healed = self.manager.current_step() != step
        seconds = time.perf_counter() - t0
        self._wait_for_groups(step, t0)
        self.quorum_seconds = time.perf_counter() - t0
        self._refuse_a_restart_with_nothing_to_rejoin(step)
        self._check_the_group_agrees(step)
        if healed:
            self.recovery_seconds = seconds
            self._say(
                f"recovered the live state of step {self.manager.current_step()} from a healthy group in "
                f"{seconds:.2f} s (weights, optimizer, LR schedule, data position, RNG); rejoining"
            )
        slot = self.manager.batches_committed() + self.manager.participating_rank()
        set_loader_position(self.dataloader, slot * self.global_batch)
        return iter(self.dataloader)

    def _wait_for_groups(self, step: int, t0: float) -> None:
        """Fewer than ``min_replica_size`` groups: quorum again every half second until there are, and stop after
        ``quorum_timeout_seconds``. At the start of a job (every group at step 0) wait the same time for all
        ``group_size`` groups, then train with those there (a late group heals from them)."""
        ft, said = self.cfg.fault_tolerance, False
        fresh = step == 0 and self.manager.current_step() == 0
        while self.participants < (ft.group_size if fresh else ft.min_replica_size):
            waited = time.perf_counter() - t0
            if waited > ft.quorum_timeout_seconds:
                if self.participants >= ft.min_replica_size:
                    self._say(
                        f"step 1: starting with {self.participants} of {ft.group_size} groups after {waited:.0f} s"
                    )
                    return
                raise QuorumError(
                    f"fault tolerance: group {ft.replica_id}: only {self.participants} replica group(s) "
                    f"{self.replica_ids} took part for {waited:.0f} s, fewer than fault_tolerance.min_replica_size = "
                    f"{ft.min_replica_size}: this group stops (start the missing groups, or lower min_replica_size)"
                )
            if not said:
                said = True
                self._say(
                    f"step {self.manager.current_step() + 1}: {self.participants} group(s), fewer than "
                    + (
                        f"group_size {ft.group_size} at the start"
                        if fresh
                        else f"min_replica_size {ft.min_replica_size}"
                    )
                    + f": waiting for more (at most {ft.quorum_timeout_seconds} s)"
                )
            time.sleep(0.5)
            self._quorum(step)

    def _quorum(self, step: int) -> None:
        """torchft's quorum (synchronous), through :meth:`_start_quorum`."""
        self.manager.start_quorum()

    def _start_quorum(self, *args, **kwargs) -> None:
        """torchft's ``Manager.start_quorum`` (this replaces it on the manager, so LocalSGD's and DiLoCo's quorums go
        through it too): a failure is one line (QuorumError), a new quorum is said on the console (rank 0)."""
        ft = self.cfg.fault_tolerance
        step = self.train_state.step + (0 if self.semi_sync is not None else 1)  # the step it is for
        was_quorum, t0 = self.pg.quorum_id, time.perf_counter()
        try:
            self._torchft_start_quorum(*args, **kwargs)
        except Exception as e:  # the lighthouse is gone (or did not answer in time): this group stops
            raise QuorumError(
                f"fault tolerance: group {ft.replica_id}: the quorum of step {step} failed after "
                f"{time.perf_counter() - t0:.1f} s ({_first_line(e)}): the lighthouse at "
                f"{lighthouse_address(self.cfg)} is down or unreachable, or a group took longer than "
                f"fault_tolerance.quorum_timeout_seconds = {ft.quorum_timeout_seconds} to reach its next step; this "
                f"group stops here (resume from its checkpoints with a lighthouse running)"
            ) from None
        self.participants = self.manager.num_participants()
        if self.pg.quorum_id != was_quorum:
            self.quorum_changes += 1
            before, self.replica_ids = self.replica_ids, self.pg.replica_ids(self.group_world)
            self._say(
                f"step {self.train_state.step + (0 if self.semi_sync is not None else 1)}: quorum "  # healed: its step
                f"{self.pg.quorum_id}: replica groups {self.replica_ids} take part ({self.participants} of "
                f"{ft.group_size})" + _changes(before, self.replica_ids)
            )

    def _refuse_a_restart_with_nothing_to_rejoin(self, step: int) -> None:
        """A restarted group (torchrun's restart count > 0) without a checkpoint of its own whose first quorum has
        no other group would train the job again from step 0, alone: the others have finished or died."""
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        ft = self.cfg.fault_tolerance
        if attempt and step == 0 and self.manager.current_step() == 0 and self.quorum_changes == 1:
            if self.participants == 1 and ft.group_size > 1:
                raise NothingToRejoinError(
                    f"fault tolerance: group {ft.replica_id} restarted (attempt {attempt}) but no other replica group "
                    f"is running to recover the job's state from (they finished or died); it would train from step 0 "
                    f"alone. Resume the job from its checkpoints (checkpoint.enable) or start it again"
                )

    def _check_the_group_agrees(self, step: int) -> None:
        """Every rank of the group is at the same step after the quorum: a recovery that failed on some ranks only
        (the healthy group died while sending) would leave the group's shards at different steps."""
        if self.group_world == 1:
            return
        now = self.manager.current_step()
        steps = torch.tensor([now, -now], dtype=torch.int64, device=self.params[0].device)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        hi, lo = int(steps[0]), -int(steps[1])
        if hi != lo:
            raise RecoveryError(
                f"fault tolerance: group {self.cfg.fault_tolerance.replica_id}: the recovery before step {step + 1} "
                f"failed on some ranks ({_first_line(self.manager.errored()) or 'no error'} on rank {self.rank}): its "
                f"ranks hold steps {lo} .. {hi}; the group stops (torchrun's --max-restarts restarts it, and it "
                f"recovers again from a healthy group)"
            )

    def sum_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """This group's token count summed over the groups of the step (the loss denominator; local_sgd: this
        group's)."""
        if self.semi_sync is not None:
            return tokens
        self.manager.allreduce(tokens, reduce_op=dist.ReduceOp.SUM).wait()
        return tokens

    def sum_gradients(self, total: torch.Tensor) -> torch.Tensor:
        """Every local gradient shard and the loss, summed over the groups of the step: one buffer per dtype."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        if self.semi_sync is not None:
            return total
        grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        total = total.reshape(1).to(torch.float64)
        by_dtype.setdefault(torch.float64, []).append(total)
        for tensors in by_dtype.values():
            flat = _flatten_dense_tensors(tensors)
            self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
            for t, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                t.copy_(reduced)
        return total.reshape(())

    def should_commit(self) -> bool:
        """Every rank of every group of the step succeeded: step the optimizer. Then the data position moves past
        the group batches of the step."""
        from titanlike.data import set_loader_position

        if self.semi_sync is not None:  # the averaging commits (torchft's LocalSGD, after the optimizer step)
            return True
        committed = self.manager.should_commit()
        if committed:
            set_loader_position(self.dataloader, self.manager.batches_committed() * self.global_batch)
        else:
            self.failed_steps += 1
            why = _first_line(self.manager.errored()) or "fewer than fault_tolerance.min_replica_size groups"
            self._say(
                f"step {self.manager.current_step() + 1} was not committed ({why}); it is redone on the same data "
                f"with the groups that are left"
            )
        return committed

    def metrics(self) -> dict:
        """The step's metrics: groups that took part, quorums so far, the last recovery's and this step's quorum
        seconds, group batches committed (the data position), steps not committed so far, the wall clock."""
        if self.semi_sync is not None:
            self.participants = self.manager.num_participants()  # of the last averaging
        return {
            "participants": self.participants,
            "quorum_changes": self.quorum_changes,
            "recovery_seconds": self.recovery_seconds,
            "quorum_seconds": self.quorum_seconds,
            "data_group_batches": self.manager.batches_committed(),
            "failed_steps": self.failed_steps,
            "unix_time": time.time(),
        }

    def load_checkpointed_position(self) -> None:
        """After a checkpoint load: torchft's counters from the trainer's (the loader position is group batches x
        training.global_batch_size)."""
        from titanlike.data import loader_position

        step = self.train_state.step
        if self.semi_sync is not None:  # torchft counts the synchronizations
            ft = self.cfg.fault_tolerance
            if ft.semi_sync_method == "diloco" and step % ft.sync_steps:
                raise ConfigError(
                    f"checkpoint: diloco resumes only from the checkpoint of a synchronization (a multiple of "
                    f"fault_tolerance.sync_steps = {ft.sync_steps}; the outer weights of step {step} are not saved); "
                    f"set checkpoint.load_step to one"
                )
            self.manager.load_state_dict({"step": step // ft.sync_steps, "batches_committed": 0})
            self.semi_sync._local_step = step % ft.sync_steps
            if ft.semi_sync_method == "diloco":
                self.semi_sync._save_parameters()  # the outer (global) weights: the loaded ones
            return
        self.manager.load_state_dict(
            {"step": step, "batches_committed": loader_position(self.dataloader) // self.global_batch}
        )

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(f"fault tolerance: group {self.cfg.fault_tolerance.replica_id}: {line}", flush=True)

    # ------------------------------------------------------------------ live state (torchft's checkpoint transport)
    def _live_state(self) -> dict:
        """This rank's shards of everything a rejoining group needs, as local tensors (its counterpart rank of the
        same layout loads them)."""
        opt = self.optimizer
        return {
            "params": [local_tensor(p.detach()) for p in self.params],
            "optimizer": [{k: local_tensor(v) for k, v in opt.state.get(p, {}).items()} for p in self.params],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "train_state": self.train_state.state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        }

    @torch.no_grad()
    def _load_live_state(self, state: dict) -> None:
        from torch.distributed.tensor import DTensor

        if len(state["params"]) != len(self.params):
            raise RuntimeError(
                f"the healthy group sent {len(state['params'])} parameters, this group has {len(self.params)}: the "
                f"groups must run the same model and layout"
            )
        for p, src in zip(self.params, state["params"]):
            local_tensor(p).copy_(src)
        for p, src in zip(self.params, state["optimizer"]):
            self.optimizer.state[p] = {
                k: DTensor.from_local(
                    v.clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
                if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0
                else v.clone()
                if isinstance(v, torch.Tensor)
                else v
                for k, v in src.items()
            }
        for group, src in zip(self.optimizer.param_groups, state["param_groups"]):
            group.update(src)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.train_state.load_state_dict(state["train_state"])
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])


class _Parameters:
    """What torchft's LocalSGD reads of a model: its parameters (every model part of this rank)."""

    def __init__(self, params):
        self._params = params

    def parameters(self):
        return iter(self._params)


def _first_line(e) -> str:
    """The first line of an exception (torchft wraps them in ExceptionWithTraceback), at most 200 characters."""
    if not e:
        return ""
    e = getattr(e, "original_exception", e)
    lines = str(e).strip().splitlines()
    return (lines[0][:200] if lines else "") or type(e).__name__


def _changes(before: list[int], now: list[int]) -> str:
    if not before:  # this process's first quorum
        return ""
    left, joined = sorted(set(before) - set(now)), sorted(set(now) - set(before))
    out = "".join(f"; group {g} left" for g in left) + "".join(f"; group {g} joined" for g in joined)
    return out


def _recording(base: type) -> type:
    """torchft's process group class that remembers the quorum it was last configured for (id and groups)."""

    class Recording(base):
        quorum_id = -1  # not configured yet
        _ranks: tuple[int, ...] = ()

        def configure(
            self,
            store_addr,
            replica_id,
            rank,
            world_size,
            quorum_id=None,
            group_rank=None,
            group_world_size=None,
            global_ranks=None,
        ):
            self.quorum_id, self._ranks = quorum_id, tuple(global_ranks or ())
            return super().configure(
                store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
            )

        def replica_ids(self, group_world: int) -> list[int]:
            return sorted(g // group_world for g in self._ranks)

    return Recording
