"""``python -m toolkit.bench gateway``: agents over HTTP through the gateway vs the same sessions straight
through ``RouterClient``.

512 concurrent 4-turn tool-calling sessions on 2 rank processes and sim engines, run three ways:
agents on the ``openai`` SDK through each rank's gateway, the same agents on plain HTTP, and the same
token ids replayed through ``RouterClient``. It reports sessions/s, the latency the gateway adds per
turn, the ranks' CPU per turn and token mismatches. Method and fields: docs/benchmarks.md#gateway.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.client import RouterClient
from toolkit.config import compose_config, group_engine, load_run_config
from toolkit.core.lifecycle import quiet_gc
from toolkit.core.protocol import Generate, Result, Route, Sampling, Structured
from toolkit.core.rundir import RunDir
from toolkit.gateway.chat import ChatTokenizer
from toolkit.gateway.server import Gateway, gateway_settings
from toolkit.launch.stack import LocalStack
from toolkit.launch.validation import validate
from toolkit.model.tokenizer import chat_tokenizer_dir
from toolkit.session.requests import OpenStep, RequestLog

SESSIONS_PER_RANK = 256
RANKS = 2
TURNS = 4
TOOL_S = 1.0
FAST_TOOL_S = 0.05
MAX_TOKENS = 256
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up in the dictionary.",
    "parameters": {"type": "object", "properties": {"word": {"enum": ["cat", "dog", "fox", "owl"]}},
                   "required": ["word"], "additionalProperties": False}}}]


class RecordingClient(RouterClient):
    """The rank's real client, keeping every request it sent and every Result it got by request id (the
    engines' own ids)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.requests: dict[str, Generate] = {}
        self.results: dict[str, Result] = {}
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        await super().abort(request_id)

    async def generate(self, msg: Generate) -> tuple[Result, Route | None]:
        self.requests[msg.request_id] = msg
        res, route = await super().generate(msg)
        self.results[msg.request_id] = res
        return res, route


def _segments(tokens: list[int], mask: list[int]) -> tuple[list[int], list[list[int]]]:
    """Where each generation starts in a sample, and its ids."""
    starts, segs = [], []
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            starts.append(i)
            segs.append([])
        if m:
            segs[-1].append(tokens[i])
    return starts, segs


async def _gateway_rank(run_dir: Path, rank: int, n: int, harness: str, tool_s: float,
                        one_at_a_time: bool = False) -> dict[str, Any]:
    # openai is a test extra; aiohttp only for this harness's own client.
    import aiohttp
    import openai


    rd = RunDir(run_dir)
    cfg = load_run_config(run_dir)
    client = RecordingClient(rd)
    await client.connect(30)
    chat = ChatTokenizer(chat_tokenizer_dir(cfg))
    gw = Gateway(gateway_settings(cfg, rd, rank, group_engine(cfg, "throughput").max_model_len), chat, client)
    await gw.start()
    added: list[float] = []
    log = RequestLog()
    nonce = time.monotonic_ns()

    async def call_openai(oai: Any, messages: list[Any], last: bool) -> dict[str, Any]:
        raw = await oai.chat.completions.with_raw_response.create(
            model="policy", messages=messages, tools=TOOLS, tool_choice="none" if last else "required",
            max_tokens=MAX_TOKENS)
        added.append(-float(raw.headers["x-toolkit-generate-ms"]))
        return raw.parse().choices[0].message.model_dump(exclude_none=True)

    async def call_http(http: Any, url: str, messages: list[Any], last: bool) -> dict[str, Any]:
        body = {"model": "policy", "messages": messages, "tools": TOOLS,
                "tool_choice": "none" if last else "required", "max_tokens": MAX_TOKENS}
        async with http.post(f"{url}/chat/completions", json=body) as r:
            added.append(-float(r.headers["x-toolkit-generate-ms"]))
            msg = (await r.json())["choices"][0]["message"]
        return {k: v for k, v in msg.items() if v is not None}

    async def session(i: int, http: Any) -> tuple[float, Any]:
        # Session ids new in every run: the router answers a request id it has seen from its cache.
        key, sess = gw.open_session(OpenStep(0, log), i, f"bench-{nonce}/0/{rank}-{i}")
        url = gw.base_url(key)
        if harness == "openai":
            # The session's own SDK client over plain HTTP on the node (no TLS context to build:
            # a default AsyncOpenAI loads the CA store, ~30-40 ms of CPU per client).
            oai = openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=600,
                                     http_client=openai.DefaultAsyncHttpxClient(verify=False))
        messages: list[Any] = [{"role": "user", "content": f"Session {i}: look the words up, then sum up."}]
        for turn in range(TURNS):
            last = turn == TURNS - 1
            t = time.perf_counter()
            if harness == "openai":
                msg = await call_openai(oai, messages, last)
            else:
                msg = await call_http(http, url, messages, last)
            added[-1] += (time.perf_counter() - t) * 1000
            messages.append(msg)
            for call in msg.get("tool_calls") or []:
                await asyncio.sleep(tool_s)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "an animal"})
        if harness == "openai":
            await oai.close()
        await gw.close_session(key)
        return time.time(), sess.samples("completed", "", 1.0)

    quiet_gc()  # as the rank does
    cpu0, t0 = time.process_time(), time.time()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        if one_at_a_time:
            done = [await session(i, http) for i in range(n)]
        else:
            done = await asyncio.gather(*(session(i, http) for i in range(n)))
    cpu = time.process_time() - cpu0
    await gw.close()
    await client.close()
    # Exactness: every sample's generations against the Results the engines sent, turn by turn.
    mismatches = turns = roundtrip_failures = 0
    replay = []
    for _, samples in done:
        [s] = samples
        rid = s.session_id
        starts, segs = _segments(s.tokens, s.loss_mask)
        got = [client.results[f"{rid}/{k + 1}"].output_token_ids for k in range(len(segs))]
        turns += len(got)
        mismatches += sum(a != b for a, b in zip(segs, got, strict=True)) + abs(len(segs) - s.num_turns)
        roundtrip_failures += sum(chat.encode(chat.decode(g)) != g for g in got)
        replay.append([(s.tokens[:p], len(g)) for p, g in zip(starts, got, strict=True)])
    return {"start": t0, "end": max(t for t, _ in done), "added_ms": added, "turns": turns, "cpu_s": cpu,
            "mismatches": mismatches, "roundtrip_failures": roundtrip_failures, "replay": replay}


