"""Plot acceptance by depth and tau by category from `launch.eval_suite` results.

  python -m launch.probes.plot_results --results=results/smollm2 --temperature=0 \
      --out=results/smollm2/acceptance.png

Left: alpha_k per method, the fraction of rounds that accept a k-th drafted token among
those that accepted k-1 (pooled over the categories). Right: tau per category and method.
Needs matplotlib (`pip install -e ".[plot]"`).
"""

from __future__ import annotations

from absl import app, flags

from jakiro_jax.reports.benchmark import alpha_by_depth, pooled_counts
from launch import cli

_RESULTS = flags.DEFINE_string("results", None, "Directory of eval_suite JSON results.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Which temperature's results to plot.")
_OUT = flags.DEFINE_string("out", None, "PNG file to write.")
flags.mark_flags_as_required(["results", "out"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    import matplotlib
  except ImportError:
    raise SystemExit('plotting needs matplotlib: pip install -e ".[plot]"') from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  from jakiro_jax.reports.benchmark import load_results

  results = [r for r in load_results(_RESULTS.value)
             if "category" in r and r["temperature"] == _TEMPERATURE.value]
  if not results:
    raise SystemExit(f"no eval_suite results at T={_TEMPERATURE.value:g} in {_RESULTS.value}")
  methods = sorted({r["method"] for r in results})
  categories = sorted({r["category"] for r in results})
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  for method in methods:
    alphas = alpha_by_depth(pooled_counts([r for r in results if r["method"] == method]))
    left.plot(range(1, len(alphas) + 1), alphas, marker="o", label=method)
  left.set(xlabel="drafted token k", ylabel="alpha_k", ylim=(0, 1),
           title=f"acceptance by depth (T={_TEMPERATURE.value:g})")
  left.legend()
  width = 0.8 / len(methods)
  for m, method in enumerate(methods):
    taus = [next((r["tau"] for r in results
                  if r["method"] == method and r["category"] == c), 0.0) for c in categories]
    right.bar([i + m * width for i in range(len(categories))], taus, width, label=method)
  right.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(categories))],
                   categories)
  right.set(ylabel="tau (tokens per target forward)", title="tau by category")
  right.legend()
  fig.tight_layout()
  fig.savefig(_OUT.value, dpi=120)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
