"""Memory per device of a target (and its KV cache) sharded over a mesh, computed from the
sharded abstract arrays (`jax.eval_shape` + the rules of `jakiro_jax/sharding.py`):
nothing is allocated or downloaded.

  python -m launch.shard_memory --preset=llama2_7b --mesh=1,1,8
  python -m launch.shard_memory --hf_config=/path/to/model/config.json --mesh=1,4,2

On a machine with fewer devices than the mesh, CPU devices are faked
(`--xla_force_host_platform_device_count`), which is all abstract evaluation needs.
"""

from __future__ import annotations

import json
import math
import os

from absl import app, flags

from launch import cli

from jakiro_jax.models.presets import PRESETS  # noqa: E402
from jakiro_jax.reports.shard_memory import sharded_memory  # noqa: E402

_PRESET = flags.DEFINE_enum("preset", "llama2_7b", sorted(PRESETS),
                            "Architecture when no --hf_config is given.")
_HF_CONFIG = flags.DEFINE_string("hf_config", None, "A HuggingFace config.json instead.")
_MESH = flags.DEFINE_string("mesh", "1,1,8", "DATA,FSDP,TENSOR.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Weight and cache dtype.")
_BATCH = flags.DEFINE_integer("batch", 1, "KV cache rows.", lower_bound=1)
_MAX_LEN = flags.DEFINE_integer("max_len", 4096, "KV cache slots per row.", lower_bound=1)

def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from jakiro_jax.sharding import parse_mesh_flag
  sizes = parse_mesh_flag(_MESH.value)
  if _HF_CONFIG.value:
    from jakiro_jax.models.config import read_json
    hf = read_json(_HF_CONFIG.value, f"--hf_config: no such file {_HF_CONFIG.value}")
    from jakiro_jax.models.config import config_from_hf
    try:
      config_from_hf(hf, _DTYPE.value)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
      raise ValueError(f"{_HF_CONFIG.value}: not a usable model config "
                       f"({type(e).__name__}: {e})") from None
  else:
    hf = PRESETS[_PRESET.value]
  want = math.prod(s for s in sizes if s > 0)
  # Read when the backend starts (first device query), so setting it here still counts.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={want}")
  print(json.dumps(sharded_memory(hf, sizes, _DTYPE.value, _BATCH.value, _MAX_LEN.value),
                   indent=2))


if __name__ == "__main__":
  cli.run(main)
