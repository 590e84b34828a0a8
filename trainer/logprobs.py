"""The policy's log-probs (and entropy) at the positions the loss reads, in fp32, in chunks.

The obvious ``model(...).logits`` projects every position of every row, prompts and padding
included, onto the whole vocabulary: for SmolLM2 (V = 49,152) a batch of 16 rows of 300 tokens
is 940 MB of fp32 logits, and log_softmax, its saved output and its gradient each add as much
again. The loss reads only the model's own tokens (``loss_mask``), so here the model's head
computes one position per row (``logits_to_keep=1``), the decoder's hidden states — what the
head reads — are taken by a forward hook, the N masked positions (shifted: position t - 1
predicts token t) are selected, and the head plus log_softmax run on them ``chunk`` positions
at a time, in fp32 (bf16 autocast or not), each chunk under ``torch.utils.checkpoint``: a chunk's
(chunk, V) tensors are freed as soon as its log-probs are read and recomputed in the backward
pass, so no (N, V) tensor is ever held (bench/trainer_memory.py measures what that saves).

Calling the whole model (not its decoder alone) keeps every wrapper's hooks in place: peft's
LoRA layers live inside the decoder, and FSDP2 gathers the root's parameters (embeddings, head)
in the root's forward and keeps them gathered until the backward (fully_shard's root is never
resharded after forward), so the head's weight is whole when the chunks use it.

``chunk`` = 0 is the whole-vocabulary path at every position (kept to compare against). It is
also taken when a model cannot be split this way: its
``forward`` has no ``logits_to_keep`` (transformers before 4.48), or its logits are more than
``lm_head(hidden)`` (Gemma's final soft-capping, Cohere's and Granite's logit scaling).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from . import packing
from .batch import Batch
from .fused_grads import fusable, grad_of
from .grpo import at_least_fp32, token_entropy, token_logprobs
from .packing import pack

# config attributes of models whose logits are not lm_head(hidden) alone
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass(frozen=True)
class TokenStats:
    """(b, T-1) each, aligned on target positions; 0 where the loss mask is off (chunked)."""

    logprobs: torch.Tensor  # fp32, with gradient when the forward had one
    entropy: torch.Tensor | None  # fp32; with gradient only when asked (the entropy bonus)


def causal_lm(model):
    """The transformers model inside a wrapper (peft's PeftModel; FSDP2 keeps the class)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def splittable(model) -> bool:
    """Whether ``model``'s logits are its head on its decoder's hidden states, and its forward
    can be asked to project one position only."""
    causal = causal_lm(model)
    config = getattr(causal, "config", None)
    if any(getattr(config, name, None) for name in _LOGIT_TRANSFORMS):
        return False
    if not callable(getattr(causal, "get_decoder", None)):
        return False
    if causal.get_output_embeddings() is None:
        return False
    return "logits_to_keep" in inspect.signature(causal.forward).parameters


def token_stats(
    model,
    mb: Batch,
    *,
    chunk: int,
    entropy: bool = True,
    entropy_grad: bool = False,
    bf16_autocast: bool = False,
    share_prefix: bool = True,
) -> TokenStats:
    """Log-probs of ``mb``'s next tokens at each call's temperature, and their entropy (when
    ``entropy``; differentiable when ``entropy_grad``): chunked at the loss mask's positions
    (``chunk`` > 0), or at every position over the whole vocabulary (``chunk`` = 0). A model
    set up for packed rows (trainer/packing.py) runs ``mb``'s rows as one sequence without
    their padding, and with ``share_prefix`` the tokens each run of its rows begins with once
    (``packing.PrefixRuns``); the results are laid out as ``mb``'s either way."""
    device_type = mb.input_ids.device.type
    autocast = torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=bf16_autocast)
    packed = (
        pack(mb.input_ids, mb.attention_mask, share_prefix=share_prefix)
        if packing.enabled(causal_lm(model))
        else None
    )
    inputs = (
        packed.forward_kwargs()
        if packed is not None
        else {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask}
    )
    rows_packed = packing.packed_forward() if packed is not None else contextlib.nullcontext()
    if chunk <= 0 or not splittable(model):
        with autocast, rows_packed:
            logits = model(**inputs).logits
        if packed is not None:
            logits = packed.unpack(logits, mb.input_ids.shape[1])  # (b, T, V), zeros past rows
        logits = logits[:, :-1]  # (b, T-1, V): position t predicts token t + 1
        targets, temperature = mb.input_ids[:, 1:], mb.temperature[:, 1:]  # (b, T-1)
        logprobs = token_logprobs(logits, targets, temperature)  # (b, T-1)
        ent = None
        if entropy:
            ent = token_entropy(logits if entropy_grad else logits.detach(), temperature)
        return TokenStats(logprobs, ent)

    causal = causal_lm(model)
    captured: list[torch.Tensor] = []
    hook = causal.get_decoder().register_forward_hook(
        lambda _module, _args, output: captured.append(output[0])
    )
    try:
        with autocast, rows_packed:
            model(
                **inputs,
                logits_to_keep=1,  # the model's own head: one position a row, unused
                use_cache=False,
            )
    finally:
        hook.remove()
    assert len(captured) == 1, f"the decoder ran {len(captured)} times in one forward"
    mask = mb.loss_mask[:, 1:]  # (b, T-1)
    rows, cols = mask.nonzero(as_tuple=True)  # N positions, row-major
    if packed is not None:  # (1, tokens, H): a row's position t sits at its start + t
        hidden = captured[0][0][packed.flat_index(rows, cols)]  # (N, H)
    else:
        hidden = captured[0][:, :-1][rows, cols]  # (N, H)
    targets = mb.input_ids[:, 1:][rows, cols]  # (N,)
    temperature = mb.temperature[:, 1:][rows, cols]  # (N,)
    head = causal.get_output_embeddings()
    grad = torch.is_grad_enabled()
    if type(head) is torch.nn.Linear:  # the usual case: one autograd node for every chunk
        into_grad = fusable(head.weight, model) and fusable(head.weight, causal)
        lp, ent = HeadStats.apply(
            hidden, head.weight, head.bias, targets, temperature, chunk, entropy, entropy_grad,
            into_grad,
        )  # fmt: skip
        zeros = torch.zeros(mask.shape, dtype=lp.dtype, device=mask.device)
        return TokenStats(
            zeros.index_put((rows, cols), lp),
            zeros.index_put((rows, cols), ent) if entropy else None,
        )
    lp_parts, ent_parts = [], []
    # At least one chunk, even empty: the head's weight then gets its (zero) gradient on a
    # rank with no loss token, so sharded ranks reduce the same set of gradients.
    for start in range(0, max(len(targets), 1), chunk):
        part = slice(start, start + chunk)
        args = (head, hidden[part], targets[part], temperature[part], entropy, entropy_grad)
        if grad:
            lp, ent = checkpoint(_chunk_stats, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            lp, ent = _chunk_stats(*args)
        lp_parts.append(lp)
        ent_parts.append(ent)
    picked = torch.cat(lp_parts)  # (N,) fp32, or fp64 for a float64 model
    zeros = torch.zeros(mask.shape, dtype=picked.dtype, device=mask.device)
    logprobs = zeros.index_put((rows, cols), picked)  # (b, T-1)
    ent = zeros.index_put((rows, cols), torch.cat(ent_parts)) if entropy else None
    return TokenStats(logprobs, ent)


def _chunk_stats(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, H) hidden states -> (n,) log-probs of ``targets`` and (n,) entropies (zeros when
    not asked), through the head in fp32."""
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        logits = _head_fp32(head, hidden) / temperature.unsqueeze(-1)  # (n, V)
        logp = torch.log_softmax(logits, dim=-1)  # (n, V)
        lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (n,)
        if not entropy:
            return lp, torch.zeros_like(lp)
        src = logp if entropy_grad else logp.detach()
        return lp, -(src.exp() * src).sum(-1)  # (n,)


class HeadStats(torch.autograd.Function):
    """A plain ``Linear`` head's log-probs of ``targets`` and entropies at (N, H) hidden states,
    ``chunk`` positions at a time, in fp32 (fp64 for a float64 model), as one autograd node.

    Forward keeps no (chunk, V) tensor; backward recomputes each chunk's softmax and adds the
    chunk's share of the head's weight gradient into one (V, H) buffer (``addmm_``). A chunk's
    logits are its one (chunk, V) tensor, made into its log-softmax (forward) or its softmax
    and then its gradient (backward) in place, beside (``ROWS``, V) temporaries: with
    ``into_grad``, the weight's ``.grad`` itself (trainer/fused_grads.py). Autograd
    over per-chunk checkpoints (what wrapped heads still take) makes a (V, H) gradient for every
    chunk and sums them in a buffer of its own: for SmolLM2's tied 49,152 x 576 head, 113 MB
    each, at the step's peak (docs/benchmarks.md, "The defaults"). With z = logits / T,
    p = softmax(z): d log p[y] / dz = onehot(y) - p, and d entropy / dz = -p (log p + entropy).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, entropy, entropy_grad,  # type: ignore[no-untyped-def,override]
                into_grad=False):  # fmt: skip
        dtype = at_least_fp32(hidden).dtype
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        n = hidden.shape[0]
        lp = hidden.new_zeros(n, dtype=dtype)
        ent = hidden.new_zeros(n, dtype=dtype)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for start in range(0, n, chunk):
                part = slice(start, start + chunk)
                logp = _log_softmax_(_logits(hidden[part].to(dtype), w, b, temperature[part]))
                lp[part] = logp.gather(-1, targets[part].unsqueeze(-1)).squeeze(-1)
                if entropy:
                    ent[part] = _entropy(logp)
        ctx.save_for_backward(hidden, weight, bias, targets, temperature)
        ctx.chunk, ctx.entropy_grad = chunk, entropy and entropy_grad
        ctx.into_grad = into_grad and weight.dtype == dtype
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):  # type: ignore[no-untyped-def,override]
        hidden, weight, bias, targets, temperature = ctx.saved_tensors
        dtype = at_least_fp32(hidden).dtype
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden, dtype=dtype) if need_h else None
        grad_w = None
        if need_w:
            grad_w = grad_of(weight) if ctx.into_grad else torch.zeros_like(w)
        grad_b = torch.zeros_like(b) if need_b and b is not None else None
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], ctx.chunk):
                part = slice(start, start + ctx.chunk)
                h = hidden[part].to(dtype)
                z = _logits(h, w, b, temperature[part])  # (n, V)
                entropy_grad = ctx.entropy_grad and grad_ent is not None
                # the chunk's one (n, V) tensor becomes p, then d loss / d z, in place; the
                # entropy's gradient needs log p beside it
                logp = _log_softmax_(z) if entropy_grad else None
                probs = logp.exp() if logp is not None else _softmax_(z)
                # dz = g_lp (onehot - p) [- g_ent p (log p + entropy)], then / T for the logits
                dz = probs.mul_(-grad_lp[part].to(dtype).unsqueeze(-1))
                dz.scatter_add_(-1, targets[part].unsqueeze(-1),
                                grad_lp[part].to(dtype).unsqueeze(-1))  # fmt: skip
                if logp is not None:
                    p = logp.exp()
                    ent = -(p * logp).sum(-1, keepdim=True)
                    dz.sub_(p.mul_(logp.add_(ent)).mul_(grad_ent[part].to(dtype).unsqueeze(-1)))
                dz.div_(temperature[part].to(dtype).unsqueeze(-1))  # d loss / d logits
                if grad_h is not None:
                    grad_h[part] = dz @ w
                if grad_w is not None:
                    grad_w.addmm_(dz.t(), h)
                if grad_b is not None:
                    grad_b.add_(dz.sum(0))
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None or ctx.into_grad else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None, None, None, None, None, None,
        )  # fmt: skip


