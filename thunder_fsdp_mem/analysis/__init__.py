"""What a Thunder execution trace does to memory: the vocabulary of traces (``symbols``), what each bound symbol
allocates or aliases (``effects``, ``layout``), storage liveness over one trace (``liveness``, which returns a
``timeline``), and the peak of a whole training step (``step``), the one estimator that judges every rewrite and
every prediction; what the caching allocator reserves for it (``caching_allocator``)."""
