"""Compiled loops (numba) over a `PackedModel`: how it is built, and the two BitDelta-domain kernels
of Krum and Multi-Krum.

- `sq_distances`: sum over groups of c (s_i - s_j)^2 + 4 k_ij s_i s_j, k = popcount(x_i XOR x_j).
- `gather`: lays every contributor's tensors end to end (`PackedModel.build`), one call for all.
- `weighted_sum`: out = sum_r c_r(g) (2 b_r - 1), from a (256, 8) sign table.

Every kernel takes a range of groups and releases the GIL, so callers share ranges among their own
threads. Compiled code is cached on disk; `warm_up()` compiles or loads it. Why hand-written, and how:
docs/design/aggregation.md.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["SIGN_TABLE", "TENSOR_FIELDS", "gather", "in_chunks", "in_group_ranges", "sq_distances", "warm_up",
           "weighted_sum"]

# (256 * 8,) float32: SIGN_TABLE[8 x + k] = +1 if bit k of byte x is set else -1
SIGN_TABLE = (((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1) * 2.0 - 1.0).astype(np.float32).ravel()
_GROUPS_PER_RUN = 2048  # sq_distances: groups per run, so n rows of a run stay in L2 across pairs


@intrinsic
def _popcount(typingctx, x):
    """Population count of an unsigned integer (LLVM ctpop: one POPCNT instruction)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return x(x), codegen


def _sum8x4_intrinsic(accumulate: bool):
    """acc[ai:ai+8] (+)= (c0 table[t0:t0+8] + c1 table[t1:..]) + (c2 table[t2:..] + c3 table[t3:..])
    with <8 x float> vector operations (acc and table float32 C-contiguous arrays, c float32);
    `accumulate=False` stores the sum (the first four contributors of a group), True adds it."""

    def sum8x4(typingctx, acc, ai, table, t0, t1, t2, t3, c0, c1, c2, c3):
        def codegen(context, builder, sig, args):
            vt = ir.VectorType(ir.FloatType(), 8)
            zeros = ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8)
            data = context.make_array(sig.args[2])(context, builder, args[2]).data

            def term(ti, c):
                splat = builder.insert_element(ir.Constant(vt, ir.Undefined), c, ir.Constant(ir.IntType(32), 0))
                splat = builder.shuffle_vector(splat, ir.Constant(vt, ir.Undefined), zeros)
                row = builder.load(builder.bitcast(builder.gep(data, [ti]), vt.as_pointer()), align=4)
                return builder.fmul(splat, row)

            total = builder.fadd(builder.fadd(term(args[3], args[7]), term(args[4], args[8])),
                                 builder.fadd(term(args[5], args[9]), term(args[6], args[10])))
            acc_data = context.make_array(sig.args[0])(context, builder, args[0]).data
            pa = builder.bitcast(builder.gep(acc_data, [args[1]]), vt.as_pointer())
            if accumulate:
                total = builder.fadd(builder.load(pa, align=4), total)
            builder.store(total, pa, align=4)
            return context.get_dummy_value()

        return types.void(acc, ai, table, t0, t1, t2, t3, c0, c1, c2, c3), codegen

    return intrinsic(sum8x4)


_set8x4 = _sum8x4_intrinsic(accumulate=False)
_axpy8x4 = _sum8x4_intrinsic(accumulate=True)


def pointer_intrinsic(element):
    """An intrinsic turning an integer address into a pointer to `element` (for `numba.carray`)."""
    ptr = types.CPointer(element)

    def at(typingctx, addr):
        if not isinstance(addr, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr))

        return ptr(addr), codegen

    return intrinsic(at)


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):
    """Copy `nbytes` bytes from address `src` to address `dst` (LLVM memcpy; numba's slice
    assignment copies byte by byte, 4x slower)."""
    if not all(isinstance(a, types.Integer) for a in (dst, src, nbytes)):
        return None

    def codegen(context, builder, signature, args):
        u8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(args[0], u8p), builder.inttoptr(args[1], u8p),
                           args[2], 1)
        return context.get_dummy_value()

    return types.void(dst, src, nbytes), codegen


_f32_at = pointer_intrinsic(types.float32)
_f64_at = pointer_intrinsic(types.float64)


# columns of `gather`'s per-tensor table (bytes, groups)
TENSOR_FIELDS = ("rows", "row_bytes_in", "first_byte", "full_groups", "full_bytes", "padded_full",
                 "padded_last", "groups_per_row", "scale_rows", "first_group")


