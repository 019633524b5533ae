"""Jacobian probes: the maths of the score maps, the estimator, and the live probe's side effects."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from stabilitylab.config import ModelConfig
from stabilitylab.model import Transformer
from stabilitylab.probes.jacobian import (
    exact_jacobian,
    loglog_slope,
    max_abs_score,
    max_offdiag_abs,
    power_iteration_spectral_norm,
    score_probs,
    sigmoid_jacobian_closed_form,
    softmax_jacobian_closed_form,
    spectral_norm,
    toy_attention,
    toy_weights,
)
from stabilitylab.probes.live import JacobianProbe
from stabilitylab.probes.sweeps import layer_table, median_curve, slope_table

F64 = torch.float64


def fresh_generator() -> torch.Generator:
    """A generator seeded from the OS: new inputs every run, without touching the global RNG;
    the seed is printed (pytest shows it with a failure) so the inputs can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"generator seed {seed}")
    return torch.Generator().manual_seed(seed)


# ---- score maps ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 33, 64])
@pytest.mark.parametrize("scale", [0.1, 3.0, 100.0])
def test_sigmoid_score_jacobian_is_diagonal_and_at_most_a_quarter(n, scale):
    s_N = torch.randn(n, generator=fresh_generator(), dtype=F64) * scale
    J = exact_jacobian(lambda s: score_probs(s, "sigmoid"), s_N)
    if n > 1:
        assert max_offdiag_abs(J) == 0.0  # exactly: each weight depends on its own score only
    assert float(J.diagonal().max()) <= 0.25
    assert float(J.diagonal().min()) >= 0.0
    torch.testing.assert_close(J, sigmoid_jacobian_closed_form(s_N), rtol=0, atol=1e-15)
    assert spectral_norm(J) <= 0.25


def test_sigmoid_derivative_reaches_a_quarter_where_the_biased_score_is_zero():
    n = 16
    s_N = torch.full((n,), math.log(n), dtype=F64)  # s + b = 0 with b = -log n
    J = exact_jacobian(lambda s: score_probs(s, "sigmoid"), s_N)
    torch.testing.assert_close(J.diagonal(), torch.full((n,), 0.25, dtype=F64))


@pytest.mark.parametrize("n", [2, 9, 64])
@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_softmax_score_jacobian_equals_diag_p_minus_ppT(n, scale):
    s_N = torch.randn(n, generator=fresh_generator(), dtype=F64) * scale
    J = exact_jacobian(lambda s: score_probs(s, "softmax"), s_N)
    p_N = torch.softmax(s_N, -1)
    torch.testing.assert_close(J, torch.diag(p_N) - torch.outer(p_N, p_N), rtol=0, atol=1e-14)
    torch.testing.assert_close(J, softmax_jacobian_closed_form(s_N), rtol=0, atol=1e-14)
    # Dense coupling: every row sums to zero (weights stay on the simplex) and, with no
    # weight saturated, every off-diagonal entry is non-zero.
    torch.testing.assert_close(J.sum(dim=1), torch.zeros(n, dtype=F64), rtol=0, atol=1e-14)
    if scale <= 1.0:
        off = J[~torch.eye(n, dtype=torch.bool)]
        assert bool((off < 0).all())
    assert spectral_norm(J) <= 0.5 + 1e-12


def test_spectral_norm_matches_svd():
    A = torch.randn(37, 23, generator=fresh_generator(), dtype=F64)
    assert spectral_norm(A) == pytest.approx(float(torch.linalg.svdvals(A)[0]), rel=1e-12)
    assert spectral_norm(A.T) == pytest.approx(float(torch.linalg.svdvals(A)[0]), rel=1e-12)


# ---- power iteration -----------------------------------------------------------------------


