/*
 * Top-k BM25 retrieval over the default backend's postings, exact to Lucene's float arithmetic.
 *
 * The Python side (toolgym.tools.search.bm25_search) analyses the query, looks its terms up and calls
 * Ranker.search(term_ids, boosts, k). This file does the rest without the GIL, so several threads
 * of one process search at once.
 *
 * Scores. Lucene's BM25Similarity scores a (term, document) pair in float:
 *     weight = boost * idf;  score = weight - weight / (1 + freq * normInverse[norm code])
 * where normInverse is a 256-entry cache indexed by the document's one-byte length norm (or, with
 * Lucene's norms off, one float per document). A document's score is the sum of its terms' scores
 * in double, cast to float. The same operations in the same precision give bit-identical scores
 * (compile with -ffp-contract=off: a fused multiply-add would round once instead of twice). Per
 * query, each term's scores for frequencies 1 and 2 and every norm code are tabulated once, with the
 * same arithmetic, so nearly every posting is scored by a table look-up.
 *
 * Order. Best score first, ties broken by the rank of the document's external id in sorted order
 * (Anserini sorts by score, then by id), so the k returned are exactly Anserini's k.
 *
 * Postings. A term's postings (ascending documents, with their frequencies) are cut into blocks of
 * `block` postings (a power of two). Each block has its highest boost-1 score, its last document,
 * its base (first) document and its place in the document-id bytes: a block spanning fewer than
 * 65,536 ids stores 2-byte offsets from its base (padded to 4 bytes), any other stores 4-byte ids
 * and has the base UINT32_MAX. Nearly every block is narrow, so ids cost about two bytes each.
 *
 * Pruning. MaxScore with block-max bounds, over windows of documents. In a window, a term's bound is
 * the highest maximum of its blocks there; terms are ordered by it, and the lowest ones whose bounds
 * sum below the current k-th score are "non-essential": no document that only they match can enter
 * the top k. So only the essential terms' documents are candidates (their postings summed
 * term-at-a-time into an accumulator); a window with no essential term is skipped whole. The
 * non-essential terms are frequent ones, yet a candidate usually lacks them: a frequent term has a
 * presence map (bit g set when any document in [g << shift, (g + 1) << shift) holds the term, about
 * 8 bits per posting). The candidates are then filtered in three steps:
 *   A. collected in document order, keeping those whose partial score plus every non-essential
 *      bound reaches the k-th score;
 *   B. one non-essential term at a time, highest bound first, over all the kept candidates: the
 *      term's presence bit adds its bound to the candidate's upper bound (a clear bit adds nothing:
 *      the document lacks the term), and a candidate whose upper bound plus the bounds of the terms
 *      still to test falls below the k-th score is dropped. Each step is a loop without a branch
 *      per candidate; at a million documents, once there is a k-th score, under 1% of the candidates
 *      are left;
 *   C. the survivors get their exact scores, seeking only into terms whose bits were set, and are
 *      dropped as soon as their partial score plus the bounds still to add (a block's own bound
 *      where known) cannot reach the k-th score.
 * Every comparison keeps a relative margin so rounding can never drop a document that belongs in
 * the result: pruning only skips work, it never changes the answer (tests compare it with an
 * exhaustive scorer).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 0: float and double operations are evaluated in their own type (SSE, NEON); 16: the same, with
 * _Float16 evaluated in float (compilers targeting AVX512-FP16). x87's extended precision would break
 * the bit-for-bit agreement with Java. */
#if !defined(FLT_EVAL_METHOD) || (FLT_EVAL_METHOD != 0 && FLT_EVAL_METHOD != 16)
#error "Lucene-exact scores need float arithmetic evaluated in float (FLT_EVAL_METHOD 0 or 16)"
#endif

#define END_DOC UINT32_MAX
#define WIDE_BLOCK UINT32_MAX
/* Bounds are inflated by this much before a comparison that could prune (float rounding of the
 * sums and of boosted weights is far below it). */
#define MARGIN 1e-5
/* Term frequencies up to this are scored from a per-query table (no division, no float norm). */
#define TABLE_TF 2
/* Documents per window (a multiple of 64: the window's seen-bitmap is 64-bit words). */
#define WINDOW 16384

