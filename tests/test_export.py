"""PyTorch interop of drafts: the original EAGLE-2 / Jakiro / Jakiro* / Gumiho layouts, both ways.

Checks: JAX -> reference files -> JAX is bit-identical (fp32, .bin and .safetensors); a plain
torch forward written here from the specs' equations, fed the exported state dict, matches
the JAX forward; broken inputs fail with a ValueError that names the problem.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jakiro_jax.drafts import make_drafter
from jakiro_jax.speculative.drafter import TargetHead
from jakiro_jax.drafts.io import load_draft, save_draft
from jakiro_jax.integrity import RECORD
from jakiro_jax.export import (read_reference_dir, to_reference_state_dict,
                               write_reference_dir, write_target_hf_dir)
from jakiro_jax.models import llama
from jakiro_jax.models.config import LlamaConfig
from jakiro_jax.speculative.tree import TreeConfig
from jakiro_jax.target import Target, load_target

torch = pytest.importorskip("torch")

# Distinct sizes so a transposed axis shows; head_dim = hidden / heads as the originals need.
CFG = LlamaConfig(vocab_size=97, hidden_size=72, intermediate_size=88, num_layers=1,
                  num_heads=6, num_kv_heads=2, head_dim=12, rope_theta=1000.0,
                  rms_norm_eps=1e-5, max_position_embeddings=512)
TREES = {"eagle2": TreeConfig(top_k=2, depth=2, total_tokens=6),
         "jakiro": TreeConfig(top_k=2, depth=2, total_tokens=6),
         "jakiro_star": None,  # from its choices (the original's 26-node tree)
         "gumiho": TreeConfig(top_k=2, depth=3, total_tokens=8)}
OPTIONS = {"gumiho": dict(mlp_num=2, mlp_topk=3, pruning=3)}
METHODS = ("eagle2", "jakiro", "jakiro_star", "gumiho")


def _randomize(tree, seed):
  """Every leaf random (the zero-initialised Gumiho heads too); norm scales near 1."""
  rng = np.random.RandomState(seed)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  out = []
  for path, leaf in leaves:
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    is_norm = any("norm" in str(p) for p in path)
    out.append(jnp.asarray(1.0 + 0.1 * noise if is_norm else 0.08 * noise))
  return jax.tree.unflatten(treedef, out)


def _target(cfg=CFG, seed=0):
  params = llama.init_params(cfg, jax.random.PRNGKey(seed))
  params = _randomize(params, seed)
  emb = params["params"]["embed_tokens"]["embedding"]
  params["params"]["embed_tokens"]["embedding"] = emb * 10  # std ~1, like the features
  return Target(cfg, params)


@pytest.fixture(scope="module")
def target():
  return _target()


@pytest.fixture(scope="module")
def drafts():
  out = {}
  for n, method in enumerate(METHODS):
    drafter = make_drafter(method, CFG, TREES[method], **OPTIONS.get(method, {}))
    out[method] = drafter, _randomize(drafter.init_params(jax.random.PRNGKey(n)), 10 + n)
  return out


def _embedding(target):
  return target.params["params"]["embed_tokens"]["embedding"]


# ---- round trip -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
@pytest.mark.parametrize("method", METHODS)
def test_round_trip_is_bit_identical(tmp_path, target, drafts, method, fmt):
  drafter, params = drafts[method]
  write_reference_dir(tmp_path, drafter, params, _embedding(target), formats=[fmt])
  names = os.listdir(tmp_path)
  assert sorted(names) == sorted([".jakiro_jax_files.json", "config.json",
                                  "pytorch_model.bin" if fmt == "bin" else "model.safetensors"])
  # mlp_num is read off the names; the tree and Gumiho's search widths are not stored.
  search = {k: v for k, v in OPTIONS.get(method, {}).items() if k != "mlp_num"}
  loaded_drafter, loaded = read_reference_dir(tmp_path, method, target, TREES[method], **search)
  assert loaded_drafter == drafter
  assert jax.tree.structure(loaded) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("method", METHODS)
def test_draft_vocabulary_is_recorded_and_read_back(tmp_path, target, drafts, method):
  """The layouts hold no token subset: export records it in config.json (with a note the
  original loaders ignore) and import restores it, so the round trip keeps the drafter."""
  from jakiro_jax.export.reference_dir import draft_vocab_warning

  drafter, params = drafts[method]
  subset = tuple(range(3, 97, 2))
  drafter = dataclasses.replace(drafter, draft_vocab=subset)
  write_reference_dir(tmp_path, drafter, params, _embedding(target), formats=["safetensors"])
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["draft_vocab_ids"] == list(subset)
  assert config["draft_vocab_note"] == draft_vocab_warning(drafter)
  assert f"subset of {len(subset)} of the 97" in config["draft_vocab_note"]
  search = {k: v for k, v in OPTIONS.get(method, {}).items() if k != "mlp_num"}
  back, _ = read_reference_dir(tmp_path, method, target, TREES[method], **search)
  assert back.draft_vocab == subset and back == drafter
  assert draft_vocab_warning(drafts[method][0]) is None  # the whole vocabulary: nothing lost


def test_names_and_config_follow_the_specs(tmp_path, target, drafts):
  d, v, f = CFG.hidden_size, CFG.vocab_size, CFG.intermediate_size
  states = {m: to_reference_state_dict(*drafts[m]) if m != "gumiho" else
            to_reference_state_dict(*drafts[m], _embedding(target)) for m in METHODS}
  attn = "layers.0.self_attn."
  common = {"fc.weight": (d, 2 * d), "fc.bias": (d,),
            attn + "q_proj.weight": (72, d), attn + "k_proj.weight": (24, d),
            attn + "v_proj.weight": (24, d), attn + "o_proj.weight": (d, 72),
            "layers.0.post_attention_layernorm.weight": (d,)}
  mlp = {"gate_proj.weight": (f, d), "up_proj.weight": (f, d), "down_proj.weight": (d, f)}
  eagle2 = dict(common, **{"layers.0.mlp." + k: s for k, s in mlp.items()})
  jakiro = dict(common, **{"layers.0.mlp_moe.gate.weight": (4, d)})
  for e in range(2):
    jakiro.update({f"layers.0.mlp_moe.experts.{e}.{k}": (d, d) for k in mlp})
  gumiho = dict(eagle2, **{"embed_tokens.weight": (v, d), "layers.1.input_layernorm.weight": (d,)})
  gumiho.update({k.replace("layers.0.", "layers.1."): s for k, s in eagle2.items()
                 if k.startswith("layers.0.")})
  for i in range(2):
    for j in range(6):
      gumiho[f"mlp.{i}.{j}.linear.weight"] = (d, 2 * d if j == 0 else d)
      gumiho[f"mlp.{i}.{j}.linear.bias"] = (d,)
  star = dict(common, **{"layers.0.mlp_moe.gate.weight": (2, d)})
  for e in range(2):  # GELU experts: fc [I, H], proj [H, I]
    star.update({f"layers.0.mlp_moe.experts.{e}.fc.weight": (f, d),
                 f"layers.0.mlp_moe.experts.{e}.proj.weight": (d, f)})
  for method, expected in (("eagle2", eagle2), ("jakiro", jakiro), ("jakiro_star", star),
                           ("gumiho", gumiho)):
    assert {k: a.shape for k, a in states[method].items()} == expected, method
  # Values: fc columns are [embedding ; feature]; the gate keeps its row order.
  np.testing.assert_array_equal(states["jakiro"]["layers.0.mlp_moe.gate.weight"],
                                drafts["jakiro"][1]["params"]["layers_0"]["gate"])
  np.testing.assert_array_equal(states["gumiho"]["mlp.1.3.linear.weight"],
                                drafts["gumiho"][1]["params"]["heads_1"]["block_3"])

  write_reference_dir(tmp_path, *drafts["jakiro"], dtype="fp16")
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["num_hidden_layers"] == 1 and config["num_local_experts"] == 2
  assert config["num_experts_per_tok"] == 2 and config["bias"] is True
  assert config["rope_theta"] == 1000.0 and config["num_key_value_heads"] == 2
  assert config["rope_scaling"] is None and "qkv_bias" not in config
  from safetensors.numpy import load_file
  stored = load_file(tmp_path / "model.safetensors")
  assert "embed_tokens.weight" not in stored  # EAGLE/Jakiro copy it from the base
  assert all(a.dtype == np.float16 for a in stored.values())

  # Jakiro*: the original builds RoPE with base 10000 whatever the config says, and the
  # experts with the config's intermediate_size.
  write_reference_dir(tmp_path / "star", *drafts["jakiro_star"])
  config = json.loads((tmp_path / "star" / "config.json").read_text())
  assert config["rope_theta"] == 10000.0 and config["intermediate_size"] == f
  assert config["num_local_experts"] == 2 and config["num_experts_per_tok"] == 2


# ---- torch forward from the spec's equations --------------------------------------------------


def _t(a):
  return torch.from_numpy(np.array(a, np.float32))


def _rms(x, w, eps):
  return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _attention(sd, p, x, cfg):
  """Causal GQA attention, rotate-half RoPE at positions 0..T-1, fp32."""
  b, t, _ = x.shape
  nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size // cfg.num_heads
  q = (x @ sd[p + "q_proj.weight"].T).view(b, t, nh, hd).transpose(1, 2)
  k = (x @ sd[p + "k_proj.weight"].T).view(b, t, nkv, hd).transpose(1, 2)
  v = (x @ sd[p + "v_proj.weight"].T).view(b, t, nkv, hd).transpose(1, 2)
  inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
  angles = torch.arange(t).float()[:, None] * inv_freq
  angles = torch.cat([angles, angles], -1)
  cos, sin = angles.cos(), angles.sin()

  def rope(z):
    return z * cos + torch.cat([-z[..., hd // 2:], z[..., :hd // 2]], -1) * sin

  q, k = rope(q), rope(k)
  rep = nh // nkv  # kv head j serves query heads j*rep .. j*rep+rep-1
  k = k[:, :, None].expand(b, nkv, rep, t, hd).reshape(b, nh, t, hd)
  v = v[:, :, None].expand(b, nkv, rep, t, hd).reshape(b, nh, t, hd)
  scores = q @ k.transpose(2, 3) / hd ** 0.5
  causal = torch.ones(t, t, dtype=torch.bool).tril()
  scores = scores.masked_fill(~causal, torch.finfo(torch.float32).min)
  out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, nh * hd)
  return out @ sd[p + "o_proj.weight"].T


def _swiglu(sd, p, x):
  return (torch.nn.functional.silu(x @ sd[p + "gate_proj.weight"].T)
          * (x @ sd[p + "up_proj.weight"].T)) @ sd[p + "down_proj.weight"].T


def _fc(sd, emb, features):
  return torch.cat([emb, features], -1) @ sd["fc.weight"].T + sd["fc.bias"]


def torch_forward(method, sd, cfg, tokens, features):
  """The original draft's forward over a fresh sequence: (hidden, extra).

  eagle2/gumiho: hidden [B, T, D]; jakiro: (x + L, x + R) per spec 1.4; jakiro_star:
  ([x + E_pref, x + E_other] stacked on axis -2, x + w0 E0 + w1 E1) per spec 1.5, RoPE base
  10000. The layer-0 input is not normalised; later layers are pre-norm; no final norm.
  """
  sd = {k: _t(v) for k, v in sd.items()}
  eps = cfg.rms_norm_eps
  x = _fc(sd, sd["embed_tokens.weight"][torch.from_numpy(tokens)], _t(features))
  layers = 2 if method == "gumiho" else 1
  for layer in range(layers):
    p = f"layers.{layer}."
    h = _rms(x, sd[p + "input_layernorm.weight"], eps) if layer else x
    rope_cfg = cfg.replace(rope_theta=10000.0) if method == "jakiro_star" else cfg
    x = x + _attention(sd, p + "self_attn.", h, rope_cfg)
    h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
    if method == "jakiro_star":
      g = h @ sd[p + "mlp_moe.gate.weight"].T
      e0, e1 = (torch.nn.functional.gelu(h @ sd[f"{p}mlp_moe.experts.{e}.fc.weight"].T)
                @ sd[f"{p}mlp_moe.experts.{e}.proj.weight"].T for e in range(2))
      w = g.softmax(-1)
      first = (g[..., 0] > g[..., 1])[..., None]
      by_preference = torch.stack([torch.where(first, e0, e1), torch.where(first, e1, e0)], -2)
      return x[..., None, :] + by_preference, x + w[..., :1] * e0 + w[..., 1:] * e1
    if method != "jakiro":
      x = x + _swiglu(sd, p + "mlp.", h)
      continue
    g = h @ sd[p + "mlp_moe.gate.weight"].T
    e0, e1 = (_swiglu(sd, f"{p}mlp_moe.experts.{e}.", h) for e in range(2))
    w, u = g[..., :2].softmax(-1), g[..., 2:].softmax(-1)
    left = w[..., :1] * e0 + w[..., 1:] * e1
    first = (g[..., 2] > g[..., 3])[..., None]  # the dominant expert minus the other
    right = torch.where(first, u[..., :1] * e0 - u[..., 1:] * e1, u[..., 1:] * e1 - u[..., :1] * e0)
    return x + left, x + right
  return x


def torch_mlp_heads(sd, tokens, features, heads):
  """Gumiho's parallel heads over z = [fc(level a) ; fc(level b)]: [B, R, M, D]."""
  sd = {k: _t(v) for k, v in sd.items()}
  fused = _fc(sd, sd["embed_tokens.weight"][torch.from_numpy(tokens)], _t(features))
  z = fused.reshape(fused.shape[:-2] + (-1,))
  outs = []
  for i in range(heads):
    def block(x, j):
      return torch.nn.functional.silu(x @ sd[f"mlp.{i}.{j}.linear.weight"].T
                                      + sd[f"mlp.{i}.{j}.linear.bias"])
    y = block(z, 0)  # 2D -> D, no residual
    for j in range(1, 6):
      y = y + block(y, j)
    outs.append(y)
  return torch.stack(outs, -2)


