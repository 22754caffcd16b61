"""The rewrites of ``FSDPMemoryTransform``: pure passes from traces to traces (``casts``, ``recompute``,
``reorder``, ``gathers``, ``scatters``), the checks every rewrite passes (``checks``), how a pass builds its result
(``edit``), the driver that runs, checks, judges and records each pass (``driver``), and their order
(``pipeline``)."""