enum { DOCBYTES, BLOCKOFF, BLOCKBASE, TFS, NORMS, NORMCACHE, IDRANK, INDPTR, BLOCKPTR, BLOCKMAX, BLOCKLAST, IDF,
       PRESENCE, PRESPTR, PRESSHIFT, N_VIEWS };
static const char *VIEW_NAMES[N_VIEWS] = {"docbytes", "blockoff",  "blockbase", "tfs",      "norms",
                                          "normcache", "idrank",   "indptr",    "blockptr", "blockmax",
                                          "blocklast", "idf",      "presence",  "presptr",  "presshift"};
/* Item size of each array; 0: 1, 2 or 4 bytes (term frequencies), -1: 1 or 4 bytes (norms: Lucene's
 * one-byte norm codes, decoded by the 256-entry normcache, or one float per document). */
static const Py_ssize_t VIEW_ITEMSIZE[N_VIEWS] = {1, 8, 4, 0, -1, 4, 4, 8, 8, 4, 4, 4, 8, 8, 1};

typedef struct {
    PyObject_HEAD
    Py_buffer views[N_VIEWS];
    int ready;
    int tf_width;
    int coded; /* norms are one-byte codes (and normcache decodes them) */
    int64_t block, shift;
    int64_t n_terms, n_docs, n_postings, n_blocks;
} Ranker;

#define BUF(self, which) ((self)->views[which].buf)

typedef struct {
    const uint8_t *docbytes; /* the whole index's id bytes */
    const int64_t *boff;     /* this term's blocks' byte offsets into docbytes */
    const uint32_t *base;    /* this term's blocks' base documents (WIDE_BLOCK: 4-byte ids) */
    const void *tfs;
    int tf_width; /* bytes per term frequency: 1, 2 or 4 */
    int64_t n, pos;
    const float *bmax;
    const uint32_t *blast;
    int64_t nb, bpos;
    int64_t shift;      /* log2 of the block size */
    int64_t loaded;     /* the block whose ids d16/d32 point at, or -1 */
    const uint16_t *d16; /* its 2-byte offsets from cbase, or NULL */
    const uint32_t *d32; /* its 4-byte ids, or NULL */
    uint32_t cbase;
    float weight;       /* boost * idf, in float as Lucene computes it */
    const float *table; /* [TABLE_TF][256]: this term's score for tf 1..TABLE_TF and each norm code */
    double boost;
    uint32_t cur;          /* the document at pos, or END_DOC */
    const uint64_t *pres;  /* the term's presence map (bit g: a posting in [g << pshift, (g + 1) << pshift)), or NULL */
    int pshift;
} Cursor;

typedef struct {
    float score;
    uint32_t rank;
    uint32_t doc;
} Hit;

typedef struct {
    const uint8_t *codes; /* per document, when coded */
    const float *cache;   /* normInverse per code, when coded */
    const float *floats;  /* normInverse per document, when not coded */
} Norms;

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

/* ------------------------------------------------------------------------------------- postings */

static inline void load_block(Cursor *c, int64_t b) {
    const uint8_t *bytes = c->docbytes + c->boff[b];
    c->loaded = b;
    c->cbase = c->base[b];
    if (c->cbase == WIDE_BLOCK) {
        c->d16 = NULL;
        c->d32 = (const uint32_t *)bytes;
    } else {
        c->d16 = (const uint16_t *)bytes;
        c->d32 = NULL;
    }
}

/* The document of posting pos (0 <= pos < n). */
static inline uint32_t doc_at(Cursor *c, int64_t pos) {
    int64_t b = pos >> c->shift, i = pos & (((int64_t)1 << c->shift) - 1);
    if (b != c->loaded) load_block(c, b);
    return c->d16 ? c->cbase + c->d16[i] : c->d32[i];
}

static inline uint32_t tf_at(const Cursor *c, int64_t pos) {
    switch (c->tf_width) {
    case 1: return ((const uint8_t *)c->tfs)[pos];
    case 2: return ((const uint16_t *)c->tfs)[pos];
    default: return ((const uint32_t *)c->tfs)[pos];
    }
}

