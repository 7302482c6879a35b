"""Generation (``titanlike.generate``, ``scripts/generate.py``) against the real ``transformers`` ``generate``: greedy
tokens identical on the exported folder for every built-in model family (float32, tiny random weights), from the
Hugging Face folder and from a DCP checkpoint; batched prompts of different lengths (left padding) equal to each
prompt alone and to the uncached recompute; sampling reproducible by seed; EOS stops a row; an attention seam
without a cache is named and the model runs without one; tensor parallelism (tp2) identical to one process (the
session's shared 2-rank launch)."""

from __future__ import annotations

import pytest
import shared_launch
import torch
import transformers  # the [hf] extra, installed by CI: a missing one fails, never skips

from titanlike.checkpoint import write_seed_checkpoint
from titanlike.errors import ConfigError
from titanlike.generate import Sampling, cache_blockers, generate, load_model, sample_next
from titanlike.hf import save_hf
from titanlike.models import get_spec
from titanlike.models.decoder import AttentionCore
from titanlike.models.kv_cache import (
    CachedLatentAttention,
    CachedSoftmaxAttention,
    DecodeState,
    SequenceSeam,
    kv_cached,
)
from titanlike.models.linear_attention import CachedGatedDelta, CachedShortConv

MODELS = ("llama3", "gpt2", "qwen3", "qwen3_moe")
PROMPTS = [[5, 9, 33, 2, 7, 61], [100, 3], [8, 8, 8, 9, 10, 11, 12, 1, 77], [42]]
NEW = 10


def tiny(name: str, seed: int = 1):
    spec = get_spec(name)
    args = spec.flavors["tiny"].replace(vocab_size=256, tie_embeddings=False)  # a tiny tied model repeats its input
    torch.manual_seed(seed)
    model = spec.build(args)
    model.init_weights(seed=seed)
    with torch.no_grad():  # non-trivial norms and larger weights: varied tokens, a mis-scaled norm shows
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval(), args


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (our model, its Hugging Face folder, its DCP seed checkpoint)."""
    root = tmp_path_factory.mktemp("generate")
    out = {}
    for name in MODELS:
        model, args = tiny(name)
        hf = save_hf(model.state_dict(), args, root / f"{name}-hf")
        dcp = write_seed_checkpoint({k: v.clone() for k, v in model.state_dict().items()}, args, root / f"{name}-dcp")
        out[name] = (model, hf, dcp)
    return out


def hf_greedy(folder, prompts, new=NEW, eos=None):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    rows = []
    for p in prompts:
        x = torch.tensor([p])
        g = hf.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0
        )
        rows.append(g[0, len(p) :].tolist())
    return rows


@pytest.mark.parametrize("name", MODELS)
def test_greedy_equals_transformers_generate(name, exported):
    model, hf, dcp = exported[name]
    expected = hf_greedy(hf, PROMPTS)
    assert len({t for row in expected for t in row}) > 8, expected  # not one token repeated: a real comparison
    assert generate(model, PROMPTS, NEW) == expected  # batched, left-padded, cached
    assert generate(model, PROMPTS, NEW, use_cache=False) == expected  # each prompt alone, recomputed
    for path in (hf, dcp):  # loaded back from either format
        loaded = load_model(path)
        assert loaded.kind == ("hf" if path == hf else "dcp")
        assert generate(loaded.model, PROMPTS, NEW) == expected


def test_eos_stops_a_row_where_transformers_does(exported):
    model, hf, _ = exported["llama3"]
    free = generate(model, PROMPTS, NEW)
    eos = free[0][3]  # the 4th token of the first row: that row stops there (eos kept), the others where it occurs
    rows = generate(model, PROMPTS, NEW, eos_id=eos)
    assert rows[0] == free[0][:4]
    for row, full in zip(rows, free):
        assert row == (full[: full.index(eos) + 1] if eos in full else full)
    assert rows == hf_greedy(hf, PROMPTS, eos=eos)


def test_sampling_is_seeded_and_its_filters_hold(exported):
    model, _, _ = exported["qwen3"]
    hot = Sampling(temperature=1.5, seed=3)
    a, b = generate(model, PROMPTS, NEW, sampling=hot), generate(model, PROMPTS, NEW, sampling=hot)
    assert a == b
    assert a != generate(model, PROMPTS, NEW, sampling=Sampling(temperature=1.5, seed=4))
    greedy = generate(model, PROMPTS, NEW)
    assert a != greedy
    assert generate(model, PROMPTS, NEW, sampling=Sampling(temperature=1.5, top_k=1, seed=3)) == greedy
    assert generate(model, PROMPTS, NEW, sampling=Sampling(temperature=1.5, top_p=1e-6, seed=3)) == greedy
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(400, 1)
    picks = sample_next(logits, Sampling(temperature=1.0, top_k=2), torch.Generator().manual_seed(0))
    assert set(picks.tolist()) == {0, 1}
    p = logits[0].softmax(-1)  # top_p just above the first two tokens' mass keeps exactly three
    picks = sample_next(logits, Sampling(temperature=1.0, top_p=float(p[:2].sum()) + 1e-3), torch.Generator())
    assert set(picks.tolist()) == {0, 1, 2}
    assert set(generate(model, PROMPTS, NEW, sampling=hot, vocab_size=7)[0]) <= set(range(7))


def test_bad_requests_are_one_line_each(exported):
    model, _, _ = exported["gpt2"]
    with pytest.raises(ConfigError) as e:
        generate(model, [[1], []], 0, sampling=Sampling(temperature=-1, top_p=0))
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("temperature -1", "top_p 0", "at least one token", "max_new_tokens 0"):
        assert part in msg
    with pytest.raises(ConfigError, match="max_seq_len 256"):
        generate(model, [[1] * 250], 10)
    with pytest.raises(ConfigError, match="neither a titanlike checkpoint"):
        load_model(model_dir := "/nonexistent-folder")  # noqa: F841


class _WindowCore(AttentionCore):
    """An attention kind whose forward differs from the softmax seam's and which brings no cache."""

    def forward(self, q, k, v, mask=None):
        return super().forward(q, k, v, mask)


