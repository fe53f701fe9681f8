"""Greedy EAGLE-3 generation by the official SafeAILab/EAGLE code, for our parity test.

Run by a python whose transformers the official code supports (4.53.x), never by ours:
it imports neither jax nor jakiro_jax.

  python tests/eagle3_reference_generate.py JOB.json OUT.json

JOB.json:
  reference_dir    a SafeAILab/EAGLE checkout (holds eagle/model/ea_model.py)
  target_dir       the target, a HuggingFace Llama directory with
                   model.safetensors.index.json (the official code reads the target's
                   embedding through it)
  head_dir         the EAGLE-3 draft: config.json + pytorch_model.bin
  prompts          lists of token ids, generated one at a time (batch 1)
  max_new_tokens   as eagenerate's (it stops once it has MORE than this many)
  tree             {"total_token", "depth", "top_k"}: EaModel.from_pretrained's
  eos_token_id     the stop token eagenerate checks (null: none)
  seed, threads    torch.manual_seed, torch.set_num_threads (default 0, 1)
  record_trees     also write each round's drafted tree (tokens, depths, parents)
  make_head        optional: first BUILD `head_dir` with the official classes
                   (`eagle.model.cnets.Model` of an `EConfig`), see `make_head`.

OUT.json: {"transformers": version, "torch": version, "head": {...weights check...},
           "results": [{"tokens": generated ids, "accept_lengths": per round,
                        "new_token": eagenerate's count, "rounds": ..., "trees": ...}]}
"""

from __future__ import annotations

import json
import math
import os
import sys
import types


