"""The trainer's memory plan (``--memory``, trainer/memory.py) and its allocator
(``--allocator``, trainer/heap.py): what the defaults resolve to by the model's size, what a
plan changes and what it leaves as given, and a trainer process that runs on jemalloc by
executing itself again, its pid the same."""

from __future__ import annotations

import copy as copy_module
import dataclasses
import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from trainlib import ROOT, child_env
from updatelib import BASE, assert_same_update, batch, update

from agentarium.tiny import ensure_tiny_model
from agentarium.trainer import (
    TrainerConfig,
    TrainerProcess,
    allocator_for,
    chunked_mlp,
    heap,
    memory,
)
from agentarium.trainer.errors import TrainerConfigError
from agentarium.trainer.logprobs import token_stats
from agentarium.trainer.step import StepSettings, load_model, load_policy, load_reference


def header_only(path, shapes: dict[str, list[int]]) -> None:
    """A safetensors file's header (what ``checkpoint_parameters`` reads), without the data."""
    header = {
        name: {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}
        for name, shape in shapes.items()
    }
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text)


def needs_jemalloc() -> None:
    """Skip where libjemalloc2 is not installed; under CI (whose setup installs it) fail."""
    if heap.find_jemalloc() is None:
        if os.environ.get("CI"):
            pytest.fail("libjemalloc.so.2 is missing: ops/setup.sh installs libjemalloc2")
        pytest.skip("libjemalloc2 is not installed")


def config(model_dir, **values) -> TrainerConfig:
    return TrainerConfig(run="r", agent="a", model_dir=str(model_dir), **values)


def test_the_parameters_are_counted_in_every_shards_header(tmp_path):
    header_only(tmp_path / "model-00001-of-00002.safetensors", {"a": [1000, 60_000], "b": [7]})
    header_only(tmp_path / "model-00002-of-00002.safetensors", {"c": [40_000_000]})
    assert memory.checkpoint_parameters(tmp_path) == 60_000_000 + 7 + 40_000_000
    assert memory.plan_for("auto", lora_rank=0, model_dir=tmp_path) == "small"
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\x01")  # cut short
    assert memory.checkpoint_parameters(tmp_path) is None
    assert memory.plan_for("auto", lora_rank=0, model_dir=tmp_path) == "fast"
    assert memory.checkpoint_parameters(tmp_path / "missing") is None


def test_auto_is_small_only_for_a_large_model_trained_whole(tmp_path):
    header_only(tmp_path / "model.safetensors", {"w": [memory.SMALL_FROM - 1]})
    assert memory.plan_for("auto", lora_rank=0, model_dir=tmp_path) == "fast"
    header_only(tmp_path / "model.safetensors", {"w": [memory.SMALL_FROM]})
    assert memory.plan_for("auto", lora_rank=0, model_dir=tmp_path) == "small"
    assert memory.plan_for("auto", lora_rank=16, model_dir=tmp_path) == "fast"  # LoRA
    assert memory.plan_for("fast", lora_rank=0, model_dir=tmp_path) == "fast"
    tiny = ensure_tiny_model()
    assert memory.plan_for("auto", lora_rank=0, model_dir=tiny) == "fast"
    assert memory.plan_for("small", lora_rank=0, model_dir=tiny) == "small"


def test_the_defaults_on_a_small_model_are_the_settings_as_given():
    settings = StepSettings.from_config(config(ensure_tiny_model()))
    assert settings.activation_checkpointing is False
    assert settings.optimizer_state == "fp32"
    assert settings.max_tokens_per_micro_batch == 0
    assert settings.logprob_chunk == 512
    assert settings.mlp_chunk == 0
    assert settings.layer_chunk == 0


def test_small_adds_what_saves_memory_and_keeps_what_was_given():
    tiny = ensure_tiny_model()
    small = StepSettings.from_config(config(tiny, memory="small"))
    assert small.activation_checkpointing is True
    assert small.optimizer_state == "fp8"
    assert small.max_tokens_per_micro_batch == memory.SMALL_TOKENS
    assert small.logprob_chunk == memory.SMALL_CHUNK
    assert small.mlp_chunk == memory.SMALL_MLP_CHUNK
    assert small.layer_chunk == memory.SMALL_LAYER_CHUNK
    given = StepSettings.from_config(
        config(
            tiny, memory="small", optimizer_state="fp32", max_tokens_per_micro_batch=4096,
            logprob_chunk=0, mlp_chunk=2048, layer_chunk=1024,
        )
    )  # fmt: skip
    assert (given.optimizer_state, given.max_tokens_per_micro_batch) == ("fp32", 4096)
    assert (given.mlp_chunk, given.layer_chunk) == (2048, 1024)
    assert given.logprob_chunk == 0  # the whole-vocabulary path, as asked
    rows = StepSettings.from_config(config(tiny, memory="small", micro_batch_size=4))
    assert (rows.micro_batch_size, rows.max_tokens_per_micro_batch) == (4, 0)
    # fp8 moments are for fp32 weights in a replicated trainer: elsewhere auto keeps fp32
    wide = StepSettings.from_config(config(tiny, memory="small", dtype="float64"))
    assert wide.optimizer_state == "fp32" and wide.activation_checkpointing is True
    # sharded layers run whole: small leaves --layer-chunk 0 there, and a given one is refused
    sharded = config(tiny, memory="small", parallel="fsdp", ray_workers=2)
    assert StepSettings.from_config(sharded).layer_chunk == 0
    with pytest.raises(TrainerConfigError, match="--layer-chunk 512 .* --parallel fsdp"):
        config(tiny, parallel="fsdp", ray_workers=2, layer_chunk=512)


