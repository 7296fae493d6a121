"""CUDA sources of the fused kernels (compiled by CuPy's RawModule, or by nvcc in tests).

One source per weight dtype and optimizer-state dtype: ``T`` is the compute type
(``float`` for float32 and half tables, ``double`` for float64), ``W`` the
weights' storage type and ``S`` the float state's. Half storage (float16,
bfloat16) is passed as its raw ``unsigned short`` bits: loads widen to float
exactly (:func:`half_to_float`), stores round with the integer rounding of
:mod:`embedding.precision` (nearest-even, or stochastic with the same
splitmix64 bits of ``(seed, step, table, row, column)``), so a half table's
rows come out bit for bit as the NumPy twin's (up to flush-to-zero, below).
Arithmetic goes through round-to-nearest intrinsics (``__fadd_rn`` …) so the
compiler cannot contract a multiply and an add into an FMA: each operation
rounds like the NumPy twin in :mod:`embedding.kernels.cpu`, and sums run in
the same order (bag order for the lookup, stable (table, row) order for the
backward), so the two agree to the last bit except where a reduction
across a row is involved (row-wise AdaGrad's mean of squares), ``pow``
(Adam's bias corrections), or a subnormal float32 value.

**Flush to zero.** CuPy compiles every ``RawModule`` with ``-ftz=true`` (an
``-ftz=false`` option does not undo it), so on the device single-precision
operations flush subnormal inputs and results (``|x| < 2**-126``, about
1.2e-38) to a zero of the same sign; NumPy keeps them. Where a float32
(float16 or bfloat16 table: float32 compute) weight, state value, gradient or
intermediate result is subnormal, the device may therefore give a zero (or a
value computed from one) where the twin gives a subnormal-derived value;
everywhere else the agreement above holds. float64 tables compute in double
precision, which is never flushed: they agree with the twin on subnormals
too.

Kernels (one warp per bag or per unique row, 32 lanes over the columns):

- ``pooled_lookup``: every bag of every slot of every local table, one launch
  (sum, mean or max per slot; for max slots optionally the position of each
  column's first maximum, which the backward reads). A module built for a
  communication ``wire`` format writes the pooled rows straight in it
  (:mod:`embedding.sharding.qcomm`): float16 or bfloat16 bits, or int8
  FUSED8BIT rows of ``wire_row`` values (the warp keeps its bag's values in
  registers, reduces each wire row's minimum and maximum with shuffles and
  writes codes, scale and bias as :func:`embedding.checkpoint.fused8bit.encode_into`);
- ``occurrence_keys``: global row key and bag of each id occurrence;
- ``segment_update``: per unique global row (after a stable sort by key),
  sum the occurrences' gradients and either write the sum (``mode`` 0) or
  apply the optimizer to the row (``mode`` 1). Gradients come either from
  the bags and the pooled output's gradient (``from_bags`` 1) or from rows
  of a flat gradient buffer (``from_bags`` 0, e.g. gradients gathered from
  other ranks). A float16 or bfloat16 ``wire`` module reads the pooled
  output's gradients (``from_bags`` 1) as received, in that format, widened
  and multiplied by the inverse loss scale on load.
"""
from __future__ import annotations

__all__ = ["MAX_DIM", "OPTIMIZER_CODES", "ROUNDING_CODES", "WIRE_FORMATS", "source_for",
           "KERNEL_NAMES"]

#: Widest row the device backward (and the int8 wire lookup) keeps in registers: 32 lanes ×
#: 32 values.
MAX_DIM = 1024
#: Optimizer codes of ``segment_update``.
OPTIMIZER_CODES = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2}
#: Rounding codes of ``segment_update`` (per table; :class:`embedding.precision.Rounding`).
ROUNDING_CODES = {"nearest": 0, "stochastic": 1, "master": 2}
KERNEL_NAMES = ("pooled_lookup", "occurrence_keys", "segment_update")
#: Wire formats a module can be built for -> (O_CODE, G_CODE, C output type, C gradient type or
#: None for the compute type): the lookup writes O, the backward reads G (int8 codes pooled rows
#: only; their gradients travel in a float format).
WIRE_FORMATS = {"float16": (1, 1, "unsigned short", "unsigned short"),
                "bfloat16": (2, 2, "unsigned short", "unsigned short"),
                "int8": (3, 0, "unsigned char", None)}

