"""A length predictor that answers garbage for one session (its sample fails) and the sim's exact plan
for the others."""

from __future__ import annotations

from typing import Any

from toolkit.core.protocol import Generate
from toolkit.rollout.hints import SimOracle


class GarbageOnSession(SimOracle):
    def __init__(self, engine: dict[str, Any], garbage_index: int = 3) -> None:
        super().__init__(0.0, engine)
        self.garbage_index = garbage_index

    def expected_tokens(self, request: Generate) -> Any:
        if request.session_id.split("/")[-1] == str(self.garbage_index):
            return "a lot"
        return super().expected_tokens(request)
