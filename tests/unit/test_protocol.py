from __future__ import annotations

import msgspec
import pytest

from toolkit.core import protocol as P

EXAMPLES = [
    P.Register("r1", "throughput", {"group": "throughput"}, "m", 8, 4096, 32000),
    P.Register("r1", "throughput", weights=P.UpdateWeights("/ckpt/3", 3, 4)),
    P.Heartbeat("r1", P.ReplicaStats(3, 1, 0.5, 100, 200, 2, 1000)),
    P.Heartbeat("r1"),
    P.Generate("req", "job", "s1", 4, [1, 2, 3], P.Sampling(16, 0.7, 0.9, 5), "tail", None, 12.5),
    P.Result("req", "ok", [4, 5], [-0.1, -0.2], "stop", "r1", "tail", 16, 2, ""),
    P.Route(0.1, 1234.5, 1),
    P.Abort("req"),
    P.StepBegin("job", 3, 128),
    P.SessionDone("job", 3, "s1"),
    P.Reregister("restart"),
    P.StatusRequest(),
    P.Status({"tail": P.GroupStatus(1, 1, 0)}, 3, 4, 5),
    P.Status({"tail": P.GroupStatus(2, 1, 0, 10, 1)}, 3, 4, 5),
    P.Drain(["throughput-0", "tail-1"]),
    P.Drain(["throughput-0"], migrate=False),
    P.Shutdown("drained"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: P.Message) -> None:
    frames = P.encode(msg)
    assert len(frames[0]) == 1
    assert P.decode(*frames) == msg


def test_type_bytes_are_unique_and_stable() -> None:
    assert len(set(P.TYPE_OF.values())) == len(P.TYPE_OF)
    assert P.TYPE_OF[P.Generate] == b"\x03" and P.TYPE_OF[P.Result] == b"\x04"


def test_array_like_missing_trailing_fields_take_defaults() -> None:
    # Older peers that send fewer trailing fields still decode (fields are only ever appended).
    payload = msgspec.msgpack.encode(["x"])
    assert P.decode(P.TYPE_OF[P.Result], payload) == P.Result("x")
    assert msgspec.msgpack.decode(P.encode(P.Abort("x"))[1]) == ["x"]


def test_scale_down_fields_keep_old_encodings_decoding() -> None:
    # A GroupStatus from before ``draining`` existed decodes with none draining.
    old = msgspec.msgpack.encode([{"tail": [2, 2, 5, 100]}, 0, 5, 9])
    assert P.decode_as(P.Status, old) == P.Status({"tail": P.GroupStatus(2, 2, 5, 100, draining=0)}, 0, 5, 9)
    # New statuses are appended: step reports store a status's index.
    assert P.STATUSES[:6] == ("ok", "client_error", "engine_dead", "timeout", "cancelled", "adapter_missing")
    assert P.STATUSES[-1] == "no_replica"
    assert P.TYPE_OF[P.Drain] == b"\x0e" and P.TYPE_OF[P.Shutdown] == b"\x0f"
    # A Drain without ``migrate`` migrates.
    assert P.decode(P.TYPE_OF[P.Drain], msgspec.msgpack.encode([["a-0"]])) == P.Drain(["a-0"], migrate=True)


def test_bad_frames_raise_protocol_error() -> None:
    with pytest.raises(P.ProtocolError, match="unknown message type"):
        P.decode(b"\xff", b"")
    with pytest.raises(P.ProtocolError, match="bad Generate"):
        P.decode(P.TYPE_OF[P.Generate], b"\x93garbage")
    with pytest.raises(P.ProtocolError):
        P.decode(P.TYPE_OF[P.Generate], msgspec.msgpack.encode(["id", "job", "s", "not-an-int"]))


def test_the_routers_result_head_is_a_result_field_for_field() -> None:
    """The router reads Results as ``ResultHead`` (tokens left encoded): the same fields in the same order,
    so every Result decodes as one, and a head's token count is the Result's."""
    assert P.ResultHead.__struct_fields__ == P.Result.__struct_fields__
    head_dec = msgspec.msgpack.Decoder(P.ResultHead)
    for n in (0, 1, 15, 16, 65_535, 65_536, 70_000):
        res = P.Result("r", "ok", list(range(n)), [-0.5] * n, "length", "rep", "tail", 3, 2, "", [], [1, 2])
        head = head_dec.decode(P.encode(res)[1])
        assert (P.array_len(head.output_token_ids), P.array_len(head.logprobs)) == (n, n)
        assert (head.request_id, head.status, head.cached_tokens, head.error) == ("r", "ok", 3, "")
    # Trailing defaults omitted on the wire: an empty Raw counts none.
    assert P.array_len(head_dec.decode(P.encode(P.Result("x", "timeout", error="late"))[1]).output_token_ids) == 0
    with pytest.raises(P.ProtocolError, match="msgpack array"):
        P.array_len(msgspec.Raw(msgspec.msgpack.encode("not an array")))
