"""Layout-invariant training (``training.layout_invariant``): the same bits under every data-parallel layout.

A step's every sum that a layout could split runs here, in one fixed order that no layout changes:

* **The canonical decomposition.** The global batch of ``G`` sequences is cut into ``V`` virtual ranks
  (``training.virtual_dp_degree``, a power of two) of ``M`` canonical microbatches of ``L`` sequences each
  (``L = training.local_batch_size``, ``G = V x M x L``): the tokens of one forward are the same under every layout.
  Data-parallel rank ``d`` of ``dp`` (``dp`` divides ``V``) hosts virtual ranks ``d V/dp .. (d+1) V/dp - 1``: the
  loader's contiguous slice of the global batch, its micro-batches in (virtual rank, microbatch) order.
* **One summation tree over the ``V x M`` leaves** in (virtual rank, microbatch) order: each virtual rank's ``M``
  leaves by a binary counter (:class:`CanonicalTree`), then a balanced binary tree over the ``V`` virtual ranks.
  Since ``dp`` and ``V`` are powers of two, every dp rank's leaves are a complete subtree: a rank accumulates its
  own leaves (pairwise, ``log2`` extra gradient buffers), then the ranks' subtrees meet in a balanced tree in rank
  order. Gradients, the loss and the token count go through the same tree.
* **Across ranks, the gradients**: FSDP's own reduce-scatter is off (``set_requires_gradient_sync(False)``); after
  the last backward each rank sends chunk ``s`` of its unsharded subtree gradient to shard rank ``s`` (one
  all-to-all: the bytes of a ring reduce-scatter) and sums what it receives in a balanced tree in rank order; under
  HSDP the replicas' partial sums are all-gathered and summed the same way (dp index = replicate x shard degree +
  shard: HSDP 2x2 and FSDP 4 build the same tree).
* **Pipeline stages** (every schedule, alone or x FSDP / HSDP): a stage's backward pass of a pipeline microbatch
  (or, under the zero-bubble schedules, its separate weight-gradient pass) hands each of its parameters' gradients
  to the parameter's own tree with the microbatch's index, before FSDP would reduce-scatter them; leaves that come
  early wait for their turn, so the tree sees microbatch order whatever order the schedule runs.
* **The clipping norm**: each parameter's rows are cut at the union over every ``dp`` dividing ``V`` of FSDP's chunk
  boundaries (canonical blocks: each lies inside one shard under every layout); each block's sum of squares is taken
  by the same kernel on the same contiguous float64 rows under every layout, the blocks are exchanged by one
  all-reduce (every block's value is non-zero on exactly one rank of the shard group: adding zeros is exact) and
  summed in a balanced tree in parameter order.

What this costs and what is not invariant yet: docs/layout_invariance.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = [
    "CanonicalTree",
    "InvariantReduction",
    "canonical_row_blocks",
    "tree_sum",
]


def _add(a, b):
    """``a + b`` for the tree's values: tensors (a fresh sum), lists of tensors or None (per parameter, in place into
    ``a``'s buffers; None is a parameter without a gradient in that leaf: the other side)."""
    if isinstance(a, list):
        out = []
        for x, y in zip(a, b, strict=True):
            if x is None:
                out.append(y)
            elif y is None:
                out.append(x)
            else:
                out.append(x.add_(y))
        return out
    return a + b


def tree_sum(values: Sequence, add: Callable = _add):
    """The balanced binary tree over ``values`` in order (pairs of neighbours, level by level); ``len(values)`` is a
    power of two wherever this sums the ranks' or the virtual ranks' subtrees."""
    values = list(values)
    if not values:
        raise ValueError("tree_sum of nothing")
    while len(values) > 1:
        paired = [add(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)]
        values = paired + ([values[-1]] if len(values) % 2 else [])
    return values[0]


class _Counter:
    """Pairwise accumulation of a stream of leaves with a binary counter: at most log2(n) + 1 partial sums held. For
    a power-of-two count the result is :func:`tree_sum`'s; otherwise the partial sums are folded from the last."""

    def __init__(self, add: Callable):
        self.add, self.stack = add, []  # (level, value), levels strictly decreasing

    def push(self, value) -> None:
        level = 0
        while self.stack and self.stack[-1][0] == level:
            _, left = self.stack.pop()
            value, level = self.add(left, value), level + 1
        self.stack.append((level, value))

    def result(self):
        if not self.stack:
            raise ValueError("no leaf was pushed")
        _, value = self.stack.pop()
        while self.stack:
            _, left = self.stack.pop()
            value = self.add(left, value)
        return value

    @property
    def held(self) -> int:
        return len(self.stack)


