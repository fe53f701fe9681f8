"""Qwen2-7B-Instruct (GQA 28/4, qkv bias, vocab 152064): EAGLE-2, Jakiro, Jakiro* or Gumiho draft (configs/real_targets.py).

  python -m launch.train --config=configs/qwen2_7b.py:jakiro \
      --config.target=/path/to/Qwen2-7B-Instruct --data=DIR --out=DIR
  python -m launch.bench --config=configs/qwen2_7b.py:jakiro \
      --config.target=/path/to/Qwen2-7B-Instruct --method=jakiro --draft=DIR --questions=Q.jsonl --mesh=2,2,2
"""

from configs.real_targets import real_target_config


def get_config(method: str | None = None):  # None: the registry's default method
  return real_target_config("/path/to/Qwen2-7B-Instruct", method)
