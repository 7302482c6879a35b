"""tests/localize/user_llama_cp.py with the gate's ``cp_rope_local`` (RoPE on each cp rank's local positions)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import user_llama_cp  # noqa: E402
from user_llama_cp import MESH, batch, build, parallelize  # noqa: E402, F401

user_llama_cp.PLANT = "cp_rope_local"
