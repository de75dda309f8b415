"""CPU kernel of bitdelta_linear's per-variant part: ``d[t, o] = sum_g scale[o, g] sum_{i in g} x[t, i] sign(o, i)``.

Read straight from the packed signs (uint8 (out, ceil(in/8)), bit k of byte j = input 8 j + k, bit 1 =
+scale; zoo_gym/codec/bitdelta.py), never unpacked to a float tile. With b the sign bits,
``sum_i x_i (2 b_i - 1) = 2 S_set - S_all``: ``S_all`` (the group sums of x) is computed once per token,
and ``S_set`` (the sum of the x_i whose bit is set) is one masked vector add per 16 weights: a 16-bit
word of signs is the lane mask of ``acc += select(mask, x[16 w : 16 w + 16], 0)`` (an AVX-512 masked
``vaddps``; numba's auto-vectoriser does not find this, so `_sum_set` writes the loop in LLVM IR, as
zoo_gym/aggregation/packed_kernels.py does). Four output rows share each load of x; each group's vector
sum is multiplied by its scale and reduced once per row. Groups whose byte length is odd use 8-lane
words instead.

`delta_rows` takes a range of (variant, block of outputs) work items and releases the GIL; the caller
splits the items among its threads. Not numba's ``prange``: its OpenMP layer beside torch's own
OpenMP runtime made a 16-variant call 15-200x slower here (two runtimes' threads spinning on 2
cores), and its workqueue layer aborts the process when two threads launch kernels at once.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from zoo_gym.aggregation.packed_kernels import _pointer_intrinsic  # address -> pointer, shared

__all__ = ["OUT_BLOCK", "delta_rows", "group_sums", "n_items"]


_u8_at = _pointer_intrinsic(types.uint8)
_f32_at = _pointer_intrinsic(types.float32)

OUT_BLOCK = 64  # output rows per parallel work item (a multiple of 4)


def _sum_set_intrinsic(lanes: int, rows: int):
    """out[r * out_stride] = sum_g scales[r * sc_stride + g] * (sum of x[i] over the set bits i of group g
    in sign row r), for r < `rows`, with `lanes`-bit words (8 or 16) of signs and groups of
    `words_per_group` words. Arguments are addresses (int64) and counts (int64); x float32 has
    n_groups * words_per_group * lanes elements (zero past the row), signs rows start `row_bytes` apart.
    """
    fvec = ir.VectorType(ir.FloatType(), lanes)
    mask_t = ir.VectorType(ir.IntType(1), lanes)
    word_t = ir.IntType(lanes)

    def sum_set(typingctx, x_addr, s_addr, row_bytes, words_per_group, n_groups, sc_addr, sc_stride, out_addr,
                out_stride):
        sig = types.void(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64,
                         types.int64, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            x_a, s_a, rb, wpg, ng, sc_a, sc_st, o_a, o_st = args
            i64 = ir.IntType(64)
            f32p = ir.FloatType().as_pointer()
            zero = ir.Constant(fvec, [0.0] * lanes)
            x_p = builder.inttoptr(x_a, f32p)
            sc_p = builder.inttoptr(sc_a, f32p)
            o_p = builder.inttoptr(o_a, f32p)
            s_p = builder.inttoptr(s_a, ir.IntType(8).as_pointer())
            tot = [cgutils.alloca_once_value(builder, zero) for _ in range(rows)]
            acc = [cgutils.alloca_once_value(builder, zero) for _ in range(rows)]
            with cgutils.for_range(builder, ng, intp=i64) as gl:
                g = gl.index
                for a in acc:
                    builder.store(zero, a)
                with cgutils.for_range(builder, wpg, intp=i64) as wl:
                    w = builder.add(builder.mul(g, wpg), wl.index)  # word index in the row
                    xv = builder.load(builder.bitcast(builder.gep(x_p, [builder.mul(w, ir.Constant(i64, lanes))]),
                                                      fvec.as_pointer()), align=4)
                    byte = builder.mul(w, ir.Constant(i64, lanes // 8))
                    for r in range(rows):
                        at = builder.gep(s_p, [builder.add(builder.mul(ir.Constant(i64, r), rb), byte)])
                        m = builder.bitcast(builder.load(builder.bitcast(at, word_t.as_pointer()), align=1), mask_t)
                        builder.store(builder.fadd(builder.load(acc[r]), builder.select(m, xv, zero)), acc[r])
                for r in range(rows):
                    sc = builder.load(builder.gep(sc_p, [builder.add(builder.mul(ir.Constant(i64, r), sc_st), g)]))
                    splat = builder.shuffle_vector(builder.insert_element(ir.Constant(fvec, ir.Undefined), sc,
                                                                          ir.Constant(ir.IntType(32), 0)),
                                                   ir.Constant(fvec, ir.Undefined),
                                                   ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))
                    builder.store(builder.fadd(builder.load(tot[r]), builder.fmul(builder.load(acc[r]), splat)), tot[r])
            for r in range(rows):
                v, width = builder.load(tot[r]), lanes
                while width > 1:  # pairwise halving reduction
                    width //= 2
                    lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), width),
                                                                  list(range(width))))
                    hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), width),
                                                                  list(range(width, 2 * width))))
                    v = builder.fadd(lo, hi)
                s = builder.extract_element(v, ir.Constant(ir.IntType(32), 0))
                builder.store(s, builder.gep(o_p, [builder.mul(ir.Constant(i64, r), o_st)]))
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(sum_set)


_set16x4 = _sum_set_intrinsic(16, 4)
_set16x1 = _sum_set_intrinsic(16, 1)
_set8x4 = _sum_set_intrinsic(8, 4)
_set8x1 = _sum_set_intrinsic(8, 1)


def n_items(n_var: int, out_f: int) -> int:
    """Work items of `delta_rows`: (variant, block of OUT_BLOCK outputs) pairs."""
    return n_var * -(-out_f // OUT_BLOCK)


@njit(nogil=True, cache=True)
def group_sums(x, group_len, out):
    """out[t, g] = sum of x[t, g * group_len : (g + 1) * group_len]; x float32 (n, cols), out float32 (n, G)."""
    n, cols = x.shape
    for t in range(n):
        for g in range(out.shape[1]):
            s = np.float32(0.0)
            for i in range(g * group_len, min(cols, (g + 1) * group_len)):
                s += x[t, i]
            out[t, g] = s


@njit(nogil=True, cache=True)
def delta_rows(x, gsum, tok_start, sign_addrs, scale_addrs, log8_refs, log8_mult, scale_rows, out_f, nbytes,
               group_bytes, i0, i1, out):
    """out[t, o] = sum_g scale_v[o, g] sum_{i in g} x[t, i] (+1 if bit i of s_v[o] else -1).

    x float32 (n_tok, W) zero past the row, W >= ceil(in / group) * group bytes * 8; gsum float32
    (n_tok, n_groups) its group sums. Tokens tok_start[v]:tok_start[v + 1] use variant slot v: signs
    uint8 C-contiguous (out_f, nbytes) at address sign_addrs[v], scales C-contiguous (scale_rows[v] in
    (1, out_f), n_groups) at scale_addrs[v]: float32 when log8_refs[v] < 0, else uint8 log8 codes c
    meaning float32(log8_refs[v] * log8_mult[c]) as the codec decodes them (one block's scales are
    decoded into a small buffer per work item). out float32 (n_tok, out_f) C-contiguous.
    Groups of `group_bytes` bytes; a short last group reads on into the next row's bytes, over x's zeros
    (no effect), and the array's very last row is read from a zero-padded copy. Work items
    i0:i1 of the n_var * ceil(out_f / OUT_BLOCK) (variant, output block) items, variant-major.
    """
    n_groups = gsum.shape[1]
    n_blocks = (out_f + OUT_BLOCK - 1) // OUT_BLOCK
    even = group_bytes % 2 == 0
    wpg = group_bytes // 2 if even else group_bytes
    x_row = x.shape[1] * 4  # bytes per x row
    span = -(-nbytes // group_bytes) * group_bytes  # bytes the groups of one row read
    safe_rows = out_f - 1 if span > nbytes else out_f  # the last row would read past its array: padded copy
    for item in range(i0, i1):
        v = item // n_blocks
        o0 = (item % n_blocks) * OUT_BLOCK
        o1 = min(out_f, o0 + OUT_BLOCK)
        t0, t1 = tok_start[v], tok_start[v + 1]
        sr = scale_rows[v]
        b0, nb = (o0, o1 - o0) if sr > 1 else (0, 1)  # scale rows of this block
        blk = np.empty((nb, n_groups), dtype=np.float32)  # this block's scales, float32
        ref = log8_refs[v]
        if ref < 0:
            blk[:, :] = carray(_f32_at(scale_addrs[v] + b0 * n_groups * 4), (nb, n_groups))
        else:
            codes = carray(_u8_at(scale_addrs[v] + b0 * n_groups), (nb, n_groups))
            for r in range(nb):
                for g in range(n_groups):
                    blk[r, g] = ref * log8_mult[codes[r, g]]
        sc_st = n_groups if sr > 1 else 0  # floats between scale rows
        ba = blk.ctypes.data
        last = np.zeros(span, dtype=np.uint8)
        if safe_rows < o1:
            src = carray(_u8_at(sign_addrs[v] + safe_rows * nbytes), (nbytes,))
            last[:nbytes] = src
        for t in range(t0, t1):
            xa = x.ctypes.data + t * x_row
            oa = out.ctypes.data + (t * out_f) * 4
            o = o0
            while o + 4 <= min(o1, safe_rows):
                sa, ca = sign_addrs[v] + o * nbytes, ba + (o - o0) * sc_st * 4
                if even:
                    _set16x4(xa, sa, nbytes, wpg, n_groups, ca, sc_st, oa + o * 4, 1)
                else:
                    _set8x4(xa, sa, nbytes, wpg, n_groups, ca, sc_st, oa + o * 4, 1)
                o += 4
            while o < o1:
                sa = sign_addrs[v] + o * nbytes if o < safe_rows else last.ctypes.data
                ca = ba + (o - o0) * sc_st * 4
                if even:
                    _set16x1(xa, sa, nbytes, wpg, n_groups, ca, 0, oa + o * 4, 1)
                else:
                    _set8x1(xa, sa, nbytes, wpg, n_groups, ca, 0, oa + o * 4, 1)
                o += 1
            for o in range(o0, o1):  # d = 2 S_set - sum_g scale_g S_all,g
                srow = o - o0 if sr > 1 else 0
                corr = np.float32(0.0)
                for g in range(n_groups):
                    corr += blk[srow, g] * gsum[t, g]
                out[t, o] = 2 * out[t, o] - corr
