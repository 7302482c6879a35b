"""Score a titanlike checkpoint (any layout) or a Hugging Face folder on lm-evaluation-harness tasks from local files.

    python scripts/eval.py --checkpoint outputs/debug/checkpoint --tasks shakespeare_next_line
    python scripts/eval.py --checkpoint outputs/debug/hf --tasks my_task --include my_tasks/ --limit 100 \
        --model_args batch_size=16,max_length=512 --output results.json

The model is lm-eval's ``titanlike`` LM (``titanlike.evaluation.TitanlikeLM``; ``--model_args`` are its keyword
arguments: tokenizer, dtype, batch_size, max_length, max_gen_toks, add_bos_token, device). Tasks are the shipped
ones (``shakespeare_next_line``) and the task YAMLs of the ``--include`` folders, whose data are local files; no
download is ever made. Prints one line per task and metric; bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlike.errors import ConfigError  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a step-N folder, a checkpoint folder or a HF folder")
    ap.add_argument("--tasks", required=True, help="comma-separated task names")
    ap.add_argument("--include", action="append", default=[], help="a folder of task YAMLs (repeatable)")
    ap.add_argument("--model_args", default="", help="key=value,... for the titanlike LM")
    ap.add_argument("--limit", type=int, default=None, help="at most this many documents per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=None, help="write lm-eval's results (JSON) here")
    return ap.parse_args(argv)


def _lm_eval_missing() -> str | None:
    """The one line that names the extra when lm-evaluation-harness is not installed, else None."""
    try:
        import lm_eval.utils  # noqa: F401
    except ModuleNotFoundError as e:
        return (
            f"scripts/eval.py needs lm-evaluation-harness ({e}); install the eval extra: "
            f"pip install -e '.[eval]' (or pip install 'titanlike[eval]')"
        )
    return None


def run(a: argparse.Namespace) -> dict:
    missing = _lm_eval_missing()
    if missing:
        raise ConfigError(missing)
    from lm_eval.utils import simple_parse_args_string

    from titanlike.evaluation import TitanlikeLM, evaluate

    for folder in a.include:
        if not Path(folder).is_dir():
            raise ConfigError(f"--include '{folder}' is not a folder of task YAMLs")
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    lm = TitanlikeLM(checkpoint=a.checkpoint, **simple_parse_args_string(a.model_args))
    return evaluate(lm, tasks, include=a.include, limit=a.limit, seed=a.seed)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    try:
        results = run(a)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    from titanlike.evaluation import task_metrics

    for key, value in task_metrics(results).items():
        _, task, metric = key.split("/", 2)
        print(f"{task:32s} {metric:16s} {value:.4f}", flush=True)
    if a.output:
        Path(a.output).write_text(json.dumps(results["results"], indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
