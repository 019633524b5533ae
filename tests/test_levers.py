"""Speed levers: the chunked cross-entropy, the one-pass q/k/v gradient, and that every variant
of the benchmark's step computes the eager step's loss and gradients (CPU; compile through
torch.compile's aot_eager backend, which traces as inductor does without generating code)."""

import os

import pytest
import torch
import torch.nn.functional as F

from stabilitylab.attention import compiled_lengths_hint
from stabilitylab.chunked_loss import labelled_rows, linear_cross_entropy_sum, rows_per_chunk
from stabilitylab.config import ModelConfig
from stabilitylab.model import Transformer, masked_lm_loss_sum, split_qkv_heads
from stabilitylab.presets import smoke
from stabilitylab.train.levers import (
    ACCUM_MICRO_BATCHES,
    ALTERNATIVES,
    COMPILED,
    DETERMINISTIC,
    DETERMINISTIC_VARIANTS,
    HEAD_ROW_MULTIPLE,
    LEVERS,
    VARIANTS,
    build_rig,
    cli_variants,
    deterministic_backend,
    micro_batch_factor,
    parse_variants,
    prepare_variants,
    synthetic_batch,
    variant_levers,
)


def _head_inputs(dtype, bias=True, seed=0, B=3, T=11, C=16, V=37, p_label=0.4):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, C, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, C, generator=g, dtype=dtype) * 0.3).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    labels = torch.randint(0, V, (B, T), generator=g)
    labels = torch.where(torch.rand(B, T, generator=g) < p_label, labels, -100)
    return h, w, b, labels


def _loss_and_grads(fn, h, w, b, scale=0.37):
    loss = fn()
    params = [t for t in (h, w, b) if t is not None]
    return loss.detach(), torch.autograd.grad(loss * scale, params)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, 10**9])  # one row per chunk, several, all at once
def test_chunked_ce_equals_masked_lm_loss_sum(bias, chunk):
    h, w, b, labels = _head_inputs(torch.float64, bias)
    V = w.shape[0]
    ref = _loss_and_grads(lambda: masked_lm_loss_sum(F.linear(h, w, b), labels), h, w, b)
    got = _loss_and_grads(
        lambda: linear_cross_entropy_sum(h, w, b, labels, max_chunk_elements=chunk * V), h, w, b
    )
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    for g_got, g_ref in zip(got[1], ref[1], strict=True):
        torch.testing.assert_close(g_got, g_ref, rtol=1e-5, atol=1e-7)  # ref: fp32 CE


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, 10**9])
def test_chunked_ce_on_padded_rows_is_the_same_loss_and_gradients(bias, chunk):
    """row_multiple pads the weight's rows for the GEMMs only; the loss and the gradients of h,
    W (V rows) and b are those without padding (the pad takes probability 0), to the float32 of
    the loss's softmax (its sums run over V + pad columns, in another order)."""
    h, w, b, labels = _head_inputs(torch.float64, bias)
    V = w.shape[0]
    ref = _loss_and_grads(
        lambda: linear_cross_entropy_sum(h, w, b, labels, max_chunk_elements=chunk * V), h, w, b
    )
    got = _loss_and_grads(
        lambda: linear_cross_entropy_sum(
            h, w, b, labels, max_chunk_elements=chunk * 64, row_multiple=64
        ),
        h,
        w,
        b,
    )
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    for g_got, g_ref in zip(got[1], ref[1], strict=True):
        assert g_got.shape == g_ref.shape
        torch.testing.assert_close(g_got, g_ref, rtol=1e-5, atol=1e-7)


def test_chunked_ce_under_bf16_autocast_matches_eager_to_rounding():
    """As the step runs it: float32 h (the final LayerNorm's output) and weights, bf16 autocast."""
    h, w, b, labels = _head_inputs(torch.float32, T=64, C=32, V=101)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _loss_and_grads(lambda: masked_lm_loss_sum(F.linear(h, w, b), labels), h, w, b)
        got = _loss_and_grads(lambda: linear_cross_entropy_sum(h, w, b, labels), h, w, b)
    torch.testing.assert_close(got[0], ref[0], rtol=2e-3, atol=1e-3)
    for g_got, g_ref in zip(got[1], ref[1], strict=True):
        assert g_got.dtype == torch.float32
        assert (g_got - g_ref).norm() <= 2e-2 * g_ref.norm()


def test_chunked_ce_without_labels_is_zero_with_zero_gradients():
    h, w, b, labels = _head_inputs(torch.float32, p_label=0.0)
    loss, grads = _loss_and_grads(lambda: linear_cross_entropy_sum(h, w, b, labels), h, w, b)
    assert loss.item() == 0.0 and all((g == 0).all() for g in grads)


