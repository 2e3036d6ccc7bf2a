"""Wire protocol: msgspec Structs in two frames, ``[type byte, msgpack payload]``; no pickle.

Clients (rollout ranks, launch) talk to the router's frontend ROUTER socket through a DEALER; replicas
talk to its backend ROUTER socket through a DEALER whose routing id is the replica id. A Result the
router forwards to a client carries a third frame, a :class:`Route` payload with the router's timings.
"""

from __future__ import annotations

from typing import Any, Final, TypeVar

import msgspec

from toolkit.core.errors import ToolkitError

STATUSES: Final = ("ok", "client_error", "engine_dead", "timeout", "cancelled", "adapter_missing", "no_replica")
"""A Result's ``status``. Step reports store the index: only ever append."""


class Message(msgspec.Struct, array_like=True, omit_defaults=True):
    """Base of every wire message. Some are frozen: msgspec allows a frozen Struct over this base, mypy's
    dataclass model does not (hence the ``type: ignore[misc]`` on them)."""


class Structured(Message, frozen=True):  # type: ignore[misc]
    """A constraint on the output (vLLM's structured outputs): exactly one of the fields is set."""

    json_schema: str = ""
    """A JSON Schema (as JSON text): the output is one JSON value that matches it."""
    choice: list[str] = []
    """The output is exactly one of these strings."""


class Sampling(Message, frozen=True):  # type: ignore[misc]
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: bool = True
    """Return the sampled token's logprob for every output token."""
    n: int = 1
    """Samples of this prompt; the first is in the Result's own fields, the others in ``Result.samples``
    (``vllm``; the sim makes one)."""
    ignore_eos: bool = False
    """Generate ``max_tokens`` tokens even past the end-of-sequence token (``vllm``; benchmarks, tests)."""
    structured: Structured | None = None
    """Constrain the output (``tool_choice``, ``response_format`` of the gateway): vLLM's structured
    outputs; the sim emits a seeded instance encoded with its ``tokenizer``."""


class Register(Message):
    replica_id: str
    group: str
    labels: dict[str, str] = {}
    model: str = ""
    max_inflight: int = 64
    max_model_len: int = 8192
    vocab_size: int = 32000
    weights: UpdateWeights | None = None
    """The ``UpdateWeights`` whose checkpoint it holds (None: the model's own weights; ``path`` empty: a
    version streamed to it)."""
    streams: str = ""
    """How its engine takes streamed updates (``StreamWeights``): ``gloo``: it joins the update's chain;
    ``model``: it models the link's time (the sim); empty: it cannot."""
    stream_ranks: int = 1
    """Ranks it takes in an update's chain: one per engine worker (tensor x pipeline parallel)."""
    kv_block_size: int = 0
    """Tokens per block of its prefix cache, when its engine reports what it caches (``KvEvents``); 0: it
    does not."""
    kv_capacity_tokens: int = 0
    """Tokens its engine's KV cache holds (0: unknown)."""


class ReplicaStats(Message):
    """An engine's load and counters: filled by the engine backends, carried by every ``Heartbeat``, and
    the last one kept per replica by the router."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    """Share of the KV cache in use."""
    prefix_hits: int = 0
    """Prompt tokens found in the prefix cache since the engine started."""
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache since the engine started."""
    weight_version: int = 0
    generated_tokens: int = 0
    """Tokens generated since the engine started: the router's evidence of progress."""
    engine_steps: int = 0
    """Engine steps (batches) run since the engine started (``sim``; 0 where the backend does not count)."""
    prefill_tokens: int = 0
    """Prompt tokens computed, not found in the prefix cache, since the engine started (``sim``; else 0)."""
    model_s: float = 0.0
    """Seconds its time model charged for those steps (``sim``; 0 for an engine without a time model)."""
    active_s: float = 0.0
    """Wall seconds in which it had work (``sim``; else 0). What exceeds ``model_s`` is time it fell
    behind its own model's schedule: a CPU shared with other processes."""


class Heartbeat(Message):
    replica_id: str
    stats: ReplicaStats = msgspec.field(default_factory=ReplicaStats)
    kv_seq: int = 0
    """The replica's last KV events batch number (0: none yet, or no events): a router that applied an
    earlier one has lost a batch, and asks for a snapshot without waiting for the next batch."""