class CanonicalTree:
    """The canonical tree of a run's ``microbatches`` (M) leaves per virtual rank: push leaves in (virtual rank,
    microbatch) order; ``result()`` is the sum of the complete virtual ranks pushed (a power of two of them)."""

    def __init__(self, microbatches: int, add: Callable = _add):
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        self.m, self.add = microbatches, add
        self.inner, self.outer = _Counter(add), _Counter(add)
        self.pushed = 0

    def push(self, leaf) -> None:
        self.inner.push(leaf)
        self.pushed += 1
        if self.pushed % self.m == 0:
            self.outer.push(self.inner.result())

    def result(self):
        if self.pushed % self.m:
            raise ValueError(f"{self.pushed} leaves pushed: not whole virtual ranks of {self.m} microbatches")
        return self.outer.result()

    @property
    def held(self) -> int:
        """Partial sums held now (the extra gradient buffers of the accumulation)."""
        return self.inner.held + self.outer.held


class InOrder:
    """A tree's leaves pushed with their index (a pipeline stage's gradient of pipeline microbatch ``index``): each
    goes into ``tree`` in index order, whatever order they arrive in; a leaf that comes early waits in a buffer
    (the schedules run a stage's backward or weight-gradient passes in microbatch order: none waits; LoopedBFS runs
    them in reverse: up to all of a schedule step's leaves wait)."""

    def __init__(self, tree):
        self.tree, self.next, self.waiting = tree, 0, {}

    def push(self, index: int, leaf) -> None:
        if index < self.next or index in self.waiting:
            raise ValueError(f"layout_invariant: the gradient of pipeline microbatch {index} came twice")
        self.waiting[index] = leaf
        while self.next in self.waiting:
            self.tree.push(self.waiting.pop(self.next))
            self.next += 1

    def result(self):
        if self.waiting:
            raise ValueError(f"layout_invariant: microbatch {self.next}'s gradient never came")
        return self.tree.result()

    @property
    def pushed(self) -> int:
        return self.tree.pushed + len(self.waiting)

    @property
    def held(self) -> int:
        return self.tree.held + len(self.waiting)