def test_auto_allocator_is_jemalloc_only_under_the_small_plan(monkeypatch):
    tiny = ensure_tiny_model()
    process = TrainerProcess()
    assert allocator_for(config(tiny), process) == "glibc"
    expected = "jemalloc" if heap.find_jemalloc() else "glibc"
    assert allocator_for(config(tiny, memory="small"), process) == expected
    assert allocator_for(config(tiny), TrainerProcess(allocator="jemalloc")) == "jemalloc"
    monkeypatch.setattr(heap, "find_jemalloc", lambda: None)
    assert allocator_for(config(tiny, memory="small"), process) == "glibc"
    with pytest.raises(ValueError, match="apt-get install libjemalloc2"):
        heap.wanted_allocator("jemalloc")


def test_a_named_jemalloc_that_is_missing_is_a_clear_error(monkeypatch, capsys):
    from agentarium.cli import build_parser
    from agentarium.commands import trainer_cmd

    monkeypatch.setattr(heap, "find_jemalloc", lambda: None)
    args = build_parser().parse_args(
        ["trainer", "--run", "r", "--agent", "a", "--model", str(ensure_tiny_model()),
         "--allocator", "jemalloc"]
    )  # fmt: skip
    assert trainer_cmd.cmd_trainer(args) == 2
    assert "libjemalloc2" in capsys.readouterr().err


def test_the_trainer_runs_on_jemalloc_by_executing_itself_again(tmp_path, nats_url):
    """``--allocator jemalloc`` on the tiny model: the process preloads jemalloc into itself
    (one exec, the same pid, whose parent sees nothing), sets up and stops (``--max-steps
    0``), and says what it runs on; without it, glibc and no exec."""
    needs_jemalloc()
    probe = (
        "import os, sys, runpy; print('pid', os.getpid(), flush=True); "
        "sys.argv = ['agentarium', *sys.argv[1:]]; runpy.run_module('agentarium', run_name='__main__')"
    )

    def run(*extra: str) -> tuple[list[str], list[dict]]:
        done = subprocess.run(
            [sys.executable, "-c", probe, "trainer", "--nats-url", nats_url, "--run", "r",
             "--agent", "a", "--model", str(ensure_tiny_model()), "--max-steps", "0",
             "--checkpoint-dir", str(tmp_path / f"ckpt{len(extra)}"), "--torch-threads", "1",
             *extra],
            cwd=ROOT, env=child_env(PYTHONPATH=str(ROOT), AGENTARIUM_LOG_FORMAT="json"),
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        pids = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("pid ")]
        events = []
        for line in done.stderr.splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        return pids, [e for e in events if e.get("event") == "trainer memory"]

    pids, events = run("--allocator", "jemalloc")
    assert len(pids) == 2 and len(set(pids)) == 1, pids  # started twice (the exec), one pid
    assert [e["allocator"] for e in events] == ["jemalloc"]
    assert events[0]["plan"] == "fast"  # the tiny model: the allocator was named, not chosen
    pids, events = run()
    assert len(pids) == 1 and [e["allocator"] for e in events] == ["glibc"]


def test_on_jemalloc_freed_pages_stay_for_reuse_until_release_hands_them_back():
    """The trainer's jemalloc settings (``heap.JEMALLOC_CONF``): a freed 64 MiB tensor's pages
    stay with the process (reused by the next pass, no page faults), and ``release()`` (after
    each pass and step) purges them."""
    needs_jemalloc()
    code = (
        "import os, torch; from agentarium.trainer import heap\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
        "assert heap.running_allocator() == 'jemalloc'\n"
        "x = torch.ones(2**24); touched = rss(); del x; freed = rss()\n"
        "assert heap.release(); print(touched, freed, rss())\n"
    )
    env = child_env(PYTHONPATH=str(ROOT))
    env.pop("MALLOC_CONF", None)
    env.pop("LD_PRELOAD", None)
    env.update(heap.allocator_env("jemalloc"))
    assert env["MALLOC_CONF"] == heap.JEMALLOC_CONF
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    touched, freed, released = (int(x) for x in done.stdout.split())
    mib = 2**20
    assert touched - freed < 8 * mib, (touched, freed)  # kept for reuse
    assert freed - released > 56 * mib, (freed, released)  # handed back


