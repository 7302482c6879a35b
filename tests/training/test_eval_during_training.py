"""The [eval] section: lm-eval tasks every eval.freq steps on the training layout (tp2 + sequence parallelism, two
ranks), logged to the console, metrics.jsonl and (rank 0 only) the wandb run, equal to scoring the same step's
checkpoint in one process; the layouts and inputs it cannot run on are refused before anything starts."""

from __future__ import annotations

import json
import sys

import pytest
from dist_utils import TESTS, run_script

from titanlike.config import load_config
from titanlike.training.eval_tasks import eval_problems
from titanlike.training.trainer import main

EVAL = ["--eval.enable", "--eval.tasks", "shakespeare_next_line"]


def test_tp2_sp_run_logs_what_one_process_scores_on_its_checkpoint(tmp_path):
    out = tmp_path / "eval.json"
    r = run_script(TESTS / "training" / "eval_train_worker.py", str(out), timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    got = json.loads(out.read_text())
    evals = {row["step"]: row for row in got["rows"] if "eval/shakespeare_next_line/acc" in row}
    assert sorted(evals) == [2, 4]
    for key, value in got["single"].items():
        assert evals[4][key] == pytest.approx(value, abs=1e-9), key
    assert "eval  shakespeare_next_line/acc " in got["console"]
    (logged,) = got["wandb"].values()  # one wandb run: rank 0's
    for step in (2, 4):
        assert {k: v for k, v in logged[str(step)].items() if k.startswith("eval/")} == {
            k: v for k, v in evals[step].items() if k.startswith("eval/")
        }


def _problems(*argv: str) -> list[str]:
    return eval_problems(load_config([*EVAL, *argv]))


def test_layouts_and_inputs_it_cannot_run_on_are_refused_each_in_a_line(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # the layouts below are of two ranks
    assert _problems() == [] and eval_problems(load_config([])) == []
    assert "pipeline parallelism (pp 2)" in _problems("--parallelism.pipeline_parallel_degree", "2")[0]
    assert "context parallelism (cp 2)" in _problems("--parallelism.context_parallel_degree", "2")[0]
    (bad,) = _problems("--eval.tasks", "nope")
    assert bad == "eval.tasks: unknown task(s) ['nope']; local tasks: shakespeare_next_line"
    (tasks,) = eval_problems(load_config(["--eval.enable"]))
    assert tasks.startswith("eval.tasks is empty")
    gen = tmp_path / "tasks"
    gen.mkdir()
    (gen / "g.yaml").write_text(
        "task: local_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: /x.jsonl\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{a}}'\ndoc_to_target: '{{b}}'\n"
    )
    sp = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel"]
    (msg,) = _problems("--eval.tasks", "local_gen", "--eval.include", str(gen), *sp)
    assert "['local_gen'] generate text, which sequence parallelism cannot" in msg
    assert _problems("--eval.tasks", "local_gen", "--eval.include", str(gen)) == []
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    assert _problems() == ["eval.enable: lm-evaluation-harness is not installed; pip install 'titanlike[eval]'"]


def test_a_refusal_exits_2_in_one_line_before_anything_is_written(tmp_path, capsys):
    dump = tmp_path / "run"
    argv = [*EVAL, "--eval.tasks", "nope", "--model.flavor", "tiny", "--model.tokenizer", "test"]
    assert main([*argv, "--job.dump_folder", str(dump)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: eval.tasks: unknown task(s) ['nope']; local tasks: shakespeare_next_line"
    assert not dump.exists()