def test_power_iteration_on_a_linear_map_is_a_rising_lower_bound():
    gen = fresh_generator()
    # Random singular vectors, and a top singular value 1.3x the next: the error then shrinks by
    # (1/1.3)^2 per step. (A plain randn matrix can have sigma_2 / sigma_1 near 1, where 200 steps
    # fall short of 1e-6.)
    U, _ = torch.linalg.qr(torch.randn(30, 20, generator=gen, dtype=F64))
    V, _ = torch.linalg.qr(torch.randn(20, 20, generator=gen, dtype=F64))
    s = torch.rand(20, generator=gen, dtype=F64).sort(descending=True).values + 0.1
    s[0] = 1.3 * s[1]
    A = U @ torch.diag(s) @ V.T
    x = torch.randn(20, generator=gen, dtype=F64)
    exact = float(torch.linalg.svdvals(A)[0])
    run = power_iteration_spectral_norm(lambda x: A @ x, x, iters=200, seed=3)
    assert run.sigma == pytest.approx(exact, rel=1e-6)
    hist = torch.tensor(run.history, dtype=F64)
    assert bool((hist <= exact * (1 + 1e-12)).all())
    assert bool((hist[1:] >= hist[:-1] * (1 - 1e-12)).all())


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
@pytest.mark.parametrize("qk_ln", [False, True])
@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_power_iteration_within_one_percent_of_exact(kind, qk_ln, scale):
    gen = fresh_generator()
    w = toy_weights(8, 8, gen)
    x_NC = torch.randn(12, 8, generator=gen, dtype=F64) * scale
    fn = lambda x: toy_attention(x, w, kind, qk_ln)
    exact = spectral_norm(exact_jacobian(fn, x_NC))
    run = power_iteration_spectral_norm(fn, x_NC, iters=300, tol=1e-12, generator=gen)
    assert abs(run.sigma - exact) <= 0.01 * exact


