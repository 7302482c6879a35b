"""Help texts say what the code does: convert_checkpoint.py converts every model with a Hugging Face adapter (not
"Llama weights" only), and the config schema does not call context parallelism "not implemented"."""

import inspect
import subprocess
import sys
from pathlib import Path

from titanlike.config import Parallelism
from titanlike.models import get_spec, registered

REPO = Path(__file__).resolve().parents[2]


def test_convert_checkpoint_help_names_every_model_that_converts():
    r = subprocess.run(
        [sys.executable, "scripts/convert_checkpoint.py", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "Llama" not in text, text
    converts = [n for n in registered() if get_spec(n).hf_adapter]
    assert {"llama3", "gpt2", "qwen3", "qwen3_moe"} <= set(converts)
    assert f"Models that convert (a Hugging Face adapter each): {', '.join(converts)}." in text, text


def test_the_schema_does_not_call_context_parallelism_unimplemented():
    line = next(x for x in inspect.getsource(Parallelism).splitlines() if "context_parallel_degree:" in x)
    assert "not implemented" not in line and "ranks splitting each sequence" in line, line
