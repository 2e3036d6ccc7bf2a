"""Prompt sources: where each session's first prompt comes from. Hydra ``_target_`` classes.

Built-in: :class:`SyntheticPrompts` (random tokens behind a shared system prompt) and
:class:`FilePrompts` (a JSONL or Parquet file of token ids or text). Users add their own by pointing
``workload.prompts._target_`` at any :class:`PromptSource` subclass.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow.parquet as pq

from toolkit.core.draws import id_window, seeded
from toolkit.model.tokenizer import Tokenizer, load_tokenizer, tokenizer_problem

# (argument, value, what is allowed): the problems ``check_spec`` reports; config.validate names the field.
SpecProblem = tuple[str, object, str]


def spec_value(cls: type, spec: dict[str, Any], key: str) -> Any:
    """Argument ``key`` of ``cls`` as ``spec`` builds it: given there, or its default."""
    return spec[key] if key in spec else inspect.signature(cls).parameters[key].default


def int_problems(cls: type, spec: dict[str, Any], at_least: dict[str, int]) -> list[SpecProblem]:
    """Each of ``at_least``'s arguments of ``cls`` (as ``spec`` builds it) that is no integer >= its least value."""
    problems: list[SpecProblem] = []
    for key, least in at_least.items():
        v = spec_value(cls, spec, key)
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            problems.append((key, v, f"an integer >= {least}"))
    return problems


@dataclass
class Prompt:
    token_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)


class PromptSource(ABC):
    @abstractmethod
    def get(self, step: int, index: int) -> Prompt:
        """The prompt of session ``index`` of ``step``; the same arguments give the same prompt."""

    def prompt_key(self, step: int, index: int) -> str:
        """Sessions of ``step`` that share a prompt (``samples_per_prompt``: GRPO siblings) share this key
        (``Generate.prompt_key``); "" (the default): each session stands alone."""
        return ""

    @classmethod
    def check_spec(cls, spec: dict[str, Any]) -> list[SpecProblem]:
        """Problems with this source's Hydra arguments, found before anything starts (``validate``
        calls it with the ``workload.prompts`` dict). Override to check files and arguments."""
        return []


class SyntheticPrompts(PromptSource):
    """Random token prompts behind a shared system prompt (so the prefix cache has something to share).

    Lengths are uniform in [min_len, max_len]; ids lie in [1, vocab_size). ``samples_per_prompt``
    consecutive sessions share a prompt (a GRPO group).
    """

    def __init__(self, min_len: int = 64, max_len: int = 384, system_len: int = 32,
                 vocab_size: int = 32000, seed: int = 0, samples_per_prompt: int = 1) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len} max_len={max_len}")
        if samples_per_prompt < 1:
            raise ValueError(f"need samples_per_prompt >= 1, got {samples_per_prompt}")
        self.min_len, self.max_len, self.vocab_size, self.seed = min_len, max_len, vocab_size, seed
        self.samples_per_prompt = samples_per_prompt
        rng = np.random.default_rng([seed, 0xC0FFEE])
        self.system = rng.integers(1, vocab_size, size=system_len).tolist()

    def prompt_key(self, step: int, index: int) -> str:
        return f"{step}/{index // self.samples_per_prompt}" if self.samples_per_prompt > 1 else ""

    def get(self, step: int, index: int) -> Prompt:
        p = index // self.samples_per_prompt
        rng = seeded(self.seed, f"prompt/{step}/{p}".encode())
        n = int(rng.integers(self.min_len, self.max_len + 1))
        body, _ = id_window(rng, self.vocab_size, max(0, n - len(self.system)))
        return Prompt(self.system + body, {"step": step, "index": index})

    @classmethod
    def check_spec(cls, spec: dict[str, Any]) -> list[SpecProblem]:
        problems = int_problems(cls, spec, {"min_len": 1, "max_len": 1, "system_len": 0, "vocab_size": 2,
                                            "seed": 0, "samples_per_prompt": 1})
        lo, hi = spec_value(cls, spec, "min_len"), spec_value(cls, spec, "max_len")
        if not {"min_len", "max_len"} & {key for key, _, _ in problems} and lo > hi:
            problems.append(("min_len", lo, f"at most max_len ({hi})"))
        return problems


class SyntheticTasks(PromptSource):
    """Tasks for agents (``workload=agent``): no tokens, a seeded ``{"a", "b"}`` per session in
    ``Prompt.metadata`` (what :func:`toolkit.rollout.agents.add_numbers` asks the model to add)."""

    def __init__(self, seed: int = 0, high: int = 999) -> None:
        self.seed, self.high = seed, high

    @classmethod
    def check_spec(cls, spec: dict[str, Any]) -> list[SpecProblem]:
        return int_problems(cls, spec, {"seed": 0, "high": 0})

    def get(self, step: int, index: int) -> Prompt:
        rng = np.random.default_rng([self.seed, step, index])
        a, b = (int(x) for x in rng.integers(0, self.high + 1, size=2))
        return Prompt([], {"a": a, "b": b, "step": step, "index": index})


