"""The benchmarks: scripts run as modules from the repository root, ``python -m benchmarks.compare ...`` (each
module's docstring gives its command), and the pieces they share.

Entry points: ``compare`` (every FSDP mode side by side), ``curves``, ``profile_step``, ``plot_tradeoff``,
``accuracy``, ``bitwise``, ``cast_check``, ``cudnn_attention_check``, ``saved_vs_eager``, ``recompute_tradeoff``,
``transform_speed``, ``analyze_speed``. Shared: ``options`` (usage errors, common options), ``variants`` (a mode's
``@`` options), ``launch`` (the ``torchrun`` command); ``compare`` is cut into ``compare_runs`` (one ``torchrun``
per mode), ``compare_worker`` (one mode on every rank) and ``compare_table`` (rows, the table, the chart).
"""
