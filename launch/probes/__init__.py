"""Measurement probes: what the figures in docs/ were measured with, not a user's commands
(those are `launch/`'s). Each runs as `python -m launch.probes.NAME` (see its docstring):
compile_bench, profile_step, profile_round, xla_flags_probe, prune_bench_prefill,
prune_generate_bench, plot_results."""
