"""MoE routing and balancing as model.* keys (torchtitan's names): they set the flavor's args, bad values and keys a
model does not read are one line, a Hugging Face import takes the balancing keys over its config.json (DeepSeek-V3's
bias rate is no longer fixed), and a run whose routing collapses is warned once."""

from __future__ import annotations

import pytest
import torch

from titanlike.config import load_config, model_args_from_config
from titanlike.data import asset_path
from titanlike.errors import ConfigError
from titanlike.models import get_spec
from titanlike.training.metrics import ImbalanceWatch
from titanlike.training.trainer import Trainer


def _args(*argv: str):
    return model_args_from_config(load_config(list(argv), world_size=1), 2008)


def test_routing_and_balancing_keys_set_the_flavors_args():
    flavor = get_spec("qwen3_moe").flavors["debugmodel"]
    same = _args("--model.name", "qwen3_moe")
    assert (same.score_func, same.route_norm, same.route_scale) == (
        flavor.score_func,
        flavor.route_norm,
        flavor.route_scale,
    )
    assert (same.load_balance_coeff, same.aux_loss_coeff) == (flavor.load_balance_coeff, flavor.aux_loss_coeff)
    keys = ["--model.score_func", "sigmoid", "--model.route_norm", "false", "--model.route_scale", "2.0"]
    keys += ["--model.load_balance_coeff", "0", "--model.aux_loss_coeff", "0.02"]
    args = _args("--model.name", "qwen3_moe", *keys)
    assert (args.score_func, args.route_norm, args.route_scale) == ("sigmoid", False, 2.0)
    assert (args.load_balance_coeff, args.aux_loss_coeff) == (None, 0.02)  # 0: no expert bias at all
    assert not any(k.endswith("expert_bias") for k in get_spec("qwen3_moe").build_meta(args).state_dict())
    gpt_oss = _args("--model.name", "gpt_oss", "--model.load_balance_coeff", "1e-3", "--model.aux_loss_coeff", "0.01")
    assert (gpt_oss.load_balance_coeff, gpt_oss.aux_loss_coeff) == (1e-3, 0.01)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model.route_scale", "-1"], "route_scale must be > 0, got -1.0"),
        (["--model.load_balance_coeff", "-3"], "load_balance_coeff must be > 0 or None (no bias), got -3.0"),
        (["--model.aux_loss_coeff", "-2"], "aux_loss_coeff must be >= 0, got -2.0"),
        (["--model.score_func", "relu"], "model.score_func"),
    ],
)
def test_bad_values_are_one_line(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _args("--model.name", "qwen3_moe", *argv)


def test_a_key_the_model_does_not_read_is_refused():
    with pytest.raises(ConfigError, match="model.score_func: gpt_oss has no such setting"):
        _args("--model.name", "gpt_oss", "--model.score_func", "sigmoid")
    with pytest.raises(ConfigError, match="model.route_scale: llama3 has no such setting"):
        _args("--model.route_scale", "2")


def test_a_deepseek_import_takes_the_balancing_keys_over_its_config_json(tmp_path):
    """The bias update rate of a DeepSeek-V3 import is model.load_balance_coeff (default 1e-3, the published run's);
    the routing itself (route_scale) is the checkpoint's: a disagreeing key is refused."""
    from titanlike.hf import save_hf

    spec = get_spec("deepseek_v3")
    args = spec.flavors["tiny"].replace(vocab_size=2048)
    folder = save_hf(spec.build(args).state_dict(), args, tmp_path / "hf")
    base = ["--checkpoint.initial_load_path", str(folder)]
    assert _args(*base).load_balance_coeff == 1e-3
    imported = _args(*base, "--model.load_balance_coeff", "5e-3", "--model.aux_loss_coeff", "1e-4")
    assert (imported.load_balance_coeff, imported.aux_loss_coeff) == (5e-3, 1e-4)
    with pytest.raises(ConfigError, match=r"disagrees with model.route_scale 1.0 \(config.json has 2.5\)"):
        _args(*base, "--model.route_scale", "1.0")


def test_the_imbalance_watch_warns_once_after_n_steps_in_a_row():
    watch = ImbalanceWatch(threshold=2.0, steps=3)
    even = {"loads": torch.tensor([[4, 4, 4, 4], [5, 3, 4, 4]])}
    skewed = {"loads": torch.tensor([[4, 4, 4, 4], [16, 0, 0, 0]])}  # layer 1: 4x the mean
    assert [watch.update(m, s) for s, m in enumerate([skewed, skewed, even, skewed, skewed], 1)] == [None] * 5
    line = watch.update(skewed, 6)  # the third in a row
    assert line.startswith("warning: MoE load: the busiest expert has held more than 2x the mean tokens for 3 steps")
    assert "(step 6: MoE layer 1 at 4.00x)" in line and "model.load_balance_coeff" in line
    assert watch.update(skewed, 7) is None  # once
    assert ImbalanceWatch(threshold=0.0, steps=1).update(skewed, 1) is None  # 0: never


def test_a_run_prints_the_imbalance_warning_once(tmp_path, capsys):
    argv = ["--model.name", "gpt_oss", "--model.flavor", "tiny", "--training.steps", "4", "--training.seq_len", "16"]
    argv += ["--training.local_batch_size", "2", "--data.path", str(asset_path("corpus", "tinyshakespeare.txt"))]
    argv += ["--validation.enable", "false", "--metrics.enable_tensorboard", "false", "--job.dump_folder"]
    argv += [str(tmp_path), "--metrics.moe_imbalance_warn", "1.0", "--metrics.moe_imbalance_steps", "2"]
    Trainer(load_config(argv, world_size=1)).train()
    out = capsys.readouterr().out
    assert out.count("warning: MoE load:") == 1 and "for 2 steps in a row (step 2:" in out, out
