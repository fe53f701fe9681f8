"""HuggingFace `config.json` fields of the public targets the project is sized for.

Shapes only (no weights): the compile report and the memory planner build abstract
targets from them. Any other target: pass its own config.json.
"""

from __future__ import annotations

_LLAMA_7B = dict(model_type="llama", vocab_size=32000, hidden_size=4096,
                 intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, tie_word_embeddings=False)
_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=8192)

PRESETS: dict[str, dict] = {
    # lmsys/vicuna-7b-v1.3 (LLaMA-1 7B)
    "vicuna_7b": dict(_LLAMA_7B, rms_norm_eps=1e-6, max_position_embeddings=2048),
    # meta-llama/Llama-2-7b-chat-hf
    "llama2_7b": dict(_LLAMA_7B, rms_norm_eps=1e-5, max_position_embeddings=4096),
    # meta-llama/Llama-3.1-8B-Instruct
    "llama31_8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, max_position_embeddings=131072,
                       rope_scaling=_LLAMA3_ROPE),
    # Qwen/Qwen2-7B-Instruct
    "qwen2_7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                     intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, max_position_embeddings=32768),
    # meta-llama/Meta-Llama-3-70B-Instruct
    "llama3_70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192,
                       intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, max_position_embeddings=8192),
    # HuggingFaceTB/SmolLM2-135M-Instruct (the embedded default)
    "smollm2": dict(model_type="llama", vocab_size=49152, hidden_size=576,
                    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, max_position_embeddings=8192),
}


def preset_or_file(name_or_path: str) -> tuple[str, dict]:
  """(short name, HF config dict) of a preset name or a config.json path (or a model
  directory holding one)."""
  import json
  import os
  if name_or_path in PRESETS:
    return name_or_path, dict(PRESETS[name_or_path])
  path = name_or_path
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"target {name_or_path!r} is neither a preset {sorted(PRESETS)} nor "
                     f"a HuggingFace config.json (or a directory holding one)")
  with open(path) as f:
    hf = json.load(f)
  return os.path.basename(os.path.dirname(os.path.abspath(path))) or "target", hf
