"""The Transformer: encoder or causal decoder; positions, QK-norm, KV-eviction gates, losses."""

import math

import pytest
import torch
import torch.nn as nn

from stabilitylab import config as C
from stabilitylab.config import ConfigError, ModelConfig
from stabilitylab.model import (
    Transformer,
    apply_rope,
    budget_loss,
    count_parameters,
    dense_parameter_count,
    flops_per_step,
    flops_per_step_labelled,
    gate_mean,
    head_linear,
    head_parameter_count,
    masked_lm_loss_sum,
    next_token_labels_BT,
    next_token_loss_sum,
    padded_size,
    rope_cos_sin,
)

V, T = 41, 12


def cfg(**kw) -> ModelConfig:
    base = dict(n_layers=3, d_model=32, n_heads=4, d_ff=64, dropout=0.0)
    return ModelConfig(**{**base, **kw})


def build(backend="sigmoid-reference", seed=0, **kw) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg(**kw), vocab_size=V, context_len=T, backend=backend)


def batch(seed=0, lengths=(T, 7)):
    g = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(3, V, (len(lengths), T), generator=g)
    lengths_B = torch.tensor(lengths)
    tokens_BT[torch.arange(T)[None, :] >= lengths_B[:, None]] = 0
    return tokens_BT, lengths_B


# ---- gates ------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_head", [False, True])
def test_gates_start_at_sigmoid_5_everywhere(per_head):
    model = build(gates=True, gate_per_head=per_head, causal=True, position="rope")
    tokens_BT, lengths_B = batch()
    model(tokens_BT, lengths_B)
    assert len(model.gates) == 2, "layers 0 .. L-2 emit a gate, the last none"
    shape = (2, 4, T) if per_head else (2, T)
    for g in model.gates:
        assert g.shape == shape and g.dtype == torch.float32 and g.requires_grad
        torch.testing.assert_close(g, torch.full(shape, 1 / (1 + math.exp(-5))))
    assert abs(model.gates[0].flatten()[0].item() - 0.9933) < 1e-4
    gate = model.blocks[0].gate_out
    assert (gate.weight_GC == 0).all() and (gate.bias_G == 5).all()
    assert model.blocks[-1].gate_out is None


def test_dense_model_has_no_gates():
    model = build(causal=True)
    model(*batch())
    assert model.gates == [] and all(b.gate_out is None for b in model.blocks)


