"""Hugging Face ``transformers`` decoder-only models trained directly (``model.name = "hf"``, ``model.hf_config`` =
a folder with a config.json): the library's own modules under the package's roles, the tensor-parallel plan
translated from the config's ``base_model_tp_plan`` (docs/transformers.md). transformers stays an optional extra:
it is imported only when such a model is built."""

from titanlike.models.spec import ModelSpec, register
from titanlike.models.transformers_lm.model import HFArgs, HFCausalLM, args_from_folder, param_init
from titanlike.models.transformers_lm.sharding import sharding_for

__all__ = ["SPEC", "HFArgs", "HFCausalLM", "args_from_folder", "param_init", "sharding_for"]


def _shape_violations(args: HFArgs) -> list[str]:
    return []


SPEC = register(
    ModelSpec(
        name="hf",
        model_cls=HFCausalLM,
        args_cls=HFArgs,
        flavors={},
        sharding_fn=sharding_for,
        args_from_overrides=lambda overrides: args_from_folder(overrides.get("hf_config", "")),
        param_init=param_init,
        # transformers' attention, not the shared seam: no context parallelism, no document mask (refused by the
        # layout rules cp_model and mask_model in one line)
        context_parallel=False,
        block_causal=False,
        shape_violations=_shape_violations,
        hf_adapter="titanlike.models.transformers_lm.hf",
    )
)
