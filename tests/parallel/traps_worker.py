"""Issue 26's traps for user modules, on 2 forked gloo ranks in ONE launch (every case a few steps of a tiny float64
model, written the way outside users write theirs: real ``transformers`` models from tiny configs and a user's own
pipeline model), results in one JSON for tests/parallel/test_traps.py:

* the documented complete ``transformers`` example (the python block of docs/parallelizing_your_own_module.md,
  "A complete `transformers` example", executed as is): Qwen3ForCausalLM under tp2, 3 steps equal to one process;
* the issue's mis-plan (Qwen3 q_norm / k_norm as ReplicateParallel) refused at step 1 naming q_norm, and the same
  mis-plan with the check off (``check="never"``) training wrong: the check is what catches it; the check's cost
  (CommDebugMode over the first and the second forward);
* a positional PrepareModuleInput on transformers' keyword-called self_attn: one line naming the module;
* the fused q|k|v of the README example given a sequence shard as if it were the replicated stream: refused;
* tp vs head counts (Phi3, 1 kv head, tp2): refused at apply_tp;
* data-parallel coverage (Qwen2, q/k/v biases, tied embeddings): ``apply_fsdp(model.model)`` refused at the first
  train_step naming lm_head.weight; with the check off it trains wrong (the grad norm); FSDP on the root trains
  equal to one process; ``blocks=`` splitting the tie refused at apply_fsdp;
* ``pipeline_module(shared=["rope"])``: a module every stage calls, holding a parameter, trains pp2 equal to one
  process (its gradient summed over the stages);
* karpathy's nanoGPT as written (karpathy_nanogpt.py): ``apply_fsdp(model, mesh, blocks=[[model.transformer.wte,
  model.lm_head], *model.transformer.h])``, torch's list form of one group holding the tied pair, trains dp2 equal
  to one process (its own loss from ``forward(idx, targets)``).

    python tests/parallel/traps_worker.py --out result.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "parallelizing_your_own_module.md"
EXAMPLE_HEADING = "## A complete `transformers` example"
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def documented_example() -> types.ModuleType:
    """The python block under the doc's example heading, executed as a module."""
    text = DOC.read_text()
    section = text[text.index(EXAMPLE_HEADING) :]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    module = types.ModuleType("transformers_example")
    exec(compile(code, str(DOC), "exec"), module.__dict__)
    return module


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return None


# --------------------------------------------------------------------------------------------- a user's pipeline model
class Rope(nn.Module):
    """A position table every block calls (a rotary-table stand-in), with a learned gain (a parameter) or without."""

    def __init__(self, seq: int, dim: int, learned: bool):
        super().__init__()
        pos = torch.arange(seq, dtype=torch.float64)[:, None] / (1 + torch.arange(dim, dtype=torch.float64))
        self.register_buffer("table", torch.sin(pos), persistent=False)
        self.gain = nn.Parameter(torch.ones(dim)) if learned else None

    def forward(self, seq: int):
        table = self.table[:seq]
        return table if self.gain is None else table * self.gain


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x, pos):
        return x + self.fc(torch.tanh(self.ln(x + pos)))


class RopeNet(nn.Module):
    """Skips None embedding / head (a stage without them), but calls ``self.rope`` on every stage."""

    def __init__(self, vocab: int = 32, seq: int = 8, dim: int = 16, layers: int = 4, learned: bool = True):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.rope = Rope(seq, dim, learned)
        self.h = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.wte(idx) if self.wte is not None else idx
        pos = self.rope(x.shape[1])
        for block in self.h:
            x = block(x, pos)
        return self.head(x) if self.head is not None else x


ROPE_SPLIT = [["wte", "h.0", "h.1"], ["h.2", "h.3", "head"]]


