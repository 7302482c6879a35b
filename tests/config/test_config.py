"""Config parsing, overrides, precedence and every error path."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from titanlike.config import ConfigError, JobConfig, load_config, model_args_from_config, parse_config
from titanlike.layout import layout_violations

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_defaults_and_shipped_configs_load():
    cfg = load_config([])
    assert isinstance(cfg, JobConfig) and cfg.training.steps == 1000
    cfg = load_config(["--job.config_file", str(ROOT / "configs/debug_model.toml")])
    assert cfg.model.flavor == "debugmodel" and cfg.training.steps == 200


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.5\n")
    cfg = load_config(["--job.config_file", path, "--training.steps", "9", "--optimizer.lr=0.25"])
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.optimizer.lr == 0.25
    assert cfg.training.local_batch_size == 8  # default
    # the config file may come after other options and still sits below them
    cfg = load_config(["--training.steps", "3", "--job.config_file", path])
    assert cfg.training.steps == 3


def test_value_forms():
    cfg = load_config(
        [
            "--training.seq_len=32",
            "--metrics.enable_tensorboard",
            "false",
            "--training.global_batch_size",
            "-1",
            "--training.local_batch_size",
            "4",
            "--profiling.ranks",
            "0,1",
            "--model.tie_embeddings",
            "true",
            "--training.dtype",
            "float64",
            "--checkpoint.enable",
        ]
    )
    assert cfg.training.seq_len == 32 and cfg.metrics.enable_tensorboard is False
    assert cfg.profiling.ranks == [0, 1] and cfg.model.tie_embeddings is True
    assert cfg.training.dtype == "float64" and cfg.checkpoint.enable is True


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.step", "5"], "unknown config key 'training.step' (did you mean 'training.steps'?)"),
        (["--trainng.steps", "5"], "unknown config section 'trainng' (did you mean 'training'?)"),
        (["--training.steps", "many"], "training.steps: expected an integer, got 'many'"),
        (["--training.steps", "-3"], "training.steps: -3 trains nothing; set training.steps >= 1"),
        (["--optimizer.lr", "fast"], "optimizer.lr: expected a number"),
        (["--training.dtype", "fp16"], "training.dtype: 'fp16' is not one of"),
        (["--lr_scheduler.decay_type", "cosin"], "did you mean 'cosine'?"),
        (["--job.config_file", "missing.toml"], "job.config_file: no such file 'missing.toml'"),
        (["--training.steps"], "--training.steps needs a value"),
        (["steps=3"], "unexpected argument 'steps=3'"),
        (["--model.flavor", "debugmodle"], "model.flavor: unknown flavor 'debugmodle' (did you mean 'debugmodel'?)"),
        (["--model.n_heads", "8", "--model.n_kv_heads", "3"], "n_heads 8 is not divisible by n_kv_heads 3"),
        (
            ["--model.dim", "100", "--model.n_heads", "8", "--model.n_kv_heads", "8"],
            "dim 100 is not divisible by n_heads 8",
        ),
        (["--training.seq_len", "4096"], "exceeds the model's max_seq_len"),
        (
            ["--training.global_batch_size", "12", "--training.local_batch_size", "8"],
            "global_batch_size 12 is not divisible by local_batch_size 8",
        ),
        (["--parallelism.enable_sequence_parallel"], "enable_sequence_parallel needs tensor_parallel_degree > 1"),
        (
            ["--float8.recipe", "current"],
            "float8.recipe=current is a Transformer Engine recipe; with float8.backend=torchao "
            "use tensorwise, rowwise, rowwise_with_gw_hp (or set model.kernels=te for TE's)",
        ),
        (
            ["--float8.recipe", "current", "--float8.backend", "te"],
            "float8.backend=te needs Transformer Engine kernels",
        ),
        (
            ["--model.name", "gtp2"],
            "model.name: unknown model 'gtp2'; registered: deepseek_v3, gpt2, gpt_oss, hf, llama3, qwen3, qwen3_moe, "
            "qwen3_next (did you mean 'gpt2'?)",
        ),
        (["--model.name", "gpt2", "--model.rope_theta", "5e5"], "model.rope_theta: gpt2 has no such setting"),
        (["--model.name", "gpt2", "--model.n_kv_heads", "2"], "model.n_kv_heads: gpt2 has no such setting"),
        (
            ["--model.name", "gpt2", "--model.flavor", "124m"],
            "unknown flavor '124m' (did you mean '124M'?); valid for gpt2",
        ),
        (
            ["--model.name", "gpt2", "--model.kernels", "te"],
            "model.kernels=te swaps Transformer Engine modules only into models that declare them "
            "(ModelSpec.te_norm), and gpt2 declares none; use model.kernels=torch for gpt2",
        ),
    ],
)
def test_errors_are_one_line_naming_the_fix(argv, message):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_model_keys_are_derived_from_the_schema_and_the_args_dataclass():
    """A model reads the [model] overrides named like a field of its args dataclass (no list to keep in step): a
    model registered the way a user writes one gets its keys, and every override some model reads."""
    import dataclasses

    from titanlike.layout.rules import model_keys_read, model_overrides
    from titanlike.models import get_spec, registered

    section = JobConfig().model
    assert model_keys_read(get_spec("gpt2"), section) == (
        "tie_embeddings",
        "dim",
        "n_layers",
        "n_heads",
        "ffn_hidden_dim",
        "max_seq_len",
        "norm_eps",
    )

    @dataclasses.dataclass
    class TinyArgs:
        dim: int = 8
        rope_theta: float = 1.0

    tiny = SimpleNamespace(args_cls=TinyArgs)
    assert model_keys_read(tiny, section) == ("dim", "rope_theta")
    read = {k for name in registered() for k in model_keys_read(get_spec(name), section)}
    overrides = {f.name for f in dataclasses.fields(section) if f.metadata}
    assert read == overrides and len(overrides) == 25  # no [model] override that no model reads
    assert model_overrides(section) == {}
    cfg = load_config(["--model.dim", "128", "--model.tie_embeddings", "false", "--model.rope_scaling", "none"])
    assert model_overrides(cfg.model) == {"tie_embeddings": False, "dim": 128, "rope_scaling": "none"}


def test_toml_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'training.stepz'"):
        load_config(["--job.config_file", write(tmp_path, "[training]\nstepz = 3\n")])
    with pytest.raises(ConfigError, match="training.steps: expected an integer, got '3'"):
        load_config(["--job.config_file", write(tmp_path, "[training]\nsteps = '3'\n")])
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(["--job.config_file", write(tmp_path, "[training\n")])
    with pytest.raises(ConfigError, match="must be a \\[section\\] table"):
        load_config(["--job.config_file", write(tmp_path, "steps = 3\n")])


def test_layout_rules_need_the_world_size():
    with pytest.raises(ConfigError, match="world size 3 is not divisible by tp 2"):
        load_config(["--parallelism.tensor_parallel_degree", "2"], world_size=3)
    with pytest.raises(ConfigError, match="!= world size 4"):
        load_config(["--parallelism.data_parallel_shard_degree", "3"], world_size=4)
    cfg = load_config(["--parallelism.tensor_parallel_degree", "2"], world_size=4)
    assert cfg.parallelism.tensor_parallel_degree == 2
    # heads vs tp, vocab vs tp, seq_len vs tp under SP: all reported at once
    cfg = load_config([])
    cfg.parallelism.tensor_parallel_degree = 8
    cfg.parallelism.enable_sequence_parallel = True
    cfg.training.seq_len = 100
    args = model_args_from_config(cfg, vocab_size=2002).replace(vocab_size=2002)
    problems = layout_violations(cfg, 8, args)
    text = "\n".join(problems)
    assert "does not divide n_kv_heads 4" in text and "vocabulary 2002" in text and "seq_len 100" in text


def test_vocab_is_padded():
    cfg = load_config(["--model.vocab_multiple", "64"])
    assert model_args_from_config(cfg, vocab_size=2002).vocab_size == 2048


def test_train_py_exits_2_with_one_line_before_anything_starts(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--training.stesp", "3", "--job.dump_folder", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2
    assert r.stderr.strip() == "error: unknown config key 'training.stesp' (did you mean 'training.steps'?)"
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_train_py_reports_every_layout_problem_in_one_line(tmp_path):
    """A layout with several problems names all of them in the one refusal line (numbered), not just the first."""
    argv = ["--model.n_kv_heads", "3", "--training.layout_invariant", "true", "--training.virtual_dp_degree", "3"]
    cfg = parse_config(argv)
    problems = layout_violations(cfg, 1, model_args_from_config(cfg))
    assert len(problems) == 3  # kv heads, a batch V does not split, V not a power of two
    r = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *argv, "--job.dump_folder", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    listed = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
    assert r.stderr.strip() == f"error: 3 problems: {listed}", r.stderr
    assert not (tmp_path / "out").exists()