MAX_EXPECTED_TOKENS = (1 << 31) - 1
"""The largest length hint (``Generate.expected_tokens``) a client may send; a router caps it at the
turn's budget anyway."""
SEED_RANGE = (-(1 << 63), (1 << 63) - 16)
"""``Sampling.seed``s the wire and an engine's generator take (64 bits), with room for the gateway's
choices 2..16 at seed + 1..15."""


class Generate(Message):
    request_id: str
    job: str = ""
    session_id: str = ""
    step: int = -1
    prompt_token_ids: list[int] = []
    sampling: Sampling = Sampling()
    group: str | None = None
    lora: str | None = None
    deadline: float = 0.0
    """Absolute time.time() after which the request fails as ``timeout``; 0 = none."""
    model: str = ""
    resumed_tokens: int = 0
    """Tokens at the end of ``prompt_token_ids`` that this request generated itself before it moved
    to another replica (tail migration); ``sampling.max_tokens`` is what is left of its budget.
    Engines read them as prompt; the sim continues the output it had planned."""
    prompt_key: str = ""
    """Sessions that share a prompt (``samples_per_prompt``: GRPO siblings) share this key; the ``predict``
    tail policy reads their lengths together. Empty: the session stands alone."""
    expected_tokens: int = 0
    """A length hint: the output tokens the client expects this turn to produce (its own predictor:
    ``workload.length_hint``, or an agent's ``expected_tokens``); a tail policy starts a turn hinted
    long on the tail group. 0 = no hint. It changes where a request runs, never what it generates."""
    kv_tokens: int = 0
    """Tokens at the start of ``prompt_token_ids`` whose KV this request brings from the replica it left
    (``tail.move=kv``): the engine receives them over its KV link instead of computing them."""
    block_size: int = 0
    """The block size of ``block_hashes`` (the router's ``Route.kv_block_size``); 0: none sent."""
    block_hashes: list[int] | None = None
    """The prompt's chained block hashes (``toolkit.core.blocks``) from block ``hashes_from`` on, computed by
    the client so the router (``router.policy=kv_aware``) need not hash prompts on its one thread. Only
    routing reads them: wrong ones cost the request a cache miss, never a wrong output."""
    hashes_from: int = 0
    """Blocks before ``block_hashes``: those of the session's previous prompt, which this one goes on from."""


class Result(Message):
    request_id: str
    status: str = "ok"
    output_token_ids: list[int] = []
    logprobs: list[float] = []
    finish_reason: str = ""
    replica_id: str = ""
    group: str = ""
    cached_tokens: int = 0
    weight_version: int = 0
    error: str = ""
    samples: list[Completion] = []
    """Samples 2..n of a request with ``sampling.n > 1`` (sample 1 is in the fields above)."""
    weight_versions: list[int] = []
    """The weight versions that generated the output tokens, in order (the version of the first token
    first, no version twice in a row): one version, or more for a request that ran across an in-place
    update (``rollout.update_mode=pause``) or moved between replicas. A Result without tokens lists the
    version it ran on. ``weight_version`` is the last of them (the version at the end); empty in a Result
    the router made itself (``timeout``, ``no_replica``, ...)."""


class ResultHead(Message):
    """A :class:`Result` as the router reads it: field for field the same message, its token ids and
    logprobs left encoded. The router passes a Result's payload on as it came and only counts its tokens
    (:func:`array_len`), except for the few it rewrites (a move's legs), which it decodes whole: parsing
    thousands of token ids and logprobs it never reads was most of a Result's cost to it."""

    request_id: str
    status: str = "ok"
    output_token_ids: msgspec.Raw = msgspec.Raw()
    logprobs: msgspec.Raw = msgspec.Raw()
    finish_reason: str = ""
    replica_id: str = ""
    group: str = ""
    cached_tokens: int = 0
    weight_version: int = 0
    error: str = ""
    samples: msgspec.Raw = msgspec.Raw()
    weight_versions: msgspec.Raw = msgspec.Raw()


def array_len(raw: msgspec.Raw) -> int:
    """Elements of the msgpack array ``raw`` encodes, from its header alone (empty: none)."""
    b = memoryview(raw)
    if not b:
        return 0
    if 0x90 <= b[0] <= 0x9F:  # fixarray
        return b[0] & 0x0F
    if b[0] in (0xDC, 0xDD):  # array 16, array 32: big-endian length
        return int.from_bytes(b[1 : 3 if b[0] == 0xDC else 5], "big")
    raise ProtocolError(f"expected a msgpack array, got type byte {b[0]:#x}")


