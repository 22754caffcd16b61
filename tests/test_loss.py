"""The chunked linear cross-entropy (``loss.operator``, ``loss.rewrite``, ``loss.modules``, ``passes.chunks``,
``analysis.chunked_loss``): loss and every gradient against eager PyTorch on litgpt families with a soft-capped head,
a biased head, tied weights and ignored tokens, in several uneven chunks; the trace holds no logits; what it leaves
alone; the workspace the estimator counts against what the allocator sees; the chunk count the pass chooses.

Tolerances (``docs/accuracy.md``): float32, against eager PyTorch, every gradient within 1e-5 of its largest
magnitude and the loss within 1e-6 relative; bf16, against Thunder's unchunked step, within 2^-6 of the largest
magnitude (the gradient of the logits is rounded to bf16 once, where the unchunked loss rounds each op of the loss
and the soft-cap) and the loss within 2^-8 relative.
"""

import dataclasses

import pytest
import thunder
import torch
import torch.nn.functional as F
from thunder.core.transform_common import Transform

from configs import BY_NAME, SOFTCAP_TIED
from support import memtracker_peak, torchrun
from thunder_fsdp_mem import FSDPMemoryTransform, LossModel, MemoryConfig, estimate_step
from thunder_fsdp_mem.analysis import chunked_loss
from thunder_fsdp_mem.analysis.step import estimate_traces
from thunder_fsdp_mem.analysis.symbols import sym_id
from thunder_fsdp_mem.loss import operator
from thunder_fsdp_mem.loss.rewrite import rewrite_losses
from thunder_fsdp_mem.passes import chunks as chunks_pass
from thunder_fsdp_mem.predict.cpu_memory import CPUMemory
from thunder_fsdp_mem.training import litgpt_models

TINY = (("n_embd", 64), ("n_head", 2), ("head_size", 32), ("intermediate_size", 128))
SPECS = {
    "softcap-tied": SOFTCAP_TIED,  # gemma-2: soft-capped logits, tied embedding and head
    "biased-head": litgpt_models.ModelSpec(
        name="phi-2", n_layers=1, block_size=128, overrides=TINY + (("padded_vocab_size", 512), ("vocab_size", 512))
    ),
    "llama": dataclasses.replace(BY_NAME["llama"], n_layers=1),
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-6}


class _Chunked(Transform):
    """The rewrite alone, with a chosen chunk count (no other pass, no estimator)."""

    def __init__(self, chunks: int):
        self.chunks = chunks
        self.found = ()
        self.left = ()

    def transform_traces_pre_prologue(self, prologue, computation, epilogue, **kwargs):
        computation, self.found, self.left = rewrite_losses(computation, chunks=self.chunks)
        return prologue, computation, epilogue


def _targets(spec, batch: int = 2):
    g = torch.Generator().manual_seed(1)
    cfg = spec.config()
    idx = torch.randint(0, cfg.vocab_size, (batch, spec.block_size), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch, spec.block_size), generator=g)
    targets[0, :37] = -100  # ignored tokens: the mean is over the others
    return idx, targets


def _step(model, idx, targets):
    loss = model(idx, targets)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads


def _eager_then_chunked(loss_of, h, w, t):
    """``loss_of(h, w, t)`` eagerly (its loss and the gradients of ``h`` and ``w``: the reference), then jitted with
    the rewrite alone in 3 chunks and run forward and backward (``h.grad`` and ``w.grad`` then hold its gradients);
    returns (reference, the jitted loss, the transform, the jitted function)."""
    eager = loss_of(h, w, t)
    eager.backward()
    reference = (eager.detach(), {"h": h.grad, "w": w.grad})
    h.grad = w.grad = None
    jitted = thunder.jit(loss_of, transforms=[transform := _Chunked(3)])
    loss = jitted(h, w, t)
    loss.backward()
    return reference, loss, transform, jitted


def _assert_close(reference, candidate, dtype):
    (loss, grads), (loss_c, grads_c) = reference, candidate
    assert abs(loss.float().item() - loss_c.float().item()) <= max(1e-6, TOLERANCE[dtype] / 4) * abs(loss.item())
    assert grads.keys() == grads_c.keys()
    for name, g in grads.items():
        scale = g.float().abs().max().item()
        diff = (g.float() - grads_c[name].float()).abs().max().item()
        assert diff <= TOLERANCE[dtype] * scale, (name, diff, scale)


