"""The trainer's checkpoints: :class:`CheckpointManager` saves and restores the whole state of a run.

**Atomic commit.** Every rank writes into ``step-N.tmp-<run id>/``. DCP's coordinator writes ``.metadata`` only after
gathering every rank's write results (so after all data files exist); then rank 0 adds ``checkpoint.json`` and renames
the folder to ``step-N``. A rename is atomic, so a ``step-N`` folder is always complete and a kill -9 at any moment
leaves the previous one loadable. Old checkpoints (``keep_latest_k``) are renamed aside before they are deleted.

**Faults.** Every collective runs on a group bounded by ``comm.timeout_seconds`` and inside ``fault.operation``,
which names the ranks that stopped answering; a failed write removes its temporary folder and names the free space;
``checkpoint.checksum`` records a CRC-32 per file, verified before a resume (``checkpoint.on_corrupt``).

**Resume.** With ``checkpoint.enable``, the newest committed ``step-N`` (or ``checkpoint.load_step``) is loaded; a
seed checkpoint (model only) starts at step 0. Without one, ``checkpoint.initial_load_path`` (a seed / step folder,
or a Hugging Face ``.safetensors``) gives the initial weights. Every problem with the input is found before anything
is loaded or written, by rank 0, and raised on every rank as one :class:`ConfigError` line; what rank 0 decided is
one :class:`ResumePlan`, the same on every rank.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanlike import fault
from titanlike.checkpoint.checksums import (
    LEGACY_ALGORITHM,
    ChecksummingWriter,
    Checksums,
    CorruptCheckpointError,
    check_files,
    load_verified,
    merge_checksums,
    read_checksums,
    verify_checksums,
)
from titanlike.checkpoint.export import export_hf
from titanlike.checkpoint.files import (
    LEFTOVER_DIR,
    STEP_DIR,
    check_writable,
    checkpoint_folder,
    committed_checkpoints,
    fsync_dir,
    only_ours,
    quiet_dcp,
    read_dcp_metadata,
    remove_dir,
    write_json,
)
from titanlike.checkpoint.meta import META_NAME, checkpoint_meta, read_meta, tokenizer_meta
from titanlike.checkpoint.parts import (
    OPTIM_OPTIONS,
    check_model_fits,
    flatten,
    holds_copy_state,
    merged_model,
    owner_key,
    tied_pairs,
)
from titanlike.config import ConfigError, JobConfig

Action = Literal["fresh", "seed", "resume", "initial_dcp", "initial_hf"]


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What a run loads at its start, decided by rank 0 (:meth:`CheckpointManager._make_plan`) and given to every
    rank as it is.

    * ``action``: ``fresh`` (nothing to load), ``seed`` (write a seed checkpoint and exit), ``resume`` (a committed
      checkpoint of ``checkpoint.folder``), ``initial_dcp`` / ``initial_hf`` (``checkpoint.initial_load_path``: model
      weights only, from a checkpoint folder or a Hugging Face file);
    * ``path``: the folder or file loaded; ``step``: the step of a resumed checkpoint;
    * ``full``: the checkpoint holds the optimizer and train state too (not only weights, as a seed does);
    * ``owner_state_for_copies``: the copies of tied parameters take the optimizer state saved under their owner
      (a checkpoint written without pipelining has one state for the one parameter);
    * ``rng_world_size``: the world size that wrote the RNG states (restored only when it is this run's);
    * ``corrupt``: ``(path, why)`` of newer checkpoints that failed their checks and are set aside
      (``checkpoint.on_corrupt = "previous"``);
    * ``run_id``: names this run's temporary folders.
    """

    run_id: str
    action: Action = "fresh"
    path: str = ""
    step: int | None = None
    full: bool = False
    owner_state_for_copies: bool = False
    rng_world_size: int | None = None
    corrupt: tuple[tuple[str, str], ...] = ()


class CheckpointSaveError(fault.ReportedError):
    """A save could not be written; its partial folder is removed and the previous checkpoint is intact."""


class NonFiniteStateError(fault.ReportedError):
    """The state to save holds a NaN or an infinity: not saved (the previous checkpoint stays the newest)."""


class _Unusable(Exception):
    """Raised on every rank alike when the checkpoint being loaded turns out corrupted or non-finite while it is
    read (after its files passed the checks of the plan); :meth:`CheckpointManager.load` refuses it or falls back."""


def _root_cause(exc: BaseException) -> str:
    """'[Errno 28] No space left on device' for an OSError anywhere in ``exc`` (DCP wraps the ranks' failures),
    else its telling line."""
    for e in fault.exceptions_in(exc):
        if isinstance(e, OSError) and e.errno is not None:
            return f"[Errno {e.errno}] {e.strerror}"
    return fault.first_line(exc)


