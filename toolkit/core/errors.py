"""The toolkit's exceptions. Messages name the offending value and what is allowed."""

from __future__ import annotations

from dataclasses import dataclass


class ToolkitError(Exception):
    """Base class of every error the toolkit raises on purpose."""


class Terminated(SystemExit):
    """SIGTERM (teardown, ``scancel``, a lost lease) ending this process; whatever code it interrupts,
    a user's environment or agent included, it is never taken for that code's own exit."""


@dataclass(frozen=True)
class FieldError:
    field: str
    value: object
    allowed: str

    def __str__(self) -> str:
        return f"{self.field} = {self.value!r}: {self.allowed}"


class ConfigError(ToolkitError):
    """One or more configuration fields are invalid; lists all of them at once."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = list(errors)
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"invalid configuration ({len(self.errors)} error(s)):\n{lines}")


class ComponentFailed(ToolkitError):
    """A process the run started (router, replica, ranks) exited or could not start."""


class ReadinessTimeout(ToolkitError):
    """Components did not become ready within the configured bound."""


class RouterUnavailable(ToolkitError):
    """The router's address file did not appear or the router does not answer."""


class RouterRefused(RouterUnavailable):
    """The router refused this process's handshake: its CURVE keys are not the run's, or one side uses
    CURVE and the other does not. Nothing sent on that link would ever arrive."""


class RunDirInUse(ToolkitError):
    """The run directory already holds another run's state or outputs."""


class Interrupted(ToolkitError):
    """The run stopped before its last step (a signal, a stop request); ``resume=true`` continues it."""