def test_a_seam_without_a_cache_is_named_and_generation_recomputes(exported):
    model, hf, _ = exported["llama3"]
    expected = generate(model, PROMPTS, NEW)
    assert cache_blockers(model) == []
    block = model.layers["1"].attention
    block.sdpa = _WindowCore()
    try:
        assert cache_blockers(model) == ["Attention.sdpa (_WindowCore) has no cache"]
        assert generate(model, PROMPTS, NEW) == expected  # recomputed without a cache, the same tokens
    finally:
        block.sdpa = AttentionCore()
    no_seam = "Linear calls its attention through no seam with a kv_cache method"
    assert cache_blockers(torch.nn.Linear(2, 2)) == [no_seam]


@pytest.fixture(scope="module")
def tp2(request, tmp_path_factory):
    return shared_launch.results("generate", 2, request, tmp_path_factory)


@pytest.mark.parametrize("name", ("llama3", "gpt2", "qwen3"))
def test_tp2_generates_what_one_process_does(name, tp2):
    got = tp2[name]
    assert got["sharded"], "the model was not tensor-parallel"  # a real split: heads and vocab over the two ranks
    assert got["tp_greedy"] == got["single_greedy"] and got["tp_sampled"] == got["single_sampled"]
    assert got["tp_hf_greedy"] == got["single_greedy"]  # the Hugging Face folder, distributed after a full read
    assert got["single_greedy"] != got["single_sampled"]


def test_tp2_refuses_a_model_that_needs_sequence_parallelism(tp2):
    msg = tp2["qwen3_moe_refusal"]
    assert "\n" not in msg and "qwen3_moe" in msg and "run it in one process" in msg


