"""Compiled loops over a `PackedModel`: the two BitDelta-domain kernels of Krum and Multi-Krum.

Written by hand (numba) because no library does these loops well: both are a few operations per
sign bit, and numpy (or torch) can only run them as whole-array passes (XOR, popcount, per-group
sums, bit unpacking, table gathers), each writing a scratch array as large as the input and
reading it back. Here one loop per group keeps the work in registers and L1: the distances read
the sign words once; the mean reads them once and writes each output value once.

- `sq_distances`: sum over groups of c (s_i - s_j)^2 + 4 k_ij s_i s_j (see distances.py), with
  k = popcount(x_i XOR x_j) (the CPU's POPCNT through LLVM's ctpop), pair by pair over
  cache-sized runs of groups.
- `weighted_sum`: out = sum_r c_r(g) (2 b_r - 1). Element k of a sign byte x is +1 when bit k is
  set (packbits "little"), so a byte's 8 values are row x of a (256, 8) sign table; four
  contributors' rows are scaled and added as <8 x float> vectors (`_axpy8x4`, explicit LLVM
  vectors: numba's auto-vectoriser leaves this loop scalar and latency-bound, 3x slower).

The kernels release the GIL (`nogil=True`) and take a range of groups, so callers share ranges
among their own threads (no numba threading layer, hence no second OpenMP runtime beside
torch's). Compiled code is cached on disk (`cache=True`): the first call in a fresh install
compiles (a few seconds), later processes load it; `warm_up()` does that at server start.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["SIGN_TABLE", "sq_distances", "warm_up", "weighted_sum"]

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


@intrinsic
def _axpy8x4(typingctx, acc, ai, table, t0, t1, t2, t3, c0, c1, c2, c3):
    """acc[ai:ai+8] += (c0 table[t0:t0+8] + c1 table[t1:..]) + (c2 table[t2:..] + c3 table[t3:..])
    with <8 x float> vector operations (acc and table float32 C-contiguous arrays, c float32)."""

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
        builder.store(builder.fadd(builder.load(pa, align=4), total), pa, align=4)
        return context.get_dummy_value()

    return types.void(acc, ai, table, t0, t1, t2, t3, c0, c1, c2, c3), codegen


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
    sum_q |w_q s_q| per element.
    """
    m = rows.shape[0]
    for g in range(g0, g1):
        b0 = ends[g]
        nb = ends[g + 1] - b0
        out[8 * b0:8 * (b0 + nb)] = 0.0
        for q in range(0, m, 4):
            r0, r1, r2, r3 = rows[q], rows[q + 1], rows[q + 2], rows[q + 3]
            c0 = np.float32(weights[q] * scales[r0, g])
            c1 = np.float32(weights[q + 1] * scales[r1, g])
            c2 = np.float32(weights[q + 2] * scales[r2, g])
            c3 = np.float32(weights[q + 3] * scales[r3, g])
            for b in range(b0, b0 + nb):
                _axpy8x4(out, 8 * b, SIGN_TABLE,
                         np.intp(signs[r0, b]) * 8, np.intp(signs[r1, b]) * 8,
                         np.intp(signs[r2, b]) * 8, np.intp(signs[r3, b]) * 8, c0, c1, c2, c3)


def warm_up() -> None:
    """Compile (or load from the on-disk cache) the kernels for every word width used."""
    scales = np.ones((2, 1))
    ends = np.array([0, 1], dtype=np.int64)
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        for gw in (0, 1, 2):
            sq_distances(np.zeros((2, 1), dtype=dtype), scales, np.ones(1), ends, gw, 0, 1,
                         np.zeros((2, 2)))
    weighted_sum(np.zeros((2, 1), dtype=np.uint8), scales, np.zeros(4, dtype=np.int64), np.zeros(4),
                 ends, 0, 1, np.zeros(8, dtype=np.float32))
