"""Backend "torch": ``torch.nn.functional.scaled_dot_product_attention`` (the fused kernel).

What it adds around torch's kernel, so it agrees with the reference math:

* causal attention with ``i != j`` is aligned bottom-right (torch's ``is_causal`` is top-left),
  by passing an explicit mask in that case;
* a bias is combined with the mask into one additive float mask here, at the kernel boundary,
  with the dtype's finite minimum for blocked positions;
* fully masked rows return zeros: such a row is unblocked before the call (so the kernel never
  sees a row without a key, which would give NaN in some kernels and their gradients) and its
  output is zeroed after it;
* a call whose inputs or bias hold NaN or infinities is served by the reference math instead:
  torch's CPU kernel returns zeros for a NaN query row, which would hide it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit._numerics import all_finite, blocked
from attnkit.functional import attention_math
from attnkit.masks import pad_to_rank
from attnkit.registry import AttentionCall, register_backend

# enable_gqa arrived in torch 2.5; the builtin has no inspectable signature, so read the version.
_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def why_not(call: AttentionCall) -> str | None:
    # It reads a bias as one dense additive mask (a bias function evaluated into one).
    reason = call.modification.unserved(("bias", "bias_fn"), "torch's fused kernel")
    if reason is not None:
        return reason
    if call.sinks is not None:
        return "torch's fused kernel has no attention sinks (sinks)"
    if call.query.is_nested and call.is_causal and call.query.device.type == "cpu":
        return (
            "is_causal with nested (jagged) inputs: torch's CPU kernels have no causal jagged "
            "attention; pad the batch and pass a padding mask with is_causal=True"
        )
    if call.return_weights:
        return "torch's fused kernel does not return the attention weights"
    if call.return_lse:
        return "return_lse=True: torch's fused kernel does not return the log-sum-exp"
    if call.dropout_p > 0.0 and call.generator is not None:
        return "torch's fused kernel draws dropout from the global RNG and cannot take a generator"
    if call.groups > 1 and not _HAS_GQA:
        return f"grouped-query attention needs torch >= 2.5 (have {torch.__version__})"
    if call.query.ndim < 3:
        return "torch's fused kernel needs at least (b, i, d) inputs"
    return None


def run(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    q, k, v = call.query, call.key, call.value
    extra = {"enable_gqa": True} if call.groups > 1 else {}
    # torch's own is_causal flag is used only where it means the same as ours: i == j and
    # nothing else to combine with. Otherwise causality is folded into one dense mask.
    causal_flag = call.is_causal and call.n_queries == call.n_keys
    causal_flag = causal_flag and call.mask is None and call.bias is None
    mask = None if causal_flag else call.dense_mask()
    bias = call.dense_bias(q.dtype)
    meta = q.device.type == "meta"  # shapes only: no value can be looked at
    if not meta and not all_finite(q, k, v, bias):
        return attention_math(call)  # NaN and infinities as the reference has them

    # torch's kernel wants masks with the query's rank; pad broadcastable ones like (j,).
    if mask is not None:
        mask = pad_to_rank(mask, q.ndim)
    if bias is not None:
        bias = pad_to_rank(bias, q.ndim)

    row_has_key = None
    if mask is not None:
        row_has_key = mask.any(dim=-1, keepdim=True)  # (..., i, 1)
        if not meta and bool(row_has_key.all()):
            row_has_key = None  # the common case (padding, causal): nothing to repair
        else:
            mask = mask | ~row_has_key  # a fully masked row attends everywhere; zeroed below
    attn_mask = mask
    if bias is not None:
        attn_mask = bias if mask is None else torch.where(mask, bias, blocked(q.dtype))
    output = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=call.dropout_p,
        is_causal=causal_flag,
        scale=call.scale,
        **extra,
    )
    if row_has_key is not None:
        output = output.masked_fill(~row_has_key, 0.0)
    return output, None


register_backend("torch", run, why_not, description="torch's fused scaled_dot_product_attention")
