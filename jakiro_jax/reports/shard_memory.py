"""Memory per device of a target and its KV cache sharded over a mesh, from the sharded
abstract arrays (`jax.eval_shape` + the rules of `jakiro_jax/sharding.py`): nothing is
allocated or downloaded (`launch.shard_memory` prints it)."""

from __future__ import annotations

import math


def sharded_memory(hf_config: dict, mesh_sizes, dtype: str = "bfloat16", batch: int = 1,
                   max_len: int = 4096) -> dict:
  """Bytes per device of the target weights and of its KV cache on a (data, fsdp, tensor)
  mesh, from the abstract arrays and their shardings."""
  import jax

  from jakiro_jax import sharding
  from jakiro_jax.models.config import config_from_hf
  from jakiro_jax.models.llama import init_params, new_cache

  config = config_from_hf(hf_config, dtype)
  mesh = sharding.make_mesh(mesh_sizes)
  weights = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))
  weight_shardings = sharding.target_shardings(config, mesh)
  cache = jax.eval_shape(lambda: new_cache(config, batch, max_len))
  cache_shardings = sharding.cache_shardings(cache, mesh)
  per_weights = sharding.bytes_per_device(weights, weight_shardings)
  per_cache = sharding.bytes_per_device(cache, cache_shardings)
  total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(weights))
  return {
      "mesh": dict(mesh.shape), "dtype": dtype,
      "parameters": sum(math.prod(x.shape) for x in jax.tree.leaves(weights)),
      "weights_total_gib": total / 2**30,
      "weights_per_device_gib": max(per_weights.values()) / 2**30,
      "kv_cache": f"batch {batch} x {max_len} slots",
      "kv_cache_per_device_gib": max(per_cache.values()) / 2**30,
      "specs": {name: str(s.spec) for name, s in  # layer 0 stands for every layer
                ((jax.tree_util.keystr(path, simple=True, separator="/"), s)
                 for path, s in jax.tree_util.tree_leaves_with_path(weight_shardings))
                if "layers_" not in name or "layers_0/" in name},
  }
