"""Distillation data: target features for every position of chat conversations.

On disk a feature set is a directory:

  meta.json        target name, hidden/vocab size, chat template, how it was made
  shard_00000/     a `datasets` dataset (Arrow) per block of `shard_size` prompts
  shard_00001/ ...

Each row is one conversation: `prompt_index` (line in the prompt file), `input_ids [L]`
int32, `loss_mask [L]` int8 (1 on assistant tokens), `features [L, F]` float16: the
target's post-final-norm hidden states (F = D, the lm_head input), or, when meta.json
names `feature_layers` (the streams a method trains on, e.g. EAGLE-3's three layers and
-1, the final norm's output; `models.llama.Llama`), those streams concatenated in that
order (F = len * D). A set without the key (every set made before it existed) holds the
final norm's output. Shards are written under a temporary name and renamed into place, so
a killed run leaves only whole shards and a restart continues with the first missing one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Iterable, Mapping, Sequence

import numpy as np

META_FILE = "meta.json"
FORMAT_VERSION = 1
_SHARD_RE = re.compile(r"^shard_(\d{5})$")


def stored_feature_layers(meta: Mapping) -> tuple[int, ...]:
  """The target streams a feature set's rows hold (`Llama.feature_layers`); () = the
  final norm's output, as every set without the key holds."""
  return tuple(int(i) for i in meta.get("feature_layers") or ())


def stream_columns(stored: Sequence[int], wanted: Sequence[int], hidden_size: int
                   ) -> np.ndarray | None:
  """The feature columns that hold streams `wanted` (a drafter's training streams, () = the
  final norm's output) inside a set holding `stored` (both in `stored_feature_layers`'s
  terms): None when the set holds exactly those, so one feature set of several streams
  (e.g. EAGLE-3's, which end with -1) trains every method reading a subset of them. A
  stream the set lacks raises KeyError naming it."""
  stored, wanted = tuple(stored) or (-1,), tuple(wanted) or (-1,)
  if stored == wanted:
    return None
  missing = [i for i in wanted if i not in stored]
  if missing:
    raise KeyError(f"streams {missing} are not stored (the set holds {list(stored)})")
  return np.concatenate([np.arange(stored.index(i) * hidden_size,
                                   (stored.index(i) + 1) * hidden_size) for i in wanted])


class StreamView:
  """A numpy-formatted feature dataset whose rows' `features` keep only `columns`
  (`stream_columns`), sliced per row as it is read."""

  def __init__(self, dataset, columns: np.ndarray):
    self.dataset, self.columns = dataset, columns

  def __len__(self):
    return len(self.dataset)

  def __getitem__(self, index: int):
    row = dict(self.dataset[index])
    row["features"] = row["features"][:, self.columns]
    return row


def feature_schema(hidden_size: int):
  import datasets

  return datasets.Features({
      "prompt_index": datasets.Value("int64"),
      "input_ids": datasets.Sequence(datasets.Value("int32")),
      "loss_mask": datasets.Sequence(datasets.Value("int8")),
      "features": datasets.Array2D(shape=(None, hidden_size), dtype="float16"),
  })


def shard_dir(out_dir, index: int) -> str:
  return os.path.join(os.fspath(out_dir), f"shard_{index:05d}")


