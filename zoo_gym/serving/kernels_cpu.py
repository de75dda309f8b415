"""CPU kernel of bitdelta_linear's per-variant part: ``d[t, o] = sum_g scale[o, g] sum_{i in g} x[t, i] sign(o, i)``.

Read straight from the packed signs (uint8 (out, ceil(in/8)), bit k of byte j = input 8 j + k, bit 1 =
+scale; zoo_gym/codec/bitdelta.py), never unpacked in memory; written in LLVM IR through numba. bf16
activations on AVX512-BF16 CPUs use ``vdpbf16ps`` (x stored in the lane order of kernels.py's
``_kernel_x``); float32 ones a masked select per word. Scales are float32 or decoded inline from log8
codes exactly as the codec decodes them. `delta_rows` takes a range of (variant, block of outputs) work
items and releases the GIL; the caller splits the items among its threads.
How, and why not ``prange``: docs/design/serving.md.
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding, ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from zoo_gym.aggregation.packed_kernels import pointer_intrinsic  # address -> pointer, shared

__all__ = ["HAS_BF16_DOT", "OUT_BLOCK", "delta_rows", "n_items"]


_u8_at = pointer_intrinsic(types.uint8)

OUT_BLOCK = 64  # output rows per parallel work item (a multiple of ROWS)
ROWS = 8  # output rows per kernel call: 8 independent accumulators hide the add's latency
# numba compiles for the host CPU: the bf16 form exists only where the instruction does
HAS_BF16_DOT = "+avx512bf16" in binding.get_host_cpu_features().flatten().split(",")
_BF16_MINUS_ONE, _BF16_SIGN = 0xBF80, 0x8000
# Signs are read once per token from memory (16 variants' signs are far larger than the caches): asking for
# the rows 3 calls ahead doubled the kernel's speed here (7 -> 11 GB/s from DRAM, torch's bf16 matmul's rate)
PREFETCH_ROWS = 3 * ROWS


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite has no class for it): the operand type of the dpbf16ps intrinsic."""

    def _to_string(self) -> str:
        return "bfloat"

    def __eq__(self, other) -> bool:
        return isinstance(other, _BFloat)

    def __hash__(self) -> int:
        return hash("bfloat")


def _splat(builder, value, vec_t):
    undef = ir.Constant(vec_t, ir.Undefined)
    first = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(first, undef, ir.Constant(ir.VectorType(ir.IntType(32), vec_t.count),
                                                            [0] * vec_t.count))


def _group_scale(builder, sc_f32, sc_u8, tab, k, ref):
    """float32 scale number k: sc_f32[k] when ref < 0, else float32(ref * tab[sc_u8[k]]) (log8 codes)."""
    f32 = ir.FloatType()
    with builder.if_else(builder.fcmp_ordered("<", ref, ir.Constant(f32, 0.0))) as (plain, coded):
        with plain:
            plain_bb, plain_v = builder.block, builder.load(builder.gep(sc_f32, [k]))
        with coded:
            code = builder.zext(builder.load(builder.gep(sc_u8, [k])), ir.IntType(64))
            coded_v = builder.fmul(ref, builder.load(builder.gep(tab, [code])))
            coded_bb = builder.block
    phi = builder.phi(f32)
    phi.add_incoming(plain_v, plain_bb)
    phi.add_incoming(coded_v, coded_bb)
    return phi


