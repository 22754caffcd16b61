"""What an allocation is for. The enum values are the names reports display."""

from __future__ import annotations

from enum import Enum


class Category(str, Enum):
    """Category of one allocation in a Thunder execution trace.

    - ``PARAMETER``: a parameter or buffer of the module as it is held between steps (the shard, under FSDP).
    - ``GATHERED_PARAMETER``: the unsharded parameter an all-gather produces.
    - ``INPUT``: an argument of the step that is not a parameter (token ids, targets).
    - ``SAVED``: a tensor the forward keeps for the backward.
    - ``TEMPORARY``: an intermediate that dies inside the trace that made it, and op workspace.
    - ``GRADIENT``: a gradient the backward returns (sharded under FSDP) and the step keeps.
    - ``COMM_BUFFER``: a buffer a collective reads or writes that is none of the above (all-reduce
      copies, bucketing buffers, the unsharded gradient a reduce-scatter reads).
    - ``OUTPUT``: the forward's own result (the loss, the logits) held by the caller until backward.
    - ``OPTIMIZER_STATE``: the optimizer's state (AdamW's moments), alive through the step.
    """

    PARAMETER = "parameter"
    GATHERED_PARAMETER = "gathered parameter"
    INPUT = "input"
    SAVED = "saved for backward"
    TEMPORARY = "temporary"
    GRADIENT = "gradient"
    COMM_BUFFER = "communication buffer"
    OUTPUT = "output"
    OPTIMIZER_STATE = "optimizer state"