def test_power_iteration_leaves_global_rng_and_grads_alone():
    w = toy_weights(6, 6, torch.Generator().manual_seed(0))
    w_q = w.w_q_CD.clone().requires_grad_()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1), dtype=F64)
    x.requires_grad_()
    before = torch.get_rng_state()
    fn = lambda x: torch.sigmoid((x @ w_q) @ (x @ w.w_k_CD).T) @ (x @ w.w_v_CD)
    a = power_iteration_spectral_norm(fn, x, iters=5, seed=7)
    b = power_iteration_spectral_norm(fn, x, iters=5, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    assert w_q.grad is None and x.grad is None
    assert a == b  # own generator: same seed, same answer


def test_zero_jacobian_gives_zero():
    x = torch.randn(4, dtype=F64)
    assert power_iteration_spectral_norm(lambda x: 0.0 * x, x, iters=3).sigma == 0.0


# ---- toy layer and sweeps ------------------------------------------------------------------


def test_qk_layernorm_bounds_scores_and_sigmoid_layer_jacobian_grows_without_it():
    gen = fresh_generator()
    w = toy_weights(8, 8, gen)
    z_NC = torch.randn(16, 8, generator=gen, dtype=F64)
    assert max_abs_score(z_NC * 30.0, w, qk_layernorm=True) <= math.sqrt(8) + 1e-9
    # The score map's derivative is bounded by 1/4, the layer's Jacobian is not: it carries
    # dS/dx ~ |x| and v ~ |x| (the paper's bound grows with ||x||^2).
    sig = lambda s: spectral_norm(
        exact_jacobian(lambda x: toy_attention(x, w, "sigmoid"), z_NC * s)
    )
    assert sig(3.0) > 3.0 * sig(0.3)


def test_slope_table_recovers_a_power_law():
    df = layer_table([8], [0.5, 1.0], dim=4, head_dim=4, draws=1, seed=0)
    curve = median_curve(df, "scale")
    curve["sigma"] = 3.0 * curve.scale**1.5
    slopes = slope_table(curve, "scale", [(0.5, 1.0)])
    assert len(slopes) == 4
    assert slopes.slope.tolist() == pytest.approx([1.5] * 4)
    assert loglog_slope([1, 10, 100], [2, 20, 200]) == pytest.approx(1.0)


# ---- live probe ----------------------------------------------------------------------------


def tiny_model(backend: str, qk_layernorm: bool = False) -> Transformer:
    cfg = ModelConfig(n_layers=2, d_model=16, n_heads=2, d_ff=32, dropout=0.2,
                      qk_layernorm=qk_layernorm)  # fmt: skip
    torch.manual_seed(0)
    return Transformer(cfg, vocab_size=50, context_len=32, backend=backend)


def batch(lengths: list[int], T: int = 20):
    gen = fresh_generator()
    tokens_BT = torch.randint(3, 50, (len(lengths), T), generator=gen)
    lengths_B = torch.tensor(lengths)
    return tokens_BT.masked_fill(torch.arange(T)[None] >= lengths_B[:, None], 0), lengths_B


@pytest.mark.parametrize("backend", ["softmax", "softmax-reference", "sigmoid-reference"])
@pytest.mark.parametrize("was_training", [True, False])
def test_live_probe_leaves_training_state_unchanged(backend, was_training):
    model = tiny_model(backend)
    tokens_BT, lengths_B = batch([20, 13, 7])
    model(tokens_BT, lengths_B).square().mean().backward()
    model.attention_layers[1].proj.bias.grad = None  # a parameter with no grad must stay so
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train(was_training)
    model.set_record_max_logit(True)
    model(tokens_BT, lengths_B)
    max_logits = [a.max_logit_BH for a in model.attention_layers]
    backends = [a.backend for a in model.attention_layers]
    rng = torch.get_rng_state()

    sigmas = JacobianProbe(every=10, samples=2, tokens=16, iters=4).measure(
        model, tokens_BT, lengths_B
    )

    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training is was_training
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n])
        assert (p.grad is None) if grads[n] is None else torch.equal(p.grad, grads[n])
    for a, ml, be in zip(model.attention_layers, max_logits, backends, strict=True):
        assert a.record_max_logit and a.max_logit_BH is ml and a.backend is be
    assert sorted(sigmas) == [0, 1]
    assert all(math.isfinite(s) and s > 0 for s in sigmas.values())


@pytest.mark.parametrize("backend", ["softmax", "softmax-reference", "sigmoid-reference"])
@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_live_probe_matches_exact_jacobian_of_each_layer(backend, qk_layernorm):
    model = tiny_model(backend, qk_layernorm).eval()
    tokens_BT, lengths_B = batch([20, 9], T=20)
    probe = JacobianProbe(every=1, samples=2, tokens=12, iters=200)
    sigmas = probe.measure(model, tokens_BT, lengths_B)

    inputs = {}
    hooks = [a.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
             for i, a in enumerate(model.attention_layers)]  # fmt: skip
    with torch.no_grad():
        model(tokens_BT[:, :12], lengths_B.clamp(max=12))
    for h in hooks:
        h.remove()
    for i, layer in enumerate(model.attention_layers):
        exact = 0.0
        for s, L in enumerate([12, 9]):
            fn = lambda x, L=L, layer=layer: layer(x, torch.tensor([L]))
            with sdpa_kernel(SDPBackend.MATH):  # the CPU flash backward has no vmap rule: slow
                J = exact_jacobian(fn, inputs[i][s : s + 1, :L])
            exact = max(exact, spectral_norm(J))
        assert sigmas[i] == pytest.approx(exact, rel=0.01)


def test_every_attention_backend_has_a_differentiable_path():
    from stabilitylab.attention import available
    from stabilitylab.probes.live import _DIFFERENTIABLE_BACKEND

    assert set(available()) <= set(_DIFFERENTIABLE_BACKEND)
    assert set(_DIFFERENTIABLE_BACKEND.values()) <= set(available())


