"""One typed configuration tree: defaults < TOML file < command line, validated before anything is built.

Names follow torchtitan v0.2.2 where the concept matches, so a torchtitan TOML mostly carries over::

    python train.py --job.config_file configs/debug_model.toml --training.steps 100 --parallelism.tensor_parallel_degree=2

Every problem raises :class:`ConfigError` with one line that names the key and the fix; ``train.py`` prints it and
exits with code 2 before a model is built or a process group started.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad configuration: the message is one line naming the key and the fix."""


@dataclass
class Job:
    config_file: str | None = None
    dump_folder: str = "./outputs"
    description: str = "default job"  # printed at the start of the run
    print_config: bool = False  # print the full configuration (after the file and the command line) at the start


@dataclass
class Model:
    name: str = "llama3"
    flavor: str = "debugmodel"
    tokenizer: str = "test"  # "gpt2", "cl100k", "test" (2k ranks) or a path to a .tiktoken rank file
    vocab_multiple: int = 64  # pad the vocabulary to a multiple of this (keeps vocab % tp == 0 and matmuls aligned)
    tie_embeddings: bool | None = None  # None: the flavor's choice
    kernels: str = "torch"  # "torch" or "te" (Transformer Engine, CUDA only)
    # Optional overrides of the flavor's shape (0 / None = keep the flavor's value).
    dim: int = 0
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    ffn_hidden_dim: int = 0
    max_seq_len: int = 0
    rope_theta: float = 0.0
    norm_eps: float = 0.0  # RMSNorm epsilon (0: the flavor's)
    # RoPE scaling: "" (the flavor's), "none", or "llama3" (Llama 3.1+ long context) with its four parameters
    # (0: Llama 3.1's 8, 1, 4, 8192).
    rope_scaling: str = ""
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 0.0
    rope_high_freq_factor: float = 0.0
    rope_original_max_seq_len: int = 0


@dataclass
class Training:
    steps: int = 1000
    local_batch_size: int = 8
    global_batch_size: int = -1  # -1: local_batch_size x data-parallel degree (no accumulation)
    seq_len: int = 256
    seed: int = 42
    deterministic: bool = False
    dtype: str = "float32"  # float32 | bfloat16 (mixed precision over float32 master weights) | float64
    max_norm: float = 1.0  # gradient clipping by global norm; <= 0 disables clipping
    max_nonfinite_steps: int = 3  # the run stops at the N-th skipped step (non-finite loss or grad norm)
    device: str = "auto"  # auto | cpu | cuda


@dataclass
class Optimizer:
    name: str = "AdamW"
    lr: float = 8e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: str = "auto"  # auto (fused on CUDA, foreach otherwise) | fused | foreach | for-loop


@dataclass
class LRScheduler:
    # torchtitan's schedule: linear warmup -> stable -> decay over the last decay_ratio of the steps (all the steps
    # after warmup when decay_ratio is unset), for every decay type.
    warmup_steps: int = 200
    total_steps: int | None = None  # the steps the schedule spans (None: training.steps)
    decay_type: str = "linear"  # linear | sqrt | cosine | wsd (linear, decay_ratio 0.2 if unset) | constant
    decay_ratio: float | None = None  # the fraction of total_steps spent decaying at the end (None: all after warmup)
    min_lr_factor: float = 0.0  # the final learning rate as a fraction of optimizer.lr


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1  # -1: whatever is left of the world size
    fsdp_reshard_after_forward: str = "default"  # default | always | never
    tensor_parallel_degree: int = 1
    enable_sequence_parallel: bool = False
    disable_loss_parallel: bool = False
    loss_chunk_size: int = 0  # tokens per chunk of the cross entropy (0: all at once)
    context_parallel_degree: int = 1
    pipeline_parallel_degree: int = 1
    pipeline_parallel_schedule: str = "1F1B"
    pipeline_parallel_microbatch_size: int = 1
    pipeline_parallel_layers_per_stage: int = 0  # 0: one stage per rank (two for V-shaped schedules)
    pipeline_parallel_stages_per_rank: int = 0  # alternative to layers_per_stage (0: derive)
    pipeline_parallel_first_stage_less_layers: int = 0  # count the embedding as this many layers
    pipeline_parallel_last_stage_less_layers: int = 0  # count the norm + head (+ loss) as this many layers
    pipeline_parallel_module_names: list[str] = field(default_factory=list)  # by hand: "layers.0,layers.1" per stage
    gpus_per_node: int = 0  # 0: the local world size (LOCAL_WORLD_SIZE)


