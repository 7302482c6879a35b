"""What a Gated DeltaNet layer keeps for its backward, for the planner's activation model
(``titanlike.planner.memory``, through ``ModelSpec.attention_activations``), read off :class:`GatedDeltaNet`'s
forward and the chunked rule (``titanlike.models.linear_attention.chunk_gated_delta_rule``), and checked against the
dry run's FakeTensorMode probe (tests/planner/test_planner_qwen3_next.py).

Per sequence of ``s`` tokens padded to ``P = n C`` (``n`` chunks of ``C``), this tp rank's ``h`` value heads and
``n_k`` key heads (``r = h / n_k`` value heads per key head), the conv's ``CH = n_k (2 d_k) + h d_v`` channels and
kernel ``K``, ``a`` / ``c`` the activation / compute bytes (bf16: 2 / 4), no AC:

* the conv: its taps and its output (SiLU's input), ``(K + 1) s CH a``; the L2 norms' inputs (bf16: the float32
  copies of q and k, ``2 s n_k d_k c``; float32: SiLU's output itself, ``s CH a``) and their rsqrt ``2 s n_k c``;
  the decay's softplus input and output ``2 s h c`` and ``sigmoid(b)`` ``s h a``;
* the chunked rule, all in ``c``: ``beta`` and the padded ``k``, ``v`` ``P h (1 + d_k + d_v)``; four ``C x C``
  matrices per chunk (the decay pairs, ``k_beta k^T``, ``ut``, ``q k^T``) and the intra-chunk scores, ``5 n C^2 h``;
  ``carry_q``, ``carry_k`` ``2 P h`` and the chunk decays ``n h``; ``k_beta``, ``k_cum``, the scaled ``q``,
  ``q_dec``, ``k_dec`` ``5 P h d_k``; ``new_v`` ``P h d_v``; per chunk the state entering it and its corrected
  values, ``n h d_k d_v + P h d_v``;
* the gated output norm: its input (bf16: a float32 copy, ``s h d_v c``; float32: the padded output, ``P h d_v c``),
  rstd ``s h c`` and normalised output ``s h d_v a``; the SiLU gate's input (bf16: a float32 copy of ``z``; float32:
  ``z`` itself, a view of ``in_proj_qkvz``'s whole output ``s n_k (2 d_k + 2 r d_v) a`` when its heads fold, with
  one key head or one value head per key head, else a copy ``s h d_v c``), its output and the norm's output as the
  product saves them ``s h d_v (c + c)`` (bf16: ``c + a``); ``out_proj``'s input ``s h d_v a``;
* per block, whatever the batch: ``A_log``'s exponential and its negation ``2 h c``, the chunk's causal mask
  ``C^2`` bytes.

Under context parallelism (``titanlike.parallel.state_passing``, as cp rank 0 runs it: the probe's rank) each of
the two pieces runs the chunked rule from the state ``[0 | I]`` with the values widened to ``d_v + d_k``, the scan
keeps the ``2 cp`` gathered maps ``h d_k (d_v + d_k)`` and the ``2 cp`` states entering the chunks ``h d_k d_v``,
the correction of the second piece its run's output ``P h (d_v + d_k)`` (the first piece's entering state is zero:
nothing saved; another rank keeps that one too, and one state less), the output norm the concatenated outputs
``s h d_v c``; the pieces' causal masks and the conv's and maps' order indices (``2 x 2 cp`` int64) once.

Selective op AC keeps the matmul and collective outputs instead (:func:`_op_outputs`). The full-attention layers
take the planner's softmax formula (None). This is torch's chunked path: what runs on CPU (the probe), under cp and
under document masks (whose masks are not counted); on CUDA without a mask flash-linear-attention's kernel, when
installed, keeps its own tensors instead (not modelled).
"""

from __future__ import annotations

import math

__all__ = ["attention_activations"]


