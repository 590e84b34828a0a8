"""Chunked log-probs (``--logprob-chunk``, trainer/logprobs.py) against the whole-vocabulary path
(``--logprob-chunk 0``, the model's own logits): the same loss, statistics and gradient on the
tiny model, with per-call temperatures, stale (tis) tokens, the entropy bonus and the KL
reference, bare and with LoRA adapters; only the loss's positions go through log_softmax, a
chunk at a time; under bf16 autocast the head runs in fp32. (FSDP2 shards against the whole
path: tests/test_fsdp.py.)"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from updatelib import BASE, TOL, V, assert_same_update, batch, update

from agentarium.tiny import ensure_tiny_model
from agentarium.trainer.grpo import token_logprobs
from agentarium.trainer.logprobs import splittable, token_stats
from agentarium.trainer.step import StepSettings, Totals, forward_backward, load_model

pytestmark = pytest.mark.kernels  # run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny():
    return ensure_tiny_model()


@pytest.mark.parametrize("chunk", [1, 7, 512])
def test_chunks_give_the_whole_paths_loss_stats_and_gradient(tiny, chunk):
    model = load_model(tiny, "cpu", dtype="float64")  # fp64: see assert_same_update's tolerance
    ref = load_model(tiny, "cpu", trainable=False, dtype="float64")
    with torch.no_grad():  # a reference apart from the policy, so the KL term is not 0
        for p in ref.parameters():
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
            p.add_(0.02 * noise.to(p.dtype))
    assert splittable(model)
    base = dict(kl_coef=0.1, entropy_coef=0.01, clip_low=0.1, clip_high=0.3)
    whole = update(model, ref, batch(), StepSettings(logprob_chunk=0, **base))
    chunked = update(model, ref, batch(), StepSettings(logprob_chunk=chunk, **base))
    assert whole[1].kl > 1e-4 and whole[1].entropy > 0
    assert_same_update(whole, chunked)
    # micro-batches of the chunked path add up to the same
    micro = update(
        model, ref, batch(), StepSettings(logprob_chunk=chunk, micro_batch_size=2, **base)
    )
    assert_same_update(whole, micro)


def test_with_lora_adapters_the_chunked_path_trains_the_same(tiny):
    pytest.importorskip("peft")
    from agentarium.trainer.lora import with_lora

    model = with_lora(
        load_model(tiny, "cpu", dtype="float64"), rank=4, alpha=8, target_modules=("all-linear",)
    )
    with torch.no_grad():  # B = 0 at the start: give the adapters a value to differentiate
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    assert splittable(model)
    whole = update(model, None, batch(), StepSettings(logprob_chunk=0, entropy_coef=0.01))
    chunked = update(model, None, batch(), StepSettings(logprob_chunk=5, entropy_coef=0.01))
    assert all("lora_" in name for name in whole[2])
    assert_same_update(whole, chunked)


class Shapes(TorchFunctionMode):
    """The input shapes of every log_softmax call, and the shape and dtype of every (.., V)
    projection."""

    def __init__(self) -> None:
        super().__init__()
        self.log_softmax: list[tuple[int, ...]] = []
        self.head_shapes: list[tuple[int, ...]] = []
        self.head_dtypes: list[torch.dtype] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.log_softmax, torch.nn.functional.log_softmax, torch.Tensor.log_softmax):
            self.log_softmax.append(tuple(args[0].shape))
        if func is torch.nn.functional.linear and out.shape[-1] == V:
            self.head_shapes.append(tuple(out.shape))
            self.head_dtypes.append(out.dtype)
        return out


def test_only_the_loss_positions_go_through_the_head_a_chunk_at_a_time(tiny):
    model = load_model(tiny, "cpu", dtype="float64")  # the comparison below: fp64, as above
    data = batch()
    n = int(data.loss_mask[:, 1:].sum())
    with Shapes() as whole:
        token_stats(model, data, chunk=0)
    assert whole.log_softmax[0] == (data.rows, data.input_ids.shape[1] - 1, V)
    with Shapes() as chunked:
        stats = token_stats(model, data, chunk=8)
    # the model's own head at one position a row (logits_to_keep=1, unused), then the chunks,
    # whose log-softmax is taken in place (HeadStats): no (.., V) tensor beyond the chunk's
    assert chunked.head_shapes[0] == (data.rows, 1, V)
    assert chunked.head_shapes[1:] == [(8, V)] * (n // 8) + [(n % 8, V)] * (n % 8 > 0)
    assert chunked.log_softmax == []
    # ... and their log-probs are the model's own logits' at the sampling temperatures
    mask = data.loss_mask[:, 1:]
    with torch.no_grad():
        logits = model(input_ids=data.input_ids, attention_mask=data.attention_mask).logits
        want = token_logprobs(logits[:, :-1], data.input_ids[:, 1:], data.temperature[:, 1:])
    # the same logits, sliced before the head or after it: sums of <= 600 terms in fp64, as in
    # assert_same_update (log-probs >= -10 here, so 7e-14 relative is < 1e-12 absolute)
    assert stats.logprobs.dtype == torch.float64
    torch.testing.assert_close(stats.logprobs[mask], want[mask].detach(), atol=TOL, rtol=TOL)
    assert float(stats.logprobs.detach()[~mask].abs().max()) == 0.0


def test_a_pass_with_no_loss_token_still_gives_the_head_a_zero_gradient(tiny):
    # a sharded rank's idle pass: its ranks must reduce the same gradients (trainer/fsdp.py)
    from agentarium.trainer.fsdp import idle_pass

    model = load_model(tiny, "cpu")
    data = idle_pass()
    loss, sums = forward_backward(model, None, data, StepSettings(), Totals.of(data), "cpu")
    assert (loss, sums.tokens) == (0.0, 0.0)
    head = model.get_output_embeddings().weight
    assert head.grad is not None and float(head.grad.abs().max()) == 0.0


def test_under_bf16_autocast_the_chunked_head_runs_in_fp32(tiny):
    model = load_model(tiny, "cpu")
    data = batch()
    mask = data.loss_mask[:, 1:]
    with torch.no_grad():
        fp32 = token_stats(model, data, chunk=0).logprobs[mask]
        with Shapes() as whole:
            whole_bf16 = token_stats(model, data, chunk=0, bf16_autocast=True).logprobs[mask]
        with Shapes() as chunked:
            chunked_bf16 = token_stats(model, data, chunk=16, bf16_autocast=True).logprobs[mask]
    assert whole.head_dtypes == [torch.bfloat16]
    # the model's own head (one position a row, unused) in bf16, then every chunk in fp32
    assert chunked.head_dtypes[0] == torch.bfloat16
    assert chunked.head_dtypes[1:] == [torch.float32] * -(-int(mask.sum()) // 16)
    # bf16 decoder either way; the fp32 head removes the logits' own bf16 rounding
    err_whole = float((whole_bf16 - fp32).abs().max())
    err_chunked = float((chunked_bf16 - fp32).abs().max())
    assert err_chunked < err_whole, (err_chunked, err_whole)


def _head_inputs(seed: int, *, n: int, h: int, v: int):
    """A head's inputs in fp64 (hidden states, weight, bias: with gradients), targets,
    per-position temperatures in [0.5, 1.5), and the generator, for more draws."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    temperature = torch.rand(n, dtype=torch.float64, generator=g) + 0.5
    return hidden, weight, bias, targets, temperature, g


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_heads_one_node_has_autograds_gradient_bias_included(entropy_grad):
    """``HeadStats`` (a plain Linear head, chunks in one autograd node) against torch's
    numerical gradient (``gradcheck``, fp64), with a bias, per-position temperatures, a chunk
    that does not divide the positions, and the entropy differentiated or not."""
    from agentarium.trainer.logprobs import HeadStats

    hidden, weight, bias, targets, temperature, _ = _head_inputs(5, n=7, h=4, v=11)

    def stats(hidden, weight, bias):
        lp, ent = HeadStats.apply(hidden, weight, bias, targets, temperature, 3, True, entropy_grad)
        return (lp, ent) if entropy_grad else lp

    assert torch.autograd.gradcheck(stats, (hidden, weight, bias))
    lp, ent = HeadStats.apply(hidden, weight, bias, targets, temperature, 3, True, entropy_grad)
    logp = torch.log_softmax((hidden @ weight.T + bias) / temperature[:, None], dim=-1)
    torch.testing.assert_close(lp, logp.gather(-1, targets[:, None]).squeeze(-1))
    torch.testing.assert_close(ent, -(logp.exp() * logp).sum(-1))
    assert ent.requires_grad == entropy_grad


