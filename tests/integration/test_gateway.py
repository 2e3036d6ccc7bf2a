"""The gateway with real harness clients: the ``openai`` SDK (Chat Completions with tools, streaming,
``n``, logprobs; the Responses API) and the ``anthropic`` SDK against a real router and sim replicas.
Every sample's generated ids are checked against the Results the engines returned."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import aiohttp
import pytest

from toolkit.bench.gateway import RecordingClient
from toolkit.config import group_engine
from toolkit.gateway.chat import ChatTokenizer
from toolkit.gateway.server import SESSION_CALLS, Gateway, gateway_settings
from toolkit.gateway.types import ChatRequest, GatewayError
from toolkit.model.tokenizer import chat_tokenizer_dir
from toolkit.session.requests import OpenStep, RequestLog

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

AGENT = ["workload=agent", "engine.time_scale=0.05", "router.heartbeat_s=0.2", "workload.max_tokens=48"]
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}]


async def serve(cfg, rd, fn, **settings: Any):  # type: ignore[no-untyped-def]
    """Run ``fn(gateway, client)`` against a gateway on 127.0.0.1 in front of the run's router."""
    client = RecordingClient(rd)
    await client.connect(10)
    chat = ChatTokenizer(chat_tokenizer_dir(cfg))
    base = gateway_settings(cfg, rd, 0, group_engine(cfg, "throughput").max_model_len)
    gw = Gateway(dataclasses.replace(base, **settings), chat, client)
    await gw.start()
    try:
        return await asyncio.wait_for(fn(gw, client), 120)
    finally:
        await gw.close()
        await client.close()


def generated(sample) -> list[int]:  # type: ignore[no-untyped-def]
    return [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m]