def rope_batch(step: int):
    tokens = torch.randint(32, (4, 9), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def sum_ce(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


# --------------------------------------------------------------------------------------------- the cases
def qwen3_cases(ex, mesh) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import PrepareModuleInput

    from titanlike.parallel import ReplicateParallel, ScaledLoss, apply_tp, clip_grad_norm_
    from titanlike.training.step import train_step

    r = {"example": ex.main()}
    inputs, labels = ex.batch(0)

    def misplanned(check: str):
        model = ex.build()
        plan = ex.tp_plan(model)
        for key in plan:
            if key.endswith(("q_norm", "k_norm")):
                plan[key] = ReplicateParallel(check=check)
        return apply_tp(model, mesh, plan)

    def step(model):  # one step, not clipped: its gradients compare with one backward of the reference
        optimizer = torch.optim.AdamW(model.parameters(), lr=ex.LR)
        loss = ScaledLoss(ex.sum_cross_entropy)
        return train_step([model], optimizer, [ex.batch(0)], loss, max_norm=0.0, clip_fn=clip_grad_norm_)

    r["misplan_error"] = error_of(lambda: step(misplanned("first")))
    # the same mis-plan trusted: trains, wrong (the gradient of the norm weights covers only each rank's heads)
    model = misplanned("never")
    step(model)
    for m in model.modules():  # the debug mode on the drifted model: the norm weights now differ too
        if getattr(m, "_titanlike_replica_check", None) is not None:
            m._titanlike_replica_check.check = "always"
    r["misplan_always_error"] = error_of(lambda: model(inputs))
    ref = ex.build()
    (F.cross_entropy(ref(inputs).logits.flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()).backward()
    grads = dict(ref.named_parameters())
    r["misplan_unchecked_grad"] = max(
        (p.grad.full_tensor() - grads[n].grad).abs().max().item() for n, p in model.named_parameters()
    )

    # the check's cost: the first forward (checks) minus the second (none), collectives and bytes
    model = ex.build()
    apply_tp(model, mesh, ex.tp_plan(model))
    counts = []
    for _ in range(2):
        with torch.no_grad(), CommDebugMode() as comm:
            model(inputs)
        counts.append({str(k): v for k, v in comm.get_comm_counts().items()})
    r["check_comm_first"], r["check_comm_second"] = counts
    r["replicate_modules"] = sum(isinstance(s, ReplicateParallel) for s in ex.tp_plan(model).values())

    # keyword calls: transformers calls self_attn(hidden_states=...)
    from torch.distributed.tensor import Replicate

    def keyword_plan():
        model = ex.build()
        plan = ex.tp_plan(model)
        plan["model.layers.*.self_attn"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
        )
        apply_tp(model, mesh, plan)
        model(inputs)

    r["keyword_error"] = error_of(keyword_plan)
    # the documented keyword form on the same calls: the layouts of hidden_states by name, trains like one process
    model = ex.build()
    plan = ex.tp_plan(model)
    plan["model.layers.*.self_attn"] = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Replicate()},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
        use_local_output=True,
    )
    step(apply_tp(model, mesh, plan))
    r["keyword_form_grad"] = max(
        (p.grad.full_tensor() - grads[n].grad).abs().max().item() for n, p in model.named_parameters()
    )
    return r


def fused_input_case(mesh) -> dict:
    """The README example's SP plan without the PrepareModuleInput before attention: the fused c_attn gets this
    rank's sequence shard as a plain tensor (attention over half the sequence, silently) and refuses it."""
    import nanogpt_parallel as ex

    from titanlike.parallel import apply_tp

    model = ex.GPT(ex.GPTConfig()).to(torch.float64)
    plan = {k: v for k, v in ex.tp_plan(model).items() if not k.endswith(".attn")}
    apply_tp(model, mesh, plan)
    inputs, _ = ex.batch(0, ex.GPTConfig())
    return {"fused_input_error": error_of(lambda: model(inputs))}


def head_count_case(mesh) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel
    from transformers import Phi3Config, Phi3ForCausalLM

    from titanlike.parallel import apply_tp

    model = Phi3ForCausalLM(Phi3Config(**TINY, num_key_value_heads=1, pad_token_id=0)).to(torch.float64)
    return {"head_count_error": error_of(lambda: apply_tp(model, mesh, {"lm_head": ColwiseParallel()}))}


def coverage_cases(mesh) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import titanlike.training.step as step_mod
    from titanlike.parallel import ScaledLoss, apply_fsdp, clip_grad_norm_

    def build():
        torch.manual_seed(0)
        return Qwen2ForCausalLM(Qwen2Config(**TINY, num_key_value_heads=2, tie_word_embeddings=True)).to(torch.float64)

    tokens = torch.randint(64, (4, 17), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    rank = mesh.get_local_rank()
    mine = [(inputs[2 * rank : 2 * rank + 2], labels[2 * rank : 2 * rank + 2])]

    def step(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss = ScaledLoss(lambda out, y: sum_ce(out.logits, y))
        return step_mod.train_step(
            [model], optimizer, mine, loss, max_norm=0.0, clip_fn=clip_grad_norm_, dp_group=mesh.get_group()
        )

    ref = build()
    ref_loss = sum_ce(ref(inputs).logits, labels) / labels.numel()
    ref_loss.backward()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()

    r = {"coverage_error": error_of(lambda: step(_inner(build(), apply_fsdp, mesh)))}
    real = step_mod.check_dp_coverage
    step_mod.check_dp_coverage = lambda parts, group: None
    try:
        res = step(_inner(build(), apply_fsdp, mesh))
    finally:
        step_mod.check_dp_coverage = real
    r["coverage_unchecked_grad_norm"] = abs(res.grad_norm - ref_norm)
    model = build()
    res = step(apply_fsdp(model, mesh, blocks=list(model.model.layers)))
    r["coverage_root_loss"], r["coverage_root_grad_norm"] = (
        abs(res.loss - ref_loss.item()),
        abs(res.grad_norm - ref_norm),
    )

    def split_tie():
        model = build()
        apply_fsdp(model, mesh, blocks=[model.model.embed_tokens, *model.model.layers])

    r["split_tie_error"] = error_of(split_tie)
    return r


def _inner(model, apply_fsdp, mesh):
    """The issue's trap: FSDP on the inner decoder (it has .layers), the head (tied) left outside."""
    apply_fsdp(model.model, mesh)
    return model


def pipeline_shared_case(mesh) -> dict:
    from titanlike.parallel import pipeline_module
    from titanlike.training.step import train_step

    def build():
        torch.manual_seed(0)
        return RopeNet().to(torch.float64)

    pp = pipeline_module(build(), mesh, ROPE_SPLIT, loss_fn=sum_ce, n_microbatches=2, shared=["rope"])
    optimizer = torch.optim.AdamW([p for m in pp.model_parts for p in m.parameters()], lr=1e-2)
    ref = build()
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    loss_diff = 0.0
    for s in range(3):
        res = train_step(
            pp.model_parts,
            optimizer,
            [rope_batch(s)],
            pp.loss,
            max_norm=1.0,
            clip_fn=pp.finalize_grads_and_clip_,
            pp_schedule=pp.schedule,
            pp_group=pp.pp_group,
            has_last_stage=pp.has_last_stage,
        )
        ref_optimizer.zero_grad(set_to_none=True)
        inputs, labels = rope_batch(s)
        ref_loss = sum_ce(ref(inputs), labels) / labels.numel()
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_optimizer.step()
        loss_diff = max(loss_diff, abs(res.loss - ref_loss.item()))
    weights = dict(ref.named_parameters())
    w = max((p.detach() - weights[n]).abs().max().item() for m in pp.model_parts for n, p in m.named_parameters())
    names = [n for m in pp.model_parts for n, _ in m.named_parameters()]
    return {"shared_loss": loss_diff, "shared_weights": w, "shared_gain_here": "rope.gain" in names}


def nanogpt_fsdp_list_case(mesh) -> dict:
    from karpathy_nanogpt import GPT, GPTConfig

    from titanlike.parallel import apply_fsdp

    def build():
        torch.manual_seed(0)
        return GPT(GPTConfig()).to(torch.float64)

    model, ref = build(), build()
    apply_fsdp(model, mesh, blocks=[[model.transformer.wte, model.lm_head], *model.transformer.h])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    rank, r = mesh.get_local_rank(), {"fsdp_list_loss": 0.0, "fsdp_list_grads": 0.0}
    for s in range(3):
        tokens = torch.randint(64, (4, 17), generator=torch.Generator().manual_seed(s))
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as nanoGPT's get_batch gives them
        _, loss = model(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        (loss / 2).backward()  # the mean over this rank's half; apply_fsdp sums the ranks' gradients
        _, ref_loss = ref(x, y)
        ref_loss.backward()
        total = loss.detach() / 2
        dist.all_reduce(total, group=mesh.get_group())
        r["fsdp_list_loss"] = max(r["fsdp_list_loss"], abs(total.item() - ref_loss.item()))
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            diff = (p.grad.full_tensor() - ref_params[n].grad).abs().max().item()
            r["fsdp_list_grads"] = max(r["fsdp_list_grads"], diff)
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad(set_to_none=True)
    weights = dict(ref.named_parameters())
    r["fsdp_list_weights"] = max((p.full_tensor() - weights[n]).abs().max().item() for n, p in model.named_parameters())
    r["fsdp_list_tied"] = model.transformer.wte.weight is model.lm_head.weight
    return r


def rank_main(rank: int, world_size: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))["x"]
    r = qwen3_cases(documented_example(), mesh)
    r |= fused_input_case(mesh)
    r |= head_count_case(mesh)
    r |= coverage_cases(mesh)
    r |= pipeline_shared_case(mesh)
    r |= nanogpt_fsdp_list_case(mesh)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, r)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone, indent=1))


def main() -> int:
    from dist_utils import spawn

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args()
    prepare()
    return spawn(rank_main, 2, a.out, timeout_s=a.timeout)


def prepare() -> None:
    """Before the ranks fork: import the transformers models the cases build (once, not per rank)."""
    import transformers.models.phi3.modeling_phi3  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401


if __name__ == "__main__":
    sys.exit(main())