@pytest.mark.parametrize("family", sorted(SPECS))
def test_loss_and_every_gradient_in_uneven_chunks_match_eager(family):
    spec = SPECS[family]
    idx, targets = _targets(spec)
    for dtype in (torch.float32, torch.bfloat16):
        # bf16: against Thunder's unchunked step, which already rounds unlike eager in the rest of the model
        model = litgpt_models.build(spec, dtype=dtype)
        reference = _step(model if dtype == torch.float32 else thunder.jit(model), idx, targets)
        transform = _Chunked(3)  # 256 rows in chunks of 86, 86 and 84
        jitted = thunder.jit(litgpt_models.build(spec, dtype=dtype), transforms=[transform])
        chunked = _step(jitted, idx, targets)
        _assert_close(reference, chunked, dtype)
        assert len(transform.found) == 1 and transform.found[0].chunks == 3
        cfg = spec.config()
        assert transform.found[0].softcap == cfg.final_logit_softcapping
        assert transform.found[0].bias is cfg.lm_head_bias
        forward = thunder.last_traces(jitted)[-1]
        names = [sym_id(b) for b in forward.bound_symbols]
        assert chunked_loss.FORWARD_WITH_GRADS in names and "cross_entropy" not in names
        vocab = cfg.padded_vocab_size
        logits_sized = [o for b in forward.bound_symbols for o in b.flat_proxy_outs if vocab in getattr(o, "shape", ())]
        assert all(len(o.shape) == 1 or o.shape == (vocab, cfg.n_embd) for o in logits_sized), logits_sized


def test_the_default_transform_chunks_the_loss_within_tolerance():
    spec = SPECS["softcap-tied"]
    idx, targets = _targets(spec)
    eager = _step(litgpt_models.build(spec, dtype=torch.float32), idx, targets)
    transform = FSDPMemoryTransform(strict=True)
    chunked = _step(thunder.jit(litgpt_models.build(spec, dtype=torch.float32), transforms=[transform]), idx, targets)
    _assert_close(eager, chunked, torch.float32)
    assert [r.pass_name for r in transform.rewrites][:1] == ["chunked loss"]
    assert "f32 logits (256, 512)" in transform.summary() and "soft-capped at 30" in transform.summary()
    assert transform.summary().splitlines()[1].startswith("pair 0: chunked loss: f32 logits (256, 512)")
    assert "folded casts" not in transform.summary() and "folded casts" in transform.summary(details=True)


def test_a_cotangent_other_than_one_scales_every_gradient_once():
    # ``(loss * c).backward()``: the backward multiplies the forward's gradients by c once (the weight's and the
    # bias's in place, ``loss.scale``), as eager PyTorch's gradients of c * loss are.
    g = torch.Generator().manual_seed(3)
    h = torch.randn(6, 40, 8, generator=g, requires_grad=True)
    w = torch.randn(50, 8, generator=g).requires_grad_()
    b = torch.randn(50, generator=g).requires_grad_()
    t = torch.randint(0, 50, (6, 40), generator=g)

    def loss_of(h, w, b, t):
        return F.cross_entropy(F.linear(h, w, b).reshape(-1, 50), t.reshape(-1))

    (loss_of(h, w, b, t) * 0.37).backward()
    reference = {"h": h.grad, "w": w.grad, "b": b.grad}
    h.grad = w.grad = b.grad = None
    jitted = thunder.jit(loss_of, transforms=[transform := _Chunked(3)])
    (jitted(h, w, b, t) * 0.37).backward()
    assert len(transform.found) == 1
    backward = thunder.last_backward_traces(jitted)[-1]
    assert [sym_id(s) for s in backward.bound_symbols].count(chunked_loss.SCALE) == 2  # the weight's, the bias's
    for name, got in (("h", h.grad), ("w", w.grad), ("b", b.grad)):
        largest = reference[name].abs().max().item()
        assert (got - reference[name]).abs().max().item() <= TOLERANCE[torch.float32] * largest, name


def test_every_token_ignored_gives_torchs_nan_and_finite_gradients():
    spec = SPECS["llama"]
    idx, _ = _targets(spec)
    targets = torch.full_like(idx, -100)
    eager_loss, _ = _step(litgpt_models.build(spec, dtype=torch.float32), idx, targets)
    loss, grads = _step(
        thunder.jit(litgpt_models.build(spec, dtype=torch.float32), transforms=[_Chunked(2)]), idx, targets
    )
    assert torch.isnan(eager_loss) and torch.isnan(loss)
    assert all(torch.isfinite(g).all() for g in grads.values())


