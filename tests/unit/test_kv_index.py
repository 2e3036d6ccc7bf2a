"""The router's KV index, the ``kv_aware`` policy and admission by KV budget, on constructed replicas and
requests (no process): events applied in order, a gap resynchronised by a snapshot, the longest prefix
found within the load bound, and new sessions held to the budget while admitted ones go on."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.client import hash_prompt
from toolkit.core import protocol as P
from toolkit.core.blocks import Chains, block_hashes, chain_from
from toolkit.engine.kv_events import KvEventLog
from toolkit.engine.prefix_cache import PrefixCache
from toolkit.router.kv_admission import KvAdmission
from toolkit.router.kv_index import WAIT, KvIndex
from toolkit.router.policy import KvAware
from toolkit.router.queue import Request
from toolkit.router.replica import Replica

BS = 4


def replica(name: str, max_inflight: int = 4, capacity: int = 1000) -> Replica:
    return Replica(name, name.encode(), "g", max_inflight, 8192, 32000, kv_block_size=BS, kv_capacity_tokens=capacity)


def request(rid: str, tokens: list[int], session: str = "", job: str = "j", max_tokens: int = 10) -> Request:
    msg = P.Generate(rid, job=job, session_id=session or rid, prompt_token_ids=tokens,
                     sampling=P.Sampling(max_tokens=max_tokens))
    return Request(msg, b"", b"c", job, 0, 0.0)


class Asked:
    def __init__(self) -> None:
        self.who: list[tuple[str, str]] = []

    def __call__(self, r: Replica, why: str) -> None:
        self.who.append((r.replica_id, why))


def indexed(*names: str) -> tuple[KvIndex, Asked, list[Replica]]:
    asked = Asked()
    index = KvIndex(asked)
    rs = [replica(n) for n in names]
    for r in rs:
        index.add(r)
        index.snapshot(r, P.KvSnapshot(0, []))
        index.set_room(r, True)  # the pool's part: each has a slot free
    return index, asked, rs


def test_block_hashes_chain_and_go_on_from_known_ones() -> None:
    tokens = list(range(3, 22))  # 4 whole blocks and 3 tokens
    hs = block_hashes(tokens, BS)
    assert len(hs) == 4 and len(set(hs)) == 4
    assert block_hashes(tokens, BS, hs[:2]) == hs
    assert chain_from(hs[1], tokens[2 * BS:], BS) == hs[2:]
    assert block_hashes([9] + tokens[1:], BS)[1:] != hs[1:]  # a block's hash names its whole prefix


def test_the_event_log_sends_the_net_change_in_numbered_batches() -> None:
    log = KvEventLog()
    assert log.take() is None
    log.stored([1, 2, 3])
    log.removed([2])
    b1 = log.take()
    assert b1 is not None and (b1.seq, sorted(b1.stored), b1.removed, b1.cleared) == (1, [1, 3], [2], False)
    log.stored([4])
    log.cleared()
    log.stored([5])
    b2 = log.take()
    assert b2 is not None and (b2.seq, b2.stored, b2.cleared) == (2, [5], True)
    log.lose_seq = 3
    log.stored([6])
    assert log.take() is None and log.seq == 3  # lost on the way: the next batch shows the gap


def test_the_sim_cache_reports_what_it_stores_and_evicts() -> None:
    cache = PrefixCache(BS, 3 * BS)
    cache.log = KvEventLog()
    a = list(range(1, 10))  # 2 whole blocks
    cache.insert(a)
    cache.insert(list(range(20, 30)))  # 2 more: the oldest goes
    batch = cache.log.take()
    assert batch is not None
    assert set(batch.stored) - set(batch.removed) == set(cache.blocks)
    cache.clear()
    assert cache.log.take().cleared


def test_events_a_gap_and_a_snapshot() -> None:
    index, asked, (a, b) = indexed("a", "b")
    assert [w for _, w in asked.who] == ["registered", "registered"]
    hs = block_hashes(list(range(12)), BS)
    index.apply(a, P.KvEvents(1, stored=hs))
    index.apply(b, P.KvEvents(1, stored=hs[:1]))
    assert index.holders[hs[0]] == 0b11 and index.holders[hs[2]] == 0b01 and index.size == 3
    index.apply(a, P.KvEvents(2, removed=hs[2:]))
    assert hs[2] not in index.holders and index.cached_blocks(a) == 2
    # Batch 4 after 2: what a held is forgotten, a snapshot asked for, later batches wait for it.
    index.apply(a, P.KvEvents(4, stored=hs[2:]))
    assert asked.who[-1] == ("a", "batch 4 came after 2") and index.cached_blocks(a) == 0
    index.apply(a, P.KvEvents(5, stored=hs))
    assert index.cached_blocks(a) == 0
    index.snapshot(a, P.KvSnapshot(5, hs[:2]))
    index.apply(a, P.KvEvents(5, stored=hs))  # held by the snapshot already: ignored
    index.apply(a, P.KvEvents(6, stored=hs[2:]))
    assert index.cached_blocks(a) == 3 and index.holders[hs[0]] == 0b11
    index.apply(a, P.KvEvents(7, cleared=True, stored=hs[:1]))
    assert index.cached_blocks(a) == 1
    # A heartbeat names the last batch sent: the one applied is no news; a later one was lost on the way
    # (found out now, not by a next batch an idle replica may never send).
    n = len(asked.who)
    index.heard(a, 7)
    assert len(asked.who) == n and index.cached_blocks(a) == 1
    index.heard(a, 8)
    assert asked.who[-1] == ("a", "batch 8 was sent, 7 is the last that came") and index.cached_blocks(a) == 0
    index.heard(a, 9)  # waiting for the snapshot: asked once
    assert len(asked.who) == n + 1
    index.snapshot(a, P.KvSnapshot(9, hs[:1]))
    assert index.cached_blocks(a) == 1
    # A replica that leaves takes its bits; its slot goes to the next one.
    index.drop(b)
    assert index.holders[hs[0]] == 0b01 and b.kv_slot == -1
    c = replica("c")
    index.add(c)
    assert c.kv_slot == 1 and index.cached_blocks(c) == 0


def test_the_longest_cached_prefix_within_the_bound_least_loaded_among_equals() -> None:
    index, _, (a, b, c) = indexed("a", "b", "c")
    ctx = list(range(3, 40))
    hs = block_hashes(ctx, BS)
    index.apply(a, P.KvEvents(1, stored=hs[:2]))
    index.apply(b, P.KvEvents(1, stored=hs[:5]))
    index.apply(c, P.KvEvents(1, stored=hs[:5]))
    among = index.mask([a, b, c])
    req = request("r", ctx + [1, 2])
    c.inflight = {"x": req}
    assert index.longest(req, among, lambda r: True) == (b, 5 * BS)  # b and c hold 5; b is less loaded
    index.set_room(b, False)
    assert index.longest(req, among, lambda r: True) == (c, 5 * BS)  # only replicas with a slot free
    assert index.longest(req, among, lambda r: True, with_room=False) == (b, 5 * BS)
    index.set_room(b, True)
    # wait: the replicas holding the longest prefix are full: the turn waits (spill: the next best).
    assert index.longest(req, among, lambda r: True, wait=True) == (b, 5 * BS)
    for r in (b, c):
        r.inflight = {f"y{k}": req for k in range(r.max_inflight)}
        index.set_room(r, False)
    assert index.longest(req, among, lambda r: True, wait=True) == (None, WAIT)
    assert index.longest(req, among, lambda r: True) == (a, 2 * BS)
    for r in (b, c):
        r.inflight = {}
        index.set_room(r, True)
    c.inflight = {"x": req}
    assert index.longest(req, among, lambda r: r is a) == (a, 2 * BS)
    assert index.longest(req, index.mask([a]), lambda r: True) == (a, 2 * BS)
    assert index.longest(request("r2", [99] * 20), among, lambda r: True) == (None, 0)
    assert index.prefix_on(req, b) == 5 * BS and index.prefix_on(req, a) == 2 * BS
    # The last token is always computed: a prompt of exactly 2 cached blocks counts 1 of them.
    assert index.prefix_on(request("r3", ctx[: 2 * BS]), a) == BS


def _longest_by_definition(rs: list[Replica], held: list[set[int]], hs: list[int], among: set[Replica],
                           fits: set[Replica], with_room: bool, wait: bool) -> tuple[Replica | None, int]:
    """``KvIndex.longest`` as its docstring defines it, replica by replica: a replica's prefix is the run of
    blocks it holds from the first; the longest among those in ``among`` (with a slot free, unless ``wait``)
    that fit wins, least loaded among equals, the first on ties."""
    def depth(i: int) -> int:
        n = 0
        while n < len(hs) and hs[n] in held[i]:
            n += 1
        return n

    free = {r for r in rs if r.has_room} if with_room else set(rs)
    cands = [(depth(i), r) for i, r in enumerate(rs) if r in among and (wait or r in free)]

    def least_loaded(pairs: list[tuple[int, Replica]]) -> tuple[Replica | None, int]:
        deepest = max((d for d, _ in pairs), default=0)
        if deepest == 0:
            return None, 0
        at = [r for d, r in pairs if d == deepest]
        return min(at, key=lambda r: (len(r.inflight), rs.index(r))), deepest * BS

    if wait:
        home, _ = least_loaded(cands)
        if home is not None and not home.has_room:
            return None, WAIT
    return least_loaded([(d, r) for d, r in cands if r in free and r in fits])


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_longest_prefix_is_the_one_its_definition_gives(data: st.DataObject) -> None:
    """Whatever the replicas hold (prefixes, gaps, nothing), their load and room, the replicas considered and
    those that fit: ``longest`` (its shortcut through the last block's holders and its walk) answers as the
    definition does."""
    n = data.draw(st.integers(1, 5))
    index, _, rs = indexed(*[f"r{i}" for i in range(n)])
    ctx = list(range(3, 3 + data.draw(st.integers(1, 30))))
    hs = block_hashes(ctx, BS)[: (len(ctx) - 1) // BS]
    held: list[set[int]] = []
    for r in rs:
        shape = data.draw(st.sampled_from(["prefix", "any", "all"]))
        if shape == "prefix":
            mine = set(hs[: data.draw(st.integers(0, len(hs)))])
        elif shape == "all":
            mine = set(hs)
        else:
            mine = {h for h in hs if data.draw(st.booleans())}
        held.append(mine)
        index.apply(r, P.KvEvents(1, stored=sorted(mine)))
        r.inflight = {f"{r.replica_id}-{k}": request("x", [1]) for k in range(data.draw(st.integers(0, r.max_inflight)))}
        index.set_room(r, r.has_room)
    among = {r for r in rs if data.draw(st.booleans())}
    fits = {r for r in rs if data.draw(st.booleans())}
    with_room, wait = data.draw(st.booleans()), data.draw(st.booleans())
    got = index.longest(request("q", ctx), index.mask(among), lambda r: r in fits, with_room=with_room, wait=wait)
    assert got == _longest_by_definition(rs, held, hs, among, fits, with_room, wait)


def test_a_next_turn_hashes_only_its_new_tokens() -> None:
    index, _, _ = indexed("a")
    t1 = list(range(3, 30))
    r1 = request("t1", t1, session="s")
    h1 = index.hashes(r1, BS)
    t2 = t1 + list(range(50, 70))
    r2 = request("t2", t2, session="s")
    assert index.hashes(r2, BS) == block_hashes(t2, BS)
    assert all(a is b for a, b in zip(r2.kv_hashes[BS], h1, strict=False))  # the same hashes: not hashed again
    # A next prompt that does not extend the last one (its first block, or its last known block changed)
    # is hashed whole.
    t3 = [7] + t2[1:]
    h3 = index.hashes(request("t3", t3, session="s"), BS)
    assert h3 == block_hashes(t3, BS) and h3[0] != block_hashes(t2, BS)[0]
    k = len(h3)
    t4 = t3[: k * BS - 1] + [1] + t3[k * BS :] + [9] * BS
    assert index.hashes(request("t4", t4, session="s"), BS) == block_hashes(t4, BS)


def test_chains_keep_each_session_s_last_prompt_and_drop_the_oldest() -> None:
    chains = Chains(keep=2)
    t1 = list(range(3, 30))
    h1, kept = chains.extend("s", t1, BS)
    assert (h1, kept) == (block_hashes(t1, BS), 0)
    h2, kept = chains.extend("s", t1 + [8] * 9, BS)
    assert h2 == block_hashes(t1 + [8] * 9, BS) and kept == len(h1)
    _, kept = chains.extend("s", [1] + t1[1:], BS)  # rewritten at its start: hashed whole
    assert kept == 0
    chains.extend("u", t1, BS)
    chains.extend("v", t1, BS)  # a third session: the least recent ("s") goes
    assert chains.get("s") is None and chains.get("u") is not None and len(chains) == 2


def test_a_client_s_hashes_are_used_and_ones_that_do_not_fit_are_made_here() -> None:
    index, _, _ = indexed("a")
    chains = Chains(keep=8)
    ctx = list(range(3, 30))
    sent = []
    for turn in range(3):
        msg = P.Generate(f"t{turn}", job="j", session_id="s", prompt_token_ids=list(ctx))
        hash_prompt(chains, msg, BS)  # as a RouterClient told the block size does
        sent.append((msg.hashes_from, len(msg.block_hashes or [])))
        req = Request(msg, b"", b"c", "j", 0, 0.0)
        assert index.hashes(req, BS) == block_hashes(ctx, BS)
        ctx += [5] * 7
    # Each turn after the first sent only the blocks its last prompt did not have.
    assert sent[0] == (0, 6) and all(k > 0 and n < 3 for k, n in sent[1:]), sent
    assert index.client_hashed == 3
    # Hashes that do not fit the prompt, or go on from a chain the router no longer has (it restarted):
    # the router hashes the prompt itself.
    short = P.Generate("x", session_id="x", prompt_token_ids=ctx, block_size=BS, block_hashes=[1, 2])
    assert index.hashes(Request(short, b"", b"c", "j", 0, 0.0), BS) == block_hashes(ctx, BS)
    orphan = P.Generate("y", session_id="y", prompt_token_ids=ctx, block_size=BS, block_hashes=[7], hashes_from=6)
    assert index.hashes(Request(orphan, b"", b"c", "j", 0, 0.0), BS) == block_hashes(ctx, BS)
    # Hashes at another block size are not this index's.
    other = P.Generate("z", session_id="z", prompt_token_ids=ctx, block_size=8, block_hashes=block_hashes(ctx, 8))
    assert index.hashes(Request(other, b"", b"c", "j", 0, 0.0), BS) == block_hashes(ctx, BS)
    assert index.client_hashed == 3
    # Wrong hashes that fit are taken on trust: they cost that request its prediction, nothing else.
    wrong = P.Generate("w", session_id="w", prompt_token_ids=ctx, block_size=BS,
                       block_hashes=list(range(len(ctx) // BS)))
    assert index.prefix_on(Request(wrong, b"", b"c", "j", 0, 0.0), index._owner[0]) == 0


def test_clients_are_told_the_one_block_size_of_the_fleet() -> None:
    index, _, (a,) = indexed("a")
    assert index.client_block_size == BS
    b = Replica("b", b"b", "g", 4, 8192, 32000, kv_block_size=2 * BS)
    index.add(b)
    assert index.client_block_size == 0  # two sizes: the router hashes
    index.drop(b)
    assert index.client_block_size == BS
    index.drop(a)
    assert index.client_block_size == 0


def test_kv_aware_follows_the_prefix_and_falls_back_to_hashing() -> None:
    index, _, rs = indexed("a", "b", "c")
    policy = KvAware(rs, 1.25, index, wait_for_home=False)
    ctx = list(range(3, 40))
    index.apply(rs[2], P.KvEvents(1, stored=block_hashes(ctx, BS)))
    req = request("r", ctx + [1], session="s")
    assert policy.choose("s", 0, rs, req) is rs[2]
    # Over its load bound (ceil(1.25 * 9 * 4 / 12) = 4 with 4 in flight): the hashing's choice instead.
    rs[2].inflight = {str(i): req for i in range(4)}
    assert policy.choose("s", 8, [rs[0], rs[1]], req) in rs[:2]
    # affinity=wait: a full replica holding the prefix makes the turn wait for it.
    waiting = KvAware(rs, 1.25, index, wait_for_home=True)
    assert waiting.choose("s", 8, [rs[0], rs[1]], req) is None
    cold = request("cold", [999] * 30, session="cold")
    assert policy.choose("cold", 0, rs, cold) is policy.hashing.choose("cold", 0, rs)


def test_new_sessions_wait_for_budget_while_admitted_ones_go_on() -> None:
    adm = KvAdmission(0.5)
    a = replica("a", max_inflight=1, capacity=1000)  # 500 tokens of budget, one slot
    first = request("s1-t1", [1] * 200, session="s1", max_tokens=100)  # expects 300
    assert adm.is_new(first) and adm.fits(a, first)
    adm.placed(first, a, 0.0)
    assert adm.used[a] == 300 and not adm.is_new(request("s1-t2", [1] * 260, session="s1"))
    second = request("s2-t1", [2] * 200, session="s2", max_tokens=100)
    assert not adm.fits(a, second) and adm.best([a], second) is None and adm.refused == 1
    # Its context grows past what was expected: the reservation grows with it.
    adm.answered(first, 150, 1.0)
    assert adm.used[a] == 350
    # It ends: the reservation goes, and its job now expects 350 tokens of a session.
    adm.done("s1")
    assert a not in adm.used and adm.expected(second) == 350
    adm.placed(second, a, 2.0)
    # A replica that leaves frees its sessions; an idle one without a request expires.
    adm.drop_replica(a)
    assert not adm.sessions and not adm.used
    adm.placed(second, a, 3.0)
    adm.expire(3.0 + 61, live={"s2"})
    assert "s2" in adm.sessions
    adm.expire(3.0 + 61, live=set())
    assert not adm.sessions and not adm.used
    # A session larger than the whole budget still runs where nothing else is admitted.
    big = request("big", [3] * 900, session="big", max_tokens=100)
    assert adm.fits(a, big)


def test_a_twin_under_a_kv_budget_lands_every_session_and_keeps_more_of_the_cache() -> None:
    """The router's own code in the twin: 384 sessions on replicas that cache 40 of them. Uncapped,
    they evict each other; with kv_aware and its budget, the new ones wait and the hit rate rises."""
    from toolkit.config import compose_config
    from toolkit.launch.validation import validate
    from toolkit.plan.twin import Twin

    def run(*policy: str) -> tuple[float, dict[str, int]]:
        cfg = compose_config(["sessions_per_step=384", "steps=1", "engine.kv_cache_tokens=40000",
                              "router.affinity=wait", *policy])
        validate(cfg)
        r = Twin(cfg).run()
        (step,) = r.steps
        assert step["sessions"] == 384 and step["requests_by_status"] == {"ok": step["requests"]}
        return step["prefix_hit_rate"], r.router

    plain, _ = run("router.policy=consistent_hash")
    aware, events = run("router.policy=kv_aware")
    assert aware > plain + 0.1, (plain, aware)


def test_new_sessions_start_in_the_fair_order_under_the_budget_however_large(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Job A's new session (larger than the whole budget) waits for budget while job B keeps a backlog of
    small ones: B's new sessions do not take what B's ended ones free; A starts once its replica has
    fewer sessions than slots. B's admitted sessions go on meanwhile."""
    from tests.helpers.router import answer, ready_replica, router_in_process, submit

    router, _ = router_in_process(tmp_path / "run", ["groups=single", "router.policy=kv_aware", "router.heartbeat_s=5"])
    r = ready_replica(router, "throughput-0@h:1", "throughput", slots=4, capacity=1000)  # 900 tokens of budget
    adm = router.kv.admission
    assert adm is not None
    n = 0

    def b_session() -> None:
        nonlocal n
        n += 1
        submit(router, f"b{n}", [n % 900 + 1] * 50, session=f"B{n}", job="B", max_tokens=50)

    for _ in range(8):  # 4 by slots, 4 more by budget (100 tokens each)
        b_session()
        router.dispatch()
        answer(router, r, f"b{n}", [7] * 50)
    assert adm.count[r] == 8
    submit(router, "a1", [999] * 300, session="A1", job="A", max_tokens=2000)  # expects 2,300 > 900
    for _ in range(3):
        b_session()
    started_b = []
    for _ in range(8):  # B's admitted sessions end one by one
        done = next(s for s in adm.sessions if s.startswith("B"))
        router.on_frontend(b"client", *P.encode(P.SessionDone(job="B", step=-1, session_id=done)))
        before = set(adm.sessions)
        router.dispatch()
        started_b += [s for s in set(adm.sessions) - before if s.startswith("B")]
        if "A1" in adm.sessions:
            break
    assert "A1" in adm.sessions and adm.sessions["A1"].replica is r
    assert started_b == []  # none of B's waiting sessions went before A's


def test_a_first_turn_moved_to_the_tail_group_goes_at_once_taking_its_reservation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Admitted where its first turn went, a session is not new when that turn moves: it does not wait for
    budget on the tail group, and its reservation moves with it."""
    from tests.helpers.router import answer, ready_replica, router_in_process, submit

    router, _ = router_in_process(tmp_path / "run", ["router.policy=kv_aware", "router.heartbeat_s=5"])
    tp = ready_replica(router, "throughput-0@h:1", "throughput", slots=8, capacity=10_000)
    tail = ready_replica(router, "tail-0@h:2", "tail", slots=1, capacity=1000)
    adm = router.kv.admission
    assert adm is not None
    submit(router, "t1", [5] * 600, session="T", max_tokens=100, group="tail")  # 700 of tail's 900, idle
    router.dispatch()
    answer(router, tail, "t1", [6] * 100)
    submit(router, "s1", [9] * 100, session="S", max_tokens=200)
    router.dispatch()
    req = router.live["s1"]
    assert req.replica == tp.replica_id
    router.migrations.start(req, tp, "age", "tail")
    answer(router, tp, "s1", [1] * 50, status="cancelled")
    router.dispatch()
    assert req.replica == tail.replica_id and adm.sessions["S"].replica is tail and adm.refused == 0


def test_a_snapshot_that_never_comes_is_asked_for_again() -> None:
    from toolkit.core import clock

    now = [0.0]
    with clock.virtual(lambda: now[0], 0.0):
        asked = Asked()
        index = KvIndex(asked)
        r = replica("a")
        index.add(r)  # a snapshot asked for: lost on the way
        index.heard(r, 3)
        assert len(asked.who) == 1
        now[0] = 11.0
        index.heard(r, 3)
        assert [why for _, why in asked.who] == ["registered", "the snapshot asked for did not come"]
        index.snapshot(r, P.KvSnapshot(3, [5, 6]))
        now[0] = 30.0
        index.heard(r, 3)
        assert len(asked.who) == 2 and index.cached_blocks(r) == 2


def test_a_lora_turn_is_not_matched_against_the_base_models_blocks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.helpers.router import ready_replica, router_in_process, submit

    router, _ = router_in_process(tmp_path / "run", ["groups=single", "router.policy=kv_aware", "router.heartbeat_s=5"])
    a = ready_replica(router, "throughput-0@h:1", "throughput", slots=4)
    ready_replica(router, "throughput-1@h:2", "throughput", slots=4)
    for r in router.pool.all():
        router.on_backend(r.identity, *P.encode(P.KvSnapshot(seq=0, blocks=[])))
    tokens = list(range(10, 50))
    router.on_backend(a.identity, *P.encode(P.KvEvents(seq=1, stored=block_hashes(tokens, 4))))
    submit(router, "base", [*tokens, 1], session="B", max_tokens=5)
    submit(router, "lora", [*tokens, 1], session="L", max_tokens=5, lora="adapter-x")
    router.dispatch()
    assert router.live["base"].replica == a.replica_id
    assert router.kv.predicted_tokens == 40 and router.kv.dispatched_tokens == 82  # the base turn's alone



def test_a_turn_that_goes_on_from_its_sessions_last_prompt_is_not_a_new_session() -> None:
    """A restarted router's resent mid-session turns (its admission empty) are not held for budget."""
    adm = KvAdmission(0.5)
    later = request("s1-t3", [1] * 40, session="s1")
    later.msg.hashes_from = 8  # its client hashed only the blocks past its last prompt's
    assert adm.is_new(request("s1-t1", [1] * 40, session="s1")) and not adm.is_new(later)