class Spy:
    """Wraps a backend; records the v and the keyword arguments of each call."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def __call__(self, q, k, v, lengths, **kw):
        self.calls.append((v.detach().clone(), {k_: t for k_, t in kw.items() if "key_bias" in k_}))
        return self.backend(q, k, v, lengths, **kw)


def _spied_layer1(model, tokens_BT, lengths_B):
    spies = [Spy(a.backend) for a in model.attention_layers]
    for a, spy in zip(model.attention_layers, spies, strict=True):
        a.backend = spy
    model(tokens_BT, lengths_B)
    return spies


@pytest.mark.parametrize("injection", ["both", "logits", "values"])
@pytest.mark.parametrize("per_head", [False, True])
def test_gate_injection_changes_the_right_thing(injection, per_head):
    """Layer 1 sees layer 0's gate: log(g + 1e-8) on its logits (logits/both) and g * v on its
    values (values/both); layer 0 sees nothing. Gates are made to vary per token first."""
    kw = dict(causal=True, gates=True, gate_injection=injection, gate_per_head=per_head)
    model = build(**kw)
    with torch.no_grad():
        for b in model.blocks[:-1]:
            b.gate_out.weight_GC.normal_(0, 30.0)  # the stream's entries are ~0.03 at init
            b.gate_out.bias_G.fill_(0.0)
    tokens_BT, lengths_B = batch()
    spies = _spied_layer1(model, tokens_BT, lengths_B)
    g = model.gates[0].detach()
    assert g.std() > 0.2, "the test needs gates that differ from token to token"
    # The same layer-1 input without the gate's effect: rerun layer 1's projections directly.
    x0 = model.tok_emb(tokens_BT) + model.pos_emb(torch.arange(T))[None]
    x1 = model.blocks[0](x0, lengths_B)
    _, _, v_plain = model.blocks[1].attn._qkv(model.blocks[1].ln1(x1))
    v_seen, bias_seen = spies[1].calls[0]
    g_BHT = g if per_head else g[:, None, :]
    key = "key_bias_BHT" if per_head else "key_bias_BT"
    if injection in ("both", "values"):
        torch.testing.assert_close(v_seen, v_plain.detach() * g_BHT[..., None])
    else:
        torch.testing.assert_close(v_seen, v_plain.detach())
    if injection in ("both", "logits"):
        assert set(bias_seen) == {key}
        torch.testing.assert_close(bias_seen[key].detach(), torch.log(g + 1e-8))
    else:
        assert bias_seen == {}
    assert spies[0].calls[0][1] == {}, "layer 0 has no gate before it"


@pytest.mark.parametrize("per_head", [False, True])
def test_the_gate_in_the_kernel_is_the_same_model(per_head):
    """``gate_in_kernel``: sigmoid-triton takes g itself (log g and g v inside the kernel) and
    gives the logits and every gradient of the key-bias path (Triton's interpreter on CPU,
    float32, head dim 64); a backend without the fused gate keeps the key bias."""
    kw = dict(d_model=128, n_heads=2, causal=True, gates=True, gate_per_head=per_head)
    models = [build("sigmoid-triton", **kw, gate_in_kernel=fused) for fused in (False, True)]
    with torch.no_grad():
        for b in models[0].blocks[:-1]:
            b.gate_out.weight_GC.normal_(0, 30.0)
    models[1].load_state_dict(models[0].state_dict())
    assert [m.blocks[1].attn.gate_in_kernel for m in models] == [False, True]
    assert not build(**kw, gate_in_kernel=True).blocks[1].attn.gate_in_kernel  # the reference
    tokens_BT, lengths_B = batch()
    logits = [m(tokens_BT, lengths_B) for m in models]
    assert models[0].gates[0].detach().std() > 0.2, "gates that differ from token to token"
    torch.testing.assert_close(logits[1], logits[0], atol=2e-5, rtol=1e-4)
    for out in logits:
        out.square().mean().backward()
    for (name, p0), p1 in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p1.grad, p0.grad, atol=2e-6, rtol=1e-4, msg=name)


def test_gates_change_the_output_and_learn_from_the_budget_loss():
    """At init (g = 0.993) the gated model is the dense one up to ~1%; a closed gate is not."""
    model = build(causal=True, gates=True)
    tokens_BT, lengths_B = batch()
    dense_logits = build(causal=True)(tokens_BT, lengths_B)
    gated_logits = model(tokens_BT, lengths_B)
    assert not torch.equal(gated_logits, dense_logits)
    torch.testing.assert_close(gated_logits, dense_logits, atol=2e-3, rtol=0)
    with torch.no_grad():
        model.blocks[0].gate_out.bias_G.fill_(-1.0)
    assert (model(tokens_BT, lengths_B) - dense_logits).abs().max() > 2e-2
    loss = budget_loss(model.gates, lengths_B, 0.03)
    loss.backward()
    gb = model.blocks[0].gate_out.bias_G.grad
    s = torch.sigmoid(torch.tensor(-1.0))
    # d/db of 0.03 * mean over 2 layers: layer 0's share is 0.03 / 2 * g (1 - g)
    torch.testing.assert_close(gb, torch.full_like(gb, 0.03 / 2 * (s * (1 - s)).item()))


def test_gate_mean_counts_valid_positions_only():
    lengths_B = torch.tensor([3, 1])
    g1 = torch.tensor([[0.2, 0.4, 0.6, 9.0], [1.0, 9.0, 9.0, 9.0]])  # 9 = padding, ignored
    g2 = torch.full((2, 2, 4), 0.5)  # per head
    # layer 1: (0.2 + 0.4 + 0.6 + 1.0) / 4 = 0.55; layer 2: 0.5
    torch.testing.assert_close(gate_mean([g1, g2], lengths_B), torch.tensor(0.525))
    torch.testing.assert_close(budget_loss([g1, g2], lengths_B, 0.03), torch.tensor(0.03 * 0.525))
    assert gate_mean([], lengths_B) == 0


def test_gated_and_dense_models_share_their_common_initial_weights():
    """One seed, several cells: parameters that coincide start identical (the gates draw no
    random numbers, RoPE and NoPE have no parameters)."""
    ref = dict(build(causal=True, position="none", qk_norm="rmsnorm").named_parameters())
    for kw in (dict(gates=True), dict(gates=True, gate_per_head=True), dict(position="rope")):
        other = dict(
            build(causal=True, qk_norm="rmsnorm", **{"position": "none", **kw}).named_parameters()
        )
        common = set(ref) & set(other)
        assert common == set(ref), kw
        for name in common:
            assert torch.equal(ref[name], other[name]), (kw, name)


# ---- positions, QK-norm -----------------------------------------------------------------------


def test_nope_has_no_position_parameters():
    nope, learned = build(position="none"), build(position="learned")
    assert nope.pos_emb is None and not any("pos" in n for n, _ in nope.named_parameters())
    assert count_parameters(learned) - count_parameters(nope) == T * 32


@pytest.mark.parametrize("backend", ["softmax-reference", "sigmoid-reference"])
def test_bidirectional_nope_is_permutation_equivariant(backend):
    """Without positions, a bidirectional model sees a set: permuting the tokens permutes the
    logits (gates are token-wise, so they keep it). Learned positions and RoPE break it."""
    tokens_BT, lengths_B = batch(lengths=(T, T))
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(1))
    for position, equivariant in (("none", True), ("learned", False), ("rope", False)):
        model = build(backend, position=position, gates=True).eval()
        with torch.no_grad():
            model.blocks[0].gate_out.weight_GC.normal_(0, 1.0)
            out = model(tokens_BT, lengths_B)
            out_p = model(tokens_BT[:, perm], lengths_B)
        same = torch.allclose(out_p, out[:, perm], atol=1e-5, rtol=1e-5)
        assert same == equivariant, position


def test_rope_scores_depend_only_on_the_offset():
    """Same q at every position, same k at every position: after RoPE, the score of (i, j)
    depends on i - j only (shift along the diagonal: equal) and does vary with it."""
    D = 16
    g = torch.Generator().manual_seed(0)
    q0, k0 = torch.randn(D, generator=g), torch.randn(D, generator=g)
    cos, sin = rope_cos_sin(20, D, 10_000.0, "cpu")
    q = apply_rope(q0.expand(1, 1, 20, D), cos, sin)[0, 0]
    k = apply_rope(k0.expand(1, 1, 20, D), cos, sin)[0, 0]
    s = q @ k.T
    for shift in (1, 5):
        torch.testing.assert_close(s[shift:, shift:], s[:-shift, :-shift], atol=1e-5, rtol=1e-5)
    assert s[0].std() > 0.1, "scores must depend on the offset"
    torch.testing.assert_close(q.norm(dim=-1), q0.norm().expand(20), msg="RoPE is a rotation")


def test_qk_rmsnorm_is_applied_before_rope():
    model = build(causal=True, position="rope", qk_norm="rmsnorm")
    attn = model.blocks[0].attn
    assert isinstance(attn.q_norm, nn.RMSNorm) and isinstance(attn.k_norm, nn.RMSNorm)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 2.0)  # a gain makes norm and rotation not commute
    x = torch.randn(2, T, 32)
    q, _, _ = attn._qkv(x)
    q_raw = attn.qkv(x).view(2, T, 3, 4, 8).permute(2, 0, 3, 1, 4)[0]
    cos, sin = rope_cos_sin(T, 8, 10_000.0, "cpu")
    torch.testing.assert_close(q, apply_rope(attn.q_norm(q_raw), cos, sin))
    assert not torch.allclose(q, attn.q_norm(apply_rope(q_raw, cos, sin)))


def test_attention_inputs_share_the_projection_dtype_under_autocast():
    attn = build(causal=True, position="rope", qk_norm="rmsnorm").blocks[0].attn
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = attn._qkv(torch.randn(2, T, 32))
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16


def test_qk_layernorm_keeps_meaning_layernorm():
    for kw in (dict(qk_layernorm=True), dict(qk_norm="layernorm")):
        attn = build(**kw).blocks[0].attn
        assert isinstance(attn.q_norm, nn.LayerNorm) and isinstance(attn.k_norm, nn.LayerNorm)
    assert build().blocks[0].attn.q_norm is None


# ---- decoder ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["softmax", "softmax-reference", "sigmoid-reference"])
@pytest.mark.parametrize("position", ["learned", "rope", "none"])
def test_decoder_is_causal(backend, position):
    """Changing token t leaves the logits of positions < t unchanged (and changes position t)."""
    model = build(backend, causal=True, position=position, gates=True, qk_norm="rmsnorm")
    with torch.no_grad():
        for b in model.blocks[:-1]:
            b.gate_out.weight_GC.normal_(0, 1.0)
    tokens_BT, lengths_B = batch(lengths=(T, 9))
    t = 5
    changed = tokens_BT.clone()
    changed[:, t] = (changed[:, t] + 1 - 3) % (V - 3) + 3
    with torch.no_grad():
        a, b = model(tokens_BT, lengths_B), model(changed, lengths_B)
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(a[:, t], b[:, t])


def test_encoder_is_not_causal():
    model = build("sigmoid-reference")
    tokens_BT, lengths_B = batch()
    changed = tokens_BT.clone()
    changed[:, 5] = 3 if tokens_BT[0, 5] != 3 else 4
    with torch.no_grad():
        assert not torch.allclose(
            model(tokens_BT, lengths_B)[:, :5], model(changed, lengths_B)[:, :5]
        )


def test_decoder_ties_its_output_head_to_the_token_embedding():
    model = build(causal=True)
    assert model.head.weight is model.tok_emb.weight and model.head.bias is None
    distinct = {id(p): p.numel() for p in model.parameters()}
    assert count_parameters(model) == sum(distinct.values())
    encoder = build()
    assert encoder.head.weight is not encoder.tok_emb.weight and encoder.head.bias is not None
    assert dense_parameter_count(model) == count_parameters(model) - T * 32
    assert dense_parameter_count(encoder) == count_parameters(encoder) - T * 32 - V * 32


def test_next_token_labels_and_loss():
    tokens_BT = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    labels = next_token_labels_BT(tokens_BT, torch.tensor([4, 2]))
    assert labels.tolist() == [[6, 7, 8, -100], [10, -100, -100, -100]]
    logits = torch.randn(2, 4, 12)
    want = sum(
        -torch.log_softmax(logits[b, t], -1)[labels[b, t]]
        for b, t in ((0, 0), (0, 1), (0, 2), (1, 0))
    )
    torch.testing.assert_close(next_token_loss_sum(logits, labels), want)


def test_gated_decoder_learns_a_short_sequence():
    """A few steps of CE + budget on one repeated sequence: the CE falls and the gates move."""
    model = build("sigmoid-reference", causal=True, position="rope", gates=True, qk_norm="rmsnorm")
    tokens_BT, lengths_B = batch(lengths=(T, T))
    labels = next_token_labels_BT(tokens_BT, lengths_B)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ces = []
    for _ in range(25):
        ce = next_token_loss_sum(model(tokens_BT, lengths_B), labels) / (labels != -100).sum()
        loss = ce + budget_loss(model.gates, lengths_B, 0.03)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ces.append(ce.item())
    assert ces[-1] < 0.5 * ces[0]
    assert model.blocks[0].gate_out.weight_GC.abs().sum() > 0


# ---- accounting, compatibility ----------------------------------------------------------------


def test_flops_count_the_causal_half():
    enc, dec = cfg(), cfg(causal=True)
    dense = 6.0 * 1000 * (10 + 4)
    assert flops_per_step(enc, 1000, [10, 4]) == dense + 12.0 * 3 * 32 * (100 + 16)
    assert flops_per_step(dec, 1000, [10, 4]) == dense + 12.0 * 3 * 32 * (55 + 10)


def test_flops_labelled_count_the_head_on_labelled_rows_only():
    enc = cfg()
    model = build()
    n_dense, n_head = dense_parameter_count(model), head_parameter_count(model)
    assert n_head == V * 32 + V
    assert flops_per_step_labelled(enc, n_dense, n_head, [T, T], 2 * T) == flops_per_step(
        enc, n_dense, [T, T]
    )
    three = flops_per_step_labelled(enc, n_dense, n_head, [T, T], 3)
    assert flops_per_step(enc, n_dense, [T, T]) - three == 6.0 * n_head * (2 * T - 3)
    with pytest.raises(ValueError, match="n_params_head"):
        flops_per_step_labelled(enc, 10, 11, [T], 1)


# ---- the head's padded GEMM (a speed setting: the same function) -----------------------------


def test_padded_size():
    assert [padded_size(n, 64) for n in (1, 64, 65, 44003)] == [64, 64, 128, 44032]
    assert padded_size(41, 1) == 41
    with pytest.raises(ValueError, match="multiple"):
        padded_size(41, 0)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("multiple", [8, 64])
def test_head_linear_is_f_linear_with_its_gradients(bias, multiple):
    """fp64: the padded GEMM gives F.linear's logits (shape N x V) and the same gradients of h,
    the weight and the bias under a loss that weighs every logit."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, 16, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    weights = torch.randn(2, 5, V, generator=g, dtype=torch.float64)
    params = [t for t in (h, w, b) if t is not None]
    results = []
    for m in (1, multiple):
        logits = head_linear(h, w, b, m)
        assert logits.shape == (2, 5, V)
        results.append((logits.detach(), torch.autograd.grad((logits * weights).sum(), params)))
    (ref, ref_grads), (got, got_grads) = results
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, r in zip(got_grads, ref_grads, strict=True):
        assert a.shape == r.shape
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])  # encoder: head with bias; decoder: tied
def test_a_padded_head_is_the_same_model(causal):
    """fp64: set_head_row_multiple(64) leaves the logits (B x T x V), the loss and every
    parameter's gradient (the tied embedding's included) as they were."""
    tokens_BT, lengths_B = batch()
    labels_BT = torch.where(torch.rand(tokens_BT.shape) < 0.5, tokens_BT, -100)
    results = []
    for multiple in (1, 64):
        model = build(causal=causal).double()
        model.set_head_row_multiple(multiple)
        logits = model(tokens_BT, lengths_B)
        assert logits.shape == (2, T, V)
        loss = masked_lm_loss_sum(logits, labels_BT)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert grad.shape == ref_grads[name].shape, name
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)


