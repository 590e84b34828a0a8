"""VLLMBackend: vLLM's token-in/token-out ``/inference/v1/generate`` (VLLM_API.md), read as the
tracing client reads SGLang's ``/generate``: the ids with their log-probs checked one by one,
the version spans, the text decoded with the consumer's tokenizer and trimmed as the engines
trim theirs. Against a stand-in that answers in vLLM's documented shapes; tests/test_vllm_trace.py
runs the backend against the real vLLM."""

from __future__ import annotations

import pytest
from aiohttp import web

from agentarium.consumers.backends import VLLMBackend, parse_vllm_response
from agentarium.consumers.backends.base import GenerateRequest
from agentarium.consumers.backends.vllm import reply_text, vllm_sampling

# VLLM_API.md's response, one choice, its log-prob entries in tokens mode
DOCUMENTED = {
    "request_id": "generate-tokens-1",
    "model": "smol",
    "output_mode": "tokens",
    "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8},
    "choices": [
        {
            "index": 0,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": [2316, 354, 5646, 11173],
            "weight_versions": [{"version": "default", "start": 0, "end": 4}],
            "logprobs": {
                "content": [
                    {"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []}
                    for t, lp in ((2316, -0.9777), (354, -0.5), (5646, -1.25), (11173, -0.01))
                ]
            },
        }
    ],
}


def with_choice(**changes) -> dict:
    return {**DOCUMENTED, "choices": [{**DOCUMENTED["choices"][0], **changes}]}


def test_the_documented_response_parses():
    result = parse_vllm_response(DOCUMENTED, url="http://v:1")
    assert result.output_ids == [2316, 354, 5646, 11173]
    assert result.output_logprobs == [-0.9777, -0.5, -1.25, -0.01]
    assert (result.finish_reason, result.weight_version, result.weight_spans) == ("length", "default", [])  # fmt: skip
    assert (result.prompt_tokens, result.completion_tokens, result.backend) == (4, 4, "http://v:1")
    # the weights changed twice during the call: each version from its first token
    spans = [
        {"version": "runA:3:abc", "start": 0, "end": 1},
        {"version": "runA:4:def", "start": 1, "end": 3},
        {"version": "runA:5:ghi", "start": 3, "end": 4},
    ]
    changed = parse_vllm_response(with_choice(weight_versions=spans))
    assert changed.weight_version == "runA:5:ghi"
    assert changed.weight_spans == [("runA:3:abc", 0), ("runA:4:def", 1), ("runA:5:ghi", 3)]
    unnamed = parse_vllm_response(with_choice(weight_versions=[{"version": None, "start": 0, "end": 4}]))  # fmt: skip
    assert unnamed.weight_version == "default"
    empty = with_choice(token_ids=[], logprobs={"content": []}, weight_versions=[], finish_reason="abort")  # fmt: skip
    assert parse_vllm_response(empty).finish_reason == "abort"

    entries = DOCUMENTED["choices"][0]["logprobs"]["content"]
    for broken, why in (
        (with_choice(logprobs={"content": entries[:3]}), "3 log-probs for 4 token_ids"),
        (with_choice(logprobs=None), "no log-probs for 4 token_ids"),
        (with_choice(token_ids=[2316, 354, 5646, 1]), r"does not match 1"),
        (with_choice(finish_reason="eos"), "unknown finish_reason"),
        (with_choice(weight_versions=[{"version": "a", "start": 1, "end": 4}]), "weight_versions"),
        ({**DOCUMENTED, "choices": []}, "not exactly one choice"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_vllm_response(broken)


def test_sampling_goes_in_vllms_names():
    sglang = {
        "max_new_tokens": 32,
        "min_new_tokens": 2,
        "sampling_seed": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "stop": ["\n\n"],
        "stop_token_ids": [2],
        "no_stop_trim": True,
        "json_schema": '{"type": "object"}',
    }
    assert vllm_sampling(sglang) == {
        "max_tokens": 32,
        "min_tokens": 2,
        "seed": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "stop": ["\n\n"],
        "stop_token_ids": [2],
        "include_stop_str_in_output": True,
        "structured_outputs": {"json": '{"type": "object"}'},
        "skip_special_tokens": False,  # markers that are special tokens stay in the text
        "logprobs": 0,  # the sampled token's
    }


def test_the_text_is_trimmed_as_the_engines_trim_theirs():
    def decode(ids):
        return "".join(chr(i) for i in ids)

    text = [ord(c) for c in "Paris. Rome."]
    eos = 2

    def result(ids, finish, stop_reason=None):
        n = len(ids)
        return parse_vllm_response(
            with_choice(
                token_ids=ids,
                logprobs={"content": [{"token_id": t, "logprob": -0.1} for t in ids]},
                finish_reason=finish,
                stop_reason=stop_reason,
                weight_versions=[{"version": "v", "start": 0, "end": n}],
            )
        )

    assert reply_text(result([*text, eos], "stop"), decode) == "Paris. Rome."  # the EOS
    assert reply_text(result([*text, 7], "stop", 7), decode) == "Paris. Rome."  # a stop id
    assert reply_text(result(text, "stop", " Rome"), decode) == "Paris."  # a stop string
    assert reply_text(result(text, "stop", " Rome"), decode, keep_stop=True) == "Paris. Rome."
    assert reply_text(result(text[:3], "length"), decode) == "Par"


class VllmStandIn:
    """``/inference/v1/generate`` answering in vLLM's shapes: ``reply`` ids, the first
    ``aborts`` requests aborted before any token."""

    def __init__(self, reply: list[int], aborts: int = 0, checksums: dict | None = None) -> None:
        self.reply, self.aborts, self.requests = reply, aborts, []
        self.checksums = checksums or {}  # /weight_checker's, names with vLLM's prefix
        self.prompt_logprobs: list[float] = []  # what prompt_logprobs: 0 reports, after the first
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": "smol", "object": "model", "owned_by": "vllm", "root": "/models/smol"}
        return web.json_response({"object": "list", "data": [model]})

    async def checker(self, request: web.Request) -> web.Response:
        assert (await request.json()) == {"action": "checksum"}
        return web.json_response({"checksums": self.checksums})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        ids = [] if self.aborts else self.reply
        self.aborts = max(0, self.aborts - 1)
        choice = {
            "index": 0,
            "finish_reason": "stop" if ids else "abort",
            "stop_reason": None,
            "token_ids": ids,
            "weight_versions": [{"version": "run:1:abc", "start": 0, "end": len(ids)}]
            if ids
            else [],  # fmt: skip
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5, "rank": 1} for t in ids]},
        }
        usage = {"prompt_tokens": len(body["token_ids"]), "completion_tokens": len(ids)}
        reply = {"request_id": body.get("request_id"), "usage": usage, "choices": [choice]}
        if body["sampling_params"].get("prompt_logprobs") == 0:  # vLLM's shape: id -> Logprob
            prompt = body["token_ids"]
            reply["prompt_logprobs"] = [None] + [
                {str(t): {"logprob": lp, "rank": 1, "decoded_token": "x"}}
                for t, lp in zip(prompt[1:], self.prompt_logprobs, strict=True)
            ]
        return web.json_response(reply)

    async def __aenter__(self) -> VllmStandIn:
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/weight_checker", self.checker)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def test_a_request_is_what_vllm_takes_and_an_empty_abort_is_sent_again(template):
    reply = template.encode("Paris.") + template.eos_token_ids[:1]
    async with VllmStandIn(reply, aborts=1) as server:
        backend = VLLMBackend([server.url], decode=template.decode, backoff=0.0, lora="run")
        try:
            result = await backend.generate(
                GenerateRequest(
                    input_ids=[1, 2, 3],
                    sampling={"max_new_tokens": 8, "temperature": 1.0},
                    rid="job-call-0",
                )
            )
        finally:
            await backend.aclose()
    first, second = server.requests
    assert first == {
        "token_ids": [1, 2, 3],
        "sampling_params": {
            "max_tokens": 8,
            "temperature": 1.0,
            "skip_special_tokens": False,
            "logprobs": 0,
        },  # fmt: skip
        "request_id": "job-call-0",
        "model": "run",  # the LoRA adapter vLLM answers with
    }
    assert second["request_id"] == "job-call-0-r1"  # a fresh id: vLLM may hold the first
    assert (result.output_ids, result.text, result.weight_version) == (reply, "Paris.", "run:1:abc")
    assert result.output_logprobs == [-0.5] * len(reply)


