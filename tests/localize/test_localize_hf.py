"""``--module`` on modules this project did not write: transformers models (tiny float64 configs) with issue 26's
silent traps reproduced by hand, bypassing titanlike's checks, and the documented example's right plan. The three
files run one after the other in one interpreter (one transformers import)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FILES = ("hf_qwen3.py", "hf_qwen3_qk_norm_replicated.py", "hf_qwen2_fsdp_inner.py")
SCRIPT = """
import contextlib, io, json, sys
from titanlike.localize.__main__ import main
out = {}
for f in sys.argv[1:]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["--nproc", "2", "--module", f])
    out[f] = [code, buf.getvalue()]
print("RESULT " + json.dumps(out))
"""
_RESULT: dict = {}


def result(name: str) -> tuple[int, list[str]]:
    if not _RESULT:
        r = subprocess.run(
            [sys.executable, "-c", SCRIPT, *(str(HERE / f) for f in FILES)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=400,
        )
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
        _RESULT.update(json.loads(line[0][len("RESULT ") :]))
    code, text = _RESULT[str(HERE / name)]
    return code, text.splitlines()


def test_documented_example_no_divergence():
    code, lines = result("hf_qwen3.py")
    assert code == 0 and lines[0].startswith("no divergence above 1e-10 in 2 steps ("), lines


def test_qk_norm_replicated_localised():
    code, lines = result("hf_qwen3_qk_norm_replicated.py")
    assert code == 1, lines
    assert lines[0].startswith("divergence: model.layers.0.self_attn.q_norm gradient: step 1, microbatch 0, rank "), (
        lines
    )
    assert lines[1] == (
        "hint: the 2 tp ranks' gradients sum to the reference: a partial sum never reduced over tp in "
        "model.layers.0.self_attn.q_norm"
    )


def test_head_outside_fsdp_localised():
    code, lines = result("hf_qwen2_fsdp_inner.py")
    assert code == 1, lines
    assert lines[0].startswith("divergence: lm_head gradient: step 1, microbatch 0, rank "), lines
    assert (
        lines[1] == "hint: no data-parallel reduction covers lm_head.weight: each data-parallel rank steps its own copy"
    )
