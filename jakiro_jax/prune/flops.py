"""FLOPs of a pruned forward, to compare methods at equal compute.

A block computing n of a sequence's tokens costs (multiply-add = 2 FLOPs):
  projections  2 n D (K (G + 2) H) + 2 n (K G H) D     (q/k/v and o)
  MLP          6 n D F                                  (gate, up, down)
  attention    4 (K G) H * pairs                        (q.k and probs.v)
with pairs = n (n + 1) / 2 under a causal mask (each kept query sees the kept keys up to
itself), or n^2 without causality. Linear terms scale with the kept fraction, attention
with its square. Embedding lookups and norms are ignored; the lm_head is counted apart.
"""

from __future__ import annotations

from typing import Sequence

from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.prune.schedule import check_schedule, keep_counts


def block_flops(config: LlamaConfig, kept: int, causal: bool = True) -> dict:
  """FLOPs of one block computing `kept` tokens: {"linear", "attention", "total"} and the
  split of "linear" into "projections" (q/k/v and o) and "mlp" (gate, up, down)."""
  if kept < 0:
    raise ValueError(f"kept must be >= 0, got {kept}")
  d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
  kv, heads = config.num_kv_heads, config.num_heads
  projections = 2 * kept * d * kv * (config.queries_per_kv + 2) * hd + 2 * kept * heads * hd * d
  mlp = 6 * kept * d * f
  linear = projections + mlp
  pairs = kept * (kept + 1) // 2 if causal else kept * kept
  attention = 4 * heads * hd * pairs
  return {"linear": float(linear), "attention": float(attention),
          "total": float(linear + attention), "projections": float(projections),
          "mlp": float(mlp)}


def sub_block_flops(config: LlamaConfig, kept: int, causal: bool = True) -> tuple:
  """(attention sub-block, MLP sub-block) FLOPs of one block computing `kept` tokens: the
  attention sub-block is its projections and the attention itself, the MLP its three
  matmuls; they sum to `block_flops(...)["total"]`."""
  b = block_flops(config, kept, causal)
  return b["projections"] + b["attention"], b["mlp"]


def head_flops(config: LlamaConfig, tokens: int = 1) -> float:
  """lm_head FLOPs for `tokens` rows (prefill needs only the last token's logits)."""
  return float(2 * tokens * config.vocab_size * config.hidden_size)


def schedule_flops(config: LlamaConfig, schedule: Sequence[float], length: int,
                   causal: bool = True) -> dict:
  """Per-block and total block FLOPs of one sequence of `length` tokens under `schedule`,
  the dense model's, and their ratio (pruned / dense). Keys: "per_block" (list),
  "total", "dense_per_block", "dense", "ratio", "linear", "attention"."""
  schedule = check_schedule(schedule, config.num_layers)
  per_block = [block_flops(config, k, causal) for k in keep_counts(schedule, length)]
  dense_block = block_flops(config, length, causal)["total"]
  total = sum(b["total"] for b in per_block)
  dense = dense_block * config.num_layers
  return {
      "per_block": [b["total"] for b in per_block],
      "linear": sum(b["linear"] for b in per_block),
      "attention": sum(b["attention"] for b in per_block),
      "total": total,
      "dense_per_block": dense_block,
      "dense": dense,
      "ratio": total / dense if dense else float("nan"),
  }
