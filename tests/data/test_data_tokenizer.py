import random

import pytest

from titanlike.data import TOKENIZER_NAMES, asset_path, build_tokenizer


@pytest.fixture(scope="module", params=TOKENIZER_NAMES)
def tok(request):
    return build_tokenizer(request.param)


def _excerpts() -> list[str]:
    shakespeare = asset_path("corpus", "tinyshakespeare.txt").read_text(encoding="utf-8")
    ball = asset_path("corpus", "gutenberg", "chesterton-ball.txt").read_text(encoding="utf-8")
    moby = asset_path("corpus", "gutenberg", "melville-moby_dick.txt").read_bytes().decode("utf-8")
    i = ball.index("Brunetière")
    return [
        shakespeare[:3000],
        ball[i - 500 : i + 500],
        moby[10000:13000],
        "  tabs\tand\r\nCRLF  \n\n  ",
        "ünïcödé → 漢字 🙂",
    ]


def test_round_trip_on_corpus_excerpts(tok):
    for text in _excerpts():
        ids = tok.encode(text)
        assert ids and all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(_excerpts()) == [tok.encode(t) for t in _excerpts()]


def test_round_trip_random_unicode():
    tok = build_tokenizer("test")
    rng = random.Random(0)
    alphabet = "abc XYZ 019 \n\t.,'!é漢🙂<|>"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize(
    "name, vocab, eos, bos, specials",
    [
        ("gpt2", 50257, 50256, None, {"<|endoftext|>": 50256}),
        (
            "cl100k",
            100277,
            100257,
            None,
            {
                "<|endoftext|>": 100257,
                "<|fim_prefix|>": 100258,
                "<|fim_middle|>": 100259,
                "<|fim_suffix|>": 100260,
                "<|endofprompt|>": 100276,
            },
        ),
        (
            "test",
            2008,
            2000,
            2001,
            {
                "<|end_of_text|>": 2000,
                "<|begin_of_text|>": 2001,
                **{f"<|reserved_special_token_{i}|>": 2002 + i for i in range(6)},
            },
        ),
    ],
)
def test_special_token_ids(name, vocab, eos, bos, specials):
    tok = build_tokenizer(name)
    assert (tok.name, tok.vocab_size, tok.eos_id, tok.bos_id, tok.special_tokens) == (name, vocab, eos, bos, specials)
    ids = tok.encode("Hello world", bos=bos is not None, eos=True)
    assert ids[-1] == eos and (bos is None or ids[0] == bos)
    assert tok.decode(ids[:-1]).endswith("Hello world")


def test_known_ids():
    assert build_tokenizer("gpt2").encode("Hello world") == [15496, 995]
    assert build_tokenizer("cl100k").encode("Hello world") == [9906, 1917]


def test_special_strings_in_text_are_plain_text(tok):
    for special in tok.special_tokens:
        text = f"before {special} after"
        ids = tok.encode(text)
        assert not set(ids) & set(tok.special_tokens.values())
        assert tok.decode(ids) == text


def test_bos_without_bos_token_is_an_error():
    with pytest.raises(ValueError, match="no bos token"):
        build_tokenizer("gpt2").encode("x", bos=True)


def test_rank_file_path_defaults_match_test_tokenizer():
    by_path = build_tokenizer(str(asset_path("tokenizers", "test_2k.tiktoken")))
    by_name = build_tokenizer("test")
    assert by_path.name == "test_2k"
    assert (by_path.vocab_size, by_path.eos_id, by_path.bos_id) == (2008, 2000, 2001)
    text = _excerpts()[0]
    assert by_path.encode(text) == by_name.encode(text)


def test_rank_file_eos_is_first_id_after_ranks():
    tok = build_tokenizer(str(asset_path("tokenizers", "r50k_base.tiktoken")))
    assert (tok.eos_id, tok.bos_id, tok.vocab_size) == (50256, 50257, 50264)
    assert tok.encode("Hello world") == [15496, 995]  # the Llama-3 pattern splits this text like GPT-2's


def test_explicit_pattern():
    path = str(asset_path("tokenizers", "test_2k.tiktoken"))
    per_char = build_tokenizer(path, pattern=r"[\s\S]")
    text = "hello world, 12345"
    assert len(per_char.encode(text)) == len(text)  # every pre-token is one ASCII byte
    assert len(build_tokenizer(path).encode(text)) < len(text)


def test_unknown_name_or_missing_file():
    with pytest.raises(ValueError, match=r"neither a known name \(gpt2, cl100k, test\)"):
        build_tokenizer("llama3")
    with pytest.raises(ValueError, match="nor an existing .tiktoken rank file"):
        build_tokenizer("/no/such/file.tiktoken")


@pytest.mark.parametrize("content", ["not base64 at all\n", "", "aGVsbG8= notanumber\n"])
def test_malformed_rank_file(tmp_path, content):
    bad = tmp_path / "bad.tiktoken"
    bad.write_text(content)
    with pytest.raises(ValueError, match="rank file"):
        build_tokenizer(str(bad))