def join_versions(*legs: list[int]) -> list[int]:
    """Versions of consecutive stretches of tokens as one list, in order, no version twice in a row."""
    out: list[int] = []
    for leg in legs:
        for v in leg:
            if not out or out[-1] != v:
                out.append(v)
    return out


class Route(Message):
    """Router-side facts about one request, sent beside its Result."""

    queue_s: float = 0.0
    dispatched_at: float = 0.0
    dispatches: int = 0
    moves: int = 0
    """Times it moved to another replica while it ran (a tail move or flip, a drained replica)."""
    kv_block_size: int = 0
    """The block size at which the router's KV index reads prompts: the client hashes its next prompts at
    it (``Generate.block_hashes``); 0: it need not."""


class Abort(Message):
    request_id: str


class StepBegin(Message):
    job: str
    step: int
    n_sessions: int


class SessionDone(Message):
    job: str
    step: int
    session_id: str


class Reregister(Message):
    """Router to replica: I do not know you (e.g. I restarted); send Register again."""

    reason: str = ""


class StatusRequest(Message):
    pass


class GroupStatus(Message):
    registered: int = 0
    ready: int = 0
    inflight: int = 0
    generated_tokens: int = 0
    """Tokens its replicas generated since this router started, summed from their heartbeats' increments
    (monotonic: a replica that registers again, or whose engine restarts, is not counted twice)."""
    draining: int = 0
    """Registered replicas being drained (``Drain``): they take no new request; not counted in ``ready``."""
    tokens_per_s: float = 0.0
    """Decode rate of its ready replicas together, as learned from their heartbeats."""
    request_tokens_per_s: float = 0.0
    """The best rate one running request gets on one of its ready replicas (tokens/s)."""
    peak_tokens_per_s: float = 0.0
    """The sum of its ready replicas' highest decode rates seen (what the group can do when full)."""
    peak_request_tokens_per_s: float = 0.0
    """The highest per-request rate seen on one of its ready replicas (about a request alone there)."""
    stale_weights: int = 0
    """Registered replicas kept out of service because they could not load the run's current weights."""
    replica_s: float = 0.0
    """Replica-seconds between its replicas' heartbeats since this router started (monotonic)."""
    busy_s: float = 0.0
    """Of those, the seconds in which tokens came out: ``busy_s / replica_s`` is how busy it was."""
    engine_steps: int = 0
    """Its replicas' engine steps since this router started, summed from heartbeat increments, as the
    three below (``ReplicaStats``; counted by the ``sim`` only)."""
    prefill_tokens: int = 0
    model_s: float = 0.0
    active_s: float = 0.0


class StepProgress(Message):
    """A job's current step as the router sees it (for live progress)."""

    step: int = -1
    sessions: int = 0
    """Sessions the step has (``StepBegin.n_sessions``)."""
    done: int = 0
    """Sessions that reported done."""
    started_at: float = 0.0
    """time.time() of the step's ``StepBegin`` at the router."""
    flip_count: int = 0
    flip_at: float = 0.0
    """time.time() of the count flip; 0 = not flipped."""
    moves: int = 0
    """Requests of the step moved to the tail group while running."""


class KvStatus(Message):
    """The router's KV index and budget (``router.policy=kv_aware``, ``router.kv_budget``)."""

    index_blocks: int = 0
    """Distinct blocks held by some replica, as the engines' events say."""
    cached_blocks: dict[str, int] = {}
    """Per replica id: blocks its prefix cache holds."""
    events: int = 0
    """Block events applied since the router started."""
    events_per_s: float = 0.0
    """Over the last seconds."""
    resyncs: int = 0
    """Snapshots asked for (registrations, gaps)."""
    predicted_tokens: int = 0
    """Prompt tokens the index said were cached on the replica each request was sent to (the last token
    of a prompt, always computed, not counted)."""
    dispatched_tokens: int = 0
    """Prompt tokens of the requests sent to replicas that report events."""
    predicted_hit: float = 0.0
    """``predicted_tokens / dispatched_tokens``."""
    client_hashed: int = 0
    """Requests whose prompt's block hashes their client sent (the router hashed the others)."""
    reported_hit: float = 0.0
    """Share of prompt tokens the engines' own counters found cached (their heartbeats, since this router
    started)."""
    admitted_sessions: int = 0
    """Sessions holding a KV reservation on a replica."""
    reserved_tokens: dict[str, int] = {}
    """Per replica id: tokens its admitted sessions reserve."""
    waiting_sessions: int = 0
    """New sessions waiting in the queue for a KV budget."""