def test_openai_chat_tools_streaming_n_and_logprobs_keep_the_engines_ids(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run(AGENT)
    stack.start()

    async def body(gw: Gateway, client: RecordingClient) -> None:
        key, sess = gw.open_session(OpenStep(0, RequestLog()), 7, "rollout/0/7")
        gw.set_prompt_key(key, "0/3")  # a GRPO sibling's: every call of the session carries it
        oai = openai.AsyncOpenAI(base_url=gw.base_url(key), api_key="x", max_retries=0, timeout=30)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        first = await oai.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required")
        call = first.choices[0].message.tool_calls[0]
        assert first.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        # Streaming: the deltas add up to the whole answer.
        stream = await oai.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True,
                                                   stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        assert usage is not None and usage.completion_tokens > 0
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Pick one."}]
        two = await oai.chat.completions.create(model="m", messages=messages, n=2, logprobs=True)
        assert len(two.choices) == 2
        lp = two.choices[1].logprobs.content
        assert len(lp) == two.usage.completion_tokens // 2 or lp  # per-token logprobs are there
        messages += [{"role": "assistant", "content": two.choices[1].message.content},
                     {"role": "user", "content": "Thanks."}]
        # The toolkit's own field, as the SDK sends it: the agent's guess of the turn's length.
        await oai.chat.completions.create(model="m", messages=messages, max_tokens=8, extra_body={"expected_tokens": 700})
        await gw.close_session(key)
        assert [client.requests[f"rollout/0/7/{t}"].expected_tokens for t in ("1", "2", "3/1", "4")] == [0, 0, 0, 700]
        samples = sess.samples("completed", "", 1.0)
        # The line the harness continued: its generated ids are the engine's, turn by turn.
        final = next(s for s in samples if s.reward == 1.0)
        rid = "rollout/0/7"
        expected = (client.results[f"{rid}/1"].output_token_ids + client.results[f"{rid}/2"].output_token_ids
                    + client.results[f"{rid}/3/1"].output_token_ids + client.results[f"{rid}/4"].output_token_ids)
        # The line the harness continued is the session's last row; its generated ids are the engine's.
        assert [(s.branch, s.error, s.num_turns) for s in samples] == [
            (0, "choice 0 of 2 at turn 2, not continued", 3), (1, "", 4)]
        other, final = samples
        rid = "rollout/0/7"
        expected = (client.results[f"{rid}/1"].output_token_ids + client.results[f"{rid}/2"].output_token_ids
                    + client.results[f"{rid}/3/1"].output_token_ids + client.results[f"{rid}/4"].output_token_ids)
        assert generated(final) == expected and final.reward == 1.0
        assert generated(other)[-len(client.results[f"{rid}/3"].output_token_ids):] == \
            client.results[f"{rid}/3"].output_token_ids
        # The answer text is the decoding of those ids (without the end token).
        assert two.choices[1].message.content == gw.chat.content_text(client.results[f"{rid}/3/1"].output_token_ids)
        assert {g.prompt_key for g in client.requests.values()} == {"0/3"}

    asyncio.run(serve(cfg, rd, body))


def test_responses_api_and_anthropic_messages_with_tools(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run(AGENT)
    stack.start()
    fn_tool = {"type": "function", "name": "weather", "description": "Weather of a city.",
               "parameters": TOOLS[0]["function"]["parameters"]}

    async def body(gw: Gateway, client: RecordingClient) -> None:
        key, sess = gw.open_session(OpenStep(0, RequestLog()), 1, "rollout/0/1")
        oai = openai.AsyncOpenAI(base_url=gw.base_url(key), api_key="x", max_retries=0, timeout=30)
        r1 = await oai.responses.create(model="m", instructions="Be brief.", input="Weather in Rome?",
                                        tools=[fn_tool], tool_choice="required")
        calls = [o for o in r1.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "weather"
        follow = [{"role": "user", "content": "Weather in Rome?"},
                  {"type": "function_call", "call_id": calls[0].call_id, "name": "weather",
                   "arguments": calls[0].arguments},
                  {"type": "function_call_output", "call_id": calls[0].call_id, "output": "rainy"}]
        events = []
        async with await oai.responses.create(model="m", instructions="Be brief.", input=follow,
                                              tools=[fn_tool], stream=True) as stream:
            async for ev in stream:
                events.append(ev.type)
        assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
        await gw.close_session(key)
        [sample] = sess.samples("completed", "", 0.0)
        assert generated(sample) == (client.results["rollout/0/1/1"].output_token_ids
                                     + client.results["rollout/0/1/2"].output_token_ids)

        key, sess = gw.open_session(OpenStep(0, RequestLog()), 2, "rollout/0/2")
        ant = anthropic.AsyncAnthropic(base_url=gw.base_url(key)[:-3], api_key="x", max_retries=0, timeout=30)
        a_tools = [{"name": "weather", "description": "Weather of a city.",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        m1 = await ant.messages.create(model="m", max_tokens=200, messages=msgs, tools=a_tools,
                                       tool_choice={"type": "tool", "name": "weather"})
        use = next(b for b in m1.content if b.type == "tool_use")
        assert m1.stop_reason == "tool_use" and use.input["city"] in ("Paris", "Rome")
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "warm"}]}]
        async with ant.messages.stream(model="m", max_tokens=40, messages=msgs, tools=a_tools) as stream:
            final = await stream.get_final_message()
        assert final.usage.output_tokens > 0
        await gw.close_session(key)
        [sample] = sess.samples("completed", "", 0.0)
        assert sample.branch == 0 and sample.error == ""
        assert generated(sample) == (client.results["rollout/0/2/1"].output_token_ids
                                     + client.results["rollout/0/2/2"].output_token_ids)

    asyncio.run(serve(cfg, rd, body))


def test_bad_requests_fail_alone_with_the_protocols_error(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run([*AGENT, "engine.max_model_len=400"])
    stack.start()

    async def body(gw: Gateway, client: RecordingClient) -> None:
        key, sess = gw.open_session(OpenStep(0, RequestLog()), 0, "rollout/0/0")
        url = gw.base_url(key)
        auth = {"authorization": "Bearer sekrit"}
        good = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with aiohttp.ClientSession() as http:
            async def post(path: str, body: Any, headers: dict | None = None) -> tuple[int, Any]:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                async with http.post(url + path, data=data, headers=auth if headers is None else headers) as r:
                    return r.status, await r.json()
            st, err = await post("/chat/completions", b'{"model": "m", "messages": [')
            assert st == 400 and err["error"]["type"] == "invalid_request_error"
            st, err = await post("/chat/completions", b"[" * 5000 + b"]" * 5000)
            # msgspec's depth follows the process's recursion limit (a RecursionError past it), which other
            # code in the process may have raised: then the body decodes, and is refused as not an object.
            assert st == 400 and any(why in err["error"]["message"]
                                     for why in ("nested too deeply", "must be a JSON object")), err
            # A key with a byte that is not UTF-8: a wrong key, in the protocol's own error body.
            host, port = url.split("//")[1].split("/")[0].split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"POST {url.split(port, 1)[1]}/chat/completions HTTP/1.1\r\nHost: x\r\n".encode()
                         + b"Authorization: Bearer \xff\xfe\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
            raw = await reader.read()
            writer.close()
            assert raw.startswith(b"HTTP/1.1 401") and b"authentication_error" in raw, raw[:200]
            st, err = await post("/chat/completions", {"model": "m", "messages": "hi"})
            assert st == 400 and err["error"]["param"] == "messages"
            st, err = await post("/chat/completions", good, headers={"authorization": "Bearer wrong"})
            assert st == 401
            st, err = await post("/messages", {"model": "m", "max_tokens": 4, "messages": []}, headers={})
            assert st == 401 and err["type"] == "error" and err["error"]["type"] == "authentication_error"
            async with http.post(url.replace(key, "nope") + "/chat/completions", json=good, headers=auth) as r:
                assert r.status == 404
            reward = url[: -len("/v1")] + "/reward"
            for bad_reward, why in (({"reward": "high"}, "expected"), ({"reward": 1, "choice": True}, "index"),
                                    ({"reward": 1, "choice": 2}, "no choice 2")):
                async with http.post(reward, json=bad_reward, headers=auth) as r:
                    assert r.status == 400 and why in (await r.json())["error"]["message"], bad_reward
            st, err = await post("/chat/completions", {**good, "messages": [{"role": "user", "content": "x" * 5000}]})
            # The conversation does not fit the model's context: worded and coded as OpenAI and Anthropic
            # do, so that a harness that shortens its history on overflow does so.
            assert st == 400 and err["error"]["code"] == "context_length_exceeded", err
            assert "prompt is too long" in err["error"]["message"] and "maximum context length" in err["error"]["message"]
            st, err = await post("/chat/completions", {**good, "stop": json.loads("[" * 900 + "]" * 900)})
            assert st == 400, err  # a refused field nested past Python's limit: the caller's error, not a 500
            st, err = await post("/chat/completions", {**good, "pad": "y" * 70000})
            assert st == 413  # the body is over gateway.max_body_mb
            gw.s.max_concurrent_requests = 1
            other, _ = gw.open_session(OpenStep(0, RequestLog()), 1, "rollout/0/1")

            async def post_other(body: Any) -> tuple[int, Any]:
                async with http.post(gw.base_url(other) + "/chat/completions", json=body, headers=auth) as r:
                    return r.status, await r.json()

            both = await asyncio.gather(post("/chat/completions", good), post_other(good))
            assert sorted(s for s, _ in both) == [200, 429]  # two sessions, one place
            # One session's calls take one place between them: they wait on each other, not on others.
            gw.s.max_concurrent_requests = 2
            many = await asyncio.gather(*(post("/chat/completions", good) for _ in range(SESSION_CALLS + 1)),
                                        post_other(good))
            assert sorted(s for s, _ in many[:-1]) == [200] * SESSION_CALLS + [429] and many[-1][0] == 200
            gw.s.max_concurrent_requests = 8
            st, ok = await post("/chat/completions", good)
            assert st == 200 and ok["choices"][0]["message"]["role"] == "assistant"
            async with http.get(url + "/models", headers=auth) as r:
                assert r.status == 200 and (await r.json())["data"][0]["id"] == "sim-8b"

    asyncio.run(serve(cfg, rd, body, token="sekrit", max_body_bytes=64 << 10))


def test_a_session_closed_as_its_call_starts_leaves_nothing_running(make_run) -> None:  # type: ignore[no-untyped-def]
    # Long turns at real time: a call the close failed to abort would run for minutes.
    cfg, rd, stack = make_run([*AGENT, "engine.time_scale=1.0", "engine.output_len_median=100000",
                               "engine.max_model_len=200000"])
    stack.start()

    async def body(gw: Gateway, client: RecordingClient) -> None:
        key, _ = gw.open_session(OpenStep(0, RequestLog()), 0, "rollout/0/0")
        entry = gw.sessions[key]
        call = asyncio.create_task(gw.turn(entry, ChatRequest([{"role": "user", "content": "hi"}],
                                                              max_tokens=100000)))
        await asyncio.sleep(0)  # the call has built its request and queued the task that sends it
        await gw.close_session(key)  # ... and the close's Abort leaves before that Generate
        with pytest.raises(GatewayError) as err:
            await asyncio.wait_for(call, 10)
        assert err.value.status == 404
        status = await client.status()
        assert status.inflight == 0 and status.queued == 0

    asyncio.run(serve(cfg, rd, body))


def test_a_caller_that_goes_away_aborts_its_call_and_leaves_the_session_as_it_was(make_run) -> None:  # type: ignore[no-untyped-def]
    """An SDK whose timeout passes closes the connection and retries: the gateway aborts the engines'
    work for the call it abandoned and records nothing of it, so the retry continues the session (one
    line, no branch) instead of queueing behind the orphan and branching off its answer."""
    # Every answer runs to its budget: 400 tokens take ~8 s here.
    cfg, rd, stack = make_run(["workload=agent", "engine.time_scale=5", "engine.output_len_median=1e6",
                               "router.heartbeat_s=0.2", "workload.max_tokens=400"])
    stack.start()

    async def body(gw: Gateway, client: RecordingClient) -> None:
        key, sess = gw.open_session(OpenStep(0, RequestLog()), 0, "rollout/0/0")
        url = gw.base_url(key) + "/chat/completions"
        auth = {"authorization": "Bearer sekrit"}
        call = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}
        async with aiohttp.ClientSession() as http:
            with pytest.raises(asyncio.TimeoutError):
                async with http.post(url, json=call, headers=auth, timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                    await r.read()
            for _ in range(200):
                if client.aborted:
                    break
                await asyncio.sleep(0.05)
            assert client.aborted == ["rollout/0/0/1"]
            async with http.post(url, json={**call, "max_tokens": 4}, headers=auth) as r:
                assert r.status == 200, await r.text()
            # A body over OFFLOAD_BYTES is rendered off the loop; too long for the context, it is refused.
            huge = {**call, "messages": [{"role": "user", "content": "word " * 100_000}]}
            async with http.post(url, json=huge, headers=auth) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "context_length_exceeded"
        samples = sess.samples("completed", "", 1.0)
        assert len(samples) == 1 and samples[0].branch == 0
        assert generated(samples[0]) == client.results["rollout/0/0/2"].output_token_ids

    asyncio.run(serve(cfg, rd, body, token="sekrit"))


def test_an_answer_that_never_reached_its_caller_leaves_the_session_as_it_was(make_run) -> None:  # type: ignore[no-untyped-def]
    """The caller went away after the engines answered, before the answer was written (its write failed,
    or the disconnect cancelled the call there): the session records nothing of the turn, so the
    caller's retry continues the session, one line and no branch."""
    cfg, rd, stack = make_run(AGENT)
    stack.start()

    async def body(gw: Gateway, client: RecordingClient) -> None:
        key, sess = gw.open_session(OpenStep(0, RequestLog()), 0, "rollout/0/0")
        entry = gw.sessions[key]
        hi = ChatRequest([{"role": "user", "content": "hi"}], max_tokens=8)

        async def gone(result: object) -> bool:
            return False

        async def cancelled(result: object) -> bool:
            raise asyncio.CancelledError

        await gw.turn(entry, hi, deliver=gone)
        with pytest.raises(asyncio.CancelledError):
            await gw.turn(entry, hi, deliver=cancelled)
        answered = await gw.turn(entry, hi)  # the retry that got its answer
        more = ChatRequest([{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": answered.choices[0].content},
                            {"role": "user", "content": "more"}], max_tokens=8)
        await gw.turn(entry, more)
        samples = sess.samples("completed", "", 1.0)
        assert len(samples) == 1 and samples[0].branch == 0 and samples[0].num_turns == 2, samples
        assert generated(samples[0]) == [*client.results["rollout/0/0/3"].output_token_ids,
                                         *client.results["rollout/0/0/4"].output_token_ids]

    asyncio.run(serve(cfg, rd, body))


def test_a_long_streaming_turn_keeps_its_connection_alive_and_fails_as_an_error_event(make_run) -> None:  # type: ignore[no-untyped-def]
    """A turn longer than ``gateway.keepalive_s`` starts its stream at once with SSE comments (a
    client's idle timeout never fires); both SDKs skip them and read the answer, and an error after the
    stream began comes as the protocol's ``error`` event, which the SDK raises."""
    cfg, rd, stack = make_run(["workload=agent", "engine.time_scale=5", "engine.output_len_median=1e6",
                               "router.heartbeat_s=0.2", "workload.max_tokens=100"])  # 100 tokens: ~2 s
    stack.start()

    async def body(gw: Gateway, client: RecordingClient) -> None:
        key, _ = gw.open_session(OpenStep(0, RequestLog()), 0, "rollout/0/0")
        call = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": True}
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.base_url(key) + "/chat/completions", json=call,
                                 headers={"authorization": "Bearer sekrit"}) as r:
                assert r.status == 200 and "x-toolkit-generate-ms" not in r.headers  # sent before the turn ended
                raw = await r.read()
        assert raw.startswith(b": keepalive\n\n") and raw.endswith(b"data: [DONE]\n\n")
        frames = [f for f in raw.split(b"\n\n") if f.startswith(b"data: {")]
        text = "".join((json.loads(f[6:])["choices"][0]["delta"].get("content") or "") for f in frames)
        assert text == gw.chat.content_text(client.results["rollout/0/0/1"].output_token_ids)

        sdk = openai.AsyncOpenAI(base_url=gw.base_url(key), api_key="sekrit", max_retries=0)
        chunks = [c async for c in await sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "again"}], max_tokens=100, stream=True)]
        assert chunks[-1].choices[0].finish_reason == "length"
        other, _ = gw.open_session(OpenStep(0, RequestLog()), 1, "rollout/0/1")
        claude = anthropic.AsyncAnthropic(base_url=gw.base_url(other)[: -len("/v1")], api_key="sekrit", max_retries=0)
        async with claude.messages.stream(model="m", max_tokens=100,
                                          messages=[{"role": "user", "content": "hi"}]) as events:
            message = await events.get_final_message()
        assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 100

        async def close_soon() -> None:
            await asyncio.sleep(0.6)  # after the first keepalive: the stream has begun
            await gw.close_session(other)

        closing = asyncio.create_task(close_soon())
        with pytest.raises(anthropic.APIStatusError, match="the session ended while this call ran") as failed:
            async with claude.messages.stream(model="m", max_tokens=100,
                                              messages=[{"role": "user", "content": "hi"}]) as events:
                await events.get_final_message()
        assert failed.value.response.status_code == 200  # an error event on the begun stream, not a 404
        await closing
        await sdk.close()
        await claude.close()

    asyncio.run(serve(cfg, rd, body, token="sekrit", keepalive_s=0.2))


