"""GGUF errors through `load_target`, and the embedded SmolLM2 as a Target (the loader
itself is tested in test_gguf_loader.py)."""

import numpy as np
import pytest

from jakiro_jax.models.gguf_loader import read_gguf
from jakiro_jax.target import load_target


def test_gguf_errors(tmp_path):
  import gguf

  with pytest.raises(FileNotFoundError, match="does not exist"):
    read_gguf(tmp_path / "missing.gguf")
  path = tmp_path / "gpt2.gguf"
  writer = gguf.GGUFWriter(str(path), "gpt2")
  writer.add_block_count(1)
  writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
    read_gguf(path)
  with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
    load_target(path)
  garbage = tmp_path / "garbage.gguf"
  garbage.write_bytes(b"not a gguf file at all" * 10)
  with pytest.raises(ValueError, match="corrupt or not GGUF"):
    read_gguf(garbage)


def test_smollm2_config_and_tokenizer(smollm2):
  cfg = smollm2.config
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size,
          cfg.tie_word_embeddings, cfg.rope_theta) == (30, 576, 9, 3, 49152, True, 100000.0)
  tok = smollm2.tokenizer
  assert tok.eos_token_id == 2 and tok.bos_token_id == 1 and smollm2.stop_ids == (2,)
  ids = smollm2.chat_prompt("What is the capital of France?")
  assert ids[0] == 1 and ids[1] != 1 and ids[-4:] == tok.encode("<|im_start|>assistant\n")
  text = "12345 apples cost $6.78, café ☃\n\n  done"
  encoded = tok.encode(text)
  assert tok.decode(encoded) == text
  assert all(len(tok.decode([i])) == 1 for i in tok.encode("12345"))  # digits split one by one
