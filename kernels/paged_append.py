"""One decode step's write into a paged KV cache, in one launch: each active row (b, h) whose
held pages are full takes a page from the free list, its new entry is written at its logical
slot ``count`` and counted live. The reference is ``PagedKV.ensure_page``, ``write_new`` and
``commit(active)`` run in that order (``stabilitylab/inference/paged.py``, which documents the
layout); the kernel leaves every buffer as they leave it, bit for bit (pages are handed out in
the same order: the free list is a stack popped by the rows' rank among those that need a page).

    need_r = active_r and count_r == held_r * P
    rank_r = sum of need over rows before r              (row order: b major, then h)
    ok_r   = need_r and n_free - 1 - rank_r >= 0 and held_r < M
    table[r, held_r] = free[n_free - 1 - rank_r]  if ok_r;   held_r += ok_r
    n_free -= sum(need);  overflow |= any(need and not ok)
    slot_r = table[r, count_r // P] * P + count_r % P  if active_r and count_r < held_r * P,
             else the trash slot (a row that must not write)
    k, v, pos, key bias -> slot_r;  score[slot_r] = 0;  count_r += active_r

Why a kernel: the PyTorch form is ~50 small device ops per layer (a cumsum, gathers, scatters,
four index copies), each a launch of a few microseconds even inside a CUDA graph; at decode sizes
they cost more than the attention itself. One program walks every row in blocks of ``BLOCK_R``,
carrying the rank across blocks (the pop order needs a prefix sum over all rows; B H is a few
hundred). Writes of rows that must not write all land on the trash slot, as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stabilitylab.kernels.triton_support import compiled, interpreted, interpreting

BLOCK_R = 64
"""Rows per block of the one program (a block holds BLOCK_R x D of K and of V)."""


@triton.jit
def _append_kernel(
    k_ptr, v_ptr, kb_ptr, pos_ptr, active_ptr,
    k_pool, v_pool, pos_pool, kb_pool, score_pool,
    table_ptr, count_ptr, held_ptr, free_ptr, n_free_ptr, overflow_ptr,
    stride_kb, stride_kh, stride_vb, stride_vh, stride_kbb, stride_kbh, stride_ab, stride_ah,
    R, H, M, n_pages, trash,
    P: tl.constexpr, D: tl.constexpr, HAS_KB: tl.constexpr, HAS_SCORE: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    n_free = tl.load(n_free_ptr)
    d = tl.arange(0, D)
    carried = n_free * 0  # int32 scalar: rows before this block that needed a page
    over = n_free * 0
    for start in range(0, R, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        rm = r < R
        b, h = r // H, r % H
        act = tl.load(active_ptr + b * stride_ab + h * stride_ah, mask=rm, other=0) != 0
        count = tl.load(count_ptr + r, mask=rm, other=0)
        held = tl.load(held_ptr + r, mask=rm, other=0)
        need = act & (count == held * P) & rm
        need_i = need.to(tl.int32)
        rank = tl.cumsum(need_i, 0) - need_i + carried
        take = n_free - 1 - rank
        ok = need & (take >= 0) & (held < M)
        page = tl.load(free_ptr + tl.minimum(tl.maximum(take, 0), n_pages - 1), mask=ok, other=0)
        tl.store(table_ptr + r * M + held, page, mask=ok)
        col = tl.minimum(count // P, M - 1)
        # The page just handed out sits at column held_old == count // P: take it from the
        # register rather than reading back the store.
        cur = tl.load(table_ptr + r * M + col, mask=rm & ~ok, other=0)
        cur = tl.where(ok, page, cur)
        held = held + ok.to(tl.int32)
        tl.store(held_ptr + r, held, mask=rm)
        carried += tl.sum(need_i, 0)
        over = tl.maximum(over, tl.max((need & ~ok).to(tl.int32), 0))
        write = act & (count < held * P) & rm
        slot = tl.where(write, cur.to(tl.int64) * P + (count % P), trash)
        k = tl.load(k_ptr + b[:, None] * stride_kb + h[:, None] * stride_kh + d[None, :],
                    mask=rm[:, None], other=0.0)  # fmt: skip
        v = tl.load(v_ptr + b[:, None] * stride_vb + h[:, None] * stride_vh + d[None, :],
                    mask=rm[:, None], other=0.0)  # fmt: skip
        tl.store(k_pool + slot[:, None] * D + d[None, :], k, mask=rm[:, None])
        tl.store(v_pool + slot[:, None] * D + d[None, :], v, mask=rm[:, None])
        pos = tl.load(pos_ptr + b, mask=rm, other=0)
        tl.store(pos_pool + slot, pos.to(tl.int32), mask=rm)
        if HAS_KB:
            kb = tl.load(kb_ptr + b * stride_kbb + h * stride_kbh, mask=rm, other=0.0)
            tl.store(kb_pool + slot, kb.to(tl.float32), mask=rm)
        if HAS_SCORE:
            tl.store(score_pool + slot, tl.zeros([BLOCK_R], dtype=score_pool.dtype.element_ty),
                     mask=rm)  # fmt: skip
        tl.store(count_ptr + r, count + act.to(tl.int32), mask=rm)
    tl.store(n_free_ptr, n_free - carried)
    old = tl.load(overflow_ptr).to(tl.int32)
    tl.store(overflow_ptr, tl.maximum(old, over) != 0)


def check_append(cache, k_BHD, v_BHD, kb_BH, pos_B, active_BH) -> None:
    """Refuse inputs the kernel cannot take, naming which (the reference takes them all)."""
    B, H, _ = cache.table_BHM.shape
    D = cache.k_PSD.shape[2]
    for name, t in (("k_BHD", k_BHD), ("v_BHD", v_BHD)):
        if tuple(t.shape) != (B, H, D) or t.dtype != cache.k_PSD.dtype or t.stride(2) != 1:
            raise ValueError(f"{name} must be ({B}, {H}, {D}) {cache.k_PSD.dtype} with unit stride along D, got {tuple(t.shape)} {t.dtype}")  # fmt: skip
    if D & (D - 1):
        raise ValueError(f"the append kernel takes a power-of-two head dim, got {D}")
    if (kb_BH is None) != (cache.kb_PS is None):
        raise ValueError("kb_BH must be given exactly when the cache keeps key biases")
    if tuple(active_BH.shape) != (B, H) or active_BH.dtype != torch.bool:
        raise ValueError(f"active_BH must be a ({B}, {H}) bool tensor")
    if tuple(pos_B.shape) != (B,) or pos_B.dtype.is_floating_point or pos_B.stride(0) != 1:
        raise ValueError(f"pos_B must be a contiguous ({B},) integer tensor")
    for name in ("k_PSD", "v_PSD", "pos_PS", "table_BHM", "count_BH", "held_BH"):
        if not getattr(cache, name).is_contiguous():
            raise ValueError(f"the cache's {name} must be contiguous")


def paged_append(cache, k_BHD, v_BHD, kb_BH, pos_B, active_BH) -> None:
    """The module docstring's step on ``cache`` (a ``PagedKV``), in place, in one launch."""
    check_append(cache, k_BHD, v_BHD, kb_BH, pos_B, active_BH)
    B, H, M = cache.table_BHM.shape
    dummy = cache.count_BH
    kb = kb_BH if kb_BH is not None else dummy
    kernel = interpreted(_append_kernel) if interpreting() else compiled(_append_kernel)
    kernel[(1,)](
        k_BHD, v_BHD, kb, pos_B, active_BH,
        cache.k_PSD, cache.v_PSD, cache.pos_PS,
        cache.kb_PS if cache.kb_PS is not None else dummy,
        cache.score_PS if cache.score_PS is not None else dummy,
        cache.table_BHM, cache.count_BH, cache.held_BH, cache.free_F, cache.n_free, cache.overflow,
        k_BHD.stride(0), k_BHD.stride(1), v_BHD.stride(0), v_BHD.stride(1),
        kb.stride(0), kb.stride(1),
        active_BH.stride(0), active_BH.stride(1),
        B * H, H, M, cache.n_pages, cache.trash_slot,
        P=cache.page_size, D=cache.k_PSD.shape[2], HAS_KB=kb_BH is not None,
        HAS_SCORE=cache.score_PS is not None, BLOCK_R=BLOCK_R,
    )  # fmt: skip
