"""``python -m titanlike.localize --module``: a user's decoder (tests/localize/user_decoder.py) under tp 2, the right
plan (exit 0) and two wrong ones for the attention output projection (exit 1 naming it in forward), bad input
(exit 2 before any rank starts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def localize(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titanlike.localize", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_right_plan_no_divergence():
    r = localize("--nproc", "2", "--module", str(HERE / "user_decoder.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("no divergence above 1e-10 in 2 steps"), r.stdout
    compared = int(r.stdout.split("(")[1].split()[0])
    assert compared > 300, r.stdout  # every module's outputs and input gradients, every gradient and weight, 2 ranks


def test_o_proj_colwise_named_in_forward():
    """ColwiseParallel on o_proj: its input is this rank's heads, not the replicated stream; the step raises in
    o_proj's forward (DTensor's shape check), reported as the divergence there."""
    r = localize("--nproc", "2", "--module", str(HERE / "user_decoder_o_proj_colwise.py"))
    assert r.returncode == 1, r.stdout + r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("divergence: blocks.0.attn.o_proj forward: step 1, microbatch 0, rank "), first
    assert "raised RuntimeError" in first and first.endswith("(input local [4, 8, 16], weight tp: S(0) [32, 32])"), (
        first
    )
    assert r.stdout.splitlines()[1] == (
        "hint: its input holds 1/2 of its 32 in-features (this rank's share, e.g. its heads), but its weight is split "
        "column-wise (Shard(0)), which needs the whole input: plan it row-wise (RowwiseParallel), the partner of a "
        "column-wise module before it"
    )


def test_o_proj_partial_never_reduced():
    """o_proj row-wise with its output left Partial (transformers' local_rowwise without the parent's gather): the
    first divergence is o_proj's forward output, the hint names the Partial(sum) never reduced."""
    r = localize("--nproc", "2", "--module", str(HERE / "user_decoder_o_proj_partial.py"))
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("divergence: blocks.0.attn.o_proj forward: step 1, microbatch 0, rank "), lines[0]
    assert "placement local (inside the module: tp: Partial(sum)); 0 collectives in this module" in lines[0]
    assert lines[1] == (
        "hint: blocks.0.attn.o_proj's output placement tp: Partial(sum) was never reduced (0 all-reduce in this "
        "module) before it became a local tensor"
    ), lines[1]
    assert lines[2] == "next divergent points:"
    assert "blocks.0.attn (output 0; local)" in lines[4]  # the table: the block's attention right after it


def test_bad_module_file_exit_2(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("MESH = {'tp': 4}\ndef build():\n    pass\n")
    r = localize("--nproc", "2", "--module", str(f))
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.strip() == (
        f"error: --module {f}: define parallelize(); --module {f}: define batch(); --module {f}: MESH {{'tp': 4}} "
        "has 4 ranks, --nproc is 2: make them equal"
    )
    r = localize("--nproc", "2", "--module", str(tmp_path / "missing.py"))
    assert r.returncode == 2 and "no such file" in r.stderr


# the --module files asking for pp and cp mesh dims, run one after the other in one interpreter
MESH_FILES = (
    "user_nanogpt_pp.py",
    "user_nanogpt_pp_tied_not_summed.py",
    "user_llama_cp.py",
    "user_llama_cp_rope_local.py",
)
MESH_SCRIPT = """
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
_MESH_RESULT: dict = {}


def mesh_result(name: str) -> tuple[int, str]:
    if not _MESH_RESULT:
        files = [str(HERE / f) for f in MESH_FILES]
        r = subprocess.run(
            [sys.executable, "-c", MESH_SCRIPT, *files], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
        _MESH_RESULT.update({Path(k).name: v for k, v in json.loads(line[0][len("RESULT ") :]).items()})
    return tuple(_MESH_RESULT[name])


def _compared(text: str) -> int:
    return int(text.split("(")[1].split()[0])


def test_user_pipeline_tied_weight():
    """A user's pipeline (``MESH = {"pp": 2}``, ``pipeline_module`` returned by ``parallelize``): NanoGPT split over
    2 stages trains like one device; with the pipeline gate's ``pp_tied_not_summed`` planted, the first point is the
    tied weight's gradient on the first stage (``wte``), the last stage's copy (``lm_head``) right after it."""
    code, text = mesh_result("user_nanogpt_pp.py")
    assert code == 0 and text.startswith("no divergence above 1e-10 in 2 steps ("), text
    assert _compared(text) > 500, text  # both stages' modules, every microbatch, every parameter
    code, text = mesh_result("user_nanogpt_pp_tied_not_summed.py")
    lines = text.splitlines()
    assert code == 1, text
    assert lines[0].startswith("divergence: wte gradient: step 1, microbatch 0, rank 0: max |diff| "), lines[0]
    assert "lm_head (weight; local)" in lines[3], text


def test_user_context_parallel():
    """``MESH = {"cp": 2}``: the localiser cuts the batch into each rank's load-balanced chunks; titanlike's Llama
    under the user's apply_cp + FSDP over the cp ranks trains like one device; with the gate's ``cp_rope_local``
    planted, the first point is the attention core's forward, the hint naming the attention's own code (RoPE)."""
    code, text = mesh_result("user_llama_cp.py")
    assert code == 0 and text.startswith("no divergence above 1e-10 in 2 steps ("), text
    assert _compared(text) > 300, text
    code, text = mesh_result("user_llama_cp_rope_local.py")
    lines = text.splitlines()
    assert code == 1, text
    assert lines[0].startswith("divergence: layers.0.attention.sdpa forward: step 1, microbatch 0, rank 1: "), lines[0]
    assert lines[1].startswith("hint: layers.0.attention.sdpa's input 0 already differs (max |diff| "), lines[1]
    assert lines[1].endswith("in layers.0.attention's forward code around its submodules"), lines[1]