class FilePrompts(PromptSource):
    """Prompts from a file: JSONL (``.jsonl``, one JSON object per line) or Parquet (``.parquet``, one row each).

    Each record holds either token ids under ``token_key`` (a list of ints, used as is) or text under
    ``text_key`` (encoded with ``tokenizer`` on the rank that runs the session). Every other key is
    passed on in ``Prompt.metadata`` (e.g. a reference answer for a reward function), with ``step``,
    ``index`` and ``record``. Relative paths resolve against the directory ``launch`` started in.
    Every rank reads the whole file (prompts are small next to outputs) and tokenizes only the text of
    its own sessions.

    Session ``index`` of ``step`` reads record ``p % n_records`` with
    ``p = step * ceil(sessions_per_step / samples_per_prompt) + index // samples_per_prompt``: steps walk
    through the file in order, ``samples_per_prompt`` consecutive sessions share a prompt (a GRPO
    group), and a new pass starts when the file is used up (shuffled per pass when ``shuffle``).
    """

    SUFFIXES = (".jsonl", ".parquet")

    def __init__(self, path: str, sessions_per_step: int, samples_per_prompt: int = 1, token_key: str = "token_ids",
                 text_key: str = "prompt", tokenizer: Any = None, shuffle: bool = False, seed: int = 0) -> None:
        problems = self.check_spec({"path": path, "sessions_per_step": sessions_per_step,
                                    "samples_per_prompt": samples_per_prompt, "token_key": token_key,
                                    "text_key": text_key, "tokenizer": tokenizer})
        if problems:
            raise ValueError("; ".join(f"{k} = {v!r}: {allowed}" for k, v, allowed in problems))
        self.path = Path(path)
        self.per_step = math.ceil(sessions_per_step / samples_per_prompt)
        self.samples_per_prompt = samples_per_prompt
        self.token_key, self.text_key = token_key, text_key
        self.tokenizer: Tokenizer | None = load_tokenizer(tokenizer)
        self.shuffle, self.seed = shuffle, seed
        self._records = _read_records(self.path)
        self._perm: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self._records)

    def _record_number(self, step: int, index: int) -> int:
        p = step * self.per_step + index // self.samples_per_prompt
        n = len(self._records)
        if not self.shuffle:
            return p % n
        epoch = p // n
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(n))
        return int(self._perm[1][p % n])

    def prompt_key(self, step: int, index: int) -> str:
        return f"{step}/{index // self.samples_per_prompt}" if self.samples_per_prompt > 1 else ""

    def get(self, step: int, index: int) -> Prompt:
        k = self._record_number(step, index)
        rec = self._records[k]
        ids = rec.get(self.token_key)
        if ids is not None:
            tokens = [int(t) for t in ids]
        else:
            text = rec.get(self.text_key)
            if not isinstance(text, str):
                raise ValueError(f"{self.path} record {k}: neither {self.token_key!r} (token ids) nor "
                                 f"{self.text_key!r} (text)")
            if self.tokenizer is None:
                raise ValueError(f"{self.path} record {k} is text ({self.text_key!r}) but no tokenizer is set")
            tokens = self.tokenizer.encode(text)
        if not tokens:
            raise ValueError(f"{self.path} record {k}: an empty prompt")
        meta = {key: v for key, v in rec.items() if key not in (self.token_key, self.text_key)}
        meta.update(step=step, index=index, record=k)
        return Prompt(tokens, meta)

    @classmethod
    def check_spec(cls, spec: dict[str, Any]) -> list[SpecProblem]:
        problems: list[SpecProblem] = []
        for key in ("sessions_per_step", "samples_per_prompt"):
            v = spec.get(key, 1)
            if not isinstance(v, int) or v < 1:
                problems.append((key, v, "an integer >= 1"))
        tok = spec.get("tokenizer")
        why = tokenizer_problem(tok)
        if why is not None:
            problems.append(("tokenizer", tok, why))
        raw = spec.get("path")
        path = Path(str(raw)) if raw else None
        if path is None or path.suffix not in cls.SUFFIXES or not path.is_file():
            problems.append(("path", raw, f"an existing file ending in one of {list(cls.SUFFIXES)}"))
            return problems
        token_key, text_key = spec.get("token_key", "token_ids"), spec.get("text_key", "prompt")
        try:
            keys, n = _peek(path)
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            return [*problems, ("path", raw, f"a readable JSONL or Parquet file ({exc})")]
        if n == 0:
            problems.append(("path", raw, "a file with at least one record"))
        elif token_key not in keys and text_key not in keys:
            problems.append(("path", raw, f"records with {token_key!r} (token ids) or {text_key!r} (text); "
                                          f"found keys {sorted(keys)}"))
        elif token_key not in keys and tok is None:
            problems.append(("tokenizer", tok, f"a tokenizer: {raw} has text prompts ({text_key!r}) and no "
                                               f"{token_key!r}; set workload.tokenizer"))
        return problems


def _read_records(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    dec = msgspec.json.Decoder(dict)
    out = []
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(dec.decode(line))
                except msgspec.DecodeError as exc:
                    raise ValueError(f"{path}:{n}: not a JSON object ({exc})") from None
    return out


def _peek(path: Path) -> tuple[set[str], int]:
    """The keys of the first record and the number of records, without loading the file."""
    if path.suffix == ".parquet":
        meta = pq.ParquetFile(path)
        return set(meta.schema_arrow.names), meta.metadata.num_rows
    keys: set[str] | None = None
    n = 0
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                if keys is None:
                    keys = set(msgspec.json.decode(line, type=dict))
                n += 1
    return keys or set(), n
