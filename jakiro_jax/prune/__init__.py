"""FTP: fine-grained token-wise pruning of the target (each block skips some tokens).

Modules:
  schedule  per-block sparsity schedules: `check_schedule`, `keep_count(s)`,
            `uniform_schedule`, `mean_sparsity`
  cache     `PrunedCache`: layer-wise K/V with per-layer validity and attention-received sums
  route     what a router sees (`BlockContext`) and decides (`Decision`), `fixed_route`,
            `straight_through`
  model     masked-dense token-skipping `forward`, `prefill`, `decode_step` (training,
            evaluation, decode)
  routers   static priority, dynamic (per block) and one-pass learnt routers (on the four
            factors or, the input ablation, the hidden state)
  prefill   gathered prefill with real compute savings (`prefill_gathered`,
            `pruned_prefill_jit`)
  flops     per-block and total FLOPs of a schedule against the dense model
  timing    dense vs pruned prefill wall clock
  evaluate  held-out perplexity, KL / top-1 vs dense, greedy-decode agreement, MC accuracy
            (as is and with a fair tail), achieved sparsity and FLOPs of a pruning method
            (`Method`, `compare`)
  baselines ShortGPT block influence and the blocks it removes; BlockPruner's sub-block
            search; the models with them really removed
  tasks     multiple-choice tasks from natural text (`cloze_items`) for `score_mc`
  search    genetic per-block schedule search under a global budget (resumable)
  train_router  router training (guide, sparsity and distillation losses; resumable)
  assets    shipped routers (`load_shipped`) and the MC subset
"""
