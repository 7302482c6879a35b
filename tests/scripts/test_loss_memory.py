"""The memory-lean loss measurement: on a 128k vocabulary the chunked cross entropy's peak is far below the
unchunked one (measured with fake tensors: exact allocation sizes, nothing allocated)."""

from __future__ import annotations

import loss_memory  # noqa: E402

MiB = 2**20


def test_chunked_peak_is_a_fraction_of_unchunked_on_128k_vocab(capsys):
    tokens, vocab = 2048, 128256
    logits_bytes = tokens * vocab * 2
    unchunked = loss_memory.peak_bytes(tokens, vocab, None)
    chunked = loss_memory.peak_bytes(tokens, vocab, 256)
    # At least the bf16 logits and their bf16 gradient are alive at the peak in both cases.
    assert chunked >= 2 * logits_bytes
    # Unchunked keeps float32 (tokens x vocab) tensors alive (upcast, log-softmax, gradient): several times
    # the logits; chunked only (256 x vocab) float32 working sets.
    assert unchunked >= 6 * logits_bytes
    assert chunked <= 3 * logits_bytes
    with capsys.disabled():
        print(
            f"\n[loss memory] {tokens}x{vocab} bf16: unchunked {unchunked / MiB:.0f} MiB, "
            f"chunk 256 {chunked / MiB:.0f} MiB"
        )


def test_script_prints_a_table(capsys):
    assert loss_memory.main(["--tokens", "64", "--vocab", "512", "--chunks", "none,16"]) == 0
    out = capsys.readouterr().out
    assert "64 tokens x 512 vocab" in out and "none" in out and "16" in out