def test_a_session_that_ends_while_a_big_call_is_planned_sends_the_engines_nothing(make_run) -> None:  # type: ignore[no-untyped-def]
    """A call whose body is over OFFLOAD_BYTES is rendered in a thread; the session ends meanwhile (its
    timeout): once the thread is done the call is the session's 404, and nothing reaches the engines
    (they would have generated its whole budget for nobody, after the session's end)."""
    import threading

    cfg, rd, stack = make_run(AGENT)
    stack.start()

    async def body(gw: Gateway, client: RecordingClient) -> None:
        key, sess = gw.open_session(OpenStep(0, RequestLog()), 0, "rollout/0/0")
        planning, release = threading.Event(), threading.Event()
        real = sess.plan

        def held_plan(*args: Any) -> Any:
            planning.set()
            assert release.wait(30)
            return real(*args)

        sess.plan = held_plan  # type: ignore[method-assign]
        # Big by its body, small by its prompt (a field the prompt does not hold).
        call = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                "metadata": {"pad": "x" * 300_000}}
        async with aiohttp.ClientSession() as http:
            post = asyncio.create_task(http.post(gw.base_url(key) + "/chat/completions", json=call))
            assert await asyncio.to_thread(planning.wait, 30)
            await gw.close_session(key)
            release.set()
            r = await post
            assert r.status == 404 and "the session ended" in (await r.json())["error"]["message"]
            r.release()
        assert not any(rid.startswith("rollout/0/0") for rid in client.requests), list(client.requests)

    asyncio.run(serve(cfg, rd, body))