def test_a_tied_weights_gradient_added_into_grad_is_autograds(tiny, monkeypatch):
    """trainer/fused_grads.py on a tied embedding and head (the tiny model tied by hand, fp64):
    the embedding lookup (``FusedEmbedding``) and the head (``HeadStats``) add their gradients
    into ``.grad`` over passes of two rows, and the update is autograd's own (the same sums in
    another order: ``TOL``)."""
    from agentarium.trainer import fused_grads, logprobs

    model = load_model(tiny, "cpu", dtype="float64")
    model.lm_head.weight = model.get_input_embeddings().weight  # tied
    assert fused_grads.fuse_embedding(model)
    assert type(model.get_input_embeddings()) is fused_grads.FusedEmbedding
    assert fused_grads.fusable(model.lm_head.weight, model)  # both paths add into .grad
    settings = StepSettings(logprob_chunk=7, micro_batch_size=2, entropy_coef=0.01)
    fused = update(model, None, batch(), settings)
    for module in (fused_grads, logprobs):
        monkeypatch.setattr(module, "fusable", lambda weight, model: False)
    plain = update(model, None, batch(), settings)
    assert_same_update(plain, fused)


def test_the_embeddings_gradient_added_into_grad_skips_padding_and_accumulates():
    from agentarium.trainer.fused_grads import EmbeddingIntoGrad

    g = torch.Generator().manual_seed(7)
    weight = torch.randn(11, 4, dtype=torch.float64, generator=g, requires_grad=True)
    ids = torch.tensor([[1, 3, 3, 0, 10], [3, 0, 0, 5, 1]])
    scale = torch.randn(2, 5, 4, dtype=torch.float64, generator=g)
    expected = torch.autograd.grad((torch.nn.functional.embedding(ids, weight, 0) * scale).sum(),
                                   weight)[0]  # fmt: skip
    for times in (1, 2):  # a second pass adds into the first's gradient
        out = EmbeddingIntoGrad.apply(ids, weight, 0)
        torch.testing.assert_close(out, torch.nn.functional.embedding(ids, weight, 0))
        (out * scale).sum().backward()
        torch.testing.assert_close(weight.grad, times * expected, rtol=1e-12, atol=1e-12)
    assert float(weight.grad[0].abs().sum()) == 0.0  # the padding row


