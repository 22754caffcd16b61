"""The runner: an unmodified Python program run with ``FSDPMemoryTransform`` in every Thunder function it builds,
in the manner of ``memray run`` or ``nsys profile``::

    thunder-fsdp-mem run [options] -- script.py [args...]
    thunder-fsdp-mem run [options] -- -m package.module [args...]
    torchrun --nproc-per-node 8 -m thunder_fsdp_mem.run [options] -- script.py [args...]

- ``inject``: ``thunder.jit`` (which ``ThunderCompiler``, ``thunder.compile`` and Thunder's fsdp reach) patched to
  append ``FSDPMemoryTransform(config)`` after the program's own transforms, and, asked to, to replace its
  executors; what it made, in the order made.
- ``program``: the program run in this process as ``python`` would run it; its exit code.
- ``record``: at exit, what each transform did and the memory CUDA measured, computed once (``Record``) and
  rendered as a short block of text or as JSON.
- ``main(argv) -> int`` (``command``): the options, the run, the block on rank 0's stderr; the program's exit code.
"""
