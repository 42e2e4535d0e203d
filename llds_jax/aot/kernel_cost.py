"""What one call of the ragged paged attention kernel costs on one chip, counted from the kernel's grid and index maps
as JAX 0.10.2 ships it (`jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel`), for the step estimate
(`llds_jax.aot.step_estimate`). A model of what the kernel executes, not a measurement.

How `llds_jax.model.paged_attention` calls it: on each chip (a `shard_map` over the key/value heads), with that
chip's N query heads and K key/value heads (the pool's 2K rows per slot: keys and values interleaved), pages of Z
slots, the page table's M pages per sequence, and the tile (bkv, bq) = (min(kv_pages_per_block, M),
min(queries_per_block, T)), 32 and 32 when the caller names none (`paged_attention.KERNEL_KV_PAGES_PER_BLOCK`,
`KERNEL_QUERIES_PER_BLOCK`). T is the q operand's tokens: the token bucket in a step's ragged forward, the S sequence
slots in a decode iteration (`rollout.runner.step_program` passes every slot, those no longer sampling with
kv_len 1 and page table row 0).

What the kernel does (read from its source):
- Grid (heads blocks, q blocks) = (N / n_h, ceil(T / bq)), both "arbitrary" (run in order, heads outermost), where
  (n_h, c) = `get_min_heads_per_blk(N, 2K, q dtype, kv dtype)` are the query heads and pool rows of a heads block
  (its own helper, imported here). q has BlockSpec [bq, n_h, H] at index map (q block, heads block, 0) and the output
  the same: every grid step copies its q block in and its output block out, whether it has work or not. The pool
  stays in HBM (memory space ANY): the kernel copies pages itself.
- Grid step (h, b) loops over sequences from the one the step before stopped at (carried in scalar memory), while
  b x bq < cu_q_lens[num_seqs] and the sequence < num_seqs; a sequence whose tokens end inside or at the end of the
  block moves the loop to the next one, a sequence whose tokens run past the block ends this step and is taken up
  again by the next q block (from its first kv block). So sequence s is visited once by each q block holding one of
  its tokens.
- A visit loops over kv blocks j while j x bkv x Z < kv_len: ceil(kv_len / (bkv Z)) blocks. Each waits for its copy
  (started one block earlier, double-buffered), starts the next one's (the next kv block of this sequence, else kv
  block 0 of the next sequence visited, else of sequence 0 in the next heads block: no copy is started that is not
  waited for, when every sequence has tokens), then, for each key/value head, flash attention of the whole q block's
  [bq x N / K, H] queries against the block's whole [bkv x Z, H] keys: QK^T and PV on the MXU at full size, the causal
  and kv_len masks applied to the products, rows of other sequences and padding masked only at the store.
- A kv block's copy (`MultiPageAsyncCopyDescriptor`) is bkv page copies of [Z, c, H]: the sequence's page-table
  entries j x bkv .. j x bkv + bkv - 1, each entry at or past ceil(kv_len / Z) replaced by entry 0
  (`lax.select(page_idx < end_page_idx, page_idx, 0)`: the sequence's first page, copied again). Every kv block moves
  bkv whole pages, whatever the sequence's length.
- Skipped: q blocks starting at or past cu_q_lens[num_seqs] (no sequence loop: no copy, no FLOPs; their q and output
  blocks are still copied), rows past num_seqs, kv blocks past a sequence's kv_len. Not skipped: q rows of other
  sequences or padding in a visited q block, slots past kv_len in a sequence's last kv block, pages past its end in
  that block (page 0, copied), a decode iteration's rows that no longer sample (one kv block each).

Per call, with V visits (sequence x q block x kv block) per heads block:
  page copies  V x bkv per heads block;   pool bytes  V x bkv x Z x 2K x H x itemsize (all heads blocks);
  MXU FLOPs    V x 4 x bq x N x bkv x Z x H (QK^T and PV: 2 FLOPs per multiply-add, all heads);
  q/out bytes  2 x ceil(T / bq) x bq x N x H x itemsize;   grid steps  heads blocks x ceil(T / bq).
Not counted: the VPU's and EUP's work (masks, exp, the online softmax's rescaling), the scalar loops' overhead, the
wait on a copy not hidden behind the previous block's compute (the roofline takes max(FLOPs, bytes)).

The model takes calls whose every sequence has tokens (q_len >= 1, the engine's: `rollout.engine`) and kv_len >=
q_len; a sequence without tokens would be visited by the q block holding its start (at a block boundary at the
batch's end, by none), which is not modelled: `kernel_call` raises.

Dimension letters: S sequences of the call, T tokens of its q operand.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """One chip's kernel calls of one layer: its heads, pages and tile as `paged_attention` passes them.

    Attributes:
      num_heads: query heads N on the chip.
      num_kv_heads: key/value heads K on the chip (the pool's 2K rows per slot).
      head_dim: H.
      page_size: Z, slots per page.
      pages_per_seq: M, the page table's pages per sequence.
      dtype: the queries' and the pool's dtype (the rollout's compute dtype), a dtype name ("bfloat16").
      kv_pages_per_block: the tile's pages per kv block as passed (clipped to M by `paged_attention`).
      queries_per_block: the tile's tokens per q block as passed (clipped to T).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_seq: int
    dtype: str
    kv_pages_per_block: int
    queries_per_block: int

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    @property
    def block_pages(self) -> int:
        """bkv: pages per kv block."""
        return min(self.kv_pages_per_block, self.pages_per_seq)

    def block_queries(self, tokens: int) -> int:
        """bq: tokens per q block of a call whose q operand has `tokens` tokens."""
        return min(self.queries_per_block, tokens)

    @property
    def heads_blocks(self) -> int:
        """The grid's heads blocks: N over the query heads of a block (`rpa.get_min_heads_per_blk`)."""
        per_block, _ = rpa.get_min_heads_per_blk(self.num_heads, 2 * self.num_kv_heads, jnp.dtype(self.dtype),
                                                 jnp.dtype(self.dtype))
        return self.num_heads // per_block

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of the chip's pool rows (all its key/value heads): Z x 2K x H x itemsize."""
        return self.page_size * 2 * self.num_kv_heads * self.head_dim * self.itemsize


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One kernel call's work on one chip (module docstring).

    Attributes:
      grid_steps: heads blocks x q blocks.
      visits_s: per sequence its kv blocks computed in one heads block, over all the q blocks visiting it.
      page_copies: pages copied from HBM, all heads blocks (each heads block copies its share of each page's rows).
      useful_page_copies: of those, the pages a sequence holds (ceil(kv_len / Z) per visit of its q blocks).
      pool_bytes: bytes copied from the pool, all heads blocks.
      q_out_bytes: bytes of the q blocks copied in and the output blocks copied out.
      flops: MXU FLOPs (QK^T and PV of whole q blocks against whole kv blocks).
    """

    grid_steps: int
    visits_s: tuple[int, ...]
    page_copies: int
    useful_page_copies: int
    pool_bytes: float
    q_out_bytes: float
    flops: float

    @property
    def hbm_bytes(self) -> float:
        return self.pool_bytes + self.q_out_bytes


def q_blocks_visiting(q_lens_s: np.ndarray, block_queries: int) -> np.ndarray:
    """Per sequence the q blocks of `block_queries` tokens that hold one of its tokens (sequences back to back from
    token 0, each with >= 1 token): int [S]."""
    end_s = np.cumsum(q_lens_s)
    start_s = end_s - q_lens_s
    return (end_s - 1) // block_queries - start_s // block_queries + 1


def kernel_call(shape: KernelShape, tokens: int, q_lens_s, kv_lens_s) -> KernelCall:
    """The work of one kernel call on one chip (module docstring): a q operand of `tokens` tokens holding S
    sequences back to back, sequence s with q_lens_s[s] new tokens and kv_lens_s[s] slots (its cached ones and
    the new ones). Raises ValueError for a call the model does not take (a sequence without tokens, kv_len <
    q_len, more tokens than the operand, more slots than M pages hold)."""
    q_lens_s, kv_lens_s = np.asarray(q_lens_s, np.int64), np.asarray(kv_lens_s, np.int64)
    if q_lens_s.shape != kv_lens_s.shape:
        raise ValueError(f"kernel_call: {q_lens_s.size} q lengths, {kv_lens_s.size} kv lengths")
    if q_lens_s.size and (q_lens_s.min() < 1 or (kv_lens_s < q_lens_s).any()):
        raise ValueError("kernel_call: every sequence needs q_len >= 1 and kv_len >= q_len")
    if q_lens_s.sum() > tokens or (kv_lens_s > shape.pages_per_seq * shape.page_size).any():
        raise ValueError(f"kernel_call: {q_lens_s.sum()} tokens in an operand of {tokens}, or a kv length past "
                         f"{shape.pages_per_seq} pages of {shape.page_size}")
    bq, bkv = shape.block_queries(tokens), shape.block_pages
    q_blocks = math.ceil(tokens / bq)
    kv_blocks_s = -(-kv_lens_s // (bkv * shape.page_size))
    q_visits_s = q_blocks_visiting(q_lens_s, bq) if q_lens_s.size else q_lens_s
    visits_s = q_visits_s * kv_blocks_s
    visits = int(visits_s.sum())
    heads_blocks = shape.heads_blocks
    return KernelCall(
        grid_steps=heads_blocks * q_blocks,
        visits_s=tuple(int(v) for v in visits_s),
        page_copies=heads_blocks * visits * bkv,
        useful_page_copies=heads_blocks * int((q_visits_s * -(-kv_lens_s // shape.page_size)).sum()),
        pool_bytes=float(visits * bkv * shape.page_bytes),
        q_out_bytes=float(2 * q_blocks * bq * shape.num_heads * shape.head_dim * shape.itemsize),
        flops=float(visits) * 4 * bq * shape.num_heads * bkv * shape.page_size * shape.head_dim)
