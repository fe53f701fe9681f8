"""The campaign (`launch.campaign`): the steps it plans, its sizes, the drafts it copies, the results it
gathers, and (slow) the whole campaign at tiny scale on the embedded target."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jakiro_jax.train import campaign

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jsonl(path, questions):
  path.write_text("".join(json.dumps({"question_id": i, "category": path.stem,
                                      "turns": [q]}) + "\n" for i, q in enumerate(questions)))
  return str(path)


def _prompts(tmp_path):
  return _jsonl(tmp_path / "prompts.jsonl", [
      "Name a primary colour.", "What is 2 + 3?", "Say hello in French.",
      "Give one word for happy.", "Write a haiku about rain."])


def test_plan_runs_gen_data_then_each_method_then_the_evaluation(tmp_path):
  sizes = campaign.scale_settings("gpu", ["prompts=10", "fixed_shapes=false"])
  assert sizes["prompts"] == 10 and sizes["fixed_shapes"] is False
  questions = ["q/a.jsonl", "q/b.jsonl"]
  layers = {"eagle2": (), "eagle3": (2, 15, 27, -1), "gumiho": ()}
  steps = campaign.plan("configs/smollm2_135m.py", "p.jsonl", questions, str(tmp_path),
                        sizes, layers, "smollm2", warm_start=False)
  names = [s.name for s in steps]
  assert names == ["data:data", "data:data_2_15_27_m1", "train:eagle2", "train:eagle3",
                   "train:gumiho", "eval"]
  data, data3 = steps[0].command, steps[1].command
  assert "--exclude_questions=q/a.jsonl,q/b.jsonl" in data and "--max_prompts=10" in data
  assert "--feature_layers=2,15,27,-1" in data3
  assert not any(a.startswith("--feature_layers") for a in data)
  assert "--fixed_shapes" not in data and "--self_prompts=4000" in data
  train3 = steps[3].command
  assert f"--data={tmp_path / 'data_2_15_27_m1'}" in train3
  assert "--config=configs/smollm2_135m_eagle3.py" in train3 and "--resume" in train3
  assert "--config.num_epochs=2.0" in train3
  assert steps[3].done_when == str(tmp_path / "train" / "eagle3" / "draft" / "draft.json")
  evaluation = steps[-1].command
  assert "--methods=eagle2,eagle3,gumiho" in evaluation
  assert "--temperatures=0,1" in evaluation
  assert "--max_per_source=2500" in data and "--samples_per_prompt=2" in data
  # compare_shipped: the methods with a shipped draft for the target, on the same questions
  compared = campaign.plan("configs/smollm2_135m.py", "p.jsonl", questions, str(tmp_path),
                           dict(sizes, max_per_source=0), layers, "smollm2",
                           warm_start=False, compare_shipped=True)
  assert [s.name for s in compared] == names + ["eval:shipped"]
  assert not any(a.startswith("--max_per_source") for a in compared[0].command)
  shipped = compared[-1].command
  assert "--methods=eagle2,gumiho" in shipped and not any(
      a.startswith("--drafts") for a in shipped)
  assert shipped[shipped.index("--methods=eagle2,gumiho") + 1:] == evaluation[
      evaluation.index("--methods=eagle2,eagle3,gumiho") + 2:-1] + [
          f"--out={tmp_path / 'eval_shipped'}"]


def test_bad_sizes_are_refused_in_one_line():
  with pytest.raises(ValueError, match="key one of"):
    campaign.scale_settings("tiny", ["promts=3"])
  with pytest.raises(ValueError, match="prompts takes a int"):
    campaign.scale_settings("tiny", ["prompts=many"])
  for change, error in [("eval_new_tokens=-1", "eval_new_tokens=-1: it must be a number >= 1"),
                        ("prompts=-5", "prompts=-5: it must be a number >= 1"),
                        ("max_len=8", "max_len=8: it must be a number >= 16"),
                        ("train_epochs=nan", "train_epochs=nan: it must be"),
                        ("temperatures=0,hot", "temperatures=0,hot: a comma-separated")]:
    with pytest.raises(ValueError, match=error):
      campaign.scale_settings("tiny", [change])


def test_drafts_are_copied_in_files_of_at_most_the_limit(tmp_path, tiny_pair):
  from jakiro_jax.drafts import make_drafter
  from jakiro_jax.drafts.io import load_draft, save_draft
  _, target = tiny_pair
  drafter = make_drafter("gumiho", target.config)
  params = drafter.init_params(jax.random.PRNGKey(0))
  save_draft(tmp_path / "train" / "gumiho" / "draft", drafter, params)
  size = os.path.getsize(tmp_path / "train" / "gumiho" / "draft" / "model.safetensors")
  files = campaign.copy_drafts(str(tmp_path), ["gumiho"], "tiny", size // 2)
  copied = tmp_path / "drafts" / "tiny-gumiho"
  assert "model.safetensors.index.json" in files["gumiho"] and "draft.json" in files["gumiho"]
  shards = [n for n in files["gumiho"] if n.startswith("model-")]
  assert len(shards) >= 2
  _, loaded = load_draft(copied, target)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               loaded, params)


def test_results_pool_tau_over_the_files(tmp_path):
  (tmp_path / "eval").mkdir()
  for name, method, t, tokens, rounds, tau in [("gsm8k", "eagle2", 0, 91, 30, 3.0),
                                               ("alpaca", "eagle2", 0, 61, 40, 1.5),
                                               ("alpaca", "eagle2", 1, 51, 50, 1.0),
                                               ("alpaca", "ar", 0, 60, 60, 1.0)]:
    record = {"method": method, "temperature": t, "new_tokens": tokens, "rounds": rounds,
              "tau": tau, "speedup": 1.1, "greedy_mismatches": 0}
    (tmp_path / "eval" / f"{name}_T{t}_{method}.json").write_text(json.dumps(record))
  results = campaign.gather_results(str(tmp_path), ["eagle2"])
  assert set(results) == {"eagle2"} and set(results["eagle2"]) == {"0", "1"}
  # 1 + accepted tokens per round over both files' rounds: (3.0 * 30 + 1.5 * 40) / 70
  assert results["eagle2"]["0"]["tau"] == pytest.approx(150 / 70)
  assert results["eagle2"]["0"]["per_file"] == {"gsm8k": 3.0, "alpaca": 1.5}


def _entry(tau, gsm8k):
  return {"tau": tau, "per_file": {"gsm8k": gsm8k, "qa": 2.0}}


def test_a_trained_draft_replaces_the_shipped_one_only_when_better_everywhere():
  shipped = {m: {"0": _entry(2.0, 3.5), "1": _entry(1.8, 3.0)}
             for m in ("eagle2", "jakiro", "gumiho", "eagle3")}
  trained = {"eagle2": {"0": _entry(2.3, 3.45), "1": _entry(1.9, 2.95)},  # gsm8k -1.4%, -1.7%
             "jakiro": {"0": _entry(2.3, 3.5), "1": _entry(1.8, 3.0)},  # T=1 not higher
             "gumiho": {"0": _entry(2.5, 3.3), "1": _entry(2.0, 3.0)},  # gsm8k -5.7% at T=0
             "eagle3": {"0": _entry(2.5, 3.5)}}  # never shipped is not compared
  got = campaign.verdicts(trained, {k: v for k, v in shipped.items() if k != "eagle3"})
  assert set(got) == {"eagle2", "jakiro", "gumiho"}
  assert got["eagle2"]["replace"]
  assert not got["jakiro"]["replace"] and "T=1: pooled tau" in got["jakiro"]["why"]
  assert not got["gumiho"]["replace"] and "T=0: gsm8k tau 3.30" in got["gumiho"]["why"]
  # Pooled over other files (an evaluation that stopped early) is no comparison.
  partial = {"eagle2": {t: {"tau": e["tau"], "per_file": {"gsm8k": e["per_file"]["gsm8k"]}}
                        for t, e in trained["eagle2"].items()}}
  got = campaign.verdicts(partial, shipped)
  assert not got["eagle2"]["replace"] and "other files" in got["eagle2"]["why"]


def _campaign(*args, **kwargs):
  return subprocess.run([sys.executable, "-m", "launch.campaign", *args], cwd=REPO,
                        capture_output=True, text=True, **kwargs)


def test_the_command_line_names_bad_input(tmp_path):
  prompts = _prompts(tmp_path)
  out = _campaign(f"--prompts={prompts}", f"--questions_dir={tmp_path}",
                  f"--out={tmp_path / 'c'}", "--methods=eagle2,medusa")
  assert out.returncode != 0 and "no method medusa" in out.stderr
  (tmp_path / "empty").mkdir()
  out = _campaign(f"--prompts={prompts}", f"--questions_dir={tmp_path / 'empty'}",
                  f"--out={tmp_path / 'c'}", "--methods=eagle2")
  assert out.returncode != 0 and "holds no .jsonl files" in out.stderr
  (tmp_path / "q.jsonl").write_text('{"turns": ["hi"]}\n')
  (tmp_path / "a_file").write_text("")
  out = _campaign(f"--prompts={prompts}", f"--questions_dir={tmp_path}",
                  f"--out={tmp_path / 'a_file'}", "--methods=eagle2", "--dry_run")
  assert out.returncode == 2 and "--out=" in out.stderr and "is a file" in out.stderr
  out = _campaign(f"--prompts={prompts}", f"--questions_dir={tmp_path}",
                  f"--out={tmp_path / 'c'}", "--methods=eagle2", "--set=eval_new_tokens=-1")
  assert out.returncode == 2 and "eval_new_tokens=-1: it must be a number >= 1" in out.stderr
  assert not (tmp_path / "c").exists()  # refused before anything was written


def test_methods_trained_online_share_the_plain_feature_set(tmp_path):
  """Each method's streams come from its own training config: EAGLE-3 and DFlash train
  online (their configs say so), so no set of their layers is written for nothing."""
  (tmp_path / "q.jsonl").write_text('{"turns": ["hi"]}\n')
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"turns": ["hello"]}\n')
  out = _campaign(f"--prompts={prompts}", f"--questions_dir={tmp_path}",
                  f"--out={tmp_path / 'c'}", "--methods=eagle2,eagle3,dflash", "--dry_run")
  assert out.returncode == 0, out.stderr[-2000:]
  names = [line[2:] for line in out.stdout.splitlines() if line.startswith("# ")]
  assert names == ["data:data", "train:eagle2", "train:eagle3", "train:dflash", "eval"]


def test_a_second_campaign_into_a_busy_folder_is_refused_in_one_line(tmp_path):
  out = tmp_path / "c"
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time\n"
       "from jakiro_jax.atomic_dir import output_lock\n"
       f"with output_lock({str(out)!r}, 'launch.campaign'):\n"
       "  print('held', flush=True); time.sleep(120)\n"],
      cwd=REPO, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    (tmp_path / "q.jsonl").write_text('{"turns": ["hi"]}\n')
    proc = _campaign(f"--prompts={_prompts(tmp_path)}", f"--questions_dir={tmp_path}",
                     f"--out={out}", "--methods=eagle2", "--scale=tiny")
  finally:
    holder.kill()
    holder.wait()
  assert proc.returncode == 2, proc.stderr[-2000:]
  [line] = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
  assert f"{out} is being written by launch.campaign (pid {holder.pid} on " in line
  assert sorted(os.listdir(out)) == [".jakiro_jax.lock"]  # nothing else written


@pytest.mark.slow  # minutes: every launcher loads the target and compiles
def test_a_tiny_campaign_runs_end_to_end_and_resumes(tmp_path):
  questions = tmp_path / "eval"
  questions.mkdir()
  _jsonl(questions / "gsm8k.jsonl", ["Tom has 3 apples and buys 4 more. How many now?"])
  _jsonl(questions / "alpaca.jsonl", ["Give three tips for staying healthy."])
  args = [f"--prompts={_prompts(tmp_path)}", f"--questions_dir={questions}", f"--out={tmp_path / 'c'}",
          "--scale=tiny"]
  first = _campaign(*args, timeout=1800)
  assert first.returncode == 0, first.stderr[-3000:]
  results = json.loads((tmp_path / "c" / "results.json").read_text())
  assert set(results["evaluation"]) == {"eagle2", "jakiro", "gumiho"}
  for method, per_t in results["evaluation"].items():
    assert per_t["0"]["tau"] >= 1.0 and set(per_t["0"]["per_file"]) == {"gsm8k", "alpaca"}
    assert per_t["0"]["greedy_mismatches"] == 0
    assert (tmp_path / "c" / "drafts" / f"smollm2-{method}" / "draft.json").exists()
  assert results["data"]["data"]["conversations"] >= 1
  again = _campaign(*args, timeout=600)
  assert again.returncode == 0 and again.stderr.count("done before") == 5
