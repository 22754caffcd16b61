"""The memory report of one step, computed once and rendered by functions that only read it; only the CLI prints.

``build_report(step, title=...) -> Report`` (``contents``) computes the plans, their largest allocation groups at the
peak and the ``advice`` on what would lower it; ``render_text`` (``text``), ``render_json`` (``as_json``) and
``render_plot``/``plot_figure`` (``plot``) render it. ``render_fit`` and ``fit_json`` (``fit_table``) present the search
of ``predict.largest_step`` for the largest step that fits.
"""
