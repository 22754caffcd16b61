"""The rewrites of ``FSDPMemoryTransform``: pure passes from traces to traces (``casts``, ``fusions``, ``recompute``
with its minimum cut ``mincut``, its rewrite ``plan_rewrite`` and its memory budget ``budget``, ``reorder``,
``gathers``, ``scatters``), the checks every rewrite passes (``checks``), how a pass builds its result (``edit``),
the driver that runs, checks, judges and records each pass (``driver``), how each pass declares itself
(``declaration``), and their order (``pipeline``)."""
