"""FTP token-wise pruning of SmolLM2-135M-Instruct, sized for a small CPU run.

  python -m launch.prune --config=configs/smollm2_135m_ftp.py --mode=search \
      --out_dir=/tmp/ftp_s30
  python -m launch.prune --config=configs/smollm2_135m_ftp.py --mode=train \
      --out_dir=/tmp/ftp_s30
  python -m launch.prune --config=configs/smollm2_135m_ftp.py --mode=eval \
      --out_dir=/tmp/ftp_s30      # without --out_dir: the shipped smollm2_s30 router

Other budgets: --config.budget=0.2 (each budget its own --out_dir). The hidden-state
router ablation: --mode=train --config.router.inputs=hidden (then --mode=eval includes
ftp_hidden).
"""

import ml_collections

from jakiro_jax.config import base_config


def get_config() -> ml_collections.ConfigDict:
  c = base_config(trees=None)  # the shared keys (`jakiro_jax/config.py`): target, dtype, ...
  c.budget = 0.3  # mean block sparsity S, in [0, 0.9)
  c.seed = 0

  # Text the user supplies, read at run time by path (FastChat question files): set
  #   --config.data.prompts=PATH --config.data.articles=PATH
  #   --config.data.questions=PATH [--config.data.questions=PATH ...]
  c.data = ml_collections.ConfigDict(dict(
      prompts="",  # calibration + router training prompts (e.g. the training prompts)
      articles="",  # held-out natural text (e.g. the summarisation questions, sum.jsonl)
      questions=("",),  # held-out questions (e.g. alpaca, gsm8k, qa, humaneval .jsonl)
      mc="",  # empty: the shipped ARC-Easy subset (jakiro_jax/assets/prune/mc)
      cloze="",  # empty: the articles (cloze items from the texts after the first 8)
  ))
  # Search fitness batch: chat-template user turns packed into full rows.
  c.calib_rows = 4
  c.calib_length = 128
  # True: each calibration row ends where a prompt ends (the assistant's turn starts), so
  # the objective's last positions are where replies start; False: prompts packed and cut.
  c.calib_end_at_prompt = False

  # The search's objective: kl_weight x (-KL(dense || pruned) on the calibration rows
  # - last_weight x the KL on each row's last last_tokens positions) + mc_weight x
  # probability of the right choice on mc_items calibration items (disjoint from every
  # evaluation set; `pipeline.calibration_items`): mc_file "" = cloze items of
  # data.prompts, "arc_easy_test" = the shipped ARC-Easy test items, or a path.
  c.objective = ml_collections.ConfigDict(dict(
      kl_weight=1.0, last_weight=0.0, last_tokens=16, mc_weight=0.0, mc_items=64,
      mc_length=64, mc_context_words=30, mc_choice_words=6, mc_file=""))

  # Schedules that join the search's first population beside uniform and BI-proportional
  # (shipped names or schedule.json paths, e.g. an earlier search's, at the same budget).
  c.seed_schedules = ()
  # GA with the static router. The spec's defaults are population 32, 30 generations;
  # scaled down for a 2-core CPU (one fitness call ~1.5 s).
  c.ga = ml_collections.ConfigDict(dict(
      population=12, generations=8, tournament=3, sigma=0.05, max_mutated=3, elitism=2,
      s_max=0.9, init_noise=0.05, agree_weight=0.0))
  # Schedule fine-tune with the trained dynamic router in the loop (0 generations: skip).
  c.finetune = ml_collections.ConfigDict(dict(population=6, generations=3, sigma=0.02))

  # Router training: the target frozen, only the router params (385 for the factors).
  # inputs: "factors" (4 -> 64 -> 1, written to OUT_DIR/router) or "hidden" (the input
  # ablation: 576 -> 64 -> 1 on the hidden state, OUT_DIR/router_hidden, no fine-tune).
  # rows: packed training rows of `length` tokens (the paper trains on a few thousand
  # sequences; the prompts file holds ~5,800 rows of 128); the dense log-probabilities
  # are computed per batch, so rows cost no memory. heldout_rows: the next rows of the
  # same stream, the fixed batch whose KL is logged every eval_every steps. gate, sparse,
  # guide_floor: the loss (see `jakiro_jax/prune/train_router.py`; the paper's is
  # gate=straight_through, sparse=hinge). guide_fraction: the paper decays the guide over
  # the first half; here over the first 2% (10 steps), since the static rule it imitates
  # has a higher KL than the untrained router on SmolLM2 (the held-out log's step-0
  # "static_kl"), so a long guide raised the KL. select: "heldout" keeps the router of
  # lowest KL on the held-out rows (evaluated every eval_every steps), "last" the last
  # step's (the held-out KL wandered 2.98-3.25 after step 100). calib_rows: rows the
  # decode thresholds are calibrated on. tail_weight: weight of a second KL term over the
  # last tail_tokens tokens of each row (the predictions a continuation starts from).
  # recent: the recency window R (`prune.routers`): each block keeps token 0 and the newest
  # R tokens whatever the MLP says, the MLP choosing among the older ones (0: none).
  c.router = ml_collections.ConfigDict(dict(
      steps=500, batch_size=2, rows=2048, length=128, lr=1e-3, weight_decay=0.0, clip=1.0,
      guide_fraction=0.02, guide_floor=0.0, sparse="level", sparse_weight=1.0,
      gate="kept", save_every=50, eval_every=50, select="heldout", heldout_rows=8,
      calib_rows=64, tail_weight=0.0, tail_tokens=8, inputs="factors", recent=0))

  # The fitted linear router (--mode=fit, eval method ftp_fit): score = position_weight x
  # position + a x attention received, the newest `recent` tokens kept as by the window;
  # a from attention_weights (0, the both-ends rule, always tried first) by the least KL
  # on `rows` calibration rows of `length` tokens (long enough that the window leaves
  # older tokens to choose among). `train_router.fit_linear_router`.
  c.fit = ml_collections.ConfigDict(dict(
      rows=8, length=256, recent=64, position_weight=-1.0,
      attention_weights=(0.25, 0.5, 1.0, 2.0, 4.0, 8.0)))

  # Held-out evaluation. MC-style scoring (ARC-Easy, and cloze items from natural text,
  # `prune.tasks.cloze_items`: a 30-word passage, its next 8 words against 3 segments of
  # other texts; up to 3 items per text of the cloze file, skipping its first
  # `cloze_skip` texts, the perplexity rows) runs twice: as is (the answer ends the row)
  # and fair, with `mc_tail` tokens of other items' text after each row so the answer is
  # no longer among the newest tokens the static router always keeps (0: skip the fair
  # runs; 192 puts the answers of 64- and 80-token rows in the oldest ~25-30% of the
  # row; see `evaluate.score_mc`). cloze_items=0 skips the cloze task. recent: the window
  # R of the methods ftp_window (the trained router with the newest R tokens forced) and
  # ends_static (token 0, the newest R, then the oldest tokens; no router).
  c.eval = ml_collections.ConfigDict(dict(
      articles=8, article_length=256, questions_per_file=4, question_length=128,
      batch_size=8, mc_items=100, mc_length=64, mc_tail=192, cloze_items=200,
      cloze_context_words=30, cloze_choice_words=8, cloze_skip=8, cloze_per_text=3,
      cloze_length=80, gen_prompts=8, gen_tokens=32, random_seed=0, recent=64))
  return c