@njit(nogil=True, cache=True)
def _copy_scales(sc, out, first_group, rows, g, scale_rows, mult):
    """out[first_group + r g + j] = sc[r g + j] * mult (sc[j] for every r when scale_rows is 1)."""
    for r in range(rows):
        s0 = r * g if scale_rows > 1 else 0
        d0 = first_group + r * g
        for j in range(g):
            out[d0 + j] = sc[s0 + j] * mult


@njit(nogil=True, cache=True)
def gather(addrs, scale_f64, mult, tensors, buf, scales_out):
    """Copy contributor i's tensor t (sign bytes, scales) into row i of `buf` and `scales_out`.

    addrs (n, T, 2) int64: addresses of a C-contiguous uint8 (rows, row_bytes_in) sign array
    and of C-contiguous (scale_rows, groups_per_row) scales, float64 where scale_f64[i, t]
    else float32; a single scale row is repeated for every row.
    tensors (T, len(TENSOR_FIELDS)) int64; buf (n, total) uint8 gets each group's bytes at its
    padded place, pad bytes set to 0; scales_out (n, G) float64 gets scale * mult[i].
    The caller guarantees the addresses point at arrays of exactly these shapes and dtypes.
    """
    n, n_t = addrs.shape[0], addrs.shape[1]
    for i in range(n):
        out = buf[i]
        dst = out.ctypes.data
        sc_out = scales_out[i]
        m = mult[i]
        for t in range(n_t):
            rows, nb, fb, full, gb, pf, pl, g, sr, fg = tensors[t]
            if rows == 0:
                continue
            src = addrs[i, t, 0]
            last = nb - gb * full
            row_out = pf * full + pl
            if pf == gb and pl == last:  # no padding in this tensor: one run of bytes
                _memcpy(dst + fb, src, rows * nb)
            else:
                for r in range(rows):
                    s0 = src + r * nb
                    d0 = fb + r * row_out
                    for j in range(full):
                        _memcpy(dst + d0 + j * pf, s0 + j * gb, gb)
                        out[d0 + j * pf + gb:d0 + (j + 1) * pf] = 0
                    d1 = d0 + full * pf
                    _memcpy(dst + d1, s0 + full * gb, last)
                    out[d1 + last:d1 + pl] = 0
            if scale_f64[i, t]:
                _copy_scales(carray(_f64_at(addrs[i, t, 1]), sr * g), sc_out, fg, rows, g, sr, m)
            else:
                _copy_scales(carray(_f32_at(addrs[i, t, 1]), sr * g), sc_out, fg, rows, g, sr, m)


@njit(nogil=True, cache=True)
def sq_distances(words, scales, counts, ends, group_words, g0, g1, out):
    """out[i, j] += sum over groups g in [g0, g1) of c(g) (s_i - s_j)^2 + 4 k_ij(g) s_i s_j, i < j.

    words (n, W) unsigned ints, group g's sign bits in words ends[g]:ends[g + 1] (zero padded);
    group_words: words in every group when all are alike (1 and 2 get unrolled loops), else 0;
    scales (n, G) float64; counts (G,) float64 elements per group; out (n, n) float64, upper
    triangle only. Both terms are >= 0: float64 sums without cancellation.
    """
    n = words.shape[0]
    for r0 in range(g0, g1, _GROUPS_PER_RUN):
        r1 = min(r0 + _GROUPS_PER_RUN, g1)
        for i in range(n - 1):
            x = words[i]
            for j in range(i + 1, n):
                y = words[j]
                signs = 0.0  # sum of k s_i s_j
                size = 0.0  # sum of c (s_i - s_j)^2
                for g in range(r0, r1):
                    if group_words == 2:
                        k = _popcount(x[2 * g] ^ y[2 * g]) + _popcount(x[2 * g + 1] ^ y[2 * g + 1])
                    elif group_words == 1:
                        k = _popcount(x[g] ^ y[g])
                    else:
                        k = 0
                        for w in range(ends[g], ends[g + 1]):
                            k += _popcount(x[w] ^ y[w])
                    si, sj = scales[i, g], scales[j, g]
                    signs += k * (si * sj)
                    size += counts[g] * ((si - sj) * (si - sj))
                out[i, j] += size + 4.0 * signs


