"""The gateway's session logic with the tiny model's real tokenizer and chat template: the engine's ids
are kept verbatim, new messages are rendered alone, rewrites and ``n > 1`` choices become branches."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from toolkit.core.protocol import Result
from toolkit.gateway.session import GatewaySession
from toolkit.gateway.types import Choice, ToolCall

pytest.importorskip("transformers")

from toolkit.gateway.chat import ChatTokenizer  # noqa: E402
from toolkit.model.tiny import ensure_tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return ChatTokenizer(ensure_tiny_tokenizer(tmp_path_factory.mktemp("cache")))


def _generated(chat: ChatTokenizer, seed: int, n: int = 40, eos: bool = True) -> list[int]:
    """Random ids (the kind a sampled model emits) that do not survive decode + encode."""
    rnd = random.Random(seed)
    while True:
        ids = [rnd.randrange(10, chat.vocab_size) for _ in range(n)]
        if chat.encode(chat.decode(ids)) != ids:
            break
    return ids + sorted(chat.eos_ids)[:1] if eos else ids


def _turn(chat: ChatTokenizer, sess: GatewaySession, messages: list[dict], ids: list[int],
          calls: list[ToolCall] | None = None) -> dict:
    plan = sess.plan(messages, [])
    res = Result(request_id="r", output_token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")
    choice = Choice(0, chat.content_text(ids), calls or [], "stop", ids, res.logprobs)
    sess.commit(plan, messages, [res], [choice])
    return {"role": "assistant", "content": choice.content}, plan


def test_turns_keep_the_engines_ids_and_render_only_new_messages(chat: ChatTokenizer) -> None:
    sess = GatewaySession(0, "job/0/0", chat)
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    g1, g2 = _generated(chat, 1), _generated(chat, 2, eos=False)
    reply, plan1 = _turn(chat, sess, convo, g1)
    assert plan1.prompt == chat.encode(chat.render(convo, [], True))
    convo += [reply, {"role": "user", "content": "and then?"}]
    reply2, plan2 = _turn(chat, sess, convo, g2)
    assert plan2.branch_reason is None
    # The second prompt is the first prompt, the engine's ids verbatim, then only the new text.
    n = len(plan1.prompt) + len(g1)
    assert plan2.prompt[:n] == plan1.prompt + g1
    assert chat.decode(plan2.prompt[n:]) == "\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n"
    # Re-tokenizing the conversation would not give the engine's ids: the property that matters.
    assert chat.encode(chat.render(convo, [], True))[:n] != plan2.prompt[:n]
    # A generation cut by its budget (no end token) gets the template's whole closing.
    convo += [reply2, {"role": "user", "content": "ok"}]
    plan3 = sess.plan(convo, [])
    m = len(plan2.prompt) + len(g2)
    assert plan3.prompt[:m] == plan2.prompt + g2
    assert chat.decode(plan3.prompt[m:]).startswith("<|im_end|>\n<|im_start|>user\nok")

    [sample] = sess.samples("completed", "", 1.0)
    assert sample.tokens == plan2.prompt + g2
    assert [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if m] == g1 + g2
    assert sample.prompt_length == len(plan1.prompt) and sample.num_turns == 2 and sample.reward == 1.0
    sample.check()


def test_tool_calls_echoed_with_other_json_spacing_still_extend_the_session(chat: ChatTokenizer) -> None:
    sess = GatewaySession(0, "job/0/1", chat)
    convo = [{"role": "user", "content": "add 2 and 3"}]
    call = ToolCall("call_1", "add", '{"a":2,"b":3}')
    _, plan1 = _turn(chat, sess, convo, _generated(chat, 3), [call])
    echo = {"role": "assistant", "content": chat.content_text(sess.line.sample.tokens[len(plan1.prompt):]),
            "tool_calls": [{"id": "call_1", "name": "add", "arguments": '{"b": 3, "a": 2}'}]}
    convo += [echo, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    assert sess.plan(convo, []).branch_reason is None


def test_a_rewritten_history_starts_a_branch_recorded_with_its_reason(chat: ChatTokenizer) -> None:
    sess = GatewaySession(3, "job/0/3", chat)
    convo = [{"role": "user", "content": "hi"}]
    reply, _ = _turn(chat, sess, convo, _generated(chat, 4))
    edited = [*convo, {**reply, "content": "I rewrote this"}, {"role": "user", "content": "go on"}]
    plan = sess.plan(edited, [])
    assert plan.branch_reason is not None and "message 1 (assistant)" in plan.branch_reason
    assert plan.prompt == chat.encode(chat.render(edited, [], True))
    _turn(chat, sess, edited, _generated(chat, 5))
    dropped = sess.plan([{"role": "user", "content": "hi"}], [])
    assert "dropped" in dropped.branch_reason
    tools = sess.plan([*edited, {"role": "user", "content": "x"}], [{"name": "f", "parameters": {}}])
    assert tools.branch_reason == "the tools changed"
    first, second = sess.samples("completed", "", 0.5)
    assert (first.branch, second.branch) == (0, 1)
    assert first.error == "" and second.error.startswith("branch at turn 1: message 1 (assistant) differs")
    assert second.reward == 0.5 and first.reward == 0.0


def _three_choices(chat: ChatTokenizer, sess: GatewaySession, convo: list[dict], seed: int):  # type: ignore[no-untyped-def]
    """One ``n = 3`` call answered: its plan, each choice's ids, and the choices."""
    plan = sess.plan(convo, [])
    ids = [_generated(chat, seed + k) for k in range(3)]
    results = [Result(request_id=f"r{k}", output_token_ids=i, logprobs=[-1.0] * len(i), finish_reason="stop")
               for k, i in enumerate(ids)]
    choices = [Choice(k, chat.content_text(i), [], "stop", i, r.logprobs)
               for k, (i, r) in enumerate(zip(ids, results, strict=True))]
    sess.commit(plan, convo, results, choices)
    return plan, ids, choices


