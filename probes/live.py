"""Live Jacobian probe: spectral norm of each attention layer's input-output Jacobian in training.

For layer ``i`` it estimates ``sigma_i = ||d attn_i(x) / d x||_2`` where ``x_LC`` is the input the
layer received (after its LayerNorm) on the first ``tokens`` valid positions of a sampled
sequence, by power iteration (one JVP and one VJP per step, see
``stabilitylab.probes.jacobian.power_iteration_spectral_norm``). With several samples it reports
the largest, i.e. the spectral norm of the block-diagonal Jacobian over the sampled sequences.

What a measurement does, and why it cannot change the training trajectory:

- one extra forward pass on the sampled tokens, in eval mode (no dropout draws), under
  ``torch.no_grad()`` and with autocast off, with forward pre-hooks that copy each attention
  layer's input; the hooks exist only during that pass;
- JVP/VJP with respect to ``x`` only (``torch.func``), so no parameter ``.grad`` is written;
- the start vector comes from the probe's own generator, never the global CPU/CUDA RNG;
- fused kernels are not twice differentiable (the JVP is a VJP of a VJP), so during the
  measurement the layer runs the same maths through a differentiable path (SDPA's math kernel for softmax, the PyTorch reference for
  sigmoid), and the q/k/v split through plain views (not the one-pass gradient of
  ``train.fast``); the layer's backend, flags, train/eval mode are restored in ``finally``.

Limit: the window is the first ``tokens`` positions treated as a sequence of that length, so for
sigmoid attention the bias is ``-log(window)``, not ``-log(full length)``; values are comparable
across steps (same window size), not equal to the full-length layer's norm.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from stabilitylab.attention import get_backend
from stabilitylab.probes.jacobian import power_iteration_spectral_norm

# Cadence and window that keep the amortised cost under 2% of training (measured with
# experiments/probes/live_cost.py: one measurement costs 0.9-1.2 smoke-preset steps on CPU, <0.7
# of a proxy step at batch 4).
RECOMMENDED_EVERY = 200
RECOMMENDED_TOKENS = 256

# Backend the probe differentiates through, for each backend the model may use.
_DIFFERENTIABLE_BACKEND = {
    "softmax": "softmax",
    "softmax-flex": "softmax",
    "softmax-reference": "softmax-reference",
    "softmax-triton": "softmax-reference",
    "softmax-flash": "softmax",
    "sigmoid-reference": "sigmoid-reference",
    "sigmoid-triton": "sigmoid-reference",
    "sigmoid-triton-exact": "sigmoid-reference",
}


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DDP (``.module``) or ``torch.compile`` (``._orig_mod``) wrappers."""
    while not hasattr(model, "attention_layers"):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            raise ValueError(
                f"{type(model).__name__} has no `attention_layers`; pass a stabilitylab Transformer"
            )
        model = inner
    return model