def _losses_in(fn, *args):
    jitted = thunder.jit(fn, transforms=[transform := _Chunked(2)])
    jitted(*args)
    return transform.found


def test_losses_it_cannot_chunk_are_left_alone():
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(16, 8, requires_grad=True)
    t = torch.randint(0, 16, (4,))
    ce = torch.nn.functional.cross_entropy
    linear = torch.nn.functional.linear
    assert len(_losses_in(lambda h, w, t: ce(linear(h, w), t), h, w, t)) == 1
    assert _losses_in(lambda h, w, t: (ce(logits := linear(h, w), t), logits), h, w, t) == ()  # logits returned
    assert _losses_in(lambda h, w, t: ce(linear(h, w), t, label_smoothing=0.1), h, w, t) == ()
    assert _losses_in(lambda h, w, t: ce(linear(h, w), t, reduction="none"), h, w, t) == ()
    assert _losses_in(lambda h, w, t: ce(linear(h, w), t, weight=torch.ones(16)), h, w, t) == ()
    assert _losses_in(lambda h, w, t: ce(linear(h, w) * 2.0, t), h, w, t) == ()  # not a soft-cap
    assert _losses_in(lambda h, w, t: ce(linear(h, w).exp(), t), h, w, t) == ()
    assert len(_losses_in(lambda h, w, t: ce(linear(h, w), t, reduction="sum"), h, w, t)) == 1


def _left_in(fn, *args) -> str:
    jitted = thunder.jit(fn, transforms=[transform := _Chunked(2)])
    jitted(*args)
    assert transform.found == () and len(transform.left) == 1, (transform.found, transform.left)
    return transform.left[0].describe()


def test_each_loss_left_alone_says_why_and_what_to_change():
    h = torch.randn(2, 4, 8, requires_grad=True)
    w = torch.randn(16, 8, requires_grad=True)
    t = torch.randint(0, 16, (2, 4))
    ce, linear = F.cross_entropy, F.linear
    shifted = _left_in(lambda h, w, t: ce(linear(h, w)[:, :-1].reshape(-1, 16), t[:, 1:].reshape(-1)), h, w, t)
    assert "the logits pass through getitem" in shifted and "slice the hidden states" in shifted
    returned = _left_in(lambda h, w, t: (ce((z := linear(h, w)).reshape(-1, 16), t.reshape(-1)), z), h, w, t)
    assert "returns the logits too" in returned and "return the loss alone" in returned
    unreduced = _left_in(lambda h, w, t: ce(linear(h, w).reshape(-1, 16), t.reshape(-1), reduction="none"), h, w, t)
    assert "reduction='none'" in unreduced and "chunk_size=0" in unreduced
    outside = _left_in(lambda logits, t: ce(logits.reshape(-1, 16), t.reshape(-1)), linear(h, w).detach(), t)
    assert "head is outside" in outside and "LossModel" in outside
    probabilities = _left_in(
        lambda h, w, t: ce(linear(h, w).reshape(-1, 16), F.one_hot(t, 16).reshape(-1, 16).float()), h, w, t
    )
    assert "one class index per row" in probabilities  # class probabilities as targets


class _UserLoss(torch.nn.Module):
    """A litgpt GPT and a loss of the user's, ``loss(gpt, idx, targets)``, as a training script holds them."""

    def __init__(self, gpt, loss):
        super().__init__()
        self.gpt, self.loss = gpt, loss

    def forward(self, idx, targets):
        return self.loss(self.gpt, idx, targets)


def test_the_summary_says_which_loss_it_left_and_why():
    # litgpt's finetuning shifts the logits (logits[..., :-1, :]): the transform keeps that loss and says so.
    spec = SPECS["llama"]
    idx, targets = _targets(spec)

    def shifted(gpt, idx, targets):
        logits = gpt(idx)[..., :-1, :]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets[..., 1:].reshape(-1))

    transform = FSDPMemoryTransform()
    model = _UserLoss(litgpt_models.build(spec, dtype=torch.float32).gpt, shifted)
    _step(thunder.jit(model, transforms=[transform]), idx, targets)
    summary = transform.summary()
    assert "chunked loss: left as it was: cross_entropy not chunked: the logits pass through getitem" in summary
    assert "(to have it chunked: apply it to the head's input instead" in summary


