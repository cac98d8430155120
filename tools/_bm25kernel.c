/*
 * Top-k BM25 retrieval over the default backend's postings, exact to Lucene's float arithmetic.
 *
 * The Python side (toolgym.tools.bm25_search) analyses the query, looks its terms up and calls
 * Ranker.search(term_ids, boosts, k). This file does the rest without the GIL, so several threads
 * of one process search at once.
 *
 * Scores. Lucene's BM25Similarity scores a (term, document) pair in float:
 *     weight = boost * idf;  score = weight - weight / (1 + freq * normInverse[document])
 * where normInverse comes from the document's one-byte length norm (precomputed per document at
 * build time, also in float, see bm25.py). A document's score is the sum of its terms' scores in
 * double, cast to float. The same operations in the same precision give bit-identical scores
 * (compile with -ffp-contract=off: a fused multiply-add would round once instead of twice).
 *
 * Order. Best score first, ties broken by the rank of the document's external id in sorted order
 * (Anserini sorts by score, then by id), so the k returned are exactly Anserini's k.
 *
 * Pruning. MaxScore with block-max bounds, over windows of documents: each term's postings are cut
 * into blocks of `block` postings, each with its highest boost-1 score and its last document. In a
 * window, a term's bound is the highest maximum of its blocks there; terms are ordered by it, and
 * the lowest ones whose bounds sum below the current k-th score are "non-essential": no document
 * that only they match can enter the top k. So only the essential terms' documents are candidates
 * (their postings summed term-at-a-time into an accumulator), and a candidate is dropped as soon as
 * its partial score plus the bounds still to add (its block's own bound where known) cannot reach
 * the k-th score; a window with no essential term is skipped whole. Every comparison keeps a
 * relative margin so rounding can never drop a document that belongs in the result: pruning only
 * skips work, it never changes the answer (tests compare it with an exhaustive scorer).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "Lucene-exact scores need float arithmetic evaluated in float (FLT_EVAL_METHOD == 0)"
#endif

#define END_DOC UINT32_MAX
/* Bounds are inflated by this much before a comparison that could prune (float rounding of the
 * sums and of boosted weights is far below it). */
#define MARGIN 1e-5

enum { DOCS, TFS, NORMS, NORMCACHE, IDRANK, INDPTR, BLOCKPTR, BLOCKMAX, BLOCKLAST, IDF, N_VIEWS };
static const char *VIEW_NAMES[N_VIEWS] = {"docs",     "tfs",      "norms",    "normcache", "idrank",
                                          "indptr",   "blockptr", "blockmax", "blocklast", "idf"};
/* Item size of each array; 0: 1, 2 or 4 bytes (term frequencies), -1: 1 or 4 bytes (norms: Lucene's
 * one-byte norm codes, decoded by the 256-entry normcache, or one float per document). */
static const Py_ssize_t VIEW_ITEMSIZE[N_VIEWS] = {4, 0, -1, 4, 4, 8, 8, 4, 4, 4};
/* Term frequencies up to this are scored from a per-query table (no division, no float norm). */
#define TABLE_TF 2

typedef struct {
    PyObject_HEAD
    Py_buffer views[N_VIEWS];
    int ready;
    int tf_width;
    int coded;      /* norms are one-byte codes (and normcache decodes them) */
    int64_t block;
    int64_t n_terms, n_docs, n_postings, n_blocks;
} Ranker;

#define BUF(self, which) ((self)->views[which].buf)

typedef struct {
    const uint32_t *docs;
    const void *tfs;
    int tf_width;   /* bytes per term frequency: 1, 2 or 4 */
    int64_t n, pos;
    const float *bmax;
    const uint32_t *blast;
    int64_t nb, bpos;
    float weight;   /* boost * idf, in float as Lucene computes it */
    const float *table; /* [TABLE_TF][256]: this term's score for tf 1..TABLE_TF and each norm code */
    double boost;
    uint32_t cur;   /* docs[pos], or END_DOC */
} Cursor;

typedef struct {
    float score;
    uint32_t rank;
    uint32_t doc;
} Hit;

/* a is worse than b: lower score, or the same score and a later id. */
static inline int worse(const Hit *a, const Hit *b) {
    return a->score < b->score || (a->score == b->score && a->rank > b->rank);
}

static void sift_down(Hit *heap, int64_t n, int64_t i) {
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && worse(&heap[l], &heap[m])) m = l;
        if (r < n && worse(&heap[r], &heap[m])) m = r;
        if (m == i) return;
        Hit t = heap[i];
        heap[i] = heap[m];
        heap[m] = t;
        i = m;
    }
}

