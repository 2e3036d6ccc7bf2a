"""``python -m toolkit.bench gateway``: agents over HTTP through the gateway vs the same sessions straight
through ``RouterClient``.

One router and three sim replicas (the default fleet: two throughput replicas, one TP-2 tail replica,
the 8B/H200 step model at ``time_scale`` 1). Two rank processes, each with 256 concurrent sessions
(512 in all) of 4 turns: three forced tool calls (``tool_choice=required``, generated under the
call's JSON schema), each answered by a tool that takes ``TOOL_S``, then a free answer.

- **gateway**: in each rank process, a :class:`~toolkit.gateway.server.Gateway` on 127.0.0.1 and 256
  agents written against the real ``openai`` SDK (``AsyncOpenAI``, Chat Completions with tools) in
  the same event loop, as ``workload=agent`` runs them.
- **direct**: the same sessions replayed token for token through ``RouterClient``: every turn's
  prompt ids as the gateway sent them (the sim answers a prompt deterministically, so the engines do
  the same work), the same tool latency between turns: what a user who did the token bookkeeping
  in-process would run.

Arms alternate (gateway, direct, gateway, direct; ``--quick``: one each at 64 sessions).
``sessions_per_s_*`` = sessions / (last session end - first session start) over both ranks,
averaged over the rounds. ``added_latency_ms_*`` per turn = the SDK call's duration minus the
time the gateway spent waiting for the router (the ``x-toolkit-generate-ms`` header): parsing,
rendering, tokenizing, decoding, tool-call parsing, HTTP and the SDK itself. ``token_mismatches`` =
turns whose ids in the merged samples differ from the Result the engine returned (recorded by the
rank's client), over every turn of every gateway round; the tokenizer is the tiny model's byte-level
BPE, on which ``roundtrip_failures`` of those turns' outputs do not survive decode + encode.
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
from toolkit.config import compose_config, group_engine, validate
from toolkit.protocol import Generate, Result, Route
from toolkit.stack import LocalStack

SESSIONS_PER_RANK = 256
RANKS = 2
TURNS = 4
TOOL_S = 0.05
MAX_TOKENS = 64
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up in the dictionary.",
    "parameters": {"type": "object", "properties": {"word": {"enum": ["cat", "dog", "fox", "owl"]}},
                   "required": ["word"], "additionalProperties": False}}}]


class RecordingClient(RouterClient):
    """The rank's real client, keeping every Result it got by request id (the engines' own ids)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.results: dict[str, Result] = {}

    async def generate(self, msg: Generate) -> tuple[Result, Route | None]:
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


async def _gateway_rank(run_dir: Path, rank: int, n: int) -> dict[str, Any]:
    import httpx
    import openai

    from toolkit.config import load_run_config
    from toolkit.gateway.chat import ChatTokenizer, chat_tokenizer_dir
    from toolkit.gateway.server import Gateway, gateway_settings
    from toolkit.rollout.stepreport import RequestLog
    from toolkit.rundir import RunDir

    rd = RunDir(run_dir)
    cfg = load_run_config(run_dir)
    client = RecordingClient(rd)
    await client.connect(30)
    chat = ChatTokenizer(chat_tokenizer_dir(cfg))
    gw = Gateway(gateway_settings(cfg, rd, rank, group_engine(cfg, "throughput").max_model_len), chat, client)
    await gw.start()
    added: list[float] = []
    log = RequestLog()
    # One HTTP client for the rank's agents, as one writes it for hundreds of sessions: a new
    # AsyncOpenAI builds its own (TLS context included), ~40 ms of CPU each.
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=n))

    async def session(i: int) -> tuple[float, Any]:
        key, sess = gw.open_session(0, i, f"bench/0/{rank}-{i}", log)
        oai = openai.AsyncOpenAI(base_url=gw.base_url(key), api_key="bench", max_retries=0, timeout=600,
                                 http_client=http)
        messages: list[Any] = [{"role": "user", "content": f"Session {i}: look the words up, then sum up."}]
        for turn in range(TURNS):
            last = turn == TURNS - 1
            t = time.perf_counter()
            raw = await oai.chat.completions.with_raw_response.create(
                model="policy", messages=messages, tools=TOOLS, tool_choice="none" if last else "required",
                max_tokens=MAX_TOKENS)
            out = raw.parse()
            added.append((time.perf_counter() - t) * 1000 - float(raw.headers["x-toolkit-generate-ms"]))
            msg = out.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls or []:
                await asyncio.sleep(TOOL_S)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "an animal"})
        await gw.close_session(key)
        return time.time(), sess.samples("completed", "", 1.0)

    t0 = time.time()
    done = await asyncio.gather(*(session(i) for i in range(n)))
    await http.aclose()
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
    return {"start": t0, "end": max(t for t, _ in done), "added_ms": added, "turns": turns,
            "mismatches": mismatches, "roundtrip_failures": roundtrip_failures, "replay": replay}


