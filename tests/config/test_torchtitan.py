"""torchtitan v0.2.2 TOMLs as input: every key torchtitan defines has a fate (shared / mapped / inert / refused),
every problem of a file is reported in one line, suggestions go by meaning, torchtitan's defaults apply to a
torchtitan file, and the torchtitan-only options titanlike implements work."""

from __future__ import annotations

import json
import textwrap

import pytest

from titanlike import torchtitan as tt
from titanlike.config import ConfigError, JobConfig, _all_keys, format_config, load_config, parse_config

# torchtitan v0.2.2, torchtitan/config/job_config.py: every key with its default (None where TOML cannot say it).
V022 = {
    "job": dict(
        config_file=None,
        dump_folder="./outputs",
        description="default job",
        print_config=False,
        save_config_file=None,
        custom_config_module="",
    ),
    "profiling": dict(
        enable_profiling=False,
        save_traces_folder="profile_traces",
        profile_freq=10,
        profiler_active=1,
        profiler_warmup=3,
        enable_memory_snapshot=False,
        save_memory_snapshot_folder="memory_snapshot",
    ),
    "metrics": dict(
        log_freq=10,
        enable_tensorboard=False,
        disable_color_printing=False,
        save_tb_folder="tb",
        save_for_all_ranks=False,
        enable_wandb=False,
    ),
    "model": dict(
        name="llama3",
        flavor="debugmodel",
        hf_assets_path="./tests/assets/tokenizer",
        tokenizer_path=None,
        converters=[],
        print_after_conversion=False,
    ),
    "optimizer": dict(
        name="AdamW",
        lr=8e-4,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        implementation="fused",
        early_step_in_backward=False,
    ),
    "lr_scheduler": dict(warmup_steps=200, total_steps=None, decay_ratio=None, decay_type="linear", min_lr_factor=0.0),
    "training": dict(
        dataset="c4_test",
        dataset_path=None,
        local_batch_size=8,
        global_batch_size=-1,
        seq_len=2048,
        max_norm=1.0,
        steps=10000,
        enable_cpu_offload=False,
        dtype="float32",
        mixed_precision_param="bfloat16",
        mixed_precision_reduce="float32",
        gc_freq=50,
        gc_debug=False,
    ),
    "training.dataloader": dict(num_workers=0, persistent_workers=False, pin_memory=False, prefetch_factor=None),
    "parallelism": dict(
        data_parallel_replicate_degree=1,
        data_parallel_shard_degree=-1,
        fsdp_reshard_after_forward="default",
        tensor_parallel_degree=1,
        disable_loss_parallel=False,
        enable_async_tensor_parallel=False,
        pipeline_parallel_degree=1,
        module_fqns_per_model_part=None,
        pipeline_parallel_first_stage_less_layers=1,
        pipeline_parallel_last_stage_less_layers=1,
        pipeline_parallel_layers_per_stage=None,
        pipeline_parallel_schedule="1F1B",
        pipeline_parallel_schedule_csv="",
        pipeline_parallel_microbatch_size=1,
        pipeline_parallel_expert_parallel_overlap=True,
        context_parallel_degree=1,
        context_parallel_load_balancer="headtail",
        context_parallel_rotate_method="allgather",
        expert_parallel_degree=1,
        expert_tensor_parallel_degree=1,
        expert_parallel_comm_backend="standard",
    ),
    "checkpoint": dict(
        enable=False,
        enable_ft_dataloader_checkpoints=True,
        folder="checkpoint",
        interval=500,
        initial_load_path=None,
        initial_load_model_only=True,
        initial_load_in_hf=False,
        initial_load_in_hf_quantized=False,
        last_save_model_only=True,
        last_save_in_hf=False,
        export_dtype="float32",
        async_mode="disabled",
        keep_latest_k=10,
        load_step=-1,
        exclude_from_loading=[],
        enable_first_step_checkpoint=False,
        create_seed_checkpoint=False,
        load_only=False,
    ),
    "activation_checkpoint": dict(
        mode="selective",
        selective_ac_option="2",
        per_op_sac_force_recompute_mm_shapes_by_fqns=["moe.router.gate"],
        early_stop=False,
        memory_budget=0.5,
        visualize_memory_budget_pareto=False,
        preserve_rng_state=True,
        determinism_check="default",
        debug=False,
    ),
    "compile": dict(enable=False, components=["model", "loss"], backend="inductor"),
    "quantize.linear.float8": dict(
        enable_fsdp_float8_all_gather=False,
        precompute_float8_dynamic_scale_for_fsdp=False,
        recipe_name=None,
        filter_fqns=[],
        emulate=False,
    ),
    "quantize.linear.mx": dict(
        mxfp8_dim1_cast_kernel_choice="triton", recipe_name="mxfp8_cublas", filter_fqns=["output"]
    ),
    "quantize.grouped_mm.float8": dict(fqns=[]),
    "quantize.grouped_mm.mx": dict(recipe_name="mxfp8", fqns=[]),
    "comm": dict(
        init_timeout_seconds=300,
        train_timeout_seconds=100,
        trace_buf_size=20000,
        save_traces_folder="comm_traces",
        save_traces_file_prefix="rank_",
        mode="default",
    ),
    "memory_estimation": dict(enable=False, disable_fake_mode=False),
    "fault_tolerance": dict(
        enable=False,
        process_group="gloo",
        process_group_timeout_ms=10000,
        replica_id=0,
        group_size=0,
        min_replica_size=1,
        semi_sync_method=None,
    ),
    "experimental": dict(custom_import="", custom_args_module=""),
    "validation": dict(
        enable=False, dataset="c4_validation", dataset_path=None, local_batch_size=8, seq_len=2048, freq=10, steps=-1
    ),
    "validation.dataloader": dict(num_workers=0, persistent_workers=False, pin_memory=False, prefetch_factor=None),
    "debug": dict(seed=None, deterministic=False, deterministic_warn_only=False, moe_force_load_balance=False),
}
ALL = {f"{section}.{k}": v for section, keys in V022.items() for k, v in keys.items()}
# The keys titanlike refuses at torchtitan's default value (its shipped files set them all): hf_assets_path names
# torchtitan's test tokenizer folder, which does not exist here (a folder that holds a tokenizer.json is read).
REFUSED_AT_DEFAULT = {"model.hf_assets_path"}


