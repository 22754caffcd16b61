"""What measures speed and memory. Each runs as ``python -m benchmarks.performance.NAME`` from the repository root
(its docstring gives the command and what it prints).

- ``compare``: every FSDP mode side by side, peak memory, step time and the estimate, one fresh ``torchrun`` per
  mode; cut into ``compare_runs`` (one ``torchrun`` per mode), ``compare_worker`` (one mode on every rank) and
  ``compare_table`` (the rows, the table, the chart). ``plot_tradeoff`` draws peak memory against step time from
  its ``--json``.
- ``profile_step``: where a step's time goes, per phase and per kind of kernel.
- ``litgpt_script``: Thunder's own ``benchmark_litgpt.py`` run unmodified, plain and through the runner.
- ``transform_speed``, ``analyze_speed``: how long the transform and the analysis take on a large model.
- ``window_first_step``: the first step of a sliding-window model, with litgpt's mask loop and vectorized.
- ``saved_vs_eager``, ``recompute_tradeoff``: bytes saved for backward, against eager autograd and against the
  traffic of what is recomputed.
"""
