/* KeyTable: 16-byte block key -> small-int holding code, open addressing, plus per-location reverse lists.
 *
 * Layout (like CPython's compact dict): `entries` is a dense array of {key, code} that never moves on resize;
 * `index` is a power-of-two array of entry numbers + 1 (0: empty), linear probing, deletion by backward shift
 * (no tombstones), load factor at most 1/2. Freed entries are reused through a free list. Reverse lists are
 * append-only arrays of entry numbers per location id; a stale number (its key since lost the location) is
 * skipped by the caller's code mapping. All memory comes from PyMem_Raw* so tracemalloc counts it.
 * Every method runs with the GIL held and never releases it, so each call is atomic for Python threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "_native.h"

#define FREE_CODE 0xFFFFFFFFu
#define MAX_LOCATIONS (1 << 24) /* location ids index an array of reverse lists */

/* A code in [0, FREE_CODE) and a location id in [-1, MAX_LOCATIONS); -1 with OverflowError set otherwise. */
static int check_code_loc(Py_ssize_t code, Py_ssize_t loc) {
    if (code < 0 || (uint64_t)code >= FREE_CODE) {
        PyErr_Format(PyExc_OverflowError, "code %zd is not in [0, 2**32 - 1)", code);
        return -1;
    }
    if (loc < -1 || loc >= MAX_LOCATIONS) {
        PyErr_Format(PyExc_OverflowError, "location id %zd is not in [-1, %d)", loc, MAX_LOCATIONS);
        return -1;
    }
    return 0;
}

#pragma pack(push, 1)
typedef struct {
    uint8_t key[16];
    uint32_t code; /* FREE_CODE: a free entry; its first 4 key bytes chain the free list */
} Entry;
#pragma pack(pop)

typedef struct {
    uint32_t *ids;
    Py_ssize_t len, cap;
} RevList;

typedef struct {
    PyObject_HEAD
    Entry *entries;
    Py_ssize_t nentries, capentries, used;
    uint32_t free_head; /* entry number + 1 of the first free entry; 0: none */
    uint32_t *index;
    uint64_t mask; /* index size - 1 */
    int shift;     /* 64 - log2(index size) */
    RevList *rev;
    Py_ssize_t nrev;
} KeyTable;

static inline uint64_t slot_hash(const uint8_t *k) {
    uint64_t a, b;
    memcpy(&a, k, 8);
    memcpy(&b, k + 8, 8);
    return (a ^ ((b << 32) | (b >> 32))) * 0x9E3779B97F4A7C15ULL; /* keys are random; this also spreads others */
}

static int key_of(PyObject *o, const uint8_t **out) {
    if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) != 16) {
        PyErr_Format(PyExc_ValueError, "block keys must be 16 bytes, got %R", o);
        return -1;
    }
    *out = (const uint8_t *)PyBytes_AS_STRING(o);
    return 0;
}

/* Index position of `key`, or of the empty slot where it would go; *found tells which. */
static inline uint64_t probe(const KeyTable *t, const uint8_t *key, int *found) {
    uint64_t i = slot_hash(key) >> t->shift;
    for (;;) {
        uint32_t e = t->index[i];
        if (e == 0) {
            *found = 0;
            return i;
        }
        if (memcmp(t->entries[e - 1].key, key, 16) == 0) {
            *found = 1;
            return i;
        }
        i = (i + 1) & t->mask;
    }
}

static int resize_index(KeyTable *t, int bits) {
    uint32_t *index = PyMem_RawCalloc((size_t)1 << bits, sizeof(uint32_t));
    if (index == NULL) return -1;
    uint64_t mask = ((uint64_t)1 << bits) - 1;
    for (Py_ssize_t e = 0; e < t->nentries; e++) {
        if (t->entries[e].code == FREE_CODE) continue;
        uint64_t i = slot_hash(t->entries[e].key) >> (64 - bits);
        while (index[i]) i = (i + 1) & mask;
        index[i] = (uint32_t)e + 1;
    }
    PyMem_RawFree(t->index);
    t->index = index;
    t->mask = mask;
    t->shift = 64 - bits;
    return 0;
}