@njit(nogil=True, cache=True)
def weighted_sum(signs, scales, rows, weights, ends, g0, g1, out):
    """out[8 b + k] = sum_q weights[q] scales[rows[q], g] (+1 if bit k of signs[rows[q], b] else -1)
    for every byte b of the groups g in [g0, g1) (group g is bytes ends[g]:ends[g + 1]).

    signs (n, B) uint8; scales (n, G) float64; rows int64 (m,), m a multiple of 4 (pad with
    weight 0); out float32 (8 B,). Each coefficient w s is rounded once to float32, then four
    contributors are summed pairwise and added to out: error <= (1.5 + m / 8) float32 eps times
    sum_q |w_q s_q| per element. m >= 4 (the first four set `out`).
    """
    m = rows.shape[0]
    for g in range(g0, g1):
        b0 = ends[g]
        nb = ends[g + 1] - b0
        for q in range(0, m, 4):
            r0, r1, r2, r3 = rows[q], rows[q + 1], rows[q + 2], rows[q + 3]
            c0 = np.float32(weights[q] * scales[r0, g])
            c1 = np.float32(weights[q + 1] * scales[r1, g])
            c2 = np.float32(weights[q + 2] * scales[r2, g])
            c3 = np.float32(weights[q + 3] * scales[r3, g])
            if q == 0:  # the first four set the output (no zeroing pass, no read)
                for b in range(b0, b0 + nb):
                    _set8x4(out, 8 * b, SIGN_TABLE,
                            np.intp(signs[r0, b]) * 8, np.intp(signs[r1, b]) * 8,
                            np.intp(signs[r2, b]) * 8, np.intp(signs[r3, b]) * 8, c0, c1, c2, c3)
            else:
                for b in range(b0, b0 + nb):
                    _axpy8x4(out, 8 * b, SIGN_TABLE,
                             np.intp(signs[r0, b]) * 8, np.intp(signs[r1, b]) * 8,
                             np.intp(signs[r2, b]) * 8, np.intp(signs[r3, b]) * 8, c0, c1, c2, c3)


T = TypeVar("T")
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _shutdown_pool() -> None:
    if _pool is not None:
        _pool.shutdown(wait=False)


def in_group_ranges(fn: Callable[[int, int], T], n_groups: int, threads: int) -> list[T]:
    """[fn(g0, g1) for each of `threads` equal ranges of groups 0..n_groups], run side by side.

    The kernels release the GIL, so the ranges run in parallel. The threads are kept between
    calls: starting a pool costs about 0.1-0.2 ms, as much as a tiny model's whole distance pass.
    """
    threads = max(1, min(threads, n_groups))
    if threads == 1:
        return [fn(0, n_groups)]
    pool = _threads(threads)
    cuts = np.linspace(0, n_groups, threads + 1).astype(int).tolist()
    futures = [pool.submit(fn, a, b) for a, b in zip(cuts[1:-1], cuts[2:])]
    first = fn(cuts[0], cuts[1])  # this thread takes the first range itself
    return [first] + [f.result() for f in futures]


def _threads(size: int) -> ThreadPoolExecutor:
    """The kernels' shared pool, grown to at least `size` threads."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < size:
            if _pool is not None:
                _pool.shutdown(wait=False)
            else:
                atexit.register(_shutdown_pool)
            _pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="zoo-gym-kernels")
            _pool_size = size
        return _pool


def in_chunks(fn: Callable[[int, int], T], n: int, *, min_chunk: int) -> list[T]:
    """[fn(a, b) for chunks [a, b) of 0..n, in order], at least `min_chunk` each, on every core this process may
    use, each thread taking the next chunk when it finishes one. For kernels whose every output element depends
    on its own chunk alone: a core another thread holds for a while (the checkpoint writer's, for which torch's
    threads are lowered during a publish) slows only the chunks it runs, so these need not give it up."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    chunks = max(1, min(n // max(min_chunk, 1), 4 * cores))
    if cores == 1 or chunks == 1:
        return [fn(0, n)]
    cuts = np.linspace(0, n, chunks + 1).astype(int).tolist()
    pool = _threads(cores)
    return [f.result() for f in [pool.submit(fn, a, b) for a, b in zip(cuts[:-1], cuts[1:])]]


def warm_up() -> None:
    """Compile (or load from the on-disk cache) the kernels for every word width used."""
    scales = np.ones((2, 1))
    ends = np.array([0, 1], dtype=np.int64)
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        for gw in (0, 1, 2):
            sq_distances(np.zeros((2, 1), dtype=dtype), scales, np.ones(1), ends, gw, 0, 1,
                         np.zeros((2, 2)))
    signs, sc32 = np.zeros(1, dtype=np.uint8), np.ones(1, dtype=np.float32)
    gather(np.array([[[signs.ctypes.data, sc32.ctypes.data]]]), np.zeros((1, 1), dtype=np.bool_),
           np.ones(1), np.array([[1, 1, 0, 0, 1, 8, 8, 1, 1, 0]], dtype=np.int64),
           np.zeros((1, 8), dtype=np.uint8), np.zeros((1, 1)))
    weighted_sum(np.zeros((2, 1), dtype=np.uint8), scales, np.zeros(4, dtype=np.int64), np.zeros(4),
                 ends, 0, 1, np.zeros(8, dtype=np.float32))
