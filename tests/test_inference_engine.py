"""The decode engine (stabilitylab/inference) against the research loop (eviction/decode.py).

Same tiny random decoders as tests/test_eviction.py. In float64 (the PyTorch attention path) the
engine's per-step NLL equals the research loop's within ``tolerance(model)`` (1e-6 with gates,
whose float32 rounding either side can differ by an ulp; 1e-10 without), and every policy keeps
the same live set in every layer after the prefill and after every step. In float32, and through
the Triton kernel in the interpreter, the NLL agrees within 1e-4 (FLOAT32_NLL_ATOL; measured
~1e-6). On the GPU in bf16 the bar is BF16_NLL_ATOL (tests marked gpu).
"""

from __future__ import annotations

import pytest
import torch

from stabilitylab.eviction import H2O, GateThreshold, KeyDiff, NoEviction, decode_nll
from stabilitylab.inference import DecodeEngine, PagedKV
from stabilitylab.inference.paged import logical_drop_BHN
from tests.test_eviction import full_pass_nll_BW, random_tokens, tiny_decoder, tolerance

FLOAT32_NLL_ATOL = 1e-4
BF16_NLL_ATOL = 5e-2
"""bf16 K/V, weights and activations against the float32 research loop: a per-token NLL
within 0.05 nats (bf16 keeps 8 bits; over 12 layers the logits move by ~1e-2)."""