USER_FORMS = {  # the head's logits (B, T, V) to F.cross_entropy as users write it
    "reshape": lambda logits, t: F.cross_entropy(logits.reshape(-1, logits.size(-1)), t.reshape(-1)),
    "view": lambda logits, t: F.cross_entropy(logits.view(-1, logits.size(-1)), t.view(-1)),
    "flatten": lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()),
    ".float()": lambda logits, t: F.cross_entropy(logits.float().view(-1, logits.size(-1)), t.view(-1)),
    ".to(float32)": lambda logits, t: F.cross_entropy(
        logits.to(torch.float32).reshape(-1, logits.size(-1)), t.view(-1)
    ),
    "transpose(1, 2)": lambda logits, t: F.cross_entropy(logits.transpose(1, 2), t),  # classes second
    "nn.CrossEntropyLoss": lambda logits, t: _CRITERION(logits.view(-1, logits.size(-1)), t.view(-1)),
}
_CRITERION = torch.nn.CrossEntropyLoss()  # held by the training code, as a module


@pytest.mark.parametrize("form", sorted(USER_FORMS))
def test_the_losses_users_write_are_chunked_and_match_eager(form):
    # bf16 head, as trained; the loss against eager PyTorch's on the same bf16 head within the bf16 tolerance.
    torch.manual_seed(0)
    h = torch.randn(2, 96, 32, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(200, 32) / 6).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, 200, (2, 96))
    t[0, :5] = -100

    def loss_of(h, w, t):
        return USER_FORMS[form](F.linear(h, w), t)

    reference, chunked, transform, _ = _eager_then_chunked(loss_of, h, w, t)
    eager = reference[0]
    assert len(transform.found) == 1 and transform.found[0].chunks == 3
    # The loss is a bf16 scalar: within one bf16 step (2^-7 relative) of eager's; the gradients as elsewhere.
    assert abs(chunked.float().item() - eager.float().item()) <= 2**-7 * abs(eager.float().item())
    for name, g in {"h": h.grad, "w": w.grad}.items():
        expected = reference[1][name].float()
        assert (g.float() - expected).abs().max() <= TOLERANCE[torch.bfloat16] * expected.abs().max(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
def test_the_workspace_counted_is_what_the_allocator_sees(dtype, softcap):
    rows, hidden, vocab, chunks = 512, 64, 4096, 2
    h = torch.randn(rows, hidden, dtype=dtype)
    w = torch.randn(vocab, hidden, dtype=dtype)
    t = torch.randint(0, vocab, (rows,))
    with CPUMemory(h, w, t) as memory:
        out = operator.run_chunks(h, w, None, t, -100, softcap, "mean", chunks, dtype, grads=True)
    outputs = sum(o.nbytes for o in out)
    measured = memory.peak_bytes - memory.baseline_bytes - outputs
    counted = chunked_loss.workspace_bytes(
        rows, vocab, chunks, weight_bytes=dtype.itemsize, softcap=softcap is not None, device_type="cpu"
    )
    # hand-computed: 256 x 4096 cells of float32 (and the 16-bit logits or the soft-cap's derivative beside them)
    cells = 256 * 4096
    assert (
        counted == cells * {(4, False): 4, (4, True): 8, (2, False): 6, (2, True): 8}[(dtype.itemsize, bool(softcap))]
    )
    assert counted <= measured <= counted * 1.01, (measured, counted)


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
def test_the_compiled_chunk_writes_its_gradient_over_its_logits(softcap):
    # What CUDA runs (``_chunk_grad_in_place`` under torch.compile), compiled here by Inductor for CPU: the loss and
    # the gradient of the eager CPU path, and no buffer of the chunk's size beside the logits it overwrites.
    rows, hidden, vocab = 256, 64, 4096
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, generator=g) / 8).bfloat16()
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[:7] = -100
    scale = torch.tensor(1 / (rows - 7))
    eager_loss, eager_grad = operator._chunk_math(h, w, None, t, -100, softcap, scale)
    z = h @ w.t()
    picked = z.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
    compiled = operator._compiled_grad_in_place()
    compiled(z.clone(), picked, t, -100, softcap, scale)  # compiled outside the measurement
    with CPUMemory(z, picked, t, scale) as memory:
        loss = compiled(z, picked, t, -100, softcap, scale)
    assert memory.peak_bytes - memory.baseline_bytes < rows * vocab // 64
    assert abs(loss.item() - eager_loss.item()) <= 1e-6 * abs(eager_loss.item())
    assert (z.float() - eager_grad.float()).abs().max() <= 2**-8 * eager_grad.float().abs().max()