def test_a_caller_gone_while_its_call_winds_up_frees_its_place(make_run, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """aiohttp cancels the handler of a caller that went away wherever it awaits, its clean-up included:
    the rank's place the call held is freed there too (one left taken per such caller would, over a
    long run, leave every call a 429)."""
    from toolkit.gateway import stream as stream_mod

    async def slow_stop(self: stream_mod.Stream) -> None:  # the clean-up's await, made long enough to land in
        await asyncio.sleep(30)

    monkeypatch.setattr(stream_mod.Stream, "stop", slow_stop)
    cfg, rd, stack = make_run(AGENT)
    stack.start()

    async def body(gw: Gateway, client: RecordingClient) -> None:
        key, _ = gw.open_session(OpenStep(0, RequestLog()), 0, "rollout/0/0")
        call = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with aiohttp.ClientSession() as http:
            with pytest.raises(asyncio.TimeoutError):
                async with http.post(gw.base_url(key) + "/chat/completions", json=call,
                                     timeout=aiohttp.ClientTimeout(total=2)) as r:
                    await r.read()
        for _ in range(200):
            if "rollout/0/0/1" in client.results and gw.inflight == 0:
                break
            await asyncio.sleep(0.05)
        assert "rollout/0/0/1" in client.results  # the turn ended: the caller left during the clean-up
        assert gw.inflight == 0 and gw.sessions[key].calls == 0

    asyncio.run(serve(cfg, rd, body))