def test_a_padded_head_keeps_checkpoints_loading_both_ways():
    """The setting is no parameter: the state dict has the same names and shapes (V rows), an
    unpadded model's weights load into a padded one and back, and both give the same logits."""
    plain, padded = build(seed=0), build(seed=1)
    padded.set_head_row_multiple(64)
    sd = padded.state_dict()
    assert {k: v.shape for k, v in sd.items()} == {
        k: v.shape for k, v in plain.state_dict().items()
    }
    assert sd["head.weight"].shape == (V, 32) and sd["head.bias"].shape == (V,)
    padded.load_state_dict(plain.state_dict())
    tokens_BT, lengths_B = batch()
    with torch.no_grad():
        torch.testing.assert_close(padded(tokens_BT, lengths_B), plain(tokens_BT, lengths_B))
    plain.load_state_dict(padded.state_dict())
    assert padded.head.row_multiple == 64 and plain.head.row_multiple == 1
    for bad in (0, -8, 2.0, True):
        with pytest.raises(ValueError, match="row multiple"):
            plain.set_head_row_multiple(bad)


def test_encoder_state_dict_keys_are_unchanged():
    """Checkpoints of the encoder keep loading: same parameter names as before the decoder."""
    want = {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias", "head.weight",
            "head.bias"}  # fmt: skip
    for i in range(3):
        want |= {f"blocks.{i}.{n}" for n in (
            "ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
            "attn.proj.bias", "ln2.weight", "ln2.bias", "ff.0.weight", "ff.0.bias",
            "ff.2.weight", "ff.2.bias")}  # fmt: skip
    assert set(build().state_dict()) == want


