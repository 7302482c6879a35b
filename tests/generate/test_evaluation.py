"""lm-eval (``titanlike.evaluation``, ``scripts/eval.py``) against lm-eval's own ``hf`` model on the exported folder:
the same accuracy and per-sample log-likelihoods within float32 tolerance on the shipped multiple-choice task,
a rolling log-likelihood task (several windows per document) and a generate_until task, all from local files; the
shipped task is what its builder writes; bad model args and unknown tasks are one line each."""

from __future__ import annotations

import json
import math

import pytest
import torch
from data_files import make_hf_tokenizer

from titanlike.errors import ConfigError
from titanlike.evaluation import TitanlikeLM, evaluate, local_tasks, task_metrics
from titanlike.generate import Sampling
from titanlike.hf import save_hf
from titanlike.models import get_spec

TOL = 2e-4  # float32 sums of log-probabilities over a few tokens; transformers' RoPE angles are float32
LIMIT = 24
MAX_LENGTH = 48  # short windows: the rolling task's documents need several


def _task_folder(root, corpus_lines: list[str]):
    """Two task YAMLs with local data_files (absolute paths), as a user writes them."""
    rows = [{"text": "\n".join(corpus_lines[i : i + 12]), "context": corpus_lines[i], "next": corpus_lines[i + 1]}
            for i in range(0, 12 * 8, 12)]  # fmt: skip
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (root / "rolling.yaml").write_text(
        "task: local_rolling\n" + common + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    (root / "gen.yaml").write_text(
        "task: local_gen\n" + common + "output_type: generate_until\ndoc_to_text: '{{context}}\n'\n"
        "doc_to_target: '{{next}}'\ngeneration_kwargs:\n  until: ['\n']\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Hugging Face folder: a tiny random Llama (exported by titanlike) + a tokenizer.json transformers reads."""
    from titanlike.data import asset_path

    root = tmp_path_factory.mktemp("eval")
    tok = make_hf_tokenizer(root / "model", vocab_size=400, save_pretrained=True)
    spec = get_spec("llama3")
    args = spec.flavors["tiny"].replace(vocab_size=400, max_seq_len=128)
    torch.manual_seed(0)
    model = spec.build(args)
    model.init_weights(seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    out = root / "model-hf"
    save_hf(model.state_dict(), args, out)
    for f in tok.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    lines = [s for s in asset_path("corpus", "tinyshakespeare.txt").read_text().splitlines()[:400] if s.strip()]
    return out, _task_folder(root, lines)


def _samples(results, task):
    """Per document, per request, the model's answer: (log-likelihood, greedy), a rolling log-likelihood, a text."""
    docs = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [[resp[0] for resp in s["resps"]] for s in docs]


def test_results_equal_lm_evals_hf_model(folder):
    from lm_eval.models.huggingface import HFLM

    path, tasks = folder
    names = ["shakespeare_next_line", "local_rolling", "local_gen"]
    ours = TitanlikeLM(checkpoint=str(path), batch_size=8, max_length=MAX_LENGTH)
    theirs = HFLM(pretrained=str(path), dtype="float32", batch_size=8, max_length=MAX_LENGTH, device="cpu")
    got = evaluate(ours, names, include=[str(tasks)], limit=LIMIT, log_samples=True)
    want = evaluate(theirs, names, include=[str(tasks)], limit=LIMIT, log_samples=True)
    for task in names:
        for a, b in zip(_samples(got, task), _samples(want, task), strict=True):
            for x, y in zip(a, b, strict=True):
                if task == "local_gen":
                    assert x == y  # the generated text
                elif task == "local_rolling":
                    assert math.isclose(x, y, abs_tol=TOL * 20), (x, y)  # a document: ~100 tokens
                else:
                    assert math.isclose(x[0], y[0], abs_tol=TOL) and x[1] == y[1], (x, y)
    mine, hers = task_metrics(got), task_metrics(want)
    assert mine.keys() == hers.keys()
    assert mine["eval/shakespeare_next_line/acc"] == hers["eval/shakespeare_next_line/acc"]
    assert mine["eval/shakespeare_next_line/acc_norm"] == hers["eval/shakespeare_next_line/acc_norm"]
    assert mine["eval/local_gen/exact_match"] == hers["eval/local_gen/exact_match"]
    assert math.isclose(
        mine["eval/local_rolling/bits_per_byte"], hers["eval/local_rolling/bits_per_byte"], rel_tol=1e-5
    )
    assert any(len(text) > 0 for doc in _samples(got, "local_gen") for text in doc)  # it generated text


def test_shipped_task_is_its_builders_output_and_listed():
    import make_next_line_task  # scripts/

    from titanlike.data import asset_path

    shipped = [json.loads(line) for line in asset_path("tasks", "shakespeare_next_line", "test.jsonl").open()]
    assert shipped == make_next_line_task.build()
    assert len(shipped) == 100 and all(len(r["choices"]) == 4 and 0 <= r["label"] < 4 for r in shipped)
    assert {r["label"] for r in shipped} == {0, 1, 2, 3}
    assert local_tasks() == ["shakespeare_next_line"]


def test_bad_model_args_and_unknown_tasks_are_one_line(folder):
    path, _ = folder
    with pytest.raises(ConfigError, match=r"unknown model_args \['pretrained'\]"):
        TitanlikeLM(checkpoint=str(path), pretrained="x")
    with pytest.raises(ConfigError, match="not both"):
        TitanlikeLM()
    with pytest.raises(ConfigError, match="batch_size 'auto': give a positive number"):
        TitanlikeLM(checkpoint=str(path), batch_size="auto")
    from titanlike.evaluation import _sampling

    with pytest.raises(ConfigError, match=r"generation_kwargs \['repetition_penalty'\] are not supported"):
        _sampling({"do_sample": True, "repetition_penalty": 1.1})
    assert _sampling({"do_sample": False, "temperature": 0.0}).temperature == 0
    assert _sampling({"do_sample": True, "temperature": 0.7, "top_p": 0.9}) == Sampling(0.7, 0, 0.9, 0)
    lm = TitanlikeLM(checkpoint=str(path))
    with pytest.raises(ConfigError, match=r"unknown task\(s\) \['hellaswag_local'\]; local tasks here: shakespeare"):
        evaluate(lm, ["hellaswag_local"])


def _hf_tokenizer_of_test(folder) -> None:
    """tokenizer.json + tokenizer_config.json of the shipped "test" tokenizer in ``folder`` (transformers' tiktoken
    converter: the same ids), so that lm-eval's hf model reads the exported folder of a run that used it."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from titanlike.data import asset_path, build_tokenizer
    from titanlike.data.tokenizer import LLAMA3_PATTERN

    tok = build_tokenizer("test")
    specials = [t for t, _ in sorted(tok.special_tokens.items(), key=lambda kv: kv[1])]
    converted = TikTokenConverter(
        vocab_file=str(asset_path("tokenizers", "test_2k.tiktoken")),
        pattern=LLAMA3_PATTERN,
        extra_special_tokens=specials,
    ).converted()
    text = asset_path("corpus", "tinyshakespeare.txt").read_text()[:5000]
    assert converted.encode(text, add_special_tokens=False).ids == tok.encode(text)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=converted, eos_token="<|end_of_text|>", bos_token="<|begin_of_text|>"
    )
    fast.save_pretrained(str(folder))


def test_script_on_a_run_checkpoint_prints_the_accuracy_of_lm_evals_hf_model_on_its_export(tmp_path, capsys):
    """``scripts/eval.py --checkpoint <a run's checkpoint folder> --tasks shakespeare_next_line``, the tokenizer the
    run recorded ("test"), against lm-eval's hf model on the folder export_hf writes of it."""
    import eval as script  # scripts/eval.py
    from lm_eval.models.huggingface import HFLM

    from titanlike.checkpoint import export_hf, write_seed_checkpoint
    from titanlike.data import build_tokenizer

    tok = build_tokenizer("test")
    spec = get_spec("llama3")
    args = spec.flavors["tiny"].replace(vocab_size=2048, max_seq_len=64)
    model = spec.build(args)
    model.init_weights(seed=5)
    meta = {"tokenizer": tok.name, "bos_id": tok.bos_id, "eos_id": tok.eos_id}
    step = write_seed_checkpoint(dict(model.state_dict()), args, tmp_path / "checkpoint" / "step-3", **meta)
    argv = ["--checkpoint", str(tmp_path / "checkpoint"), "--tasks", "shakespeare_next_line", "--limit", str(LIMIT)]
    assert script.main([*argv, "--output", str(tmp_path / "r.json")]) == 0
    lines = dict(line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.startswith("shakespeare"))
    hf = export_hf(step, tmp_path / "hf")
    _hf_tokenizer_of_test(hf)
    theirs = HFLM(pretrained=str(hf), dtype="float32", batch_size=8, device="cpu", add_bos_token=False)
    want = task_metrics(evaluate(theirs, ["shakespeare_next_line"], limit=LIMIT))
    assert float(lines["acc"]) == round(want["eval/shakespeare_next_line/acc"], 4)
    assert float(lines["acc_norm"]) == round(want["eval/shakespeare_next_line/acc_norm"], 4)
    saved = json.loads((tmp_path / "r.json").read_text())["shakespeare_next_line"]
    assert saved["acc,none"] == want["eval/shakespeare_next_line/acc"]
    capsys.readouterr()
    assert script.main(["--checkpoint", str(tmp_path / "checkpoint"), "--tasks", "x", "--model_args", "bogus=1"]) == 2
    assert capsys.readouterr().err.startswith("error: titanlike LM: unknown model_args ['bogus']")


def test_script_without_lm_eval_is_one_line_naming_the_extra(monkeypatch, capsys):
    """lm-evaluation-harness not installed (simulated: its import fails as a missing module's does): scripts/eval.py
    prints one line naming the eval extra and exits 2, before any checkpoint is read."""
    import sys

    import eval as script  # scripts/eval.py

    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval...` raises ModuleNotFoundError
    assert script.main(["--checkpoint", "nowhere", "--tasks", "shakespeare_next_line"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: scripts/eval.py needs lm-evaluation-harness") and "\n" not in err, err
    assert "pip install -e '.[eval]'" in err
