"""``model: tiny``: a random-weight Llama and a tokenizer built on the spot, for CPU runs and tests.

No network and no model hub: the tokenizer is a byte-level BPE trained by the ``tokenizers`` library
on a synthetic corpus, the weights come from a seeded generator. It is a real model architecture
that vLLM loads and runs (hidden 128, 2 layers, 2 heads of 64 dims: the CPU attention kernels reject
head_dim 16), not a model of anything: its outputs are noise.

Also here, for tests and the weight-reload path: another checkpoint of the same architecture (other
seed) and a PEFT-style LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).
The builders need torch, transformers, tokenizers and safetensors: vLLM's own dependencies.

``python -m toolkit.engine.tiny OUT`` writes ``OUT/base``, ``OUT/ckpt``, ``OUT/lora``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

VOCAB = 512
HIDDEN = 128
LAYERS = 2
HEADS = 2
INTERMEDIATE = 256
MAX_POSITIONS = 2048
LORA_RANK = 8
# Bump when the builders change, so an old cache is not reused.
VERSION = 1
MARKER = ".tiny-complete"


def _corpus(n: int = 4000, seed: int = 0) -> Iterator[str]:
    rnd = random.Random(seed)
    words = ["the", "a", "cat", "dog", "runs", "sat", "on", "mat", "quick", "brown", "fox", "jumps",
             "over", "lazy", "hello", "world", "router", "engine", "token", "model", "queue", "fast"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    words += ["".join(rnd.choice(letters) for _ in range(rnd.randint(2, 7))) for _ in range(400)]
    for _ in range(n):
        yield " ".join(rnd.choice(words) for _ in range(rnd.randint(3, 15))) + "."


def build_tokenizer(out: Path) -> object:
    """A byte-level BPE of exactly :data:`VOCAB` tokens (``<s>``=0, ``</s>``=1, ``<pad>``=2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(str(out))
    return fast


def build_model(out: Path, seed: int = 0, tokenizer: object | None = None) -> Path:
    """A complete model directory (config, bf16 safetensors, tokenizer) with weights drawn from ``seed``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_tokenizer(out)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HIDDEN // HEADS,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,  # type: ignore[attr-defined]
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # The default init (std 0.02) gives nearly uniform logits; wider weights make checkpoints and
    # adapters change the greedy output visibly, which the reload and LoRA tests rely on.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))  # type: ignore[attr-defined]
    return out


def build_lora(out: Path, seed: int = 2) -> Path:
    """A PEFT-layout adapter on q_proj and v_proj, with a non-zero B (PEFT's B=0 init is a no-op)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for proj in ("q_proj", "v_proj"):
            pre = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{pre}.lora_A.weight"] = (torch.randn(LORA_RANK, HIDDEN, generator=gen) * 0.5).to(torch.bfloat16)
            tensors[f"{pre}.lora_B.weight"] = (torch.randn(HIDDEN, LORA_RANK, generator=gen) * 0.5).to(torch.bfloat16)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "r": LORA_RANK,
              "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
              "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False,
              "inference_mode": True}
    # adapter_config.json last: its presence is what says "this adapter is complete".
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_tiny(cache_dir: str | Path) -> Path:
    """The tiny model's directory under ``cache_dir``, built there first if it is missing.

    Replicas starting together build it once: the first takes a file lock and builds into a temp dir
    that is renamed into place; the others wait on the lock and find it complete.
    """
    root = Path(cache_dir).expanduser()
    target = root / f"tiny-v{VERSION}"
    if (target / MARKER).exists():
        return target
    with _locked(root / f".tiny-v{VERSION}.lock"):
        if (target / MARKER).exists():
            return target
        logger.info("building the tiny model into %s", target)
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; other users' runs may share the cache
            build_model(tmp, seed=0)
            (tmp / MARKER).write_text("ok\n")
            if target.exists():
                shutil.rmtree(target)  # an incomplete build of a crashed process
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def build_all(out: Path) -> dict[str, Path]:
    """``base`` (seed 0, what ``ensure_tiny`` builds), ``ckpt`` (seed 1, same tokenizer), ``lora``."""
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out / "base")
    return {"base": build_model(out / "base", 0, tok), "ckpt": build_model(out / "ckpt", 1, tok),
            "lora": build_lora(out / "lora", 2)}


if __name__ == "__main__":
    for name, path in build_all(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-models")).items():
        print(f"{name}: {path}")