_OPS = {
    "float": dict(ADD="__fadd_rn", SUB="__fsub_rn", MUL="__fmul_rn", DIV="__fdiv_rn",
                  SQRT="__fsqrt_rn"),
    "double": dict(ADD="__dadd_rn", SUB="__dsub_rn", MUL="__dmul_rn", DIV="__ddiv_rn",
                   SQRT="__dsqrt_rn"),
}

_BODY = r"""
#define ADD(a, b) @ADD@((a), (b))
#define SUB(a, b) @SUB@((a), (b))
#define MUL(a, b) @MUL@((a), (b))
#define DIV(a, b) @DIV@((a), (b))
#define SQRT(a) @SQRT@((a))
#define MAX_CHUNKS 32

typedef long long i64;
typedef unsigned long long u64;

// ---- half storage: raw float16 / bfloat16 bits (embedding/precision.py, bit for bit)

// float16 (fp16 != 0) or bfloat16 bits h widened to float: exact, subnormals, inf and NaN
// (payload kept) included
__device__ __forceinline__ float half_to_float(const unsigned int h, const int fp16) {
    if (!fp16) return __uint_as_float(h << 16);
    const unsigned int sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    if (e != 0u) return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
    // zero or subnormal: m * 2**-24, exact in float
    return __uint_as_float(sign | __float_as_uint(__fmul_rn((float)m, 5.9604644775390625e-8f)));
}

// float x rounded to float16 (fp16 != 0) or bfloat16 bits: add a rounding increment below
// the s kept-away bits, then drop them. stochastic == 0: nearest, ties to even; else the low s
// bits of rnd (a carry happens with probability equal to the dropped fraction)
__device__ __forceinline__ unsigned short float_to_half(const float x, const int fp16,
                                                       const int stochastic,
                                                       const unsigned int rnd) {
    const unsigned int u = __float_as_uint(x);
    const unsigned int sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (unsigned short)(sign | (fp16 ? 0x7e00u : 0x7fc0u));
    int s = 16;
    u64 base = a;
    if (fp16) {
        if (a >= 0x47800000u) return (unsigned short)(sign | 0x7c00u);   // |x| >= 2**16: inf
        const int e = (int)(a >> 23) - 127;
        if (e >= -14) {
            s = 13;
            base = a - (112u << 23);
        } else {
            s = -1 - e;
            if (s > 32) return (unsigned short)sign;                      // |x| < 2**-32: zero
            base = (a & 0x7fffffu) | 0x800000u;
        }
    }
    const u64 inc = stochastic ? ((u64)rnd & (((u64)1 << s) - 1))
                               : (((u64)1 << (s - 1)) - 1 + ((base >> s) & 1));
    return (unsigned short)(((base + inc) >> s) | sign);
}

// one splitmix64 step of h absorbing v (embedding.precision.random_bits)
__device__ __forceinline__ u64 mix64(const u64 h, const u64 v) {
    u64 z = (h ^ v) + (u64)0x9E3779B97F4A7C15;
    z = (z ^ (z >> 30)) * (u64)0xBF58476D1CE4E5B9;
    z = (z ^ (z >> 27)) * (u64)0x94D049BB133111EB;
    return z ^ (z >> 31);
}

// W_CODE / S_CODE: 0 when the weights / the float state are stored as a float type (plain
// conversions), 1 for float16 bits, 2 for bfloat16 bits
#if W_CODE == 0
#define LOAD_W(v) ((T)(v))
#else
#define LOAD_W(v) ((T)half_to_float((v), W_CODE == 1))
#endif
#if S_CODE == 0
#define LOAD_S(v) ((T)(v))
#define ROUND_S(x) ((S)(x))
#else
#define LOAD_S(v) ((T)half_to_float((v), S_CODE == 1))
#define ROUND_S(x) float_to_half((float)(x), S_CODE == 1, 0, 0u)
#endif

// G_CODE: the pooled output's gradients as received, 0 in the compute type, else float16 (1)
// or bfloat16 (2) bits
#if G_CODE == 0
#define LOAD_G(v) ((T)(v))
#else
#define LOAD_G(v) ((T)half_to_float((v), G_CODE == 1))
#endif

#if O_CODE == 1 || O_CODE == 2
#if T_DOUBLE
// x rounded to float toward zero, its last bit set when inexact ("round to odd"): rounding
// that once more to float16 or bfloat16 gives x's nearest half value (float keeps 13 and 16
// more bits): one rounding, as embedding.precision.encode_half
__device__ __forceinline__ float narrow_for_half(const double x) {
    const float f = (float)x;
    if (!(x == x) || (double)f == x) return f;
    unsigned int u = __float_as_uint(f);
    const double ax = x < 0.0 ? -x : x, af = f < 0.0f ? -(double)f : (double)f;
    if (af > ax) u -= 1u;
    return __uint_as_float(u | 1u);
}
#else
__device__ __forceinline__ float narrow_for_half(const float x) { return x; }
#endif
#endif

#if O_CODE == 3
// one float32 as 4 little-endian bytes at p (FUSED8BIT rows are not 4-byte aligned)
__device__ __forceinline__ void put_f32(unsigned char* __restrict__ p, const float x) {
    const unsigned int u = __float_as_uint(x);
    p[0] = (unsigned char)(u & 0xffu);
    p[1] = (unsigned char)((u >> 8) & 0xffu);
    p[2] = (unsigned char)((u >> 16) & 0xffu);
    p[3] = (unsigned char)(u >> 24);
}

// 255 / (max - min + 1e-8) of a wire row (fused8bit.encode_into, float32)
__device__ __forceinline__ float int8_inverse(const float lo, const float hi) {
    return __fdiv_rn(255.0f, __fadd_rn(__fsub_rn(hi, lo), 1e-8f));
}

// code j of a wire row at unit: rint((x - lo) * inverse) clipped to [0, 255]; the operand is
// in [0, 256), where adding and taking away 2**23 rounds to the nearest integer, ties to even
__device__ __forceinline__ void put_code(unsigned char* __restrict__ unit, const int j,
                                         const float x, const float lo, const float inverse) {
    const float y = __fmul_rn(__fsub_rn(x, lo), inverse);
    const float r = __fsub_rn(__fadd_rn(y, 8388608.0f), 8388608.0f);
    unit[j] = (unsigned char)(r > 255.0f ? 255.0f : r);
}

// scale (max - min) / 255 and bias min after a wire row's row codes
__device__ __forceinline__ void put_scale_bias(unsigned char* __restrict__ unit, const int row,
                                               const float lo, const float hi) {
    put_f32(unit + row, __fdiv_rn(__fsub_rn(hi, lo), 255.0f));
    put_f32(unit + row + 4, lo);
}
#endif

// Rounding modes of a table's weights (embedding.precision.Rounding)
#define ROUND_NEAREST 0
#define ROUND_STOCHASTIC 1
#define ROUND_MASTER 2

// the value the optimizer reads of weight element j: the master copy of a MASTER table
__device__ __forceinline__ T read_weight(const W* __restrict__ weights,
                                         const float* __restrict__ master, const i64 j,
                                         const int rmode) {
    if (rmode == ROUND_MASTER) return (T)master[j];
    return LOAD_W(weights[j]);
}

// store the optimizer's new value v of weight element j (column c of a row whose hash prefix
// is hrow): the master copy keeps v, the stored weight is v rounded by rmode
__device__ __forceinline__ void write_weight(W* __restrict__ weights, float* __restrict__ master,
                                             const i64 j, const T v, const int rmode,
                                             const u64 hrow, const int c) {
#if W_CODE == 0
    weights[j] = (W)v;
#else
    if (rmode == ROUND_MASTER) master[j] = (float)v;
    const int sto = rmode == ROUND_STOCHASTIC;
    const unsigned int rnd = sto ? (unsigned int)(mix64(hrow, (u64)c) >> 32) : 0u;
    weights[j] = float_to_half((float)v, W_CODE == 1, sto, rnd);
#endif
}

__device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v = ADD(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

extern "C" __global__ void pooled_lookup(
        const W* __restrict__ weights, const i64* __restrict__ weight_offsets,
        const int* __restrict__ dims, const int* __restrict__ slot_table,
        const i64* __restrict__ slot_col, const int* __restrict__ slot_mean,
        const int* __restrict__ slot_max,
        const i64* __restrict__ indices, const i64* __restrict__ offsets,
        const T* __restrict__ per_id, const int has_per_id,
        const i64 num_bags, const int num_slots, const int batch_size, const i64 out_dim,
        O* __restrict__ out, i64* __restrict__ arg_out, const int has_arg,
        const T out_scale, const int has_out_scale, const int wire_row) {
    // arg_out (has_arg != 0), laid out like out: for the columns of max slots, the index into
    // indices of the bag's first id holding the column's maximum (-1 for an empty bag).
    // O_CODE != 0: out is the wire format of the pooled rows, each value multiplied by
    // out_scale first when has_out_scale != 0; int8 (O_CODE 3): out_dim / wire_row rows of
    // wire_row codes, scale and bias per output row (wire_row divides out_dim, every slot's
    // column and dim; dims up to MAX_DIM)
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
#if O_CODE == 3
    float v[MAX_CHUNKS];
#endif
    for (i64 bag = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); bag < num_bags;
         bag += warps) {
        const i64 gs = bag / batch_size;
        const i64 b = bag - gs * batch_size;
        const int s = (int)(gs % num_slots);
        const i64 g = gs / num_slots;
        const int t = slot_table[s];
        const int d = dims[t];
        const W* w = weights + weight_offsets[t];
        const i64 start = offsets[bag], end = offsets[bag + 1];
        const i64 at = (g * batch_size + b) * out_dim + slot_col[s];
        const bool mean = slot_mean[s] != 0;
        const bool mx = slot_max[s] != 0;
        const T scale = (mean && end > start) ? DIV((T)1, (T)(end - start)) : (T)1;
        int k = 0;
        for (int c = lane; c < d; c += 32, ++k) {
            T acc = (T)0;
            i64 arg = -1;
            for (i64 i = start; i < end; ++i) {
                T x = LOAD_W(w[indices[i] * d + c]);
                if (has_per_id) x = MUL(x, per_id[i]);
                if (mx) {
                    if (i == start || x > acc) {
                        acc = x;
                        arg = i;
                    }
                } else {
                    acc = (i == start) ? x : ADD(acc, x);
                }
            }
            if (mx && has_arg) arg_out[at + c] = arg;
            T val = mean ? MUL(acc, scale) : acc;
#if O_CODE == 0
            out[at + c] = val;
#else
            if (has_out_scale) val = MUL(val, out_scale);
#if O_CODE == 3
            v[k] = (float)val;
#else
            out[at + c] = float_to_half(narrow_for_half(val), O_CODE == 1, 0, 0u);
#endif
#endif
        }
#if O_CODE == 3
        // the warp's values of wire row r: columns [r * row, (r + 1) * row), column c in v[c >> 5]
        // of lane c & 31. Loop bounds are the same on every lane (the shuffles need all 32).
        const int row = wire_row;
        const float inf = __uint_as_float(0x7f800000u);
        unsigned char* ob = out + ((g * batch_size + b) * (out_dim / row) + slot_col[s] / row)
                                  * (i64)(row + 8);
        if (32 % row == 0) {
            // a wire row is an aligned group of row lanes in one chunk: reduce within it
            k = 0;
            for (int c0 = 0; c0 < d; c0 += 32, ++k) {
                const int c = c0 + lane;
                const bool live = c < d;
                float lo = live ? v[k] : inf, hi = live ? v[k] : -inf;
                for (int o = 1; o < row; o <<= 1) {
                    const float l2 = __shfl_xor_sync(0xffffffffu, lo, o);
                    const float h2 = __shfl_xor_sync(0xffffffffu, hi, o);
                    lo = l2 < lo ? l2 : lo;
                    hi = h2 > hi ? h2 : hi;
                }
                if (live) {
                    unsigned char* unit = ob + (i64)(c / row) * (row + 8);
                    put_code(unit, c % row, v[k], lo, int8_inverse(lo, hi));
                    if (c % row == 0) put_scale_bias(unit, row, lo, hi);
                }
            }
        } else {
            // any other width: each lane's share of the wire row, then the whole warp
            for (int a = 0; a < d; a += row) {
                const int first = a + ((lane - (a & 31) + 32) & 31);
                float lo = inf, hi = -inf;
                for (int c = first; c < a + row; c += 32) {
                    const float x = v[c >> 5];
                    lo = x < lo ? x : lo;
                    hi = x > hi ? x : hi;
                }
                for (int o = 16; o > 0; o >>= 1) {
                    const float l2 = __shfl_xor_sync(0xffffffffu, lo, o);
                    const float h2 = __shfl_xor_sync(0xffffffffu, hi, o);
                    lo = l2 < lo ? l2 : lo;
                    hi = h2 > hi ? h2 : hi;
                }
                unsigned char* unit = ob + (i64)(a / row) * (row + 8);
                const float inverse = int8_inverse(lo, hi);
                for (int c = first; c < a + row; c += 32) put_code(unit, c - a, v[c >> 5], lo,
                                                                  inverse);
                if (lane == 0) put_scale_bias(unit, row, lo, hi);
            }
        }
#endif
    }
}

extern "C" __global__ void occurrence_keys(
        const i64* __restrict__ row_base, const int* __restrict__ slot_table,
        const i64* __restrict__ indices, const i64* __restrict__ offsets,
        const i64 num_bags, const int num_slots, const int batch_size,
        i64* __restrict__ keys, i64* __restrict__ occ_bag) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 bag = (i64)blockIdx.x * blockDim.x + threadIdx.x; bag < num_bags; bag += stride) {
        const int s = (int)((bag / batch_size) % num_slots);
        const i64 base = row_base[slot_table[s]];
        for (i64 i = offsets[bag]; i < offsets[bag + 1]; ++i) {
            keys[i] = base + indices[i];
            occ_bag[i] = bag;
        }
    }
}

// Gradient of one occurrence at column c.
__device__ __forceinline__ T occurrence_grad(
        const int from_bags, const i64 occ, const int c,
        const G* __restrict__ grad_out, const T grad_scale, const int has_grad_scale,
        const i64* __restrict__ occ_bag,
        const i64* __restrict__ offsets, const i64* __restrict__ slot_col,
        const int* __restrict__ slot_mean, const int* __restrict__ slot_max,
        const i64* __restrict__ max_arg, const T* __restrict__ per_id, const int has_per_id,
        const int num_slots, const int batch_size, const i64 out_dim,
        const T* __restrict__ grad_rows, const i64* __restrict__ grad_row_offsets) {
    if (!from_bags) return grad_rows[grad_row_offsets[occ] + c];
    const i64 bag = occ_bag[occ];
    const i64 gs = bag / batch_size;
    const i64 b = bag - gs * batch_size;
    const int s = (int)(gs % num_slots);
    const i64 g = gs / num_slots;
    const i64 at = (g * batch_size + b) * out_dim + slot_col[s] + c;
    // max pooling: only the bag's first maximum of column c receives its gradient
    if (slot_max[s] && max_arg[at] != occ) return (T)0;
    T x = LOAD_G(grad_out[at]);
    if (has_grad_scale) x = MUL(x, grad_scale);
    if (slot_mean[s]) {
        const i64 len = offsets[bag + 1] - offsets[bag];
        x = MUL(x, DIV((T)1, (T)(len > 0 ? len : 1)));
    }
    if (has_per_id) x = MUL(x, per_id[occ]);
    return x;
}

extern "C" __global__ void segment_update(
        // segments of the stably sorted occurrences
        const i64* __restrict__ sorted_keys, const i64* __restrict__ order,
        const i64* __restrict__ seg_start, const int* __restrict__ seg_table,
        const i64 num_segments,
        // tables
        const i64* __restrict__ row_base, const i64* __restrict__ weight_offsets,
        const int* __restrict__ dims,
        // gradient source: bags (from_bags = 1; grad_out in G, times grad_scale when
        // has_grad_scale != 0) or flat rows (from_bags = 0)
        const int from_bags, const G* __restrict__ grad_out, const T grad_scale,
        const int has_grad_scale, const i64* __restrict__ occ_bag,
        const i64* __restrict__ offsets, const i64* __restrict__ slot_col,
        const int* __restrict__ slot_mean, const int* __restrict__ slot_max,
        const i64* __restrict__ max_arg, const T* __restrict__ per_id, const int has_per_id,
        const int num_slots, const int batch_size, const i64 out_dim,
        const T* __restrict__ grad_rows, const i64* __restrict__ grad_row_offsets,
        // row-wise AdaGrad's mean(g*g) given per occurrence for the tables t with
        // has_row_term[t] != 0, e.g. whole-row terms for a column slice; read at the segment's
        // first occurrence
        const T* __restrict__ row_term, const int* __restrict__ has_row_term,
        // mode 0: write sums to agg at agg_offsets; mode 1: optimizer step
        const int mode, T* __restrict__ agg, const i64* __restrict__ agg_offsets,
        // per table: optimizer code, (lr, eps, b1, 1-b1, b2, 1-b2) in T, (beta1, beta2) in double
        const int* __restrict__ kinds, const T* __restrict__ hyper,
        const double* __restrict__ betas,
        W* __restrict__ weights, S* __restrict__ momentum, S* __restrict__ exp_avg,
        S* __restrict__ exp_avg_sq, i64* __restrict__ step,
        // per table: rounding mode and stochastic-rounding seed of half weights; the update
        // counter; float32 master rows (laid out like weights) of MASTER tables; the number
        // stochastic rounding hashes for each row (by global row, has_row_keys != 0; else the
        // row itself)
        const int* __restrict__ rounding, const u64* __restrict__ seeds, const u64 update_step,
        float* __restrict__ master, const i64* __restrict__ row_keys, const int has_row_keys) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    T g[MAX_CHUNKS];
    for (i64 u = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); u < num_segments;
         u += warps) {
        const int t = seg_table[u];
        const int d = dims[t];
        const i64 grow = sorted_keys[seg_start[u]];
        const i64 row = grow - row_base[t];
        const i64 lo = seg_start[u], hi = seg_start[u + 1];
        T sumsq = (T)0;
        int k = 0;
        for (int c = lane; c < d; c += 32, ++k) {
            T acc = (T)0;
            for (i64 p = lo; p < hi; ++p) {
                const T x = occurrence_grad(from_bags, order[p], c, grad_out, grad_scale,
                                            has_grad_scale, occ_bag, offsets, slot_col,
                                            slot_mean, slot_max, max_arg, per_id, has_per_id,
                                            num_slots, batch_size, out_dim, grad_rows,
                                            grad_row_offsets);
                acc = (p == lo) ? x : ADD(acc, x);
            }
            g[k] = acc;
            sumsq = ADD(sumsq, MUL(acc, acc));
        }
        if (mode == 0) {
            T* dst = agg + agg_offsets[u];
            k = 0;
            for (int c = lane; c < d; c += 32, ++k) dst[c] = g[k];
            continue;
        }
        const i64 w0 = weight_offsets[t] + row * d;
        const int kind = kinds[t];
        const int rmode = rounding[t];
        const u64 hrow = rmode == ROUND_STOCHASTIC
            ? mix64(mix64(mix64(mix64((u64)0, seeds[t]), update_step), (u64)t),
                    (u64)(has_row_keys ? row_keys[grow] : row))
            : (u64)0;
        const T lr = hyper[6 * t], eps = hyper[6 * t + 1], b1 = hyper[6 * t + 2];
        const T omb1 = hyper[6 * t + 3], b2 = hyper[6 * t + 4], omb2 = hyper[6 * t + 5];
        if (kind == 0) {
            k = 0;
            for (int c = lane; c < d; c += 32, ++k)
                write_weight(weights, master, w0 + c,
                             SUB(read_weight(weights, master, w0 + c, rmode), MUL(g[k], lr)),
                             rmode, hrow, c);
        } else if (kind == 1) {
            const T total = warp_sum(sumsq);
            const T add = has_row_term[t] ? row_term[order[lo]] : DIV(total, (T)d);
            const T m = ADD(LOAD_S(momentum[grow]), add);
            __syncwarp();
            if (lane == 0) momentum[grow] = ROUND_S(m);
            const T scale = DIV(lr, ADD(SQRT(m), eps));
            k = 0;
            for (int c = lane; c < d; c += 32, ++k)
                write_weight(weights, master, w0 + c,
                             SUB(read_weight(weights, master, w0 + c, rmode), MUL(g[k], scale)),
                             rmode, hrow, c);
        } else {
            const i64 n = step[grow] + 1;
            __syncwarp();
            if (lane == 0) step[grow] = n;
            const T bc1 = (T)(1.0 - pow(betas[2 * t], (double)n));
            const T bc2 = (T)(1.0 - pow(betas[2 * t + 1], (double)n));
            S* m1 = exp_avg + w0;
            S* m2 = exp_avg_sq + w0;
            k = 0;
            for (int c = lane; c < d; c += 32, ++k) {
                const T gc = g[k];
                const T m = ADD(MUL(LOAD_S(m1[c]), b1), MUL(omb1, gc));
                const T v = ADD(MUL(LOAD_S(m2[c]), b2), MUL(omb2, MUL(gc, gc)));
                m1[c] = ROUND_S(m);
                m2[c] = ROUND_S(v);
                const T denom = ADD(SQRT(DIV(v, bc2)), eps);
                write_weight(weights, master, w0 + c,
                             SUB(read_weight(weights, master, w0 + c, rmode),
                                 MUL(DIV(DIV(m, bc1), denom), lr)),
                             rmode, hrow, c);
            }
        }
    }
}
"""


