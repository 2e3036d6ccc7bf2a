"""Shared fixtures, the test tiers and what the ``slurm``/``vllm`` markers require.

Tiers are directories: ``tests/unit`` (no processes; ``tests/unit/conftest.py`` fails a test that starts
one; the tier runs alone in under 2 minutes), ``tests/integration`` (real processes on 127.0.0.1, and
whole benchmark smoke runs) and ``tests/cluster`` (markers ``slurm``, ``vllm``). Each test is marked with its tier's name (``-m unit`` and so on), and the terminal summary
gives each tier's test count and summed duration. Helpers shared by test modules live in
``tests/helpers``; no test module imports another one.
"""

from __future__ import annotations

import functools
import os
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

# Before the helpers are imported: their asserts are rewritten like a test module's.
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers.slurm import slurm_problem  # noqa: E402
from toolkit.config import Config, compose_config, register_configs  # noqa: E402
from toolkit.core.rundir import RunDir  # noqa: E402
from toolkit.launch.stack import LocalStack  # noqa: E402
from toolkit.launch.validation import validate  # noqa: E402

register_configs()

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "cluster")


# ---- tiers -----------------------------------------------------------------------------------------
def tier_of(path: Path | str) -> str | None:
    """The tier of a test file: the directory under ``tests/`` it is in."""
    try:
        first = Path(path).resolve().relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return None
    return first if first in TIERS else None


_misplaced = pytest.StashKey[str]()


# Before pytest-xdist's own hook, which reads the xdist_group marks (hence tryfirst).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its tier, and keep the markers honest (a test that breaks a rule fails):
    a unit test needs no Slurm, vLLM or MPI; a cluster test needs Slurm or vLLM; ``slurm``/``vllm`` tests
    are cluster tests.
    The unit tier runs first, then integration, then cluster (in file order within each). Under
    pytest-xdist (``--dist loadgroup``) the ``slurm`` tests are one group and the other ``vllm`` tests
    another: each group runs on one worker, in order, so two tests never compete for the Slurm nodes'
    CPUs or boot vLLM engines side by side, and a fixture's replica serves its whole file."""
    items.sort(key=lambda item: (TIERS + (None,)).index(tier_of(item.path)))
    for item in items:
        tier = tier_of(item.path)
        if tier is None:
            item.stash[_misplaced] = "a test must be under tests/unit, tests/integration or tests/cluster"
            continue
        item.add_marker(getattr(pytest.mark, tier))
        marks = {m.name for m in item.iter_markers()}
        group = "slurm" if "slurm" in marks else "vllm" if "vllm" in marks else None
        if group is not None and tier == "cluster":
            item.add_marker(pytest.mark.xdist_group(group))
        if tier == "unit" and marks & {"slurm", "vllm", "mpi"}:
            item.stash[_misplaced] = (f"a unit test marked {sorted(marks & {'slurm', 'vllm', 'mpi'})}: "
                                      "it belongs in tests/integration or tests/cluster")
        elif tier == "cluster" and not marks & {"slurm", "vllm"}:
            item.stash[_misplaced] = "a test in tests/cluster needs the marker slurm or vllm"
        elif tier != "cluster" and marks & {"slurm", "vllm"}:
            item.stash[_misplaced] = f"marked {sorted(marks & {'slurm', 'vllm'})}: it belongs in tests/cluster"


@functools.cache
def vllm_problem() -> str | None:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import is the answer
        return f"vLLM does not import ({type(exc).__name__}: {exc}); pip install -e '.[vllm]'"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked ``slurm``/``vllm`` skip without a usable Slurm/vLLM, or fail under
    ``TOOLKIT_REQUIRE_SLURM=1``/``TOOLKIT_REQUIRE_VLLM=1`` (CI); checked before any fixture starts
    something (a class-scoped vLLM stack, say). A test in the wrong tier fails here."""
    if why := item.stash.get(_misplaced, None):
        pytest.fail(f"wrong tier: {why}", pytrace=False)
    for marker, problem, env in (("slurm", slurm_problem, "TOOLKIT_REQUIRE_SLURM"),
                                 ("vllm", vllm_problem, "TOOLKIT_REQUIRE_VLLM")):
        if item.get_closest_marker(marker) is not None and (why := problem()):
            if os.environ.get(env, "") not in ("", "0"):
                pytest.fail(f"{env}={os.environ[env]} but {why}", pytrace=False)
            pytest.skip(why)


# ---- time per tier in the terminal summary ----------------------------------------------------------
_durations: dict[str, float] = defaultdict(float)
_counts: Counter[str] = Counter()
_outcomes: dict[str, Counter[str]] = defaultdict(Counter)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # From the node id (under pytest-xdist the reports reach a controller that collected nothing).
    tier = tier_of(TESTS.parent / report.nodeid.split("::")[0]) or "other"
    _durations[tier] += report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _counts[tier] += 1
        _outcomes[tier][report.outcome] += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _counts:
        return
    tr = terminalreporter
    tr.section("time per tier (setup + call + teardown, summed)")
    for tier in (*TIERS, "other"):
        if _counts[tier]:
            outcomes = ", ".join(f"{n} {what}" for what, n in sorted(_outcomes[tier].items()))
            tr.write_line(f"{tier:<12} {_counts[tier]:>4} tests  {_durations[tier]:8.1f} s  ({outcomes})")
    tr.write_line(f"{'all':<12} {sum(_counts.values()):>4} tests  {sum(_durations.values()):8.1f} s")


# ---- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture
def make_run(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    """``make_run(overrides) -> (cfg, run_dir, stack)``: a validated config saved in a fresh run dir;
    the stack's processes are stopped by pid at the end of the test."""
    owned: list[LocalStack] = []

    def factory(overrides: list[str] | None = None) -> tuple[Config, RunDir, LocalStack]:
        cfg = compose_config(overrides)
        validate(cfg)
        stack = LocalStack(cfg, tmp_path / f"run{len(owned)}")
        owned.append(stack)
        return cfg, stack.run_dir, stack

    yield factory
    for p in owned:
        p.stop()
