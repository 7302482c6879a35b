"""Hugging Face tokenizers: token ids identical to transformers' tokenizer for the same folder (built with the
tokenizers library, saved by save_pretrained), BOS/EOS from tokenizer_config.json / config.json as transformers
takes them, special-token strings in a document encoded as plain text, the folder accepted wherever a tokenizer is
(model.tokenizer, a .bin's sidecar told apart by the tokenizer.json's content)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from data_files import BOS, EOS, documents, make_hf_tokenizer, make_tokenizer_without_its_unknown_token

from titanlike.data import (
    HFTokenizer,
    asset_path,
    build_tokenizer,
    load_token_stream,
    open_token_file,
    write_token_file,
)

TEXTS = [
    *documents(6, seed=1),
    "  tabs\tand\r\nCRLF  \n\n  ",
    f"a {EOS} inside a document, and {BOS} too",
    "ünïcödé → 漢字 🙂",
    "",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        "saved": make_hf_tokenizer(root / "saved", save_pretrained=True),
        # BOS / EOS named by tokenizer_config.json only (torchtitan's test folder is like that): added at new ids
        "config_only": make_hf_tokenizer(root / "config_only", eos_in_tokenizer_json=False, save_pretrained=True),
    }


def test_ids_equal_transformers_for_the_same_folder(folders):
    from transformers import AutoTokenizer

    for name, folder in folders.items():
        ours = build_tokenizer(str(folder))
        theirs = AutoTokenizer.from_pretrained(str(folder))
        split = AutoTokenizer.from_pretrained(str(folder), split_special_tokens=True)
        assert isinstance(ours, HFTokenizer), name
        assert (ours.bos_id, ours.eos_id, ours.vocab_size) == (theirs.bos_token_id, theirs.eos_token_id, len(theirs))
        for text in TEXTS:
            # special-token strings in data are plain text: transformers' split_special_tokens=True
            assert ours.encode(text) == split(text, add_special_tokens=False)["input_ids"], (name, text)
            if BOS not in text and EOS not in text:
                assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"], (name, text)
            assert ours.decode(ours.encode(text)) == text
        assert ours.encode_batch(TEXTS, eos=True) == [ours.encode(t, eos=True) for t in TEXTS]
        # with BOS, as transformers' template adds it (tokenizer.json's post-processor)
        if name == "saved":
            assert ours.encode(TEXTS[0], bos=True) == theirs(TEXTS[0])["input_ids"]


def test_bos_eos_from_tokenizer_config_or_config_json(tmp_path, folders):
    saved = build_tokenizer(str(folders["saved"]))
    assert (saved.bos_id, saved.eos_id, saved.sources) == (
        0,
        1,
        {"bos": "tokenizer_config.json", "eos": "tokenizer_config.json"},
    )
    only = build_tokenizer(str(folders["config_only"] / "tokenizer.json"))  # the file itself names the folder too
    assert (only.bos_id, only.eos_id, only.vocab_size) == (400, 401, 402)
    # no tokens named in tokenizer_config.json: config.json's ids (the first of a list)
    folder = make_hf_tokenizer(tmp_path / "cj", config_json={"bos_token_id": 0, "eos_token_id": [1, 2]})
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if "_token" not in k}))
    tok = build_tokenizer(str(folder))
    assert (tok.bos_id, tok.eos_id, tok.sources) == (0, 1, {"bos": "config.json", "eos": "config.json"})
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match="names no eos token .* add eos_token to tokenizer_config.json"):
        build_tokenizer(str(folder))


def test_bad_folders_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="holds no tokenizer.json"):
        build_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .*tokenizer.json with the tokenizers library"):
        build_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="its pattern is in tokenizer.json"):
        build_tokenizer(str(tmp_path), pattern=r"\w+")


def test_a_tokenizer_without_its_unknown_token_is_one_line_in_encode_and_in_train(tmp_path, capsys):
    """tokenizer.json names an unknown token its vocabulary lacks: encoding a character outside the vocabulary is
    one ValueError naming the token (the library raises a bare Exception), and train.py exits 2 with that line."""
    from titanlike.training.trainer import main

    folder = make_tokenizer_without_its_unknown_token(tmp_path / "tok")
    tok = build_tokenizer(str(folder))
    assert tok.encode("ab") == [0, 1]
    for encode in (lambda: tok.encode("ROMEO: 1"), lambda: tok.encode_batch(["ab", "c, d"])):
        with pytest.raises(ValueError, match="the unknown token '<unk>' that its tokenizer.json names is not in"):
            encode()
    argv = ["--model.flavor", "tiny", "--model.tokenizer", str(folder), "--training.steps", "1"]
    argv += ["--job.dump_folder", str(tmp_path / "run"), "--metrics.enable_tensorboard", "false", "--data.path"]
    argv += [str(asset_path("corpus", "tinyshakespeare.txt"))]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "'<unk>'" in err, err


def test_a_bin_records_the_tokenizer_json_it_was_made_with(tmp_path, folders):
    """Two folders with the same name but different tokenizer.json: a .bin of one is refused under the other."""
    tok = build_tokenizer(str(folders["saved"]))
    other = build_tokenizer(str(make_hf_tokenizer(tmp_path / "x" / "saved", vocab_size=380)))
    assert tok.name == other.name == "saved" and tok.fingerprint != other.fingerprint
    (tmp_path / "a.txt").write_text(TEXTS[0])
    ids = load_token_stream(tmp_path / "a.txt", tok)
    assert ids.tolist() == tok.encode(TEXTS[0], eos=True)
    write_token_file([ids], tmp_path / "a.bin", tok)
    assert np.array_equal(open_token_file(tmp_path / "a.bin", tok), ids)
    with pytest.raises(ValueError, match=f"tokenizer.json sha256 {tok.fingerprint}.* sha256 {other.fingerprint}"):
        open_token_file(tmp_path / "a.bin", other)
    # pickles (preprocessing workers, loader workers) with the same behaviour
    again = pickle.loads(pickle.dumps(tok))
    assert again.encode(TEXTS[-3]) == tok.encode(TEXTS[-3])
