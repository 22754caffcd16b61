"""A GPU run's memory predicted on a machine without one, and measured where there is one: the meta device as a
target device (``meta``), one step traced there (``emulate``), an FSDP2 step composed per rank (``fsdp2`` from the
blocks' ThunderFX traces, ``thunderfx``), and a probed real step (``probes``, ``measure``, ``cpu_memory``) set
beside the prediction (``comparison``)."""
