"""AdamW with smaller moments (``--optimizer-state fp8``): 3 bytes a parameter instead of 8.

fp32 AdamW keeps two fp32 moments a parameter, 8 bytes: for SmolLM2-135M 1.08 GB, more than the
weights and their gradients together. Here:

- the first moment ``m`` is kept as 8-bit floats (``float8_e4m3fn``: 3 mantissa bits, largest
  448) with one fp32 scale per block of 256 values, the block's largest magnitude mapped to 448:
  1.02 bytes a parameter;
- the second moment is kept as its root ``r = sqrt(v)`` in bfloat16 (7 mantissa bits, fp32's
  range): 2 bytes. Its EMA moves 0.1 % a step (beta2 = 0.999), so its rounding error stays in
  it for about a thousand steps: with e4m3's 3 mantissa bits the stored root drifted 16 % (sd,
  per value) from fp32's over 3,000 steps of random gradients, with bfloat16's about 1 %.

Each step decodes a chunk of the moments to fp32, takes AdamW's fp32 update on it, and encodes
it back with *stochastic rounding*: a value between two codes becomes the upper one with
probability proportional to its distance from the lower, so the stored moment equals the fp32
one in expectation. Rounded to nearest, ``v``'s EMA would stick at a code whenever a step moves
it less than half a code, and stop following the gradients.

Every step's update is clamped to the largest |m̂ / sqrt(v̂)| exact Adam can produce (``bound``),
so a decoding error cannot become a step of lr / eps. The update, weight decay included, is
``torch.optim.AdamW``'s, and the first step (moments zero, decoded exactly) is AdamW's to fp32
rounding (tests/test_optim.py). Chunks of ``chunk`` values (1M: about 40 MB of fp32
temporaries) bound the step's temporary memory, and ``release_grads`` drops each parameter's
gradient once its update is taken.
The rounding draws come from a generator seeded by the trainer's seed, the step and the
parameter (``_generator``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

BLOCK = 256  # values sharing one scale
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
_DROP = 20  # fp32 mantissa bits e4m3 does not keep (23 - 3)
_MOMENTS = "fp8"  # the param group's "moments", checked when a state is loaded


def stochastic_fp8(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32, |x| <= 448) as e4m3 codes (uint8), rounded stochastically. ``noise``: int32
    draws, uniform over the multiples of 16 in [0, 2^20) plus 8 (``draws``), one a value.

    The draw is added to the fp32 bits and the 20 bits e4m3 drops are cleared: the magnitude
    rounds up with probability the dropped fraction (to within 2^-16 of a code's spacing). In
    e4m3's normal range the result is a code; below 2^-6 (values under 1/28,672 of their
    block's largest) e4m3's codes are 2^-9 apart and the cast rounds the result to the nearest,
    a bias under 2^-10, 2.2e-6 of the block's largest value."""
    rounded = ((x.view(torch.int32) + noise) & -(1 << _DROP)).view(torch.float32)
    return rounded.to(FP8).view(torch.uint8)


def draws(
    n: int, device: torch.device, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounding draws for ``n`` values, from one 32-bit draw each: for e4m3 (``stochastic_fp8``)
    its high 16 bits shifted to the top of the 20 bits e4m3 drops, plus 8 (the middle of the
    16 values they stand for); for bfloat16 (``stochastic_bf16``) its low 16 bits, exactly the
    bits bfloat16 drops."""
    bits = torch.randint(
        -(1 << 31), 1 << 31, (n,), dtype=torch.int32, device=device, generator=generator
    )
    fp8 = (bits >> 16).bitwise_and_(0xFFFF).bitwise_left_shift_(4).add_(8)
    return fp8, bits.bitwise_and_(0xFFFF)


def stochastic_bf16(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32, finite) as bfloat16, rounded stochastically (``noise``: uniform in
    [0, 2^16)): the draw added to the fp32 bits, the 16 bits bfloat16 drops cleared; exactly
    unbiased (the magnitude rounds up with probability the dropped fraction)."""
    rounded = ((x.view(torch.int32) + noise) & -(1 << 16)).view(torch.float32)
    return rounded.to(torch.bfloat16)


def encode(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, noise) -> None:  # type: ignore[no-untyped-def]
    """Store ``values`` (fp32, a whole number of blocks; overwritten) into ``codes`` (uint8)
    and ``scales``, rounding with ``noise`` (``stochastic_fp8``)."""
    blocks = values.view(-1, BLOCK)
    absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    blocks.mul_((1.0 / scale)[:, None]).clamp_(-FP8_MAX, FP8_MAX)
    codes.copy_(stochastic_fp8(values, noise))
    scales.copy_(scale)


_TABLES: dict[torch.device, torch.Tensor] = {}


def _table(device: torch.device) -> torch.Tensor:
    """The fp32 value of each of the 256 e4m3 codes (its two NaNs read 0: never written)."""
    table = _TABLES.get(device)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8).view(FP8).to(torch.float32)
        table = torch.nan_to_num(table, nan=0.0).to(device)
        _TABLES[device] = table
    return table


def decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``codes`` (uint8, a whole number of blocks) and their ``scales``: a table
    look-up (torch's own e4m3-to-fp32 cast is several times slower on the CPU)."""
    values = _table(codes.device).index_select(0, codes.to(torch.int32))
    return values.view(-1, BLOCK).mul_(scales[:, None]).view(-1)


def bound(beta1: float, beta2: float, step: int) -> float:
    """The largest |m̂ / sqrt(v̂)| exact Adam reaches at ``step`` (1-based), any gradients.

    m_t = (1-b1) sum_k b1^k g_{t-k} and v_t = (1-b2) sum_k b2^k g_{t-k}^2 over k < t; by
    Cauchy-Schwarz |m_t| <= (1-b1) sqrt(sum_k b1^2k / b2^k) sqrt(v_t / (1-b2)). With the bias
    corrections m̂ = m_t / (1-b1^t), v̂ = v_t / (1-b2^t): the value returned."""
    ratio = beta1 * beta1 / beta2
    series = step if ratio == 1 else (1 - ratio**step) / (1 - ratio)
    return (1 - beta1) / (1 - beta1**step) * math.sqrt(series * (1 - beta2**step) / (1 - beta2))


class Fp8AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` (decoupled weight decay, bias-corrected) with its first moment
    kept as block-scaled 8-bit floats and its second moment's root as bfloat16 (module
    docstring). Dense fp32 parameters only."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        chunk: int = 1 << 20,
        release_grads: bool = False,
    ) -> None:
        if chunk <= 0 or chunk % BLOCK:
            raise ValueError(f"chunk must be a positive multiple of {BLOCK}, got {chunk}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "chunk": chunk,
            "moments": _MOMENTS,
        }
        super().__init__(params, defaults)
        # drop each parameter's gradient once its update is taken: the step's memory falls as
        # it goes, where it would otherwise peak at its end (the gradients, the moments and a
        # chunk's temporaries at once); for a caller that zeroes the gradients after the step
        self.release_grads = release_grads
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(f"fp8 moments are for fp32 parameters, got {p.dtype}")

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            padded = -(-p.numel() // BLOCK) * BLOCK
            state["exp_avg"] = torch.zeros(padded, dtype=torch.uint8, device=p.device)
            state["exp_avg_scale"] = torch.ones(padded // BLOCK, device=p.device)
            state["exp_avg_sq_root"] = torch.zeros(padded, dtype=torch.bfloat16, device=p.device)
            state["step"] = torch.zeros((), dtype=torch.float32)
        return state

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0  # the parameter's place, in the draws' seed
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, chunk = group["lr"], group["eps"], group["chunk"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Fp8AdamW does not take sparse gradients")
                state = self._state_of(p)
                state["step"] += 1
                t = int(state["step"])
                correction1 = 1 - beta1**t
                root2 = math.sqrt(1 - beta2**t)
                limit = bound(beta1, beta2, t)
                if group["weight_decay"]:
                    p.mul_(1 - lr * group["weight_decay"])
                index += 1
                generator = _generator(p.device, t, index)
                flat, grad = p.view(-1), p.grad.reshape(-1)
                for start in range(0, flat.numel(), chunk):
                    self._update(state, flat, grad, start, min(start + chunk, flat.numel()),
                                 (beta1, beta2), (lr, eps), (correction1, root2), limit,
                                 generator)  # fmt: skip
                if self.release_grads:
                    p.grad = None
        return loss

    @staticmethod
    def _update(state, flat, grad, start, end, betas, lr_eps, corrections, limit, generator):  # type: ignore[no-untyped-def]
        """AdamW on values [start, end) of one parameter (``start`` on a block boundary)."""
        (beta1, beta2), (lr, eps), (correction1, root2) = betas, lr_eps, corrections
        n, blocks = end - start, slice(start // BLOCK, -(-end // BLOCK))
        codes = slice(blocks.start * BLOCK, blocks.stop * BLOCK)
        g = torch.zeros(codes.stop - codes.start, dtype=torch.float32, device=flat.device)
        g[:n] = grad[start:end]
        m = decode(state["exp_avg"][codes], state["exp_avg_scale"][blocks])
        v = state["exp_avg_sq_root"][codes].to(torch.float32)
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.square_().mul_(beta2).addcmul_(g, g, value=1 - beta2).sqrt_()  # the new root
        # g's buffer takes the step: lr * m / (1 - b1^t) / (r / sqrt(1 - b2^t) + eps), clamped
        torch.div(v, root2, out=g).add_(eps)
        torch.div(m, g, out=g).mul_(1 / correction1).clamp_(-limit, limit)
        flat[start:end].add_(g[:n], alpha=-lr)
        noise_m, noise_r = draws(g.numel(), g.device, generator)
        encode(m, state["exp_avg"][codes], state["exp_avg_scale"][blocks], noise_m)
        state["exp_avg_sq_root"][codes] = stochastic_bf16(v, noise_r)

    def load_state_dict(self, state_dict: dict) -> None:
        """A state this optimizer wrote (an fp32 AdamW's is refused, naming the flag)."""
        if moments_of(state_dict) != _MOMENTS:
            raise ValueError(
                "the saved optimizer state has fp32 AdamW moments, this trainer keeps fp8 "
                "moments: resume it with --optimizer-state fp32"
            )
        super().load_state_dict(state_dict)  # casts the bfloat16 roots to fp32: back, exactly
        for state in self.state.values():
            state["exp_avg_sq_root"] = state["exp_avg_sq_root"].to(torch.bfloat16)


def _generator(device: torch.device, step: int, index: int) -> torch.Generator:
    """The rounding draws of parameter ``index`` at its ``step``: a generator seeded from the
    seed the trainer set (``torch.initial_seed()``), the step and the parameter, so every step
    and parameter draws afresh, and data-parallel ranks, which draw different amounts in their
    forward passes, round alike and their replicas stay equal."""
    generator = torch.Generator(device=device)
    seed = (torch.initial_seed() * 1_000_003 + step * 7_919 + index) % (1 << 63)
    generator.manual_seed(seed)
    return generator


def moments_of(state_dict: dict) -> str:
    """How a saved optimizer state keeps its moments: "fp8" (``Fp8AdamW``) or "fp32"."""
    groups = state_dict.get("param_groups", [])
    return _MOMENTS if any(g.get("moments") == _MOMENTS for g in groups) else "fp32"