static inline float term_score(const Cursor *c, uint32_t freq, uint32_t doc, const Norms *nv) {
    float ni;
    if (nv->codes) {
        uint8_t code = nv->codes[doc];
        if (freq - 1 < TABLE_TF) return c->table[(freq - 1) * 256 + code]; /* freq 0 (corrupt) wraps */
        ni = nv->cache[code];
    } else {
        ni = nv->floats[doc];
    }
    return c->weight - c->weight / (1.0f + (float)freq * ni);
}

static inline float score_here(Cursor *c, const Norms *nv) { return term_score(c, tf_at(c, c->pos), c->cur, nv); }

/* Bit d >> shift of a presence map: 0 when no document of d's group holds the term (then d lacks it). */
static inline uint64_t map_bit(const uint64_t *pres, int shift, uint32_t d) {
    uint32_t g = d >> shift;
    return (pres[g >> 6] >> (g & 63)) & 1;
}

/* False when the term's presence map says d lacks it (a term without a map may hold anything). */
static inline int may_hold(const Cursor *c, uint32_t d) { return !c->pres || map_bit(c->pres, c->pshift, d); }

static inline void exhaust(Cursor *c) {
    c->pos = c->n;
    c->cur = END_DOC;
}

/* Move the block cursor to the first block whose last document is >= target (ids not read). */
static inline int shallow_seek(Cursor *c, uint32_t target) {
    int64_t b = c->bpos;
    if (b < c->nb && c->blast[b] >= target) return 1;
    while (b < c->nb && c->blast[b] < target) b++;
    c->bpos = b;
    return b < c->nb;
}

/* Move the cursor to its first posting >= target. */
static inline void seek(Cursor *c, uint32_t target) {
    if (c->cur >= target) return; /* END_DOC is >= everything */
    if (!shallow_seek(c, target)) {
        exhaust(c);
        return;
    }
    int64_t lo = c->bpos << c->shift, hi = lo + ((int64_t)1 << c->shift);
    if (lo < c->pos) lo = c->pos;
    if (hi > c->n) hi = c->n;
    if (c->loaded != c->bpos) load_block(c, c->bpos);
    /* Within one block: offsets relative to its first posting. The last posting of the block is
     * blast[bpos] >= target. Candidates come in document order, so the target is usually a few
     * postings ahead: look there first, then halve what is left. */
    int64_t first = c->bpos << c->shift, i = lo - first, end = hi - first;
    const uint16_t *d16 = c->d16;
    const uint32_t *d32 = c->d32;
#define FIRST_AT_LEAST(IDS, REL)                                                                               \
    do {                                                                                                       \
        int step = 0;                                                                                          \
        while (step < 16 && i < end && IDS[i] < (REL)) i++, step++;                                            \
        if (step == 16)                                                                                        \
            for (int64_t h = end; i < h;) {                                                                    \
                int64_t mid = i + ((h - i) >> 1);                                                              \
                if (IDS[mid] < (REL)) i = mid + 1;                                                             \
                else h = mid;                                                                                  \
            }                                                                                                  \
    } while (0)
    if (d16) {
        /* base <= every id of the block; a target before the base: the first remaining posting */
        if (target >= c->cbase) {
            const uint32_t rel = target - c->cbase;
            FIRST_AT_LEAST(d16, rel);
        }
    } else {
        FIRST_AT_LEAST(d32, target);
    }
#undef FIRST_AT_LEAST
    if (i >= end) { /* only a corrupt block has no posting >= its own last document */
        exhaust(c);
        return;
    }
    c->pos = first + i;
    c->cur = d16 ? c->cbase + d16[i] : d32[i];
}