async def _direct_rank(run_dir: Path, rank: int, replay: list[list[tuple[list[int], int]]],
                       tool_s: float) -> dict[str, Any]:
    cfg = load_run_config(run_dir)
    client = RouterClient(RunDir(run_dir))
    await client.connect(30)
    schema = json.dumps({"type": "object", "properties": {"name": {"enum": ["lookup"]}, "arguments":
                         TOOLS[0]["function"]["parameters"]}, "required": ["name", "arguments"],
                         "additionalProperties": False})

    async def session(i: int, turns: list[tuple[list[int], int]]) -> float:
        for k, (prompt, _) in enumerate(turns):
            structured = None if k == len(turns) - 1 else Structured(json_schema=schema)
            res, _ = await client.generate(Generate(
                f"direct/{rank}-{i}/{k}/{time.monotonic_ns()}", job=cfg.job, session_id=f"direct/{rank}-{i}", step=0,
                prompt_token_ids=prompt, sampling=Sampling(MAX_TOKENS, cfg.workload.temperature, cfg.workload.top_p,
                                                           structured=structured)))
            if res.status != "ok":
                raise RuntimeError(f"direct session {i}: {res.status} {res.error}")
            if k < len(turns) - 1:
                await asyncio.sleep(tool_s)
        return time.time()

    quiet_gc()
    cpu0, t0 = time.process_time(), time.time()
    ends = await asyncio.gather(*(session(i, t) for i, t in enumerate(replay)))
    cpu = time.process_time() - cpu0
    await client.close()
    return {"start": t0, "end": max(ends), "cpu_s": cpu, "turns": sum(len(t) for t in replay)}


def _worker(arm: str, run_dir: str, rank: int, arg: Any, tool_s: float) -> dict[str, Any]:
    if arm == "direct":
        return asyncio.run(_direct_rank(Path(run_dir), rank, arg, tool_s))
    harness, _, mode = arm.partition("-")
    return asyncio.run(_gateway_rank(Path(run_dir), rank, arg, harness, tool_s, one_at_a_time=mode == "alone"))


def _unloaded(pool: Any, run_dir: Path, sessions: int) -> dict[str, Any]:
    """The added latency of a turn with nothing else running: one session at a time on one rank."""
    out: dict[str, Any] = {}
    for harness in ("openai", "http"):
        [r] = pool.starmap(_worker, [(f"{harness}-alone", str(run_dir), 0, sessions, 0.0)])
        suffix = "" if harness == "openai" else "_http"
        out[f"added_latency_ms_p50{suffix}"] = round(float(np.percentile(r["added_ms"], 50)), 3)
        out[f"added_latency_ms_p99{suffix}"] = round(float(np.percentile(r["added_ms"], 99)), 3)
        out[f"rank_cpu_ms_per_turn{suffix}"] = round(1000 * r["cpu_s"] / r["turns"], 3)
    return out


