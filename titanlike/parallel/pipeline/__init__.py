"""Pipeline parallelism: split a model into stages and run them with a torch.distributed.pipelining schedule.

* :mod:`~titanlike.parallel.pipeline.build`: the one stage builder (deepcopy-and-delete, the full model's FQNs) and
  the split check, for any module;
* :mod:`~titanlike.parallel.pipeline.runtime`: :class:`PipelineParallel` (the stages, the schedule, the eval
  executor, the gradient sync of parameters tied across stages) and the one schedule builder;
* :mod:`~titanlike.parallel.pipeline.api`: :func:`apply_pp` (the trainer's, from the config) and
  :func:`pipeline_module` (any module, from a user's split).

See docs/pipeline.md.
"""

from titanlike.parallel.pipeline.api import apply_pp, pipeline_module
from titanlike.parallel.pipeline.build import build_stage, check_split, dry_run
from titanlike.parallel.pipeline.runtime import PipelineParallel

__all__ = ["PipelineParallel", "apply_pp", "build_stage", "check_split", "dry_run", "pipeline_module"]
