"""broker.EngineControl: one client of the engines' control API, one error type, against the
SGLang fake (SGLang's real shapes) and SGLang's older spelling of model info."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from fake_sglang import FakeSGLang

from broker import EngineControl, EngineControlError


async def test_model_info_falls_back_to_the_older_spelling_once():
    app = web.Application()
    app.router.add_get(
        "/get_model_info", lambda r: web.json_response({"weight_version": "7", "model_path": "m"})
    )
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as http:
            engine = EngineControl(http, f"http://127.0.0.1:{port}/")
            assert await engine.weight_version() == "7"
            with pytest.raises(EngineControlError) as caught:
                await engine.server_info()  # neither spelling served
            assert caught.value.status == 404 and caught.value.url == f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_a_refused_weight_update_raises_with_the_engines_message(tmp_path):
    fake = FakeSGLang()
    await fake.start()
    try:
        async with aiohttp.ClientSession() as http:
            engine = EngineControl(http, fake.url)
            await engine.pause()
            await engine.resume()
            with pytest.raises(EngineControlError) as caught:
                await engine.update_weights_from_disk(
                    model_path=str(tmp_path / "missing"), weight_version="3", timeout_s=10
                )
            assert caught.value.path == "/update_weights_from_disk"
            assert caught.value.status in (200, 400)
            assert "no safetensors weights" in caught.value.message
    finally:
        await fake.close()


async def test_an_engine_that_is_down_is_an_error_without_a_status():
    async with aiohttp.ClientSession() as http:
        with pytest.raises(EngineControlError) as caught:
            await EngineControl(http, "http://127.0.0.1:9").model_info(timeout_s=2)
    assert caught.value.status is None and "/model_info" in str(caught.value)
