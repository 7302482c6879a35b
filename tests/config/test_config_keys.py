"""Every config key is live and documented: some code reads it, it has a one-line doc, and ``train.py --help``
prints it with its default and choices. ``training.deterministic`` makes a float32 run repeat bitwise."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import torch

from titanlike.config import _field_types, _sections, config_help, field_docs, load_config

REPO = Path(__file__).resolve().parents[2]
SOURCES = [p for p in (REPO / "titanlike").rglob("*.py")] + [REPO / "train.py"]


def _code() -> dict[Path, str]:
    """Every source file, with config.py's dataclass bodies (the declarations themselves) blanked out."""
    out = {}
    for path in SOURCES:
        text = path.read_text()
        if path.name == "config.py" and path.parent.name == "titanlike":
            text = re.sub(r"@dataclass\nclass \w+:\n(?:    .*\n|\n)*", "", text)
        out[path] = text
    return out


def unread_keys(fields: dict[str, list[str]]) -> list[str]:
    """``section.key`` names no code reads: neither ``.key`` nor the string ``"key"`` appears in any file; a key
    name that several sections share also needs its section named in that file."""
    code = _code()
    names = [k for keys in fields.values() for k in keys]
    missing = []
    for section, keys in fields.items():
        for key in keys:
            pattern = re.compile(rf"\.{key}\b|[\"']{key}[\"']")
            shared = names.count(key) > 1
            if not any(
                pattern.search(text) and (not shared or re.search(rf"\b{section}\b", text)) for text in code.values()
            ):
                missing.append(f"{section}.{key}")
    return missing


def _fields() -> dict[str, list[str]]:
    return {section: list(_field_types(cls)) for section, cls in _sections().items()}


def test_every_config_key_is_read_by_some_code():
    assert unread_keys(_fields()) == []


def test_an_unread_key_is_found():
    assert unread_keys({"training": ["steps", "a_key_nobody_reads"]}) == ["training.a_key_nobody_reads"]


def test_every_key_has_a_one_line_doc_and_help_prints_it():
    text = config_help()
    for section, cls in _sections().items():
        docs = field_docs(cls)
        for key, tp in _field_types(cls).items():
            assert docs.get(key), f"{section}.{key} has no doc comment"
            assert f"--{section}.{key}  " in text
            for choice in typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else ():
                assert repr(choice) in text
    assert "default 'float32'" in text and "'bfloat16'" in text and "ZBVZeroBubble" in text


def test_train_py_help_prints_the_tree_and_exits_0(capsys):
    from titanlike.training.trainer import main  # what train.py runs

    assert main(["--help"]) == 0 and main(["--job.config_file", "x.toml", "-h"]) == 0
    assert capsys.readouterr().out == config_help() * 2


def test_deterministic_float32_runs_repeat_bitwise(tmp_path):
    from titanlike.training.trainer import Trainer

    argv = [
        "--model.flavor",
        "tiny",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "4",
        "--training.steps",
        "4",
        "--training.deterministic",
        "--training.dtype",
        "float32",
        "--validation.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.log_freq",
        "100",
    ]
    runs = []
    try:
        for i in range(2):
            cfg = load_config([*argv, "--job.dump_folder", str(tmp_path / f"run{i}")], world_size=1)
            runs.append(Trainer(cfg).train())
            assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(runs[0]) == 4 and runs[0] == runs[1]  # float equality: bitwise


def test_help_shows_one_section_and_every_help_line_is_whole(capsys):
    """``--help parallelism`` prints that section only; every comment line of every section's class body is in the
    help (a doc spread over several comment lines is printed whole, a note above a documented key before it); an
    unknown section is one line and exit 2. ``model.name`` / ``model.flavor`` list every registered model and its
    flavors."""
    import inspect

    from titanlike.models import get_spec, registered
    from titanlike.training.trainer import main

    assert main(["--help", "parallelism"]) == 0
    out = capsys.readouterr().out
    keys = re.findall(r"^  --(\w+)\.", out, re.M)
    assert keys and set(keys) == {"parallelism"}, set(keys)
    assert out == config_help("parallelism")
    assert main(["--help", "parallelsm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --help parallelsm: no such section (did you mean 'parallelism'?)"), err
    text = config_help()
    joined = " ".join(text.split())
    for section, cls in _sections().items():
        for line in inspect.getsource(cls).splitlines():
            m = re.match(r"\s+(?:\w+: [^#]*?)?#\s*(.+)$", line)
            if m and not line.strip().startswith(("name:", "flavor:")):  # those two: from the registry
                assert " ".join(m.group(1).split()) in joined, (section, m.group(1))
    for docs in (field_docs(cls) for cls in _sections().values()):
        for key, doc in docs.items():
            assert doc.count("(") == doc.count(")"), (key, doc)
    model = config_help("model")
    for name in registered():
        assert name in model.split("--model.name")[1].split("--model.flavor")[0]
        for flavor in get_spec(name).flavors:
            assert f"{flavor}" in model.split("--model.flavor")[1].split("--model.tokenizer")[0]