def test_the_compiled_chunks_give_the_eager_chunks_loss_and_gradients():
    # run_chunks as CUDA runs it (one logits buffer, the compiled kernel), here on CPU: uneven chunks (the last one
    # shorter), a bias, a soft-cap, ignored tokens; against the eager CPU path.
    g = torch.Generator().manual_seed(1)
    h = torch.randn(333, 64, generator=g).bfloat16()
    w = (torch.randn(2048, 64, generator=g) / 8).bfloat16()
    b = (torch.randn(2048, generator=g) / 8).bfloat16()
    t = torch.randint(0, 2048, (333,), generator=g)
    t[5:40] = -100
    args = (h, w, b, t, -100, 30.0, "mean", 3, torch.float32)
    eager = operator.run_chunks(*args, grads=True, compiled=False)
    compiled = operator.run_chunks(*args, grads=True, compiled=True)
    assert abs(compiled[0].item() - eager[0].item()) <= 1e-6 * abs(eager[0].item())
    for got, want in zip(compiled[1:], eager[1:]):
        assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()


def test_row_chunks_and_candidates():
    assert chunked_loss.row_chunks(10, 3) == [(0, 4), (4, 8), (8, 10)]
    assert chunked_loss.row_chunks(2, 5) == [(0, 1), (1, 2)]
    assert chunked_loss.candidate_chunks(255) == [1]
    assert chunked_loss.candidate_chunks(8192) == [1, 2, 4, 8, 16, 32]


@pytest.fixture(scope="module")
def long_step():
    neox = BY_NAME["neox"]  # with a vocabulary whose logits outweigh the rest of the step
    spec = dataclasses.replace(
        neox, n_layers=1, block_size=1024, overrides=neox.overrides + (("padded_vocab_size", 16384),)
    )
    model = litgpt_models.build(spec, dtype=torch.float32)
    idx, targets = litgpt_models.batch(spec)
    transform = FSDPMemoryTransform()
    jitted = thunder.jit(model, transforms=[transform])
    return jitted, transform, idx, targets


def test_the_chunk_count_is_the_fewest_that_keeps_the_estimated_peak(long_step):
    jitted, transform, idx, targets = long_step
    jitted(idx, targets)
    forward, backward = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
    (loss,) = [b for b in forward.bound_symbols if sym_id(b) == chunked_loss.FORWARD_WITH_GRADS]
    chosen = loss.args[chunked_loss.CHUNKS_ARG]
    candidates = chunked_loss.candidate_chunks(1024)
    assert candidates == [1, 2, 4]
    peaks = {c: estimate_traces(chunks_pass.with_chunks(forward, c), backward).peak_bytes for c in candidates}
    assert peaks[1] > peaks[4]  # at 1024 rows the loss's logits set the peak: chunking lowers it
    assert chosen == min(c for c in candidates if peaks[c] <= peaks[candidates[-1]]), (chosen, peaks)
    assert [r.note for r in transform.rewrites if r.pass_name == "loss chunks"][0].startswith(f"{chosen} chunk(s)")


def test_the_estimate_of_the_chunked_step_is_what_memtracker_measures(long_step):
    jitted, _, idx, targets = long_step
    for p in jitted.parameters():
        p.grad = None
    measured = memtracker_peak(jitted, idx, targets, tracked=(jitted,))
    estimated = estimate_step(jitted, loss=None).peak_bytes
    assert abs(estimated - measured) <= 0.01 * measured, (estimated, measured)


def test_loss_model_is_the_model_and_its_loss():
    spec = SPECS["softcap-tied"]
    idx, targets = _targets(spec)
    model = litgpt_models.build(spec, dtype=torch.float32)
    assert isinstance(model, LossModel)
    logits = model.gpt(idx)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    assert torch.equal(model(idx, targets), expected)
    assert MemoryConfig().chunk_loss and not MemoryConfig(chunk_loss=False).chunk_loss


@pytest.mark.slow
def test_under_thunders_fsdp_and_fsdp2_the_chunked_loss_matches_thunders_on_every_shard():
    # The head's weight gathered by Thunder's fsdp (ZeRO2, ZeRO3) and by FSDP2 (the root unit's), tied to the
    # embedding, soft-capped logits, ignored tokens; float32 against Thunder's own loss in the same sharding.
    results = torchrun("loss_worker.py")
    assert {(r["mode"], r["shard"], r["rank"]) for r in results} == {
        (m, s, k)
        for m, s in (("thunder-fsdp", "zero2"), ("thunder-fsdp", "zero3"), ("fsdp2-thunder", "zero2"))
        for k in (0, 1)
    }
    for r in results:
        assert r["chunked"] and r["n_grads"] == r["n_grads_mem"] > 0, r
        assert abs(r["loss"] - r["loss_mem"]) <= 1e-6 * abs(r["loss"]), r
        assert r["largest_error"] <= TOLERANCE[torch.float32], r