class JacobianProbe:
    """Measures per-layer attention Jacobian spectral norms every ``every`` steps (0 = never)."""

    def __init__(
        self, every: int, samples: int = 1, tokens: int = 256, iters: int = 8, seed: int = 0
    ):
        for name, value, low in (("every", every, 0), ("samples", samples, 1), ("tokens", tokens, 2), ("iters", iters, 1)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"JacobianProbe {name} must be an int >= {low}, got {value!r}")
        if not isinstance(seed, int):
            raise ValueError(f"JacobianProbe seed must be an int, got {seed!r}")
        self.every, self.samples, self.tokens, self.iters, self.seed = (
            every, samples, tokens, iters, seed,
        )  # fmt: skip

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def _window(self, tokens_BT: torch.Tensor, lengths_B: torch.Tensor):
        if tokens_BT.dim() != 2:
            raise ValueError(
                f"tokens_BT must be (batch, tokens), got shape {tuple(tokens_BT.shape)}"
            )
        B, T = tokens_BT.shape
        if lengths_B.shape != (B,):
            raise ValueError(f"lengths_B must have shape ({B},), got {tuple(lengths_B.shape)}")
        if B == 0 or bool(((lengths_B < 1) | (lengths_B > T)).any()):
            raise ValueError(f"lengths_B must lie in [1, {T}] and the batch be non-empty")
        n = min(self.samples, B)
        lengths_S = lengths_B[:n].clamp(max=self.tokens)
        width = int(lengths_S.max())
        return tokens_BT[:n, :width], lengths_S

    def _capture_inputs(self, model, tokens_ST, lengths_S) -> list[torch.Tensor]:
        """One forward pass with pre-hooks on every attention layer; returns each layer's x_SWC."""
        layers = model.attention_layers
        captured: dict[int, torch.Tensor] = {}
        handles = []

        def hook_for(i: int):
            def hook(module, args, kwargs):
                x = args[0] if args else kwargs["x_BTC"]
                # Autocast is off, so x has the parameters' dtype: float32 in this lab.
                captured[i] = x.detach()

            return hook

        try:
            for i, layer in enumerate(layers):
                handles.append(layer.register_forward_pre_hook(hook_for(i), with_kwargs=True))
            with torch.no_grad(), torch.autocast(tokens_ST.device.type, enabled=False):
                model(tokens_ST, lengths_S)
        finally:
            for h in handles:
                h.remove()
        missing = [i for i in range(len(layers)) if i not in captured]
        if missing:
            raise RuntimeError(f"attention layers {missing} did not run in the probe's forward")
        return [captured[i] for i in range(len(layers))]

    def measure(self, model, tokens_BT: torch.Tensor, lengths_B: torch.Tensor) -> dict[int, float]:
        """Layer index -> estimated spectral norm of that attention layer's Jacobian w.r.t. x."""
        model = _unwrap(model)
        tokens_ST, lengths_S = self._window(tokens_BT, lengths_B)
        layers = list(model.attention_layers)
        unknown = [a.backend_name for a in layers if a.backend_name not in _DIFFERENTIABLE_BACKEND]
        if unknown:
            raise ValueError(
                f"no differentiable path for attention backends {sorted(set(unknown))}"
            )
        saved = [
            (a.backend, a.record_max_logit, a.max_logit_BH, a.one_pass_qkv_grad) for a in layers
        ]
        was_training = model.training
        gen = torch.Generator().manual_seed(self.seed)
        sigmas: dict[int, float] = {}
        try:
            model.eval()
            for a in layers:
                # The one-pass q/k/v gradient (train.fast) is an autograd.Function without the
                # setup_context torch.func needs; the plain views are the same values.
                a.record_max_logit, a.one_pass_qkv_grad = False, False
            xs = self._capture_inputs(model, tokens_ST, lengths_S)
            for a in layers:
                a.backend = get_backend(_DIFFERENTIABLE_BACKEND[a.backend_name])
            with (
                torch.no_grad(),  # torch.func still differentiates w.r.t. x; params build no graph
                torch.autocast(tokens_ST.device.type, enabled=False),
                sdpa_kernel(SDPBackend.MATH),  # fused SDPA kernels have no double backward
            ):
                for i, (layer, x_SWC) in enumerate(zip(layers, xs, strict=True)):
                    best = 0.0
                    for s, L in enumerate(lengths_S.tolist()):
                        len_1 = lengths_S[s : s + 1]
                        fn = lambda x, layer=layer, len_1=len_1: layer(x, len_1)
                        est = power_iteration_spectral_norm(
                            fn, x_SWC[s : s + 1, :L], iters=self.iters, generator=gen
                        )
                        best = max(best, est.sigma)
                    sigmas[i] = best
        finally:
            for a, (backend, record, max_logit, one_pass) in zip(layers, saved, strict=True):
                a.backend, a.record_max_logit, a.max_logit_BH = backend, record, max_logit
                a.one_pass_qkv_grad = one_pass
            model.train(was_training)
        return sigmas
