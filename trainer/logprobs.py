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
from collections.abc import Callable
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


# the loss of a pass's (b, T-1) log-probs and entropies (None when not computed)
PassLoss = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


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
    loss: PassLoss | None = None,
) -> TokenStats:
    """Log-probs of ``mb``'s next tokens at each call's temperature, and their entropy (when
    ``entropy``; differentiable when ``entropy_grad``): chunked at the loss mask's positions
    (``chunk`` > 0), or at every position over the whole vocabulary (``chunk`` = 0). A model
    set up for packed rows (trainer/packing.py) runs ``mb``'s rows as one sequence without
    their padding, and with ``share_prefix`` the tokens each run of its rows begins with once
    (``packing.PrefixRuns``); the results are laid out as ``mb``'s either way.

    ``loss``: the loss the caller will take of the results, as a function of them, where each
    position's term reads only that position's log-prob and entropy (GRPO's: trainer/grpo.py).
    A plain ``Linear`` head then makes each chunk's gradient in the forward pass, from the
    logits it has just made (``HeadStats``), instead of making them again in the backward."""
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
        predict = None
        if loss is not None and grad:
            predict = LossGrads(loss, (rows, cols), mask.shape, entropy and entropy_grad)
        lp, ent = HeadStats.apply(
            hidden, head.weight, head.bias, targets, temperature, chunk, entropy, entropy_grad,
            into_grad, predict,
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


class LossGrads:
    """A pass's loss's gradient with respect to one chunk's log-probs (and entropies, when the
    loss differentiates them), from the chunk's values alone: ``loss`` of (b, T-1) tensors that
    hold the chunk's values at their positions (``index``, the chunk's ``part`` of them) and
    zeros elsewhere, differentiated by autograd.

    That is the gradient the whole pass's loss gives the chunk when each position's term reads
    only its own values and the terms are summed with weights the mask decides (trainer/grpo.py's
    ``grpo_loss``): elementwise operations and one linear aggregation, the same operations on
    the same layout as the loss the caller then takes, so the same numbers. ``HeadStats``'s
    backward checks that they are, and makes again, as before, any chunk where they are not."""

    def __init__(
        self,
        loss: PassLoss,
        index: tuple[torch.Tensor, torch.Tensor],
        shape: torch.Size,
        entropy_grad: bool,
    ) -> None:
        self.loss, self.index, self.shape, self.entropy_grad = loss, index, shape, entropy_grad

    def __call__(
        self, part: slice, lp: torch.Tensor, ent: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """d loss / d lp and d loss / d ent (None unless the loss differentiates entropies)."""
        at = (self.index[0][part], self.index[1][part])
        with torch.enable_grad():
            zeros = torch.zeros(self.shape, dtype=lp.dtype, device=lp.device)
            lp_leaf = lp.detach().requires_grad_()
            leaves = [lp_leaf]
            full_ent = None
            if ent is not None:
                ent_leaf = ent.detach().requires_grad_(self.entropy_grad)
                full_ent = zeros.index_put(at, ent_leaf)
                if self.entropy_grad:
                    leaves.append(ent_leaf)
            value = self.loss(zeros.index_put(at, lp_leaf), full_ent)
            grads = torch.autograd.grad(value, leaves, allow_unused=True)
        g_lp = grads[0] if grads[0] is not None else torch.zeros_like(lp)
        if not self.entropy_grad:
            return g_lp, None
        return g_lp, grads[1] if grads[1] is not None else torch.zeros_like(lp)


class HeadStats(torch.autograd.Function):
    """A plain ``Linear`` head's log-probs of ``targets`` and entropies at (N, H) hidden states,
    ``chunk`` positions at a time, in fp32 (fp64 for a float64 model), as one autograd node.

    No (chunk, V) tensor outlives its chunk. A chunk's logits are its one (chunk, V) tensor,
    made into its log-softmax, then its softmax (exp of the log-softmax, in the forward and the
    backward alike: the gradient's bits do not depend on where it is made), then d loss / d
    logits in place, beside
    (``ROWS``, V) temporaries; the head's weight gradient is added chunk by chunk into one
    (V, H) buffer (``addmm_``): with ``into_grad``, the weight's ``.grad`` itself
    (trainer/fused_grads.py). Autograd over per-chunk checkpoints (what wrapped heads still
    take) makes a (V, H) gradient for every chunk and sums them in a buffer of its own: for
    SmolLM2's tied 49,152 x 576 head, 113 MB each, at the step's peak (docs/benchmarks.md,
    "The defaults"). With z = logits / T, p = softmax(z): d log p[y] / dz = onehot(y) - p, and
    d entropy / dz = -p (log p + entropy).

    Given ``predict`` (``LossGrads``: the loss's gradient at a chunk's log-probs), the forward
    makes each chunk's gradients while it holds the chunk's logits: the hidden states' (kept,
    (N, H)) and the weight's (into ``.grad``, or nothing where the weight is frozen). The
    backward then compares the gradient it is handed with the predicted one and makes again,
    from the hidden states, only the chunks where they differ, with the difference: the same
    gradient, with three products of the chunk's size where there were four (the logits made
    again).
    The weight's share is then in ``.grad`` from the forward on: a caller that hands the loss
    runs the backward (the trainer zeroes the gradients at each step's start).
    Without ``predict``, or where the weight's gradient cannot go into ``.grad`` at once, the
    backward makes every chunk again."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, entropy, entropy_grad,  # type: ignore[no-untyped-def,override]
                into_grad=False, predict=None):  # fmt: skip
        dtype = at_least_fp32(hidden).dtype
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        n = hidden.shape[0]
        lp = hidden.new_zeros(n, dtype=dtype)
        ent = hidden.new_zeros(n, dtype=dtype)
        ctx.into_grad = into_grad and weight.dtype == dtype
        ctx.entropy_grad = entropy and entropy_grad
        # the gradients now, only where the weight's needs no buffer held until the backward
        fused = predict is not None and (ctx.into_grad or not weight.requires_grad)
        grads = _Grads.of(hidden, weight, bias, dtype, ctx.into_grad) if fused else None
        predicted_lp = hidden.new_zeros(n, dtype=dtype) if fused else None
        predicted_ent = hidden.new_zeros(n, dtype=dtype) if fused and ctx.entropy_grad else None
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for start in range(0, n, chunk):
                part = slice(start, start + chunk)
                h = hidden[part].to(dtype)
                logp = _log_softmax_(_logits(h, w, b, temperature[part]))
                lp[part] = logp.gather(-1, targets[part].unsqueeze(-1)).squeeze(-1)
                if entropy:
                    ent[part] = _entropy(logp)
                if grads is None:
                    continue
                assert predict is not None and predicted_lp is not None
                g_lp, g_ent = predict(part, lp[part], ent[part] if entropy else None)
                predicted_lp[part] = g_lp
                if predicted_ent is not None:
                    assert g_ent is not None
                    predicted_ent[part] = g_ent
                    probs = logp.exp()  # the entropy's gradient reads log p beside p
                    dz = _dz_(probs, targets[part], g_lp, temperature[part], logp, ent[part], g_ent)
                else:
                    dz = _dz_(logp.exp_(), targets[part], g_lp, temperature[part])
                grads.add(part, dz, h, w)
        ctx.save_for_backward(hidden, weight, bias, targets, temperature)
        ctx.chunk = chunk
        ctx.fused = (grads, predicted_lp, predicted_ent) if grads is not None else None
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
        entropy_grad = ctx.entropy_grad and grad_ent is not None
        if grad_lp is None:
            grad_lp = torch.zeros(hidden.shape[0], dtype=dtype, device=hidden.device)
        if ctx.fused is not None:  # what the forward made, and the rest: the differences
            grads, predicted_lp, predicted_ent = ctx.fused
            ctx.fused = None
            grad_lp = grad_lp.to(dtype) - predicted_lp
            if entropy_grad:
                grad_ent = grad_ent.to(dtype) - predicted_ent
        else:
            grads = _Grads.of(hidden, weight, bias, dtype, ctx.into_grad, need_h, need_w, need_b)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], ctx.chunk):
                part = slice(start, start + ctx.chunk)
                g_lp = grad_lp[part].to(dtype)
                g_ent = grad_ent[part].to(dtype) if entropy_grad else None
                if not (g_lp.any() or (g_ent is not None and g_ent.any())):
                    continue  # no gradient here, or the forward's was the whole of it
                h = hidden[part].to(dtype)
                z = _logits(h, w, b, temperature[part])  # (n, V)
                if g_ent is not None:
                    logp = _log_softmax_(z)
                    ent = _entropy(logp)
                    dz = _dz_(logp.exp(), targets[part], g_lp, temperature[part], logp, ent, g_ent)
                else:  # p as the forward makes it, exp(log_softmax): the same bits either way
                    dz = _dz_(_log_softmax_(z).exp_(), targets[part], g_lp, temperature[part])
                grads.add(part, dz, h, w)
        grad_h, grad_w, grad_b = grads.h, grads.w, grads.b
        return (
            None if grad_h is None or not need_h else grad_h.to(hidden.dtype),
            None if grad_w is None or ctx.into_grad or not need_w else grad_w.to(weight.dtype),
            None if grad_b is None or not need_b else grad_b.to(bias.dtype),
            None, None, None, None, None, None, None,
        )  # fmt: skip


@dataclass
class _Grads:
    """The head's gradients as its chunks add into them: the hidden states', (N, H); the
    weight's, (V, H), ``.grad`` itself with ``into_grad``; the bias's, (V,). None where not
    wanted."""

    h: torch.Tensor | None
    w: torch.Tensor | None
    b: torch.Tensor | None

    @classmethod
    def of(
        cls, hidden, weight, bias, dtype, into_grad,  # type: ignore[no-untyped-def]
        need_h=None, need_w=None, need_b=None,
    ) -> _Grads:  # fmt: skip
        """Zeros for each gradient wanted (by default: each input that requires one)."""
        need_h = hidden.requires_grad if need_h is None else need_h
        need_w = weight.requires_grad if need_w is None else need_w
        need_b = (bias is not None and bias.requires_grad) if need_b is None else need_b
        grad_w = None
        if need_w:
            grad_w = grad_of(weight) if into_grad else torch.zeros_like(weight, dtype=dtype)
        return cls(
            torch.zeros_like(hidden, dtype=dtype) if need_h else None,
            grad_w,
            torch.zeros_like(bias, dtype=dtype) if need_b and bias is not None else None,
        )

    def add(self, part: slice, dz: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        """A chunk's d loss / d logits ``dz`` (n, V) at hidden states ``h`` (n, H)."""
        if self.h is not None:
            self.h[part] += dz @ w
        if self.w is not None:
            self.w.addmm_(dz.t(), h)
        if self.b is not None:
            self.b.add_(dz.sum(0))


def _dz_(
    probs: torch.Tensor,
    targets: torch.Tensor,
    g_lp: torch.Tensor,
    temperature: torch.Tensor,
    logp: torch.Tensor | None = None,
    ent: torch.Tensor | None = None,
    g_ent: torch.Tensor | None = None,
) -> torch.Tensor:
    """d loss / d logits from a chunk's softmax ``probs`` (n, V), written into ``probs``:
    g_lp (onehot(targets) - p) [- g_ent p (log p + ent)], / T. The entropy's term (with
    ``g_ent``) is made in ``logp``'s memory."""
    dtype = probs.dtype
    g = g_lp.to(dtype).unsqueeze(-1)
    ent_term = None
    if g_ent is not None:
        assert logp is not None and ent is not None
        ent_term = logp.add_(ent.to(dtype).unsqueeze(-1)).mul_(probs)
        ent_term.mul_(g_ent.to(dtype).unsqueeze(-1))
    dz = probs.mul_(-g).scatter_add_(-1, targets.unsqueeze(-1), g)
    if ent_term is not None:
        dz.sub_(ent_term)
    return dz.div_(temperature.to(dtype).unsqueeze(-1))


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