/* A lower bound on the cursor's first document >= from, without reading beyond one block. */
static inline uint32_t next_bound(Cursor *c, uint32_t from) {
    if (c->cur >= from) return c->cur; /* exact (or END_DOC) */
    if (!shallow_seek(c, from)) {
        exhaust(c);
        return END_DOC;
    }
    int64_t p = c->bpos << c->shift;
    if (p < c->pos) p = c->pos;
    uint32_t d = doc_at(c, p);
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

/* One block's postings [pos, end) below hi, added to the accumulator; returns where it stopped, or
 * -1 on a posting below lo (out of order: corrupt). ID(i) reads the block's i-th id; the common case
 * (one-byte frequencies, Lucene's norm codes, frequencies read from the table) runs on locals. */
#define ACCUMULATE_BLOCK(ID)                                                                                   \
    do {                                                                                                       \
        if (fast) {                                                                                            \
            const uint8_t *tf8 = c->tfs;                                                                       \
            for (; pos < end; pos++) {                                                                         \
                uint32_t d = ID(pos - first);                                                                  \
                if (d >= hi) break;                                                                            \
                if (d < lo) return -1;                                                                         \
                uint32_t off = d - lo, freq = tf8[pos];                                                        \
                uint8_t code = codes[d];                                                                       \
                acc[off] += freq - 1 < TABLE_TF ? table[(freq - 1) * 256 + code]                               \
                                                : weight - weight / (1.0f + (float)freq * cache[code]);        \
                seen[off >> 6] |= (uint64_t)1 << (off & 63);                                                   \
            }                                                                                                  \
        } else {                                                                                               \
            for (; pos < end; pos++) {                                                                         \
                uint32_t d = ID(pos - first);                                                                  \
                if (d >= hi) break;                                                                            \
                if (d < lo) return -1;                                                                         \
                uint32_t off = d - lo;                                                                         \
                acc[off] += term_score(c, tf_at(c, pos), d, nv);                                               \
                seen[off >> 6] |= (uint64_t)1 << (off & 63);                                                   \
            }                                                                                                  \
        }                                                                                                      \
    } while (0)
#define NARROW_ID(i) (base + d16[i])
#define WIDE_ID(i) (d32[i])

/* Add the cursor's scores for its postings in [lo, hi) to the window accumulator and mark them seen;
 * the cursor ends on its first posting >= hi. Returns -1 on postings out of order (corrupt). */
static int accumulate(Cursor *c, uint32_t lo, uint32_t hi, const Norms *nv, double *acc, uint64_t *seen) {
    const int fast = c->tf_width == 1 && nv->codes != NULL;
    const uint8_t *codes = nv->codes;
    const float *cache = nv->cache, *table = c->table;
    const float weight = c->weight;
    while (c->cur < hi) {
        if (c->cur < lo) return -1;
        /* The rest of the current block. */
        int64_t b = c->pos >> c->shift, end = (b + 1) << c->shift;
        if (end > c->n) end = c->n;
        if (c->loaded != b) load_block(c, b);
        int64_t first = b << c->shift, pos = c->pos;
        const uint16_t *d16 = c->d16;
        const uint32_t *d32 = c->d32;
        const uint32_t base = c->cbase;
        if (d16) ACCUMULATE_BLOCK(NARROW_ID);
        else ACCUMULATE_BLOCK(WIDE_ID);
        c->pos = pos;
        c->cur = pos < c->n ? doc_at(c, pos) : END_DOC;
        if (pos < end) break; /* stopped at hi inside the block */
    }
    return 0;
}

/* --------------------------------------------------------------------------------------- search */

/* A window's candidates (struct of arrays, in document order): the document, its exact partial
 * score, an upper bound on its final score, and bit i set when the presence map of the i-th
 * non-essential term tested (highest bound first) may hold it. */
typedef struct {
    uint32_t *doc;
    double *partial, *upper;
    uint64_t *maybe;
} Candidates;

/* Step A: the documents seen in the window, in order, with their accumulated scores (the
 * accumulator and the bitmap are left zeroed); those below keep are dropped. Returns their number. */
static int64_t collect(uint64_t *seen, double *acc, uint32_t lo, double keep, Candidates *cs) {
    uint32_t *restrict doc = cs->doc;
    double *restrict partial = cs->partial, *restrict upper = cs->upper;
    uint64_t *restrict maybe = cs->maybe;
    int64_t n = 0;
    for (int w = 0; w < WINDOW / 64; w++) {
        uint64_t bits = seen[w];
        if (!bits) continue;
        seen[w] = 0;
        do {
            uint32_t off = (uint32_t)(w * 64 + __builtin_ctzll(bits));
            bits &= bits - 1;
            double s = acc[off];
            acc[off] = 0.0;
            doc[n] = lo + off;
            partial[n] = s;
            upper[n] = s;
            maybe[n] = 0;
            n += s >= keep; /* written either way, kept only if it passes: no branch */
        } while (bits);
    }
    return n;
}

/* Step B for one term with a presence map and window bound b: each candidate's upper bound gains b
 * where the map's bit is set (bit `bit` of maybe records it); those whose bound falls below keep are
 * dropped. Returns how many are left. */
static int64_t filter_by_map(const Cursor *c, double b, int bit, double keep, Candidates *cs, int64_t n) {
    const uint64_t *restrict pres = c->pres;
    const int shift = c->pshift;
    uint32_t *restrict doc = cs->doc;
    double *restrict partial = cs->partial, *restrict upper = cs->upper;
    uint64_t *restrict maybe = cs->maybe;
    int64_t kept = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t d = doc[i];
        uint64_t h = map_bit(pres, shift, d);
        double u = upper[i] + (double)h * b;
        doc[kept] = d;
        partial[kept] = partial[i];
        upper[kept] = u;
        maybe[kept] = maybe[i] | (h << bit);
        kept += u >= keep;
    }
    return kept;
}