def _bf16_dot(builder, dot, acc, a, b):
    """acc (16 x float32) + pairwise sums of a * b (32 x bf16 bits, i16): ``vdpbf16ps``, or where the CPU
    lacks it (`dot` None) the same sums through float32 (never chosen there by the caller, kept correct)."""
    if dot is not None:
        bvec = ir.VectorType(_BFloat(), 32)
        return builder.call(dot, [acc, builder.bitcast(a, bvec), builder.bitcast(b, bvec)])
    i32x32, f32x32 = ir.VectorType(ir.IntType(32), 32), ir.VectorType(ir.FloatType(), 32)

    def widen(bits):  # bf16 bits -> float32
        return builder.bitcast(builder.shl(builder.zext(bits, i32x32), ir.Constant(i32x32, [16] * 32)), f32x32)

    prod = builder.fmul(widen(a), widen(b))
    half = ir.VectorType(ir.IntType(32), 16)
    even = builder.shuffle_vector(prod, prod, ir.Constant(half, list(range(0, 32, 2))))
    odd = builder.shuffle_vector(prod, prod, ir.Constant(half, list(range(1, 32, 2))))
    return builder.fadd(acc, builder.fadd(even, odd))


def _store_row_sums(builder, tot: list, o_p) -> None:
    """out[r] = the sum of the lanes of the vector at tot[r], for each row r."""
    for r, at in enumerate(tot):
        v, width = builder.load(at), at.type.pointee.count
        while width > 1:  # pairwise halving reduction
            width //= 2
            half = ir.VectorType(ir.IntType(32), width)
            v = builder.fadd(builder.shuffle_vector(v, v, ir.Constant(half, list(range(width)))),
                             builder.shuffle_vector(v, v, ir.Constant(half, list(range(width, 2 * width)))))
        builder.store(builder.extract_element(v, ir.Constant(ir.IntType(32), 0)),
                      builder.gep(o_p, [ir.Constant(ir.IntType(64), r)]))