static void sift_up(Hit *heap, int64_t i) {
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!worse(&heap[i], &heap[p])) return;
        Hit t = heap[i];
        heap[i] = heap[p];
        heap[p] = t;
        i = p;
    }
}

static int better_first(const void *pa, const void *pb) {
    const Hit *a = pa, *b = pb;
    if (worse(a, b)) return 1;
    if (worse(b, a)) return -1;
    return 0;
}

typedef struct {
    const uint8_t *codes;  /* per document, when coded */
    const float *cache;    /* normInverse per code, when coded */
    const float *floats;   /* normInverse per document, when not coded */
} Norms;

static inline float term_score(const Cursor *c, int64_t pos, const Norms *nv) {
    uint32_t freq;
    switch (c->tf_width) {
    case 1: freq = ((const uint8_t *)c->tfs)[pos]; break;
    case 2: freq = ((const uint16_t *)c->tfs)[pos]; break;
    default: freq = ((const uint32_t *)c->tfs)[pos]; break;
    }
    float ni;
    if (nv->codes) {
        uint8_t code = nv->codes[c->docs[pos]];
        if (freq <= TABLE_TF) return c->table[(freq - 1) * 256 + code];
        ni = nv->cache[code];
    } else {
        ni = nv->floats[c->docs[pos]];
    }
    return c->weight - c->weight / (1.0f + (float)freq * ni);
}

static inline void next_posting(Cursor *c) {
    c->pos++;
    c->cur = c->pos < c->n ? c->docs[c->pos] : END_DOC;
}

/* Move the block cursor to the first block whose last document is >= target (docs not read). */
static inline int shallow_seek(Cursor *c, uint32_t target) {
    int64_t b = c->bpos;
    if (b < c->nb && c->blast[b] >= target) return 1;
    while (b < c->nb && c->blast[b] < target) b++;
    c->bpos = b;
    return b < c->nb;
}

/* Move the cursor to its first posting >= target. */
static inline void seek(Cursor *c, uint32_t target, int64_t block) {
    if (c->cur >= target) return; /* END_DOC is >= everything */
    if (!shallow_seek(c, target)) {
        c->pos = c->n;
        c->cur = END_DOC;
        return;
    }
    int64_t lo = c->bpos * block, hi = lo + block;
    if (lo < c->pos) lo = c->pos;
    if (hi > c->n) hi = c->n;
    /* docs[hi - 1] == blast[bpos] >= target. Candidates come in document order, so the target is
     * usually a few postings ahead: look there first, then halve what is left. */
    for (int step = 0; step < 4 && lo < hi; step++, lo++)
        if (c->docs[lo] >= target) {
            hi = lo;
            break;
        }
    while (lo < hi) {
        int64_t mid = lo + ((hi - lo) >> 1);
        if (c->docs[mid] < target) lo = mid + 1;
        else hi = mid;
    }
    c->pos = lo;
    c->cur = c->docs[lo];
}

/* A lower bound on the cursor's first document >= from, without reading postings beyond one. */
static inline uint32_t next_bound(Cursor *c, uint32_t from, int64_t block) {
    if (c->cur >= from) return c->cur; /* exact (or END_DOC) */
    if (!shallow_seek(c, from)) {
        c->pos = c->n;
        c->cur = END_DOC;
        return END_DOC;
    }
    int64_t p = c->bpos * block;
    if (p < c->pos) p = c->pos;
    uint32_t d = c->docs[p];
    return d > from ? d : from;
}

/* The highest score the cursor's term can give a document in [lo, hi) (0 if it has none there). */
static inline double window_bound(Cursor *c, uint32_t lo, uint32_t hi) {
    if (c->cur == END_DOC || !shallow_seek(c, lo)) return 0.0;
    float top = 0.0f;
    for (int64_t b = c->bpos; b < c->nb; b++) {
        if (c->bmax[b] > top) top = c->bmax[b];
        if (c->blast[b] >= hi - 1) break;
    }
    return (double)top * c->boost;
}

static inline void push_hit(Hit *heap, int64_t *size, int64_t k, Hit h) {
    if (*size < k) {
        heap[*size] = h;
        sift_up(heap, *size);
        (*size)++;
    } else if (worse(&heap[0], &h)) {
        heap[0] = h;
        sift_down(heap, *size, 0);
    }
}