def test_chunked_ce_names_bad_shapes():
    h, w, b, labels = _head_inputs(torch.float32)
    with pytest.raises(ValueError, match="labels_BT"):
        linear_cross_entropy_sum(h, w, b, labels[:, :-1])
    with pytest.raises(ValueError, match="weight_VC"):
        linear_cross_entropy_sum(h, w[:, :-1], b, labels)
    with pytest.raises(ValueError, match="max_chunk_elements"):
        rows_per_chunk(10, 0)


def test_chunked_ce_with_the_hosts_count_selects_the_same_rows_without_a_sync(monkeypatch):
    """n_labelled (the count a batch makes on the host): the same rows in the same order, so the
    same loss and gradients bit for bit, and no nonzero (the op that waits for the device)."""
    h, w, b, labels = _head_inputs(torch.float64, T=40)
    n = int((labels != -100).sum())
    assert torch.equal(labelled_rows(labels.flatten(), n), labelled_rows(labels.flatten()))
    ref = _loss_and_grads(lambda: linear_cross_entropy_sum(h, w, b, labels), h, w, b)
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda *_a, **_k: pytest.fail("nonzero called"))
    got = _loss_and_grads(lambda: linear_cross_entropy_sum(h, w, b, labels, n_labelled=n), h, w, b)
    assert torch.equal(got[0], ref[0])
    for g_got, g_ref in zip(got[1], ref[1], strict=True):
        assert torch.equal(g_got, g_ref)
    assert labelled_rows(torch.full((5,), -100), 0).numel() == 0
    with pytest.raises(ValueError, match="n_labelled must lie in"):
        labelled_rows(labels.flatten(), labels.numel() + 1)
    with pytest.raises(TypeError, match="n_labelled"):
        labelled_rows(labels.flatten(), torch.tensor(n))