def _watch_stage(reduction: InvariantReduction, stage, indices: list[int]) -> None:
    """A pipeline stage's backward passes report their parameters' gradients, with the pipeline microbatch's index,
    to ``reduction`` (:meth:`InvariantReduction.stage_leaves`), and its end-of-step gradient reduction is checked to
    have nothing to reduce. torch's schedules call ``backward_one_chunk`` (a full backward, or the input-gradient
    half of a split one: no weight gradients) and ``backward_weight_one_chunk`` (the weight-gradient half, by
    ``torch.autograd.grad``: no gradient hook fires) per microbatch, then ``perform_reduce_grad`` (FSDP's
    reduce-scatter): the methods are wrapped on this stage object. In train_step, before each pass the stage's
    gradients are cleared (the first step's metadata inference leaves some under torch 2.13)."""
    backward, weight = stage.backward_one_chunk, stage.backward_weight_one_chunk

    def backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        _clear(reduction, indices)
        backward(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        reduction.stage_leaves(indices, bwd_chunk_id)

    def backward_weight_one_chunk(bwd_chunk_id, last_backward=False):
        _clear(reduction, indices)
        weight(bwd_chunk_id, last_backward=last_backward)
        reduction.stage_leaves(indices, bwd_chunk_id)

    stage.backward_one_chunk, stage.backward_weight_one_chunk = backward_one_chunk, backward_weight_one_chunk
    if hasattr(stage, "perform_reduce_grad"):
        reduce = stage.perform_reduce_grad

        def perform_reduce_grad(grad_scale_factor):
            if reduction._trees is not None:  # in train_step: FSDP must find no gradient to reduce-scatter
                left = [reduction.names[id(reduction.params[i])] for i in indices if reduction._take(i) is not None]
                if left:
                    raise ValueError(f"layout_invariant: gradients left for FSDP to reduce: {left[:4]}")
            reduce(grad_scale_factor)

        stage.perform_reduce_grad = perform_reduce_grad


def _clear(reduction: InvariantReduction, indices: list[int]) -> None:
    """In train_step only (a user's backward outside it accumulates in ``.grad`` as usual)."""
    if reduction._trees is not None:
        for i in indices:
            reduction._take(i)


def canonical_row_blocks(rows: int, virtual: int) -> list[int]:
    """The row boundaries of a parameter's canonical blocks: the union, over every ``dp`` dividing ``virtual``, of
    FSDP's chunk boundaries (``torch.chunk``: chunks of ``ceil(rows / dp)`` rows), so that every block lies within one
    shard under every layout with ``dp <= virtual``."""
    bounds = {0, rows}
    d = 1
    while d <= virtual:
        size = -(-rows // d) if rows else 0
        bounds.update(min(k * size, rows) for k in range(d + 1))
        d *= 2
    return sorted(bounds)


def _fsdp_params(model: nn.Module) -> dict[int, object]:
    """id(sharded parameter) -> its FSDPParam (torch's FSDP2 internals: the unsharded gradient of each backward)."""
    from torch.distributed.fsdp import FSDPModule

    out = {}
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params if group is not None else ():
            out[id(fp.sharded_param)] = fp
    return out


def _shard_geometry(p: DTensor) -> tuple[int, int, object, object]:
    """(shard degree, this rank's shard index, shard group, replicate group or None) of an FSDP / HSDP parameter:
    ``(Shard(0),)`` on a 1-D mesh or ``(Replicate(), Shard(0))`` on a 2-D one, refused otherwise."""
    mesh, pl = p.device_mesh, p.placements
    if mesh.ndim == 1 and pl[0].is_shard(0):
        return mesh.size(0), mesh.get_local_rank(0), mesh.get_group(0), None
    if mesh.ndim == 2 and pl[0].is_replicate() and pl[1].is_shard(0):
        return mesh.size(1), mesh.get_local_rank(1), mesh.get_group(1), mesh.get_group(0)
    raise ValueError(
        f"layout_invariant: a parameter on mesh {mesh.mesh_dim_names} with placements {pl}; only FSDP (Shard(0)) "
        f"and HSDP (Replicate(), Shard(0)) parameters are reduced in the fixed tree"
    )


class InvariantReduction:
    """The step's reductions in the canonical order (module docstring); ``train_step(..., reduction=this)``.

    ``model_parts``: the model, or this rank's pipeline stages. ``microbatches`` is M (canonical microbatches per
    virtual rank), ``virtual`` V, ``canonical_size`` the sequences of a canonical microbatch (the local batch; under
    pipeline parallelism the pipeline microbatch). ``dp_group`` (None: one process) is the data-parallel group, its
    ranks in dp-index order; ``pp_group`` the pipeline group and ``stages`` this rank's ``PipelineStage`` objects:
    each stage's backward and weight-gradient passes hand over each parameter's gradient of each pipeline microbatch
    (FSDP's unsharded gradient under pp x FSDP) with the microbatch's index, a leaf of that parameter's own tree in
    microbatch order whatever order the schedule runs them in (:func:`_watch_stage`, :class:`InOrder`); the stages'
    subtrees then go through the same dp reduction. Planted mutations in the tests swap ``cross_order`` (the ranks'
    subtrees in another order), ``local_tree`` (the accumulation of a rank's leaves), ``stage_tree`` (a stage
    parameter's in-order buffer) or ``norm_blocks`` (the clipping norm's blocks)."""

    def __init__(
        self,
        model_parts: nn.Module | Sequence[nn.Module],
        *,
        microbatches: int,
        virtual: int,
        canonical_size: int,
        dp_group=None,
        pp_group=None,
        stages: Sequence = (),
    ):
        parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
        self.parts, self.m, self.virtual, self.dp_group = parts, microbatches, virtual, dp_group
        self.canonical_size, self.pp_group = canonical_size, pp_group
        self.dp = 1 if dp_group is None else dist.get_world_size(dp_group)
        if virtual & (virtual - 1) or virtual < 1 or virtual % self.dp:
            raise ValueError(f"layout_invariant: virtual_dp_degree {virtual} must be a power of two divisible by dp")
        self.fsdp = {k: v for part in parts for k, v in _fsdp_params(part).items()}
        named = [(n, p) for part in parts for n, p in part.named_parameters() if p.requires_grad]
        if self.dp > 1:
            uncovered = [n for n, p in named if id(p) not in self.fsdp]
            if uncovered:
                raise ValueError(f"layout_invariant: parameters outside FSDP under dp {self.dp}: {uncovered[:4]}")
        for part in parts:
            for m in part.modules():
                if hasattr(m, "set_requires_gradient_sync"):
                    m.set_requires_gradient_sync(False, recurse=False)  # the gradients are reduced here
        self.params = [p for _, p in named]
        self.local_tree: Callable[[], object] = lambda: CanonicalTree(self.m)
        self.stage_tree: Callable[[], object] = lambda: InOrder(self.local_tree())
        self.cross_order: Callable[[list], list] = lambda received: received
        self.norm_blocks: Callable[[int], list[int]] = lambda rows: canonical_row_blocks(rows, self.virtual)
        self.max_held = 0  # the most partial gradient sums held at once in a step (the accumulation's extra buffers)
        self._layout_norm(named)
        self._trees: list | None = None
        self._offset, self._call, self._sizes = 0, 0, []
        self.stages = list(stages)
        if pp_group is not None:
            index = {id(p): i for i, p in enumerate(self.params)}
            for stage in stages:
                _watch_stage(self, stage, [index[id(p)] for p in stage.submod.parameters() if id(p) in index])

    def _layout_norm(self, named: list[tuple[str, Tensor]]) -> None:
        """The clipping norm's parameter order, by name (every stage's parameters under pipeline parallelism: the
        names and row counts gathered over the pp group once): ``self.norm_order`` = [(name, rows)]."""
        mine = [(n, p.shape[0] if p.dim() else 1) for n, p in named]
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            every: list = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(every, mine, group=self.pp_group)
            mine = [x for stage in every for x in stage]
        self.norm_order = sorted(dict(mine).items())
        self.names = {id(p): n for n, p in named}

    # ---------------------------------------------------------------------------------------- the token count, loss
    def _leaves_tree(self, leaves: Tensor) -> Tensor:
        """The canonical sum of this rank's per-leaf scalars (float64) over every rank: all-gathered in dp-index order,
        then the whole tree on every rank (identical everywhere)."""
        if self.dp > 1:
            parts = [torch.empty_like(leaves) for _ in range(self.dp)]
            dist.all_gather(parts, leaves.contiguous(), group=self.dp_group)
            leaves = torch.cat(parts)
        tree = CanonicalTree(self.m)
        for v in leaves.unbind(0):
            tree.push(v)
        return tree.result()

    def tokens(self, micro_batches: Sequence[Sequence[Tensor]], ignore_index: int) -> Tensor:
        """The global batch's non-ignored label tokens (float64), summed in the canonical tree (one leaf per
        canonical microbatch: a pipeline micro-batch holds several)."""
        self._sizes = [len(mb[1].split(self.canonical_size)) for mb in micro_batches]
        labels = [c for mb in micro_batches for c in mb[1].split(self.canonical_size)]
        self._check_leaves(len(labels))
        self.leaves = len(labels)
        counts = torch.stack([(c != ignore_index).sum() for c in labels]).to(torch.float64)
        return self._leaves_tree(counts)

    def loss(self, leaf_losses: Sequence[Tensor]) -> Tensor:
        """The step's loss: the canonical microbatches' ``sum(CE) / tokens`` (float64) in the canonical tree; under
        pipeline parallelism only the last stage has them (the others pass none: zeros, summed over the pp group,
        exactly)."""
        device = next(iter(self.params)).device if self.params else torch.device("cpu")
        if leaf_losses:
            values = torch.stack([x.detach().to(torch.float64) for x in leaf_losses])
        else:
            values = torch.zeros(self.leaves, dtype=torch.float64, device=device)
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            dist.all_reduce(values, group=self.pp_group)
        return self._leaves_tree(values)

    def _check_leaves(self, n: int) -> None:
        want = self.virtual // self.dp * self.m
        if n != want:
            raise ValueError(
                f"layout_invariant: {n} micro-batches on this rank, the canonical decomposition needs V/dp x M = "
                f"{self.virtual // self.dp} x {self.m} = {want}"
            )

    # ---------------------------------------------------------------------------------------------- the gradients
    def begin_step(self) -> None:
        self._tree = self.local_tree()
        self.max_held = 0
        self._offset, self._call = 0, 0
        if self.pp_group is not None:
            self._trees = [self.stage_tree() for _ in self.params]

    def stage_leaves(self, indices: Sequence[int], chunk: int) -> None:
        """Pipeline stages: after a stage's backward (or weight-gradient) pass of pipeline microbatch ``chunk`` of the
        current schedule step, each of its parameters' gradients (unsharded under FSDP) is the leaf ``offset + chunk``
        of that parameter's own tree, pushed in microbatch order whatever order the schedule ran it in."""
        if self._trees is None:
            return  # a backward outside train_step (a user's): left in .grad
        for i in indices:
            g = self._take(i)
            if g is not None:
                self._trees[i].push(self._offset + chunk, g)
                self.max_held = max(self.max_held, self._trees[i].held)

    def _take(self, i: int) -> Tensor | None:
        """Parameter ``i``'s gradient (unsharded under FSDP), taken out of autograd's buffers."""
        p = self.params[i]
        fp = self.fsdp.get(id(p))
        if fp is None:
            g, p.grad = p.grad, None
        elif getattr(fp, "unsharded_accumulated_grad", None) is not None:
            g, fp.unsharded_accumulated_grad = fp.unsharded_accumulated_grad, None
        elif hasattr(fp, "_unsharded_param"):
            u = fp.unsharded_param
            g, u.grad = u.grad, None
        else:
            g = None  # not gathered yet: no gradient
        return None if g is None else g.detach()

    def _take_leaf(self) -> list[Tensor | None]:
        """This micro-batch's gradient of every parameter (unsharded under FSDP), taken out of autograd's buffers."""
        return [self._take(i) for i in range(len(self.params))]

    def microbatch_done(self) -> None:
        """After each micro-batch's backward: its gradients become a leaf of the tree (under pipeline parallelism
        the stages pushed each pipeline microbatch's already: the next schedule step's leaves come after them)."""
        if self._trees is not None:
            self._offset += self._sizes[self._call]
            self._call += 1
            return
        self._tree.push(self._take_leaf())
        self.max_held = max(self.max_held, self._tree.held)

    def finish_gradients(self) -> None:
        """This rank's subtree, then across the ranks: every parameter's ``.grad`` set (sharded like the parameter)."""
        if self._trees is not None:  # pipeline stages: one tree per parameter
            local = self._stage_results()
        else:
            local = self._tree.result()
            self._tree = None
        if not self.fsdp:
            for p, g in zip(self.params, local):
                p.grad = g
            return
        by_mesh: dict[object, list[int]] = {}
        for i, p in enumerate(self.params):
            by_mesh.setdefault((p.device_mesh, tuple(p.placements)), []).append(i)
        for indices in by_mesh.values():
            self._reduce(indices, local)

    def _stage_results(self) -> list[Tensor]:
        trees, self._trees = self._trees, None
        local = []
        for p, tree in zip(self.params, trees):
            if tree.pushed != self.leaves:
                raise ValueError(
                    f"layout_invariant: {self.names[id(p)]} got {tree.pushed} gradients of the {self.leaves} "
                    f"canonical microbatches (a parameter without a gradient in some microbatch)"
                )
            local.append(tree.result())
        return local

    def _reduce(self, indices: list[int], local: list[Tensor | None]) -> None:
        """The fixed-order reduce-scatter of one mesh's parameters: one all-to-all over the shard group, the received
        chunks summed in a balanced tree in shard-rank order; under HSDP an all-gather over the replicas summed the
        same way (the bytes of a ring reduce-scatter; the replicas' all-reduce as an all-gather)."""
        first = self.params[indices[0]]
        shards, me, shard_group, replicate_group = _shard_geometry(first)
        pieces: list[list[Tensor]] = [[] for _ in range(shards)]
        layout = []  # per parameter: (rows of a padded chunk, row numel, this rank's real rows)
        for i in indices:
            p = self.params[i]
            g = local[i]
            if g is None:
                g = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
            rows = g.shape[0]
            chunk = -(-rows // shards)
            row_numel = g[0].numel() if rows else 0
            flat = g.reshape(rows, row_numel) if rows else g.reshape(0, 0)
            for s in range(shards):
                part = flat[min(s * chunk, rows) : min((s + 1) * chunk, rows)]
                padded = part.new_zeros(chunk, row_numel)
                padded[: part.shape[0]] = part
                pieces[s].append(padded.reshape(-1))
            layout.append((chunk, row_numel, max(0, min((me + 1) * chunk, rows) - me * chunk)))
        send = torch.stack([torch.cat(ps) for ps in pieces])
        if shards > 1:
            received = torch.empty_like(send)
            dist.all_to_all_single(received, send, group=shard_group)
            mine = tree_sum(self.cross_order(list(received.unbind(0))))
        else:
            mine = send[0]
        if replicate_group is not None and dist.get_world_size(replicate_group) > 1:
            gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(replicate_group))]
            dist.all_gather(gathered, mine.contiguous(), group=replicate_group)
            mine = tree_sum(self.cross_order(gathered))
        offset = 0
        for i, (chunk, row_numel, real) in zip(indices, layout):
            p = self.params[i]
            n = chunk * row_numel
            local_grad = mine[offset : offset + real * row_numel].reshape(real, *p.shape[1:]).clone()
            offset += n
            p.grad = DTensor.from_local(
                local_grad, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )

    # ------------------------------------------------------------------------------------------ the clipping norm
    def norm_squared(self, params: Sequence[Tensor]) -> Tensor:
        """The sum of squared gradient entries over the whole model (float64), in canonical blocks, parameters in
        name order (every stage's under pipeline parallelism)."""
        blocks: list[tuple[Tensor, int, int]] = []  # (local rows, first local row, last local row) per block owned
        index = []  # per block of every parameter: position in the exchanged vector, or -1 when not held here
        group = None
        by_name = {self.names[id(p)]: p for p in params if id(p) in self.names}
        for name, rows in self.norm_order:
            p = by_name.get(name)
            bounds = self.norm_blocks(rows)
            g = None if p is None else p.grad
            if g is None:
                index += [-1] * (len(bounds) - 1)
                continue
            if isinstance(g, DTensor):
                shards, me, group, _ = _shard_geometry(g)
                chunk = -(-rows // shards)
                lo, hi = min(me * chunk, rows), min((me + 1) * chunk, rows)
                t = g.to_local()
            else:
                lo, hi, t = 0, rows, g
            t = t.reshape(hi - lo, -1) if g.dim() else t.reshape(1, 1)
            for a, b in zip(bounds[:-1], bounds[1:]):
                if lo <= a and b <= hi and a < b:
                    index.append(len(blocks))
                    blocks.append((t, a - lo, b - lo))
                else:
                    index.append(-1)
        values = torch.zeros(len(index), dtype=torch.float64, device=_device(params))
        for pos, k in enumerate(index):
            if k >= 0:
                t, a, b = blocks[k]
                # a fresh contiguous float64 copy of the block's rows: the same shape, values and alignment under
                # every layout (squares of float32 are exact in float64)
                values[pos] = t[a:b].to(torch.float64, copy=True).square().sum()
        for g in (group, self.pp_group):  # each block non-zero on one rank of the group: adding zeros is exact
            if g is not None and dist.get_world_size(g) > 1:
                dist.all_reduce(values, group=g)
        return tree_sum(list(values.unbind(0))) if len(values) else values.sum()

    def clip_grad_norm_(self, parameters, max_norm: float) -> Tensor:
        """``clip_fn`` of a layout-invariant run: the canonical norm; the gradients scaled by the same float32
        coefficient (elementwise: the same bits wherever an entry lives)."""
        params = [p for p in parameters if p.grad is not None]
        total = self.norm_squared(params).sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for p in params:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                g.mul_(coef.to(g.dtype))
        return total


def _device(params: Sequence[Tensor]) -> torch.device:
    for p in params:
        return p.to_local().device if isinstance(p, DTensor) else p.device
    return torch.device("cpu")
