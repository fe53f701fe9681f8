"""Loading a target model: params, config and tokenizer, from any supported source.

Sources: the embedded default (`"smollm2"`), a HuggingFace model directory (config.json +
safetensors, no torch needed), a GGUF file, or an in-memory transformers model.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from jakiro_jax.integrity import check_finite
from jakiro_jax.models import convert
from jakiro_jax.models.config import LlamaConfig, config_from_hf, load_hf_config

EMBEDDED_TARGETS = ("smollm2",)


@dataclasses.dataclass
class Target:
  """A loaded target LLM. `params` is the `{"params": ...}` pytree of jax arrays."""
  config: LlamaConfig
  params: Mapping[str, Any]
  tokenizer: Any = None
  name: str = "target"
  stop_ids: tuple[int, ...] = ()

  def chat_prompt(self, user_turn: str, system: str | None = None) -> list[int]:
    """Token ids of one user turn under the chat template, ready for generation."""
    if self.tokenizer is None:
      raise ValueError(f"target {self.name!r} was loaded without a tokenizer")
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user_turn}]
    if getattr(self.tokenizer, "chat_template", None):
      ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               tokenize=True)
      if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
      return list(ids)
    return self.tokenizer.encode(user_turn, add_special_tokens=False)

  def decode(self, ids: Sequence[int]) -> str:
    ids = [i for i in ids if i not in self.stop_ids]
    return self.tokenizer.decode(ids, skip_special_tokens=True)

  def save_hf(self, out_dir: str | os.PathLike, overwrite: bool = False,
              always_index: bool = False, force: bool = False) -> None:
    """Writes a HuggingFace directory (config.json, safetensors, tokenizer files), all at
    once; a non-empty `out_dir` is refused unless `overwrite`, and one holding files no
    export wrote unless `force` too (`convert.write_hf_dir`)."""
    convert.write_hf_dir(self.config, self.params, out_dir, tokenizer=self.tokenizer,
                         overwrite=overwrite, always_index=always_index, force=force)


def _stop_ids(hf_config: Mapping[str, Any], tokenizer) -> tuple[int, ...]:
  ids = set()
  eos = hf_config.get("eos_token_id")
  if isinstance(eos, int):
    ids.add(eos)
  elif isinstance(eos, (list, tuple)):
    ids.update(int(e) for e in eos)
  if tokenizer is not None and tokenizer.eos_token_id is not None:
    ids.add(int(tokenizer.eos_token_id))
  return tuple(sorted(ids))


def target_from_state_dict(hf_config: Mapping[str, Any], state: Mapping[str, np.ndarray],
                           tokenizer=None, name: str = "target",
                           dtype: str = "float32", allow_nonfinite: bool = False) -> Target:
  """A Target from HF tensor names; a tensor holding NaN/Inf is refused by name unless
  `allow_nonfinite`."""
  check_finite(state, f"target {name}", allow_nonfinite)
  cfg = config_from_hf(hf_config, dtype)
  params = jax.tree.map(jax.numpy.asarray, convert.params_from_hf(cfg, state))
  return Target(cfg, params, tokenizer, name, _stop_ids(hf_config, tokenizer))


def load_target(source: str | os.PathLike = "smollm2", dtype: str = "float32",
                with_tokenizer: bool = True, allow_nonfinite: bool = False) -> Target:
  """Loads `"smollm2"`, a HF model directory, or a `.gguf` file. Files of a directory that
  differ from its integrity record (`jakiro_jax/integrity.py`), and tensors holding NaN/Inf
  (unless `allow_nonfinite`), are refused by name."""
  source = os.fspath(source)
  if source in EMBEDDED_TARGETS:
    from jakiro_jax.models.embedded import smollm2_gguf_path
    return _load_gguf(smollm2_gguf_path(), dtype, with_tokenizer, "smollm2", allow_nonfinite)
  if os.path.isfile(source) and source.endswith(".gguf"):
    return _load_gguf(source, dtype, with_tokenizer, os.path.basename(source), allow_nonfinite)
  if os.path.isdir(source):
    return _load_hf_dir(source, dtype, with_tokenizer, allow_nonfinite)
  raise FileNotFoundError(
      f"unknown target {source!r}: not an embedded name {EMBEDDED_TARGETS}, "
      f"a HuggingFace model directory, or a .gguf file")


def _load_gguf(path, dtype, with_tokenizer, name, allow_nonfinite=False) -> Target:
  from jakiro_jax.models.gguf_loader import read_gguf, tokenizer_from_gguf
  hf_config, state = read_gguf(path)
  tokenizer = tokenizer_from_gguf(path) if with_tokenizer else None
  return target_from_state_dict(hf_config, state, tokenizer, name, dtype, allow_nonfinite)


def _load_hf_dir(model_dir: str, dtype: str, with_tokenizer: bool,
                 allow_nonfinite: bool = False) -> Target:
  import json
  convert.verify_hf_dir(model_dir)  # before any file is read: damage is named as such
  load_hf_config(model_dir, dtype)  # validates the config first, with a clear error
  with open(os.path.join(model_dir, "config.json")) as f:
    hf_config = json.load(f)
  state = convert.read_safetensors_dir(model_dir)
  tokenizer = None
  if with_tokenizer and any(os.path.exists(os.path.join(model_dir, f))
                            for f in ("tokenizer.json", "tokenizer_config.json",
                                      "tokenizer.model", "vocab.json")):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
  return target_from_state_dict(hf_config, state, tokenizer,
                                os.path.basename(os.path.normpath(model_dir)), dtype,
                                allow_nonfinite)


def target_from_torch(model, tokenizer=None, dtype: str = "float32") -> Target:
  """From an in-memory transformers `*ForCausalLM` (needs torch)."""
  hf_config = model.config.to_dict()
  state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
  if hf_config.get("tie_word_embeddings"):
    state.pop("lm_head.weight", None)
  return target_from_state_dict(hf_config, state, tokenizer,
                                getattr(model.config, "_name_or_path", "") or "torch", dtype)
