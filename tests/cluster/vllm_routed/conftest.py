"""``routed``: one router and one vLLM replica for the tests of this package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from toolkit.config import compose_config
from toolkit.launch.stack import LocalStack
from toolkit.launch.validation import validate


@pytest.fixture(scope="package")
def routed(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A router and one vLLM replica of the tiny model (LoRA on), shared by every test of this package:
    vLLM starts once (about 35 s on 2 cores) instead of once per module. Only test_vllm_router.py
    changes its weights, in its last test (its first asserts version 0); the other modules' tests hold
    whatever the weights are (the gateway's ids, structured outputs)."""
    cfg = compose_config(["model=tiny", f"engine.cache_dir={models['cache']}", "groups=single",
                          "++engine.args.enable_lora=true", "++engine.args.max_lora_rank=8"])
    validate(cfg)
    with LocalStack(cfg, tmp_path_factory.mktemp("routed") / "run") as stack:
        stack.start(timeout_s=300)
        yield stack