def write_meta(out_dir, meta: Mapping) -> None:
  """Writes meta.json, or checks that an existing one describes the same run."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, META_FILE)
  meta = dict(meta, format=FORMAT_VERSION)
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    changed = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
    if changed:
      raise ValueError(f"{out_dir} holds a feature set made with other settings "
                       f"({', '.join(changed)} differ); use a new --out directory")
    return
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(meta, f, indent=2)
  os.replace(tmp, path)


def read_meta(out_dir) -> dict:
  path = os.path.join(os.fspath(out_dir), META_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{out_dir} is not a feature set (no {META_FILE}); make one "
                            f"with `python -m launch.gen_data`")
  with open(path) as f:
    try:
      meta = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is corrupt: {e}") from None
  if meta.get("format") != FORMAT_VERSION:
    raise ValueError(f"{path} has format {meta.get('format')}, expected {FORMAT_VERSION}")
  return meta


def completed_shards(out_dir) -> list[int]:
  """Indices of the shards fully written (temporary directories are ignored)."""
  if not os.path.isdir(out_dir):
    return []
  found = (_SHARD_RE.match(name) for name in os.listdir(out_dir))
  return sorted(int(m.group(1)) for m in found if m)


def write_shard(out_dir, index: int, rows: Sequence[Mapping], hidden_size: int) -> str:
  """Writes rows (dicts with the schema's columns) as shard `index`, atomically.
  `hidden_size` is the features' width F (len(feature_layers) * D with layers)."""
  import datasets

  final = shard_dir(out_dir, index)
  tmp = final + ".partial"
  shutil.rmtree(tmp, ignore_errors=True)
  columns = {
      "prompt_index": [int(r["prompt_index"]) for r in rows],
      "input_ids": [np.asarray(r["input_ids"], np.int32) for r in rows],
      "loss_mask": [np.asarray(r["loss_mask"], np.int8) for r in rows],
      "features": [np.asarray(r["features"], np.float16) for r in rows],
  }
  for r, ids, feats in zip(rows, columns["input_ids"], columns["features"]):
    if feats.shape != (len(ids), hidden_size):
      raise ValueError(f"prompt {r['prompt_index']}: features {feats.shape} do not match "
                       f"{len(ids)} tokens x hidden {hidden_size}")
  dataset = datasets.Dataset.from_dict(columns, features=feature_schema(hidden_size))
  datasets.disable_progress_bars()  # one line per shard is the caller's progress bar
  dataset.save_to_disk(tmp)
  os.replace(tmp, final)
  return final


def load_feature_dataset(out_dir):
  """Returns `(dataset, meta)`: all shards concatenated in order, numpy formatted."""
  import datasets

  meta = read_meta(out_dir)
  shards = completed_shards(out_dir)
  if not shards:
    raise ValueError(f"feature set {out_dir} has no complete shard yet")
  if shards != list(range(len(shards))):
    missing = sorted(set(range(shards[-1] + 1)) - set(shards))
    raise ValueError(f"feature set {out_dir} is missing shards {missing[:10]}; rerun "
                     f"gen_data on it to fill them")
  parts = []
  for i in shards:
    try:
      parts.append(datasets.load_from_disk(shard_dir(out_dir, i)))
    except Exception as e:  # datasets raises several types for damaged directories
      raise ValueError(f"cannot read {shard_dir(out_dir, i)} (corrupt?): {e}") from None
  dataset = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
  return dataset.with_format("numpy"), meta


def text_lines(path) -> Iterable[tuple[int, str]]:
  """(line number, line) of a UTF-8 text file; where a line is not UTF-8, a ValueError
  that names the file and the line (Python's own names neither)."""
  with open(path, "rb") as f:
    for number, raw in enumerate(f, 1):
      try:
        yield number, raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{number} is not UTF-8 text ({e.reason} at byte "
                         f"{e.start} of the line)") from None


def read_prompts(path, limit: int | None = None) -> list[str]:
  """First user turns of a FastChat-format jsonl file (`{"turns": [...]}` per line)."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"questions file {path} does not exist")
  prompts = []
  for number, line in text_lines(path):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      turn = record["turns"][0]
    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
      raise ValueError(f"{path}:{number} is not a FastChat question record "
                       f"({type(e).__name__}: {e})") from None
    if not isinstance(turn, str) or not turn.strip():
      raise ValueError(f"{path}:{number}: the first turn is empty or not text")
    prompts.append(turn)
    if limit is not None and len(prompts) >= limit:
      break
  if not prompts:
    raise ValueError(f"{path} holds no prompts")
  return prompts


def conversation(prompt_ids: Sequence[int], response_ids: Sequence[int],
                 max_len: int) -> tuple[np.ndarray, np.ndarray]:
  """`(input_ids [L], loss_mask [L])` for prompt + response, cut at `max_len`; the mask
  is 1 on response (assistant) tokens."""
  ids = np.asarray(list(prompt_ids) + list(response_ids), np.int32)[:max_len]
  mask = np.zeros(len(ids), np.int8)
  mask[len(prompt_ids):] = 1
  return ids, mask


def length_batches(lengths: Sequence[int], batch_size: int) -> Iterable[list[int]]:
  """Indices grouped into batches of similar length (longest first), deterministic."""
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  for start in range(0, len(order), batch_size):
    yield order[start:start + batch_size]