def _logits(target, hidden):
  return np.asarray(llama.Llama(target.config).apply(target.params, jnp.asarray(hidden),
                                                     method=llama.Llama.logits))


@pytest.mark.parametrize("method", METHODS)
def test_torch_forward_from_exported_state_dict_matches(target, drafts, method):
  drafter, params = drafts[method]
  state = to_reference_state_dict(drafter, params, _embedding(target))
  rng = np.random.RandomState(7)
  b, t, d = 2, 5, CFG.hidden_size
  tokens = rng.randint(0, CFG.vocab_size, (b, t)).astype(np.int32)
  features = rng.standard_normal((b, t, d)).astype(np.float32)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  cache = drafter.new_cache(b, t)
  # Jakiro: (left, right); Jakiro*: (experts, mixture), the drafting and training outputs
  ours, _ = drafter.forward(params, TargetHead.of(target.config, target.params),
                            jnp.asarray(tokens), jnp.asarray(features), positions, cache, mask)
  with torch.no_grad():
    theirs = torch_forward(method, state, CFG, tokens, features)
  pairs = (list(zip(ours, theirs)) if method in ("jakiro", "jakiro_star")
           else [(ours, theirs)])
  if method == "gumiho":
    from gumiho_jax.draft import GumihoDraft
    pair_tokens = tokens[:, :4].reshape(b, 2, 2)
    pair_features = features[:, :4].reshape(b, 2, 2, d)
    embeds = llama.Llama(CFG).apply(target.params, jnp.asarray(pair_tokens),
                                    method=llama.Llama.embed)
    heads = drafter.module().apply(params, embeds, jnp.asarray(pair_features),
                                   method=GumihoDraft.parallel)
    with torch.no_grad():
      pairs.append((heads, torch_mlp_heads(state, pair_tokens, pair_features, drafter.mlp_num)))
  for jax_out, torch_out in pairs:
    jax_out, torch_out = np.asarray(jax_out), torch_out.numpy()
    assert np.abs(torch_out).max() > 0.1  # not a trivially small output
    np.testing.assert_allclose(jax_out, torch_out, rtol=0, atol=1e-5)
    head = np.asarray(target.params["params"]["lm_head"])
    np.testing.assert_allclose(_logits(target, jax_out), torch_out @ head.T, rtol=0, atol=1e-5)


