"""Vicuna-7B v1.3 (LLaMA-1 architecture, MHA, vocab 32000): EAGLE-2, Jakiro, Jakiro* or Gumiho draft (configs/real_targets.py).

  python -m launch.train --config=configs/vicuna_7b.py:jakiro \
      --config.target=/path/to/vicuna-7b-v1.3 --data=DIR --out=DIR
  python -m launch.bench --config=configs/vicuna_7b.py:jakiro \
      --config.target=/path/to/vicuna-7b-v1.3 --method=jakiro --draft=DIR --questions=Q.jsonl --mesh=2,2,2
"""

from configs.real_targets import real_target_config


def get_config(method: str | None = None):  # None: the registry's default method
  return real_target_config("/path/to/vicuna-7b-v1.3", method)
