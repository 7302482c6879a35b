"""The README's complete example (examples/nanogpt_parallel.py, shown in docs/parallelizing_your_own_module.md) is a
test: the documented code is the file, and the file trains on 8 ranks (pp 2 x dp 2 x tp 2, SP, FSDP, fused c_attn,
loss parallel, clipping, a checkpoint round trip) exactly like one process in float64."""

import re
from pathlib import Path

import pytest
import shared_launch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EXAMPLE = REPO / "examples" / "nanogpt_parallel.py"
TOL = 1e-10


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.S)


def test_the_documented_example_is_the_file():
    code = EXAMPLE.read_text()
    doc = (REPO / "docs" / "parallelizing_your_own_module.md").read_text()
    assert code in _python_blocks(doc), (
        "docs/parallelizing_your_own_module.md must show "
        "examples/nanogpt_parallel.py verbatim: paste the file into its code block"
    )
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Parallelizing your own module") : readme.index('## What "correct" means here')]
    assert "docs/parallelizing_your_own_module.md" in section
    blocks = _python_blocks(section)
    assert blocks and all(b in code for b in blocks), "README's example excerpt must be a verbatim part of the file"


def test_the_example_uses_the_public_api_only():
    code = EXAMPLE.read_text()
    assert "torch.distributed.pipelining" not in code
    ours = re.findall(r"^from (titanlike[\w.]*) import", code, flags=re.M)
    assert set(ours) <= {"titanlike.parallel", "titanlike.checkpoint", "titanlike.training.step"}, ours
    model = code[code.index("# ----") : code.index("# ----", code.index("# ----") + 1)]
    assert "titanlike" not in model and "permute" not in model and "index_select" not in model


@pytest.fixture(scope="module")
def result(request, tmp_path_factory):
    r = shared_launch.results("nanogpt", 8, request, tmp_path_factory)  # in the session's 8-rank launch
    print("\nnanoGPT example vs one process:", {k: v for k, v in r.items()})
    return r


def test_the_example_trains_exactly_like_one_process(result):
    r = result
    assert r["coverage"] == [] and r["checkpoint_keys_missing"] == []
    assert r["clipped"], "clipping must act on every step"
    assert r["c_attn_is_chunk_sharded"] and r["initial_weights"] == 0.0  # q|k|v order from full_tensor()
    for key in ("loss", "grad_norm", "grads", "weights", "resumed_grads", "resumed_weights", "checkpoint"):
        assert r[key] <= TOL, f"{key}: {r[key]:.1e} > {TOL}"


def test_a_plain_colwise_c_attn_is_caught(result):
    assert result["mutation_plain_colwise_loss"] > 1e-3