class Status(Message):
    groups: dict[str, GroupStatus] = {}
    queued: int = 0
    inflight: int = 0
    completed: int = 0
    steps: dict[str, StepProgress] = {}
    """Per job: its current step."""
    loading: list[str] = []
    """Replicas (their ids) handed the latest weights that have not acknowledged them yet."""
    weights_version: int = -1
    """The latest weights version every replica it was sent to has answered (-1: none yet)."""
    kv: KvStatus | None = None
    """The KV index and budget, when either is on."""


class Completion(Message):
    """One more sample of a request (``Result.samples``)."""

    output_token_ids: list[int] = []
    logprobs: list[float] = []
    finish_reason: str = ""


class UpdateWeights(Message):
    """Client -> router -> every replica: load the checkpoint directory ``path`` in place as ``version``
    and reset the prefix cache. New requests wait meanwhile; the requests in the engine either pause
    between engine steps and go on with the new weights (``rollout.update_mode=pause``) or finish on the
    old ones first (``drain``); none is aborted. Results name the versions of their tokens."""

    path: str
    version: int
    serial: int = 0
    """Set by the router: its count of the run's client updates, which only goes up (across router
    restarts too, through ``weights.json``). A restarted router tells by it weights its predecessor
    forwarded but did not record (a higher serial than the file's) from weights a client has since
    rolled back from (a lower one): a version number cannot, as a rollback lowers it."""


class WeightsUpdated(Message):
    """Replica -> router: ``version`` is loaded (or ``error``). Router -> client: every ready replica has it."""

    version: int
    replica_id: str = ""
    error: str = ""
    replicas: int = 0
    """In the router's answer: how many replicas acknowledged."""


class StreamWeights(Message):
    """Trainer -> router: update ``version`` is ready to stream from ``master:port`` (the trainer's
    rendezvous); the router answers with a ``StreamPlan``, then with ``WeightsUpdated`` once every
    replica of the plan has applied it (or failed). Router -> replica: the same, with the replica's
    ``rank`` in the chain. Not resent: an update whose plan or answer is lost fails, and the trainer
    sends the next one."""

    version: int
    manifest: bytes
    """msgpack of the update's ``toolkit.weights.wire.Manifest``."""
    master: str
    port: int
    base: int = -1
    """The version its deltas apply to (-1: all dense)."""
    timeout_s: float = 300.0
    """How long a peer of the chain may stall before the update fails."""
    target: str = ""
    """A catch-up (``StreamWanted``): the one replica (its id) that gets it; empty: every replica."""
    rank: int = 0
    """Set by the router for a replica: its first place in the chain (1..; its workers take the next
    ``Register.stream_ranks``); 0: not on the chain (the sim)."""
    world: int = 0
    """Set by the router: the chain's ranks, the trainer's included."""
    serial: int = 0
    """Set by the router, as ``UpdateWeights.serial``."""
    prev: int = 0
    """Set by the router for a replica on the chain: the rank its first worker receives from (the
    previous replica's first; 0: the trainer). Its other workers get their shares from its first."""


class StreamPlan(Message):
    """Router -> trainer: who receives a ``StreamWeights``, in chain order."""

    version: int
    world: int = 1
    """Ranks of the chain, the trainer's (0) included: 1 means nobody joins it (modelled links only)."""
    replicas: list[str] = []
    """Every replica that takes the update (the chain's ranks 1.. first, in order)."""
    target: str = ""
    dense: bool = False
    """Refused: no replica holds the delta's base; send the update dense."""
    busy: bool = False
    """Refused for now: every replica is taking another update (a dense copy); send it again shortly."""
    error: str = ""


class StreamWanted(Message):
    """Router -> the trainer that streamed the run's weights: ``replica_id`` (registered late, restarted,
    or left out of an update) needs ``version``, dense, before it serves."""

    version: int
    replica_id: str


