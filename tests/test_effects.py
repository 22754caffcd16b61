"""effects.classify: what one bound symbol allocates, aliases and needs as workspace, against what torch itself does
with the same op on real tensors (a shared storage, a copy, the strides)."""

import thunder
import thunder.torch as ltorch
import torch

from thunder_fsdp_mem.analysis import effects, layout
from thunder_fsdp_mem.analysis.effects import Kind, classify
from thunder_fsdp_mem.analysis.symbols import shape


def _effects(fn, *args):
    """Each bound symbol of ``fn``'s trace with its effect, strides followed as ``liveness`` follows them."""
    trace = thunder.trace()(fn, *args)
    strides = {}
    out = []
    for b in trace.bound_symbols:
        for p in b.flat_proxy_outs:
            if b.sym.name == "unpack_trivial" and hasattr(p, "shape"):
                strides[p.name] = layout.contiguous_strides(shape(p))
        effect = classify(b, strides.__getitem__)
        for o in effect.outputs:
            strides[o.proxy.name] = o.strides
        out.append((b, effect))
    return out


def _by_name(effects, name):
    return next(e for b, e in effects if b.sym.name == name)


def test_the_tables_built_from_thunder_hold_the_names_they_replaced():
    # The literal names as they were before they were built from Thunder's objects (lightning-thunder 0.2.7).
    assert effects._SAME_STRIDES == {
        "shallow_copy",
        "detach",
        "alias",
        "update_aliases",
        "split",
        "split_with_sizes",
        "tensor_split",
        "hsplit",
        "vsplit",
        "chunk",
    }
    assert effects._EXPANDS == {"expand", "expand_as", "broadcast_to"}
    assert effects._TRANSPOSES == {"transpose", "swapaxes", "swapdims", "t", "mT", "adjoint"}
    assert effects._SQUEEZES == {"squeeze", "select", "unbind"} and effects._SELECTS == {"select", "unbind"}
    assert effects._SOFTMAXES == {"softmax", "log_softmax"}
    assert (effects._CONTIGUOUS, effects._TO, effects._LINEAR) == ("contiguous", "to", "linear")
    assert (effects._UNSQUEEZE, effects._PERMUTE) == ("unsqueeze", "permute")


def transposed_then_flat(x):
    t = ltorch.transpose(x, 0, 1)
    return ltorch.reshape(t, (32,)), ltorch.reshape(x, (32,))


def test_a_view_aliases_and_a_reshape_copies_only_where_torch_copies():
    x = torch.randn(4, 8)
    effects = _effects(transposed_then_flat, x)
    transpose = _by_name(effects, "transpose")
    assert transpose.kind is Kind.COMPUTE and transpose.outputs[0].base is not None
    assert transpose.outputs[0].strides == x.t().stride()
    first, second = [e for b, e in effects if b.sym.name == "reshape"]
    # torch: reshaping the transposed tensor copies it, reshaping the contiguous one is a view.
    assert x.t().reshape(32).untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert first.outputs[0].base is None
    assert x.reshape(32).untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert second.outputs[0].base is not None


def permuted_matmul(q, v):
    return ltorch.matmul(q, ltorch.permute(v, (0, 2, 3, 1)))


def test_matmul_workspace_is_the_operand_torch_copies():
    q, v = torch.randn(2, 4, 8, 16), torch.randn(2, 8, 4, 16)
    matmul = _by_name(_effects(permuted_matmul, q, v), "matmul")
    # torch folds (2, 4, 16, 8) to (8, 16, 8) for bmm: the permuted operand cannot be viewed so, it is copied.
    assert matmul.workspace == 2 * 8 * 4 * 16 * 4
    assert _by_name(_effects(lambda a, b: ltorch.matmul(a, b), q, torch.randn(2, 4, 16, 8)), "matmul").workspace == 0


def test_a_softmax_in_another_dtype_converts_its_input():
    # The execution trace's torch.softmax (the torch executor claims it whole) converts a bf16 input to float32
    # before it runs: a float32 copy of the input it does not return.
    jitted = thunder.jit(lambda t: torch.softmax(t, -1, dtype=torch.float32))
    jitted(torch.randn(4, 8, dtype=torch.bfloat16))
    softmax = next(b for b in thunder.last_traces(jitted)[-1].bound_symbols if b.sym.name == "softmax")
    effect = classify(softmax, lambda name: (8, 1))
    assert effect.workspace == 4 * 8 * 4 and effect.outputs[0].base is None


def test_del_return_and_unpack_are_not_compute():
    kinds = [e.kind for _, e in _effects(lambda t: ltorch.exp(t), torch.randn(3))]
    assert kinds == [Kind.UNPACK, Kind.COMPUTE, Kind.RETURN]


def _gelu_chain(x, w1, w2):
    h = x @ w1
    return torch.nn.functional.gelu(h) @ w2


def _two_readers(x, w1, w2, w3):
    h = x @ w1  # read by the gelu and by the second matmul: alive beside the gelu's output
    return (torch.nn.functional.gelu(h) @ w2) * torch.tanh(h @ w3)


def _read_through_a_chain(x, w1, w2, w3):
    h = x @ w1
    t = torch.tanh(h)  # h's last reader in the trace, but t has no buffer: the last matmul's operand computes it
    u = x @ w3  # again from h, so h is alive beside u (gemma-2's scores beside the gradient of its probabilities)
    return (t * u) @ w2


def test_a_fused_region_holds_its_matmuls_buffers_as_the_compiled_region_does():
    # One torch.compile region on the CPU (``fused``); its matmuls' results and computed operands are buffers that
    # it frees inside, which the region's outputs do not show. The estimate of the whole trace equals the live
    # bytes measured while the compiled region runs (without the workspace it would be 1 MiB and more under; with
    # h freed at its last reader in the trace, 1 MiB under for ``_read_through_a_chain``).
    from thunder_fsdp_mem.analysis.liveness import analyze
    from thunder_fsdp_mem.analysis.symbols import is_fusion
    from thunder_fsdp_mem.predict.cpu_memory import CPUMemory
    from thunder_fsdp_mem.training import runtime

    torch.manual_seed(0)
    m, k, n, p = 512, 64, 1024, 32
    x, w1 = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    w2, w3 = torch.randn(n, p, dtype=torch.bfloat16), torch.randn(n, p, dtype=torch.bfloat16)
    w4 = torch.randn(k, n, dtype=torch.bfloat16)
    cases = ((_gelu_chain, (x, w1, w2)), (_two_readers, (x, w1, w2, w3)), (_read_through_a_chain, (x, w1, w2, w4)))
    for fn, args in cases:
        jitted = thunder.jit(fn, executors=runtime.executors("fused"))
        jitted(*args)
        trace = thunder.last_traces(jitted)[-1]
        region = next(b for b in trace.bound_symbols if is_fusion(b))
        shapes = {a.name: shape(a) for a in region.flat_proxy_args if hasattr(a, "shape")}
        effect = classify(region, lambda name: layout.contiguous_strides(shapes[name]))
        assert effect.workspace >= m * n * 2  # at least the gelu's bf16 output, an operand of the second matmul
        with CPUMemory(*args) as memory:
            out = jitted(*args)
            del out
        assert analyze(trace).peak_bytes == memory.peak_bytes, fn.__name__
