"""LLaMA-3.1-8B-Instruct (GQA 32/8, vocab 128256, llama3 rope scaling): EAGLE-2, Jakiro, Jakiro* or Gumiho draft (configs/real_targets.py).

  python -m launch.train --config=configs/llama31_8b.py:jakiro \
      --config.target=/path/to/Llama-3.1-8B-Instruct --data=DIR --out=DIR
  python -m launch.bench --config=configs/llama31_8b.py:jakiro \
      --config.target=/path/to/Llama-3.1-8B-Instruct --method=jakiro --draft=DIR --questions=Q.jsonl --mesh=2,2,2
"""

from configs.real_targets import real_target_config


def get_config(method: str | None = None):  # None: the registry's default method
  return real_target_config("/path/to/Llama-3.1-8B-Instruct", method)
