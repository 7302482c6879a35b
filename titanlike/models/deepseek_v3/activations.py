"""What an MLA block keeps for its backward, per token, for the planner's activation model
(``titanlike.planner.memory``, through ``ModelSpec.attention_activations``), read off :class:`MLA`'s forward and
checked against the dry run's FakeTensorMode probe (tests/planner/test_planner_mla.py).

With ``n`` heads (``n / t`` per tp rank), ``d_qk`` = nope + rope, ``d_v``, the ranks ``r_q`` (``q_lora_rank``) and
``r_kv``, the RoPE width ``d_r``, ``a`` / ``c`` the activation / compute bytes, no AC:

* the query path (``r_q > 0``): ``q_norm`` keeps its input in float32 (``c r_q``; under float32 ``wq_a``'s output
  itself), its rstd and its output twice (normalised, and as ``wq_b`` saves it): ``c r_q + c + 2 a r_q``; a plain
  ``wq`` keeps nothing beyond the block norm's output (its output only feeds the split and the RoPE, which saves the
  tables only);
* the latent: ``kv_norm`` the same, except that under float32 its input is a view of ``wkv_a``'s whole output
  (``a (r_kv + d_r)``);
* the replicated down-projections run on the whole (all-gathered) sequence: these terms are not divided by ``t``;
* the kernel, per head (``/ t``): the memory-efficient kernel (CUDA: q / k and v of different widths) keeps q, k,
  v, its output and the log-sum-exp, ``a (2 d_qk + 2 d_v) + 4``; torch's math path (what runs on CPU, and so in the
  probe, when ``d_qk != d_v``) the scaled q, the transposed k, the probabilities over the ``s`` keys, v and the
  output as ``wo`` saves it: ``a (2 d_qk + s + 2 d_v)``; with ``d_qk == d_v`` the flash kernel as for Llama.

Selective op AC keeps the matmul and kernel outputs: ``wq_a``, ``wq_b`` (or ``wq``), ``wkv_a``, ``wkv_b``, the
math path's scores and weighted values (``c (s + d_v)`` per head) or the fused kernel's output and log-sum-exp, and
``wo``'s partial output ``a h``.
"""

from __future__ import annotations

__all__ = ["attention_activations"]


def attention_activations(args, layer_id: int, sizes) -> float:
    """Bytes per token one MLA block's attention keeps (module docstring); ``sizes``: ``ActivationSizes``."""
    a, c, t, s = sizes.act_bytes, sizes.compute_bytes, sizes.tp, sizes.seq
    n, qk, v, h = args.n_heads, args.qk_head_dim, args.v_head_dim, args.dim
    rq, rkv, rope = args.q_lora_rank, args.kv_lora_rank, args.qk_rope_head_dim
    math_path = sizes.probe and qk != v
    if sizes.mode == "op":
        mm = a * (rq + rkv + rope) + a * n * (qk + args.qk_nope_head_dim + v) / t + a * h
        kernel = c * n * (s + v) / t if math_path else (a * n * v + 4 * n) / t
        return mm + kernel
    upcast = a < c  # bf16: the norms' float32 copies; float32 / float64: their inputs themselves
    q_path = (c * rq + c + 2 * a * rq) if rq else 0.0
    kv_in = c * rkv if upcast else a * (rkv + rope)
    latent = kv_in + c + 2 * a * rkv
    if math_path:
        kernel = (c * n * (2 * qk + s + v) + a * n * v) / t
    elif qk == v:
        kernel = (4 * a * n * qk + 4 * n) / t
    else:
        kernel = (a * n * (2 * qk + 2 * v) + 4 * n) / t
    return q_path + latent + kernel