def make_head(job, spec, torch, Model, EConfig):
  """An official EAGLE-3 draft of the target, built in the official `Model` and saved as
  the official layout (config.json + `pytorch_model.bin`, architectures
  LlamaForCausalLMEagle3, no eagle_config: the official code captures the target's
  default streams, before layers 2, L//2 and L-3).

  Every weight starts from the official random initialisation (torch.manual_seed(seed)),
  norms scaled by 1 + 0.1 noise; then, so that the draft accepts part of the time, a
  structure is written over it that predicts `spec["next_token"]` (the target's next
  token as a function of the current one, f) from the draft's INPUT token, at every
  depth of the tree:

  - q/k: a constant query and key (read from dimension 0 of the normed embedding, which
    the test's target holds constant) in the three fastest RoPE pairs of every head, so
    each position attends to itself: the scores at distance d are a^2 (cos d + cos
    0.32d + cos 0.1d) / sqrt(head_dim), 0.51 a^2 / 4 below distance 0's for 0 < d < 100.
    The other q/k weights keep their random values times `qk_noise`.
  - v (embedding half) and o: the attention output is A(t) = c (u_f(t) - u_t), with
    u_t = B z_t (z_t random unit vectors in the value space, B orthonormal columns),
    exact since the normed embeddings are independent (V <= D).
  - lm_head rows beta u_y. The draft's output is its input hidden plus A(t) (plus the
    random MLP and the value's random hidden half): along a drafted chain t1, f(t1), ...
    the A's telescope to c (u_next - u_t1), whose logits rank f(last) first.
  - fc keeps its random values times `fc_scale`: the fused target streams shift the
    scores, they do not decide them.
  """
  target_dir, head_dir = job["target_dir"], job["head_dir"]
  with open(os.path.join(target_dir, "config.json")) as f:
    base = json.load(f)
  config = {
      "architectures": ["LlamaForCausalLMEagle3"],
      "model_type": "llama",
      "hidden_act": "silu",
      "hidden_size": base["hidden_size"],
      "intermediate_size": base["intermediate_size"],
      "num_attention_heads": base["num_attention_heads"],
      "num_key_value_heads": base["num_key_value_heads"],
      "num_hidden_layers": 1,
      "max_position_embeddings": base["max_position_embeddings"],
      "rms_norm_eps": base["rms_norm_eps"],
      "rope_theta": float(spec.get("rope_theta", 10000.0)),
      "tie_word_embeddings": False,
      "torch_dtype": "float32",
      "vocab_size": base["vocab_size"],
      "draft_vocab_size": base["vocab_size"],
  }
  torch.manual_seed(int(spec.get("seed", 0)))
  model = Model(EConfig(**config), load_emb=True, path=target_dir).float().eval()
  gen = torch.Generator().manual_seed(int(spec.get("seed", 0)) + 1)
  d, heads = config["hidden_size"], config["num_attention_heads"]
  kv_heads, vocab = config["num_key_value_heads"], config["vocab_size"]
  hd = d // heads
  rank, rep = kv_heads * hd, heads // kv_heads
  nxt = torch.tensor(spec["next_token"], dtype=torch.long)
  a, c, beta = float(spec["query_scale"]), float(spec["code_scale"]), float(spec["head_scale"])
  with torch.no_grad():
    layer, attn = model.midlayer, model.midlayer.self_attn
    for norm in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm,
                 model.norm):
      norm.weight.mul_(1 + 0.1 * torch.randn(d, generator=gen))
    model.fc.weight.mul_(float(spec.get("fc_scale", 1.0)))
    attn.q_proj.weight.mul_(float(spec.get("qk_noise", 0.1)))
    attn.k_proj.weight.mul_(float(spec.get("qk_noise", 0.1)))
    rho = torch.zeros(hd)
    rho[:3] = a  # RoPE pairs (j, j + hd/2), j = 0, 1, 2: the fastest frequencies
    for h in range(heads):
      attn.q_proj.weight[h * hd:(h + 1) * hd, 0] += rho
    for g in range(kv_heads):
      attn.k_proj.weight[g * hd:(g + 1) * hd, 0] += rho
    emb = layer.input_layernorm(model.embed_tokens.weight.float())  # [V, D], as the layer sees it
    z = torch.randn(rank, vocab, generator=gen)
    z = z / z.norm(dim=0, keepdim=True)
    basis, _ = torch.linalg.qr(torch.randn(d, rank, generator=gen, dtype=torch.float64))
    basis = basis.float()
    wanted = c * (z[:, nxt] - z)  # [R, V]: the value of token t
    attn.v_proj.weight[:, :d] = (wanted.double() @ torch.linalg.pinv(emb.T.double())).float()
    for h in range(heads):
      g = h // rep
      attn.o_proj.weight[:, h * hd:(h + 1) * hd] = basis[:, g * hd:(g + 1) * hd] / rep
    model.lm_head.weight.copy_(beta * (basis @ z).T)
    residual = (attn.v_proj.weight[:, :d] @ emb.T - wanted).abs().max().item()
  state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
           if k != "embed_tokens.weight"}  # the target's, loaded by the official code
  # The whole vocabulary as the official training writes it: d2t 0, t2d all true.
  state["d2t"] = torch.zeros(vocab, dtype=torch.long)
  state["t2d"] = torch.ones(vocab, dtype=torch.bool)
  os.makedirs(head_dir, exist_ok=True)
  torch.save(state, os.path.join(head_dir, "pytorch_model.bin"))
  with open(os.path.join(head_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  return {"value_fit_max_error": residual}


def check_loaded(model, head_dir, torch):
  """The official loader reads with strict=False, which would skip a misnamed weight in
  silence: every draft weight must have come from the file, with its values."""
  state = torch.load(os.path.join(head_dir, "pytorch_model.bin"), map_location="cpu")
  ours = model.ea_layer.state_dict()
  missing = sorted(k for k in ours if k not in state and k != "embed_tokens.weight")
  unused = sorted(k for k in state if k not in ours)
  differ = sorted(k for k in state if k in ours and not torch.equal(
      state[k].to(ours[k].dtype), ours[k]))
  if missing or differ:
    raise SystemExit(f"the official EaModel did not load {head_dir} whole: missing "
                     f"{missing}, different {differ}")
  return {"loaded": sorted(k for k in state if k in ours), "unused": unused}


def main(job_path, out_path):
  with open(job_path) as f:
    job = json.load(f)
  sys.path.insert(0, os.path.abspath(job["reference_dir"]))
  for flag in ("USE_TF", "USE_FLAX", "USE_JAX"):
    os.environ.setdefault(flag, "0")
  import torch
  import transformers
  torch.set_num_threads(int(job.get("threads", 1)))
  from eagle.model import ea_model
  from eagle.model.cnets import Model
  from eagle.model.configs import EConfig

  out = {"transformers": transformers.__version__, "torch": torch.__version__, "head": {}}
  if job.get("make_head") is not None:
    out["head"].update(make_head(job, job["make_head"], torch, Model, EConfig))

  # EaModel asks for the target's tokenizer only for its eos id.
  tokenizer = types.SimpleNamespace(eos_token_id=job.get("eos_token_id"))
  ea_model.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: tokenizer)
  # Each round's accepted length, and (optionally) its tree, as eagenerate computes them.
  accepts, trees = [], []
  evaluate = ea_model.evaluate_posterior

  def recording_evaluate(*args, **kwargs):
    best, accept_length, sample_p = evaluate(*args, **kwargs)
    accepts.append(int(accept_length))
    return best, accept_length, sample_p

  ea_model.evaluate_posterior = recording_evaluate
  if job.get("record_trees"):
    genrate = Model.topK_genrate

    def recording_genrate(self, *args, **kwargs):
      tokens, retrieve, mask, depths = genrate(self, *args, **kwargs)
      rows = mask[0, 0].bool()  # ancestor-or-self; the parent is the deepest ancestor
      parents = [-1] + [int(max((j for j in range(i) if rows[i, j]),
                                key=lambda j: int(depths[j]))) for i in range(1, len(depths))]
      trees.append({"tokens": tokens[0].tolist(), "depths": depths.tolist(),
                    "parents": parents})
      return tokens, retrieve, mask, depths

    Model.topK_genrate = recording_genrate

  tree = job["tree"]
  torch.manual_seed(int(job.get("seed", 0)))
  model = ea_model.EaModel.from_pretrained(
      use_eagle3=True, base_model_path=job["target_dir"], ea_model_path=job["head_dir"],
      total_token=int(tree["total_token"]), depth=int(tree["depth"]),
      top_k=int(tree["top_k"]), torch_dtype=torch.float32)
  model.eval()
  out["head"].update(check_loaded(model, job["head_dir"], torch))
  out["draft_total_tokens"] = int(model.ea_layer.total_tokens)  # drafted nodes, root excluded
  results = []
  for prompt in job["prompts"]:
    accepts.clear()
    trees.clear()
    input_ids = torch.tensor([list(prompt)], dtype=torch.long)
    output, new_token, idx = model.eagenerate(
        input_ids, temperature=0.0, max_new_tokens=int(job["max_new_tokens"]), log=True)
    result = {"tokens": output[0, len(prompt):].tolist(), "accept_lengths": list(accepts),
              "new_token": int(new_token), "rounds": int(idx) + 1}
    if job.get("record_trees"):
      result["trees"] = [dict(t) for t in trees]
    results.append(result)
  out["results"] = results
  lens = [a for r in results for a in r["accept_lengths"]]
  out["tau"] = (sum(lens) / len(lens) + 1.0) if lens else math.nan
  with open(out_path, "w") as f:
    json.dump(out, f)


if __name__ == "__main__":
  if len(sys.argv) != 3:
    raise SystemExit(__doc__)
  main(sys.argv[1], sys.argv[2])