def test_script_prints_text_equal_to_transformers_on_the_export(tmp_path, capsys):
    """``scripts/generate.py --checkpoint <checkpoint folder> --prompt "ROMEO:"`` on a run's checkpoint (its newest
    step, the tokenizer it recorded): the greedy continuation is transformers' on the exported folder, decoded,
    printed under its own header after the prompt's; ``--plain`` prints the two as one text; ``--ignore-eos`` keeps
    every EOS generated as its text."""
    import generate as script  # scripts/generate.py

    from titanlike.checkpoint import export_hf
    from titanlike.data import build_tokenizer

    tok = build_tokenizer("test")
    spec = get_spec("llama3")
    args = spec.flavors["tiny"].replace(vocab_size=2048)
    model = spec.build(args)
    model.init_weights(seed=3)
    torch.manual_seed(
        0
    )  # the same weights every run (seeds 3 and 4 greedy-pick a padded id >= 2008, which we never do)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    meta = {"tokenizer": tok.name, "bos_id": tok.bos_id, "eos_id": tok.eos_id}
    step = write_seed_checkpoint(dict(model.state_dict()), args, tmp_path / "checkpoint" / "step-5", **meta)
    short = ["--prompt", "ROMEO:", "--max-new-tokens", "12"]
    assert script.main(["--checkpoint", str(tmp_path / "checkpoint"), *short]) == 0
    text = capsys.readouterr().out.removesuffix("\n")  # print adds one newline; a generated one stays
    hf = export_hf(step, tmp_path / "hf")
    ids = tok.encode("ROMEO:")
    (expected,) = hf_greedy(hf, [ids], new=12, eos=tok.eos_id)
    ended = expected[-1] == tok.eos_id
    continuation = tok.decode(expected[:-1] if ended else expected)
    why = "ended at EOS" if ended else "no EOS"
    assert text == f"--- prompt 1 ---\nROMEO:\n--- continuation ({len(expected)} tokens, {why}) ---\n{continuation}"
    assert continuation
    assert script.main(["--checkpoint", str(hf), "--tokenizer", "test", "--plain", *short]) == 0
    assert capsys.readouterr().out.removesuffix("\n") == "ROMEO:" + continuation
    # EOS as the model's likeliest next token: the row ends there; with --ignore-eos every EOS is printed as text
    with torch.no_grad():  # the blocks add nothing, every embedding is ones: only EOS gets a positive logit
        for name, p in model.named_parameters():
            if name.endswith(("wo.weight", "w2.weight")):
                p.zero_()
        model.tok_embeddings.weight.fill_(1.0)
        model.norm.weight.fill_(1.0)
        model.output.weight.zero_()
        model.output.weight[tok.eos_id] = 1.0
    write_seed_checkpoint(dict(model.state_dict()), args, tmp_path / "eos" / "step-1", **meta)
    eos_argv = ["--checkpoint", str(tmp_path / "eos"), "--prompt", "ROMEO:", "--max-new-tokens", "3"]
    assert script.main(eos_argv) == 0
    assert capsys.readouterr().out.endswith("--- continuation (1 tokens, ended at EOS) ---\n\n")
    assert script.main([*eos_argv, "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert out.count("<|end_of_text|>") == 3 and "(3 tokens, no EOS)" in out, out
    assert script.main(["--checkpoint", str(tmp_path / "checkpoint"), "--top-p", "2"]) == 2
    assert capsys.readouterr().err.strip() == "error: top_p 2.0 is not in (0, 1]"
    assert script.main(["--checkpoint", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert "neither a titanlike checkpoint" in capsys.readouterr().err


def test_script_names_the_unknown_token_a_tokenizer_lacks(tmp_path, capsys):
    """A tokenizer whose tokenizer.json names an unknown token its vocabulary lacks, given a prompt with a character
    outside the vocabulary: one line naming the token, exit 2 (the library raises a bare Exception)."""
    import generate as script  # scripts/generate.py
    from data_files import make_tokenizer_without_its_unknown_token

    folder = make_tokenizer_without_its_unknown_token(tmp_path / "tok")
    model, args = tiny("llama3")
    write_seed_checkpoint(dict(model.state_dict()), args, tmp_path / "step-0")
    argv = ["--checkpoint", str(tmp_path / "step-0"), "--tokenizer", str(folder), "--prompt", "ROMEO: 1"]
    capsys.readouterr()
    assert script.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "the unknown token '<unk>'" in err, err


def test_a_transformers_model_cannot_cache_says_so_and_generates_transformers_tokens(tmp_path):
    """``model.name = "hf"`` runs transformers' own attention modules (no seam): it is named as unable to cache and
    recomputes, with the tokens transformers' generate gives on its export."""
    from hf_models import hf_folder

    from titanlike.models.transformers_lm import args_from_folder

    args = args_from_folder(hf_folder("hf_qwen3"))
    torch.manual_seed(0)
    model = get_spec("hf").build(args)
    model.init_weights(seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    assert cache_blockers(model) == ["HFCausalLM calls its attention through no seam with a kv_cache method"]
    out = save_hf(model.state_dict(), args, tmp_path / "export")
    prompts = [[int(t) % 128 for t in p] for p in PROMPTS]
    expected = hf_greedy(out, prompts)
    assert len({t for row in expected for t in row}) > 8, expected
    assert generate(model.eval(), prompts, NEW) == expected


def _seam_model(name: str, flavor: str, *flags: str):
    from titanlike.config import load_config, model_args_from_config

    args = model_args_from_config(load_config(["--model.name", name, "--model.flavor", flavor, *flags]), vocab_size=64)
    model = get_spec(name).build(args).double()
    model.init_weights(seed=0)
    return model.eval()


def _full_forward_greedy(model, prompts, new: int) -> list[list[int]]:
    """Greedy by hand: the argmax of the full forward (the training seams' path) at every step, a prompt alone."""
    rows = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(new):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
            rows.append(seq[len(p) :])
    assert len({t for row in rows for t in row}) > 3, rows  # a comparison that can tell
    return rows


def _cache_after(model, steps) -> list[torch.nn.Module]:
    """The cached seams after a decode of ``steps`` (token tensors of one row) from an empty cache."""
    state = DecodeState(torch.tensor([0]))
    with kv_cached(model, state):
        caches = [m for m in model.modules() if hasattr(m, "state")]
        for step in steps:
            state.begin(step.shape[1])
            model(step)
            state.end(step.shape[1])
    return caches


def _assert_cached_logits_exact(model, prompts, follow=(11, 12, 13)):
    """The cached decode's logits of a left-padded batch (the prompt, then the ``follow`` tokens one at a time) equal
    the full forward's of each row alone, at float64 rounding: a padding token that leaks into a cache shows here
    even where the greedy tokens do not change."""
    longest = max(len(p) for p in prompts)
    state = DecodeState(torch.tensor([longest - len(p) for p in prompts]))
    tokens = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts])
    with torch.no_grad(), kv_cached(model, state):
        cached = []
        for step in [tokens, *(torch.full((len(prompts), 1), t) for t in follow)]:
            state.begin(step.shape[1])
            cached.append(model(step)[:, -1])
            state.end(step.shape[1])
    with torch.no_grad():
        for b, p in enumerate(prompts):
            full = model(torch.tensor([list(p) + list(follow)]))[0, len(p) - 1 :]
            torch.testing.assert_close(torch.stack([c[b] for c in cached]), full, rtol=0, atol=1e-12)


PROMPTS_LONG = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [5, 1, 3, 3, 2]]
STEPS = (torch.tensor([[1, 2, 3, 4, 5, 6]]), torch.tensor([[7]]))


@pytest.mark.parametrize("window", [1, 4])
def test_windowed_and_sinked_seams_cache_what_their_window_reaches(window):
    """gpt-oss's seams (a sliding window on every other layer, sinks on all) decode with a cache that keeps only the
    last ``window - 1`` keys: batched prompts of different lengths, longer than the window, give the greedy tokens
    of the full forward."""
    model = _seam_model("gpt_oss", "tiny", "--model.sliding_window", str(window))
    assert cache_blockers(model) == []
    assert generate(model, PROMPTS_LONG, 6) == _full_forward_greedy(model, PROMPTS_LONG, 6)
    _assert_cached_logits_exact(model, PROMPTS_LONG)
    caches = [m for m in _cache_after(model, STEPS) if isinstance(m, CachedSoftmaxAttention)]
    assert sorted({m.k.shape[1] for m in caches if m.window}) == [window - 1]  # the window's keys only
    assert sorted({m.k.shape[1] for m in caches if not m.window}) == [7]


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_lite"])
def test_latent_attention_caches_the_latent(flavor):
    """DeepSeek-V3's multi-head latent attention (with and without the query's low-rank path) decodes batched
    prompts with a cache of the compressed latent and the shared RoPE key (kv_lora_rank + qk_rope_head_dim numbers a
    token), giving the full forward's greedy tokens (before, its seam was not swapped: the decode attended over the
    new token only, silently)."""
    model = _seam_model("deepseek_v3", flavor)
    assert cache_blockers(model) == []
    assert generate(model, PROMPTS_LONG, 6) == _full_forward_greedy(model, PROMPTS_LONG, 6)
    _assert_cached_logits_exact(model, PROMPTS_LONG)
    a = model.args
    caches = [m for m in _cache_after(model, STEPS) if isinstance(m, CachedLatentAttention)]
    assert len(caches) == a.n_layers + a.mtp_layers  # the MTP blocks' too, never run in eval
    caches = [m for m in caches if m.latent is not None]
    assert len(caches) == a.n_layers
    assert {(m.latent.shape[1:], m.k_rope.shape[1:]) for m in caches} == {
        ((7, a.kv_lora_rank), (7, 1, a.qk_rope_head_dim))
    }


def test_linear_attention_caches_its_state():
    """Qwen3-Next's Gated DeltaNet layers decode with a fixed-size state (and the short conv's last kernel - 1
    inputs), its attention layers with the softmax cache; left padding writes nothing into a row's state, so batched
    prompts of different lengths give the full forward's greedy tokens (before, the linear seams were not swapped)."""
    model = _seam_model("qwen3_next", "tiny")
    assert cache_blockers(model) == []
    assert generate(model, PROMPTS_LONG, 6) == _full_forward_greedy(model, PROMPTS_LONG, 6)
    _assert_cached_logits_exact(model, PROMPTS_LONG)
    caches = _cache_after(model, STEPS)
    states = {tuple(m.S.shape) for m in caches if isinstance(m, CachedGatedDelta)}
    halos = {m.halo.shape[1] for m in caches if isinstance(m, CachedShortConv)}
    a = model.args
    assert states == {(1, a.linear_v_heads, a.linear_k_head_dim, a.linear_v_head_dim)}
    assert halos == {a.conv_kernel - 1}


class _NewMixer(SequenceSeam):
    """A new sequence-mixing seam that brings no cache."""

    def forward(self, x):
        return x.cumsum(1)


def test_a_sequence_seam_without_a_cache_is_a_blocker():
    """A seam kind that does not say how to cache is named (and generation recomputes), never decoded as if the
    new token were the whole sequence."""
    model = _seam_model("qwen3_next", "tiny")
    model.layers["0"].linear_attn.conv_core = _NewMixer()
    assert cache_blockers(model) == ["GatedDeltaNet.conv_core (_NewMixer) has no cache"]
