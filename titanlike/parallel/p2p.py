"""Point-to-point exchanges a compiled block can hold: two opaque custom ops.

:func:`exchange_start` posts the sends of ``tensors`` to global rank ``send_to`` and as many receives from
``recv_from`` over ``group`` (one ``batch_isend_irecv``); :func:`exchange_wait` waits for them and returns what
arrived (contiguous tensors shaped as what was sent). The compute between the two overlaps the transfer where the
backend is asynchronous.

Why custom ops: dynamo traces ``batch_isend_irecv`` only behind the experimental
``TORCHDYNAMO_ENABLE_P2P_COMPILATION`` (torch 2.13) and breaks the graph otherwise (an error under
``fullgraph=True``). Traced (the ring attention's autograd function inside a compiled block,
``titanlike.parallel.ring_attention``), the exchange is a ``torch.library`` custom op, one opaque node of the graph
(its fake implementation gives the shapes), posting it and returning a token, and a second one waiting for it;
eager code posts the same exchange directly. Every rank of the group must run the same exchanges in the same order,
as with any collective.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["exchange_start", "exchange_wait"]

# the exchanges posted and not yet waited for: token -> (the works, the tensors sent, the receive buffers)
_IN_FLIGHT: dict[int, tuple[list, list[Tensor], list[Tensor]]] = {}
_TOKENS = itertools.count()


def _buffer_like(t: Tensor) -> Tensor:
    """A receive buffer: contiguous whatever the strides of what was sent (the real and the fake op agree)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


@torch.library.custom_op("titanlike::p2p_exchange_start", mutates_args=())
def _start(tensors: list[Tensor], group_name: str, send_to: int, recv_from: int) -> Tensor:
    from torch.distributed.distributed_c10d import _resolve_process_group

    key = next(_TOKENS)  # the sent tensors kept alive until the wait
    _IN_FLIGHT[key] = exchange_start(tensors, _resolve_process_group(group_name), send_to, recv_from)
    return torch.tensor(key, dtype=torch.int64)


@_start.register_fake
def _(tensors, group_name, send_to, recv_from):
    return torch.empty((), dtype=torch.int64)


@torch.library.custom_op("titanlike::p2p_exchange_wait", mutates_args=())
def _wait(token: Tensor, like: list[Tensor]) -> list[Tensor]:
    return exchange_wait(_IN_FLIGHT.pop(int(token)), like)


@_wait.register_fake
def _(token, like):
    return [_buffer_like(t) for t in like]


def exchange_start(tensors: list[Tensor], group: dist.ProcessGroup, send_to: int, recv_from: int):
    """Post the sends of ``tensors`` to global rank ``send_to`` and the receives of as many from ``recv_from``
    over ``group``; returns what :func:`exchange_wait` takes. Traced by dynamo: the custom op (a token); eager: the
    works and buffers themselves, as before any compile (so eager dispatch modes, the byte counters of the planner's
    gloo pins and ``scripts/cp_memory.py``, see every send)."""
    if torch.compiler.is_compiling():
        return _start(list(tensors), group.group_name, send_to, recv_from)
    sent = [t.contiguous() for t in tensors]
    recv = [_buffer_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, send_to, group) for t in sent]
    ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in recv]
    return dist.batch_isend_irecv(ops), sent, recv


def exchange_wait(pending, like: list[Tensor]) -> list[Tensor]:
    """What arrived for the exchange ``pending`` (:func:`exchange_start`'s) stands for (``like``: what was sent, for
    the shapes)."""
    if isinstance(pending, Tensor):
        return _wait(pending, list(like))
    works, _, recv = pending
    for w in works:
        w.wait()
    return recv