# ---- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(position="alibi"), "model.position"),
        (dict(qk_norm="batchnorm"), "model.qk_norm"),
        (dict(gate_injection="keys"), "model.gate_injection"),
        (dict(position="rope", d_model=36, n_heads=4), "model.position"),  # head dim 9
        (dict(gates=True, n_layers=1), "model.gates"),
        (dict(qk_layernorm=True, qk_norm="rmsnorm"), "model.qk_layernorm"),
        (dict(causal="yes"), "model.causal"),
        (dict(gates=1), "model.gates"),
        (dict(rope_base=1.0), "model.rope_base"),
        (dict(gate_bias_init=float("nan")), "model.gate_bias_init"),
    ],
)
def test_bad_model_config_names_its_key(kw, key):
    with pytest.raises(ConfigError, match=f"config {key}:"):
        cfg(**kw)


def test_saved_config_with_an_unknown_kind_is_refused():
    d = C.to_dict(C.smoke())
    d["model"]["position"] = "sinusoidal"
    with pytest.raises(ConfigError, match="model.position"):
        C.from_dict(d)


def test_command_line_knobs_and_help(capsys):
    c = C.parse(["--preset", "tiny", "--model.causal=True", "--model.position=rope",
                 "--model.qk_norm=rmsnorm", "--model.gates=True", "--model.gate_per_head=True"])  # fmt: skip
    m = c.model
    assert m.causal and m.position == "rope" and m.qk_norm_kind == "rmsnorm" and m.gate_per_head
    with pytest.raises(SystemExit):
        C.parse(["--preset", "smoke", "--model.position=alibi"])
    with pytest.raises(SystemExit):
        C.parse(["--preset", "smoke", "--help"])
    out = capsys.readouterr().out
    for phrase in ("NoPE", "QK-RMSNorm", "log(g_j + 1e-8)", "tied input/output embeddings"):
        assert phrase in " ".join(out.split()), phrase