def test_a_vllm_fleet_needs_the_models_template():
    from agentarium.consumers.service import LLMTarget

    target = LLMTarget(urls=("http://v:1",), engine="vllm")
    with pytest.raises(ValueError, match="needs the model's chat template"):
        target.backend()


async def test_the_syncer_checks_vllms_digests_against_the_file(tmp_path):
    """vLLM's ``/weight_checker`` digests each served parameter's bytes; the syncer compares
    the ones the file holds under the same name (the CPU build's repacked linear layers digest
    empty: not compared). A tensor served in bf16 from an fp32 file matches its bf16 bytes."""
    import hashlib

    import torch
    from safetensors.torch import save_file

    from agentarium.inference import EngineControl
    from agentarium.inference.sync.verify import EMPTY_SHA256, checksum_mismatch
    from agentarium.schemas import WeightIdentity

    def digest(t: torch.Tensor) -> str:
        return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()  # fmt: skip

    norm, embed = torch.rand(8), torch.rand(4, 8)
    save_file({"model.norm.weight": norm, "model.embed_tokens.weight": embed}, tmp_path / "model.safetensors")  # fmt: skip
    target = WeightIdentity.parse("run@1:abcdef0123456789")
    assert target is not None
    prefix = "dp0:pp0:pcp0:tp0:"
    served = {
        prefix + "model.norm.weight": digest(norm),
        prefix + "model.embed_tokens.weight": digest(embed.to(torch.bfloat16)),
        prefix + "model.layers.0.self_attn.qkv_proj.weight": EMPTY_SHA256,  # repacked
    }
    async with EngineControl() as control:
        async with VllmStandIn([], checksums=served) as server:
            assert await control.kind(server.url) == "vllm"
            assert await checksum_mismatch(control, server.url, tmp_path, target) == ""
            # vLLM's vocabulary tensors padded to 64 rows, zero-filled: the same weights
            padded = torch.cat([embed, torch.zeros(60, 8)])
            server.checksums[prefix + "model.embed_tokens.weight"] = digest(padded)
            assert await checksum_mismatch(control, server.url, tmp_path, target) == ""
            server.checksums[prefix + "model.embed_tokens.weight"] = digest(padded + 1)
            assert "embed_tokens.weight differs" in await checksum_mismatch(
                control, server.url, tmp_path, target
            )
            server.checksums[prefix + "model.embed_tokens.weight"] = digest(embed)
            server.checksums[prefix + "model.norm.weight"] = digest(norm * 2)
            problem = await checksum_mismatch(control, server.url, tmp_path, target)
    assert problem == f"reports {str(target)!r} but does not serve its weights: model.norm.weight differs"  # fmt: skip