/* A new entry for `key` with `code` at empty index slot `i` (which a resize may move). */
static Py_ssize_t add(KeyTable *t, const uint8_t *key, uint32_t code, uint64_t i) {
    if ((uint64_t)(t->used + 1) * 2 > t->mask + 1) {
        if (resize_index(t, 65 - t->shift) < 0) return -1;
        int found;
        i = probe(t, key, &found);
    }
    Py_ssize_t e;
    if (t->free_head) {
        e = t->free_head - 1;
        memcpy(&t->free_head, t->entries[e].key, 4);
    } else {
        if (t->nentries >= (Py_ssize_t)FREE_CODE - 1) return -1; /* entry numbers + 1 are uint32 */
        if (t->nentries == t->capentries) {
            Py_ssize_t cap = t->capentries ? t->capentries * 2 : 1024;
            Entry *grown = PyMem_RawRealloc(t->entries, (size_t)cap * sizeof(Entry));
            if (grown == NULL) return -1;
            t->entries = grown;
            t->capentries = cap;
        }
        e = t->nentries++;
    }
    memcpy(t->entries[e].key, key, 16);
    t->entries[e].code = code;
    t->index[i] = (uint32_t)e + 1;
    t->used++;
    return e;
}

/* Delete the key at index slot `i`: free its entry and shift later probes back (no tombstones). */
static void del_at(KeyTable *t, uint64_t i) {
    Py_ssize_t e = t->index[i] - 1;
    t->entries[e].code = FREE_CODE;
    memcpy(t->entries[e].key, &t->free_head, 4);
    t->free_head = (uint32_t)e + 1;
    t->used--;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        uint32_t f = t->index[j];
        if (f == 0) break;
        uint64_t home = slot_hash(t->entries[f - 1].key) >> t->shift;
        /* move f back to the hole at i unless its home lies cyclically in (i, j] */
        if (((j - home) & t->mask) >= ((j - i) & t->mask)) {
            t->index[i] = f;
            i = j;
        }
    }
    t->index[i] = 0;
}

static int rev_append(KeyTable *t, Py_ssize_t loc, Py_ssize_t e) {
    if (loc < 0) return 0;
    if (loc >= t->nrev) {
        Py_ssize_t n = loc + 8;
        RevList *grown = PyMem_RawRealloc(t->rev, (size_t)n * sizeof(RevList));
        if (grown == NULL) return -1;
        memset(grown + t->nrev, 0, (size_t)(n - t->nrev) * sizeof(RevList));
        t->rev = grown;
        t->nrev = n;
    }
    RevList *r = &t->rev[loc];
    if (r->len == r->cap) {
        Py_ssize_t cap = r->cap ? r->cap * 2 : 64;
        uint32_t *ids = PyMem_RawRealloc(r->ids, (size_t)cap * sizeof(uint32_t));
        if (ids == NULL) return -1;
        r->ids = ids;
        r->cap = cap;
    }
    r->ids[r->len++] = (uint32_t)e;
    return 0;
}

static PyObject *code_obj(uint32_t c) { return PyLong_FromUnsignedLong(c); }

static PyObject *KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    KeyTable *t = (KeyTable *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    if (resize_index(t, 10) < 0) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    return (PyObject *)t;
}