/* The search proper; no Python calls. Documents are taken in windows of WINDOW ids. Per window,
 * each term's bound is the highest block maximum it has there; terms are ordered by that bound and
 * the lowest ones whose bounds sum below the k-th score are non-essential. The essential terms'
 * postings in the window are summed term-at-a-time into an accumulator; the documents they reached
 * are filtered by the non-essential terms' bounds and presence maps (steps A and B, see the top of
 * this file), and what is left gets the non-essential terms' exact scores (step C). Returns the
 * number of hits written (sorted), -1 when out of memory, -2 when the postings are inconsistent (a
 * corrupt index). */
static int64_t run_search(const Ranker *self, Cursor *cur, int m, int64_t k, Hit *heap) {
    Norms nv = {NULL, NULL, NULL};
    if (self->coded) {
        nv.codes = BUF(self, NORMS);
        nv.cache = BUF(self, NORMCACHE);
    } else {
        nv.floats = BUF(self, NORMS);
    }
    const uint32_t *idrank = BUF(self, IDRANK);
    const uint32_t n_docs = (uint32_t)self->n_docs;
    int64_t size = 0, status = 0;
    double *bound = malloc(sizeof(double) * (size_t)(3 * m + 2));
    int *order = malloc(sizeof(int) * (size_t)(m + 1));
    double *acc = calloc(WINDOW, sizeof(double));
    uint64_t *seen = calloc(WINDOW / 64, sizeof(uint64_t));
    Candidates cs = {malloc(sizeof(uint32_t) * WINDOW), malloc(sizeof(double) * WINDOW),
                     malloc(sizeof(double) * WINDOW), malloc(sizeof(uint64_t) * WINDOW)};
    if (!bound || !order || !acc || !seen || !cs.doc || !cs.partial || !cs.upper || !cs.maybe) {
        status = -1;
        goto out;
    }
    double *prefix = bound + m, *need = bound + 2 * m;
    float thr = -INFINITY; /* the k-th best score once the heap is full */
    double cut = -INFINITY; /* a bound below cut cannot reach the final k-th score, whatever the rounding */
    uint32_t from = 0;

    for (;;) {
        uint32_t lo = END_DOC;
        for (int i = 0; i < m; i++) {
            uint32_t d = next_bound(&cur[i], from);
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
            seek(c, lo);
            if (accumulate(c, lo, hi, &nv, acc, seen) < 0) {
                status = -2;
                goto out;
            }
        }

        /* need[j + 1]: what a document must already score for terms 0..j still to reach the cut. */
        need[0] = cut;
        for (int j = 0; j < ne; j++) need[j + 1] = cut - prefix[j];
        int64_t n = collect(seen, acc, lo, need[ne], &cs);
        /* Step B, non-essential term j tested as bit ne - 1 - j (the first 64 of them). A term with
         * no posting in the window is known absent; one without a map cannot be tested, and its
         * bound is added to every candidate's (extra). */
        uint64_t tested = 0;
        double extra = 0.0;
        for (int j = ne - 1; j >= 0 && j >= ne - 64 && n > 0; j--) {
            const Cursor *c = &cur[order[j]];
            const int bit = ne - 1 - j;
            const double b = bound[order[j]];
            if (b == 0.0) {
                tested |= (uint64_t)1 << bit;
            } else if (!c->pres) {
                extra += b;
            } else {
                tested |= (uint64_t)1 << bit;
                n = filter_by_map(c, b, bit, need[j] - extra, &cs, n);
            }
        }

        /* Step C: exact scores, in document order. */
        for (int64_t i = 0; i < n; i++) {
            const uint32_t d = cs.doc[i];
            const uint64_t maybe = cs.maybe[i];
            double s = cs.partial[i];
            int pruned = 0;
            for (int j = ne - 1; j >= 0; j--) {
                if (s < need[j + 1]) {
                    pruned = 1;
                    break;
                }
                Cursor *c = &cur[order[j]];
                const int bit = ne - 1 - j;
                const int known = bit < 64 && ((tested >> bit) & 1);
                if (known && !((maybe >> bit) & 1)) continue; /* its map says absent */
                if (c->cur < d) {
                    if (!known && !may_hold(c, d)) continue; /* a set bit may be a false alarm: seek then */
                    if (!shallow_seek(c, d)) {
                        exhaust(c);
                        continue;
                    }
                    if (s + (double)c->bmax[c->bpos] * c->boost < need[j]) {
                        pruned = 1;
                        break;
                    }
                    seek(c, d);
                }
                if (c->cur == d) s += score_here(c, &nv);
            }
            if (pruned || s < need[0]) continue;
            Hit h = {(float)s, idrank[d], d};
            push_hit(heap, &size, k, h);
            if (size == k && heap[0].score != thr) {
                thr = heap[0].score;
                cut = thr / (1.0 + MARGIN);
                need[0] = cut;
                for (int j = 0; j < ne; j++) need[j + 1] = cut - prefix[j];
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
    free(cs.doc);
    free(cs.partial);
    free(cs.upper);
    free(cs.maybe);
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

static int check_structure(Ranker *self) {
    /* O(terms + blocks): an inconsistent table must raise, never read out of bounds. */
    const int64_t *indptr = BUF(self, INDPTR), *blockptr = BUF(self, BLOCKPTR), *boff = BUF(self, BLOCKOFF);
    const uint32_t *base = BUF(self, BLOCKBASE);
    int64_t block = self->block, n_bytes = self->views[DOCBYTES].shape[0];
    if (block < 1 || (block & (block - 1)) || self->views[TFS].shape[0] != self->n_postings ||
        self->views[IDRANK].shape[0] != self->n_docs || self->views[BLOCKLAST].shape[0] != self->n_blocks ||
        self->views[BLOCKBASE].shape[0] != self->n_blocks || self->views[BLOCKOFF].shape[0] != self->n_blocks + 1 ||
        self->views[INDPTR].shape[0] != self->n_terms + 1 || self->views[BLOCKPTR].shape[0] != self->n_terms + 1 ||
        self->views[PRESPTR].shape[0] != self->n_terms + 1 || self->views[PRESSHIFT].shape[0] != self->n_terms ||
        self->n_docs >= (int64_t)END_DOC || self->views[NORMCACHE].shape[0] != (self->coded ? 256 : 0)) {
        PyErr_SetString(PyExc_ValueError, "inconsistent array sizes");
        return -1;
    }
    if (indptr[0] != 0 || blockptr[0] != 0 || indptr[self->n_terms] != self->n_postings ||
        blockptr[self->n_terms] != self->n_blocks || boff[0] != 0 || boff[self->n_blocks] != n_bytes) {
        PyErr_SetString(PyExc_ValueError, "term offsets do not span the postings");
        return -1;
    }
    const int64_t *presptr = BUF(self, PRESPTR);
    const uint8_t *presshift = BUF(self, PRESSHIFT);
    if (presptr[0] != 0 || presptr[self->n_terms] != self->views[PRESENCE].shape[0]) {
        PyErr_SetString(PyExc_ValueError, "presence offsets do not span the presence maps");
        return -1;
    }
    for (int64_t t = 0; t < self->n_terms; t++) {
        int64_t words = presptr[t + 1] - presptr[t], shift = presshift[t];
        if (words != 0 && (shift > 31 || self->n_docs == 0 || words != (((self->n_docs - 1) >> shift) >> 6) + 1)) {
            PyErr_Format(PyExc_ValueError, "term %lld: a presence map of %lld words (shift %lld) for %lld documents",
                         (long long)t, (long long)words, (long long)shift, (long long)self->n_docs);
            return -1;
        }
    }
    for (int64_t t = 0; t < self->n_terms; t++) {
        int64_t n = indptr[t + 1] - indptr[t], nb = blockptr[t + 1] - blockptr[t];
        if (n < 0 || nb != (n + block - 1) / block) {
            PyErr_Format(PyExc_ValueError, "term %lld: %lld postings but %lld blocks", (long long)t,
                         (long long)n, (long long)nb);
            return -1;
        }
        for (int64_t b = 0; b < nb; b++) {
            int64_t g = blockptr[t] + b, count = b + 1 < nb ? block : n - b * block;
            int64_t bytes = boff[g + 1] - boff[g];
            int64_t want = base[g] == WIDE_BLOCK ? 4 * count : 2 * count + 2 * (count & 1);
            if (bytes != want || boff[g] % 4) {
                PyErr_Format(PyExc_ValueError, "block %lld holds %lld bytes for %lld postings", (long long)g,
                             (long long)bytes, (long long)count);
                return -1;
            }
        }
    }
    return 0;
}

static int Ranker_init(Ranker *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"docbytes", "blockoff",  "blockbase", "tfs",      "norms",    "normcache",
                             "idrank",   "indptr",    "blockptr",  "blockmax", "blocklast", "idf",
                             "presence", "presptr",   "presshift", "block",    NULL};
    PyObject *o[N_VIEWS];
    Py_ssize_t block;
    if (self->ready) {
        /* Threads may be searching the arrays: swapping them under their feet would crash. */
        PyErr_SetString(PyExc_RuntimeError, "a Ranker is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOOOOOOOOn", kwlist, &o[0], &o[1], &o[2], &o[3], &o[4],
                                     &o[5], &o[6], &o[7], &o[8], &o[9], &o[10], &o[11], &o[12], &o[13], &o[14],
                                     &block))
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
    self->shift = 0;
    while (((int64_t)1 << self->shift) < block) self->shift++;
    self->n_postings = self->views[TFS].shape[0];
    self->n_docs = self->views[NORMS].shape[0];
    self->n_terms = self->views[IDF].shape[0];
    self->n_blocks = self->views[BLOCKMAX].shape[0];
    if (check_structure(self) < 0) goto fail;
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
        c->docbytes = BUF(self, DOCBYTES);
        c->boff = (const int64_t *)BUF(self, BLOCKOFF) + blockptr[t];
        c->base = (const uint32_t *)BUF(self, BLOCKBASE) + blockptr[t];
        c->tf_width = self->tf_width;
        c->tfs = (const char *)BUF(self, TFS) + start * self->tf_width;
        c->n = n;
        c->bmax = bmax + blockptr[t];
        c->blast = (const uint32_t *)BUF(self, BLOCKLAST) + blockptr[t];
        c->nb = blockptr[t + 1] - blockptr[t];
        c->shift = self->shift;
        c->loaded = -1;
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
        const int64_t *presptr = BUF(self, PRESPTR);
        c->pres = presptr[t + 1] > presptr[t] ? (const uint64_t *)BUF(self, PRESENCE) + presptr[t] : NULL;
        c->pshift = ((const uint8_t *)BUF(self, PRESSHIFT))[t];
        c->cur = doc_at(c, 0);
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
        PyErr_SetString(PyExc_ValueError, "the postings are inconsistent: a document beyond the collection or out of order");
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
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "toolgym.tools.search._bm25kernel.Ranker",
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
