"""Settings the three SmolLM2 draft configs share: a small CPU run (not an experiment)."""


def cpu_training(c):
  """Applies the shared CPU settings to a `trainer.default_config()` in place."""
  c.target = "smollm2"
  c.batch_size = 4
  c.max_len = 1024  # the specs: 2048
  c.lr = 3e-4
  c.warmup_steps = 100
  c.num_epochs = 4.0
  # The full 49152-row lm_head dominates the CPU step; keep the CE over the most frequent
  # target tokens (training only), and let the final draft draft from them (lossless).
  c.vocab_subset = 8192
  c.draft_vocab = True
  c.save_every = 500
  c.eval_every = 500  # ~4 s per batch of 4 validation rows on CPU
  c.eval_rows = 16
  c.log_every = 10
  c.seed = 0
  return c