/* The search proper; no Python calls. Documents are taken in windows of WINDOW ids. Per window,
 * each term's bound is the highest block maximum it has there; terms are ordered by that bound and
 * the lowest ones whose bounds sum below the k-th score are non-essential. The essential terms'
 * postings in the window are summed term-at-a-time into an accumulator; then each document they
 * reached, in order, gets the non-essential terms' scores added (seeking their postings) until its
 * bound falls below the k-th score. Returns the number of hits written (sorted), -1 when out of
 * memory, -2 when the postings name a document that does not exist (corrupt index). */
#define WINDOW 4096
static int64_t run_search(const Ranker *self, Cursor *cur, int m, int64_t k, Hit *heap) {
    Norms nv = {NULL, NULL, NULL};
    if (self->coded) {
        nv.codes = BUF(self, NORMS);
        nv.cache = BUF(self, NORMCACHE);
    } else {
        nv.floats = BUF(self, NORMS);
    }
    const Norms *norms = &nv;
    const uint32_t *idrank = BUF(self, IDRANK);
    const uint32_t n_docs = (uint32_t)self->n_docs;
    const int64_t block = self->block;
    int64_t size = 0;
    double *bound = malloc(sizeof(double) * (size_t)(2 * m + 1));
    int *order = malloc(sizeof(int) * (size_t)(m + 1));
    double *acc = calloc(WINDOW, sizeof(double));
    uint64_t *seen = calloc(WINDOW / 64, sizeof(uint64_t));
    int64_t status = 0;
    if (!bound || !order || !acc || !seen) {
        status = -1;
        goto out;
    }
    double *prefix = bound + m;
    float thr = -INFINITY; /* the k-th best score once the heap is full */
    double cut = -INFINITY; /* a bound below this cannot reach thr, whatever the rounding */
    uint32_t from = 0;

    for (;;) {
        uint32_t lo = END_DOC;
        for (int i = 0; i < m; i++) {
            uint32_t d = next_bound(&cur[i], from, block);
            if (d < lo) lo = d;
        }
        if (lo == END_DOC) break;
        if (lo >= n_docs) {
            status = -2;
            goto out;
        }
        uint64_t hi64 = (uint64_t)lo + WINDOW;
        uint32_t hi = hi64 > n_docs ? n_docs : (uint32_t)hi64;
        from = hi;

        /* Window bounds, terms ordered by them (insertion sort: m is a handful). */
        for (int i = 0; i < m; i++) {
            bound[i] = window_bound(&cur[i], lo, hi);
            int j = i;
            while (j > 0 && bound[order[j - 1]] > bound[i]) {
                order[j] = order[j - 1];
                j--;
            }
            order[j] = i;
        }
        double total = 0.0;
        for (int j = 0; j < m; j++) {
            total += bound[order[j]];
            prefix[j] = total;
        }
        int ne = 0;
        while (ne < m && prefix[ne] < cut) ne++;
        if (ne == m) continue; /* nothing in this window can enter the top k */

        /* Essential terms, term at a time. */
        for (int j = ne; j < m; j++) {
            Cursor *c = &cur[order[j]];
            seek(c, lo, block);
            while (c->cur < hi) {
                if (c->cur < lo) { /* postings out of order: a corrupt index */
                    status = -2;
                    goto out;
                }
                uint32_t off = c->cur - lo;
                acc[off] += term_score(c, c->pos, norms);
                seen[off >> 6] |= (uint64_t)1 << (off & 63);
                next_posting(c);
            }
        }

        /* Candidates in document order: add the non-essential terms while they can matter. */
        for (int w = 0; w < WINDOW / 64; w++) {
            uint64_t bits = seen[w];
            if (!bits) continue;
            seen[w] = 0;
            while (bits) {
                uint32_t off = (uint32_t)(w * 64 + __builtin_ctzll(bits));
                bits &= bits - 1;
                uint32_t d = lo + off;
                double s = acc[off];
                acc[off] = 0.0;
                if (s + (ne > 0 ? prefix[ne - 1] : 0.0) < cut) continue;
                int pruned = 0;
                for (int j = ne - 1; j >= 0; j--) {
                    if (s + prefix[j] < cut) {
                        pruned = 1;
                        break;
                    }
                    Cursor *c = &cur[order[j]];
                    if (c->cur < d) {
                        if (!shallow_seek(c, d)) {
                            c->pos = c->n;
                            c->cur = END_DOC;
                            continue;
                        }
                        double rest = j > 0 ? prefix[j - 1] : 0.0;
                        if (s + (double)c->bmax[c->bpos] * c->boost + rest < cut) {
                            pruned = 1;
                            break;
                        }
                        seek(c, d, block);
                    }
                    if (c->cur == d) s += term_score(c, c->pos, norms);
                }
                if (pruned) continue;
                Hit h = {(float)s, idrank[d], d};
                push_hit(heap, &size, k, h);
                if (size == k) {
                    thr = heap[0].score;
                    cut = thr / (1.0 + MARGIN);
                }
            }
        }
    }
    qsort(heap, (size_t)size, sizeof(Hit), better_first);
    status = size;
out:
    free(bound);
    free(order);
    free(acc);
    free(seen);
    return status;
}