def test_every_linears_gradient_added_into_grad_is_autograds(tiny, monkeypatch):
    """trainer/fused_grads.py's ``FusedLinear``: every Linear of the decoder adds its weight
    gradient into ``.grad`` (``addmm_``) over passes of two rows, under activation
    checkpointing (its forward runs again in the backward pass), and the update is autograd's
    own (the same sums in another order: ``TOL``, fp64)."""
    from agentarium.trainer import fused_grads

    model = load_model(tiny, "cpu", dtype="float64")
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert fused_grads.fuse_linears(model) == len(linears) - 1  # all but the output head
    assert type(model.get_output_embeddings()) is torch.nn.Linear
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = []
    apply = fused_grads.LinearIntoGrad.apply
    monkeypatch.setattr(
        fused_grads.LinearIntoGrad, "apply", lambda *a: calls.append(1) or apply(*a)
    )
    settings = StepSettings(logprob_chunk=7, micro_batch_size=2, entropy_coef=0.01)
    fused = update(model, None, batch(), settings)
    assert len(calls) >= 2 * 3 * (len(linears) - 1)  # three passes, each forward run twice
    monkeypatch.setattr(fused_grads, "fusable", lambda weight, model: False)
    calls.clear()
    plain = update(model, None, batch(), settings)
    assert calls == []
    assert_same_update(plain, fused)


