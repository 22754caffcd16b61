"""What running a bound symbol again costs in time, by a roofline: the larger of its arithmetic at the device's peak
rate and its memory traffic at the device's bandwidth. The memory budget (``passes.budget``) ranks what to
recompute by this time per byte of peak removed.

Entry points: ``op_seconds(bsym, rates=H200) -> float``; ``traffic_equivalent(bsym, rates)``, the same time in the
bytes a memory-bound op would move.

- ``matmul`` / ``linear``: 2 x M x N x K floating-point operations at the tensor cores' rate for the dtype;
- the attention kernels of Thunder's sdpa executor (flash and memory-efficient) and of torch's cuDNN attention
  (``training.cudnn_attention``): 4 x B x H x Tq x Tk x D
  operations, half of it under a causal mask;
- a fusion region: the arithmetic of the matmuls and attention among its subsymbols, and the traffic of its own
  inputs and outputs (what a fused kernel reads and writes);
- every other op: the bytes of its tensor arguments and outputs; views and reshapes launch no kernel and cost
  nothing.

Assumptions, to be checked against measured step times (``docs/design.md``): peak rates are reached (no launch
overhead, no occupancy loss), and an op is bound by one of the two rates. The rates are a small typed table
(``DeviceRates``); ``H200`` holds what the device's README and NVIDIA's data sheet give.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from thunder_fsdp_mem.analysis import symbols

# Thunder's sdpa executor's forwards, by name, with the positions of their dropout and causal arguments: the
# memory-efficient kernel's (query, key, value, attn_mask, dropout_p, is_causal, scale), and the flash kernel's,
# which Thunder names ``sdpafx_..._efficient_attention`` too: (query, key, value, dropout_p, is_causal); and the
# cuDNN kernel's of ``training.cudnn_attention`` (query, key, value, dropout_p, is_causal, scale), the package's
# own op, by a literal (``analysis`` imports nothing of ``training``; tests/test_cost.py checks that it agrees).
_ATTENTION_OPTIONS = {
    symbols.EFFICIENT_ATTENTION: (4, 5),
    symbols.FLASH_ATTENTION: (3, 4),
    "cudnn_sdpa_forward": (3, 4),
}
ATTENTION = frozenset(_ATTENTION_OPTIONS)
# ``broadcast_in_dim``: the prim's own name, which ``sym_id`` never gives (it names the prim ``expand``), kept from the
# first table.
_NO_KERNEL = symbols.VIEW_OPS | symbols.RESHAPE_OPS | {"broadcast_in_dim"}


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceRates:
    """Peak rates of one device.

    name: what the device is called in reports.
    matmul_flops: dense matrix arithmetic per second, by Thunder's short dtype name (``bf16``, ``f16``, ``f32``).
    bandwidth: bytes per second between the device's memory and its cores.
    memory: bytes the device holds (0: not said).
    """

    name: str
    matmul_flops: Mapping[str, float]
    bandwidth: float
    memory: int = 0

    def __post_init__(self) -> None:
        if not self.matmul_flops or any(not rate > 0 for rate in self.matmul_flops.values()):
            raise ValueError(f"DeviceRates.matmul_flops must give a positive rate per dtype, got {self.matmul_flops!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"DeviceRates.bandwidth must be positive, got {self.bandwidth!r}")

    def flops(self, dtype: str) -> float:
        """The matrix rate for ``dtype``; the float32 rate for a dtype the table does not name."""
        return self.matmul_flops.get(dtype, self.matmul_flops.get("f32", min(self.matmul_flops.values())))


# H200 SXM: dense matrix rates for bf16, f16 and float32 (no TF32: torch's default precision), HBM3e bandwidth and
# memory; where each figure comes from: docs/design.md, "The cost model".
H200 = DeviceRates(
    name="H200",
    matmul_flops=MappingProxyType({"bf16": 790e12, "f16": 790e12, "f32": 67e12}),
    bandwidth=4.8e12,
    memory=143771 * 2**20,
)


def op_flops(bsym) -> tuple[float, str]:
    """Floating-point operations of ``bsym``'s matmuls and attention (inside a fusion region too), and the dtype
    they run in; (0, "") for an op without them."""
    if symbols.is_fusion(bsym):
        found = [op_flops(sub) for sub in bsym.subsymbols]
        total = sum(f for f, _ in found)
        return total, next((d for f, d in found if f), "")
    sid = symbols.sym_id(bsym)
    args = symbols.tensor_args(bsym)
    if sid in symbols.MATMULS and len(args) >= 2:
        out = symbols.tensor_outputs(bsym)[0]
        k = symbols.shape(args[0])[-1]
        numel = 1
        for s in symbols.shape(out):
            numel *= s
        return 2.0 * numel * k, symbols.dtype_name(out)
    if sid in ATTENTION and len(args) >= 3:
        q, key = symbols.shape(args[0]), symbols.shape(args[1])
        *batch, tq, d = q
        tk = key[-2]
        heads = 1
        for s in batch:
            heads *= s
        causal = attention_options(bsym)[1]
        return 4.0 * heads * tq * tk * d * (0.5 if causal else 1.0), symbols.dtype_name(args[0])
    return 0.0, ""


def attention_options(bsym) -> tuple[float, bool]:
    """(dropout probability, causal) of one of Thunder's sdpa forwards."""
    dropout_at, causal_at = _ATTENTION_OPTIONS[symbols.sym_id(bsym)]
    dropout = bsym.kwargs.get("dropout_p", bsym.args[dropout_at] if len(bsym.args) > dropout_at else 0.0)
    causal = bsym.kwargs.get("is_causal", bsym.args[causal_at] if len(bsym.args) > causal_at else False)
    return float(dropout), bool(causal)


def op_traffic(bsym) -> int:
    """Bytes ``bsym`` reads and writes: nothing for views and reshapes, which launch no kernel; a fusion region's
    own inputs and outputs; every tensor argument and output otherwise."""
    if not symbols.is_fusion(bsym) and symbols.sym_id(bsym) in _NO_KERNEL:
        return 0
    return sum(symbols.nbytes(t) for t in (*symbols.tensor_args(bsym), *symbols.tensor_outputs(bsym)))


def traffic_equivalent(bsym, rates: DeviceRates = H200) -> int:
    """The bytes a memory-bound op that takes as long as ``bsym`` would read and write: its own traffic where its
    arithmetic is faster than its traffic (every op without matmuls or attention), its time at the device's bandwidth
    otherwise. The minimum cut prices a recomputation in these bytes."""
    flops, dtype = op_flops(bsym)
    traffic = op_traffic(bsym)
    return max(traffic, round(flops / rates.flops(dtype) * rates.bandwidth)) if flops else traffic


def op_seconds(bsym, rates: DeviceRates = H200) -> float:
    """The time ``bsym`` takes on a device of ``rates``, by the roofline (see the module's docstring)."""
    flops, dtype = op_flops(bsym)
    return max(flops / rates.flops(dtype) if flops else 0.0, op_traffic(bsym) / rates.bandwidth)