class Recording:
    """A research policy that records each row's live positions after every call (prefill
    first, then every step, layers in order): ``log[(step, layer)]``."""

    def __init__(self, inner, n_layers: int):
        self.inner, self.L, self.calls, self.log = inner, n_layers, 0, {}
        self.needs_scores, self.needs_budget = inner.needs_scores, inner.needs_budget

    @property
    def name(self) -> str:
        return self.inner.name

    def drop_BHN(self, cache, keep_B=None):
        drop = self.inner.drop_BHN(cache, keep_B)
        live = cache.live_BHN if drop is None else cache.live_BHN & ~drop
        key = (self.calls // self.L - 1, self.calls % self.L)
        self.log[key] = positions(cache.pos_BHN, live)
        self.calls += 1
        return drop


def positions(pos_BHN, live_BHN) -> list:
    return [[sorted(p for p, ok in zip(pr, lr, strict=True) if ok)
             for pr, lr in zip(pb, lb, strict=True)]
            for pb, lb in zip(pos_BHN.tolist(), live_BHN.tolist(), strict=True)]  # fmt: skip


def engine_run(model, tokens_BS, prefill, policy, keep_BL=None, lengths_B=None, **kw):
    """``(EngineOutput, {(step, layer): live positions})``."""
    log = {}

    def observe(step, layer, cache):
        log[(step, layer)] = cache.live_positions()

    engine = DecodeEngine(model, batch=tokens_BS.shape[0], max_entries=tokens_BS.shape[1],
                          policy=policy, page_size=4, **kw)  # fmt: skip
    out = engine.teacher_forced(tokens_BS, prefill, lengths_B, keep_BL, observe)
    return out, log


def evicting_tau(model, tokens_BS) -> float:
    """A tau midway between the two adjacent gates of the middle half of the model's gates on
    these tokens that lie furthest apart in logit space (where a gate's rounding is about even):
    a quarter to three quarters of the gated entries go, and no gate lies within rounding of tau.
    (The decode loop and the engine compute the gates with other rounding than this full pass;
    the midpoint of the two median gates, once 1.5e-7 apart in float32, flipped a decision.)"""
    _, gates = full_pass_nll_BW(model, tokens_BS, prefill=1)
    g = torch.cat([x.flatten() for x in gates]).sort().values.double()
    lo, hi = len(g) // 4, 3 * len(g) // 4
    x = torch.logit(g[lo : hi + 1])  # +-inf for a saturated gate; inf - inf (equal gates): no gap
    j = lo + int(torch.argmax(torch.nan_to_num(x[1:] - x[:-1], nan=0.0)))
    return float((g[j] + g[j + 1]) / 2)


POLICIES = ["dense", "tau0", "tau", "h2o", "keydiff"]


def policy_case(name, model, tokens_BS, seed):
    B, L = tokens_BS.shape[0], model.cfg.n_layers
    budget_BL = torch.randint(3, 14, (B, L), generator=torch.Generator().manual_seed(seed))
    if name == "tau":
        return GateThreshold(evicting_tau(model, tokens_BS)), None
    return {
        "dense": (NoEviction(), None),
        "tau0": (GateThreshold(0.0), None),
        "h2o": (H2O(), budget_BL),
        "keydiff": (KeyDiff(), budget_BL),
    }[name]


@pytest.mark.parametrize("policy_name", POLICIES)
@pytest.mark.parametrize("backend", ["softmax", "sigmoid-reference"])
def test_engine_equals_the_research_loop_in_float64(seed, backend, policy_name, one_thread):
    model = tiny_decoder(seed, backend, gates=policy_name != "dense")
    tokens_BS = random_tokens(seed)
    policy, keep_BL = policy_case(policy_name, model, tokens_BS, seed)
    recording = Recording(policy, model.cfg.n_layers)
    ref = decode_nll(model, tokens_BS, 8, recording, keep_BL)
    out, log = engine_run(model, tokens_BS, 8, policy, keep_BL)
    torch.testing.assert_close(out.nll_BW, ref.nll_BW, rtol=0, atol=tolerance(model))
    assert log == recording.log  # the same live set in every layer after every step
    assert (out.live_BL == ref.live_BL).all() and (out.keys_read_BL == ref.keys_read_BL).all()
    if policy_name in ("tau", "h2o", "keydiff"):  # the case evicts
        assert (out.live_BL < out.written_B[:, None]).any()


VARIANTS = [("none", "rmsnorm", "both"), ("learned", "layernorm", "both"),
            ("rope", "none", "logits"), ("rope", "rmsnorm", "values")]  # fmt: skip


@pytest.mark.parametrize("position,qk_norm,injection", VARIANTS)
def test_model_variants_equal_the_research_loop(seed, position, qk_norm, injection, one_thread):
    """NoPE, learned positions, QK-LayerNorm, no QK-norm, the gate on logits or values only."""
    model = tiny_decoder(seed, "sigmoid-reference", gates=True, position=position,
                         qk_norm=qk_norm, gate_injection=injection)  # fmt: skip
    tokens_BS = random_tokens(seed)
    policy = GateThreshold(evicting_tau(model, tokens_BS))
    recording = Recording(policy, model.cfg.n_layers)
    ref = decode_nll(model, tokens_BS, 8, recording)
    out, log = engine_run(model, tokens_BS, 8, policy)
    torch.testing.assert_close(out.nll_BW, ref.nll_BW, rtol=0, atol=tolerance(model))
    assert log == recording.log and (out.live_BL < out.written_B[:, None]).any()


@pytest.mark.parametrize("policy_name", ["tau", "h2o"])
def test_ragged_sequences_decode_as_they_would_alone(seed, policy_name, one_thread):
    """Different lengths and prefills in one batch: each sequence's NLL, live sets and reads
    are those of the research loop run on it alone (its own sigmoid bias -log(S_b - 1))."""
    model = tiny_decoder(seed, "sigmoid-reference", gates=True)
    tokens_BS = random_tokens(seed, B=3, S=21)
    lengths, prefills = [21, 14, 17], [8, 3, 11]
    policy, keep_BL = policy_case(policy_name, model, tokens_BS, seed)
    out, log = engine_run(model, tokens_BS, torch.tensor(prefills), policy, keep_BL,
                          lengths_B=torch.tensor(lengths))  # fmt: skip
    for b, (S, P) in enumerate(zip(lengths, prefills, strict=True)):
        rec = Recording(policy, model.cfg.n_layers)
        keep = None if keep_BL is None else keep_BL[b : b + 1]
        ref = decode_nll(model, tokens_BS[b : b + 1, :S], P, rec, keep)
        W = S - 1 - P
        torch.testing.assert_close(out.nll_BW[b, :W], ref.nll_BW[0], rtol=0, atol=tolerance(model))
        assert out.nll_BW[b, W:].isnan().all()
        assert out.live_BL[b].tolist() == ref.live_BL[0].tolist()
        assert out.keys_read_BL[b].tolist() == ref.keys_read_BL[0].tolist()
        for (step, layer), live in rec.log.items():
            assert log[(step, layer)][b] == live[0], (b, step, layer)


def float32_decoder(seed, backend, gates=True, d_model=32):
    """``tiny_decoder`` in float32 with head dim d_model / 2 (16: the kernel's smallest)."""
    return tiny_decoder(seed, backend, gates, d_model=d_model, std=0.3, dtype=torch.float32)


@pytest.mark.parametrize("attention", ["reference", pytest.param("triton", marks=pytest.mark.interpreter)])  # fmt: skip
@pytest.mark.parametrize("backend", ["softmax", "sigmoid-reference"])
def test_engine_in_float32_at_tau0_and_an_evicting_tau(seed, backend, attention, monkeypatch,
                                                      one_thread):  # fmt: skip
    """The interpreter takes ~0.3 s per kernel call: 4 steps, the evicting tau only."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = float32_decoder(seed, backend)
    tokens_BS = random_tokens(seed, B=2, S=21 if attention == "reference" else 13)
    taus = [evicting_tau(model, tokens_BS)]
    for tau in taus if attention == "triton" else [0.0, *taus]:
        ref = decode_nll(model, tokens_BS, 8, GateThreshold(tau))
        out, _ = engine_run(model, tokens_BS, 8, GateThreshold(tau), attention=attention)
        torch.testing.assert_close(out.nll_BW, ref.nll_BW, rtol=0, atol=FLOAT32_NLL_ATOL)
        assert (out.live_BL == ref.live_BL).all()


@pytest.mark.interpreter
def test_h2o_through_the_kernel_accumulates_the_research_scores(seed, monkeypatch, one_thread):
    """H2O in the engine on the Triton kernel's score side output (interpreter, float32,
    softmax: the merge kernel's pass): the research loop's NLL and live sets, and every live
    entry's accumulated score equal to the PyTorch path's. The scores differ by float32
    rounding, so a near tie could flip a decision: not seen in 30 seeds."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = float32_decoder(seed, "softmax", gates=False)
    tokens_BS = random_tokens(seed, B=2, S=13)
    keep_BL = torch.tensor([[6, 5, 7], [4, 6, 5]])
    ref = decode_nll(model, tokens_BS, 8, H2O(), keep_BL)
    engines = {}
    for impl in ("triton", "reference"):
        engines[impl] = DecodeEngine(model, batch=2, max_entries=13, policy=H2O(), page_size=4,
                                     attention=impl)  # fmt: skip
        out = engines[impl].teacher_forced(tokens_BS, 8, keep_BL=keep_BL)
        torch.testing.assert_close(out.nll_BW, ref.nll_BW, rtol=0, atol=FLOAT32_NLL_ATOL)
    for kernel, torch_path in zip(engines["triton"].caches, engines["reference"].caches, strict=True):  # fmt: skip
        (a, _), (b, _) = kernel.view(with_keys=False), torch_path.view(with_keys=False)
        assert torch.equal(a.pos_BHN, b.pos_BHN)
        torch.testing.assert_close(a.score_BHN, b.score_BHN, rtol=0, atol=1e-5)
    assert (ref.live_BL == keep_BL * model.cfg.n_heads).all()


# ---- the paged store ----------------------------------------------------------------------------


def filled_store(gen, B=2, H=3, D=4, T=23, page=4, n_pages=None):
    """A store after a prefill of T tokens (k = position + row id, so moves can be checked)."""
    kv = PagedKV.allocate(B, H, D, max_entries=T + 8, page_size=page, dtype=torch.float64,
                          device="cpu", n_pages=n_pages, key_bias=True, scores=True)  # fmt: skip
    row_BH = torch.arange(B * H, dtype=torch.float64).view(B, H) * 1000
    k_BHTD = (torch.arange(T, dtype=torch.float64)[:, None] + row_BH[..., None, None]).expand(B, H, T, D)  # fmt: skip
    keep_BHT = torch.rand(B, H, T, generator=gen) < 0.7
    kv.write_prefill(k_BHTD, -k_BHTD, k_BHTD[..., 0].float(), keep_BHT, k_BHTD[..., 0])
    return kv, keep_BHT, row_BH


def check_store(kv: PagedKV, live_sets, row_BH) -> None:
    """Each row holds exactly ``live_sets`` with its own data; pages: owned once, the rest free."""
    B, H = kv.count_BH.shape
    for b in range(B):
        for h in range(H):
            n = torch.arange(int(kv.count_BH[b, h]))
            flat = kv.flat_slots(torch.full_like(n, b), torch.full_like(n, h), n)
            pos = kv.pos_PS.view(-1)[flat]
            assert sorted(pos.tolist()) == live_sets[b][h]
            want = pos.double() + row_BH[b, h]
            assert torch.equal(kv.k_PSD.view(-1, kv.k_PSD.shape[2])[flat][:, 0], want)
            assert torch.equal(kv.v_PSD.view(-1, kv.v_PSD.shape[2])[flat][:, 0], -want)
            assert torch.equal(kv.score_PS.view(-1)[flat], want)
    P = kv.page_size
    assert (kv.held_BH == (kv.count_BH + P - 1) // P).all()
    held = [kv.table_BHM[b, h, m].item() for b in range(B) for h in range(H)
            for m in range(int(kv.held_BH[b, h]))]  # fmt: skip
    free = kv.free_F[: int(kv.n_free)].tolist()
    assert sorted(held + free) == list(range(kv.n_pages))  # no page lost or owned twice


def logical_positions(kv: PagedKV) -> list:
    """Each row's positions in its logical slot order (what a drop mask indexes)."""
    out = []
    for b, counts in enumerate(kv.count_BH.tolist()):
        rows = []
        for h, c in enumerate(counts):
            n = torch.arange(c)
            rows.append(kv.pos_PS.view(-1)[kv.flat_slots(torch.full_like(n, b), torch.full_like(n, h), n)].tolist())  # fmt: skip
        out.append(rows)
    return out


def test_drops_move_at_most_the_dropped_entries_and_free_pages():
    gen = torch.Generator().manual_seed(0)
    kv, keep_BHT, row_BH = filled_store(gen)
    check_store(kv, positions(torch.arange(23).expand_as(keep_BHT), keep_BHT), row_BH)
    for _ in range(4):
        drop_BHN = torch.rand(*kv.count_BH.shape, int(kv.count_BH.max()) + 2, generator=gen) < 0.3
        slots = logical_positions(kv)
        want = [[sorted(p for n, p in enumerate(row) if not drop_BHN[b, h, n])
                 for h, row in enumerate(rows)] for b, rows in enumerate(slots)]  # fmt: skip
        before = kv.k_PSD.clone()
        n_dropped = kv.drop(drop_BHN)
        assert n_dropped == sum(len(r) for rows in slots for r in rows) - sum(len(r) for rows in want for r in rows)  # fmt: skip
        moved = (kv.k_PSD != before).any(-1).sum().item()
        assert moved <= n_dropped  # each hole takes one entry; nothing else is copied
        check_store(kv, want, row_BH)


def test_policies_see_entries_in_position_order_so_ties_go_to_the_earlier():
    """A drop moves the row's last entry into the hole; the research policies break ties by
    the earlier slot, meaning the earlier position, so the view must restore position order."""
    kv = PagedKV.allocate(1, 1, 4, max_entries=8, page_size=4, dtype=torch.float64,
                          device="cpu", scores=True)  # fmt: skip
    k_BHTD = torch.randn(1, 1, 8, 4, dtype=torch.float64)
    kv.write_prefill(k_BHTD, k_BHTD, None, torch.ones(1, 1, 8, dtype=torch.bool),
                     torch.zeros(1, 1, 8))  # fmt: skip
    kv.drop(torch.tensor([[[True] + [False] * 7]]))
    assert logical_positions(kv) == [[[7, 1, 2, 3, 4, 5, 6]]]
    view, order_BHN = kv.view(with_keys=False)  # every score 0: a seven-way tie
    drop_BHN = H2O(heavy_fraction=1.0).drop_BHN(view, torch.tensor([6]))
    kv.drop(logical_drop_BHN(drop_BHN, order_BHN))
    assert kv.live_positions() == [[[2, 3, 4, 5, 6, 7]]]


def test_static_writes_of_ended_rows_land_in_the_trash_page():
    gen = torch.Generator().manual_seed(1)
    kv, keep_BHT, row_BH = filled_store(gen)
    B, H = kv.count_BH.shape
    active_BH = torch.tensor([[True] * H, [False] * H])
    live = positions(torch.arange(23).expand_as(keep_BHT), keep_BHT)
    for t in range(23, 31):
        new_BHD = (row_BH + t)[..., None].expand(B, H, 4)
        kv.ensure_page(active_BH)
        kv.write_new(new_BHD, -new_BHD, (row_BH + t).float(), torch.full((B,), t), active_BH)
        with torch.no_grad():
            kv.score_PS.view(-1)[kv.slot_of_next_BH(active_BH).flatten()] = (row_BH + t).flatten()
        kv.commit(active_BH)
        for h in range(H):
            live[0][h].append(t)
    check_store(kv, live, row_BH)  # row 1 unchanged, row 0 grew, pages came off the free list


def test_a_pool_too_small_says_so():
    gen = torch.Generator().manual_seed(2)
    kv, _, _ = filled_store(gen, n_pages=40)
    with pytest.raises(ValueError, match="the pool has"):
        filled_store(gen, n_pages=10)
    active_BH = torch.ones_like(kv.count_BH, dtype=torch.bool)
    for _ in range(16):  # 4 more pages per row: 24 > the 16 left
        kv.ensure_page(active_BH)
        kv.commit(active_BH)
    with pytest.raises(RuntimeError, match="overflow"):
        kv.check()


# ---- refusals ----------------------------------------------------------------------------------


def test_the_engine_refuses_what_it_cannot_run(seed):
    model = tiny_decoder(seed, "softmax")
    with pytest.raises(ValueError, match="attention must be one of"):
        DecodeEngine(model, batch=1, max_entries=8, attention="flash")
    with pytest.raises(ValueError, match="head dims 16-256"):
        DecodeEngine(model, batch=1, max_entries=8, attention="triton")  # head dim 8, float64
    with pytest.raises(ValueError, match="the engine runs the policies"):
        DecodeEngine(model, batch=1, max_entries=8, policy=object())
    engine = DecodeEngine(model, batch=2, max_entries=32, policy=H2O())
    tokens = random_tokens(seed, B=3)
    with pytest.raises(ValueError, match="exceeds the engine's 2 rows"):
        engine.teacher_forced(tokens, 8, keep_BL=torch.full((3, 3), 4))
    with pytest.raises(ValueError, match="needs keep_BL"):
        engine.teacher_forced(tokens[:2], 8)
    with pytest.raises(ValueError, match=r"prefill must lie in \[1, S_b - 2\]"):
        engine.teacher_forced(tokens[:2], 20, keep_BL=torch.full((2, 3), 4))


# ---- GPU: bf16 through the kernel and the CUDA graph -------------------------------------------


def to_bf16(model):
    """Weights in bf16, the gates in float32 (``TokenGate`` computes in float32)."""
    model = model.bfloat16()
    for block in model.blocks:
        if block.gate_out is not None:
            block.gate_out.float()
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["softmax", "sigmoid-triton"])
def test_bf16_engine_on_the_gpu_tracks_the_float32_research_loop(seed, backend):
    """The engine in bf16 (the kernel, the CUDA graph) against the float32 research loop."""
    model = float32_decoder(seed, backend, d_model=128).cuda()  # 2 heads of 64
    tokens_BS = random_tokens(seed, B=4, S=31).cuda()
    with torch.no_grad():
        model(tokens_BS[:, :-1], torch.full((4,), 30, device="cuda"))
    g = torch.cat([x.flatten() for x in model.gates]).sort().values
    tau = float((g[len(g) // 2] + g[len(g) // 2 + 1]) / 2)
    ref = decode_nll(model, tokens_BS, 12, GateThreshold(tau))
    out, _ = engine_run(to_bf16(model), tokens_BS, 12, GateThreshold(tau))
    assert (out.nll_BW - ref.nll_BW).abs().max().item() < BF16_NLL_ATOL
    # Gates near tau may fall the other side in bf16: at most 10% of a layer's entries.
    assert ((out.live_BL - ref.live_BL).abs() <= 0.1 * out.written_B[:, None]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["tau", "h2o"])
def test_the_cuda_graph_step_repeats_the_eager_step(seed, policy):
    """The captured step is the eager step replayed: the same kernels, the same bits."""
    model = to_bf16(float32_decoder(seed, "sigmoid-triton", d_model=128).cuda())
    tokens_BS = random_tokens(seed, B=3, S=40).cuda()
    lengths_B = torch.tensor([40, 33, 25], device="cuda")
    keep_BL = torch.full((3, 3), 12) if policy == "h2o" else None
    pol = H2O() if policy == "h2o" else GateThreshold(0.4)
    runs = [engine_run(model, tokens_BS, 9, pol, keep_BL, lengths_B, cuda_graph=g)[0]
            for g in (False, True)]  # fmt: skip
    assert torch.equal(runs[0].nll_BW.nan_to_num(-1), runs[1].nll_BW.nan_to_num(-1))
    assert torch.equal(runs[0].live_BL, runs[1].live_BL)