def test_a_loss_the_rewrite_does_not_understand_is_left_as_it_was(monkeypatch):
    def broken(trace):
        raise ValueError("a form never seen")

    monkeypatch.setattr("thunder_fsdp_mem.transform.rewrite_losses", broken)
    spec = SPECS["llama"]
    idx, targets = _targets(spec)
    eager = _step(litgpt_models.build(spec, dtype=torch.float32), idx, targets)
    with pytest.warns(UserWarning, match="pass 'chunked loss' refused.*a form never seen"):
        plain = _step(
            thunder.jit(litgpt_models.build(spec, dtype=torch.float32), transforms=[FSDPMemoryTransform()]),
            idx,
            targets,
        )
    _assert_close(eager, plain, torch.float32)
    with pytest.raises(RuntimeError, match="a form never seen"):
        strict = thunder.jit(
            litgpt_models.build(spec, dtype=torch.float32), transforms=[FSDPMemoryTransform(strict=True)]
        )
        strict(idx, targets)


@pytest.mark.parametrize("chunk_size", [0, 128], ids=["chunk_size=0", "default"])
def test_litgpts_chunked_cross_entropy_is_chunked_and_matches_eager(chunk_size):
    # What litgpt's pretrain and finetune call: chunk_size=128 splits the rows, takes each chunk's unreduced loss,
    # and divides their sum by the rows that count. The sum becomes the chunked operator's; litgpt's division stays.
    from litgpt.utils import chunked_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(2, 150, 32, requires_grad=True)
    w = (torch.randn(200, 32) / 6).requires_grad_(True)
    t = torch.randint(0, 200, (2, 150))
    t[0, :40] = -100

    def loss_of(h, w, t):
        return chunked_cross_entropy(F.linear(h, w), t, chunk_size=chunk_size)

    reference, loss, transform, jitted = _eager_then_chunked(loss_of, h, w, t)
    assert len(transform.found) == 1 and transform.left == ()
    _assert_close(reference, (loss.detach(), {"h": h.grad, "w": w.grad}), torch.float32)
    forward = thunder.last_traces(jitted)[-1]
    assert not any(b.sym.name == "cross_entropy" for b in forward.bound_symbols)


@pytest.mark.parametrize("chunk_size", [0, 128], ids=["chunk_size=0", "default"])
def test_a_head_run_in_chunks_is_said_with_the_option_that_lets_it_be_chunked(chunk_size):
    # litgpt's finetuning calls the model with lm_head_chunk_size=128: a list of logits, concatenated (chunk_size=0)
    # or each chunk's loss apart; the transform keeps it and names the option.
    from litgpt.utils import chunked_cross_entropy

    spec = SPECS["llama"]
    idx, targets = _targets(spec)

    def chunked_head(gpt, idx, targets):
        return chunked_cross_entropy(gpt(idx, lm_head_chunk_size=64), targets, chunk_size=chunk_size)

    transform = FSDPMemoryTransform()
    model = _UserLoss(litgpt_models.build(spec, dtype=torch.float32).gpt, chunked_head)
    _step(thunder.jit(model, transforms=[transform]), idx, targets)
    assert "the head runs in chunks" in transform.summary() and "lm_head_chunk_size=0" in transform.summary()


def test_a_loss_computed_after_the_compiled_model_is_said_with_what_its_logits_hold():
    # Thunder's own benchmark script compiles the model alone and computes the loss eagerly after it.
    spec = SPECS["biased-head"]  # a vocabulary 8 times the width, as heads are (49152 for 2560 in stablecode-3b)
    idx, targets = _targets(spec)
    transform = FSDPMemoryTransform()
    gpt = thunder.jit(litgpt_models.build(spec, dtype=torch.float32).gpt, transforms=[transform])
    logits = gpt(idx)
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).backward()
    rows, vocab = idx.numel(), logits.size(-1)
    assert f"returns its head's logits, (2, {spec.block_size}, {vocab}) f32" in transform.summary()
    assert f"({rows * vocab * 4 / 2**10:.2f} KiB): the loss is computed after it" in transform.summary()
    assert "LossModel" in transform.summary()
