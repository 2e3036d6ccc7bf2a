"""Command-line overrides checked before Hydra composes them, so that a composition error reaches the user
as the toolkit's own error list (every bad override, its value and what is allowed), not as Hydra's
message about the first one.

``launch`` composes the config once here, as Hydra will (a sweep's first value stands for the sweep).
That composition is the happy path's only extra cost. When it fails, each override is composed on its
own to find every override that fails by itself. Options that change where the config comes from
(``--config-name``, ``--config-dir``...) and the help and info screens are left to Hydra.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import re
from collections.abc import Callable, Sequence

from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob, Override
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console

from toolkit.config import CONF_DIR, Config, compose_config, typing_errors
from toolkit.core.errors import ConfigError, FieldError
from toolkit.launch.validation import validate

COMPOSITION_ERRORS = (HydraException, OmegaConfBaseException, ValueError)
"""What composing a bad override raises (Hydra raises a ValueError for a group choice that is no string)."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a command line's overrides are checked against: ``launch``'s config, with ``base`` composed
    under them (a replayed run's own overrides) and, beside validation's, the errors ``refusals`` finds
    in a composed config (what the fleet twin cannot run), listed together."""

    base: tuple[str, ...] = ()
    refusals: Callable[[Config], list[FieldError]] | None = None

    def compose(self, lines: Sequence[str]) -> Config:
        return compose_config([*self.base, *lines])

    def validate(self, cfg: Config) -> None:
        errors: list[FieldError] = []
        try:
            validate(cfg)
        except ConfigError as exc:
            errors = list(exc.errors)
        if self.refusals is not None:
            errors.extend(e for e in self.refusals(cfg) if e not in errors)
        if errors:
            raise ConfigError(errors)


LAUNCH = Setup()


def _allowed(line: str, exc: BaseException) -> str:
    """What the override should be, from Hydra's or OmegaConf's message."""
    text = str(exc)
    cause = exc.__cause__
    if "Available options in" in text:
        options = [o.strip() for o in text.split("Available options in", 1)[1].splitlines()[1:]]
        names = [o for o in options if o and not o.endswith("_schema") and not o.startswith("Config search")
                 and "provider=" not in o]
        return f"one of {names}"
    if "is not in struct" in text or "Could not override" in text:
        key = line.split("=", 1)[0].lstrip("+~")
        found = _fields_of(cause if cause is not None else exc)
        if found is not None:  # a field of a typed section: a '+' cannot add one either
            where, name, fields = found
            near = difflib.get_close_matches(name, fields, n=1)
            return (f"{name!r} is not a field of {where or 'the config'}"
                    f"{f' (did you mean {near[0]}?)' if near else ''}; its fields: {', '.join(fields)}")
        return f"not a config key (a new key needs a '+': +{key}=...)"
    if "Ambiguous value" in text:
        return "a single value: a list is [a,b], a sweep needs -m (--multirun)"
    if cause is not None and (choices := re.search(r"expected one of \[(.*?)\]", str(cause))):  # a Choice field
        return f"one of {[c.strip() for c in choices.group(1).split(',')]}"
    if cause is not None:
        first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        return re.sub(r"\s+", " ", first)
    return re.sub(r"\s+", " ", text.splitlines()[0] if text else type(exc).__name__)


def _fields_of(exc: BaseException | None) -> tuple[str, str, list[str]] | None:
    """From OmegaConf's error for a key not in a structured config: where the key was looked for
    (``a.b``), the key, and the fields of that config class; None for an open mapping (groups,
    engine.args, labels...), where a '+' adds a key."""
    cls = getattr(exc, "object_type", None)
    key = getattr(exc, "key", None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)) or key is None:
        return None
    where = str(getattr(exc, "full_key", "") or "").rpartition(".")[0]
    return where, str(key), sorted(f.name for f in dataclasses.fields(cls))


def _error(line: str, exc: BaseException) -> FieldError:
    key, _, value = line.partition("=")
    return FieldError(key.lstrip("+~") or line, value, _allowed(line, exc))


def _lines(overrides: Sequence[str], multirun: bool) -> tuple[list[str], list[list[str]], list[FieldError]]:
    """The overrides of one composition (a sweep's first value), every override line to check on its own
    (a sweep: each of its values), and the lines that do not parse."""
    parser = OverridesParser.create()
    first: list[str] = []
    each: list[list[str]] = []
    bad: list[FieldError] = []
    for line in overrides:
        try:
            (o,) = parser.parse_overrides([line])
        except COMPOSITION_ERRORS as exc:
            bad.append(FieldError(line, "", f"not a Hydra override: {str(exc).splitlines()[0]}"))
            continue
        if multirun and o.is_sweep_override():
            values = [f"{o.get_key_element()}={v}" for v in _sweep_values(o)]
            if not values:
                bad.append(FieldError(line, "", "a sweep with at least one value (a glob must match an option of "
                                      "the config group)"))
                continue
            first.append(values[0])
            each.append(values)
        else:
            first.append(line)
            each.append([line])
    return first, each, bad


def _sweep_values(o: Override) -> list[str]:
    """A sweep override's values; a ``glob(...)`` over a config group's options as Hydra expands it (its
    own expansion needs the config loader of a running app)."""
    value = o.value()
    if isinstance(value, Glob):
        return list(value.filter(sorted(p.stem for p in (CONF_DIR / o.key_or_group).glob("*.yaml"))))
    return list(o.sweep_string_iterator())


def check_overrides(overrides: Sequence[str], multirun: bool = False, setup: Setup = LAUNCH) -> None:
    """Raise a :class:`ConfigError` listing every override that does not compose (config errors that need
    the whole config, such as a bad group field, come from the composition itself, also as one list) and,
    outside a sweep, what validation says of the overrides that do."""
    first, each, bad = _lines(overrides, multirun)
    if bad:
        raise ConfigError(bad)
    sweep = any(len(values) > 1 for values in each)
    kept, errors = first, list[FieldError]()
    try:
        cfg = setup.compose(first)
        if not sweep:
            if typing_errors(cfg):  # a group field of the wrong type: listed with the rest, before Hydra starts
                setup.validate(cfg)
            return
        whole: BaseException | None = None  # a sweep's other values are checked one by one below
    except COMPOSITION_ERRORS as exc:
        whole = exc
        kept, errors = _composing(first, setup)
    for i, values in enumerate(each):
        rest = [line for line in kept if line != first[i]]  # (a field of a group chosen beside it composes)
        for line in values[1:]:
            try:
                setup.compose([*rest, line])
                continue
            except (*COMPOSITION_ERRORS, ConfigError):
                pass
            try:  # alone: a value that composes alone but not with the rest is its points' error (below)
                setup.compose([line])
            except COMPOSITION_ERRORS as exc:
                errors.append(_error(line, exc))
            except ConfigError as exc:
                errors.extend(e for e in exc.errors if e not in errors)
    if whole is None and not errors:
        _validate_points(each, setup)
        return
    if errors and kept and not sweep:  # a bad choice (a Choice field) hides no out-of-range value
        try:
            setup.validate(setup.compose(kept))
        except ConfigError as exc:
            errors.extend(e for e in exc.errors if e not in errors)
    raise ConfigError(errors or [FieldError(" ".join(first), "", _allowed(first[-1] if first else "", whole or ""))])


def _composing(lines: list[str], setup: Setup) -> tuple[list[str], list[FieldError]]:
    """The lines that compose together, and the errors of the others (in the order given): each line is
    composed with the lines kept before it, a config group's choice first (``engine=vllm`` before the
    ``engine.*`` fields it brings)."""
    kept: list[str] = []
    errors: dict[int, list[FieldError]] = {}
    for i in sorted(range(len(lines)), key=lambda i: not chooses_group(lines[i])):
        try:
            setup.compose([*kept, lines[i]])
            kept.append(lines[i])
        except COMPOSITION_ERRORS as exc:
            errors[i] = [_error(lines[i], exc)]
        except ConfigError as exc:
            errors[i] = list(exc.errors)
    return kept, [e for i in sorted(errors) for e in errors[i]]


def chooses_group(line: str) -> bool:
    """``line`` picks a config group of ``conf/`` (``engine=vllm``), not a field."""
    key = line.split("=", 1)[0].lstrip("+~")
    return "." not in key and (CONF_DIR / key).is_dir()


MAX_POINTS_CHECKED = 256
"""A sweep's points validated before its first runs (a larger sweep: its first this many)."""


def _validate_points(each: list[list[str]], setup: Setup) -> None:
    """Every point of a sweep, validated as its run will be: a bad value, or values bad only together,
    fail the sweep before its first run, not hours later at that point (and each listed with it)."""
    points: dict[str, tuple[FieldError, list[str]]] = {}  # each error once, with the points that have it
    n = min(MAX_POINTS_CHECKED, math.prod(len(values) for values in each))
    if n > 16:  # ~0.15 s a point (Hydra's compose): say why the sweep has not begun
        Console(stderr=True).print(f"[dim]checking {n} points of the sweep before it begins[/dim]")
    for combo in itertools.islice(itertools.product(*each), MAX_POINTS_CHECKED):
        point = " ".join(line for line, values in zip(combo, each, strict=True) if len(values) > 1)
        try:
            setup.validate(setup.compose(list(combo)))
        except ConfigError as exc:
            for e in exc.errors:  # str: a value may be a list, which does not hash
                points.setdefault(str(e), (e, []))[1].append(point)
        except COMPOSITION_ERRORS as exc:  # values that compose alone but not together (a key of one group)
            e = FieldError("overrides", "", f"they do not compose: {str(exc).splitlines()[0]}")
            points.setdefault(str(e), (e, []))[1].append(point)
    if points:
        raise ConfigError([FieldError(f"{e.field} (sweep point {where[0]}" + (f" and {len(where) - 1} more)"
                                                                              if len(where) > 1 else ")"),
                                      e.value, e.allowed) for e, where in points.values()])


def precheck(argv: Sequence[str], setup: Setup = LAUNCH) -> None:
    """``launch``'s command line: check its overrides unless Hydra is asked for something else."""
    args, _ = get_args_parser().parse_known_args(list(argv))
    if (args.help or args.hydra_help or args.info or args.shell_completion or args.config_name
            or args.config_path or args.config_dir or args.experimental_rerun):
        return
    # (hydra.mode=MULTIRUN on the command line is -m, as Hydra takes it)
    multirun = bool(args.multirun) or "hydra.mode=MULTIRUN" in args.overrides
    check_overrides([o for o in args.overrides if o != "hydra.mode=MULTIRUN"], multirun=multirun, setup=setup)
