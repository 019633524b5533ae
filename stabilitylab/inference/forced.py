"""The research loop's teacher-forced protocol through the engine, for ragged batches.

Sequence b of ``S_b`` tokens prefills ``P_b``, decodes ``W_b = S_b - 1 - P_b`` tokens, and its
sigmoid bias counts ``S_b - 1`` input tokens; step w feeds token ``P_b + w`` of every sequence
still inside its window and scores token ``P_b + w + 1``. A batch smaller than the engine's is
padded with one-token rows that never decode.
"""

from __future__ import annotations

import torch

from stabilitylab.inference.engine import DecodeEngine, EngineOutput
from stabilitylab.model import inference


def _per_sequence(x, B: int, device, name: str) -> torch.Tensor:
    t = torch.as_tensor(x, device=device, dtype=torch.long)
    t = t.expand(B) if t.dim() == 0 else t
    if tuple(t.shape) != (B,):
        raise ValueError(f"{name} must be an int or have shape ({B},), got {tuple(t.shape)}")
    return t


def check_windows(tokens_BS, prefill_B, lengths_B) -> None:
    S = tokens_BS.shape[1]
    if bool((lengths_B > S).any()) or bool((lengths_B < 3).any()):
        raise ValueError(f"sequence lengths must lie in [3, {S}], got {lengths_B.tolist()}")
    if bool((prefill_B < 1).any()) or bool((prefill_B > lengths_B - 2).any()):
        raise ValueError(
            f"prefill must lie in [1, S_b - 2] for each sequence; got prefill "
            f"{prefill_B.tolist()} for lengths {lengths_B.tolist()}"
        )


def pad_rows(tokens_BS, prefill_B, lengths_B, keep_BL, rows: int):
    """The batch padded to ``rows``: one-token prefills of token 0 whose window is empty."""
    B = tokens_BS.shape[0]
    pad = rows - B
    if pad < 0:
        raise ValueError(f"a batch of {B} sequences exceeds the engine's {rows} rows")
    if pad == 0:
        return tokens_BS, prefill_B, lengths_B, keep_BL
    tokens_BS = torch.cat([tokens_BS, tokens_BS.new_zeros(pad, tokens_BS.shape[1])])
    prefill_B = torch.cat([prefill_B, prefill_B.new_ones(pad)])
    lengths_B = torch.cat([lengths_B, lengths_B.new_full((pad,), 2)])
    if keep_BL is not None:
        keep_BL = torch.cat([keep_BL, keep_BL.new_ones(pad, keep_BL.shape[1])])
    return tokens_BS, prefill_B, lengths_B, keep_BL


def _decode_window(engine, tokens_BS, prefill_B, window_B, nll_BW, observer) -> None:
    """The decode steps, each row's NLL into ``nll_BW`` (NaN once its window has ended)."""
    S = tokens_BS.shape[1]
    for w in range(nll_BW.shape[1]):
        pos_B = prefill_B + w
        active_B = w < window_B
        token_B = tokens_BS.gather(1, pos_B.clamp(max=S - 1)[:, None])[:, 0]
        target_B = tokens_BS.gather(1, (pos_B + 1).clamp(max=S - 1)[:, None])
        logits_BV = engine.step(token_B, pos_B, active_B, observer, w)
        logp_BV = torch.log_softmax(logits_BV.to(torch.float64), dim=-1)
        nll_BW[:, w] = torch.where(active_B, -logp_BV.gather(1, target_B)[:, 0], float("nan"))


def teacher_forced(engine: DecodeEngine, tokens_BS, prefill, lengths_B, keep_BL, observer):
    """``DecodeEngine.teacher_forced``."""
    dev = engine.device
    B, S = tokens_BS.shape
    tokens_BS = tokens_BS.to(dev)
    prefill_B = _per_sequence(prefill, B, dev, "prefill")
    lengths_B = _per_sequence(S if lengths_B is None else lengths_B, B, dev, "lengths_B")
    check_windows(tokens_BS, prefill_B, lengths_B)
    if keep_BL is not None:
        keep_BL = torch.as_tensor(keep_BL, device=dev, dtype=torch.long)
    tokens_BS, prefill_B, lengths_B, keep_BL = pad_rows(
        tokens_BS, prefill_B, lengths_B, keep_BL, engine.batch
    )
    window_B = lengths_B - 1 - prefill_B
    P = int(prefill_B.max())
    engine.prefill(tokens_BS[:, :P], prefill_B, lengths_B - 1, keep_BL, observer)
    W = int(window_B.max())
    nll_BW = torch.full((engine.batch, W), float("nan"), dtype=torch.float64, device=dev)
    with inference(engine.model):
        _decode_window(engine, tokens_BS, prefill_B, window_B, nll_BW, observer)
    engine.check()
    live_BL = torch.stack([c.count_BH[:B].sum(-1) for c in engine.caches], dim=1).long()
    live_L = live_BL.sum(0).tolist()
    return EngineOutput(
        nll_BW=nll_BW[:B],
        written_B=(engine.H * (lengths_B - 1))[:B],
        live_BL=live_BL,
        keys_read_BL=engine.keys_read_BL[:B].clone(),
        held_bytes_L=[c.held_bytes(B) for c in engine.caches],
        live_bytes_L=[n * c.entry_bytes() for n, c in zip(live_L, engine.caches, strict=True)],
    )