@dataclass
class Checkpoint:
    enable: bool = False
    folder: str = "checkpoint"  # relative to job.dump_folder unless absolute
    interval: int = 500
    keep_latest_k: int = 0  # 0: keep all
    load_step: int = -1  # -1: the newest complete checkpoint
    async_mode: str = "disabled"  # disabled | async
    initial_load_path: str = ""  # a seed / step checkpoint folder, or a Hugging Face folder (its config.json sets the
    # architecture) or .safetensors file, to start from
    create_seed_checkpoint: bool = False
    export_safetensors: bool = False  # write <folder>/final/model.safetensors + config.json at the end
    checksum: bool = False  # a CRC-32 per file, written at the commit and verified before a resume
    on_corrupt: str = "stop"  # stop | previous: a corrupted newest checkpoint stops the run or is set aside
    last_save_model_only: bool = False  # the checkpoint of the last step holds the model weights only
    export_dtype: str = "float32"  # dtype of a model-only last save and of export_safetensors


@dataclass
class Metrics:
    log_freq: int = 10
    enable_tensorboard: bool = False
    disable_color_printing: bool = False  # plain console lines (colors are used only on a terminal anyway)
    save_tb_folder: str = "tb"
    enable_jsonl: bool = True
    peak_tflops: float = 0.0  # override the peak table (dense bf16 TFLOP/s of one device)


@dataclass
class Data:
    path: str = ""  # a text file, folder of .txt, .jsonl or pre-tokenized .bin ("" = the shipped corpus)
    text_field: str = "text"
    encoding: str = "utf-8"  # of text and .jsonl files (e.g. latin-1 for a corpus that is not UTF-8)
    encoding_errors: str = "strict"  # strict (a bad byte is an error) | replace (U+FFFD) | ignore (dropped)
    val_fraction: float = 0.05
    shuffle: bool = True
    num_workers: int = 0


@dataclass
class Validation:
    enable: bool = True
    freq: int = 100
    steps: int = 4  # batches of local_batch_size per rank (-1: the whole held-out tail)


@dataclass
class ActivationCheckpoint:
    mode: str = "none"  # none | full | selective
    selective_ac_option: str = "op"  # "op" (save matmul/attention outputs) or an integer N (every N-th block)


@dataclass
class Compile:
    enable: bool = False
    backend: str = "inductor"


@dataclass
class Float8:
    # "" (off); torchao: tensorwise | rowwise | rowwise_with_gw_hp; te (model.kernels=te): delayed | current |
    # block | mxfp8
    recipe: str = ""
    backend: str = "auto"  # auto (te when model.kernels=te, else torchao) | torchao | te
    emulate: bool = False  # torchao's emulation (float8 casts, float32 GEMMs): CPU and tests, no sm_89 needed
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])  # Linear FQNs containing these stay hp
    enable_fsdp_float8_all_gather: bool = False  # FSDP2 all-gathers weights in float8 (tensorwise only)
    precompute_float8_dynamic_scale_for_fsdp: bool = False  # one all-reduce for all weight scales per step


@dataclass
class Comm:
    timeout_seconds: int = 300
    init_timeout_seconds: int = 300


@dataclass
class Profiling:
    enable_profiling: bool = False
    save_traces_folder: str = "profile_traces"
    profile_freq: int = 10
    profile_warmup: int = 3
    profile_active: int = 1
    ranks: list[int] = field(default_factory=lambda: [0])
    enable_memory_snapshot: bool = False
    save_memory_snapshot_folder: str = "memory_snapshot"


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
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    comm: Comm = field(default_factory=Comm)
    profiling: Profiling = field(default_factory=Profiling)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {
    "training.dtype": ("float32", "bfloat16", "float64"),
    "training.device": ("auto", "cpu", "cuda"),
    "optimizer.name": ("AdamW",),
    "optimizer.implementation": ("auto", "fused", "foreach", "for-loop"),
    "lr_scheduler.decay_type": ("linear", "sqrt", "cosine", "wsd", "constant"),
    "checkpoint.export_dtype": ("float32", "bfloat16", "float16"),
    "parallelism.fsdp_reshard_after_forward": ("default", "always", "never"),
    "parallelism.pipeline_parallel_schedule": ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS",
                                               "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"),
    "checkpoint.async_mode": ("disabled", "async"),
    "checkpoint.on_corrupt": ("stop", "previous"),
    "activation_checkpoint.mode": ("none", "full", "selective"),
    "model.kernels": ("torch", "te"),
    "float8.recipe": ("", "tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "current", "block", "mxfp8"),
    "float8.backend": ("auto", "torchao", "te"),
    "model.rope_scaling": ("", "none", "llama3"),
    "data.encoding_errors": ("strict", "replace", "ignore"),
}
# key -> (lowest allowed value, what it means)
MINIMUM = {
    "training.steps": 1, "training.local_batch_size": 1, "training.seq_len": 1, "training.max_nonfinite_steps": 1,
    "optimizer.lr": 0.0, "optimizer.eps": 0.0, "optimizer.weight_decay": 0.0,
    "lr_scheduler.warmup_steps": 0, "lr_scheduler.decay_ratio": 0.0, "lr_scheduler.min_lr_factor": 0.0,
    "model.vocab_multiple": 1, "model.dim": 0, "model.n_layers": 0, "model.n_heads": 0, "model.n_kv_heads": 0,
    "model.ffn_hidden_dim": 0, "model.max_seq_len": 0, "model.norm_eps": 0.0, "model.rope_scaling_factor": 0.0,
    "model.rope_low_freq_factor": 0.0, "model.rope_high_freq_factor": 0.0, "model.rope_original_max_seq_len": 0,
    "parallelism.data_parallel_replicate_degree": 1, "parallelism.tensor_parallel_degree": 1,
    "parallelism.context_parallel_degree": 1, "parallelism.pipeline_parallel_degree": 1,
    "parallelism.pipeline_parallel_microbatch_size": 1, "parallelism.pipeline_parallel_layers_per_stage": 0,
    "parallelism.pipeline_parallel_stages_per_rank": 0, "parallelism.loss_chunk_size": 0,
    "parallelism.gpus_per_node": 0,
    "checkpoint.interval": 1, "checkpoint.keep_latest_k": 0, "metrics.log_freq": 1, "validation.freq": 1,
    "validation.steps": -1, "data.num_workers": 0, "comm.timeout_seconds": 1, "comm.init_timeout_seconds": 1,
    "profiling.profile_freq": 1, "profiling.profile_warmup": 0, "profiling.profile_active": 1,
}
MAXIMUM = {"lr_scheduler.decay_ratio": 1.0, "lr_scheduler.min_lr_factor": 1.0, "data.val_fraction": 0.5,
           "optimizer.beta1": 1.0, "optimizer.beta2": 1.0}


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def _field_types(section_cls: type) -> dict[str, typing.Any]:
    return typing.get_type_hints(section_cls)