def test_n_choices_the_continued_one_stays_the_others_become_branches(chat: ChatTokenizer) -> None:
    sess = GatewaySession(0, "job/0/4", chat)
    convo = [{"role": "user", "content": "pick"}]
    plan, ids, choices = _three_choices(chat, sess, convo, 10)
    chosen = [*convo, {"role": "assistant", "content": choices[2].content}, {"role": "user", "content": "more"}]
    nxt = sess.plan(chosen, [])
    assert nxt.branch_reason is None and nxt.prompt[:len(plan.prompt) + len(ids[2])] == plan.prompt + ids[2]
    out = sess.samples("completed", "", 1.0)
    assert [s.branch for s in out] == [0, 1, 2]
    final = out[-1]  # the final line is the session's last row
    assert final.reward == 1.0 and final.tokens == plan.prompt + ids[2] and final.error == ""
    assert sorted(s.error for s in out[:-1]) == ["choice 0 of 3 at turn 0, not continued",
                                                 "choice 1 of 3 at turn 0, not continued"]


def test_a_session_that_ends_on_n_choices_rewards_the_one_the_harness_names(chat: ChatTokenizer) -> None:
    """A best-of-n agent's last call: no later call says which choice it took, so it names it
    (``POST /reward {"reward": r, "choice": k}``); the reward and outcome go to that choice's row, and
    a note already on a row (missing logprobs, say) is kept next to the 'not continued' one."""
    sess = GatewaySession(0, "job/0/5", chat)
    plan, ids, _ = _three_choices(chat, sess, [{"role": "user", "content": "pick"}], 20)
    sess.alternatives[0].sample.error = "turn 0: 3 logprobs missing"  # choice 1's own note
    with pytest.raises(ValueError, match=r"no choice 3 \(it has \[0, 1, 2\]\)"):
        sess.choose(3)
    sess.choose(2)
    out = sess.samples("completed", "", 0.5)
    final = out[-1]
    assert final.reward == 0.5 and final.tokens == plan.prompt + ids[2] and final.error == ""
    assert sorted(s.error for s in out[:-1]) == ["choice 0 of 3 at turn 0, not continued",
                                                 "turn 0: 3 logprobs missing; choice 1 of 3 at turn 0, not continued"]


