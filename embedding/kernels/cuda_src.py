"""CUDA sources of the fused kernels (compiled by CuPy's RawModule, or by nvcc in tests).

One source per weight dtype (``T`` is ``float`` or ``double``). Arithmetic
goes through round-to-nearest intrinsics (``__fadd_rn`` …) so the compiler
cannot contract a multiply and an add into an FMA: each operation rounds
like the NumPy twin in :mod:`embedding.kernels.cpu`, and sums run in the
same order (bag order for the lookup, stable (table, row) order for the
backward), so the two agree to the last bit except where a reduction
across a row is involved (row-wise AdaGrad's mean of squares) or ``pow``
(Adam's bias corrections).

Kernels (one warp per bag or per unique row, 32 lanes over the columns):

- ``pooled_lookup``: every bag of every slot of every local table, one launch
  (sum, mean or max per slot; for max slots optionally the position of each
  column's first maximum, which the backward reads);
- ``occurrence_keys``: global row key and bag of each id occurrence;
- ``segment_update``: per unique global row (after a stable sort by key),
  sum the occurrences' gradients and either write the sum (``mode`` 0) or
  apply the optimizer to the row (``mode`` 1). Gradients come either from
  the bags and the pooled output's gradient (``from_bags`` 1) or from rows
  of a flat gradient buffer (``from_bags`` 0, e.g. gradients gathered from
  other ranks).
"""
from __future__ import annotations

__all__ = ["MAX_DIM", "OPTIMIZER_CODES", "source_for", "KERNEL_NAMES"]

#: Widest row the device backward keeps in registers: 32 lanes × 32 values.
MAX_DIM = 1024
#: Optimizer codes of ``segment_update``.
OPTIMIZER_CODES = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2}
KERNEL_NAMES = ("pooled_lookup", "occurrence_keys", "segment_update")

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

__device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v = ADD(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

extern "C" __global__ void pooled_lookup(
        const T* __restrict__ weights, const i64* __restrict__ weight_offsets,
        const int* __restrict__ dims, const int* __restrict__ slot_table,
        const i64* __restrict__ slot_col, const int* __restrict__ slot_mean,
        const int* __restrict__ slot_max,
        const i64* __restrict__ indices, const i64* __restrict__ offsets,
        const T* __restrict__ per_id, const int has_per_id,
        const i64 num_bags, const int num_slots, const int batch_size, const i64 out_dim,
        T* __restrict__ out, i64* __restrict__ arg_out, const int has_arg) {
    // arg_out (has_arg != 0), laid out like out: for the columns of max slots, the index into
    // indices of the bag's first id holding the column's maximum (-1 for an empty bag)
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 bag = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); bag < num_bags;
         bag += warps) {
        const i64 gs = bag / batch_size;
        const i64 b = bag - gs * batch_size;
        const int s = (int)(gs % num_slots);
        const i64 g = gs / num_slots;
        const int t = slot_table[s];
        const int d = dims[t];
        const T* w = weights + weight_offsets[t];
        const i64 start = offsets[bag], end = offsets[bag + 1];
        const i64 at = (g * batch_size + b) * out_dim + slot_col[s];
        T* o = out + at;
        const bool mean = slot_mean[s] != 0;
        const bool mx = slot_max[s] != 0;
        const T scale = (mean && end > start) ? DIV((T)1, (T)(end - start)) : (T)1;
        for (int c = lane; c < d; c += 32) {
            T acc = (T)0;
            i64 arg = -1;
            for (i64 i = start; i < end; ++i) {
                T x = w[indices[i] * d + c];
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
            o[c] = mean ? MUL(acc, scale) : acc;
            if (mx && has_arg) arg_out[at + c] = arg;
        }
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
        const T* __restrict__ grad_out, const i64* __restrict__ occ_bag,
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
    T x = grad_out[at];
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
        const i64* __restrict__ seg_start, const int* __restrict__ seg_table, const i64 num_segments,
        // tables
        const i64* __restrict__ row_base, const i64* __restrict__ weight_offsets,
        const int* __restrict__ dims,
        // gradient source: bags (from_bags = 1) or flat rows (from_bags = 0)
        const int from_bags, const T* __restrict__ grad_out, const i64* __restrict__ occ_bag,
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
        const int* __restrict__ kinds, const T* __restrict__ hyper, const double* __restrict__ betas,
        T* __restrict__ weights, T* __restrict__ momentum, T* __restrict__ exp_avg,
        T* __restrict__ exp_avg_sq, i64* __restrict__ step) {
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
                const T x = occurrence_grad(from_bags, order[p], c, grad_out, occ_bag, offsets,
                                            slot_col, slot_mean, slot_max, max_arg, per_id,
                                            has_per_id, num_slots, batch_size, out_dim,
                                            grad_rows, grad_row_offsets);
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
        T* w = weights + weight_offsets[t] + row * d;
        const int kind = kinds[t];
        const T lr = hyper[6 * t], eps = hyper[6 * t + 1], b1 = hyper[6 * t + 2];
        const T omb1 = hyper[6 * t + 3], b2 = hyper[6 * t + 4], omb2 = hyper[6 * t + 5];
        if (kind == 0) {
            k = 0;
            for (int c = lane; c < d; c += 32, ++k) w[c] = SUB(w[c], MUL(g[k], lr));
        } else if (kind == 1) {
            const T total = warp_sum(sumsq);
            const T add = has_row_term[t] ? row_term[order[lo]] : DIV(total, (T)d);
            const T m = ADD(momentum[grow], add);
            __syncwarp();
            if (lane == 0) momentum[grow] = m;
            const T scale = DIV(lr, ADD(SQRT(m), eps));
            k = 0;
            for (int c = lane; c < d; c += 32, ++k) w[c] = SUB(w[c], MUL(g[k], scale));
        } else {
            const i64 n = step[grow] + 1;
            __syncwarp();
            if (lane == 0) step[grow] = n;
            const T bc1 = (T)(1.0 - pow(betas[2 * t], (double)n));
            const T bc2 = (T)(1.0 - pow(betas[2 * t + 1], (double)n));
            T* m1 = exp_avg + weight_offsets[t] + row * d;
            T* m2 = exp_avg_sq + weight_offsets[t] + row * d;
            k = 0;
            for (int c = lane; c < d; c += 32, ++k) {
                const T gc = g[k];
                const T m = ADD(MUL(m1[c], b1), MUL(omb1, gc));
                const T v = ADD(MUL(m2[c], b2), MUL(omb2, MUL(gc, gc)));
                m1[c] = m;
                m2[c] = v;
                const T denom = ADD(SQRT(DIV(v, bc2)), eps);
                w[c] = SUB(w[c], MUL(DIV(DIV(m, bc1), denom), lr));
            }
        }
    }
}
"""


def source_for(dtype: str) -> str:
    """The CUDA source of the kernels for weight dtype ``dtype`` (float32 or float64)."""
    ctype = {"float32": "float", "float64": "double"}.get(str(dtype))
    if ctype is None:
        raise ValueError(f"dtype: expected float32 or float64, got {dtype}")
    body = _BODY
    for name, fn in _OPS[ctype].items():
        body = body.replace(f"@{name}@", fn)
    return f"typedef {ctype} T;\n" + body
