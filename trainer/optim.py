"""AdamW with 8-bit moments (``--optimizer-state fp8``): a quarter of fp32 AdamW's state.

fp32 AdamW keeps two fp32 moments a parameter, 8 bytes: for SmolLM2-135M 1.08 GB, more than the
weights and their gradients together. Here each moment is stored as 8-bit floats
(``float8_e4m3fn``: 3 mantissa bits, largest 448) with one fp32 scale per block of 256 values,
the block's largest magnitude mapped to 448: 2 bytes a parameter and 1/32 for the scales.

- The first moment ``m`` is stored as it is; the second as its root ``r = sqrt(v)``, which
  halves the range of magnitudes a block must hold (e4m3's normal range is 2^-6..448, 2^15 of
  ``r``, 2^30 of ``v``).
- Each step decodes a chunk of the moments to fp32, takes AdamW's fp32 update on it, and
  encodes it back with *stochastic rounding*: a value between two codes becomes the upper one
  with probability proportional to its distance from the lower, so the stored moment equals
  the fp32 one in expectation. Rounded to nearest, ``v``'s EMA (beta2 = 0.999 moves it 0.1 % a
  step) would stick at a code and never follow the gradients; stochastically it does, with
  noise no larger than the code's spacing (at most 12.5 % of the value in e4m3's normal range).
- Every step's update is clamped to the largest |m̂ / sqrt(v̂)| exact Adam can produce (``bound``):
  a block whose root decodes to 0 while its first moment does not (values below 2^-9 of the
  block's largest root) cannot become a step of lr / eps.

The update, weight decay included, is ``torch.optim.AdamW``'s; only the moments' storage
differs, so with the quantization removed the two agree (tests/test_optim.py). Chunks of
``chunk`` values bound the step's temporary memory to a few times that in fp32. The
rounding draws from torch's default generator, which the trainer seeds per step.
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


def draws(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent sets of ``n`` rounding draws (``stochastic_fp8``), the two 16-bit halves
    of one 32-bit draw each: 16 random bits, shifted to the top of the 20 dropped, plus 8."""
    bits = torch.randint(-(1 << 31), 1 << 31, (n,), dtype=torch.int32, device=device)
    low = (bits & 0xFFFF).bitwise_left_shift_(4).add_(8)
    high = (bits >> 16).bitwise_and_(0xFFFF).bitwise_left_shift_(4).add_(8)
    return low, high


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
    """``torch.optim.AdamW`` (decoupled weight decay, bias-corrected) with its two moments kept
    as block-scaled 8-bit floats (module docstring). Dense fp32 parameters only."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        chunk: int = 1 << 22,
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
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(f"fp8 moments are for fp32 parameters, got {p.dtype}")

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            padded = -(-p.numel() // BLOCK) * BLOCK
            for name in ("exp_avg", "exp_avg_sq_root"):
                state[name] = torch.zeros(padded, dtype=torch.uint8, device=p.device)
                state[name + "_scale"] = torch.ones(padded // BLOCK, device=p.device)
            state["step"] = torch.zeros((), dtype=torch.float32)
        return state

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
                flat, grad = p.view(-1), p.grad.reshape(-1)
                for start in range(0, flat.numel(), chunk):
                    self._update(state, flat, grad, start, min(start + chunk, flat.numel()),
                                 (beta1, beta2), (lr, eps), (correction1, root2), limit)  # fmt: skip
        return loss

    @staticmethod
    def _update(state, flat, grad, start, end, betas, lr_eps, corrections, limit):  # type: ignore[no-untyped-def]
        """AdamW on values [start, end) of one parameter (``start`` on a block boundary)."""
        (beta1, beta2), (lr, eps), (correction1, root2) = betas, lr_eps, corrections
        n, blocks = end - start, slice(start // BLOCK, -(-end // BLOCK))
        codes = slice(blocks.start * BLOCK, blocks.stop * BLOCK)
        g = torch.zeros(codes.stop - codes.start, dtype=torch.float32, device=flat.device)
        g[:n] = grad[start:end]
        m = decode(state["exp_avg"][codes], state["exp_avg_scale"][blocks])
        v = decode(state["exp_avg_sq_root"][codes], state["exp_avg_sq_root_scale"][blocks])
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.square_().mul_(beta2).addcmul_(g, g, value=1 - beta2).sqrt_()  # the new root
        # g's buffer takes the step: lr * m / (1 - b1^t) / (r / sqrt(1 - b2^t) + eps), clamped
        torch.div(v, root2, out=g).add_(eps)
        torch.div(m, g, out=g).mul_(1 / correction1).clamp_(-limit, limit)
        flat[start:end].add_(g[:n], alpha=-lr)
        noise_m, noise_r = draws(g.numel(), g.device)
        encode(m, state["exp_avg"][codes], state["exp_avg_scale"][blocks], noise_m)
        encode(v, state["exp_avg_sq_root"][codes], state["exp_avg_sq_root_scale"][blocks], noise_r)

    def load_state_dict(self, state_dict: dict) -> None:
        """A state this optimizer wrote (an fp32 AdamW's is refused, naming the flag)."""
        if moments_of(state_dict) != _MOMENTS:
            raise ValueError(
                "the saved optimizer state has fp32 AdamW moments, this trainer keeps fp8 "
                "moments: resume it with --optimizer-state fp32"
            )
        super().load_state_dict(state_dict)  # the codes are uint8: not cast


def moments_of(state_dict: dict) -> str:
    """How a saved optimizer state keeps its moments: "fp8" (``Fp8AdamW``) or "fp32"."""
    groups = state_dict.get("param_groups", [])
    return _MOMENTS if any(g.get("moments") == _MOMENTS for g in groups) else "fp32"