class Drain(Message):
    """Client (launch) -> router: elastic scale-down. Each named replica takes no new request from
    now on, and once it holds none it gets ``Shutdown``. No answer; the caller resends until the
    processes are gone (a Drain of a replica already draining changes nothing, an unknown name is
    ignored), so a restarted router drains them again."""

    replicas: list[str]
    """Replica names ``<group>-<index>``: a replica id up to its ``@``."""
    migrate: bool = True
    """Abort their in-flight requests and continue each on its own group (or any group) from where it
    stopped, keeping its tokens and logprobs; false: they finish where they run."""


class KvEvents(Message):
    """Replica to router: the blocks its engine's prefix cache stored and dropped since its last batch
    (toolkit block hashes, ``toolkit.core.blocks``), net per block. ``seq`` counts the replica's batches
    from 1; a gap makes the router ask for a ``KvSnapshot``."""

    seq: int
    stored: list[int] = []
    removed: list[int] = []
    cleared: bool = False
    """Every block went before those stored here (a weight update, an engine restart)."""


class KvResync(Message):
    """Router to replica: send a ``KvSnapshot`` (a batch went missing, or the router does not know you)."""

    reason: str = ""


class KvSnapshot(Message):
    """Replica to router: every block its engine's prefix cache holds, as of batch ``seq``."""

    seq: int
    blocks: list[int] = []


class Leaving(Message):
    """Replica -> router: this replica is going now (a signal stopped it: a preemption, a kill, the run's
    end). Its requests in flight go back to their queues at once, not after missed heartbeats, and do
    not count toward their ``max_engine_deaths``: a replica stopped from outside says nothing about them."""

    reason: str


class Shutdown(Message):
    """Router -> replica: you were drained and hold no request; close the engine and exit 0. Sent
    again on every heartbeat or registration of a replica that was told so."""

    reason: str


# One-byte type frames. Values are part of the wire protocol: never renumber.
TYPE_OF: Final[dict[type[Message], bytes]] = {
    Register: b"\x01",
    Heartbeat: b"\x02",
    Generate: b"\x03",
    Result: b"\x04",
    Abort: b"\x05",
    StepBegin: b"\x06",
    SessionDone: b"\x07",
    Reregister: b"\x08",
    StatusRequest: b"\x09",
    Status: b"\x0a",
    Route: b"\x0b",
    UpdateWeights: b"\x0c",
    WeightsUpdated: b"\x0d",
    Drain: b"\x0e",
    Shutdown: b"\x0f",
    StreamWeights: b"\x10",
    StreamPlan: b"\x11",
    StreamWanted: b"\x12",
    KvEvents: b"\x13",
    KvResync: b"\x14",
    KvSnapshot: b"\x15",
    Leaving: b"\x16",
}
CLASS_OF: Final[dict[bytes, type[Message]]] = {v: k for k, v in TYPE_OF.items()}
DECODERS: Final[dict[bytes, msgspec.msgpack.Decoder[Any]]] = {
    t: msgspec.msgpack.Decoder(cls) for t, cls in CLASS_OF.items()
}
_encoder = msgspec.msgpack.Encoder()

M = TypeVar("M", bound=Message)


class ProtocolError(ToolkitError):
    """A frame that is not a valid message of the protocol."""


def encode(msg: Message) -> list[bytes]:
    """The frames of one message: ``[type, payload]``."""
    return [TYPE_OF[type(msg)], _encoder.encode(msg)]


def decode(type_frame: bytes, payload: bytes) -> Message:
    decoder = DECODERS.get(bytes(type_frame))
    if decoder is None:
        raise ProtocolError(f"unknown message type {bytes(type_frame)!r}; known: {sorted(CLASS_OF)}")
    try:
        return decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:  # (nested past the limit)
        raise ProtocolError(f"bad {CLASS_OF[bytes(type_frame)].__name__} payload: {exc}") from exc


def decode_as(cls: type[M], payload: bytes) -> M:
    msg = decode(TYPE_OF[cls], payload)
    assert isinstance(msg, cls)
    return msg


def request_id_of(payload: bytes) -> str | None:
    """The request id of a Generate that does not decode as one (a float among its token ids...), if
    it can be read at all: the router answers that request with an error instead of dropping it."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError):  # arrays nested past Python's limit: no id to read
        return None
    return raw[0] if isinstance(raw, list) and raw and isinstance(raw[0], str) else None
