"""Activation offload: exact gradients (float64), each block's saved tensors prefetched back when the backward reaches
the block after it, the host copies released once brought back, nothing left on the host after the backward."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

import titanlike.parallel.activation_offload as ao
from titanlike.config import ActivationCheckpoint
from titanlike.models.llama import FLAVORS, Transformer
from titanlike.parallel.activation_checkpoint import apply_ac


def _model(n_layers=4) -> Transformer:
    torch.manual_seed(0)
    args = FLAVORS["tiny"].replace(vocab_size=64, n_layers=n_layers)
    model = Transformer(args).to(torch.float64)
    model.init_weights()
    return model


def _tokens(seed=1):
    return torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(seed))


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


class _Trace:
    """Logs the offload's fetches and unpacks, and keeps weak references to every host copy, by block."""

    def __init__(self, monkeypatch):
        self.events: list[tuple[str, str]] = []
        self.hosts: dict[str, list[weakref.ref]] = {}
        self.live_at_unpack: list[tuple[str, set[str]]] = []
        self.prefetched: list[bool] = []
        self.params_kept = 0
        pack, fetch, unpack = ao.pack_to_host, ao._fetch, ao._unpack

        def traced_pack(tensor):
            saved = pack(tensor)
            if isinstance(tensor, torch.nn.Parameter):  # a weight: kept as it is, not copied
                assert saved is tensor
                self.params_kept += 1
                return saved
            self.hosts.setdefault(saved.block, []).append(weakref.ref(saved.host))
            return saved

        def traced_fetch(rec):
            self.events.append(("fetch", rec.block))
            fetch(rec)

        def traced_unpack(saved):
            if isinstance(saved, torch.Tensor):
                return unpack(saved)
            self.events.append(("unpack", saved.block))
            self.prefetched.append(saved.on_device is not None)
            self.live_at_unpack.append((saved.block, self.live()))
            return unpack(saved)

        monkeypatch.setattr(ao, "pack_to_host", traced_pack)
        monkeypatch.setattr(ao, "_fetch", traced_fetch)
        monkeypatch.setattr(ao, "_unpack", traced_unpack)

    def live(self) -> set[str]:
        """The blocks that still hold a host copy."""
        return {b for b, refs in self.hosts.items() if any(r() is not None for r in refs)}

    def backward_order(self) -> list[tuple[str, str]]:
        """The events with each run of unpacks of one block folded into one."""
        out = []
        for e in self.events:
            if not out or e != out[-1] or e[0] != "unpack":
                out.append(e)
        return out


@pytest.mark.parametrize("ac", [None, ("selective", "2")])
def test_offload_gradients_equal_no_offload(ac):
    ref = _model()
    model = copy.deepcopy(ref)
    if ac is not None:
        apply_ac(model, ActivationCheckpoint(mode=ac[0], selective_ac_option=ac[1]))
        apply_ac(ref, ActivationCheckpoint(mode=ac[0], selective_ac_option=ac[1]))
    done = ao.apply_activation_offload(model)
    assert done == (["0", "1", "2", "3"] if ac is None else ["1", "3"])
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for _ in range(2):  # a second step: the records of the first are gone, nothing stale
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
        want = _loss(ref, _tokens())
        want.backward()
        got = _loss(model, _tokens())
        got.backward()
        assert got.item() == want.item()
        g_ref, g = _grads(ref), _grads(model)
        assert all(torch.equal(g[n], g_ref[n]) for n in g_ref)


def test_each_block_prefetched_when_the_backward_reaches_the_next(monkeypatch):
    model = _model()
    ao.apply_activation_offload(model)
    trace = _Trace(monkeypatch)
    loss = _loss(model, _tokens())
    assert trace.events == [] and trace.live() == {"0", "1", "2", "3"}  # the forward keeps every copy on the host
    assert trace.params_kept > 0  # the blocks' weights, saved by their matmuls, are not copied
    loss.backward()
    # the last block's hook brings back its own tensors and block 2's; each next hook the block before
    assert trace.backward_order() == [
        ("fetch", "3"),
        ("fetch", "2"),
        ("unpack", "3"),
        ("fetch", "1"),
        ("unpack", "2"),
        ("fetch", "0"),
        ("unpack", "1"),
        ("unpack", "0"),
    ]
    assert trace.prefetched and all(trace.prefetched)  # every unpack found its tensor on the device
    for block, live in trace.live_at_unpack:
        # block b runs with blocks b and b - 1 brought back (their host copies released), the earlier ones still
        # on the host
        assert live == {str(i) for i in range(int(block) - 1)}, (block, live)
    assert trace.live() == set()  # nothing left on the host after the backward


def test_with_ac_the_previous_offloaded_block_is_prefetched(monkeypatch):
    model = _model()
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="2"))
    ao.apply_activation_offload(model)  # blocks 1 and 3; 0 and 2 checkpointed
    trace = _Trace(monkeypatch)
    _loss(model, _tokens()).backward()
    assert trace.backward_order() == [("fetch", "3"), ("fetch", "1"), ("unpack", "3"), ("unpack", "1")]
    assert all(trace.prefetched) and trace.live() == set()


def test_each_forward_keeps_its_own_records(monkeypatch):
    """Two forwards in flight (pipeline microbatches), the second backward first: each backward brings back its own
    forward's tensors only, and the gradients are those of the two losses."""
    ref = _model()
    model = copy.deepcopy(ref)
    ao.apply_activation_offload(model)
    (_loss(ref, _tokens(1)) + _loss(ref, _tokens(2))).backward()
    trace = _Trace(monkeypatch)
    first, second = _loss(model, _tokens(1)), _loss(model, _tokens(2))
    second.backward()
    assert [e for e in trace.events if e[0] == "fetch"] == [("fetch", b) for b in "3210"]
    assert trace.live() == {"0", "1", "2", "3"}  # the first forward's copies still on the host
    first.backward()
    assert [e for e in trace.events if e[0] == "fetch"] == [("fetch", b) for b in "32103210"]
    assert all(trace.prefetched) and trace.live() == set()
    g_ref, g = _grads(ref), _grads(model)
    assert all(torch.allclose(g[n], g_ref[n], rtol=0, atol=1e-14) for n in g_ref)


def test_retain_graph_unpacks_the_same_tensor_twice():
    ref = _model(2)
    model = copy.deepcopy(ref)
    ao.apply_activation_offload(model)
    want = _loss(ref, _tokens())
    want.backward(retain_graph=True)
    want.backward()
    got = _loss(model, _tokens())
    got.backward(retain_graph=True)
    got.backward()
    g_ref, g = _grads(ref), _grads(model)
    assert all(torch.equal(g[n], g_ref[n]) for n in g_ref)


def test_evaluation_saves_nothing(monkeypatch):
    model = _model(2)
    ao.apply_activation_offload(model)
    trace = _Trace(monkeypatch)
    with torch.no_grad():
        model(_tokens()[:, :-1])
    assert trace.hosts == {} and trace.events == []