# rows of a chunk exponentiated at a time where the result is not kept: the head's one (n, V)
# temporary beyond its logits is (ROWS, V)
ROWS = 32


def _logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature
) -> torch.Tensor:
    """(n, H) hidden states -> (n, V) tempered logits."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return logits.div_(temperature.to(logits.dtype).unsqueeze(-1))


def _log_softmax_(z: torch.Tensor) -> torch.Tensor:
    """``log_softmax(z, -1)`` of an (n, V) ``z``, written into ``z``: z - max - log sum exp(z -
    max), as torch's kernel computes it, the sums ``ROWS`` rows at a time."""
    z.sub_(z.amax(-1, keepdim=True))
    sums = z.new_empty(z.shape[0], 1)
    for start in range(0, z.shape[0], ROWS):
        sums[start : start + ROWS] = z[start : start + ROWS].exp().sum(-1, keepdim=True)
    return z.sub_(sums.log_())


def _softmax_(z: torch.Tensor) -> torch.Tensor:
    """``softmax(z, -1)`` of an (n, V) ``z``, written into ``z``."""
    z.sub_(z.amax(-1, keepdim=True)).exp_()
    return z.div_(z.sum(-1, keepdim=True))


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """(n, V) log-probs -> (n,) entropies, -sum p log p, ``ROWS`` rows of p at a time."""
    out = logp.new_empty(logp.shape[0])
    for start in range(0, logp.shape[0], ROWS):
        rows = logp[start : start + ROWS]
        out[start : start + ROWS] = rows.exp().mul_(rows).sum(-1).neg_()
    return out


def _head_fp32(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The output head on ``hidden`` in fp32 (a plain Linear's weight is upcast if it is not,
    as FSDP's bf16 compute copy is; a float64 model stays in fp64); a wrapped head (LoRA on
    lm_head) runs as it is."""
    if type(head) is torch.nn.Linear:
        bias = None if head.bias is None else at_least_fp32(head.bias)
        return torch.nn.functional.linear(at_least_fp32(hidden), at_least_fp32(head.weight), bias)
    return at_least_fp32(head(hidden))