def attention_activations(args, layer_id: int, sizes) -> float | None:
    """Bytes per token one Gated DeltaNet layer keeps (module docstring); ``sizes``: ``ActivationSizes``."""
    if args.layer_type(layer_id) != "linear_attention" or sizes.mode not in ("none", "op"):
        return None
    a, c, t, s, b, cp = sizes.act_bytes, sizes.compute_bytes, sizes.tp, sizes.seq, sizes.batch, sizes.cp
    dk, dv, K, C = args.linear_k_head_dim, args.linear_v_head_dim, args.conv_kernel, args.linear_chunk_size
    h, nk = args.linear_v_heads // t, args.linear_k_heads // t
    rep, channels = h // nk, nk * 2 * dk + h * dv
    if sizes.mode == "op":
        return _op_outputs(args, sizes, h, nk, rep)
    upcast = a < c
    conv = (K + 1) * s * channels * a + (2 * s * nk * dk * c if upcast else s * channels * a) + 2 * s * nk * c
    decay = 2 * s * h * c + s * h * a
    z_view = not upcast and (nk == 1 or rep == 1)
    z = s * nk * (2 * dk + 2 * rep * dv) * a if z_view else s * h * dv * c
    gate = z + s * h * dv * c + (s * h * dv * a if upcast else s * h * dv * c) + s * h * dv * a
    if cp == 1:
        P = math.ceil(s / C) * C
        core = _chunked_rule(h, P, C, dk, dv, c)
        norm_in = s * h * dv * c if upcast else P * h * dv * c  # float32: the padded output itself
        constant = C * C  # the causal mask
    else:  # state passing on cp rank 0: two pieces widened to dv + dk, the scan of 2 cp maps, one correction
        P, W = math.ceil(s / 2 / C) * C, dv + dk
        core = 2 * _chunked_rule(h, P, C, dk, W, c) + c * (2 * cp * h * dk * W + 2 * cp * h * dk * dv + P * h * W)
        norm_in = s * h * dv * c  # the pieces' concatenated outputs
        constant = 2 * C * C + 2 * 2 * cp * 8  # the pieces' masks, the conv's and the maps' order
    norm = norm_in + s * h * c + s * h * dv * a
    per_sequence = conv + decay + core + norm + gate
    return (b * per_sequence + 2 * h * c + constant) / (b * s)


def _chunked_rule(h: int, P: int, C: int, dk: int, dv: int, c: int) -> int:
    """Bytes one sequence's run of ``chunk_gated_delta_rule`` keeps, ``P`` tokens (padded) in chunks of ``C``, values
    ``dv`` wide (module docstring)."""
    n = P // C
    per_token = 1 + dk + dv + 2 + 5 * dk + dv + dv  # beta, k, v; carry_q / carry_k; k_beta ... k_dec; new_v; v_new
    return c * h * (P * per_token + 5 * n * C * C + n + n * dk * dv)


def _op_outputs(args, sizes, h: int, nk: int, rep: int) -> float:
    """Selective op AC: the matmul outputs it keeps per token: the fused input projections, the chunked rule's
    ``k_beta k^T`` and ``q k^T`` per chunk and its per-chunk state products (three ``C x d_v``, one ``d_k x d_v``;
    under cp with the widened values, plus the scan's ``d_k x d_v`` per map, the corrections and the all-gathered
    maps and halos), ``out_proj``'s."""
    a, c, s, cp = sizes.act_bytes, sizes.compute_bytes, sizes.seq, sizes.cp
    dk, dv, C = args.linear_k_head_dim, args.linear_v_head_dim, args.linear_chunk_size
    proj = s * nk * (2 * dk + 2 * rep * dv) * a + s * 2 * h * a + s * args.dim * a
    if cp == 1:
        P = math.ceil(s / C) * C
        rule = _rule_products(h, P, C, dk, dv, c)
    else:
        P, W = math.ceil(s / 2 / C) * C, dv + dk
        rule = 2 * _rule_products(h, P, C, dk, W, c) + c * h * (2 * cp * dk * dv + s * dv)
        # the all-gathers' outputs (saved like every collective's): the maps, the conv's halos
        channels = nk * 2 * dk + h * dv
        rule += 2 * cp * h * dk * W * c + 2 * cp * min(args.conv_kernel - 1, s // 2) * channels * sizes.act_bytes
    return (proj + rule) / s


def _rule_products(h: int, P: int, C: int, dk: int, dv: int, c: int) -> int:
    n = P // C
    return c * h * (2 * n * C * C + 3 * P * dv + n * dk * dv)
