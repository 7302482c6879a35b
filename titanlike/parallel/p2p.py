"""Point-to-point exchanges a compiled block can hold: two opaque custom ops.

``exchange_start(tensors, group, send_to, recv_from)`` posts the sends of ``tensors`` to global rank ``send_to``
and as many receives from ``recv_from`` over ``group`` (one ``batch_isend_irecv``) and returns a token;
``exchange_wait(token, like)`` waits for them and returns what arrived (contiguous tensors shaped as ``like``).
The compute between the two overlaps the transfer where the backend is asynchronous.

Why custom ops: dynamo traces ``batch_isend_irecv`` only behind the experimental
``TORCHDYNAMO_ENABLE_P2P_COMPILATION`` (torch 2.13) and breaks the graph otherwise (an error under
``fullgraph=True``); a ``torch.library`` custom op is one opaque node of the graph (its fake implementation gives
the shapes), called alike from eager code and from a traced autograd function (the ring attention's forward and
backward, ``titanlike.parallel.ring_attention``). Every rank of the group must run the same exchanges in the same
order, as with any collective.
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

    group = _resolve_process_group(group_name)
    sent = [t.contiguous() for t in tensors]
    recv = [_buffer_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, send_to, group) for t in sent]
    ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in recv]
    key = next(_TOKENS)
    _IN_FLIGHT[key] = (dist.batch_isend_irecv(ops), sent, recv)  # the sent tensors kept alive until the wait
    return torch.tensor(key, dtype=torch.int64)


@_start.register_fake
def _(tensors, group_name, send_to, recv_from):
    return torch.empty((), dtype=torch.int64)


@torch.library.custom_op("titanlike::p2p_exchange_wait", mutates_args=())
def _wait(token: Tensor, like: list[Tensor]) -> list[Tensor]:
    works, _, recv = _IN_FLIGHT.pop(int(token))
    for w in works:
        w.wait()
    return recv


@_wait.register_fake
def _(token, like):
    return [_buffer_like(t) for t in like]


def exchange_start(tensors: list[Tensor], group: dist.ProcessGroup, send_to: int, recv_from: int) -> Tensor:
    """Post the sends of ``tensors`` to global rank ``send_to`` and the receives of as many from ``recv_from``
    over ``group``; returns the token :func:`exchange_wait` takes."""
    return _start(list(tensors), group.group_name, send_to, recv_from)


def exchange_wait(token: Tensor, like: list[Tensor]) -> list[Tensor]:
    """What arrived for the exchange ``token`` stands for (``like``: what was sent, for the shapes)."""
    return _wait(token, list(like))
