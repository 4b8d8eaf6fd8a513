// C++ loops for host preprocessing: the passes over every id of a batch that
// numpy can only express as a sort, a scatter or several temporaries.
//
// Each function computes exactly what the numpy code it stands for computes
// (`_native.py` names it; the tests compare the two bit for bit), works
// in place on arrays the caller allocated (1-D, C-contiguous, checked by item
// size), checks every index it follows, and releases the GIL while it loops.
//
//   fill_keys(keys, samples, ids, lengths, first_sample, v_s, n, r, offset, rotation)
//       For the ids of consecutive samples first_sample, first_sample + 1, ...
//       (lengths[s] ids each): samples[j] = b and keys[j] = b * v_s + row(id_j),
//       row(i) = ((i mod n + rotation) mod n) * r + floor(i / n) + offset.
//   merge_samples(keys, weights | None, lengths, repeats, v_s, samples) -> d
//       Stably sorts the keys of every sample s (lengths[s] each, weights
//       alongside), writes the d ascending positions j with sorted keys[j] ==
//       keys[j - 1] to repeats, then the n - d entries (the other positions,
//       in order): keys[e] = their key - s * v_s (the row), samples[e] = s.
//   rank_rows(rows, words, V, distinct, ranks) -> k
//       distinct[:k] = the distinct values of rows (in [0, V)), ascending, and
//       ranks[i] = j where distinct[j] = rows[i], through a bit map over
//       [0, V) in `words` (uint64, any content on entry): 1/8 byte per row,
//       so the map and its per-word counts stay in the cache.
//   drop_device(unique_index, stride, edges, U, C, samples, weights | None, distinct,
//               words, keep, out_samples, out_weights | None, out_index, out_distinct,
//               counts, unique_counts) -> k
//       One device's entries e in (sample, row) order, entry e of unique index
//       v = n * stride + u naming row edges[n] + u of distinct (the device's
//       rows, shard n's at edges[n] ... edges[n + 1] - 1). Partition = shard:
//       keep[e] = the row is among the first U rows of its shard in
//       first-entry order and the entry among the first C such entries of its
//       shard. The k kept entries' samples, weights and unique indices
//       n * U + u' (u': kept rows before the row in its shard) go to
//       out_*[:k] in order; the kept rows (those with a kept entry) to
//       out_distinct[:sum(unique_counts)], ascending; counts[n] / unique_counts[n]:
//       shard n's kept entries / rows. `words` (uint64, any content on entry):
//       the bit map of kept rows.
//   rank_kept_rows(rows, out_rows, samples, out_samples, weights | None, out_weights | None,
//                  words, V, R, U, C, keep, distinct, ranks, all_counts, unique_counts)
//       -> (k, d)
//       rank_rows and drop_device in one: one device's entries e (rows[e] in
//       [0, V), shard rows[e] / R of the len(all_counts) shards) in (sample,
//       row) order; keep[e] as in drop_device. The k kept entries' rows,
//       samples and weights go to out_*[:k] in order (each output may overlap
//       its input at or before it); distinct[:d] = the kept rows ascending,
//       ranks[:k] = their ranks among them. Before dropping, shard n had
//       all_counts[n] entries and unique_counts[n] distinct rows. `words`:
//       two bit maps over [0, V) (uint64, any content on entry).
//   compact_padded(ids, width, padding, values, splits) -> k
//       ids: a dense [B, width] batch, flattened (int32 or int64): values[:k]
//       = the ids that differ from `padding`, row by row, and splits[b + 1] =
//       their count in rows 0..b (splits[0] = 0); values has room for every id.
//
// The loops live in the headers _host_kernels_*.h next to this file; this
// file defines the Python module.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

// In the order the code had when it was one file, so the compiled code is the same.
#include "_host_kernels_common.h"
#include "_host_kernels_sort.h"
#include "_host_kernels_rank.h"
#include "_host_kernels_drop.h"
#include "_host_kernels_rank_kept.h"
#include "_host_kernels_compact.h"

namespace {

PyMethodDef kMethods[] = {
    {"fill_keys", fill_keys, METH_VARARGS, "Keys and samples of consecutive samples' ids."},
    {"merge_samples", merge_samples, METH_VARARGS,
     "Stable sort of every sample's keys, then its entries; returns the repeats."},
    {"drop_device", drop_device, METH_VARARGS,
     "One device's entries kept by the overflow rules, compacted, and its kept rows."},
    {"rank_kept_rows", rank_kept_rows, METH_VARARGS,
     "rank_rows over the entries kept by the overflow rules, which it applies."},
    {"rank_rows", rank_rows, METH_VARARGS,
     "Ascending distinct rows and every row's rank among them, via a bit map."},
    {"compact_padded", compact_padded, METH_VARARGS,
     "The ids of a dense [B, L] batch that are not the padding id, row by row, and the splits."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_host_kernels",
    "C++ loops of host preprocessing (see _native.py).", -1, kMethods,
    nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__host_kernels() { return PyModule_Create(&kModule); }
