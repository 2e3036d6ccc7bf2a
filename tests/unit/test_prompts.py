"""Prompt files (JSONL, Parquet; token ids or text + a tokenizer), tokenizers, the reward-function env,
and the configuration checks that catch a bad prompt file or a missing tokenizer before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from toolkit.config import compose_config
from toolkit.core.errors import ConfigError
from toolkit.launch.composition import check_overrides
from toolkit.launch.validation import validate
from toolkit.model.tokenizer import ByteTokenizer, load_tokenizer
from toolkit.rollout.envs import SingleTurnEnv
from toolkit.rollout.prompts import FilePrompts, Prompt, SyntheticPrompts

ROOT = Path(__file__).resolve().parents[2]
BYTE = {"_target_": "toolkit.model.tokenizer.ByteTokenizer"}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_token_ids_walk_the_file_step_by_step(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [{"token_ids": [i + 1, i + 2], "answer": str(i)} for i in range(5)])
    src = FilePrompts(str(f), sessions_per_step=2)
    got = [(s, i, src.get(s, i)) for s in range(3) for i in range(2)]
    assert [p.token_ids[0] - 1 for _, _, p in got] == [0, 1, 2, 3, 4, 0]  # wraps into a second pass
    assert got[1][2].metadata == {"answer": "1", "step": 0, "index": 1, "record": 1}
    assert src.get(1, 1) == src.get(1, 1)  # the same arguments give the same prompt


def test_samples_per_prompt_groups_sessions_and_shuffle_is_a_seeded_permutation(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [{"token_ids": [i + 1]} for i in range(6)])
    grouped = FilePrompts(str(f), sessions_per_step=6, samples_per_prompt=3)
    assert [grouped.get(0, i).token_ids for i in range(6)] == [[1], [1], [1], [2], [2], [2]]
    assert grouped.get(1, 0).token_ids == [3]
    # Siblings share a prompt key (the router's predict policy reads their lengths together).
    assert [grouped.prompt_key(1, i) for i in range(6)] == ["1/0"] * 3 + ["1/1"] * 3
    assert FilePrompts(str(f), sessions_per_step=6).prompt_key(0, 1) == ""  # alone: no key
    synthetic = SyntheticPrompts(samples_per_prompt=2, seed=1)
    assert synthetic.get(0, 2).token_ids == synthetic.get(0, 3).token_ids != synthetic.get(0, 4).token_ids
    assert (synthetic.prompt_key(0, 2), synthetic.prompt_key(0, 3), synthetic.prompt_key(0, 4)) == ("0/1", "0/1", "0/2")
    assert SyntheticPrompts(seed=1).get(0, 3).token_ids != SyntheticPrompts(seed=1).get(0, 2).token_ids
    shuffled = FilePrompts(str(f), sessions_per_step=6, shuffle=True, seed=3)
    first = sorted(shuffled.get(0, i).token_ids[0] for i in range(6))
    assert first == [1, 2, 3, 4, 5, 6]  # one pass visits every record once
    again = FilePrompts(str(f), sessions_per_step=6, shuffle=True, seed=3)
    assert [again.get(1, i).token_ids for i in range(6)] == [shuffled.get(1, i).token_ids for i in range(6)]


def test_parquet_prompts_with_text_and_the_byte_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["hi", "héllo"], "id": [7, 8]}), path)
    src = FilePrompts(str(path), sessions_per_step=2, tokenizer=BYTE)
    p = src.get(0, 1)
    assert ByteTokenizer().decode(p.token_ids) == "héllo" and p.metadata["id"] == 8


def test_text_prompts_without_a_tokenizer_fail_with_a_clear_error(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}])
    with pytest.raises(ValueError, match="tokenizer.*has text prompts"):
        FilePrompts(str(f), sessions_per_step=1)
    bad = write_jsonl(tmp_path / "q.jsonl", [{"question": "hello"}])
    with pytest.raises(ValueError, match="records with 'token_ids'.*found keys"):
        FilePrompts(str(bad), sessions_per_step=1)
    with pytest.raises(ValueError, match="an existing file"):
        FilePrompts(str(tmp_path / "missing.jsonl"), sessions_per_step=1)


def test_a_tokenizer_json_is_loaded_with_the_tokenizers_library(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(["the tool answered: forty two", "call the calculator tool"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "call the tool"}])
    src = FilePrompts(str(f), sessions_per_step=1, tokenizer=str(tmp_path))  # a directory works too
    ids = src.get(0, 0).token_ids
    hf = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert hf is not None and ids == hf.encode("call the tool") and hf.decode(ids) == "call the tool"


def test_single_turn_env_scores_with_a_reward_function_from_the_prompt_metadata() -> None:
    env = SingleTurnEnv(reward_fn="tests.unit.test_prompts.exact_answer")
    env.reset(Prompt([1, 2], {"answer": [7, 8]}))
    assert env.step([7, 8], "stop").reward == 1.0
    env.reset(Prompt([1, 2], {"answer": [7, 8]}))
    assert env.step([7, 9], "stop").reward == 0.0
    default = SingleTurnEnv(max_len=2)
    default.reset(Prompt([1]))
    assert default.step([5, 6], "stop").reward == 1.0 and default.step([5, 6, 7], "stop").reward == 0.0


def exact_answer(prompt: Prompt, generated: list[int], finish_reason: str) -> float:
    return float(generated == prompt.metadata["answer"])


def errors_of(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        check_overrides(overrides)  # a bad choice fails at composition, listed with validation's errors
        validate(compose_config(overrides))
    return {e.field: e.allowed for e in info.value.errors}


def test_validate_lists_every_output_decode_and_prompt_file_problem_at_once(tmp_path: Path) -> None:
    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "hi"}])
    errs = errors_of(["rollout.output=nfs", "rollout.decode_responses=true", "workload=jsonl",
                      f"workload.prompts.path={text}", "workload.tokenizer=null"])
    assert "one of ['gather', 'shards']" in errs["rollout.output"]
    assert "needs workload.tokenizer" in errs["rollout.decode_responses"]
    assert "has text prompts" in errs["workload.prompts.tokenizer"]
    errs = errors_of(["workload=jsonl", f"workload.prompts.path={tmp_path / 'nope.jsonl'}",
                      f"workload.tokenizer={tmp_path / 'nope.json'}"])
    assert "an existing file" in errs["workload.prompts.path"]
    assert "tokenizer.json" in errs["workload.tokenizer"]


def test_the_example_jsonl_workload_and_shards_output_validate() -> None:
    cfg = compose_config(["workload=jsonl", "rollout.output=shards", "rollout.decode_responses=true"])
    cfg.workload.prompts["path"] = str(ROOT / cfg.workload.prompts["path"])  # tests may run from anywhere
    validate(cfg)
    src = FilePrompts(**{k: v for k, v in cfg.workload.prompts.items() if k != "_target_"})
    assert len(src) == 16 and src.get(0, 0).metadata["answer"] == "5"
