"""The silent-corruption sentinel (``training.sdc_check_interval = N``): every N steps, and before every checkpoint
save, the ranks that must hold bitwise-identical state compare a fingerprint of it, and a mismatch stops the run
before the corrupt state is saved.

What must be identical, and is compared (the layout rule ``sdc`` refuses a layout that has none of it):

* the HSDP replicas: a parameter's local shard (and its optimizer state) on every rank of its ``dp_replicate``
  group; more generally every DTensor parameter over every mesh dim on which it is ``Replicate`` (the tp ranks'
  norms and other replicated weights);
* the copies of a weight tied across pipeline stages (GPT-2's embedding and head), over the ranks holding one;
* the torchft replica groups: rank r's local state in every group that took part in the step (synchronous
  training only: under local_sgd / diloco the groups differ between synchronizations).

Each tensor costs five int64 numbers (``titanlike.parallel.replica_check.fingerprint``: any single flipped bit
changes one); each group one all-reduce (MAX of ``[f, ~f]``, 80 bytes per tensor), in a fixed order of groups on
every rank (no deadlock), then one 8-byte all-reduce over the job so that every rank stops at the same step. Only
when something differs does the group gather every member's fingerprints to name who differs (with three or more
members, the odd one out; with two, both: two copies cannot say which is wrong).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from titanlike import fault
from titanlike.parallel.replica_check import FINGERPRINT, disagreeing, fingerprint, gathered
from titanlike.sharding import local_tensor

__all__ = ["CorruptionError", "Sentinel"]

_DIMS = {"dp_replicate": "HSDP replicas", "tp": "tensor-parallel ranks"}


class CorruptionError(fault.ReportedError):
    """Ranks that must hold identical state do not: the run stops before saving it."""


@dataclass
class _Comparison:
    """One group of ranks that must hold the same tensors: what it is, its members, this rank's slot, the tensors."""

    order: tuple
    what: str
    group: object  # a process group; None: the torchft replica groups (through the manager)
    members: list[str]  # how each member is named ("rank 2", "replica group 1")
    slot: int | None
    named: list[tuple[str, torch.Tensor]] = field(default_factory=list)


@dataclass
class CheckCost:
    seconds: float
    bytes: int  # sent into all-reduces by this rank (each all-reduce counted once, at its size)
    tensors: int
    groups: list[str]