async def _cold_caches(run_dir: Path) -> None:
    """Every arm starts with empty prefix caches (a weight update empties them): the arms replay the
    same prompts, and a later arm must not find the earlier one's prefixes cached."""
    client = RouterClient(RunDir(run_dir))
    await client.connect(30)
    try:
        await client.update_weights(str(run_dir), time.monotonic_ns() % (1 << 40))
    finally:
        await client.close()


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _measure(pool: Any, run_dir: Path, n: int, rounds: int, tool_s: float, arms: tuple[str, ...]) -> dict[str, Any]:
    """Alternate the arms ``rounds`` times; per arm: sessions/s, rank CPU per turn, added latency."""
    rates: dict[str, list[float]] = {a: [] for a in (*arms, "direct")}
    cpu: dict[str, list[float]] = {a: [] for a in rates}
    busy: dict[str, list[float]] = {a: [] for a in rates}
    added: dict[str, list[float]] = {a: [] for a in arms}
    turns = mismatches = roundtrip = 0

    def record(arm: str, out: list[dict[str, Any]], before: tuple[int, int]) -> None:
        after = _busy_jiffies()
        busy[arm].append((after[0] - before[0]) / max(1, after[1] - before[1]))
        rates[arm].append(RANKS * n / (max(r["end"] for r in out) - min(r["start"] for r in out)))
        cpu[arm].append(1000 * sum(r["cpu_s"] for r in out) / sum(r["turns"] for r in out))

    for _ in range(rounds):
        replay = None
        for arm in arms:
            asyncio.run(_cold_caches(run_dir))
            before = _busy_jiffies()
            out = pool.starmap(_worker, [(arm, str(run_dir), r, n, tool_s) for r in range(RANKS)])
            record(arm, out, before)
            for r in out:
                added[arm] += r["added_ms"]
                turns += r["turns"]
                mismatches += r["mismatches"]
                roundtrip += r["roundtrip_failures"]
            replay = replay or [r["replay"] for r in out]
        asyncio.run(_cold_caches(run_dir))
        before = _busy_jiffies()
        out = pool.starmap(_worker, [("direct", str(run_dir), r, replay[r], tool_s) for r in range(RANKS)])
        record("direct", out, before)
    mean = {a: statistics.mean(v) for a, v in rates.items()}
    res: dict[str, Any] = {}
    for arm in arms:
        name = "gateway" if arm == "openai" else f"gateway_{arm}"
        res[f"sessions_per_s_{name}"] = round(mean[arm], 2)
        res[f"ratio{'' if arm == 'openai' else '_' + arm}"] = round(mean[arm] / mean["direct"], 3)
        res[f"added_latency_ms_p50{'' if arm == 'openai' else '_' + arm}"] = round(float(np.percentile(added[arm], 50)), 3)
        res[f"added_latency_ms_p99{'' if arm == 'openai' else '_' + arm}"] = round(float(np.percentile(added[arm], 99)), 3)
    res["sessions_per_s_direct"] = round(mean["direct"], 2)
    res["rank_cpu_ms_per_turn"] = {a: round(statistics.mean(v), 3) for a, v in cpu.items()}
    res["machine_cpu_busy"] = {a: round(statistics.mean(v), 3) for a, v in busy.items()}
    res.update(token_mismatches=mismatches, turns_checked=turns, roundtrip_failures=roundtrip,
               rates_per_round={a: [round(x, 2) for x in v] for a, v in rates.items()}, tool_s=tool_s)
    return res


def run(quick: bool = False) -> dict[str, Any]:
    n = 32 if quick else SESSIONS_PER_RANK
    rounds = 1 if quick else 2
    cfg = compose_config(["workload=agent", f"workload.max_tokens={MAX_TOKENS}", "groups.throughput.max_inflight=128",
                          "groups.tail.max_inflight=64", "router.policy=least_loaded"])
    validate(cfg)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp, \
            LocalStack(cfg, Path(tmp) / "run") as stack, mp.get_context("spawn").Pool(RANKS) as pool:
        stack.start(120)
        result = _measure(pool, stack.run_dir.root, n, rounds, TOOL_S, ("openai", "http"))
        result["unloaded"] = _unloaded(pool, stack.run_dir.root, 8 if quick else 50)
        if not quick:
            result["fast_tools"] = _measure(pool, stack.run_dir.root, n, 1, FAST_TOOL_S, ("openai", "http"))
    result.update(sessions=RANKS * n, ranks=RANKS, turns_per_session=TURNS, max_tokens=MAX_TOKENS)
    return result
