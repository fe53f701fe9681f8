"""LLaMA-2-chat 7B (MHA, vocab 32000): EAGLE-2, Jakiro, Jakiro* or Gumiho draft (configs/real_targets.py).

  python -m launch.train --config=configs/llama2_chat_7b.py:jakiro \
      --config.target=/path/to/Llama-2-7b-chat-hf --data=DIR --out=DIR
  python -m launch.bench --config=configs/llama2_chat_7b.py:jakiro \
      --config.target=/path/to/Llama-2-7b-chat-hf --method=jakiro --draft=DIR --questions=Q.jsonl --mesh=2,2,2
"""

from configs.real_targets import real_target_config


def get_config(method: str | None = None):  # None: the registry's default method
  return real_target_config("/path/to/Llama-2-7b-chat-hf", method)
