"""What a Thunder execution trace does to memory: the vocabulary of traces (``symbols``), what each bound symbol
allocates or aliases (``effects``, ``layout``), storage liveness over one trace (``liveness``), and the peak of a
whole training step (``step``), the one estimator that judges every rewrite and every prediction."""