def _signed_dot_intrinsic(kind: str, rows: int):
    """out[r] = sum_g scale(r, g) sum_{i in g} x[i] (+1 if bit i of sign row r is set, else -1), r < `rows`.

    kind "bf16" (x bf16 bits in the lane order above, 32-bit words), "f32x16" or "f32x8" (x float32, 16-
    or 8-bit words). Arguments (int64 addresses and counts, float32 ref): x (n_groups * words_per_group
    words, zero past the row), signs (rows `row_bytes` apart), words_per_group, n_groups, scales
    (float32 when ref < 0, else uint8 log8 codes; rows `sc_stride` elements apart), ref, the log8
    table (float32 (256,)), out (float32, `rows` consecutive).
    """
    i64, f32 = ir.IntType(64), ir.FloatType()
    bf16 = kind == "bf16"
    lanes = 32 if bf16 else int(kind[4:])
    acc_t = ir.VectorType(f32, 16 if bf16 else lanes)
    x_elem = ir.IntType(16) if bf16 else f32
    x_t = ir.VectorType(x_elem, lanes)

    def signed_dot(typingctx, x_addr, s_addr, row_bytes, words_per_group, n_groups, sc_addr, sc_stride, ref,
                   tab_addr, out_addr):
        sig = types.void(types.int64, types.int64, types.int64, types.int64, types.int64, types.int64,
                         types.int64, types.float32, types.int64, types.int64)

        def codegen(context, builder, signature, args):
            x_a, s_a, rb, wpg, ng, sc_a, sc_st, ref_v, tab_a, o_a = args
            zero = ir.Constant(acc_t, [0.0] * acc_t.count)
            x_p = builder.inttoptr(x_a, x_elem.as_pointer())
            s_p = builder.inttoptr(s_a, ir.IntType(8).as_pointer())
            sc_f32, sc_u8 = builder.inttoptr(sc_a, f32.as_pointer()), builder.inttoptr(sc_a, ir.IntType(8).as_pointer())
            tab, o_p = builder.inttoptr(tab_a, f32.as_pointer()), builder.inttoptr(o_a, f32.as_pointer())
            if bf16:
                bvec = ir.VectorType(_BFloat(), 32)
                dot = (cgutils.get_or_insert_function(builder.module, ir.FunctionType(acc_t, [acc_t, bvec, bvec]),
                                                      "llvm.x86.avx512bf16.dpbf16ps.512") if HAS_BF16_DOT else None)
                shift = ir.Constant(x_t, [15 - lane // 2 for lane in range(32)])  # lane's bit -> bit 15
                i32x16 = ir.VectorType(ir.IntType(32), 16)
            prefetch = cgutils.get_or_insert_function(  # (address, read, keep in all levels, data)
                builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()] + [ir.IntType(32)] * 3),
                "llvm.prefetch.p0")
            tot = [cgutils.alloca_once_value(builder, zero) for _ in range(rows)]
            acc = [cgutils.alloca_once_value(builder, zero) for _ in range(rows)]
            with cgutils.for_range(builder, ng, intp=i64) as gl:
                g = gl.index
                for a in acc:
                    builder.store(zero, a)
                group_at = builder.mul(g, builder.mul(wpg, ir.Constant(i64, lanes // 8)))  # byte in the row
                for r in range(rows):  # this group's signs PREFETCH_ROWS rows further on (no fault past the end)
                    row = builder.mul(ir.Constant(i64, r + PREFETCH_ROWS), rb)
                    ahead = builder.gep(s_p, [builder.add(row, group_at)])
                    builder.call(prefetch, [ahead] + [ir.Constant(ir.IntType(32), k) for k in (0, 3, 1)])
                with cgutils.for_range(builder, wpg, intp=i64) as wl:
                    w = builder.add(builder.mul(g, wpg), wl.index)  # word index in the row
                    x_at = builder.gep(x_p, [builder.mul(w, ir.Constant(i64, lanes))])
                    xv = builder.load(builder.bitcast(x_at, x_t.as_pointer()), align=4)
                    if not bf16:
                        neg_xv = builder.fneg(xv)
                    byte = builder.mul(w, ir.Constant(i64, lanes // 8))
                    for r in range(rows):
                        at = builder.gep(s_p, [builder.add(builder.mul(ir.Constant(i64, r), rb), byte)])
                        word = builder.load(builder.bitcast(at, ir.IntType(lanes).as_pointer()), align=1)
                        if bf16:  # +-1.0 in bf16: (bit << (15 - L // 2)) & 0x8000 ^ bits(-1.0)
                            bits = builder.shl(builder.bitcast(_splat(builder, word, i32x16), x_t), shift)
                            pm = builder.xor(builder.and_(bits, ir.Constant(x_t, [_BF16_SIGN] * 32)),
                                             ir.Constant(x_t, [_BF16_MINUS_ONE] * 32))
                            new = _bf16_dot(builder, dot, builder.load(acc[r]), xv, pm)
                        else:
                            mask = builder.bitcast(word, ir.VectorType(ir.IntType(1), lanes))
                            new = builder.fadd(builder.load(acc[r]), builder.select(mask, xv, neg_xv))
                        builder.store(new, acc[r])
                for r in range(rows):
                    k = builder.add(builder.mul(ir.Constant(i64, r), sc_st), g)
                    scale = _splat(builder, _group_scale(builder, sc_f32, sc_u8, tab, k, ref_v), acc_t)
                    builder.store(builder.fadd(builder.load(tot[r]), builder.fmul(builder.load(acc[r]), scale)), tot[r])
            _store_row_sums(builder, tot, o_p)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(signed_dot)


_f16_rows, _f16_one = _signed_dot_intrinsic("f32x16", ROWS), _signed_dot_intrinsic("f32x16", 1)
_f8_rows, _f8_one = _signed_dot_intrinsic("f32x8", ROWS), _signed_dot_intrinsic("f32x8", 1)
_bf_rows, _bf_one = _signed_dot_intrinsic("bf16", ROWS), _signed_dot_intrinsic("bf16", 1)


def n_items(n_var: int, out_f: int) -> int:
    """Work items of `delta_rows`: (variant, block of OUT_BLOCK outputs) pairs."""
    return n_var * -(-out_f // OUT_BLOCK)


@njit(nogil=True, cache=True)
def delta_rows(x, tok_start, dest, sign_addrs, scale_addrs, log8_refs, log8_mult, scale_rows, out_f, nbytes,
               group_bytes, i0, i1, out):
    """out[t, o] = sum_g scale_v[o, g] sum_{i in g} x[t, i] (+1 if bit i of s_v[o] else -1).

    x (n_tok, W) zero past the row, W = n_groups * group_bytes * 8: float32, or bf16 bits (uint16) in
    the bf16 form's lane order within each 32 inputs, for groups of a multiple of 4 bytes (uses the bf16
    form; only where HAS_BF16_DOT, which the caller checks). Tokens tok_start[v]:tok_start[v + 1] use
    variant slot v: signs uint8 C-contiguous (out_f, nbytes) at address sign_addrs[v], scales
    C-contiguous (scale_rows[v] in (1, out_f), n_groups) at scale_addrs[v]: float32 when log8_refs[v] < 0,
    else uint8 log8 codes c meaning float32(log8_refs[v] * log8_mult[c]). Token t's deltas go to row dest[t]
    of out, float32 (n_rows, out_f) C-contiguous. A short last group reads on into the next row's bytes,
    over x's zeros (no effect), and the array's very last row is read from a zero-padded copy. Work items
    i0:i1 of the n_var * ceil(out_f / OUT_BLOCK) (variant, output block) items, variant-major.
    """
    bf16 = x.itemsize == 2
    form = 0 if bf16 else (1 if group_bytes % 2 == 0 else 2)  # bf16 / f32 16-lane / f32 8-lane
    wpg = group_bytes // 4 if bf16 else (group_bytes // 2 if form == 1 else group_bytes)
    n_groups = x.shape[1] // (group_bytes * 8)
    n_blocks = (out_f + OUT_BLOCK - 1) // OUT_BLOCK
    span = n_groups * group_bytes  # bytes the groups of one row read
    safe_rows = out_f - 1 if span > nbytes else out_f  # the last row would read past its array
    last = np.zeros(span, dtype=np.uint8)
    tab = log8_mult.ctypes.data
    x_row = x.shape[1] * x.itemsize
    for item in range(i0, i1):
        v = item // n_blocks
        o0 = (item % n_blocks) * OUT_BLOCK
        o1 = min(out_f, o0 + OUT_BLOCK)
        ref = log8_refs[v]
        sc_st = n_groups if scale_rows[v] > 1 else 0  # scale elements between rows
        sc_bytes = 4 if ref < 0 else 1
        if o1 > safe_rows:
            last[:nbytes] = carray(_u8_at(sign_addrs[v] + (out_f - 1) * nbytes), (nbytes,))
        for t in range(tok_start[v], tok_start[v + 1]):
            xa = x.ctypes.data + t * x_row
            oa = out.ctypes.data + dest[t] * out_f * 4
            o = o0
            while o + ROWS <= min(o1, safe_rows):
                sa, ca = sign_addrs[v] + o * nbytes, scale_addrs[v] + o * sc_st * sc_bytes
                if form == 0:
                    _bf_rows(xa, sa, nbytes, wpg, n_groups, ca, sc_st, ref, tab, oa + o * 4)
                elif form == 1:
                    _f16_rows(xa, sa, nbytes, wpg, n_groups, ca, sc_st, ref, tab, oa + o * 4)
                else:
                    _f8_rows(xa, sa, nbytes, wpg, n_groups, ca, sc_st, ref, tab, oa + o * 4)
                o += ROWS
            while o < o1:
                sa = sign_addrs[v] + o * nbytes if o < safe_rows else last.ctypes.data
                ca = scale_addrs[v] + o * sc_st * sc_bytes
                if form == 0:
                    _bf_one(xa, sa, nbytes, wpg, n_groups, ca, sc_st, ref, tab, oa + o * 4)
                elif form == 1:
                    _f16_one(xa, sa, nbytes, wpg, n_groups, ca, sc_st, ref, tab, oa + o * 4)
                else:
                    _f8_one(xa, sa, nbytes, wpg, n_groups, ca, sc_st, ref, tab, oa + o * 4)
                o += 1
