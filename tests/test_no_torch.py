"""The main job's import path and generation work without torch installed.

torch is hidden in a subprocess the way a missing package looks to Python:
`sys.modules["torch"] = None` makes `import torch` raise ModuleNotFoundError and
`importlib.util.find_spec("torch")` return None (which is how transformers and datasets
decide whether torch is there), and a `sys.meta_path` finder refuses every `torch.*`
module as a second guard.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BLOCKER = textwrap.dedent("""
    import importlib.abc, importlib.util, sys

    class _NoTorch(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
          raise ModuleNotFoundError(f"No module named {name!r} (hidden by test)", name=name)
        return None

    sys.meta_path.insert(0, _NoTorch())
    sys.modules["torch"] = None
    assert importlib.util.find_spec("torch") is None
    try:
      import torch  # noqa: F401
      raise SystemExit("torch still importable")
    except ImportError:
      pass
""")

PROGRAM = BLOCKER + textwrap.dedent("""
    import numpy as np
    import jax

    # Every module on the main job's path (launch.generate and what its main imports).
    import launch.generate
    import jakiro_jax.target
    import jakiro_jax.speculative.generate
    import jakiro_jax.speculative.autoregressive
    import jakiro_jax.reports.benchmark
    import jakiro_jax.tree_tuning
    import jakiro_jax.drafts
    import jakiro_jax.drafts.io
    import jakiro_jax.models.gguf_loader
    import jakiro_jax.models.embedded
    import gumiho_jax.draft
    import transformers  # imported by the loaders; must not pull torch in either

    from jakiro_jax import TreeConfig, make_drafter
    from jakiro_jax.speculative.autoregressive import generate_ar
    from jakiro_jax.speculative.generate import generate
    from jakiro_jax.target import target_from_state_dict

    # A tiny random Llama from a HuggingFace-named numpy state dict (no torch anywhere).
    V, D, F, L, H, K, HD = 97, 48, 64, 2, 4, 2, 12
    hf_config = dict(model_type="llama", vocab_size=V, hidden_size=D, intermediate_size=F,
                     num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=K,
                     head_dim=HD, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=3)
    rng = np.random.RandomState(0)
    w = lambda *shape: (rng.randn(*shape) * 0.1).astype(np.float32)
    state = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": np.ones(D, np.float32),
             "lm_head.weight": w(V, D)}
    for i in range(L):
      p = f"model.layers.{i}."
      state.update({p + "self_attn.q_proj.weight": w(H * HD, D),
                    p + "self_attn.k_proj.weight": w(K * HD, D),
                    p + "self_attn.v_proj.weight": w(K * HD, D),
                    p + "self_attn.o_proj.weight": w(D, H * HD),
                    p + "mlp.gate_proj.weight": w(F, D), p + "mlp.up_proj.weight": w(F, D),
                    p + "mlp.down_proj.weight": w(D, F),
                    p + "input_layernorm.weight": np.ones(D, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(D, np.float32)})
    target = target_from_state_dict(hf_config, state, name="tiny")
    prompts = [list(rng.randint(4, V, size=n)) for n in (5, 9)]
    ar = generate_ar(target, prompts, max_new_tokens=12)
    drafter = make_drafter("eagle2", target.config, TreeConfig(top_k=2, depth=2, total_tokens=5))
    spec = generate(target, drafter, drafter.init_params(jax.random.PRNGKey(0)), prompts,
                    max_new_tokens=12)
    assert all(len(t) > 0 for t in ar.tokens), ar.tokens
    assert spec.tokens == ar.tokens, (spec.tokens, ar.tokens)  # greedy: lossless
    assert spec.tau >= 1.0, spec.tau
    loaded = [m for m, mod in sys.modules.items()
              if (m == "torch" or m.startswith("torch.")) and mod is not None]
    assert not loaded, loaded
    print("NO_TORCH_OK", sum(len(t) for t in ar.tokens), spec.rounds)
""")


def test_main_job_path_runs_without_torch():
  env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  assert "NO_TORCH_OK" in proc.stdout


def test_blocker_hides_torch():
  """The blocker itself: with it, code that needs torch fails as on a torch-less install
  (so the test above would notice a torch import)."""
  program = BLOCKER + "\nimport jakiro_jax.models.hf_reference as h\nimport numpy\n" \
      "try:\n  h.hf_greedy_generate(None, [1], 1)\nexcept ModuleNotFoundError:\n" \
      "  print('BLOCKED')\n"
  proc = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "BLOCKED" in proc.stdout
