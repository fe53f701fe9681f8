"""`launch.probes.profile_round`: the loop's thunks find the round's parts by their named scopes."""

from __future__ import annotations

import gzip
import json

import jax
import jax.numpy as jnp

from jakiro_jax.drafts import make_drafter
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.models.llama import init_params, new_cache
from jakiro_jax.speculative.batching import output_columns, prepare_batch
from jakiro_jax.speculative.generate import speculative_generate_jit
from jakiro_jax.speculative.sampling import SamplingConfig
from jakiro_jax.speculative.tree import TreeConfig
from launch.probes import profile_round

TINY = LlamaConfig(vocab_size=97, hidden_size=72, intermediate_size=88, num_layers=2,
                   num_heads=6, num_kv_heads=2, head_dim=12, max_position_embeddings=512)


def test_every_part_of_the_round_is_found_in_the_compiled_loop():
  drafter = make_drafter("jakiro", TINY, TreeConfig(top_k=2, depth=2, total_tokens=5))
  batch = prepare_batch(TINY, [[5, 6, 7]], 8, extra_slots=5, chunk=64)
  static = dict(target_config=TINY, drafter=drafter, max_new_tokens=output_columns(batch),
                sampling=SamplingConfig(), stop_ids=(3,), pad_id=0, prefill_fn=None,
                prefill_chunks=(64,))
  text = speculative_generate_jit.lower(
      init_params(TINY, jax.random.PRNGKey(0)), drafter.init_params(jax.random.PRNGKey(1)),
      jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), jnp.asarray(batch.budgets),
      jax.random.PRNGKey(0), new_cache(TINY, 1, batch.max_len),
      drafter.new_cache(1, batch.max_len), **static).compile().as_text()
  names = profile_round.op_names(text)
  labels = {profile_round.category(n) for n in names.values()}
  assert {label for label, _ in profile_round.CATEGORIES} <= labels
  assert None in labels  # the prefill is not a round's


def test_thunk_times_sum_by_part_leaving_out_control_flow(tmp_path):
  names = {"fusion.1": "jit(loop)/while/body/spec_round/verify/Llama/dot_general",
           "fusion.2": "jit(loop)/while/body/spec_round/draft_tree/draft_head/dot_general",
           "while.3": "jit(loop)/while", "fusion.4": "jit(loop)/prefill/dot_general"}
  events = [{"ph": "X", "name": op, "dur": dur, "args": {"hlo_op": op}}
            for op, dur in (("fusion.1", 3000), ("fusion.1", 1000), ("fusion.2", 500),
                            ("while.3", 9000), ("fusion.4", 7000))]
  events.append({"ph": "X", "name": "ExecuteHelper", "dur": 20000})
  (tmp_path / "run").mkdir()
  with gzip.open(tmp_path / "run" / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  totals = profile_round.thunk_ms(str(tmp_path), names)
  assert dict(totals) == {"verify: target forward over the tree": 4.0,
                          "draft head (log-probs over the draft vocabulary)": 0.5}


def test_the_ar_loops_steps_and_the_kernels_are_found_by_name(tmp_path):
  """The AR loop's steps carry the `ar_step` scope (its prefill does not); custom calls are
  read with their output shapes, summed under a scope, and labelled without the rows."""
  from jakiro_jax.speculative.autoregressive import ar_generate_jit

  batch = prepare_batch(TINY, [[5, 6, 7]], 8, chunk=64)
  text = ar_generate_jit.lower(
      init_params(TINY, jax.random.PRNGKey(0)), jnp.asarray(batch.tokens),
      jnp.asarray(batch.lengths), jnp.asarray(batch.budgets), jax.random.PRNGKey(0),
      new_cache(TINY, 1, batch.max_len), config=TINY, max_new_tokens=output_columns(batch),
      sampling=SamplingConfig(), stop_ids=(3,), pad_id=0, prefill_chunks=(64,)
  ).compile().as_text()
  scopes = [n for n in profile_round.op_names(text).values() if "Llama" in n]
  assert any("ar_step" in n for n in scopes) and not all("ar_step" in n for n in scopes)

  hlo = ('  %custom-call.7 = f32[5,3072]{1,0} custom-call(f32[5,576]{1,0} %x, f32[3072,576]'
         '{1,0} %w), custom_call_target="jakiro_jax_small_row_matmul", metadata={op_name='
         '"jit(loop)/while/body/spec_round/verify/Llama/mlp/ffi_call"}\n'
         '  %fusion.2 = f32[5]{0} fusion(f32[5,576]{1,0} %x), kind=kLoop, metadata={op_name='
         '"jit(loop)/while/body/spec_round/verify/Llama/add"}\n')
  calls = profile_round.custom_calls(hlo)
  assert calls == {"custom-call.7": "jakiro_jax_small_row_matmul f32[5,3072]"}
  events = [{"ph": "X", "name": op, "dur": dur, "args": {"hlo_op": op}}
            for op, dur in (("custom-call.7", 3000), ("custom-call.7", 1000),
                            ("fusion.2", 500), ("while.1", 9000))]
  (tmp_path / "run").mkdir()
  with gzip.open(tmp_path / "run" / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  totals = profile_round.kernel_ms(str(tmp_path), profile_round.op_names(hlo), calls,
                                   "spec_round/verify")
  assert dict(totals) == {"jakiro_jax_small_row_matmul f32[5,3072]": 4.0,
                          "other XLA thunks": 0.5}
  assert (profile_round.kernel_label("jakiro_jax_small_row_matmul f32[5,3072]")
          == "jakiro_jax_small_row_matmul, 3072 outputs")
  assert profile_round.kernel_label("jakiro_jax_cache_attention f32[1,5,3,3,64]") == (
      "jakiro_jax_cache_attention")
  assert profile_round.kernel_label("other XLA thunks") == "other XLA thunks"