#: Storage dtype -> (C storage type, W_CODE / S_CODE, compute C type).
_STORAGE = {"float32": ("float", 0, "float"), "float64": ("double", 0, "double"),
            "float16": ("unsigned short", 1, "float"),
            "bfloat16": ("unsigned short", 2, "float")}


def source_for(dtype: str, state_dtype: str | None = None, wire: str | None = None) -> str:
    """The CUDA source of the kernels for weight dtype ``dtype`` (float32, float64, float16,
    bfloat16), optimizer-state dtype ``state_dtype`` (default: the compute dtype, float64
    for float64 weights and float32 otherwise) and communication format ``wire`` (None: the
    compute type; else one of :data:`WIRE_FORMATS`: ``pooled_lookup`` writes it and
    ``segment_update`` reads gradients in it).

    A float64 table computes in double, every other in float. Half state
    with float64 weights is refused: its stores would round through float.
    """
    if str(dtype) not in _STORAGE:
        raise ValueError(f"dtype: expected one of {sorted(_STORAGE)}, got {dtype}")
    wtype, wcode, ctype = _STORAGE[str(dtype)]
    sname = {"float": "float32", "double": "float64"}[ctype] if state_dtype is None \
        else str(state_dtype)
    if sname not in _STORAGE:
        raise ValueError(f"state_dtype: expected one of {sorted(_STORAGE)}, got {state_dtype}")
    stype, scode, _ = _STORAGE[sname]
    if scode and ctype == "double":
        raise ValueError(f"state_dtype: the device kernels keep {sname} optimizer state for "
                         f"float32, float16 and bfloat16 tables, not {dtype}")
    if wire is not None and wire not in WIRE_FORMATS:
        raise ValueError(f"wire: expected None or one of {sorted(WIRE_FORMATS)}, got {wire!r}")
    ocode, gcode, otype, gtype = WIRE_FORMATS[wire] if wire is not None else (0, 0, ctype, None)
    body = _BODY
    for name, fn in _OPS[ctype].items():
        body = body.replace(f"@{name}@", fn)
    return (f"typedef {ctype} T;\ntypedef {wtype} W;\ntypedef {stype} S;\n"
            f"typedef {otype} O;\ntypedef {gtype or ctype} G;\n"
            f"#define W_CODE {wcode}\n#define S_CODE {scode}\n"
            f"#define O_CODE {ocode}\n#define G_CODE {gcode}\n"
            f"#define T_DOUBLE {int(ctype == 'double')}\n" + body)
