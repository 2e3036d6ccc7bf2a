"""Length hints on the client side: the sim oracle, what a predictor may answer, and setup errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from toolkit.config import compose_config
from toolkit.core.errors import ConfigError
from toolkit.core.protocol import Generate, Sampling, Structured
from toolkit.engine.plans import plan_output
from toolkit.launch.validation import validate
from toolkit.rollout.hints import HintFailed, LengthHint, SimOracle, ask

ORACLE = "{_target_:toolkit.rollout.hints.SimOracle,sigma:%s,engine:${engine}}"


def requests(n: int) -> list[Generate]:
    return [Generate(f"j/0/{i}/0", job="j", session_id=f"j/0/{i}", step=0, prompt_token_ids=[1, 2, 3 + i],
                     sampling=Sampling(max_tokens=2048)) for i in range(n)]


def test_the_oracle_names_the_sims_plan_and_misses_it_by_the_sigma_asked() -> None:
    cfg = compose_config()
    exact = SimOracle(0.0, {"type": "sim"})
    reqs = requests(400)
    planned = [len(plan_output(cfg.engine, r)[0]) for r in reqs]
    assert [exact.expected_tokens(r) for r in reqs] == planned
    noisy = SimOracle(0.5, {"type": "sim"})
    guesses = [noisy.expected_tokens(r) for r in reqs]
    assert guesses == [noisy.expected_tokens(r) for r in reqs]  # the same miss every time it is asked
    log_miss = np.log(np.array(guesses) / np.array(planned))
    assert 0.4 < float(np.std(log_miss)) < 0.6 and abs(float(np.mean(log_miss))) < 0.1
    structured = Generate("x", sampling=Sampling(max_tokens=10, structured=Structured(choice=["a", "b"])))
    assert exact.expected_tokens(structured) == 0  # its plan needs the tokenizer: no guess


class Answers(LengthHint):
    def __init__(self, value: object) -> None:
        self.value = value

    def expected_tokens(self, request: Generate) -> int:
        if isinstance(self.value, Exception):
            raise self.value
        return self.value  # type: ignore[return-value]


class AsyncHint(LengthHint):
    async def expected_tokens(self, request: Generate) -> int:  # type: ignore[override]
        return 1


def test_a_predictor_answers_a_count_of_tokens_or_its_session_fails() -> None:
    req = requests(1)[0]
    assert ask(Answers(0), req) == 0 and ask(Answers(np.int64(700)), req) == 700
    for bad in (-1, 2.5, "a lot", None, True, math.nan, 1 << 64):
        with pytest.raises(HintFailed, match=r"workload.length_hint returned .*: expected an int in \[0, 2147483647\]"):
            ask(Answers(bad), req)
    with pytest.raises(HintFailed, match="workload.length_hint raised KeyError: 'prompt'"):
        ask(Answers(KeyError("prompt")), req)


def test_every_bad_length_hint_setting_is_reported_at_setup() -> None:
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["+workload.length_hint=" + ORACLE % -1, "engine=vllm"]))
    fields = {e.field: e for e in info.value.errors}
    assert {"workload.length_hint.sigma", "workload.length_hint.engine.type"} <= set(fields)
    assert "0: exact" in str(fields["workload.length_hint.sigma"])
    with pytest.raises(ConfigError, match="workload.length_hint._target_ = 'toolkit.nope.Hint': an importable"):
        validate(compose_config(["+workload.length_hint={_target_:toolkit.nope.Hint}"]))
    with pytest.raises(ConfigError, match="a subclass of toolkit.rollout.hints.LengthHint"):
        validate(compose_config(["+workload.length_hint={_target_:collections.OrderedDict}"]))
    with pytest.raises(ConfigError, match=r"length_hint = 'toolkit.rollout.prompts.Prompt': a predictor it can "
                                          r"build \(Prompt.__init__\(\) missing 1 required positional argument"):
        validate(compose_config(["+workload.length_hint={_target_:toolkit.rollout.prompts.Prompt}"]))
    with pytest.raises(ConfigError, match="expected_tokens is a plain def"):
        validate(compose_config(["+workload.length_hint={_target_:tests.unit.test_hints.AsyncHint}"]))
    with pytest.raises(ConfigError, match="empty with workload.agent"):
        validate(compose_config(["workload=agent", "+workload.length_hint=" + ORACLE % 0.25]))
    validate(compose_config(["+workload.length_hint=" + ORACLE % 0.25]))
    assert issubclass(SimOracle, LengthHint)


def test_a_predictor_no_tail_policy_reads_is_accepted_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="toolkit.launch.validation"):
        validate(compose_config(["+workload.length_hint=" + ORACLE % 0.25, "tail.policy=age"]))
        assert not caplog.records
        validate(compose_config(["+workload.length_hint=" + ORACLE % 0.25, "tail.policy=count", "tail.threshold=0.95"]))
    [record] = caplog.records
    assert "tail.policy=count places no turn by its hint" in record.getMessage()
    assert "tail.policy=age or predict read hints" in record.getMessage()
