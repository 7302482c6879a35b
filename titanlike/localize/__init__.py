"""The divergence localiser: where a layout stops training like one device.

    python -m titanlike.localize --nproc 2 --module my_model.py            # a user's module and parallelize()
    python -m titanlike.localize --nproc 4 --job.config_file configs/debug_model.toml \\
        --parallelism.tensor_parallel_degree 2                             # the trainer's model and layout

Both run the layout on ``--nproc`` forked gloo ranks and the same model on one device (every rank runs that copy
itself), in float64, from the same seed and batches, and compare in execution order every module's forward output,
every module's gradient with respect to its inputs, every parameter's gradient after the data-parallel reductions
and every parameter after the optimizer step, for ``--steps`` steps; each rank compares what it holds with the same
cut of the one-device tensor (:mod:`titanlike.localize.cuts`). Exit 0 with ``no divergence above <tol> in <n>
steps``, or 1 with a line ``divergence: <module> <phase>: ...`` naming the first point, a hint where the evidence
shows the cause, and the next divergent points (:mod:`titanlike.localize.report`). Bad input: one line, exit 2,
before any process starts.

This package is a top layer: it imports the trainer's pieces, nothing imports it; its hooks exist only while it runs.
"""

from titanlike.localize.report import Outcome, gather_outcome
from titanlike.localize.trace import Point, Reference, Tracer

__all__ = ["Outcome", "Point", "Reference", "Tracer", "gather_outcome"]