def test_live_probe_cadence():
    probe = JacobianProbe(every=50)
    assert [s for s in range(201) if probe.due(s)] == [0, 50, 100, 150, 200]
    assert not any(JacobianProbe(every=0).due(s) for s in range(10))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(every=-1),
        dict(every=1.5),
        dict(every=True),
        dict(every=1, samples=0),
        dict(every=1, tokens=1),
        dict(every=1, iters=0),
        dict(every=1, seed="a"),
    ],
)
def test_live_probe_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        JacobianProbe(**kwargs)


def test_live_probe_rejects_bad_batches_and_models():
    model, probe = tiny_model("softmax"), JacobianProbe(every=1, tokens=8)
    tokens_BT, lengths_B = batch([20, 5])
    with pytest.raises(ValueError, match="tokens_BT"):
        probe.measure(model, tokens_BT[0], lengths_B)
    with pytest.raises(ValueError, match="lengths_B"):
        probe.measure(model, tokens_BT, lengths_B[:1])
    with pytest.raises(ValueError, match="lengths_B"):
        probe.measure(model, tokens_BT, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="lengths_B"):
        probe.measure(model, tokens_BT, torch.tensor([21, 5]))
    with pytest.raises(ValueError, match="attention_layers"):
        probe.measure(torch.nn.Linear(2, 2), tokens_BT, lengths_B)


def test_maths_rejects_bad_arguments():
    x = torch.randn(4, 3, dtype=F64)
    w = toy_weights(3, 2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="kind"):
        score_probs(x, "relu")
    with pytest.raises(ValueError, match="C="):
        toy_attention(torch.randn(4, 5, dtype=F64), w, "softmax")
    with pytest.raises(ValueError, match="iters"):
        power_iteration_spectral_norm(lambda x: x, x, iters=0)
    with pytest.raises(ValueError, match="tol"):
        power_iteration_spectral_norm(lambda x: x, x, tol=-1.0)
    with pytest.raises(ValueError, match="floating"):
        power_iteration_spectral_norm(lambda x: x, torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="matrix"):
        spectral_norm(torch.ones(3))
    with pytest.raises(ValueError, match="score row"):
        softmax_jacobian_closed_form(x)
    with pytest.raises(ValueError, match="positive"):
        loglog_slope([1, 2], [1, -1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_live_probe_on_cuda_matches_reference_backend():
    """The kernel takes head dims 64/128 only: a wider tiny model than ``tiny_model``'s."""
    tokens_BT, lengths_B = batch([20, 11])
    cfg = ModelConfig(n_layers=2, d_model=128, n_heads=2, d_ff=64, dropout=0.2)
    torch.manual_seed(0)
    triton = Transformer(cfg, vocab_size=50, context_len=32, backend="sigmoid-triton").cuda()
    ref = Transformer(cfg, vocab_size=50, context_len=32, backend="sigmoid-reference").cuda()
    ref.load_state_dict(triton.state_dict())
    probe = JacobianProbe(every=1, samples=2, tokens=16, iters=50)
    rng = torch.cuda.get_rng_state()
    a = probe.measure(triton, tokens_BT.cuda(), lengths_B.cuda())
    b = probe.measure(ref, tokens_BT.cuda(), lengths_B.cuda())
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    assert a == pytest.approx(b, rel=1e-4)


def test_code_imports_only_the_stabilitylab_names():
    """``import probes`` works only with the repository root on the path (plain ``pytest`` then
    fails); the packages must not reach into experiments/ either."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    folders = {"kernels", "probes", "analysis", "experiments"}
    outputs = {"results", "runs", "data", ".venv", "build"}  # not source
    bad = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] in outputs or rel.parts[0].startswith("."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")
                if top[0] in folders or (
                    rel.parts[0] in {"kernels", "probes", "analysis", "stabilitylab"}
                    and top[:2] == ["stabilitylab", "experiments"]
                ):
                    bad.append(f"{rel}:{node.lineno}: {name}")
    assert not bad, "\n".join(bad)