/* ------------------------------------------------------------------------------------------ Python */

static void release_buffers(Ranker *self) {
    for (int i = 0; i < N_VIEWS; i++)
        if (self->views[i].obj) PyBuffer_Release(&self->views[i]);
    self->ready = 0;
}

static void Ranker_dealloc(Ranker *self) {
    release_buffers(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Ranker_init(Ranker *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"docs",     "tfs",      "norms",     "normcache", "idrank", "indptr",
                             "blockptr", "blockmax", "blocklast", "idf",       "block",  NULL};
    PyObject *o[N_VIEWS];
    Py_ssize_t block;
    if (self->ready) {
        /* Threads may be searching the arrays: swapping them under their feet would crash. */
        PyErr_SetString(PyExc_RuntimeError, "a Ranker is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOOOn", kwlist, &o[0], &o[1], &o[2], &o[3], &o[4],
                                     &o[5], &o[6], &o[7], &o[8], &o[9], &block))
        return -1;
    for (int i = 0; i < N_VIEWS; i++) {
        Py_buffer *v = &self->views[i];
        if (PyObject_GetBuffer(o[i], v, PyBUF_ND | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) goto fail;
        Py_ssize_t want = VIEW_ITEMSIZE[i], got = v->itemsize;
        int size_ok = want > 0    ? got == want
                      : want == 0 ? (got == 1 || got == 2 || got == 4)
                                  : (got == 1 || got == 4);
        if (v->ndim != 1 || !size_ok) {
            PyErr_Format(PyExc_ValueError, "%s: a 1-d array with items of an unexpected size (%zd bytes)",
                         VIEW_NAMES[i], got);
            goto fail;
        }
    }
    self->tf_width = (int)self->views[TFS].itemsize;
    self->coded = self->views[NORMS].itemsize == 1;
    self->block = block;
    self->n_postings = self->views[DOCS].shape[0];
    self->n_docs = self->views[NORMS].shape[0];
    self->n_terms = self->views[IDF].shape[0];
    self->n_blocks = self->views[BLOCKMAX].shape[0];
    /* Structural checks, O(terms): an inconsistent table must raise, never read out of bounds. */
    const int64_t *indptr = BUF(self, INDPTR), *blockptr = BUF(self, BLOCKPTR);
    if (block < 1 || self->views[TFS].shape[0] != self->n_postings ||
        self->views[IDRANK].shape[0] != self->n_docs || self->views[BLOCKLAST].shape[0] != self->n_blocks ||
        self->views[INDPTR].shape[0] != self->n_terms + 1 ||
        self->views[BLOCKPTR].shape[0] != self->n_terms + 1 || self->n_docs >= (int64_t)END_DOC ||
        self->views[NORMCACHE].shape[0] != (self->coded ? 256 : 0)) {
        PyErr_SetString(PyExc_ValueError, "inconsistent array sizes");
        goto fail;
    }
    if (indptr[0] != 0 || blockptr[0] != 0 || indptr[self->n_terms] != self->n_postings ||
        blockptr[self->n_terms] != self->n_blocks) {
        PyErr_SetString(PyExc_ValueError, "term offsets do not span the postings");
        goto fail;
    }
    for (int64_t t = 0; t < self->n_terms; t++) {
        int64_t n = indptr[t + 1] - indptr[t], nb = blockptr[t + 1] - blockptr[t];
        if (n < 0 || nb != (n + block - 1) / block) {
            PyErr_Format(PyExc_ValueError, "term %lld: %lld postings but %lld blocks", (long long)t,
                         (long long)n, (long long)nb);
            goto fail;
        }
    }
    self->ready = 1;
    return 0;
fail:
    release_buffers(self);
    return -1;
}

static PyObject *Ranker_search(Ranker *self, PyObject *args) {
    Py_buffer tids_view, boosts_view;
    Py_ssize_t k;
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Ranker is not initialised");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "y*y*n", &tids_view, &boosts_view, &k)) return NULL;
    PyObject *result = NULL;
    Cursor *cur = NULL;
    Hit *heap = NULL;
    float *tables = NULL;
    int m = (int)(tids_view.len / 8);
    if (tids_view.len % 8 || boosts_view.len != (Py_ssize_t)m * 4 || k < 1) {
        PyErr_SetString(PyExc_ValueError, "search(term_ids: int64 bytes, boosts: float32 bytes, k >= 1)");
        goto done;
    }
    const int64_t *tids = tids_view.buf;
    const float *boosts = boosts_view.buf;
    const int64_t *indptr = BUF(self, INDPTR), *blockptr = BUF(self, BLOCKPTR);
    const float *idf = BUF(self, IDF), *bmax = BUF(self, BLOCKMAX);
    cur = calloc((size_t)(m > 0 ? m : 1), sizeof(Cursor));
    heap = malloc(sizeof(Hit) * (size_t)k);
    tables = self->coded ? malloc(sizeof(float) * TABLE_TF * 256 * (size_t)(m > 0 ? m : 1)) : NULL;
    if (!cur || !heap || (self->coded && !tables)) {
        PyErr_NoMemory();
        goto done;
    }
    int used = 0;
    for (int i = 0; i < m; i++) {
        int64_t t = tids[i];
        if (t < 0 || t >= self->n_terms) {
            PyErr_Format(PyExc_IndexError, "term id %lld out of range", (long long)t);
            goto done;
        }
        int64_t start = indptr[t], n = indptr[t + 1] - start;
        if (n == 0) continue;
        Cursor *c = &cur[used++];
        c->docs = (const uint32_t *)BUF(self, DOCS) + start;
        c->tf_width = self->tf_width;
        c->tfs = (const char *)BUF(self, TFS) + start * self->tf_width;
        c->n = n;
        c->bmax = bmax + blockptr[t];
        c->blast = (const uint32_t *)BUF(self, BLOCKLAST) + blockptr[t];
        c->nb = blockptr[t + 1] - blockptr[t];
        c->weight = boosts[i] * idf[t];
        c->boost = boosts[i];
        if (self->coded) {
            /* Exactly term_score's arithmetic, done once per (tf, code) instead of per posting. */
            const float *cache = BUF(self, NORMCACHE);
            float *table = tables + (size_t)(used - 1) * TABLE_TF * 256;
            for (int f = 1; f <= TABLE_TF; f++)
                for (int code = 0; code < 256; code++)
                    table[(f - 1) * 256 + code] = c->weight - c->weight / (1.0f + (float)f * cache[code]);
            c->table = table;
        }
        c->cur = c->docs[0];
    }
    int64_t size;
    Py_BEGIN_ALLOW_THREADS
    size = run_search(self, cur, used, k, heap);
    Py_END_ALLOW_THREADS
    if (size == -1) {
        PyErr_NoMemory();
        goto done;
    }
    if (size == -2) {
        PyErr_SetString(PyExc_ValueError, "a posting names a document beyond the collection");
        goto done;
    }
    result = PyList_New(size);
    if (!result) goto done;
    for (int64_t i = 0; i < size; i++) {
        PyObject *pair = Py_BuildValue("(kd)", (unsigned long)heap[i].doc, (double)heap[i].score);
        if (!pair) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, pair);
    }
done:
    free(cur);
    free(heap);
    free(tables);
    PyBuffer_Release(&tids_view);
    PyBuffer_Release(&boosts_view);
    return result;
}

static PyMethodDef Ranker_methods[] = {
    {"search", (PyCFunction)Ranker_search, METH_VARARGS,
     "search(term_ids, boosts, k) -> [(doc, score), ...]: the k best documents, best first.\n\n"
     "term_ids: int64 bytes (distinct ids); boosts: float32 bytes (one per term, Anserini's repeat\n"
     "count); scores are Lucene's float32 BM25 scores. Runs without the GIL."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject RankerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "toolgym.tools._bm25kernel.Ranker",
    .tp_doc = "Top-k BM25 over memory-mapped postings (see the module source for the algorithm).",
    .tp_basicsize = sizeof(Ranker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ranker_init,
    .tp_dealloc = (destructor)Ranker_dealloc,
    .tp_methods = Ranker_methods,
};

static struct PyModuleDef kernel_module = {
    PyModuleDef_HEAD_INIT, "_bm25kernel",
    "Exact top-k BM25 (Lucene's float arithmetic) with block-max MaxScore pruning.", -1, NULL};

PyMODINIT_FUNC PyInit__bm25kernel(void) {
    if (PyType_Ready(&RankerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&kernel_module);
    if (!m) return NULL;
    Py_INCREF(&RankerType);
    if (PyModule_AddObject(m, "Ranker", (PyObject *)&RankerType) < 0) {
        Py_DECREF(&RankerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
