"""The benchmarks: scripts run as modules from the repository root (each module's docstring gives its command), in
two groups, and the pieces they share.

- ``performance``: what measures speed and memory, ``python -m benchmarks.performance.compare ...`` (every FSDP mode
  side by side), ``profile_step``, ``litgpt_script``, ``transform_speed``, ``analyze_speed``,
  ``window_first_step``, ``saved_vs_eager``, ``recompute_tradeoff``, ``plot_tradeoff``.
- ``correctness``: what checks that results are unchanged and that the estimate and the report are right,
  ``python -m benchmarks.correctness.bitwise ...``, ``opinfo_sweep``, ``thunder_suite``, ``cast_check``,
  ``cudnn_attention_check``, ``curves``, ``accuracy``, ``names_check``.

Shared: ``options`` (usage errors, common options), ``variants`` (a mode's ``@`` options, as ``compare``, ``curves``
and ``profile_step`` take them), ``launch`` (the ``torchrun`` command).
"""
