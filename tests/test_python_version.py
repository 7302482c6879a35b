"""One Python requirement: README's "Requirements: Python >= X" is pyproject's ``requires-python = ">=X"``, and the
interpreter running the tests satisfies it. The README's install line takes torch's CPU build."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_and_pyproject_state_the_same_python_and_it_is_the_tested_one():
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=(\d+)\.(\d+)", requires)
    assert m, f"requires-python {requires!r} is not of the form >=X.Y"
    minimum = (int(m.group(1)), int(m.group(2)))
    readme = (REPO / "README.md").read_text()
    stated = re.findall(r"Python >= (\d+)\.(\d+)", readme)
    assert stated and {(int(a), int(b)) for a, b in stated} == {minimum}, (stated, requires)
    assert not re.findall(r"(?<!>= )Python 3\.\d+", readme), "a Python version stated another way"
    assert sys.version_info[:2] >= minimum


def test_the_readme_installs_the_cpu_build_and_the_package_with_what_the_quick_start_needs():
    first = (REPO / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first[0] == (
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && pip install -e ."
    ), first
    assert first[1].startswith("torchrun --nproc_per_node=2 train.py --job.config_file configs/debug_model.toml")
