"""``model: tiny``: a random-weight Llama and a tokenizer built on the spot, for CPU runs and tests.

No network and no model hub: the tokenizer is a byte-level BPE trained by the ``tokenizers`` library
on a synthetic corpus, the weights come from a seeded generator. It is a real model architecture
that vLLM loads and runs (hidden 128, 2 layers, 2 heads of 64 dims: the CPU attention kernels reject
head_dim 16), not a model of anything: its outputs are noise.

Also here, for tests and the weight-reload path: another checkpoint of the same architecture (other
seed) and a PEFT-style LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).
The builders need torch, transformers, tokenizers and safetensors: vLLM's own dependencies; the
tokenizer alone (:func:`build_tokenizer`, :func:`ensure_tiny_tokenizer`) needs only tokenizers and
transformers.

The tokenizer ships a ChatML-style chat template (:data:`CHAT_TEMPLATE`, our own): ``<|im_start|>``,
``<|im_end|>`` (also the EOS), ``<tool_call>`` and ``</tool_call>`` are single ids. Tools are listed
in the system turn, each call of an assistant turn as a ``<tool_call>`` block holding
``{"name": ..., "arguments": ...}`` (what the gateway's ``hermes`` parser reads back), tool results
as a user turn of ``<tool_response>`` blocks.

``python -m toolkit.model.tiny OUT`` writes ``OUT/base``, ``OUT/ckpt``, ``OUT/lora``.
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
from collections.abc import Callable, Iterator
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
VERSION = 2
MARKER = ".tiny-complete"
# Ids 0..6 in this order. The tool-call tags are added as non-special tokens, so that decoding with
# ``skip_special_tokens`` (vLLM's default) keeps them in the text the tool-call parser reads.
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
TEXT_TOKENS = ["<tool_call>", "</tool_call>"]

# ChatML turns. Every tag trims whitespace: the only text emitted is in the string literals.
# Tools: dicts ``{"type": "function", "function": {...}}`` (what transformers passes) or bare
# ``{"name", "description", "parameters"}``. A call: ``{"type": "function", "function": {"name",
# "arguments"}}`` (OpenAI/HF) or the gateway's flat ``{"id", "name", "arguments"}``; ``arguments`` a dict
# (rendered with tojson) or JSON text (inserted as is). Consecutive tool results share one user turn.
CHAT_TEMPLATE = (
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{- c -}}"
    "{%- elif c is iterable and c is not mapping -%}"
    "{%- for part in c -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set has_system = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_system -%}{{- text(messages[0].content) + '\\n\\n' -}}{%- endif -%}"
    "{{- 'Functions you may call, one JSON signature per line inside <tools></tools>:\\n<tools>' -}}"
    "{%- for t in tools -%}"
    "{{- '\\n' + ((t.function if t.function is defined else t) | tojson) -}}"
    "{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call functions, reply with one block per call:\\n<tool_call>\\n'"
    " + '{\"name\": <function name>, \"arguments\": <JSON object of arguments>}\\n'"
    " + '</tool_call><|im_end|>\\n' -}}"
    "{%- elif has_system -%}"
    "{{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if loop.first and has_system -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.previtem is not defined or loop.previtem.role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + text(m.content) + '\\n</tool_response>' -}}"
    "{%- if loop.nextitem is not defined or loop.nextitem.role != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set body = text(m.content) -%}"
    "{{- '<|im_start|>assistant\\n' + body -}}"
    "{%- for call in (m.tool_calls or []) -%}"
    "{%- set f = call.function if call.function is defined else call -%}"
    "{%- if body or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (f.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if f.arguments is string -%}{{- f.arguments -}}"
    "{%- elif f.arguments is defined and f.arguments is not none -%}{{- f.arguments | tojson -}}"
    "{%- else -%}{{- '{}' -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + text(m.content) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _corpus(n: int = 4000, seed: int = 0) -> Iterator[str]:
    rnd = random.Random(seed)
    words = ["the", "a", "cat", "dog", "runs", "sat", "on", "mat", "quick", "brown", "fox", "jumps",
             "over", "lazy", "hello", "world", "router", "engine", "token", "model", "queue", "fast"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    words += ["".join(rnd.choice(letters) for _ in range(rnd.randint(2, 7))) for _ in range(400)]
    for _ in range(n):
        yield " ".join(rnd.choice(words) for _ in range(rnd.randint(3, 15))) + "."


def build_tokenizer(out: Path) -> object:
    """A byte-level BPE of exactly :data:`VOCAB` tokens, :data:`SPECIAL_TOKENS` first, with the chat
    template, saved to ``out``; returns the ``PreTrainedTokenizerFast``. Needs no torch."""
    # transformers takes seconds to import: only when the tokenizer is built (once per cache).
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Same ids, no longer special: kept by decode(skip_special_tokens=True).
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    assert tok.get_vocab_size() == VOCAB, f"tokenizer has {tok.get_vocab_size()} tokens, not {VOCAB}"
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="<pad>")
    fast.model_max_length = MAX_POSITIONS
    fast.chat_template = CHAT_TEMPLATE
    _save_tokenizer(fast, out)
    return fast


def _save_tokenizer(tok: object, out: Path) -> None:
    # The chat template goes into tokenizer_config.json (not chat_template.jinja): one file, read by all.
    tok.save_pretrained(str(out), save_jinja_files=False)  # type: ignore[attr-defined]


def build_model(out: Path, seed: int = 0, tokenizer: object | None = None) -> Path:
    """A complete model directory (config, bf16 safetensors, tokenizer) with weights drawn from ``seed``."""
    return build_llama(out, seed, tokenizer)


def build_llama(out: Path, seed: int = 0, tokenizer: object | None = None, *, hidden: int = HIDDEN,
                layers: int = LAYERS, heads: int = HEADS, intermediate: int = INTERMEDIATE) -> Path:
    """A random-weight Llama of the given shape with the tiny tokenizer (``bench weights`` builds a 1 GB one)."""
    # torch comes with the vllm extra only.
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_tokenizer(out)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
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
    _save_tokenizer(tok, out)
    return out


def build_lora(out: Path, seed: int = 2) -> Path:
    """A PEFT-layout adapter on q_proj and v_proj, with a non-zero B (PEFT's B=0 init is a no-op)."""
    # torch comes with the vllm extra only.
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


def _ensure(cache_dir: str | Path, name: str, build: Callable[[Path], object]) -> Path:
    """``cache_dir/name``, built there first by ``build(dir)`` if it is missing.

    Processes starting together build it once: the first takes a file lock and builds into a temp dir
    that is renamed into place; the others wait on the lock and find it complete.
    """
    root = Path(cache_dir).expanduser()
    target = root / name
    if (target / MARKER).exists():
        return target
    with _locked(root / f".{name}.lock"):
        if (target / MARKER).exists():
            return target
        logger.info("building %s into %s", name, target)
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; other users' runs may share the cache
            build(tmp)
            (tmp / MARKER).write_text("ok\n")
            if target.exists():
                shutil.rmtree(target)  # an incomplete build of a crashed process
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def ensure_tiny(cache_dir: str | Path) -> Path:
    """The tiny model's directory under ``cache_dir`` (``tiny-v{VERSION}``), built there once."""
    return _ensure(cache_dir, f"tiny-v{VERSION}", lambda out: build_model(out, seed=0))


def ensure_tiny_tokenizer(cache_dir: str | Path) -> Path:
    """The tiny model's tokenizer alone under ``cache_dir`` (``tiny-tokenizer-v{VERSION}``), built
    there once; needs no torch. Same tokens and chat template as the model's directory."""
    return _ensure(cache_dir, f"tiny-tokenizer-v{VERSION}", build_tokenizer)


def build_all(out: Path) -> dict[str, Path]:
    """``base`` (seed 0, what ``ensure_tiny`` builds), ``ckpt`` (seed 1, same tokenizer), ``lora``."""
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out / "base")
    return {"base": build_model(out / "base", 0, tok), "ckpt": build_model(out / "ckpt", 1, tok),
            "lora": build_lora(out / "lora", 2)}


if __name__ == "__main__":
    for name, path in build_all(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-models")).items():
        print(f"{name}: {path}")
