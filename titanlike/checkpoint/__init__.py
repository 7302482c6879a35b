"""Checkpoints that survive anything: DCP save/load, atomic commits, resume under any layout, seed checkpoints.

What a checkpoint holds (one DCP state dict, keyed by the plain model's FQNs):

* ``model.<fqn>``: every parameter, from all model parts (pipeline stages) of all ranks. DTensor shards (FSDP, TP)
  are saved as shards of the full tensor, so a checkpoint loads under any other layout, or in one process;
* ``optimizer.state.<fqn>.exp_avg`` ... : AdamW, flattened by FQN (``flatten_optimizer_state_dict``) so it reshards
  the same way;
* ``train.*``: step, tokens seen, non-finite step count, the data position (a *global* sample index, valid for any
  data-parallel degree) and the LR scheduler;
* ``rng.rank<r>.*``: each rank's torch RNG state, restored only when the world size is unchanged.

The modules, each one job:

* :mod:`~titanlike.checkpoint.files`: the folder on disk (step folders, the commit marker, atomic writes and
  removals, leftovers of killed saves, the size check of DCP's data files);
* :mod:`~titanlike.checkpoint.meta`: ``checkpoint.json`` (what a checkpoint says about itself);
* :mod:`~titanlike.checkpoint.checksums`: a CRC32C of every entry, computed while it is written and verified while
  it is read;
* :mod:`~titanlike.checkpoint.parts`: any module's state under the plain model's names (``save_parts`` /
  ``load_parts``, the view over pipeline stages, the one-process reader, the model and tie checks);
* :mod:`~titanlike.checkpoint.export`: weights held by one process as a seed checkpoint or a Hugging Face folder;
* :mod:`~titanlike.checkpoint.manager`: :class:`CheckpointManager`, the trainer's saves and resumes, and the
  :class:`ResumePlan` it decides at the start.
"""

from titanlike.checkpoint.checksums import (
    CHECKSUMS_NAME,
    ChecksummingWriter,
    Checksums,
    CorruptCheckpointError,
    VerifyingReader,
    file_digest,
    load_verified,
    read_checksums,
    tensor_digest,
    verify_checksums,
)
from titanlike.checkpoint.export import export_hf, resolve_step, write_seed_checkpoint
from titanlike.checkpoint.files import (
    check_writable,
    checkpoint_folder,
    committed_checkpoints,
    read_dcp_metadata,
)
from titanlike.checkpoint.manager import CheckpointManager, CheckpointSaveError, NonFiniteStateError, ResumePlan
from titanlike.checkpoint.meta import (
    FORMAT,
    META_NAME,
    model_args_of,
    read_meta,
    recorded_tokenizer,
    tokenizer_meta,
)
from titanlike.checkpoint.parts import (
    ModelPartsView,
    check_model_fits,
    load_parts,
    merged_model,
    read_model_state_dict,
    save_parts,
    tied_pairs,
)

__all__ = [
    "CHECKSUMS_NAME",
    "FORMAT",
    "META_NAME",
    "CheckpointManager",
    "CheckpointSaveError",
    "Checksums",
    "ChecksummingWriter",
    "CorruptCheckpointError",
    "ModelPartsView",
    "NonFiniteStateError",
    "ResumePlan",
    "VerifyingReader",
    "check_model_fits",
    "check_writable",
    "checkpoint_folder",
    "committed_checkpoints",
    "export_hf",
    "file_digest",
    "load_verified",
    "load_parts",
    "merged_model",
    "model_args_of",
    "read_checksums",
    "read_dcp_metadata",
    "read_meta",
    "read_model_state_dict",
    "resolve_step",
    "save_parts",
    "tensor_digest",
    "tied_pairs",
    "recorded_tokenizer",
    "tokenizer_meta",
    "verify_checksums",
    "write_seed_checkpoint",
]
