"""Tokenizer files that every transformers version from 4.40 on loads.

transformers 5 saves a fast tokenizer as `tokenizer_class: "TokenizersBackend"` (a class
4.x does not have), its extra special tokens as a list under `extra_special_tokens` (4.x
reads that key as a dict of named tokens) and the chat template only in
`chat_template.jinja` (4.40-4.42 read it only from `tokenizer_config.json`). The original
EAGLE / Jakiro / Gumiho code pins transformers 4.x, so an exported target must load there.
"""

from __future__ import annotations

import json
import os

CONFIG = "tokenizer_config.json"
TEMPLATE = "chat_template.jinja"


def make_tokenizer_files_portable(out_dir: str | os.PathLike) -> None:
  """Rewrites `out_dir/tokenizer_config.json` (written by `save_pretrained`) so that
  transformers 4.40+ and 5.x load the same tokenizer and chat template."""
  path = os.path.join(out_dir, CONFIG)
  if not os.path.exists(path):
    return
  with open(path) as f:
    config = json.load(f)
  if os.path.exists(os.path.join(out_dir, "tokenizer.json")) and config.get(
      "tokenizer_class") in (None, "TokenizersBackend"):
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
  extra = config.get("extra_special_tokens")
  if isinstance(extra, list):  # 5.x's list is 4.x's additional_special_tokens
    config.pop("extra_special_tokens")
    merged = list(config.get("additional_special_tokens") or [])
    config["additional_special_tokens"] = merged + [t for t in extra if t not in merged]
  template_path = os.path.join(out_dir, TEMPLATE)
  if "chat_template" not in config and os.path.exists(template_path):
    with open(template_path) as f:
      config["chat_template"] = f.read()
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(config, f, indent=2, ensure_ascii=False)
  os.replace(tmp, path)