async def test_the_syncer_probes_what_vllms_digests_cannot_see(tiny_dir, tmp_path):
    """Where vLLM digests its linear layers empty (the CPU build), the syncer compares vLLM's
    log-probs of a fixed text with the file's own: equal within 1e-3 passes, a served model
    whose log-probs are off by more is reported, naming by how much."""
    from agentarium.inference import EngineControl
    from agentarium.inference.sync.verify import PROBE_TOLERANCE, probe_expected, probe_mismatch
    from agentarium.schemas import WeightIdentity

    target = WeightIdentity.parse("run@1:abcdef0123456789")
    assert target is not None
    ids, expected = probe_expected(tiny_dir, tiny_dir)
    assert len(ids) > 10 and len(expected) == len(ids) - 1
    async with EngineControl() as control:
        async with VllmStandIn([5]) as server:
            server.prompt_logprobs = [lp + PROBE_TOLERANCE / 2 for lp in expected]
            assert await probe_mismatch(control, server.url, tiny_dir, tiny_dir, target) == ""
            server.prompt_logprobs[3] += 0.01  # linear layers left as they were
            problem = await probe_mismatch(control, server.url, tiny_dir, tiny_dir, target)
            assert problem.startswith(f"reports {str(target)!r} but does not serve its weights")
            assert "differ from the file's by up to 0.0105" in problem
            # no configuration to build the model from: the digests were the one check
            assert await probe_mismatch(control, server.url, tiny_dir, None, target) == ""


def test_the_vllm_command_serves_what_the_fleet_speaks(tmp_path, monkeypatch):
    """``agentarium engine --backend vllm``'s command line: the token route, the control
    routes, temperature-scaled log-probs; the CPU build's settings without a GPU; a virtualenv
    that is not built is an error saying how to build it."""
    from agentarium.inference import VllmUnavailable, vllm_command, vllm_python

    argv, env = vllm_command(
        "/v/bin/python", "/models/smol", served_name="smol", host="127.0.0.1", port=8000, gpu=False
    )
    assert argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(argv[3:])
    for wanted in (
        "--model /models/smol",
        "--served-model-name smol",
        "--port 8000",
        "--enable-scale-out",
        "--logprobs-mode processed_logprobs",
        "--dtype float32 --enforce-eager",
    ):
        assert wanted in flags
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_TARGET_DEVICE"] == "cpu"
    argv, env = vllm_command(
        "py", "m", served_name="m", host="h", port=1, gpu=True, extra=["--enable-lora"]
    )
    assert "--enforce-eager" not in argv and "VLLM_TARGET_DEVICE" not in env
    assert argv[-1] == "--enable-lora"

    monkeypatch.setenv("AGENTARIUM_VLLM_VENV", str(tmp_path / "none"))
    with pytest.raises(VllmUnavailable, match="is not built: build it with .*vllm_venv.sh"):
        vllm_python(build=False)
    # a virtualenv of the user's own that holds vllm (the GPU build, say) is used as it is:
    # no stamp, and never built over with the CPU build
    own = tmp_path / "own"
    (own / "bin").mkdir(parents=True)
    (own / "bin" / "python").write_text("")
    monkeypatch.setenv("AGENTARIUM_VLLM_VENV", str(own))
    with pytest.raises(VllmUnavailable, match="is not built"):
        vllm_python(build=False)  # a python and no vllm: not vLLM's
    package = own / "lib" / "python3.12" / "site-packages" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    assert vllm_python(build=False) == own / "bin" / "python"
