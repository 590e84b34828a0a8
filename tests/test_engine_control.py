"""inference.EngineControl against SGLang's shapes (the fake) and an older server: one error type
for every failure, the one /model_info fallback."""

from __future__ import annotations

import pytest
from aiohttp import web
from fake_sglang import FakeSGLang, dead_url

from agentarium.inference import EngineControl, EngineControlError


async def test_info_pause_update_continue_and_a_refusal_raise_one_error_type(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")  # the fake looks for the file only
    fake = FakeSGLang(weight_version="3")
    await fake.start()
    try:
        async with EngineControl(timeout_s=5.0) as control:
            assert await control.weight_version(fake.url) == "3"
            assert await control.ranks(fake.url) == 1  # no /server_info: one rank
            await control.pause(fake.url, "in_place")
            assert fake.paused
            message = await control.update_weights_from_disk(
                fake.url, model_path=str(tmp_path), weight_version="4", timeout_s=5.0
            )
            assert "Succeeded" in message and fake.weight_version == "4"
            fake.update_failures = 1
            with pytest.raises(EngineControlError) as refused:
                await control.update_weights_from_disk(
                    fake.url, model_path=str(tmp_path), weight_version="5", timeout_s=5.0
                )
            await control.resume(fake.url)
            assert not fake.paused
    finally:
        await fake.close()
    error = refused.value
    assert error.url == fake.url and error.path == "/update_weights_from_disk"
    assert error.status == 400 and error.message == "scripted update failure"
    assert str(error) == "/update_weights_from_disk: scripted update failure"


async def test_an_unreachable_engine_raises_with_no_status():
    url = dead_url()
    async with EngineControl(timeout_s=2.0) as control:
        with pytest.raises(EngineControlError) as unreachable:
            await control.model_info(url)
    assert unreachable.value.status is None and unreachable.value.url == url


async def test_model_info_falls_back_to_the_older_path_once():
    asked: list[str] = []

    async def old_info(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({"model_path": "/m", "weight_version": "7"})

    app = web.Application()
    app.router.add_get("/get_model_info", old_info)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with EngineControl(timeout_s=5.0) as control:
            assert await control.weight_version(url) == "7"
            with pytest.raises(EngineControlError) as missing:
                await control.weights_checksum(url)  # the local engine's only
    finally:
        await runner.cleanup()
    assert asked == ["/get_model_info"] and missing.value.status == 404