class Sentinel:
    """Built once the model, optimizer and replica groups exist; :meth:`due` and :meth:`check` are called by the
    trainer after each committed step."""

    def __init__(self, interval: int, *, model_parts, optimizer, pp, replicas, rank: int, device):
        self.interval, self.model_parts, self.optimizer = interval, model_parts, optimizer
        self.pp, self.replicas, self.rank, self.device = pp, replicas, rank, device
        self.distributed = dist.is_available() and dist.is_initialized()
        self.last: CheckCost | None = None
        self.checks = 0  # checks passed so far

    def due(self, step: int, saving: bool) -> bool:
        """Every ``interval`` steps, and at every step whose state is about to be saved."""
        return self.interval > 0 and (step % self.interval == 0 or saving)

    # ------------------------------------------------------------------ what to compare
    def _state_of(self, name: str, p) -> list[tuple[str, torch.Tensor]]:
        """A parameter's local tensor and its optimizer state of the same shape (AdamW's moments)."""
        local = local_tensor(p.detach())
        out = [(f"parameter '{name}'", local)]
        for k, v in sorted(self.optimizer.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor) and local_tensor(v).shape == local.shape:
                out.append((f"optimizer state '{name}' ({k})", local_tensor(v)))
        return out

    def _comparisons(self) -> list[_Comparison]:
        from torch.distributed.tensor import DTensor

        comps: dict[tuple, _Comparison] = {}
        named = [(n, p) for part in self.model_parts for n, p in part.named_parameters()]
        if self.distributed:
            for name, p in named:
                if not isinstance(p, DTensor):
                    continue
                mesh = p.device_mesh
                for dim, placement in enumerate(p.placements):
                    if not placement.is_replicate() or mesh.size(dim) == 1:
                        continue
                    dim_name = (mesh.mesh_dim_names or ())[dim] if mesh.mesh_dim_names else f"dim {dim}"
                    group = mesh.get_group(dim)
                    ranks = dist.get_process_group_ranks(group)
                    key = (0, dim_name, tuple(ranks))
                    if key not in comps:
                        what = f"the {_DIMS.get(dim_name, 'ranks of mesh dim')} ({dim_name})"
                        comps[key] = _Comparison(
                            key, what, group, [f"rank {r}" for r in ranks], ranks.index(dist.get_rank())
                        )
                    comps[key].named += self._state_of(name, p)
            names = {id(p): n for n, p in named}
            for i, (mine, group) in enumerate(getattr(self.pp, "tied_sets", None) or []):
                if group is None:
                    continue
                ranks = dist.get_process_group_ranks(group)
                key = (1, f"{i:06d}", tuple(ranks))
                comps[key] = _Comparison(
                    key,
                    "the copies of a weight tied across pipeline stages",
                    group,
                    [f"rank {r}" for r in ranks],
                    ranks.index(dist.get_rank()),
                    self._state_of(names[id(mine[0])], mine[0]),
                )
        r = self.replicas
        if r is not None and r.semi_sync is None:
            key = (2, "", ())
            comps[key] = _Comparison(
                key,
                "the torchft replica groups",
                None,
                [],  # named from the exchange
                r.manager.participating_rank(),
                [t for n, p in named for t in self._state_of(n, p)],
            )
        return [comps[k] for k in sorted(comps)]

    def _local_copies(self) -> str | None:
        """Copies of a tied weight on this rank itself (two stages of one rank): compared directly."""
        for mine, _ in getattr(self.pp, "tied_sets", None) or []:
            for p in mine[1:]:
                if not torch.equal(local_tensor(p.detach()), local_tensor(mine[0].detach())):
                    return "the two copies of a tied weight on this rank"
        return None

    # ------------------------------------------------------------------ the check
    @torch.no_grad()
    def check(self, step: int) -> CheckCost:
        """Compare; raise :class:`CorruptionError` (on every rank, with the same message) when anything differs."""
        t0 = time.perf_counter()
        comps = self._comparisons()
        sent, problems, found = 0, [], False
        local = self._local_copies()
        if local:
            problems.append(f"{local} differ (rank {self.rank})")
        for c in comps:
            if not c.named:
                continue
            rows = torch.stack([fingerprint(t) for _, t in c.named])
            if c.group is None:  # torchft: every group's rows in its slot, one SUM through the manager
                sent += (rows.numel() + FINGERPRINT) * 8 * max(self.replicas.manager.num_participants(), 1)
                problems += self._across_groups(c, rows, step)  # one line from each group's rank
                continue
            differs = disagreeing(rows, c.group)
            sent += 2 * rows.numel() * 8
            if any(differs):
                found = True
                every = gathered(rows, c.group, c.slot, len(c.members))
                if c.slot == 0:  # every member finds the same; the first one says it
                    problems.append(self._verdict(c, every, differs))
        flag = torch.tensor([1 if problems or found else 0], dtype=torch.int64, device=self.device)
        if self.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            sent += 8
        if int(flag.item()):
            said = [problems]
            if self.distributed:  # every rank says the same, in rank order
                said = [None] * dist.get_world_size()
                dist.all_gather_object(said, problems)
            lines = list(dict.fromkeys(p for ps in said for p in ps))
            raise CorruptionError(f"silent data corruption found at step {step}: " + "; ".join(lines))
        self.checks += 1
        self.last = CheckCost(
            time.perf_counter() - t0,
            sent,
            sum(len(c.named) for c in comps),
            [c.what for c in comps if c.named],
        )
        return self.last

    def _across_groups(self, c: _Comparison, rows: torch.Tensor, step: int) -> list[str]:
        """The torchft replica groups of the step: every group's fingerprints (after a first row holding its
        replica id: torchft orders the participants its own way), then the verdict."""
        m = self.replicas.manager
        size = m.num_participants()
        if size < 2:  # alone: nothing to compare
            return []
        head = torch.zeros((1, FINGERPRINT), dtype=torch.int64, device=rows.device)
        head[0, 0] = self.replicas.cfg.fault_tolerance.replica_id
        every = gathered(
            torch.cat([head, rows]),
            None,
            c.slot if c.slot is not None else 0,
            size,
            allreduce=lambda t: m.allreduce(t, reduce_op=dist.ReduceOp.SUM).wait(),
        )
        if m.errored() or c.slot is None:  # a group failed during the exchange (the next quorum deals with it)
            return []
        c.members = [f"replica group {int(g)}" for g in every[:, 0, 0].tolist()]
        every = every[:, 1:]
        differs = [bool((every[:, j] != every[0, j]).any()) for j in range(rows.shape[0])]
        return [self._verdict(c, every, differs)] if any(differs) else []

    def _verdict(self, c: _Comparison, every: torch.Tensor, differs: list[bool]) -> str:
        """Which tensors differ, and which members hold the odd values."""
        bad = [j for j, d in enumerate(differs) if d]
        odd: set[int] = set()
        for j in bad:
            values = [tuple(every[m, j].tolist()) for m in range(every.shape[0])]
            (common, n), *rest = Counter(values).most_common()
            if rest and rest[0][1] == n:  # no majority (two members): every member is suspect
                odd.update(range(len(values)))
            else:
                odd.update(m for m, v in enumerate(values) if v != common)
        who = ", ".join(c.members[m] for m in sorted(odd))
        first = c.named[bad[0]][0]
        more = f" and {len(bad) - 1} more tensor(s)" if len(bad) > 1 else ""
        if len(odd) == len(c.members) and len(c.members) == 2:
            blame = f"{' and '.join(c.members)} disagree (two copies cannot say which is wrong)"
        else:
            blame = f"{who} {'differs' if len(odd) == 1 else 'differ'} from the other {len(c.members) - len(odd)}"
        return f"{first}{more} differs across {c.what} [{', '.join(c.members)}]: {blame}"
