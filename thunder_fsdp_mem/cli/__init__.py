"""``thunder-fsdp-mem``: the command line. ``main(argv=None) -> int`` (``commands``) returns the exit code; the
console script and ``python -m thunder_fsdp_mem.cli`` (``__main__``, as torchrun runs it) call it.

Two commands: ``report`` (where the memory of one training step goes) and ``fit`` (the largest step that fits a
size per rank); ``report --fit`` still runs ``fit`` for one release, with a note on stderr. The grammar is in
``parser``, the checks before any tracing in ``validate``, what goes to stderr besides the report in ``console``.
"""