async def _direct_rank(run_dir: Path, rank: int, replay: list[list[tuple[list[int], int]]]) -> dict[str, Any]:
    from toolkit.config import load_run_config
    from toolkit.protocol import Sampling, Structured
    from toolkit.rundir import RunDir

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
                await asyncio.sleep(TOOL_S)
        return time.time()

    t0 = time.time()
    ends = await asyncio.gather(*(session(i, t) for i, t in enumerate(replay)))
    await client.close()
    return {"start": t0, "end": max(ends)}


def _worker(arm: str, run_dir: str, rank: int, arg: Any) -> dict[str, Any]:
    if arm == "gateway":
        return asyncio.run(_gateway_rank(Path(run_dir), rank, arg))
    return asyncio.run(_direct_rank(Path(run_dir), rank, arg))


def _arm(pool: Any, arm: str, run_dir: Path, args: list[Any]) -> list[dict[str, Any]]:
    return pool.starmap(_worker, [(arm, str(run_dir), r, args[r]) for r in range(RANKS)])


def run(quick: bool = False) -> dict[str, Any]:
    n = 32 if quick else SESSIONS_PER_RANK
    rounds = 1 if quick else 2
    cfg = compose_config(["workload=agent", f"workload.max_tokens={MAX_TOKENS}", "groups.throughput.max_inflight=128",
                          "groups.tail.max_inflight=64", "router.policy=least_loaded"])
    validate(cfg)
    rates: dict[str, list[float]] = {"gateway": [], "direct": []}
    added: list[float] = []
    turns = mismatches = roundtrip = 0
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp, \
            LocalStack(cfg, Path(tmp) / "run") as stack, mp.get_context("spawn").Pool(RANKS) as pool:
        stack.start(120)
        for _ in range(rounds):
            gw = _arm(pool, "gateway", stack.run_dir.root, [n] * RANKS)
            rates["gateway"].append(RANKS * n / (max(r["end"] for r in gw) - min(r["start"] for r in gw)))
            for r in gw:
                added += r["added_ms"]
                turns += r["turns"]
                mismatches += r["mismatches"]
                roundtrip += r["roundtrip_failures"]
            direct = _arm(pool, "direct", stack.run_dir.root, [r["replay"] for r in gw])
            rates["direct"].append(RANKS * n / (max(r["end"] for r in direct) - min(r["start"] for r in direct)))
    g, d = statistics.mean(rates["gateway"]), statistics.mean(rates["direct"])
    return {
        "sessions_per_s_gateway": round(g, 2),
        "sessions_per_s_direct": round(d, 2),
        "ratio": round(g / d, 3),
        "added_latency_ms_p50": round(float(np.percentile(added, 50)), 3),
        "added_latency_ms_p99": round(float(np.percentile(added, 99)), 3),
        "token_mismatches": mismatches,
        "turns_checked": turns,
        "roundtrip_failures": roundtrip,
        "rates_per_round": {k: [round(v, 2) for v in vs] for k, vs in rates.items()},
        "sessions": RANKS * n, "ranks": RANKS, "turns_per_session": TURNS, "tool_s": TOOL_S,
    }