def _suggest(name: str, valid) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            type(None): "none"}.get(tp, str(tp))


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _coerce(key: str, value, tp, from_cli: bool):
    """Convert ``value`` (from TOML, or a string from the command line) to the field type ``tp``."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (from_cli and isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(key, value, args[0], from_cli)
    if origin is list:
        (item,) = typing.get_args(tp)
        if from_cli and isinstance(value, str):
            value = [v for v in (p.strip() for p in value.split(";" if item is str else ",")) if v] \
                if value.strip() else []
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
        raise ConfigError(f"unknown config section '{section}'{_suggest(section, sections)}; "
                          f"valid sections: {', '.join(sections)}")
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
        elif i + 1 < len(argv) and not (argv[i + 1].startswith("--") and len(argv[i + 1]) > 2
                                        and not argv[i + 1][2:3].isdigit()):
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
    problems = cfg._problems
    if problems:  # the values too, so that a file's every problem is in the one message
        problems = problems + value_problems(cfg)
    _raise_all(cfg, problems)
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
    if torchtitan_file:  # torchtitan's defaults where the file is silent and titanlike's default differs
        given = {k for k, _ in file_pairs} | {tt.TORCHTITAN_KEYS[k].target for k, _ in file_pairs
                                             if k in tt.TORCHTITAN_KEYS and tt.TORCHTITAN_KEYS[k].target}
        for key, value in tt.TORCHTITAN_DEFAULTS.items():
            if key not in given and key not in ("training.dtype", "parallelism.enable_sequence_parallel"):
                _set(cfg, key, value, from_cli=False)
                reading.notes.append(f"{key} = {value!r}: torchtitan's default (the file does not set it)")
        tt_dtype = dict(file_pairs).get("training.dtype", "float32")
        mixed = dict(file_pairs).get("training.mixed_precision_param", "bfloat16")
        file_pairs = [(k, v) for k, v in file_pairs if k not in ("training.dtype", "training.mixed_precision_param")]
        if tt_dtype == "bfloat16":
            problems.append("torchtitan's training.dtype = 'bfloat16' trains bf16 weights without float32 master "
                            "weights, which titanlike does not do: use training.dtype = 'float32' (torchtitan's "
                            "mixed_precision_param = 'bfloat16' is then titanlike's training.dtype = 'bfloat16')")
        elif tt_dtype != "float32":
            problems.append(f"training.dtype: '{tt_dtype}' is not a torchtitan dtype ('float32' or 'bfloat16')")
        else:
            file_pairs.append(("training.mixed_precision_param", mixed))
    _apply_pairs(cfg, file_pairs, False, reading, problems, explicit)
    cli_pairs = []
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
        cli_pairs.append((key, value))
    _apply_pairs(cfg, cli_pairs, True, reading, problems, explicit)
    if torchtitan_file and "parallelism.enable_sequence_parallel" not in explicit:
        cfg.parallelism.enable_sequence_parallel = cfg.parallelism.tensor_parallel_degree > 1
        if cfg.parallelism.enable_sequence_parallel:
            reading.notes.append("parallelism.enable_sequence_parallel = True: torchtitan shards sequences "
                                 "whenever tensor_parallel_degree > 1")
    problems += reading.problems
    for key, value in reading.settings:  # torchtitan's validation sizes: titanlike validates with the training's
        if key.startswith("_validation."):
            name = key.rpartition(".")[2]
            if value != getattr(cfg.training, name):
                problems.append(f"torchtitan's validation.{name} = {value!r}: titanlike validates with "
                                f"training.{name} ({getattr(cfg.training, name)}); remove it or make them equal")
    object.__setattr__(cfg, "notes", reading.notes)
    object.__setattr__(cfg, "_problems", problems)
    if raise_problems:
        _raise_all(cfg, problems)
    return cfg


def _raise_all(cfg: JobConfig, problems: list[str]) -> None:
    """One ConfigError line with every problem (numbered when there are several), naming the file if any."""
    if not problems:
        return
    where = cfg.job.config_file
    if len(problems) == 1:
        raise ConfigError(f"{where}: {problems[0]}" if where else problems[0])
    raise ConfigError(f"{where or 'the command line'}: {len(problems)} problems: "
                      + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1)))


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
            entry = tt.TORCHTITAN_KEYS.get(dotted)
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
                    problems.append(f"unknown config section '{section}'{_suggest(section, _sections())}; "
                                    f"valid sections: {', '.join(_sections())}")
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
        raise ConfigError(f"job.config_file: {what} '{path}' (configs live in configs/, e.g. "
                          f"configs/debug_model.toml)")
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


def value_problems(cfg: JobConfig) -> list[str]:
    """Every per-key choice and range violation, one line each."""
    out = []
    for dotted, choices in CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value not in choices:
            out.append(f"{dotted}: '{value}' is not one of {', '.join(repr(c) for c in choices)}"
                       f"{_suggest(str(value), [str(c) for c in choices])}")
    for dotted, lo in MINIMUM.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if dotted == "training.steps" and value < lo:
            if not cfg.checkpoint.create_seed_checkpoint:  # a seed checkpoint trains nothing anyway
                out.append(f"training.steps: {value} trains nothing; set training.steps >= 1 (to only write the "
                           f"initial weights use checkpoint.create_seed_checkpoint)")
        elif value is not None and value < lo:
            out.append(f"{dotted}: {value} is below the minimum {lo}")
    for dotted, hi in MAXIMUM.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value is not None and value > hi:
            out.append(f"{dotted}: {value} is above the maximum {hi}")
    return out


def validate(cfg: JobConfig, world_size: int = 1) -> None:
    """Per-key ranges and choices, then every cross-field rule; raise the first problem as a ConfigError."""
    problems = value_problems(cfg)
    if problems:
        raise ConfigError(problems[0])
    if cfg.validation.steps == 0:
        raise ConfigError("validation.steps: 0 batches validates nothing; use -1 (the whole held-out tail), a "
                          "positive count, or validation.enable = false")
    if cfg.lr_scheduler.total_steps is not None and cfg.lr_scheduler.total_steps < 1:
        raise ConfigError(f"lr_scheduler.total_steps: {cfg.lr_scheduler.total_steps} must be >= 1 (or unset: "
                          f"training.steps)")
    problems = layout_violations(cfg, world_size)
    if problems:
        raise ConfigError(problems[0])


_SHAPE_OVERRIDES = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "max_seq_len", "rope_theta",
                    "norm_eps", "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                    "rope_original_max_seq_len")


def model_args_from_config(cfg: JobConfig, vocab_size: int | None = None):
    """The flavor's args (of the spec ``model.name`` selects) with the config's overrides, the vocabulary padded to
    ``model.vocab_multiple``.

    When ``checkpoint.initial_load_path`` is a Hugging Face checkpoint with a config.json, the architecture is that
    file's instead of the flavor's (vocabulary exact, not padded); an explicit ``model.*`` override that disagrees
    with it is refused.
    """
    from titanlike.models import UnknownModelError, get_spec, pad_vocab

    try:
        spec = get_spec(cfg.model.name)
    except UnknownModelError as e:
        raise ConfigError(f"{e}{_suggest(cfg.model.name, spec_names())}") from None
    flavors = spec.flavors
    if cfg.model.flavor not in flavors:
        raise ConfigError(f"model.flavor: unknown flavor '{cfg.model.flavor}'{_suggest(cfg.model.flavor, flavors)}"
                          f"; valid for {spec.name}: {', '.join(flavors)}")
    m = cfg.model
    unread = [k for k in _SHAPE_OVERRIDES if getattr(m, k) and k not in spec.config_keys]
    if unread:
        raise ConfigError(f"model.{unread[0]}: {spec.name} has no such setting (it reads "
                          f"{', '.join('model.' + k for k in spec.config_keys)}); remove it")
    overrides = {k: getattr(m, k) for k in _SHAPE_OVERRIDES if getattr(m, k)}
    if m.tie_embeddings is not None:
        overrides["tie_embeddings"] = m.tie_embeddings
    hf_args = hf_architecture_of(cfg)
    if hf_args is not None:
        return _hf_model_args(cfg, hf_args, overrides, vocab_size)
    args = flavors[cfg.model.flavor].replace(**overrides)
    if "n_heads" in overrides and "n_kv_heads" not in overrides and args.n_kv_heads > args.n_heads:
        args = args.replace(n_kv_heads=args.n_heads)
    scaling_params = [k for k in overrides if k.startswith("rope_") and k not in ("rope_theta", "rope_scaling")]
    if getattr(args, "rope_scaling", "none") == "none" and scaling_params:
        raise ConfigError(f"model.{scaling_params[0]} is set but RoPE scaling is off; set model.rope_scaling = "
                          f"'llama3' or drop it")
    vocab = vocab_size if vocab_size is not None else args.vocab_size
    if vocab and vocab > 0:
        args = args.replace(vocab_size=pad_vocab(vocab, m.vocab_multiple))
    return args


def hf_architecture_of(cfg: JobConfig):
    """ModelArgs from the config.json of a Hugging Face ``checkpoint.initial_load_path``, else None."""
    path = cfg.checkpoint.initial_load_path
    if not path:
        return None
    from titanlike.hf import hf_architecture

    try:
        return hf_architecture(path)
    except ValueError as e:
        raise ConfigError(f"checkpoint.initial_load_path: {e}") from None


def _hf_model_args(cfg: JobConfig, hf_args, overrides: dict, vocab_size: int | None):
    from titanlike.models import spec_for

    spec = spec_for(hf_args)
    if spec is not None and spec.name != cfg.model.name:
        raise ConfigError(f"checkpoint.initial_load_path '{cfg.checkpoint.initial_load_path}' is a {spec.name} model "
                          f"(its config.json), model.name is {cfg.model.name}; set model.name = {spec.name}")
    conflicts = []
    for key, value in overrides.items():
        theirs = hf_args.hidden_dim if key == "ffn_hidden_dim" else getattr(hf_args, key)
        if value != theirs:
            conflicts.append(f"model.{key} {value} (config.json has {theirs})")
    if conflicts:
        raise ConfigError(f"checkpoint.initial_load_path '{cfg.checkpoint.initial_load_path}' sets the architecture "
                          f"from its config.json, which disagrees with {', '.join(conflicts)}; drop those model.* "
                          f"options")
    if vocab_size is not None and vocab_size > hf_args.vocab_size:
        raise ConfigError(f"model.tokenizer '{cfg.model.tokenizer}' has {vocab_size} ids but the Hugging Face model "
                          f"at '{cfg.checkpoint.initial_load_path}' only {hf_args.vocab_size}; use its tokenizer")
    return hf_args


def spec_names() -> list[str]:
    from titanlike.models import registered

    return registered()


def layout_violations(cfg: JobConfig, world_size: int, model_args=None) -> list[str]:
    """Every rule a configuration must satisfy for ``world_size`` ranks, one line (with the fix) per violation.

    Pure arithmetic: no process group, no model. Used up front by ``load_config`` and in full by the planner.
    """
    p = cfg.parallelism
    t = cfg.training
    out: list[str] = []
    try:
        args = model_args or model_args_from_config(cfg)
    except ConfigError as e:
        return [str(e)]
    # Model shape.
    if args.dim % args.n_heads:
        out.append(f"model: dim {args.dim} is not divisible by n_heads {args.n_heads}; choose n_heads dividing dim")
    if args.n_heads % args.n_kv_heads:
        out.append(f"model: n_heads {args.n_heads} is not divisible by n_kv_heads {args.n_kv_heads}; "
                   f"choose n_kv_heads dividing n_heads")
    from titanlike.models import get_spec

    out += get_spec(cfg.model.name).shape_violations(args)
    if t.seq_len > args.max_seq_len:
        out.append(f"training.seq_len {t.seq_len} exceeds the model's max_seq_len {args.max_seq_len}; "
                   f"lower training.seq_len or raise model.max_seq_len")
    # Degrees.
    tp, pp, cp, dpr = p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree, \
        p.data_parallel_replicate_degree
    dps = p.data_parallel_shard_degree
    rest = tp * pp * cp * dpr
    if dps == -1:
        if world_size % rest:
            out.append(f"parallelism: world size {world_size} is not divisible by tp {tp} x pp {pp} x cp {cp} x "
                       f"dp_replicate {dpr} = {rest}; change the degrees or the number of processes")
            dps = 1
        else:
            dps = world_size // rest
    elif dps < 1:
        out.append(f"parallelism.data_parallel_shard_degree: {dps} must be -1 (infer) or >= 1")
        dps = 1
    elif rest * dps != world_size:
        out.append(f"parallelism: pp {pp} x dp_replicate {dpr} x dp_shard {dps} x cp {cp} x tp {tp} = "
                   f"{rest * dps} != world size {world_size}; set data_parallel_shard_degree = -1 to infer it or "
                   f"change the degrees")
    if cp > 1:
        out += _context_parallel_violations(cfg, cp, tp)
    dp = dpr * dps
    # Tensor / sequence parallel.
    if tp > 1:
        if args.n_heads % tp:
            out.append(f"parallelism.tensor_parallel_degree {tp} does not divide n_heads {args.n_heads}; "
                       f"choose a tp degree dividing {args.n_heads}")
        if args.n_kv_heads % tp and args.n_kv_heads != args.n_heads:
            out.append(f"parallelism.tensor_parallel_degree {tp} does not divide n_kv_heads {args.n_kv_heads}; "
                       f"choose a tp degree dividing {args.n_kv_heads}")
        if args.hidden_dim % tp:
            out.append(f"parallelism.tensor_parallel_degree {tp} does not divide the ffn hidden size "
                       f"{args.hidden_dim}")
        if args.vocab_size > 0 and args.vocab_size % tp:
            out.append(f"parallelism.tensor_parallel_degree {tp} does not divide the vocabulary {args.vocab_size}; "
                       f"set model.vocab_multiple to a multiple of {tp}")
        if p.enable_sequence_parallel and t.seq_len % tp:
            out.append(f"training.seq_len {t.seq_len} is not divisible by tensor_parallel_degree {tp} under "
                       f"sequence parallelism; choose a multiple of {tp}")
    elif p.enable_sequence_parallel:
        out.append("parallelism.enable_sequence_parallel needs tensor_parallel_degree > 1; "
                   "turn it off or raise the tp degree")
    # Batch.
    gbs = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dp
    if gbs < 1:
        out.append(f"training.global_batch_size: {gbs} must be -1 or >= 1")
    elif gbs % (t.local_batch_size * dp):
        out.append(f"training.global_batch_size {gbs} is not divisible by local_batch_size {t.local_batch_size} x "
                   f"data-parallel degree {dp}; use a multiple of {t.local_batch_size * dp}")
    # Pipeline.
    if pp > 1:
        out += _pipeline_violations(cfg, args, pp)
    elif p.pipeline_parallel_module_names:
        out.append("parallelism.pipeline_parallel_module_names needs pipeline_parallel_degree > 1")
    if cfg.activation_checkpoint.mode == "selective":
        opt = cfg.activation_checkpoint.selective_ac_option
        if opt != "op" and not (opt.isdigit() and int(opt) >= 1):
            out.append(f"activation_checkpoint.selective_ac_option: '{opt}' must be 'op' or a positive integer")
    if cfg.model.kernels == "te" and cfg.model.name != "llama3":
        out.append(f"model.kernels=te swaps Transformer Engine modules into the Llama model only; use "
                   f"model.kernels=torch for {cfg.model.name}")
    if cfg.float8.recipe and cfg.model.name != "llama3":
        out.append(f"float8.recipe={cfg.float8.recipe}: float8 training is wired for the Llama model only; leave "
                   f"float8.recipe empty for {cfg.model.name}")
    if p.context_parallel_degree > 1 and cfg.model.name != "llama3":
        out.append(f"parallelism.context_parallel_degree {p.context_parallel_degree}: context parallelism is wired "
                   f"for the Llama model only (its attention core and RoPE positions); set cp 1 for "
                   f"{cfg.model.name}")
    out += float8_violations(cfg)
    return out


TORCHAO_FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
TE_FLOAT8_RECIPES = ("delayed", "current", "block", "mxfp8")


def float8_backend(cfg: JobConfig) -> str:
    """``float8.backend`` resolved: ``auto`` is ``te`` when ``model.kernels=te``, else ``torchao``."""
    b = cfg.float8.backend
    return ("te" if cfg.model.kernels == "te" else "torchao") if b == "auto" else b


def float8_violations(cfg: JobConfig) -> list[str]:
    """The [float8] rules (pure arithmetic; whether torchao / TE / the GPU can run it is checked by the trainer)."""
    f, out = cfg.float8, []
    if not f.recipe:
        unused = [k for k, on in (("float8.emulate", f.emulate), ("float8.backend", f.backend != "auto"),
                                  ("float8.filter_fqns", f.filter_fqns != ["output"]),
                                  ("float8.enable_fsdp_float8_all_gather", f.enable_fsdp_float8_all_gather),
                                  ("float8.precompute_float8_dynamic_scale_for_fsdp",
                                   f.precompute_float8_dynamic_scale_for_fsdp)) if on]
        if unused:
            out.append(f"{', '.join(unused)} set but float8.recipe is empty (float8 off); set float8.recipe "
                       f"(torchao: {', '.join(TORCHAO_FLOAT8_RECIPES)}) or drop {'them' if len(unused) > 1 else 'it'}")
        return out
    backend = float8_backend(cfg)
    if cfg.training.dtype == "float64":
        out.append(f"float8.recipe={f.recipe} does not combine with training.dtype=float64 (float8 GEMMs round to "
                   f"8 bits); use float32 or bfloat16, or leave float8.recipe empty")
    if backend == "torchao":
        if f.recipe not in TORCHAO_FLOAT8_RECIPES:
            out.append(f"float8.recipe={f.recipe} is a Transformer Engine recipe; with float8.backend=torchao use "
                       f"{', '.join(TORCHAO_FLOAT8_RECIPES)} (or set model.kernels=te for TE's)")
        if cfg.model.kernels != "torch":
            out.append(f"float8.backend=torchao converts nn.Linear layers, but model.kernels={cfg.model.kernels} "
                       f"replaced them; use float8.backend=te with model.kernels=te, or model.kernels=torch")
        if f.enable_fsdp_float8_all_gather and f.recipe != "tensorwise":
            out.append(f"float8.enable_fsdp_float8_all_gather needs float8.recipe=tensorwise (torchao all-gathers "
                       f"only tensorwise-scaled weights in float8), not {f.recipe}")
        if f.precompute_float8_dynamic_scale_for_fsdp and not f.enable_fsdp_float8_all_gather:
            out.append("float8.precompute_float8_dynamic_scale_for_fsdp needs "
                       "float8.enable_fsdp_float8_all_gather=true")
    else:
        if cfg.model.kernels != "te":
            out.append("float8.backend=te needs Transformer Engine kernels: set model.kernels=te (on a CUDA "
                       "machine with TE), or use float8.backend=torchao")
        if f.recipe not in TE_FLOAT8_RECIPES:
            out.append(f"float8.recipe={f.recipe} is a torchao recipe; with float8.backend=te use "
                       f"{', '.join(TE_FLOAT8_RECIPES)}")
        te_only_off = [k for k, on in (("float8.emulate", f.emulate),
                                       ("float8.filter_fqns", f.filter_fqns != ["output"]),
                                       ("float8.enable_fsdp_float8_all_gather", f.enable_fsdp_float8_all_gather),
                                       ("float8.precompute_float8_dynamic_scale_for_fsdp",
                                        f.precompute_float8_dynamic_scale_for_fsdp)) if on]
        if te_only_off:
            out.append(f"{', '.join(te_only_off)} apply to float8.backend=torchao only; unset them with "
                       f"float8.backend=te")
    return out


# Pipeline schedules whose split backward (input gradients first, weight gradients later) has not been proven with
# the context-parallel K/V reduce-scatter; the gate covers the others (tests/parallel/pipeline_gate.py).
CP_UNVERIFIED_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def _context_parallel_violations(cfg: JobConfig, cp: int, tp: int) -> list[str]:
    p, t = cfg.parallelism, cfg.training
    out = []
    if t.seq_len % (2 * cp):
        out.append(f"training.seq_len {t.seq_len} is not divisible by 2 x context_parallel_degree = {2 * cp} (each "
                   f"cp rank holds 2 of {2 * cp} load-balanced chunks); choose a multiple of {2 * cp}")
    elif p.enable_sequence_parallel and tp > 1 and (t.seq_len // cp) % tp:
        out.append(f"training.seq_len {t.seq_len}: the {t.seq_len // cp} tokens of a cp rank are not divisible by "
                   f"tensor_parallel_degree {tp} under sequence parallelism; choose a multiple of {cp * tp} and "
                   f"{2 * cp}")
    if cfg.model.kernels != "torch":
        out.append(f"parallelism.context_parallel_degree {cp}: model.kernels={cfg.model.kernels} has no "
                   f"context-parallel path (proven only with the torch kernels); set model.kernels=torch or cp 1")
    if cfg.float8.recipe:
        out.append(f"float8.recipe={cfg.float8.recipe} with context_parallel_degree {cp}: float8 training is not proven "
                   f"under context parallelism; leave float8.recipe empty or set cp 1")
    if p.pipeline_parallel_degree > 1 and p.pipeline_parallel_schedule in CP_UNVERIFIED_SCHEDULES:
        out.append(f"parallelism.pipeline_parallel_schedule {p.pipeline_parallel_schedule} is not supported with "
                   f"context parallelism (its split backward is unverified with the K/V reduce-scatter); use "
                   f"1F1B, GPipe, Interleaved1F1B or LoopedBFS")
    return out


def pipeline_stage_count(cfg: JobConfig, args) -> int:
    """Total number of pipeline stages (pp x virtual stages per rank)."""
    p = cfg.parallelism
    pp = p.pipeline_parallel_degree
    v_schedule = p.pipeline_parallel_schedule in ("ZBVZeroBubble", "DualPipeV")
    if p.pipeline_parallel_module_names:
        return len(p.pipeline_parallel_module_names)
    if p.pipeline_parallel_stages_per_rank:
        return pp * p.pipeline_parallel_stages_per_rank
    if p.pipeline_parallel_layers_per_stage:
        eff = args.n_layers + p.pipeline_parallel_first_stage_less_layers + p.pipeline_parallel_last_stage_less_layers
        return max(1, eff // p.pipeline_parallel_layers_per_stage)
    multi = p.pipeline_parallel_schedule in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
    return pp * (2 if v_schedule or multi else 1)


def _pipeline_violations(cfg: JobConfig, args, pp: int) -> list[str]:
    p, t = cfg.parallelism, cfg.training
    out = []
    sched = p.pipeline_parallel_schedule
    n_stages = pipeline_stage_count(cfg, args)
    single = sched in ("GPipe", "1F1B")
    if n_stages % pp:
        out.append(f"pipeline: {n_stages} stages do not divide evenly over pp {pp} ranks; adjust "
                   f"pipeline_parallel_layers_per_stage or pipeline_parallel_stages_per_rank")
    v = n_stages // pp if n_stages % pp == 0 else 1
    if single and v != 1:
        out.append(f"parallelism.pipeline_parallel_schedule {sched} runs one stage per rank but the split gives "
                   f"{v}; use Interleaved1F1B / LoopedBFS / InterleavedZeroBubble or fewer stages")
    if not single and sched in ("ZBVZeroBubble", "DualPipeV") and v != 2:
        out.append(f"parallelism.pipeline_parallel_schedule {sched} needs exactly 2 stages per rank (V shape), "
                   f"got {v}")
    if not single and sched not in ("ZBVZeroBubble", "DualPipeV") and v < 2:
        out.append(f"parallelism.pipeline_parallel_schedule {sched} needs at least 2 stages per rank; use "
                   f"GPipe / 1F1B or set pipeline_parallel_stages_per_rank >= 2")
    eff = args.n_layers + p.pipeline_parallel_first_stage_less_layers + p.pipeline_parallel_last_stage_less_layers
    lps = p.pipeline_parallel_layers_per_stage
    if p.pipeline_parallel_module_names:
        from titanlike.parallel.pipeline import parse_module_names

        try:
            from titanlike.models import get_spec

            parse_module_names(p.pipeline_parallel_module_names, args.n_layers, spec=get_spec(cfg.model.name))
        except ConfigError as e:
            out.append(str(e))
    else:
        if lps and (eff % lps or (p.pipeline_parallel_stages_per_rank and eff != lps * n_stages)):
            out.append(f"parallelism.pipeline_parallel_layers_per_stage {lps} does not fit {args.n_layers} layers "
                       f"(+{p.pipeline_parallel_first_stage_less_layers} for the embedding, "
                       f"+{p.pipeline_parallel_last_stage_less_layers} for the head) in {n_stages} stages; "
                       f"choose a divisor of {eff} (or drop pipeline_parallel_stages_per_rank)")
        elif eff % n_stages:
            out.append(f"pipeline: {args.n_layers} layers (+{p.pipeline_parallel_first_stage_less_layers} for the "
                       f"embedding, +{p.pipeline_parallel_last_stage_less_layers} for the head) do not split evenly "
                       f"into {n_stages} stages; change n_layers or list pipeline_parallel_module_names per stage")
        elif eff // n_stages <= max(p.pipeline_parallel_first_stage_less_layers,
                                    p.pipeline_parallel_last_stage_less_layers):
            out.append(f"pipeline: {n_stages} stages of {eff // n_stages} layers leave the first or last stage "
                       f"without a transformer block; use fewer stages")
    mbs = p.pipeline_parallel_microbatch_size
    if t.local_batch_size % mbs:
        out.append(f"training.local_batch_size {t.local_batch_size} is not divisible by "
                   f"pipeline_parallel_microbatch_size {mbs}")
    else:
        m = t.local_batch_size // mbs
        if sched not in ("GPipe",) and m < pp:
            out.append(f"pipeline: {m} microbatches (local_batch_size / pipeline_parallel_microbatch_size) are fewer "
                       f"than pp {pp} stages for {sched}; raise local_batch_size to at least {pp * mbs}")
        elif sched == "DualPipeV" and m < n_stages:
            out.append(f"pipeline: DualPipeV needs at least as many microbatches as stages ({n_stages}), got {m}; "
                       f"raise local_batch_size to at least {n_stages * mbs}")
        elif sched in ("Interleaved1F1B", "InterleavedZeroBubble") and m % max(1, m // pp):
            out.append(f"pipeline: {sched} runs the {m} microbatches in rounds of pp={pp} and needs m divisible by "
                       f"m // pp = {m // pp}; use a multiple of {pp} microbatches")
    # The zero-bubble schedules split each backward into an input-gradient and a later weight-gradient pass
    # over the same graph (retain_graph); these features assume one backward per forward.
    if sched in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        if p.fsdp_reshard_after_forward == "always":
            out.append(f"parallelism.fsdp_reshard_after_forward 'always' gives wrong gradients with {sched} (its "
                       f"weight-gradient passes run outside FSDP's hooks); use 'default' or 'never'")
        ac = cfg.activation_checkpoint
        if ac.mode == "selective" and ac.selective_ac_option == "op":
            out.append(f"activation_checkpoint: op-level selective checkpointing allows one backward per region, "
                       f"{sched} runs two; use mode 'full', selective_ac_option N (every N-th block) or another "
                       f"schedule")
        if cfg.compile.enable:
            out.append(f"compile.enable: compiled blocks allow one backward per forward, {sched} runs two; turn "
                       f"compile off or use 1F1B / Interleaved1F1B")
    return out