def test_one_pass_qkv_grad_equals_autograds_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 7, 3 * 4 * 8, generator=g, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(2, 4, 7, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    results = []
    for one_pass in (False, True):
        q, k, v = split_qkv_heads(qkv, 4, one_pass)
        assert q.shape == (2, 4, 7, 8)
        loss = sum((t * wt).sum() for t, wt in zip((q, k, v), weights, strict=True))
        results.append(((q, k, v), torch.autograd.grad(loss, qkv)[0]))
    (vals0, g0), (vals1, g1) = results
    for a, b in zip(vals0, vals1, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(g0, g1)
    # An unused output (no gradient) is a zero block.
    q, _, v = split_qkv_heads(qkv, 4, True)
    grad = torch.autograd.grad((q * weights[0]).sum() + (v * weights[2]).sum(), qkv)[0]
    assert (grad.view(2, 7, 3, 32)[:, :, 1] == 0).all()


def test_variants_parse_and_name_unknowns():
    assert parse_variants(["eager", "all", "eager"]) == ["eager", "all"]
    assert variant_levers("all") == frozenset(LEVERS) and "pad-vocab" in LEVERS
    assert variant_levers("mb2") == frozenset({"mb2"})
    assert micro_batch_factor(variant_levers("all")) == 8
    assert micro_batch_factor(variant_levers("compile+mb2")) == 2
    assert micro_batch_factor(variant_levers("all+mb4")) == 8  # the largest wins
    assert micro_batch_factor(variant_levers("mb2+mb4")) == 4
    assert micro_batch_factor(variant_levers("coord")) == 1
    assert set(VARIANTS) == {"eager", "all", *LEVERS, *ALTERNATIVES, *DETERMINISTIC_VARIANTS}
    assert not variant_levers("all") & {*ALTERNATIVES, DETERMINISTIC}
    assert variant_levers("det") == {DETERMINISTIC}
    assert variant_levers("det-all") == {*LEVERS, DETERMINISTIC}
    with pytest.raises(ValueError, match="'fast'"):
        parse_variants(["eager", "fast"])


def test_the_benchmarks_refuse_unknown_variants_and_a_machine_without_cuda(monkeypatch):
    with pytest.raises(SystemExit, match="error: --variants: unknown variant 'fast'"):
        cli_variants(["eager", "fast"], "bench_x.py")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="error: bench_x.py needs a CUDA GPU"):
        cli_variants(["eager", "all"], "bench_x.py")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli_variants(["all", "eager", "all"], "bench_x.py") == ["all", "eager"]


def test_preparing_a_deterministic_variant_sets_the_cublas_workspace(monkeypatch):
    """The benchmarks' start: the cuBLAS workspace only when a deterministic variant is asked for
    (as train.deterministic sets it), unknown names refused before it."""
    from stabilitylab.determinism import CUBLAS_WORKSPACE

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert prepare_variants(["eager", "all"]) == ["eager", "all"]
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with pytest.raises(ValueError, match="'fast'"):
        prepare_variants(["det", "fast"])
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert prepare_variants(["eager", "det-all"]) == ["eager", "det-all"]
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE


def test_a_larger_synthetic_batch_extends_a_smaller_one():
    one = synthetic_batch(1, 50, 99, "cpu")
    two = synthetic_batch(2, 50, 99, "cpu")
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a[0], b[0])
    assert not torch.equal(two[0][0], two[0][1])


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("arm", ["softmax", "sigmoid-reference"])
def test_every_variant_computes_the_eager_step(arm):
    """Loss and gradients of the first step of each variant equal eager's on the same batch: a
    variant of mbN (``all`` has mb8) against eager at a micro-batch of N sequences, whose batch
    it must be; compile traces the whole model (fullgraph). Then ``all`` (every lever, the
    accumulation over ACCUM_MICRO_BATCHES micro-batches included) and eager at mb8 take an
    optimizer step: the same loss, the same weights after it, the same loss on them."""
    cfg = smoke()
    rigs = {v: build_rig(cfg, arm, v, "cpu", compile_backend="aot_eager") for v in VARIANTS}
    refs = {}  # N -> (eager at a micro-batch of N, its loss, its gradients)
    for variant, rig in rigs.items():
        n = micro_batch_factor(rig.levers)
        if n not in refs:
            ref = build_rig(cfg, arm, "eager", "cpu", micro_batch=n)
            ref_loss = ref.loss()
            ref_loss.backward()
            refs[n] = (ref, ref_loss.detach(), _grads(ref.model))
        ref, ref_loss, ref_grads = refs[n]
        assert rig.batch[0].shape[0] == n and torch.equal(rig.batch[0], ref.batch[0]), variant
        if rig.levers & COMPILED:
            assert rig.compile_note.startswith("fullgraph"), (variant, rig.compile_note)
        loss = rig.loss()
        loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=1e-6, msg=variant)
        torch.testing.assert_close(_grads(rig.model), ref_grads, rtol=1e-4, atol=1e-6, msg=variant)

    composite, eager = rigs["all"], refs[8][0]
    assert micro_batch_factor(composite.levers) == 8 and composite.micro_batches > 1
    for rig in (composite, eager):
        rig.optimizer.zero_grad(set_to_none=True)
    first = composite.step()
    torch.testing.assert_close(first, eager.step(), rtol=1e-5, atol=1e-6)
    for p_got, p_want in zip(composite.params, eager.params, strict=True):
        torch.testing.assert_close(p_got, p_want, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        after = composite.loss()
        torch.testing.assert_close(after, eager.loss(), rtol=1e-5, atol=1e-6)
    assert after < first  # the update moved the weights, and downhill


def test_deterministic_backends_are_the_ones_train_deterministic_picks():
    assert deterministic_backend("softmax", cuda=True) == "softmax-triton"
    assert deterministic_backend("softmax", cuda=False) == "softmax-reference"
    assert deterministic_backend("softmax-flex", cuda=True) == "softmax-triton"
    for kept in ("sigmoid-triton", "softmax-triton", "sigmoid-reference"):
        assert deterministic_backend(kept, cuda=True) == kept


def test_det_rigs_step_in_deterministic_mode_and_restore_it():
    """A det rig runs its steps (forward, backward, update) with the mode on, names the backend
    that ran, and leaves the mode as it found it; the other rigs never turn it on."""
    cfg = smoke()
    det = build_rig(cfg, "softmax", "det", "cpu")
    eager = build_rig(cfg, "softmax", "eager", "cpu")
    assert det.label == "softmax-reference / det" and eager.label == "softmax / eager"
    assert det.model.attention_layers[0].backend_name == "softmax-reference"
    seen = []
    for rig in (det, eager):
        rig.model.register_forward_hook(
            lambda *_: seen.append(torch.are_deterministic_algorithms_enabled())
        )
    assert not torch.are_deterministic_algorithms_enabled()
    det.step()
    assert not torch.are_deterministic_algorithms_enabled()
    eager.step()
    assert seen == [True, False]
    with pytest.raises(RuntimeError), det.mode():
        raise RuntimeError("a step failed")
    assert not torch.are_deterministic_algorithms_enabled()


def test_pad_vocab_rigs_pad_the_head_only():
    cfg = smoke()
    for variant in ("pad-vocab", "all"):
        rig = build_rig(cfg, "softmax", variant, "cpu", compile_backend="aot_eager")
        assert rig.model.head.row_multiple == HEAD_ROW_MULTIPLE, variant
    assert build_rig(cfg, "softmax", "eager", "cpu").model.head.row_multiple == 1


def test_a_rig_steps_and_learns():
    rig = build_rig(smoke(), "softmax", "all", "cpu", compile_backend="aot_eager")
    first = rig.step(record_logits=True, layer_stats=True)
    for _ in range(3):
        last = rig.step()
    assert torch.isfinite(first) and last < first


def test_compiled_softmax_model_follows_the_padding_hint():
    """The compiled softmax model reads whether the batch is padded from compiled_lengths_hint,
    and torch.compile guards on it: an unpadded call then a padded one each equal eager."""
    cfg = ModelConfig(n_layers=1, d_model=32, n_heads=2, d_ff=64, dropout=0.0)
    torch.manual_seed(0)
    eager = Transformer(cfg, 50, 24, "softmax")
    compiled = Transformer(cfg, 50, 24, "softmax")
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(fullgraph=True, backend="aot_eager")
    tokens = torch.randint(3, 50, (2, 24))
    for lengths in (torch.tensor([24, 24]), torch.tensor([24, 9])):
        with compiled_lengths_hint(lengths, 24):
            got = compiled(tokens, lengths)
        want = eager(tokens, lengths)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # No hint: the mask path, right for any lengths.
    lengths = torch.tensor([24, 5])
    torch.testing.assert_close(
        compiled(tokens, lengths), eager(tokens, lengths), rtol=1e-5, atol=1e-5
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arm", ["sigmoid-triton", "softmax"])
def test_variants_match_eager_on_gpu(arm, monkeypatch):
    """bf16 on the GPU: every variant's first loss and gradients equal eager's up to rounding
    (inductor and the chunked loss round differently; no dropout so the draws do not differ);
    det runs softmax-triton for the softmax arm."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic matmuls
    cfg = smoke()
    cfg.model = ModelConfig(n_layers=2, d_model=128, n_heads=2, d_ff=512, dropout=0.0)
    cfg.data.context_len = 512
    ref = build_rig(cfg, arm, "eager", "cuda")
    ref_loss = ref.loss()
    ref_loss.backward()
    ref_grads = _grads(ref.model)
    for variant in (
        "compile",
        "compile-blocks",
        "compile-cg",
        "chunked-ce",
        "no-copies",
        "pad-vocab",
        "det",
    ):
        rig = build_rig(cfg, arm, variant, "cuda")
        if "compile" in variant:
            assert rig.compile_note.startswith("fullgraph"), rig.compile_note
        with rig.mode():
            loss = rig.loss()
            loss.backward()
        assert abs(loss.item() - ref_loss.item()) <= 1e-2 * abs(ref_loss.item()), variant
        assert (_grads(rig.model) - ref_grads).norm() <= 3e-2 * ref_grads.norm(), variant
        if variant == "det":
            want = "softmax-triton" if arm == "softmax" else arm
            assert rig.label == f"{want} / det", rig.label


def test_levers_join_with_plus_and_unknown_parts_are_named():
    assert variant_levers("compile+mb2") == {"compile", "mb2"}
    assert variant_levers("all+autotune") == {*LEVERS, "autotune"}
    assert "accum" in variant_levers("all") and "autotune" not in variant_levers("all")
    with pytest.raises(ValueError, match="'mb3'"):
        parse_variants(["compile+mb3"])
    with pytest.raises(ValueError, match="'det'"):
        parse_variants(["all+det"])
    assert variant_levers("all+coord") == {*LEVERS, "coord"}
    with pytest.raises(ValueError, match="'coord' cannot join 'compile-cg' or 'autotune'"):
        parse_variants(["all+coord+autotune"])


def test_accum_steps_the_mean_of_its_micro_batches():
    """accum: ACCUM_MICRO_BATCHES forward/backward passes per update, whose summed gradient is
    the mean of theirs, i.e. (the micro-batch being the same) eager's gradient: the same update,
    the same loss."""
    cfg = smoke()
    rigs = {v: build_rig(cfg, "sigmoid-reference", v, "cpu") for v in ("eager", "accum")}
    assert rigs["accum"].micro_batches == ACCUM_MICRO_BATCHES > 1
    assert rigs["eager"].micro_batches == 1
    calls = []
    rigs["accum"].model.register_forward_hook(lambda *_: calls.append(1))
    losses = {v: r.step() for v, r in rigs.items()}
    assert len(calls) == ACCUM_MICRO_BATCHES
    torch.testing.assert_close(losses["accum"], losses["eager"], rtol=1e-5, atol=1e-6)
    for pa, pe in zip(rigs["accum"].params, rigs["eager"].params, strict=True):
        torch.testing.assert_close(pa, pe, rtol=1e-4, atol=1e-6)