def test_a_linears_gradient_added_into_grad_accumulates_with_its_bias():
    from agentarium.trainer.fused_grads import LinearIntoGrad

    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, generator=g, requires_grad=True)
    scale = torch.randn(2, 5, 3, dtype=torch.float64, generator=g)
    out = torch.nn.functional.linear(x, weight, bias)
    want = torch.autograd.grad((out * scale).sum(), (x, weight, bias))
    for times in (1, 2):  # a second pass adds into the first's gradients
        out = LinearIntoGrad.apply(x, weight, bias)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias))
        (grad_x,) = torch.autograd.grad((out * scale).sum(), x)
        torch.testing.assert_close(grad_x, want[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(weight.grad, times * want[1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(bias.grad, times * want[2], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "settings",
    [
        dict(BASE),  # the KL term, the entropy bonus (its gradient), stale tokens (in batch())
        dict(clip_low=0.2, clip_high=0.2, loss_agg="seq-mean-token-mean"),
        dict(BASE, loss_agg="seq-mean-token-sum-norm", loss_norm_tokens=64, micro_batch_size=2),
    ],
    ids=["kl-entropy", "seq-mean", "norm-tokens-passes"],
)
def test_given_the_loss_the_head_makes_its_gradient_in_the_forward(tiny, monkeypatch, settings):
    """``forward_backward`` hands the head its loss (``token_stats(loss=...)``): the head makes
    each chunk's logits once (``HeadStats`` predicts the loss's gradient at them, and its
    backward finds nothing left to make), and the update is the head's without the loss,
    which makes every chunk's logits again in its backward (the same sums in another order:
    ``TOL``, fp64)."""
    from agentarium.trainer import logprobs, step

    model = load_model(tiny, "cpu", dtype="float64")
    ref = load_model(tiny, "cpu", trainable=False, dtype="float64")
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    data, chunk = batch(), 7
    calls = []
    made = logprobs._logits
    monkeypatch.setattr(logprobs, "_logits", lambda *a: calls.append(1) or made(*a))
    run = StepSettings(logprob_chunk=chunk, **{"micro_batch_size": 8, **settings})
    fused = update(model, ref, data, run)
    policy_calls = len(calls)
    passes = data.micro_batches(run.micro_batch_size, max_tokens=run.max_tokens_per_micro_batch,
                                packed=False, share_prefix=run.share_prefix)  # fmt: skip
    chunks = sum(-(-int(mb.loss_mask[:, 1:].sum()) // chunk) for mb in passes)
    ref_calls = chunks if run.kl_coef > 0 else 0  # the reference's log-probs: a forward alone
    assert policy_calls == chunks + ref_calls  # no chunk's logits made again
    real = step.token_stats
    monkeypatch.setattr(
        step,
        "token_stats",
        lambda *a, loss=None, **kw: real(*a, **kw),  # the loss not given
    )
    calls.clear()
    plain = update(model, ref, data, run)
    assert len(calls) > policy_calls  # the backward made them again
    assert_same_update(plain, fused)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_a_head_whose_predicted_gradient_is_off_still_gets_autograds(entropy_grad):
    """``HeadStats`` handed a ``predict`` that is wrong for the loss then taken (half the true
    gradient on some chunks, the true one on the rest, through a bias): its backward makes the
    chunks that differ again with the difference, and the gradients are autograd's (fp64;
    the same products summed in another order: 1e-12, as the Linear's test above)."""
    from agentarium.trainer.logprobs import HeadStats

    n = 9
    hidden, weight, bias, targets, temperature, g = _head_inputs(11, n=n, h=4, v=13)
    c = torch.randn(n, dtype=torch.float64, generator=g)  # d loss / d lp
    d = torch.randn(n, dtype=torch.float64, generator=g)  # d loss / d ent
    half = (torch.arange(n) >= 6).double() * 0.5 + (torch.arange(n) < 6).double()

    def predict(part, lp, ent):
        return c[part] * half[part], (d[part] * half[part] if entropy_grad else None)

    def loss_of(lp, ent):
        return (lp * c).sum() + ((ent * d).sum() if entropy_grad else 0.0)

    args = (targets, temperature, 3, True, entropy_grad)
    want = torch.autograd.grad(loss_of(*HeadStats.apply(hidden, weight, bias, *args)),
                               (hidden, weight, bias))  # fmt: skip
    got = torch.autograd.grad(loss_of(*HeadStats.apply(hidden, weight, bias, *args, False, predict)),
                              (hidden, weight, bias))  # fmt: skip
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # into .grad: the forward added the predicted share, the backward the rest
    lp, ent = HeadStats.apply(hidden, weight, bias, *args, True, predict)
    (grad_h,) = torch.autograd.grad(loss_of(lp, ent), hidden)
    torch.testing.assert_close(grad_h, want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weight.grad, want[1], rtol=1e-12, atol=1e-12)


def test_the_heads_gradient_has_the_same_bits_made_in_the_forward_or_the_backward():
    """In fp32, ``HeadStats``'s gradients made in the forward (``predict`` right) are the ones
    its backward makes (no ``predict``, as under FSDP2) to the bit: both take p as
    exp(log_softmax). An fp32 AdamW step from zero moments turns a last-bit difference in a
    near-zero gradient into a visible one (lr * dg / eps), and a sharded and an unsharded
    trainer are compared after one (tests/test_architecture_weights.py)."""
    from agentarium.trainer.logprobs import HeadStats

    hidden, weight, bias, targets, temperature, g = _head_inputs(13, n=10, h=8, v=300)
    hidden, weight = hidden.float().detach().requires_grad_(), weight.float().detach()
    temperature, c = temperature.float(), torch.randn(10, generator=g).float()
    grads = []
    for predict in (None, lambda part, lp, ent: (c[part], None)):
        w = weight.clone().requires_grad_()
        lp, _ = HeadStats.apply(hidden, w, None, targets, temperature, 3, True, False, True,
                                predict)  # fmt: skip
        (grad_h,) = torch.autograd.grad((lp * c).sum(), hidden)
        grads.append((grad_h, w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