# ---- errors -----------------------------------------------------------------------------------


def _write_state(path, state, fmt="safetensors"):
  """Weights as other code writes them: no integrity record (one there is removed)."""
  os.makedirs(path, exist_ok=True)
  if os.path.exists(os.path.join(path, RECORD)):
    os.remove(os.path.join(path, RECORD))
  if fmt == "bin":
    torch.save({k: torch.from_numpy(np.array(v)) for k, v in state.items()},
               os.path.join(path, "pytorch_model.bin"))
  else:
    from safetensors.numpy import save_file
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()},
              os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_corrupt_or_truncated_files(tmp_path, target, drafts, fmt):
  drafter, params = drafts["eagle2"]
  write_reference_dir(tmp_path, drafter, params, formats=[fmt])
  name = "pytorch_model.bin" if fmt == "bin" else "model.safetensors"
  data = (tmp_path / name).read_bytes()
  (tmp_path / name).write_bytes(data[:len(data) // 2])
  with pytest.raises(ValueError, match=f"{tmp_path / name} is damaged"):  # the record
    read_reference_dir(tmp_path, "eagle2", target, TREES["eagle2"])
  os.remove(tmp_path / RECORD)  # a directory the original code wrote: the reader names it
  with pytest.raises(ValueError, match="corrupt or truncated"):
    read_reference_dir(tmp_path, "eagle2", target, TREES["eagle2"])
  (tmp_path / name).write_bytes(b"not a checkpoint at all" * 10)
  with pytest.raises(ValueError, match="corrupt or truncated") as e:
    read_reference_dir(tmp_path, "eagle2", target, TREES["eagle2"])
  assert "\n" not in str(e.value) and "\x1b" not in str(e.value)
  assert "weights_only" not in str(e.value)  # no advice on loading it unsafely
  os.remove(tmp_path / name)
  with pytest.raises(FileNotFoundError, match="neither"):
    read_reference_dir(tmp_path, "eagle2", target, TREES["eagle2"])


def test_an_import_refuses_nan_before_writing_anything(tmp_path, target, drafts):
  drafter, params = drafts["eagle2"]
  poisoned = jax.tree.map(lambda x: x, params)
  weight = np.array(poisoned["params"]["fc"])
  weight[0, 0] = np.nan
  poisoned["params"]["fc"] = weight
  write_reference_dir(tmp_path / "src", drafter, poisoned, formats=["safetensors"])
  from jakiro_jax.models.convert import write_hf_dir
  from launch.import_draft import import_draft
  write_hf_dir(target.config, target.params, tmp_path / "target")
  with pytest.raises(ValueError, match="tensor fc.weight holds 1 NaN/Inf values"):
    import_draft(str(tmp_path / "src"), "eagle2", str(tmp_path / "target"),
                 str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()
  drafter2, got = read_reference_dir(tmp_path / "src", "eagle2", target, TREES["eagle2"],
                                     allow_nonfinite=True)  # to inspect a diverged run
  assert np.isnan(np.asarray(got["params"]["fc"])).sum() == 1


def test_an_export_with_no_weight_file_is_refused(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "launch.export", "--format=eagle2", "--draft=smollm2-eagle2",
       f"--out={tmp_path / 'x'}", "--nobin", "--nosafetensors"],
      capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "--nobin --nosafetensors leaves no weight file" in proc.stderr
  assert not (tmp_path / "x").exists()


class _RunsCode:
  def __reduce__(self):
    return (print, ("this must never run",))


def test_a_pickle_holding_code_is_refused_in_one_plain_line(tmp_path, target, drafts, capsys):
  import torch
  drafter, params = drafts["eagle2"]
  write_reference_dir(tmp_path, drafter, params, formats=["bin"])
  os.remove(tmp_path / RECORD)  # as the original code writes it
  torch.save({"fc.weight": torch.zeros(2), "x": _RunsCode()}, tmp_path / "pytorch_model.bin")
  with pytest.raises(ValueError) as e:
    read_reference_dir(tmp_path, "eagle2", target, TREES["eagle2"])
  message = str(e.value)
  assert "holds pickled objects other than tensors" in message and "\n" not in message
  assert "\x1b" not in message and "weights_only" not in message
  assert "this must never run" not in capsys.readouterr().out


def test_wrong_method_and_wrong_names(tmp_path, target, drafts):
  drafter, params = drafts["jakiro"]
  write_reference_dir(tmp_path / "j", drafter, params, _embedding(target), formats=["bin"])
  with pytest.raises(ValueError, match="is a jakiro checkpoint, not gumiho"):
    read_reference_dir(tmp_path / "j", "gumiho", target)
  with pytest.raises(ValueError, match="is a jakiro checkpoint, not eagle2"):
    read_reference_dir(tmp_path / "j", "eagle2", target)
  with pytest.raises(ValueError, match="is a jakiro checkpoint, not jakiro_star"):
    read_reference_dir(tmp_path / "j", "jakiro_star", target)
  write_reference_dir(tmp_path / "s", *drafts["jakiro_star"], formats=["safetensors"])
  with pytest.raises(ValueError, match="is a jakiro_star checkpoint, not jakiro"):
    read_reference_dir(tmp_path / "s", "jakiro", target, TREES["jakiro"])

  # Unknown, missing and mis-shaped names are listed (the original loader skips them).
  state = to_reference_state_dict(*drafts["eagle2"])
  state["layers.0.mlp.gate_projection.weight"] = state.pop("layers.0.mlp.gate_proj.weight")
  state["fc.bias"] = state["fc.bias"][:-1]
  state["lm_head.weight"] = np.zeros((CFG.vocab_size, CFG.hidden_size), np.float32)
  write_reference_dir(tmp_path / "e", *drafts["eagle2"])  # for config.json
  _write_state(tmp_path / "e", state)
  with pytest.raises(ValueError) as err:
    read_reference_dir(tmp_path / "e", "eagle2", target, TREES["eagle2"])
  message = str(err.value)
  assert "unknown keys: layers.0.mlp.gate_projection.weight, lm_head.weight" in message
  assert "missing keys: layers.0.mlp.gate_proj.weight" in message
  assert "mis-shaped keys: fc.bias (71,) (expected (72,))" in message

  # Gumiho: the embedding is mandatory, the module spelling mlp.mlp.* is accepted on import.
  g_drafter, g_params = drafts["gumiho"]
  with pytest.raises(ValueError, match="needs embed_tokens.weight"):
    to_reference_state_dict(g_drafter, g_params)
  g_state = to_reference_state_dict(g_drafter, g_params, _embedding(target))
  write_reference_dir(tmp_path / "g", g_drafter, g_params, _embedding(target),
                      formats=["safetensors"])
  _write_state(tmp_path / "g", {("module." + k.replace("mlp.", "mlp.mlp.", 1)
                                 if k.startswith("mlp.") else k): v for k, v in g_state.items()})
  _, loaded = read_reference_dir(tmp_path / "g", "gumiho", target, TREES["gumiho"])
  jax.tree.map(np.testing.assert_array_equal, loaded, g_params)
  del g_state["embed_tokens.weight"]
  _write_state(tmp_path / "g", g_state)
  with pytest.raises(ValueError, match="missing keys: embed_tokens.weight"):
    read_reference_dir(tmp_path / "g", "gumiho", target, TREES["gumiho"])


def test_target_mismatch(tmp_path, target, drafts):
  drafter, params = drafts["gumiho"]
  write_reference_dir(tmp_path, drafter, params, _embedding(target), formats=["safetensors"])
  other_vocab = _target(CFG.replace(vocab_size=101))
  with pytest.raises(ValueError, match=r"vocab_size=97 \(target: 101\)"):
    read_reference_dir(tmp_path, "gumiho", other_vocab)
  other_hidden = _target(CFG.replace(hidden_size=96, head_dim=16))
  with pytest.raises(ValueError, match=r"hidden_size=72 \(target: 96\)"):
    read_reference_dir(tmp_path, "gumiho", other_hidden)
  with pytest.raises(ValueError, match=r"embedding shape \(101, 72\) does not match"):
    to_reference_state_dict(drafter, params, np.zeros((101, 72), np.float32))
  # config.json says the right vocab, the stored embedding does not.
  state = to_reference_state_dict(drafter, params, _embedding(target))
  state["embed_tokens.weight"] = np.zeros((101, 72), np.float32)
  _write_state(tmp_path, state)
  with pytest.raises(ValueError, match=r"embed_tokens.weight has shape \(101, 72\), the "
                     r"target's embedding is \(97, 72\) \(vocab or hidden size mismatch\)"):
    read_reference_dir(tmp_path, "gumiho", target, TREES["gumiho"])
  odd = make_drafter("eagle2", CFG.replace(head_dim=16), TREES["eagle2"])
  odd_params = odd.init_params(jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="head_dim"):
    to_reference_state_dict(odd, odd_params)


def test_bin_wins_over_safetensors_only_when_they_agree(tmp_path, target, drafts, caplog):
  caplog.set_level("INFO")
  drafter, params = drafts["eagle2"]
  write_reference_dir(tmp_path, drafter, params, formats=["bin", "safetensors"])
  _, loaded = read_reference_dir(tmp_path, "eagle2", target, TREES["eagle2"])
  jax.tree.map(np.testing.assert_array_equal, loaded, params)
  assert "reading pytorch_model.bin" in caplog.text
  # Another draft's weights in the .safetensors (a stale file of an earlier export): the
  # original loaders would silently read the .bin; we name both files.
  other = to_reference_state_dict(drafter, _randomize(params, 99))
  _write_state(tmp_path, other)
  with pytest.raises(ValueError, match=r"holds both pytorch_model.bin and model.safetensors "
                     r"and they differ \(.*values differ"):
    read_reference_dir(tmp_path, "eagle2", target, TREES["eagle2"])
  del other["fc.bias"]
  _write_state(tmp_path, other)
  with pytest.raises(ValueError, match=r"only in pytorch_model.bin: \['fc.bias'\]"):
    read_reference_dir(tmp_path, "eagle2", target, TREES["eagle2"])
  (tmp_path / "model.safetensors").write_bytes(b"garbage")
  with pytest.raises(ValueError, match="model.safetensors \\(corrupt or truncated"):
    read_reference_dir(tmp_path, "eagle2", target, TREES["eagle2"])
  # An fp16 copy of the same weights beside the fp32 .bin agrees.
  _write_state(tmp_path, {k: v.astype(np.float16)
                          for k, v in to_reference_state_dict(drafter, params).items()})
  _, loaded = read_reference_dir(tmp_path, "eagle2", target, TREES["eagle2"])
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


# ---- command lines and the target's HF directory -----------------------------------------------


def test_command_lines_round_trip(tmp_path, target, drafts):
  target_dir = tmp_path / "target"
  write_target_hf_dir(target, target_dir)  # what --format=hf runs, in process
  assert (target_dir / "model.safetensors.index.json").exists()
  loaded_target = load_target(target_dir, with_tokenizer=False)
  jax.tree.map(np.testing.assert_array_equal, loaded_target.params, target.params)

  drafter, params = drafts["jakiro"]
  drafter = dataclasses.replace(drafter, draft_vocab=tuple(range(0, 97, 3)))
  save_draft(tmp_path / "ours", drafter, params)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = lambda module, *args: subprocess.run(  # noqa: E731
      [sys.executable, "-m", f"launch.{module}", *args], cwd=root,
      env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120)
  out = run("export", f"--draft={tmp_path / 'ours'}", f"--target={target_dir}",
            "--format=jakiro", f"--out={tmp_path / 'ref'}", "--bin", "--safetensors")
  assert out.returncode == 0, out.stderr
  assert sorted(os.listdir(tmp_path / "ref")) == [".jakiro_jax_files.json", "config.json",
                                                  "model.safetensors", "pytorch_model.bin"]
  assert "warning: this draft proposes tokens from a subset of 33 of the 97" in out.stderr
  out = run("import_draft", f"--src={tmp_path / 'ref'}", "--format=gumiho",
            f"--target={target_dir}", f"--out={tmp_path / 'back'}")
  assert out.returncode != 0 and "is a jakiro checkpoint, not gumiho" in out.stderr
  out = run("import_draft", f"--src={tmp_path / 'ref'}", "--format=jakiro",
            f"--target={target_dir}", f"--out={tmp_path / 'back'}", "--top_k=2", "--depth=2",
            "--total_tokens=6")
  assert out.returncode == 0, out.stderr
  back_drafter, back = load_draft(tmp_path / "back", target)
  assert back_drafter == drafter
  jax.tree.map(np.testing.assert_array_equal, back, params)


def test_jakiro_star_command_lines_round_trip(tmp_path, target, drafts):
  target_dir = tmp_path / "target"
  write_target_hf_dir(target, target_dir)
  drafter, params = drafts["jakiro_star"]
  save_draft(tmp_path / "ours", drafter, params)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = lambda module, *args: subprocess.run(  # noqa: E731
      [sys.executable, "-m", f"launch.{module}", *args], cwd=root,
      env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120)
  out = run("export", f"--draft={tmp_path / 'ours'}", f"--target={target_dir}",
            "--format=jakiro_star", f"--out={tmp_path / 'ref'}")
  assert out.returncode == 0, out.stderr
  out = run("import_draft", f"--src={tmp_path / 'ref'}", "--format=jakiro_star",
            f"--target={target_dir}", f"--out={tmp_path / 'back'}")
  assert out.returncode == 0, out.stderr
  back_drafter, back = load_draft(tmp_path / "back", target)
  assert back_drafter == drafter and back_drafter.tree.total_tokens == 27
  jax.tree.map(np.testing.assert_array_equal, back, params)