def toml_of(pairs: dict) -> str:
    sections: dict[str, list[str]] = {}
    for dotted, value in pairs.items():
        section, _, key = dotted.rpartition(".")
        sections.setdefault(section, []).append(f"{key} = {json.dumps(value)}")
    return "\n".join(f"[{s}]\n" + "\n".join(lines) for s, lines in sections.items()) + "\n"


def load(tmp_path, text: str, *cli: str, world_size: int = 1) -> JobConfig:
    path = tmp_path / "tt.toml"
    path.write_text(textwrap.dedent(text))
    return load_config(["--job.config_file", str(path), *cli], world_size=world_size)


def error(tmp_path, text: str, *cli: str, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as e:
        load(tmp_path, text, *cli, world_size=world_size)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_every_v022_key_has_a_fate_and_shared_or_mapped_keys_exist_here():
    assert set(tt.TORCHTITAN_KEYS) == set(ALL)
    known = _all_keys()
    for dotted, key in tt.TORCHTITAN_KEYS.items():
        assert key.fate in (tt.SHARED, tt.MAPPED, tt.INERT, tt.REFUSED), dotted
        if key.fate == tt.SHARED:
            assert dotted in known, dotted
        if key.target is not None:
            assert key.target in known, (dotted, key.target)
        if key.fate != tt.SHARED:
            assert key.note, dotted


def test_a_file_with_every_key_at_torchtitans_default(tmp_path):
    present = {k: v for k, v in ALL.items() if v is not None and k != "job.config_file"}
    msg = error(tmp_path, toml_of(present))
    assert "model.hf_assets_path" in msg and "model.tokenizer" in msg  # the equivalent is named
    assert msg.count("torchtitan's") == len(REFUSED_AT_DEFAULT)
    # Without the refused key the file loads, with torchtitan's meaning.
    cfg = load(
        tmp_path,
        toml_of({k: v for k, v in present.items() if k not in REFUSED_AT_DEFAULT}),
        "--model.max_seq_len",
        "2048",
    )
    assert cfg.training.dtype == "bfloat16"  # mixed_precision_param
    assert cfg.comm.timeout_seconds == 100 and cfg.profiling.profile_active == 1
    assert (cfg.lr_scheduler.warmup_steps, cfg.lr_scheduler.decay_type, cfg.lr_scheduler.decay_ratio) == (
        200,
        "linear",
        None,
    )
    assert cfg.activation_checkpoint.mode == "selective" and cfg.activation_checkpoint.selective_ac_option == "2"
    assert cfg.checkpoint.last_save_model_only and cfg.checkpoint.keep_latest_k == 10
    notes = "\n".join(cfg.notes)
    for dotted, key in tt.TORCHTITAN_KEYS.items():  # each key read is accounted for: set, noted or refused
        if (
            dotted in present
            and key.fate in (tt.INERT, tt.MAPPED)
            and dotted not in REFUSED_AT_DEFAULT | {"checkpoint.async_mode"}
        ):
            assert dotted in notes, dotted


def test_inert_keys_at_values_that_would_matter_are_refused_all_at_once(tmp_path):
    bad = {
        "parallelism.expert_tensor_parallel_degree": 2,
        "fault_tolerance.semi_sync_method": "streaming_diloco",
        "checkpoint.load_only": True,
        "memory_estimation.enable": True,
        "parallelism.enable_async_tensor_parallel": True,
        "model.converters": ["float8"],
        "training.dataset": "c4",
        "validation.dataset_path": "/data/val",
        "training.gc_freq": 1,
        "compile.components": ["loss"],
        "activation_checkpoint.mode": "memory_budget",
    }
    msg = error(tmp_path, toml_of({**bad, "model.tokenizer": "test"}))
    assert msg.startswith(str(tmp_path / "tt.toml")) and f"{len(bad)} problems" in msg
    for dotted in bad:
        assert dotted in msg, dotted
    assert "model.kernels = 'te'" in msg and "data.path" in msg and "scripts/plan.py" in msg


def test_expert_parallel_degree_is_read_as_titanlikes(tmp_path):
    """torchtitan's MoE axis key is shared: a qwen3_moe job keeps its ep degree; a dense model refuses it."""
    cfg = load(tmp_path, toml_of({"model.name": "qwen3_moe", "parallelism.expert_parallel_degree": 2}), world_size=2)
    assert cfg.parallelism.expert_parallel_degree == 2
    msg = error(tmp_path, toml_of({"model.name": "llama3", "parallelism.expert_parallel_degree": 2}), world_size=2)
    assert "llama3 has no experts" in msg


def test_suggestions_by_meaning_before_spelling(tmp_path):
    def hint(key, value="1"):
        with pytest.raises(ConfigError) as e:
            load_config([f"--{key}", value], world_size=1)
        return str(e.value)

    assert "did you mean 'optimizer.lr'" in hint("training.lr", "0.1")
    assert "did you mean 'training.local_batch_size'" in hint("training.batch_size")
    assert "did you mean 'data.path'" in hint("training.datset", "x")  # torchtitan's training.dataset, misspelt
    assert "did you mean 'comm.timeout_seconds'" in hint("comm.train_timeout_second")
    assert "did you mean 'training.steps'" in hint("training.stesp")
    assert "did you mean 'training.seed'" in hint("debug.sede")  # torchtitan's debug.seed is training.seed


def test_llama3_style_files_report_every_problem_then_keep_torchtitans_meaning(tmp_path):
    common = """
        [job]
        dump_folder = "./outputs"
        description = "Llama 3 {size} training"
        [profiling]
        enable_profiling = true
        save_traces_folder = "profile_trace"
        profile_freq = 100
        [metrics]
        log_freq = 10
        enable_tensorboard = true
        save_tb_folder = "tb"
        [model]
        name = "llama3"
        flavor = "{size}"
        hf_assets_path = "./assets/hf/Llama-3.1-{size}"
        {converters}
        [optimizer]
        name = "AdamW"
        lr = 8e-5
        eps = 1e-8
        [lr_scheduler]
        warmup_steps = 600
        [training]
        local_batch_size = 2
        seq_len = 8192
        max_norm = 1.0
        steps = 3000
        dataset = "c4"
        [parallelism]
        data_parallel_replicate_degree = 1
        data_parallel_shard_degree = -1
        tensor_parallel_degree = {tp}
        enable_async_tensor_parallel = {async_tp}
        pipeline_parallel_degree = 1
        context_parallel_degree = 1
        [checkpoint]
        enable = false
        folder = "checkpoint"
        interval = 500
        last_save_model_only = true
        export_dtype = "float32"
        async_mode = "disabled"
        [activation_checkpoint]
        mode = "full"
        [compile]
        enable = true
        components = ["model", "loss"]
        [quantize.linear.float8]
        enable_fsdp_float8_all_gather = {fp8}
        precompute_float8_dynamic_scale_for_fsdp = {fp8}
        filter_fqns = ["output"]
        [validation]
        enable = false
        dataset = "c4_validation"
        freq = 500
        steps = 1200
        """
    files = {  # torchtitan's 8B / 70B / 405B files: what each must report, in one run
        "8B": (dict(tp=1, async_tp="false", fp8="false", converters=""), 2, 8),
        "70B": (dict(tp=8, async_tp="true", fp8="false", converters=""), 3, 64),
        "405B": (dict(tp=8, async_tp="true", fp8="true", converters='converters = ["float8"]'), 4, 512),
    }
    for size, (fmt, n_problems, world) in files.items():
        text = textwrap.dedent(common).format(size=size, **fmt)
        msg = error(tmp_path, text, world_size=world)
        assert f"{n_problems} problems" in msg, msg
        assert "model.hf_assets_path" in msg and "training.dataset = 'c4'" in msg
        # The user's fixes, as the messages name them: model.tokenizer, data.path, remove async TP / converters.
        fixed = (
            text.replace(f'hf_assets_path = "./assets/hf/Llama-3.1-{size}"', 'tokenizer = "cl100k"')
            .replace('dataset = "c4"\n', 'dataset_path = "data.bin"\n')
            .replace("enable_async_tensor_parallel = true", "")
            .replace('converters = ["float8"]', "")
        )
        cfg = load(tmp_path, fixed, world_size=world)
        assert cfg.job.description == f"Llama 3 {size} training"
        assert cfg.training.dtype == "bfloat16"  # torchtitan's bf16 mixed-precision parameters
        assert cfg.parallelism.enable_sequence_parallel == (fmt["tp"] > 1)  # torchtitan: SP whenever tp > 1
        assert cfg.data.path == "data.bin" and cfg.checkpoint.last_save_model_only
        assert cfg.validation.steps == 1200 and cfg.validation.enable is False
        assert any("mixed_precision_param" in n for n in cfg.notes)


def test_debug_style_file_and_command_line_torchtitan_keys(tmp_path):
    text = """
        [job]
        description = "Llama 3 debug training"
        print_config = true
        [metrics]
        log_freq = 1
        disable_color_printing = true
        [model]
        name = "llama3"
        flavor = "debugmodel"
        [lr_scheduler]
        warmup_steps = 2
        decay_ratio = 0.8
        decay_type = "linear"
        min_lr_factor = 0.0
        [training]
        local_batch_size = 8
        seq_len = 128
        steps = 10
        dataset = "c4_test"
        [parallelism]
        pipeline_parallel_schedule = "Interleaved1F1B"
        [checkpoint]
        last_save_model_only = false
        export_dtype = "float32"
        [activation_checkpoint]
        mode = "selective"
        selective_ac_option = '2'
        [validation]
        enable = false
        freq = 5
        steps = 10
        [debug]
        seed = 7
        """
    cfg = load(tmp_path, text, "--comm.train_timeout_seconds", "55", "--training.mixed_precision_param", "float32")
    assert cfg.job.print_config and cfg.metrics.disable_color_printing and cfg.lr_scheduler.decay_ratio == 0.8
    assert cfg.training.seed == 7 and cfg.comm.timeout_seconds == 55 and cfg.training.dtype == "float32"
    assert cfg.data.path == "" and not cfg.checkpoint.last_save_model_only
    assert "[lr_scheduler]" in format_config(cfg) and "decay_ratio = 0.8" in format_config(cfg)
    # torchtitan's pure-bf16 dtype has no titanlike meaning
    assert "trains bf16 weights without float32 master weights" in error(
        tmp_path, text.replace('dataset = "c4_test"', 'dataset = "c4_test"\n        dtype = "bfloat16"')
    )


def test_titanlike_configs_are_not_read_as_torchtitan_files():
    for name in ("debug_model", "llama3_8b", "llama3_405b"):
        cfg = parse_config(["--job.config_file", f"configs/{name}.toml"])
        assert cfg.notes == [], name


def test_trainer_prints_description_and_config_and_saves_the_last_step_model_only(tmp_path, capsys):
    import torch

    from titanlike.checkpoint import read_dcp_metadata, read_meta
    from titanlike.data import asset_path
    from titanlike.training.trainer import Trainer

    common = [
        "--model.flavor",
        "tiny",
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "16",
        "--data.path",
        str(asset_path("corpus", "tinyshakespeare.txt")),
        "--validation.enable",
        "false",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
    ]
    run = [
        *common,
        "--training.steps",
        "2",
        "--job.dump_folder",
        str(tmp_path / "a"),
        "--job.description",
        "a tiny run",
        "--job.print_config",
        "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype",
        "bfloat16",
        "--metrics.disable_color_printing",
    ]
    trainer = Trainer(load_config(run, world_size=1))
    trainer.train()
    out = capsys.readouterr().out
    assert "job: a tiny run" in out and "[checkpoint]" in out and "last_save_model_only = true" in out
    assert "\033[" not in out
    step1, step2 = tmp_path / "a" / "checkpoint" / "step-1", tmp_path / "a" / "checkpoint" / "step-2"
    assert read_meta(step1)["kind"] == "full" and read_meta(step2)["kind"] == "model_only"
    keys = read_dcp_metadata(step2).state_dict_metadata
    assert all(k.startswith("model.") for k in keys)
    assert {md.properties.dtype for md in keys.values()} == {torch.bfloat16}
    # the same command again would resume from it: refused, naming the way out
    with pytest.raises(ConfigError, match="model-only last save of a finished run"):
        Trainer(load_config(run, world_size=1))
    # a new run starts from it
    other = Trainer(
        load_config(
            [
                *common,
                "--training.steps",
                "1",
                "--job.dump_folder",
                str(tmp_path / "b"),
                "--checkpoint.initial_load_path",
                str(step2),
            ],
            world_size=1,
        )
    )
    other.checkpointer.load()
    final = trainer.model_parts[0].state_dict()
    loaded = other.model_parts[0].state_dict()
    assert all(torch.equal(v, final[k].to(torch.bfloat16).float()) for k, v in loaded.items())


# torchtitan v0.2.2's torchtitan/models/llama3/train_configs/debug_model.toml, as it ships.
TORCHTITAN_DEBUG_TOML = """
[job]
dump_folder = "./outputs"
description = "Llama 3 debug training"
print_config = false

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 10
enable_memory_snapshot = false
save_memory_snapshot_folder = "memory_snapshot"

[metrics]
log_freq = 1
disable_color_printing = false
enable_tensorboard = false
save_tb_folder = "tb"
enable_wandb = false

[model]
name = "llama3"
flavor = "debugmodel"
# test folder with tokenizer.json, for debug purpose only
hf_assets_path = "./tests/assets/tokenizer"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2  # lr scheduler warm up, normally 20% of the train steps
decay_ratio = 0.8  # lr scheduler decay ratio, 80% of the train steps
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = 8
seq_len = 2048
max_norm = 1.0  # grad norm clipping
steps = 10
dataset = "c4_test"  # supported datasets: c4_test (2K), c4 (177M)

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default" # default / never / always
tensor_parallel_degree = 1
enable_async_tensor_parallel = false
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "Interleaved1F1B"
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 10
last_save_model_only = false
export_dtype = "float32"
async_mode = "disabled"  # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = '2'  # 'int' = ac every positive int layer or 'op', ac based on ops policy

[compile]
enable=false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[validation]
enable = false
dataset = "c4_validation"
freq = 5
steps = 10
"""


def test_torchtitans_debug_toml_runs_with_its_hf_assets_path_tokenizer_folder(tmp_path, capsys):
    """torchtitan's debug_model.toml, unchanged, with ``--model.hf_assets_path <folder>`` on the command line: the
    command line wins before the file's ./tests/assets/tokenizer (not here) is checked, and torchtitan's seq_len
    2048 is the model's max_seq_len (the debug flavor's is 512), as torchtitan's update_from_config makes it. On
    the command line besides: the run shortened (2 steps of one sequence), float32 parameters (torchtitan's bf16
    mixed precision is slow on a CPU), a parquet file for its c4_test. Without the folder, the one line names what
    to do."""
    from data_files import documents, make_hf_tokenizer, write_parquet

    from titanlike.training.trainer import Trainer, main

    folder = make_hf_tokenizer(tmp_path / "tokenizer")
    data = write_parquet(tmp_path / "c4_test.parquet", documents(60))
    path = tmp_path / "debug_model.toml"
    path.write_text(TORCHTITAN_DEBUG_TOML)
    short = [
        "--data.path",
        str(data),
        "--training.steps",
        "2",
        "--training.local_batch_size",
        "1",
        "--training.mixed_precision_param",
        "float32",
    ]
    short += ["--job.dump_folder", str(tmp_path / "out")]
    cfg = load_config(["--job.config_file", str(path), "--model.hf_assets_path", str(folder), *short], world_size=1)
    assert cfg.model.tokenizer == str(folder) and any("model.hf_assets_path" in n for n in cfg.notes)
    assert cfg.training.seq_len == cfg.model.max_seq_len == 2048
    assert any(n.startswith("model.max_seq_len = 2048: torchtitan's") for n in cfg.notes)
    trainer = Trainer(cfg)
    assert trainer.model_args.max_seq_len == 2048 and trainer.model_parts[0].rope_cos.shape[0] == 2048
    assert trainer.tokenizer.name == "tokenizer" and (trainer.tokenizer.bos_id, trainer.tokenizer.eos_id) == (0, 1)
    losses = trainer.train()
    assert len(losses) == 2 and all(5.0 < x < 7.0 for x in losses)  # ~ln(448) at the start
    assert "config: model.hf_assets_path = " in capsys.readouterr().out
    # the command line wins for every key, a titanlike one too: model.tokenizer replaces the file's hf_assets_path
    cfg = load_config(["--job.config_file", str(path), "--model.tokenizer", "test", *short], world_size=1)
    assert cfg.model.tokenizer == "test"
    # model.max_seq_len set wins over torchtitan's meaning, and is checked against seq_len as always
    assert (
        main(
            [
                "--job.config_file",
                str(path),
                "--model.hf_assets_path",
                str(folder),
                "--model.max_seq_len",
                "512",
                *short,
            ]
        )
        == 2
    )
    assert "training.seq_len 2048 exceeds the model's max_seq_len 512" in capsys.readouterr().err
    assert main(["--job.config_file", str(path), *short]) == 2  # torchtitan's own folder is not here
    err = capsys.readouterr().err
    assert (
        "torchtitan's model.hf_assets_path = './tests/assets/tokenizer': no such folder" in err
        and "\n" not in err.strip()
    )