static void KeyTable_dealloc(KeyTable *t) {
    PyMem_RawFree(t->entries);
    PyMem_RawFree(t->index);
    for (Py_ssize_t i = 0; i < t->nrev; i++) PyMem_RawFree(t->rev[i].ids);
    PyMem_RawFree(t->rev);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyObject *KeyTable_get(KeyTable *t, PyObject *key) {
    const uint8_t *k;
    int found;
    if (key_of(key, &k) < 0) return NULL;
    uint64_t i = probe(t, k, &found);
    if (!found) Py_RETURN_NONE;
    return code_obj(t->entries[t->index[i] - 1].code);
}

/* lookup(keys, stop_at_miss, deadline=inf) -> (codes, distinct, timed_out): codes per key (None: absent), cut at
 * the first absent key when stop_at_miss, or where the deadline (a perf_counter value, checked every 256 keys)
 * passed; distinct is the set of codes in the list. Prefetches a few keys ahead. */
static PyObject *KeyTable_lookup(KeyTable *t, PyObject *args) {
    PyObject *keys;
    int stop, timed_out = 0;
    double deadline = 1e308;
    if (!PyArg_ParseTuple(args, "Op|d:lookup", &keys, &stop, &deadline)) return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *codes = PyList_New(0), *distinct = PySet_New(NULL), *last = NULL;
    if (codes == NULL || distinct == NULL) goto fail;
    for (Py_ssize_t j = 0; j < n; j++) { /* validate first: a bad key anywhere is an error, as in a dict index */
        const uint8_t *k;
        if (key_of(items[j], &k) < 0) goto fail;
    }
    enum { AHEAD = 16 };
    for (Py_ssize_t j = 0; j < n && j < AHEAD; j++)
        __builtin_prefetch(&t->index[slot_hash((const uint8_t *)PyBytes_AS_STRING(items[j])) >> t->shift]);
    for (Py_ssize_t j = 0; j < n; j++) {
        if (deadline < 1e300 && j % 256 == 0 && nkv_clock() > deadline) {
            timed_out = 1;
            break;
        }
        if (j + AHEAD < n)
            __builtin_prefetch(&t->index[slot_hash((const uint8_t *)PyBytes_AS_STRING(items[j + AHEAD])) >> t->shift]);
        if (j + AHEAD / 2 < n) {
            uint32_t e = t->index[slot_hash((const uint8_t *)PyBytes_AS_STRING(items[j + AHEAD / 2])) >> t->shift];
            if (e) __builtin_prefetch(&t->entries[e - 1]);
        }
        int found;
        uint64_t i = probe(t, (const uint8_t *)PyBytes_AS_STRING(items[j]), &found);
        PyObject *c;
        if (!found) {
            if (stop) break;
            c = Py_NewRef(Py_None);
        } else {
            c = code_obj(t->entries[t->index[i] - 1].code);
            if (c == NULL) goto fail;
        }
        if (PyList_Append(codes, c) < 0) {
            Py_DECREF(c);
            goto fail;
        }
        if (last == NULL || (c != last && PyObject_RichCompareBool(c, last, Py_NE) == 1)) {
            if (PySet_Add(distinct, c) < 0) {
                Py_DECREF(c);
                goto fail;
            }
        }
        last = c; /* the list holds it */
        Py_DECREF(c);
    }
    Py_DECREF(seq);
    return Py_BuildValue("(NNO)", codes, distinct, timed_out ? Py_True : Py_False);
fail:
    Py_DECREF(seq);
    Py_XDECREF(codes);
    Py_XDECREF(distinct);
    return NULL;
}

/* set(key, code, add_loc=-1) -> old code or None; appends the entry to location add_loc's reverse list. */
static PyObject *KeyTable_set(KeyTable *t, PyObject *args) {
    PyObject *key;
    Py_ssize_t code, loc = -1;
    const uint8_t *k;
    if (!PyArg_ParseTuple(args, "On|n:set", &key, &code, &loc) || key_of(key, &k) < 0) return NULL;
    if (check_code_loc(code, loc) < 0) return NULL;
    int found;
    uint64_t i = probe(t, k, &found);
    PyObject *old;
    Py_ssize_t e;
    if (found) {
        e = t->index[i] - 1;
        old = code_obj(t->entries[e].code); /* made before anything changes */
        if (old == NULL) return NULL;
        t->entries[e].code = (uint32_t)code;
    } else {
        e = add(t, k, (uint32_t)code, i);
        if (e < 0) return PyErr_NoMemory();
        old = Py_NewRef(Py_None);
    }
    if (rev_append(t, loc, e) < 0) {
        Py_XDECREF(old);
        return PyErr_NoMemory();
    }
    return old;
}

/* add_new(keys, code, loc) -> (added, [(i, old code)]): absent keys get `code` (and the location); keys held
 * with another code are left as they are and returned, for the caller to merge. */
static PyObject *KeyTable_add_new(KeyTable *t, PyObject *args) {
    PyObject *keys;
    Py_ssize_t code, loc;
    if (!PyArg_ParseTuple(args, "Onn:add_new", &keys, &code, &loc)) return NULL;
    if (check_code_loc(code, loc) < 0) return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *clash = PyList_New(0);
    Py_ssize_t added = 0;
    if (clash == NULL) goto fail;
    for (Py_ssize_t j = 0; j < n; j++) {
        const uint8_t *k;
        if (key_of(items[j], &k) < 0) goto fail;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        int found;
        const uint8_t *k = (const uint8_t *)PyBytes_AS_STRING(items[j]);
        uint64_t i = probe(t, k, &found);
        if (found) {
            uint32_t cur = t->entries[t->index[i] - 1].code;
            if (cur == code) continue;
            PyObject *pair = Py_BuildValue("(nk)", j, (unsigned long)cur);
            if (pair == NULL || PyList_Append(clash, pair) < 0) {
                Py_XDECREF(pair);
                goto fail;
            }
            Py_DECREF(pair);
            continue;
        }
        Py_ssize_t e = add(t, k, (uint32_t)code, i);
        if (e < 0 || rev_append(t, loc, e) < 0) {
            PyErr_NoMemory();
            goto fail;
        }
        added++;
    }
    Py_DECREF(seq);
    return Py_BuildValue("(nN)", added, clash);
fail:
    Py_DECREF(seq);
    Py_XDECREF(clash);
    return NULL;
}

static PyObject *KeyTable_delete(KeyTable *t, PyObject *key) {
    const uint8_t *k;
    int found;
    if (key_of(key, &k) < 0) return NULL;
    uint64_t i = probe(t, k, &found);
    if (!found) Py_RETURN_NONE;
    PyObject *old = code_obj(t->entries[t->index[i] - 1].code);
    if (old != NULL) del_at(t, i); /* nothing changes unless the answer can be returned */
    return old;
}

/* remap(loc, mapping) -> count: for every entry on location loc's reverse list whose code is a key of
 * `mapping`, set the mapped code (-1: delete the key); the list is then dropped. Each key counts once. */
static PyObject *KeyTable_remap(KeyTable *t, PyObject *args) {
    Py_ssize_t loc, count = 0;
    PyObject *mapping;
    if (!PyArg_ParseTuple(args, "nO!:remap", &loc, &PyDict_Type, &mapping)) return NULL;
    Py_ssize_t pos = 0;
    PyObject *from, *into;
    while (PyDict_Next(mapping, &pos, &from, &into)) { /* every value checked before anything changes */
        Py_ssize_t v = PyLong_AsSsize_t(into);
        if (v == -1 && PyErr_Occurred()) return NULL;
        if (v != -1 && check_code_loc(v, -1) < 0) return NULL;
    }
    if (loc < 0 || loc >= t->nrev) return PyLong_FromLong(0);
    RevList r = t->rev[loc];
    t->rev[loc].ids = NULL;
    t->rev[loc].len = t->rev[loc].cap = 0;
    for (Py_ssize_t j = 0; j < r.len; j++) {
        if (r.ids[j] >= (uint32_t)t->nentries) continue;
        Entry *en = &t->entries[r.ids[j]];
        if (en->code == FREE_CODE) continue;
        PyObject *c = code_obj(en->code);
        if (c == NULL) goto fail;
        PyObject *to = PyDict_GetItemWithError(mapping, c);
        Py_DECREF(c);
        if (to == NULL) {
            if (PyErr_Occurred()) goto fail;
            continue;
        }
        Py_ssize_t v = PyLong_AsSsize_t(to); /* checked above */
        count++;
        if (v >= 0) {
            en->code = (uint32_t)v;
        } else {
            int found;
            uint64_t i = probe(t, en->key, &found);
            if (found) del_at(t, i);
        }
    }
    PyMem_RawFree(r.ids);
    return PyLong_FromSsize_t(count);
fail:
    PyMem_RawFree(r.ids);
    return NULL;
}

/* keys_at(loc, codes) -> set of keys on location loc's list whose code is in `codes`; compacts the list. */
static PyObject *KeyTable_keys_at(KeyTable *t, PyObject *args) {
    Py_ssize_t loc;
    PyObject *codes;
    if (!PyArg_ParseTuple(args, "nO:keys_at", &loc, &codes)) return NULL;
    PyObject *out = PySet_New(NULL);
    if (out == NULL || loc < 0 || loc >= t->nrev) return out;
    RevList *r = &t->rev[loc];
    Py_ssize_t kept = 0;
    for (Py_ssize_t j = 0; j < r->len; j++) {
        Entry *en = &t->entries[r->ids[j]];
        if (en->code == FREE_CODE) continue;
        PyObject *c = code_obj(en->code);
        int has = c == NULL ? -1 : PySequence_Contains(codes, c);
        Py_XDECREF(c);
        if (has < 0) goto fail;
        if (!has) continue;
        PyObject *key = PyBytes_FromStringAndSize((const char *)en->key, 16);
        if (key == NULL) goto fail;
        int added = PySet_Contains(out, key) ? 0 : 1;
        if (PySet_Add(out, key) < 0) {
            Py_DECREF(key);
            goto fail;
        }
        Py_DECREF(key);
        if (added) r->ids[kept++] = r->ids[j];
    }
    r->len = kept; /* stale and repeated numbers dropped */
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *KeyTable_copy(KeyTable *t, PyObject *unused) {
    KeyTable *c = (KeyTable *)Py_TYPE(t)->tp_alloc(Py_TYPE(t), 0);
    if (c == NULL) return NULL;
    c->entries = PyMem_RawMalloc((size_t)(t->capentries ? t->capentries : 1) * sizeof(Entry));
    c->index = PyMem_RawMalloc((size_t)(t->mask + 1) * sizeof(uint32_t));
    if (c->entries == NULL || c->index == NULL) {
        Py_DECREF(c);
        return PyErr_NoMemory();
    }
    memcpy(c->entries, t->entries, (size_t)t->nentries * sizeof(Entry));
    memcpy(c->index, t->index, (size_t)(t->mask + 1) * sizeof(uint32_t));
    c->nentries = t->nentries;
    c->capentries = t->capentries;
    c->used = t->used;
    c->free_head = t->free_head;
    c->mask = t->mask;
    c->shift = t->shift;
    return (PyObject *)c; /* no reverse lists: a copy is read-only */
}

static PyObject *KeyTable_keys(KeyTable *t, PyObject *unused) {
    PyObject *out = PyList_New(0);
    for (Py_ssize_t e = 0; out != NULL && e < t->nentries; e++) {
        if (t->entries[e].code == FREE_CODE) continue;
        PyObject *key = PyBytes_FromStringAndSize((const char *)t->entries[e].key, 16);
        if (key == NULL || PyList_Append(out, key) < 0) Py_CLEAR(out);
        Py_XDECREF(key);
    }
    return out;
}

static PyObject *KeyTable_used_codes(KeyTable *t, PyObject *unused) {
    PyObject *out = PySet_New(NULL);
    uint32_t last = FREE_CODE;
    for (Py_ssize_t e = 0; out != NULL && e < t->nentries; e++) {
        uint32_t c = t->entries[e].code;
        if (c == FREE_CODE || c == last) continue;
        last = c;
        PyObject *o = code_obj(c);
        if (o == NULL || PySet_Add(out, o) < 0) Py_CLEAR(out);
        Py_XDECREF(o);
    }
    return out;
}

static PyObject *KeyTable_nbytes(KeyTable *t, PyObject *unused) {
    size_t n = (size_t)t->capentries * sizeof(Entry) + (size_t)(t->mask + 1) * sizeof(uint32_t);
    for (Py_ssize_t i = 0; i < t->nrev; i++) n += (size_t)t->rev[i].cap * sizeof(uint32_t);
    return PyLong_FromSize_t(n);
}

static Py_ssize_t KeyTable_len(KeyTable *t) { return t->used; }

static PyMethodDef KeyTable_methods[] = {
    {"get", (PyCFunction)KeyTable_get, METH_O, "get(key) -> code or None"},
    {"lookup", (PyCFunction)KeyTable_lookup, METH_VARARGS, "lookup(keys, stop_at_miss, deadline=inf) -> (codes, distinct, timed_out)"},
    {"set", (PyCFunction)KeyTable_set, METH_VARARGS, "set(key, code, add_loc=-1) -> old code or None"},
    {"add_new", (PyCFunction)KeyTable_add_new, METH_VARARGS, "add_new(keys, code, loc) -> [(i, old code)]"},
    {"delete", (PyCFunction)KeyTable_delete, METH_O, "delete(key) -> old code or None"},
    {"remap", (PyCFunction)KeyTable_remap, METH_VARARGS, "remap(loc, {code: new code or -1}) -> keys changed"},
    {"keys_at", (PyCFunction)KeyTable_keys_at, METH_VARARGS, "keys_at(loc, codes) -> set of keys"},
    {"copy", (PyCFunction)KeyTable_copy, METH_NOARGS, "a read-only copy without reverse lists"},
    {"keys", (PyCFunction)KeyTable_keys, METH_NOARGS, "every key"},
    {"used_codes", (PyCFunction)KeyTable_used_codes, METH_NOARGS, "the set of codes in use"},
    {"nbytes", (PyCFunction)KeyTable_nbytes, METH_NOARGS, "bytes allocated"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods KeyTable_as_sequence = {.sq_length = (lenfunc)KeyTable_len};

PyTypeObject nkv_KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "nexuskv_native._native.KeyTable",
    .tp_basicsize = sizeof(KeyTable),
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "16-byte key -> holding code, open addressing, with per-location reverse lists.",
    .tp_methods = KeyTable_methods,
    .tp_as_sequence = &KeyTable_as_sequence,
    .tp_new = KeyTable_new,
};
