"""The tiny hybrid sliding-window model SGLang's server loads: a local config, dummy weights.

SGLang builds its SWA memory pool (`SWAKVPool`) for a model whose config says it is hybrid SWA
(`is_hybrid_swa`, `hybrid_layer_pattern`: 1 = a sliding layer); `Cohere2ForCausalLM` takes the
config's `sliding_window` as the SWA layers' window. Nothing is fetched: with `--load-format
dummy` the weights are random, and with `--skip-tokenizer-init` no tokenizer is needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine_stub.config import EngineConfig

__all__ = ["ServerModel"]

VOCAB_SIZE = 512  # above the driver's byte-level token ids (0..255)


@dataclass(frozen=True)
class ServerModel:
    """The model config for one engine configuration (the scenario's engine section)."""

    window: int
    layer_pattern: str  # "S" sliding, "F" full, as EngineConfig.layer_pattern
    hidden_size: int
    num_heads: int
    max_context_len: int

    def __post_init__(self) -> None:
        if not self.layer_pattern or set(self.layer_pattern) - {"S", "F"}:
            raise ValueError(f"layer_pattern {self.layer_pattern!r}: S and F only")
        if "S" not in self.layer_pattern or "F" not in self.layer_pattern:
            raise ValueError(f"layer_pattern {self.layer_pattern!r}: a hybrid model needs S and F layers")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"hidden_size {self.hidden_size} / num_heads {self.num_heads}: "
                             "an even head dimension is needed (rotary embedding)")

    @classmethod
    def of(cls, config: EngineConfig) -> ServerModel:
        return cls(config.window, config.layer_pattern, config.hidden_size, config.num_heads,
                   config.max_context_len)

    def config_json(self) -> dict:
        sliding = [1 if layer == "S" else 0 for layer in self.layer_pattern]
        return {
            "architectures": ["Cohere2ForCausalLM"],
            "model_type": "cohere2",
            "hidden_size": self.hidden_size,
            "intermediate_size": 2 * self.hidden_size,
            "num_hidden_layers": len(sliding),
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads,
            "head_dim": self.hidden_size // self.num_heads,
            "vocab_size": VOCAB_SIZE,
            "max_position_embeddings": max(self.max_context_len, 2 * self.window),
            "sliding_window": self.window,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "is_hybrid_swa": True,
            "hybrid_layer_pattern": sliding,
            "layer_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "logit_scale": 1.0,
            "torch_dtype": "float32",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "tie_word_embeddings": True,
            "use_qk_norm": False,
            "hidden_act": "silu",
            "attention_bias": False,
        }

    def write(self, directory: str | Path) -> Path:
        """Write config.json into `directory` (made if missing) and return the directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config_json(), indent=1) + "\n",
                                               encoding="utf-8")
        return directory
