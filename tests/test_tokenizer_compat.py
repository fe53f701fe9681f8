"""The exported target's tokenizer loads in the transformers versions the original code
pins (4.46, 4.53) and in the installed one, with the same chat-templated ids."""

import json
import os
import subprocess
import sys

import pytest

from jakiro_jax.models.tokenizer_files import make_tokenizer_files_portable

PROBE = """
import json, sys
from transformers import AutoTokenizer
t = AutoTokenizer.from_pretrained(sys.argv[1])
ids = t.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                            add_generation_prompt=True, tokenize=True)
ids = ids if isinstance(ids, list) else ids["input_ids"]
print(json.dumps({"class": type(t).__name__, "eos": t.eos_token_id, "ids": ids}))
"""


def probe(python: str, directory) -> dict:
  out = subprocess.run([python, "-c", PROBE, str(directory)], capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_portable_files_keep_the_chat_template_and_class(tmp_path):
  (tmp_path / "tokenizer.json").write_text("{}")
  (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "TokenizersBackend", "extra_special_tokens": ["<a>", "<b>"],
       "additional_special_tokens": ["<a>"], "eos_token": "<b>"}))
  make_tokenizer_files_portable(tmp_path)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
  assert config["chat_template"] == "{{ messages }}"
  assert config["additional_special_tokens"] == ["<a>", "<b>"]
  assert "extra_special_tokens" not in config and config["eos_token"] == "<b>"


def test_exported_smollm2_tokenizer_loads_here(smollm2, tmp_path):
  smollm2.save_hf(tmp_path / "hf")
  # What transformers 4.x needs (the slow test below loads it there).
  config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
  assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
  assert "<|im_start|>" in config["chat_template"]
  got = probe(sys.executable, tmp_path / "hf")
  assert got["class"] == "PreTrainedTokenizerFast" or got["class"] == "TokenizersBackend"
  assert got["eos"] == 2
  assert got["ids"] == smollm2.chat_prompt("What is the capital of France?")


@pytest.mark.slow
@pytest.mark.parametrize("version", ["4.46.3", "4.53.3"])
def test_exported_smollm2_tokenizer_loads_in_older_transformers(smollm2, tmp_path, version):
  # A venv per version (cached under JAKIRO_JAX_CACHE); needs PyPI once.
  from jakiro_jax.models.embedded import default_cache_dir
  venv = os.path.join(default_cache_dir(), f"venv-transformers-{version}")
  python = os.path.join(venv, "bin", "python")
  if not os.path.exists(python):
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", f"transformers=={version}",
                    "jinja2"], check=True)
  smollm2.save_hf(tmp_path / "hf")
  got = probe(python, tmp_path / "hf")
  assert got["class"] == "PreTrainedTokenizerFast" and got["eos"] == 2
  assert got["ids"] == smollm2.chat_prompt("What is the capital of France?")