class CheckpointManager:
    """Saves and restores the state of a run, given as named pieces (as torchtitan does):

    * ``model_parts``: this rank's model modules (one, or its pipeline stages);
    * ``optimizer`` and ``lr_scheduler``: ``state_dict`` / ``load_state_dict`` objects;
    * ``dataloader``: a ``TokenDataLoader`` (its position, a global sample index, is what is saved);
    * ``train_state``: a ``Stateful`` whose ``state_dict()`` holds the counters ``step``, ``tokens_seen`` and
      ``nonfinite_steps``; a resume sets them back with ``load_state_dict``.

    ``cfg`` (the ``JobConfig``), ``model_args``, the ``tokenizer`` (recorded in the checkpoint's metadata), the device
    and the process layout are read, never written.
    Constructing the manager is collective when distributed, and validates every input (raising the same
    :class:`ConfigError` on every rank); ``load``, ``maybe_save`` and ``finish`` are collective too.
    """

    def __init__(
        self,
        cfg: JobConfig,
        *,
        model_parts,
        optimizer,
        lr_scheduler,
        dataloader,
        train_state,
        model_args,
        tokenizer,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        dp_degree: int | None = None,
    ):
        self.cfg = cfg.checkpoint
        self.timeout = datetime.timedelta(seconds=cfg.comm.timeout_seconds)
        self.folder = checkpoint_folder(cfg)
        self.optimizer, self.lr_scheduler, self.dataloader = optimizer, lr_scheduler, dataloader
        self.train_state, self.model_args, self.tokenizer, self.device = train_state, model_args, tokenizer, device
        self.rank, self.world_size, self.dp_degree = rank, world_size, dp_degree
        self.distributed = world_size > 1
        self.optimizer_name = cfg.optimizer.name  # recorded by full saves; a resume needs the same optimizer's state
        self._tied_pairs = tied_pairs(model_args)  # (owner, copy) FQNs of the model's tied parameters
        # What the run adds to every checkpoint.json it saves (the trainer: the Weights & Biases run id, so that a
        # resume continues the same run); plain JSON values.
        self.meta_extra: dict = {}
        # What a seed checkpoint records of how its weights were made (checkpoint.json): the initialisation seed, the
        # dtype of the weights and the layout that wrote it (any layout loads it).
        from titanlike.layout import Degrees, master_dtype

        d = Degrees.from_config(cfg, world_size)
        self.seed_meta = {
            "seed": cfg.training.seed,
            "dtype": master_dtype(cfg.training.dtype),
            "layout": {"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "tp": d.tp},
        }
        self.model = merged_model(model_parts)
        # A gloo group of its own: DCP exchanges only plans and metadata (any device), an async save runs its
        # collectives on it from a background thread without interleaving with the training collectives, and
        # gloo has monitored_barrier, which names the ranks that do not arrive.
        # Created (a store rendezvous) under comm.init_timeout_seconds; the trainer then bounds it, like every other
        # group, by comm.timeout_seconds (torch's default for a new gloo group would be 30 minutes).
        init_timeout = datetime.timedelta(seconds=cfg.comm.init_timeout_seconds)
        self.pg = dist.new_group(backend="gloo", timeout=init_timeout) if self.distributed else None
        self.pending: tuple | None = None  # async save in flight: (future, step, tmp folder, start, meta)
        self.last_step: int | None = None  # newest step committed or loaded by this run
        self.quiet_commit, self.saved_note = False, ""  # rank 0's line of the last commit, and whether it prints it
        self._corrupt: dict[str, str] = {}  # path -> why, of checkpoints whose checksums did not match (_verify)
        self.plan: ResumePlan = self._agree(self._make_plan)
        self._verify()
        self._tidy()

    def _op(self, what: str):
        """A phase whose failed collectives are reported naming the ranks that stopped answering (fault.py)."""
        return fault.job_operation(self, what)

    # ------------------------------------------------------------------------------------------ input checks
    def _agree(self, fn):
        """Run ``fn`` on rank 0 and give its result, or its error, to every rank (none is left waiting)."""
        outcome = None  # ("ok", result) / ("error", the input's problem) / ("failure", anything else)
        if self.rank == 0:
            try:
                outcome = ("ok", fn())
            except ConfigError as e:
                outcome = ("error", str(e))
            except Exception as e:  # noqa: BLE001 - not the input's fault: re-raised below as what it is
                outcome = ("failure", f"checkpoint setup failed on rank 0: {type(e).__name__}: {e}")
        if self.distributed:
            box = [outcome]
            with self._op("the checkpoint setup (rank 0 checks the checkpoint folder)"):
                dist.broadcast_object_list(box, src=0, group=self.pg)
            outcome = box[0]
        kind, value = outcome
        if kind == "error":
            raise ConfigError(value)
        if kind == "failure":
            raise RuntimeError(value)
        return value

    def _expected_model(self) -> dict[str, torch.Size]:
        from titanlike.hf import expected_shapes

        return expected_shapes(self.model_args)

    def _make_plan(self) -> ResumePlan:
        c, folder = self.cfg, self.folder
        plan = ResumePlan(run_id=uuid.uuid4().hex[:8])
        if c.create_seed_checkpoint:
            return self._plan_seed(plan)
        if c.export_safetensors and not c.enable:
            raise ConfigError(
                "checkpoint.export_safetensors exports the final checkpoint: set checkpoint.enable = true as well"
            )
        if c.load_step >= 0 and not c.enable:
            raise ConfigError(f"checkpoint.load_step {c.load_step} needs checkpoint.enable = true")
        expected = self._expected_model()
        if c.enable:
            check_writable(folder)
            resumed = self._plan_resume(plan, self._resumable_steps(), expected)
            if resumed is not None:
                return resumed
        if c.initial_load_path:
            plan = self._plan_initial(plan, Path(c.initial_load_path), expected)
        return plan

    def _plan_seed(self, plan: ResumePlan) -> ResumePlan:
        """checkpoint.create_seed_checkpoint: nothing else to load or export, and an empty folder to write."""
        c, folder = self.cfg, self.folder
        ignored = [
            k
            for k, v in (
                ("initial_load_path", c.initial_load_path),
                ("load_step", c.load_step >= 0),
                ("export_safetensors", c.export_safetensors),
            )
            if v
        ]
        if ignored:
            raise ConfigError(
                f"checkpoint.create_seed_checkpoint writes the weights initialised from "
                f"training.seed and exits: {', '.join('checkpoint.' + k for k in ignored)} would be "
                f"ignored; remove {'it' if len(ignored) == 1 else 'them'} (a Hugging Face folder "
                f"becomes a seed checkpoint with scripts/convert_checkpoint.py from-hf)"
            )
        existing = committed_checkpoints(folder)
        if existing:
            raise ConfigError(
                f"checkpoint.create_seed_checkpoint: '{folder}' already holds checkpoints "
                f"({', '.join(f'step-{s}' for s in existing)}); not overwriting them, choose an "
                f"empty checkpoint.folder"
            )
        check_writable(folder)
        return dataclasses.replace(plan, action="seed")

    def _resumable_steps(self) -> dict:
        """The committed checkpoints a resume may pick from: all of them, or checkpoint.load_step's alone."""
        c, folder = self.cfg, self.folder
        found = committed_checkpoints(folder)
        if c.load_step < 0:
            return found
        if c.load_step not in found:
            have = ", ".join(map(str, found)) or "none"
            raise ConfigError(
                f"checkpoint.load_step {c.load_step}: there is no committed checkpoint "
                f"step-{c.load_step} in '{folder}' (steps there: {have})"
            )
        later = [s for s in found if s > c.load_step]
        if later:
            raise ConfigError(
                f"checkpoint.load_step {c.load_step}: '{folder}' also holds later checkpoints "
                f"({', '.join(map(str, later))}) that this run would overwrite or purge; move "
                f"them away or resume into another checkpoint.folder"
            )
        return {c.load_step: found[c.load_step]}

    def _plan_resume(self, plan: ResumePlan, found: dict, expected) -> ResumePlan | None:
        """The newest intact checkpoint of ``found`` to resume from (None when there is none to resume)."""
        corrupt: list[tuple[Path, str]] = []  # newest first, set aside when an older one resumes
        for step, path in sorted(found.items(), reverse=True):
            try:
                metadata = self._check_intact(path)
            except ConfigError as e:
                self._refuse_unless_falling_back(str(e))
                corrupt.append((path, str(e)))
                continue
            keys = self._check_resumable(path, metadata, expected)
            return dataclasses.replace(
                plan,
                action="resume",
                path=str(path),
                step=step,
                corrupt=tuple((str(p), why) for p, why in corrupt),
                full=any(k.startswith("optimizer.") for k in keys),
                owner_state_for_copies=not holds_copy_state(keys, self._tied_pairs),
                rng_world_size=read_meta(path).get("world_size"),
            )
        if corrupt:
            raise ConfigError(
                f"no intact checkpoint in '{self.folder}' to resume from (checkpoint.on_corrupt = "
                f'"previous"): {corrupt[-1][1]}; repair one or move them away to start over'
            )
        return None

    def _check_resumable(self, path: Path, metadata, expected):
        """An intact checkpoint resumes this run: a full save, of this model, by this optimizer; returns its keys."""
        if read_meta(path).get("kind") == "model_only":
            raise ConfigError(
                f"checkpoint '{path}' is the model-only last save of a finished run "
                f"(checkpoint.last_save_model_only): it cannot resume training; start a new "
                f"run from it with checkpoint.initial_load_path (in another checkpoint.folder), "
                f"or move it away to resume from the checkpoint before it"
            )
        check_model_fits(metadata, expected, path, self.model_args)
        keys = metadata.state_dict_metadata
        saved_by = read_meta(path).get("optimizer", "AdamW")  # checkpoints from before Muon: AdamW
        if saved_by != self.optimizer_name and any(k.startswith("optimizer.") for k in keys):
            raise ConfigError(
                f"checkpoint '{path}' holds {saved_by}'s optimizer state and this run's optimizer.name is "
                f"{self.optimizer_name!r}; resume with optimizer.name = {saved_by!r}, or start "
                f"{self.optimizer_name} from its weights: checkpoint.initial_load_path = '{path}' with "
                f"another checkpoint.folder"
            )
        return keys

    def _refuse_unless_falling_back(self, msg: str) -> None:
        """A checkpoint of the folder is corrupted (``msg`` says how): the one-line ConfigError with the way out, unless
        checkpoint.on_corrupt = "previous" lets the run fall back to an older one (then return)."""
        if self.cfg.load_step >= 0:
            raise ConfigError(f"{msg}; repair it or choose another checkpoint.load_step")
        if self.cfg.on_corrupt != "previous":
            raise ConfigError(
                f"{msg}; move it out of '{self.folder}' to resume from the checkpoint before it "
                f'(or set checkpoint.on_corrupt = "previous"), or repair it'
            )

    def _checksums(self, path: str | Path) -> Checksums | str | None:
        """The checksums a load of ``path`` verifies (None with checkpoint.checksum = false)."""
        return read_checksums(path) if self.cfg.checksum else None

    def _check_intact(self, path: Path):
        """The DCP metadata of a committed checkpoint after checking its files' sizes (and, with checkpoint.checksum,
        its checksums.json, the sizes it records and the checksums of .metadata and checkpoint.json; the entries are
        verified while they are read, and a legacy checkpoint's whole-file CRCs by every rank in _verify); a
        ConfigError naming the first problem otherwise. A checkpoint found corrupted later (_verify, or while it was
        loaded) is reported here on the re-plan."""
        if str(path) in self._corrupt:
            raise ConfigError(self._corrupt[str(path)])
        metadata = read_dcp_metadata(path)
        read_meta(path)
        sums = self._checksums(path)
        if isinstance(sums, str):
            raise ConfigError(f"checkpoint '{path}' is corrupted: {sums}")
        if isinstance(sums, Checksums) and sums.algorithm != LEGACY_ALGORITHM:
            problem = check_files(path, sums)
            if problem:
                raise ConfigError(f"checkpoint '{path}' is corrupted: {problem}")
        return metadata

    def _verify(self) -> None:
        """Before resuming from a checkpoint with whole-file CRC-32s (written by titanlike before per-entry
        checksums): every rank compares its share of the files (the reading is spread over the ranks), the first
        mismatch is shared, and it stops the run (on_corrupt = "stop", or a load_step) or sends rank 0 back to plan
        the newest intact checkpoint ("previous"). Nothing on disk is changed here; set-asides happen in _tidy once a
        checkpoint passed. Per-entry checksums are verified while the entries are read (the load)."""
        while self.plan.action == "resume":
            sums = self._checksums(self.plan.path)
            if not (isinstance(sums, Checksums) and sums.algorithm == LEGACY_ALGORITHM):
                return
            path, world = self.plan.path, self.world_size if self.distributed else 1
            problem = verify_checksums(path, self.rank, world)
            if self.distributed:
                problems = [None] * world
                with self._op(f"the checksum verification of step {self.plan.step}"):
                    dist.all_gather_object(problems, problem, group=self.pg)
                problem = next((p for p in problems if p is not None), None)
            if problem is None:
                return
            msg = f"checkpoint '{path}' is corrupted: {problem}"
            self._refuse_unless_falling_back(msg)
            self._corrupt[path] = msg
            self.plan: ResumePlan = self._agree(self._make_plan)

    def _tidy(self) -> None:
        """Rank 0, once the input is known good: set aside corrupted checkpoints that are skipped and ``step-N``
        folders without their commit marker (.metadata; never "newest", and their step is saved again without a
        conflict), and delete the temporary folders of dead runs when they hold only files a save writes."""
        if self.rank != 0 or not (self.cfg.enable or self.plan.action == "seed"):
            return
        folder, run_id = self.folder, self.plan.run_id
        for path, why in self.plan.corrupt:
            path = Path(path)
            aside = path.with_name(f"{path.name}.corrupt-{run_id}")
            os.rename(path, aside)
            print(f"checkpoint: {why}; set aside as {aside.name}, resuming from an older checkpoint", flush=True)
        removed, kept = [], []
        for p in sorted(folder.iterdir()):
            if not p.is_dir():
                continue
            if STEP_DIR.fullmatch(p.name) and not (p / ".metadata").is_file():
                aside = p.with_name(f"{p.name}.incomplete-{run_id}")
                os.rename(p, aside)
                print(
                    f"checkpoint: {p} has no .metadata (its save was never committed): set aside as {aside.name}",
                    flush=True,
                )
            elif LEFTOVER_DIR.fullmatch(p.name):
                if only_ours(p):
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p.name)
                else:
                    kept.append(p.name)
        if removed:
            print(
                f"checkpoint: removed {len(removed)} temporary folder(s) of interrupted saves: {', '.join(removed)}",
                flush=True,
            )
        if kept:
            print(
                f"checkpoint: not removing {', '.join(kept)}: they hold files a checkpoint save does not write",
                flush=True,
            )

    def _plan_initial(self, plan: ResumePlan, path: Path, expected: dict[str, torch.Size]) -> ResumePlan:
        from titanlike import hf

        if not path.exists():
            raise ConfigError(f"checkpoint.initial_load_path: '{path}' does not exist")
        if path.is_dir() and (path / ".metadata").is_file():
            check_model_fits(read_dcp_metadata(path), expected, path, self.model_args)
            return dataclasses.replace(plan, action="initial_dcp", path=str(path))
        try:
            files, folder = hf.resolve_weights(path)
            config = hf.read_hf_config(folder)
            if config is not None:
                hf.check_same_architecture(
                    hf.model_args_from_hf_config(config, str(folder / hf.CONFIG_NAME), like=self.model_args),
                    self.model_args,
                    f"'{path}'",
                )
            hf.from_hf(hf.safetensors_placeholders(files), self.model_args)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(
                f"checkpoint.initial_load_path: {e}; give a checkpoint step folder or a Hugging "
                f"Face folder / .safetensors of this model"
            ) from None
        return dataclasses.replace(plan, action="initial_hf", path=str(path))

    # ------------------------------------------------------------------------------------------ state
    def _train_state(self) -> dict:
        from titanlike.data import loader_position

        counters = self.train_state.state_dict()
        return {
            "step": counters["step"],
            "tokens_seen": counters["tokens_seen"],
            "nonfinite_steps": counters["nonfinite_steps"],
            "data_position": loader_position(self.dataloader),
            "lr_scheduler": self.lr_scheduler.state_dict(),
        }

    def _rng_state(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return {f"rank{self.rank}": state}

    def _state(self) -> dict:
        from titanlike.parallel.fused import contiguous_for_dcp_tree

        # Chunk-sharded DTensors (fused projections under TP) as plain-Shard layouts: DCP writes one contiguous block
        # per rank, and the files keep the single-device order (titanlike/parallel/fused.py).
        return {
            "model": contiguous_for_dcp_tree(get_model_state_dict(self.model)),
            "optimizer": contiguous_for_dcp_tree(
                get_optimizer_state_dict(self.model, self.optimizer, options=OPTIM_OPTIONS)
            ),
            "train": self._train_state(),
            "rng": self._rng_state(),
        }

    def _dcp_kwargs(self) -> dict:
        return {"process_group": self.pg} if self.distributed else {"no_dist": True}

    # ------------------------------------------------------------------------------------------ seed
    def maybe_create_seed_checkpoint(self) -> bool:
        """With checkpoint.create_seed_checkpoint: write the initial weights as ``step-0`` and return True.

        Collective: every rank writes its own shards (DCP, under the run's real layout, nothing gathered), then rank
        0 commits the folder like any save (checkpoint.json, checksums, one atomic rename) and every rank returns
        once ``step-0`` exists. Any other layout (or one process) starts from it by resharding on load."""
        if self.plan.action != "seed":
            return False
        from titanlike.parallel.fused import contiguous_for_dcp_tree

        t0 = time.perf_counter()
        what = "the seed checkpoint save"
        tmp = self.folder / f"step-0.tmp-{self.plan.run_id}"
        with self._op(what):
            if self.distributed:
                self._barrier(what)
            state = {"model": contiguous_for_dcp_tree(get_model_state_dict(self.model))}
            self._check_finite({**state, "optimizer": {}}, 0)
            kwargs = {**self._dcp_kwargs(), "checkpoint_id": str(tmp)}
            if self.cfg.checksum:
                kwargs["storage_writer"] = ChecksummingWriter(str(tmp))
            try:
                quiet_dcp(dcp.save, state, **kwargs)
            except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP raises its gathered failures
                if fault.is_comm_failure(e):
                    raise
                self._save_failed(0, tmp, e)
        self._commit(
            0,
            tmp,
            t0,
            checkpoint_meta(
                0,
                "seed",
                self.model_args,
                world_size=self.world_size,
                **self.seed_meta,
                **tokenizer_meta(self.tokenizer),
            ),
        )
        if self.distributed:  # nobody leaves (and ends the job) before rank 0 renamed the folder
            with self._op("the seed checkpoint commit"):
                dist.barrier(group=self.pg)
        if self.rank == 0:
            print(
                f"checkpoint: {self.folder / 'step-0'} is a seed checkpoint (each of {self.world_size} process(es) "
                f"wrote its own shards); start any layout from it with "
                f"checkpoint.initial_load_path={self.folder / 'step-0'}",
                flush=True,
            )
        return True

    # ------------------------------------------------------------------------------------------ load
    def load(self) -> int | None:
        """Restore what the plan says (resume / initial weights / nothing); return the step resumed from.

        A checkpoint whose entries turn out corrupted or non-finite while they are read is refused in one line or,
        with checkpoint.on_corrupt = "previous", set aside for the newest intact one (every rank alike)."""
        while True:
            try:
                return self._load_planned()
            except _Unusable as e:
                self._fall_back(str(e))

    def _load_planned(self) -> int | None:
        plan, t0 = self.plan, time.perf_counter()
        if plan.action == "resume":
            with self._op(f"the checkpoint load of step {plan.step}"):
                checks = self._load_dcp(
                    plan.path,
                    full=plan.full,
                    owner_state_for_copies=plan.owner_state_for_copies,
                    rng=plan.rng_world_size == self.world_size,
                )
            what = (
                f"resumed from {plan.path} (step {self.train_state.state_dict()['step']})"
                if plan.full
                else f"loaded the seed weights {plan.path}"
            )
            self.last_step = plan.step
        elif plan.action == "initial_dcp":
            with self._op("the load of the initial weights"):
                checks = self._load_dcp(plan.path, full=False, owner_state_for_copies=False, rng=False)
            what = f"loaded the initial weights {plan.path}"
        elif plan.action == "initial_hf":
            self._load_hf(plan.path)
            what, checks = f"loaded the initial weights {plan.path} (Hugging Face)", ""
        else:
            return None
        if self.rank == 0:
            print(f"checkpoint: {what} in {time.perf_counter() - t0:.2f}s{checks}", flush=True)
        return self.train_state.state_dict()["step"]

    def _fall_back(self, msg: str) -> None:
        """The checkpoint being loaded is unusable (``msg``): refuse in one line, or (on_corrupt = "previous") plan
        the newest intact checkpoint, set the bad one aside, and let load() try again. The failed load may have
        written into the model and the optimizer (never into the counters, the data position, the schedule or the
        RNG): the next one overwrites every weight, and a seed checkpoint (weights only) restarts the optimizer."""
        if self.plan.action != "resume":
            raise ConfigError(f"checkpoint.initial_load_path: {msg}; repair it or give another")
        self._refuse_unless_falling_back(msg)
        self._corrupt[self.plan.path] = msg
        self.plan = self._agree(self._make_plan)
        self._tidy()
        if self.plan.action == "resume" and not self.plan.full:
            for state in self.optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        v.zero_()  # AdamW at step 0 with zero moments: a fresh optimizer

    def _load_dcp(self, path: str, *, full: bool, owner_state_for_copies: bool, rng: bool) -> str:
        """Load a DCP checkpoint into the model (and, ``full``, the optimizer and the train state), verifying every
        entry read against its checksum and the loaded model and optimizer for non-finite values before anything
        else is set; returns what was verified (for the log line)."""
        state: dict = {"model": get_model_state_dict(self.model)}
        if full:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer, options=OPTIM_OPTIONS)
            state["train"] = self._train_state()
            if rng:
                state["rng"] = self._rng_state()
        flat = flatten(state)
        # Tied parameters: optimizer entries of a pipeline stage's own copy (output.weight) come from the owner's.
        aliased, copy_of = {}, {}
        if full and owner_state_for_copies:
            pairs = self._tied_pairs
            for k in [k for k in flat if owner_key(k, pairs)]:
                copy_of[owner_key(k, pairs)] = k
                aliased[owner_key(k, pairs)] = flat.pop(k)
        from titanlike.parallel.fused import contiguous_for_dcp, restore_layout

        originals = {**flat, **aliased}
        flat, aliased = contiguous_for_dcp(flat), contiguous_for_dcp(aliased)
        sums = self._checksums(path)
        records = sums.records if isinstance(sums, Checksums) and sums.algorithm != LEGACY_ALGORITHM else None
        if sums is None and self.cfg.checksum and self.rank == 0:
            print(
                f"checkpoint: '{path}' has no checksums (written with checkpoint.checksum = false, by an older "
                f"titanlike or by another tool): its entries are loaded unverified",
                flush=True,
            )
        t0 = time.perf_counter()
        try:
            quiet_dcp(load_verified, flat, path, records, **self._dcp_kwargs())
            if full and owner_state_for_copies and self._tied_pairs:
                # the same count of calls on every rank
                quiet_dcp(load_verified, aliased, path, records, **self._dcp_kwargs())
        except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP gathers every rank's failure into
            # one CheckpointException (a BaseException), raised on every rank; its last line is the root cause
            corrupt = fault.failure_of(e, CorruptCheckpointError)
            if corrupt is not None:
                raise _Unusable(f"checkpoint '{path}' is corrupted: {corrupt}") from None
            if fault.is_comm_failure(e):  # a rank stopped answering: not the checkpoint's fault (reported by _op)
                raise
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"checkpoint '{path}' could not be loaded ({first}); move it out of its folder to "
                f"resume from the checkpoint before it, or repair it"
            ) from None
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        loaded = {**flat, **aliased}
        bad = self._first_non_finite(
            [(k, loaded[k]) for k in sorted(loaded) if k.startswith(("model.", "optimizer."))], "the load"
        )
        if bad is not None:
            raise _Unusable(f"checkpoint '{path}' holds non-finite values: '{bad[1]}' (rank {bad[0]})")
        finite_s = time.perf_counter() - t0
        flat, aliased = restore_layout(flat, originals), restore_layout(aliased, originals)
        for k, v in aliased.items():
            flat[copy_of[k]] = v
        model_sd = {k[len("model.") :]: v for k, v in flat.items() if k.startswith("model.")}
        set_model_state_dict(self.model, model_sd)
        if full:
            optim_sd = {k[len("optimizer.") :]: v for k, v in flat.items() if k.startswith("optimizer.")}
            set_optimizer_state_dict(self.model, self.optimizer, optim_sd, options=OPTIM_OPTIONS)
            from titanlike.data import set_loader_position

            counters = ("step", "tokens_seen", "nonfinite_steps")
            self.train_state.load_state_dict({k: flat[f"train.{k}"] for k in counters})
            set_loader_position(self.dataloader, flat["train.data_position"])
            prefix = "train.lr_scheduler."
            self.lr_scheduler.load_state_dict({k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)})
            if rng:
                torch.set_rng_state(flat[f"rng.rank{self.rank}.cpu"])
                if f"rng.rank{self.rank}.cuda" in flat:
                    torch.cuda.set_rng_state(flat[f"rng.rank{self.rank}.cuda"], self.device)
        how = "checksums verified while read" if records is not None else "read"
        return f" ({how} in {read_s:.2f}s; finite check {finite_s:.3f}s)"

    def _load_hf(self, path: str) -> None:
        from titanlike.hf import load_hf

        mine = get_model_state_dict(self.model)  # this rank's FQNs (a pipeline rank holds only its stages')
        dtype = next(iter(mine.values())).dtype  # the file may be bfloat16 / float16: cast to the parameters'
        full, _ = load_hf(path, self.model_args, dtype=dtype)
        set_model_state_dict(self.model, {k: full[k] for k in mine}, options=StateDictOptions(full_state_dict=True))

    # ------------------------------------------------------------------------------------------ save
    def maybe_save(self, step: int, last: bool = False) -> None:
        """Call after every step: commits a finished async save, saves at every ``interval`` and the last step."""
        self._poll()
        if self.save_due(step, last):
            if last and self.cfg.last_save_model_only:
                self.save(step, model_only=True)
            else:
                self.save(step)

    def save_due(self, step: int, last: bool = False) -> bool:
        """Whether :meth:`maybe_save` saves step ``step`` (the silent-corruption sentinel checks such a step first)."""
        return self.cfg.enable and (step % self.cfg.interval == 0 or last) and step != self.last_step

    def save_now(self, step: int) -> None:
        """Save step ``step`` now, synchronously (the job ends right after: an exit signal): a background save in
        flight is committed first, async_mode is not used, and every rank returns only once ``step-N`` is
        committed."""
        self._wait()
        if self.last_step != step:
            self.save(step, synchronous=True)
        if self.distributed:  # nobody leaves (and ends the job) before rank 0 renamed the folder
            with self._op(f"the commit of step {step}"):
                dist.barrier(group=self.pg)

    def save(self, step: int, model_only: bool = False, synchronous: bool = False) -> None:
        """Save step ``step``; ``model_only`` (checkpoint.last_save_model_only at the last step): the model weights
        only, cast to checkpoint.export_dtype (torchtitan's last save); ``synchronous``: even with async_mode."""
        self._wait()
        background = self.cfg.async_mode == "async" and not synchronous
        t0 = time.perf_counter()
        what = f"the checkpoint save of step {step}"
        with self._op(what):
            if self.distributed:
                self._barrier(what)
            if model_only:
                dtype = getattr(torch, self.cfg.export_dtype)
                state = {
                    "model": {k: v.to(dtype) for k, v in get_model_state_dict(self.model).items()},
                    "optimizer": {},
                }
                meta = checkpoint_meta(
                    step,
                    "model_only",
                    self.model_args,
                    world_size=self.world_size,
                    dtype=self.cfg.export_dtype,
                    **tokenizer_meta(self.tokenizer),
                    **self.meta_extra,
                )
                self._check_finite(state, step)
                state = {"model": state["model"]}
            else:
                state = self._state()
                self._check_finite(state, step)
                train = state["train"]
                meta = checkpoint_meta(
                    step,
                    "full",
                    self.model_args,
                    world_size=self.world_size,
                    dp_degree=self.dp_degree,
                    optimizer=self.optimizer_name,
                    tokens_seen=train["tokens_seen"],
                    data_position=train["data_position"],
                    nonfinite_steps=train["nonfinite_steps"],
                    **tokenizer_meta(self.tokenizer),
                    **self.meta_extra,
                )
            tmp = self.folder / f"step-{step}.tmp-{self.plan.run_id}"
            kwargs = {**self._dcp_kwargs(), "checkpoint_id": str(tmp)}
            if self.cfg.checksum:
                kwargs["storage_writer"] = ChecksummingWriter(str(tmp))
            try:
                if background:
                    future = quiet_dcp(dcp.async_save, state, **kwargs)
                    future = getattr(future, "upload_completion", future)  # AsyncSaveResponse on some stagers
                else:
                    quiet_dcp(dcp.save, state, **kwargs)
            except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP raises its gathered failures
                if fault.is_comm_failure(e):
                    raise
                self._save_failed(step, tmp, e)
        if background:
            self.pending = (future, step, tmp, t0, meta)
            if self.rank == 0:
                print(
                    f"checkpoint: step {step} staged in {time.perf_counter() - t0:.2f}s, writing in the background",
                    flush=True,
                )
        else:
            self._commit(step, tmp, t0, meta)

    def _save_failed(self, step: int, tmp: Path, exc: BaseException):
        """A save that could not be written (disk full, I/O error, ...): remove its temporary folder (rank 0; DCP
        raises the failure of any rank on every rank, after all of them stopped writing) and stop the run with one
        line naming the folder and the free space. The previous checkpoint was never touched."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        newest = max(committed_checkpoints(self.folder), default=None)
        previous = f"step-{newest} is intact" if newest is not None else "there is no earlier checkpoint"
        raise CheckpointSaveError(
            f"rank {self.rank}: the checkpoint save of step {step} into '{self.folder}' failed ({_root_cause(exc)}); "
            f"{fault.free_space(self.folder)} there; removed its partial folder {tmp.name}, {previous}"
        ) from exc

    def _barrier(self, what: str) -> None:
        """A barrier that names the ranks which do not arrive within comm.timeout_seconds (instead of hanging)."""
        try:
            dist.monitored_barrier(group=self.pg, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as e:
            raise fault.CollectiveFailure(
                f"rank {self.rank}: {what} did not start on every rank: {fault.first_line(e)}"
            ) from None

    def _first_non_finite(self, named: list[tuple[str, torch.Tensor]], what: str) -> tuple[int, str] | None:
        """(rank, name) of the first tensor holding a NaN or an infinity on any rank (in rank order; None: every one
        is finite): one fused norm over this rank's tensors, one all-reduce of a flag, and the names gathered only
        when it trips."""
        from torch.distributed.tensor import DTensor

        local = fault.first_non_finite([(k, v.to_local() if isinstance(v, DTensor) else v) for k, v in named])
        flag = torch.tensor([0 if local is None else 1], dtype=torch.int32)
        if not self.distributed:
            return None if local is None else (self.rank, local)
        with self._op(f"the finite check of {what}"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.pg)
            if not flag.item():
                return None
            names = [None] * self.world_size
            dist.all_gather_object(names, local, group=self.pg)
        return next((r, n) for r, n in enumerate(names) if n is not None)

    def _check_finite(self, state: dict, step: int) -> None:
        """Before a save: refuse (one line) a state holding a non-finite value instead of replacing a good
        checkpoint with a poisoned one."""
        named = sorted(flatten({"model": state["model"], "optimizer": state["optimizer"]}).items())
        bad = self._first_non_finite(named, f"the save of step {step}")
        if bad is not None:
            raise NonFiniteStateError(
                f"not saving step {step}: the state holds non-finite values: '{bad[1]}' (rank {bad[0]}); the "
                f"previous checkpoint, if any, stays the newest"
            )

    def _poll(self) -> None:
        if self.pending is not None and self.pending[0].done():
            self._wait()

    def _wait(self) -> None:
        if self.pending is None:
            return
        future, step, tmp, t0, meta = self.pending
        self.pending = None
        with self._op(f"the background checkpoint save of step {step}"):
            try:
                future.result()
            except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001
                if fault.is_comm_failure(e):
                    raise
                self._save_failed(step, tmp, e)
        self._commit(step, tmp, t0, meta)

    def _commit(self, step: int, tmp: Path, t0: float, meta: dict) -> None:
        """Rank 0 publishes a fully written checkpoint folder by renaming it, then purges old ones.

        When DCP returns (or its future resolves), the coordinator has written ``.metadata``, which it does only
        after every rank reported its data files written: no barrier is needed before the rename.
        """
        self.last_step = step
        if self.rank != 0:
            return
        try:
            write_json(tmp / META_NAME, meta)
            if self.cfg.checksum:
                merge_checksums(tmp)
        except OSError as e:
            self._save_failed(step, tmp, e)
        final = self.folder / f"step-{step}"
        if final.exists():  # not there at the start (_tidy): another job writes into this folder
            aside = final.with_name(f"{final.name}.replaced-{self.plan.run_id}")
            os.rename(final, aside)
            print(f"checkpoint: {final} appeared while this run was training; set aside as {aside.name}", flush=True)
        os.rename(tmp, final)
        fsync_dir(self.folder)
        size = sum(f.stat().st_size for f in final.iterdir()) / 2**20
        self.saved_note = f"saved step {step} to {final} ({size:.1f} MiB) in {time.perf_counter() - t0:.2f}s"
        if not self.quiet_commit:  # the exit-signal save: the trainer's one line says it
            print(f"checkpoint: {self.saved_note}", flush=True)
        self._purge()

    def _purge(self) -> None:
        """Delete checkpoints beyond keep_latest_k (oldest first) and leftovers of killed saves."""
        run_id = self.plan.run_id
        found = committed_checkpoints(self.folder)
        if self.cfg.keep_latest_k > 0:
            for step in list(found)[: -self.cfg.keep_latest_k]:
                remove_dir(found[step], run_id)
        for p in self.folder.iterdir():
            if p.is_dir() and LEFTOVER_DIR.fullmatch(p.name) and only_ours(p):
                shutil.rmtree(p, ignore_errors=True)

    # ------------------------------------------------------------------------------------------ end
    def finish(self) -> None:
        """Wait for an async save; with export_safetensors, rank 0 writes ``<folder>/final`` from the newest one."""
        self._wait()
        if self.cfg.export_safetensors and self.rank == 0 and self.last_step is not None:
            t0 = time.perf_counter()
            out, run_id = self.folder / "final", self.plan.run_id
            new = export_hf(
                self.folder / f"step-{self.last_step}",
                out.with_name(f"final.new-{run_id}"),
                dtype=getattr(torch, self.cfg.export_dtype),
                tokenizer=self.tokenizer,
            )
            if out.exists():  # a previous run's export of an older step: replace it
                remove_dir(out, run_id)
            os.rename(new, out)
            print(
                f"checkpoint: exported step {self.last_step} in the Hugging Face format to {out} in "
                f"{time.perf_counter() - t0:.2f}s",
                flush=True,
            )
        if self.distributed:
            with self._op("the end-of-training barrier"):
                dist.barrier(group=self.pg)
