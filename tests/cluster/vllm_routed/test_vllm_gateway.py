"""Harnesses over HTTP against real vLLM (the CPU build, the tiny model): the ``openai`` SDK (a forced
tool call, JSON output, streaming, the Responses API) and the ``anthropic`` SDK through a rank's gateway,
a real router and a vLLM replica. The random-weight model produces parseable calls because the gateway
constrains its output with vLLM's structured outputs; the samples hold exactly the engine's ids."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from toolkit.bench.gateway import RecordingClient
from toolkit.gateway.chat import ChatTokenizer
from toolkit.gateway.server import Gateway, Settings
from toolkit.launch.stack import LocalStack
from toolkit.session.requests import OpenStep, RequestLog

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}


def generated(sample: Any) -> list[int]:
    return [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m]


def test_sdks_through_the_gateway_on_real_vllm(routed: LocalStack, models: dict[str, Path]) -> None:  # noqa: F811
    async def body() -> None:
        client = RecordingClient(routed.run_dir)
        await client.connect(30)
        settings = Settings(job="t", model="tiny", max_model_len=1024, max_tokens=64, temperature=1.0, top_p=1.0,
                            request_timeout_s=300)
        gw = Gateway(settings, ChatTokenizer(models["tiny"]), client)
        await gw.start()
        try:
            key, sess = gw.open_session(OpenStep(0, RequestLog()), 0, "t/0/0")
            oai = openai.AsyncOpenAI(base_url=gw.base_url(key), api_key="x", max_retries=0, timeout=300)
            tools = [{"type": "function", "function": {"name": "weather", "description": "Weather.",
                                                       "parameters": CITY}}]
            messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
            first = await oai.chat.completions.create(
                model="tiny", messages=messages, tools=tools, max_tokens=200,
                tool_choice={"type": "function", "function": {"name": "weather"}})
            [call] = first.choices[0].message.tool_calls
            assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
                         {"role": "user", "content": "As JSON, please."}]
            second = await oai.chat.completions.create(
                model="tiny", messages=messages, max_tokens=200,
                response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": CITY}})
            assert json.loads(second.choices[0].message.content)["city"] in ("Paris", "Rome")
            messages += [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Bye."}]
            text = ""
            async for chunk in await oai.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                                                 stream=True):
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
            await gw.close_session(key)
            [sample] = sess.samples("completed", "", 1.0)
            assert generated(sample) == [t for k in (1, 2, 3) for t in client.results[f"t/0/0/{k}"].output_token_ids]
            assert text == gw.chat.content_text(client.results["t/0/0/3"].output_token_ids)

            key, sess = gw.open_session(OpenStep(0, RequestLog()), 1, "t/0/1")
            oai = openai.AsyncOpenAI(base_url=gw.base_url(key), api_key="x", max_retries=0, timeout=300)
            resp = await oai.responses.create(model="tiny", input="Weather in Rome?", max_output_tokens=200,
                                              tools=[{"type": "function", "name": "weather", "parameters": CITY}],
                                              tool_choice="required")
            assert [o.name for o in resp.output if o.type == "function_call"] == ["weather"]
            ant = anthropic.AsyncAnthropic(base_url=gw.base_url(key)[:-3], api_key="x", max_retries=0, timeout=300)
            await gw.close_session(key)

            key, sess = gw.open_session(OpenStep(0, RequestLog()), 2, "t/0/2")
            ant = anthropic.AsyncAnthropic(base_url=gw.base_url(key)[:-3], api_key="x", max_retries=0, timeout=300)
            a_tools = [{"name": "weather", "description": "Weather.", "input_schema": CITY}]
            msg = await ant.messages.create(model="tiny", max_tokens=200, tools=a_tools, tool_choice={"type": "any"},
                                            messages=[{"role": "user", "content": "Weather in Rome?"}])
            use = next(b for b in msg.content if b.type == "tool_use")
            assert msg.stop_reason == "tool_use" and use.input["city"] in ("Paris", "Rome")
            async with ant.messages.stream(model="tiny", max_tokens=16, tools=a_tools, messages=[
                    {"role": "user", "content": "Weather in Rome?"},
                    {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain"}]},
            ]) as stream:
                final = await stream.get_final_message()
            assert final.usage.output_tokens > 0
            await gw.close_session(key)
            [sample] = sess.samples("completed", "", 0.0)
            assert sample.error == "" and generated(sample) == (
                client.results["t/0/2/1"].output_token_ids + client.results["t/0/2/2"].output_token_ids)
        finally:
            await gw.close()
            await client.close()

    asyncio.run(asyncio.wait_for(body(), 600))