@pytest.mark.kernels  # gradients compared: run again under ATEN_CPU_CAPABILITY=avx2
def test_a_long_rows_feed_forward_runs_a_slice_at_a_time_and_trains_the_same():
    """--mlp-chunk (trainer/chunked_mlp.py) under activation checkpointing, fp64: the same
    loss, statistics and gradients as the whole block (updatelib's tolerance: only
    the order of the gradients' additions changes), while no feed-forward projection ever
    sees more than the chunk's positions, with gradients or without."""
    tiny = ensure_tiny_model()
    data = batch()  # rows of 14-25 tokens, packed into one pass of more than 7
    whole_settings = StepSettings(dtype="float64", activation_checkpointing=True, **BASE)
    whole = update(*policy_and_reference(tiny, whole_settings), data, whole_settings)
    sliced_settings = dataclasses.replace(whole_settings, mlp_chunk=7)
    model, ref = policy_and_reference(tiny, sliced_settings)
    widths: list[int] = []
    blocks = chunked_mlp.feed_forward_blocks(model)
    assert blocks and all("forward" in b.__dict__ for b in blocks)
    first = next(m for m in blocks[0].modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_hook(lambda _m, args, _out: widths.append(args[0].shape[-2]))
    sliced = update(model, ref, data, sliced_settings)
    assert_same_update(whole, sliced)
    assert widths and max(widths) == 7  # forward, and again in each slice's backward
    widths.clear()
    with torch.no_grad():  # nothing to keep: the slices one after another
        token_stats(model, data.to("cpu"), chunk=0)
    assert max(widths) == 7 and sum(widths) == data.tokens


def test_a_mixture_of_experts_keeps_its_blocks_whole():
    """A mixture's routing and load balancing see all of a pass's positions at once: its
    blocks are not sliced (their class names experts)."""
    from agentarium.tiny_families import ensure_tiny_architecture

    moe = load_model(ensure_tiny_architecture("qwen3_moe"), "cpu")
    assert chunked_mlp.feed_forward_blocks(moe) == []
    assert chunked_mlp.enable(moe, 4) == 0
    dense = load_model(ensure_tiny_model(), "cpu")
    assert chunked_mlp.enable(dense, 0) == 0  # 0: nothing changes
    assert chunked_mlp.enable(dense, 4) == dense.config.num_hidden_layers
    # a copy of the model runs its own weights (the slices call the copy's block)
    copy = copy_module.deepcopy(dense)
    with torch.no_grad():
        for p in copy.parameters():
            p.zero_()
        hidden = torch.randn(1, 9, dense.config.hidden_size)
        assert torch.equal(copy.model.layers[0].mlp(hidden), torch.zeros_like(hidden))
        assert not torch.equal(dense.model.layers[0].mlp(hidden), torch.zeros_like(hidden))


def test_the_feed_forward_slices_do_not_wait_for_checkpointing():
    """``--mlp-chunk`` alone (``--memory fast``, no checkpointing) still slices the blocks: a
    flag that is given is never silently left unused."""
    model = load_policy(ensure_tiny_model(), "cpu", StepSettings(mlp_chunk=4))
    blocks = chunked_mlp.feed_forward_blocks(model)
    assert blocks and all("forward" in b.__dict__ for b in blocks)


def policy_and_reference(tiny, settings: StepSettings):
    """The policy as the trainer loads it under ``settings``, and a perturbed reference (the
    KL term not 0)."""
    model, ref = load_policy(tiny, "cpu", settings), load_reference(tiny, "cpu", settings)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(
                0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(p.dtype)
            )
    return model, ref


def test_a_pass_whose_layers_run_sliced_keeps_the_heads_chunk_small():
    """--memory small: 128-position log-prob chunks in a short pass, 32 in a pass of more real
    tokens than the layer chunk (the 8,192-token row's), whose layers' inputs are still held
    when the head's backward runs; a chunk asked smaller, or the whole path (0), as asked."""
    from types import SimpleNamespace

    from agentarium.trainer.step import head_chunk

    small = StepSettings.from_config(config(ensure_tiny_model(), memory="small"))
    assert (small.logprob_chunk, small.layer_chunk) == (128, 512)

    def pass_of(tokens):
        return SimpleNamespace(attention_mask=torch.ones(1, tokens, dtype=torch.long))

    assert head_chunk(small, pass_of(512)) == 128
    assert head_chunk(small, pass_of(513)) == memory.LONG_PASS_CHUNK == 32
    assert head_chunk(dataclasses.replace(small, logprob_chunk=16), pass_of(8192)) == 16
    assert head_chunk(dataclasses.replace(small, logprob_chunk=0), pass_of(8192)) == 0
    unsliced = dataclasses.replace(small, layer_chunk=0)  # nothing runs sliced
    assert head_chunk(unsliced, pass_of(8192)) == 128
