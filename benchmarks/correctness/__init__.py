"""The checks of correctness: does the transform leave results as they were, and do the estimate and the report say
what is true? Each runs as ``python -m benchmarks.correctness.NAME`` from the repository root (its docstring gives the
command and what it prints).

- ``bitwise``: a step with the transform against one without it, the loss and every gradient bit for bit.
- ``opinfo_sweep``: Thunder's OpInfos with and without the transform, forward and backward, bit for bit.
- ``thunder_suite``: Thunder's own test files with the transform in every compilation (``thunder_suite_plugin``
  adds it), against the same files without it.
- ``cast_check``: the elementwise ops ATen runs on 16-bit values as an upcast, the op and a rounding (the tables
  of ``passes/casts.py``).
- ``cudnn_attention_check``: ``training.cudnn_attention`` against torch's attention on a GPU.
- ``curves``: the losses of several modes trained on one data stream stay together.
- ``accuracy``: ``estimate_step`` against the measured peak of a real step.
- ``names_check``: the report names each of its largest tensors by what it is, on models the tests do not build.
"""