def test_a_call_without_tools_keeps_the_lines_tools_for_the_next_calls(chat: ChatTokenizer) -> None:
    sess = GatewaySession(0, "job/0/8", chat)
    tools = [{"name": "f", "description": "", "parameters": {"type": "object"}}]
    convo = [{"role": "user", "content": "hi"}]
    plan = sess.plan(convo, tools)
    ids = _generated(chat, 20)
    res = Result(request_id="r", output_token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")
    sess.commit(plan, convo, [res], [Choice(0, chat.content_text(ids), [], "stop", ids, res.logprobs)])
    convo += [{"role": "assistant", "content": chat.content_text(ids)}, {"role": "user", "content": "more"}]
    no_tools = sess.plan(convo, [])
    assert no_tools.branch_reason is None and no_tools.tools == tools
    # A branch started by a call without tools is still rendered, and recorded, with the line's tools.
    rewritten = [{"role": "user", "content": "other"}]
    branch = sess.plan(rewritten, [])
    assert branch.branch_reason is not None and branch.tools == tools
    ids2 = _generated(chat, 21)
    res2 = Result(request_id="r2", output_token_ids=ids2, logprobs=[0.0] * len(ids2), finish_reason="stop")
    sess.commit(branch, rewritten, [res2], [Choice(0, chat.content_text(ids2), [], "stop", ids2, res2.logprobs)])
    again = [*rewritten, {"role": "assistant", "content": chat.content_text(ids2)}, {"role": "user", "content": "x"}]
    assert sess.plan(again, tools).branch_reason is None


def test_a_failed_session_keeps_what_it_generated(chat: ChatTokenizer) -> None:
    sess = GatewaySession(0, "job/0/5", chat, record_messages=True)
    _turn(chat, sess, [{"role": "user", "content": "hi"}], _generated(chat, 6))
    [s] = sess.samples("failed", "agent raised ValueError: boom", 0.0)
    assert s.status == "failed" and s.error == "agent raised ValueError: boom" and s.num_turns == 1
    assert '"role": "assistant"' in s.messages
    empty = GatewaySession(1, "job/0/6", chat).samples("failed", "agent timed out", 0.0)
    assert len(empty) == 1 and empty[0].tokens == [] and empty[0].status == "failed"


def test_a_sessions_outcome_is_its_last_row_wherever_columns_travel(chat: ChatTokenizer) -> None:
    from toolkit.session.columns import final_rows, pack

    a = GatewaySession(0, "job/0/0", chat)
    reply, _ = _turn(chat, a, [{"role": "user", "content": "hi"}], _generated(chat, 30))
    _turn(chat, a, [{"role": "user", "content": "rewritten"}], _generated(chat, 31))  # a branch
    b = GatewaySession(1, "job/0/1", chat)
    rows = a.samples("failed", "agent raised", 0.0) + b.samples("completed", "", 1.0)
    cols = pack(rows, ["g"])
    assert cols["index"].tolist() == [0, 0, 1] and cols["branch"].tolist() == [0, 1, 0]
    assert final_rows(cols).tolist() == [False, True, True]
    assert [r.status for r in rows] == ["completed", "failed", "completed"]  # the failure is the session's


def test_each_tokens_bytes_are_its_own_even_inside_a_character(chat: ChatTokenizer) -> None:
    """OpenAI's logprobs ``bytes``: a token that is half of 'é' is that half (0xC3), not U+FFFD's
    three bytes, so a client joining them gets the text back."""
    text = "é → ok <|im_end|>"
    ids = chat.encode(text)
    pieces = chat.token_bytes(ids)
    assert b"".join(pieces) == text.encode()
    assert b"\xc3" in pieces and all(p != "\ufffd".encode() for p in pieces)


def test_a_sentencepiece_tokens_bytes_keep_its_space(tmp_path: Path) -> None:
    """Llama-2, Mistral and Gemma's tokenizers mark a space with ``▁`` in their tokens, and decoding a
    token alone drops it: each token's bytes are its text with the space, its byte-fallback tokens
    their byte, so joined they give the text back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁hello", "▁world", "▁", "ok"]
    model = models.Unigram([(p, -1.0 if p.startswith("▁") else -5.0) for p in pieces], unk_id=0, byte_fallback=True)
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(tmp_path)
    chat = ChatTokenizer(tmp_path)
    text = " hello world é ok"
    ids = chat.encode(text)
    assert "▁world" in chat.tok.convert_ids_to_tokens(ids)
    got = chat.token_bytes(ids)
    assert b"".join(got) == text.encode() and b" world" in got and b"\xc3" in got
    texts, raw = chat.token_pieces(ids)
    assert raw == got and texts[:2] == [" hello", " world"]  # a token's text is its bytes' where they are whole


def test_a_call_cancelled_twice_still_holds_the_session_until_its_thread_is_done() -> None:
    """A big call plans in a thread, holding its session's lock. Cancelled (its caller went away), and
    cancelled again (aiohttp's shutdown), it still waits for the thread: the thread works on the session,
    which the next call must not get meanwhile."""
    import asyncio
    import threading

    from toolkit.gateway.server import _in_thread

    async def body() -> None:
        started, release, done = threading.Event(), threading.Event(), []

        def plan() -> int:
            started.set()
            assert release.wait(10)
            done.append(1)
            return 1

        lock = asyncio.Lock()

        async def call() -> None:
            async with lock:
                await _in_thread(plan)

        task = asyncio.create_task(call())
        assert await asyncio.to_thread(started.wait, 10)
        for _ in range(2):
            task.cancel()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        assert lock.locked() and not task.done() and not done
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert done == [1] and not lock.locked()

    asyncio.run(body())
