/* Chained block keys in C: bit-identical to nexuskv.identity.BlockKeyer, with the GIL released on long chains.
 *
 * key_i = BLAKE2b-128(person="nexuskv.block", msg = key_(i-1) || uint32-LE token ids of block i || extras of i)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "_blake2b.h"
#include "_native.h"

#define RELEASE_GIL_BLOCKS 64 /* below this, taking the GIL back costs more than other threads gain */

static const char TOKEN_ERROR[] = "token ids must be integers in [0, 2**32)";

/* One token id as uint32; -1 with ValueError set when it is not an integer in [0, 2**32). */
static inline int token_of(PyObject *o, uint32_t *out) {
#if PY_VERSION_HEX < 0x030C0000
    if (PyLong_CheckExact(o)) {
        Py_ssize_t size = Py_SIZE(o);
        if (size == 1) {
            *out = (uint32_t)((PyLongObject *)o)->ob_digit[0]; /* one 30-bit digit */
            return 0;
        }
        if (size == 0) {
            *out = 0;
            return 0;
        }
    }
#else
    if (PyLong_CheckExact(o) && PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)o);
        if (v >= 0 && v <= 0xFFFFFFFFLL) {
            *out = (uint32_t)v;
            return 0;
        }
    }
#endif
    PyObject *ix = PyNumber_Index(o);
    if (ix == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: %R is not an integer", TOKEN_ERROR, o);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(ix);
    Py_DECREF(ix);
    if ((v == (unsigned long long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: %R is out of range", TOKEN_ERROR, o);
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* Hash `n` blocks: msg_i = parent || tokens of block i || extras of block i; keys written to `out` (16 bytes each). */
static void chain_blocks(const uint64_t h0[8], const uint8_t parent[16], const uint32_t *toks, Py_ssize_t page,
                         Py_ssize_t n, const uint8_t *xbuf, const Py_ssize_t *xoff, uint8_t *scratch, uint8_t *out) {
    const size_t tbytes = (size_t)page * 4;
    memcpy(scratch, parent, 16);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(scratch + 16, toks + i * page, tbytes); /* uint32 little-endian on little-endian hosts */
        size_t len = 16 + tbytes;
        if (xoff != NULL && xoff[i + 1] > xoff[i]) {
            memcpy(scratch + len, xbuf + xoff[i], (size_t)(xoff[i + 1] - xoff[i]));
            len += (size_t)(xoff[i + 1] - xoff[i]);
        }
        b2_hash16(h0, scratch, len, out + 16 * i);
        memcpy(scratch, out + 16 * i, 16);
    }
}

/* Collect `extras` ({block index: bytes}) into one buffer with per-block offsets (blocks past `n` are ignored). */
static int gather_extras(PyObject *extras, Py_ssize_t n, uint8_t **xbuf, Py_ssize_t **xoff, Py_ssize_t *xmax) {
    Py_ssize_t total = 0, pos = 0;
    PyObject *k, *v;
    *xmax = 0;
    Py_ssize_t *len = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    if (len == NULL) return -1;
    while (PyDict_Next(extras, &pos, &k, &v)) {
        Py_ssize_t b = PyLong_AsSsize_t(k);
        if (b == -1 && PyErr_Occurred()) goto fail;
        if (!PyBytes_Check(v)) {
            PyErr_SetString(PyExc_TypeError, "extras must map block indexes to bytes");
            goto fail;
        }
        if (b < 0 || b >= n) continue;
        len[b + 1] = PyBytes_GET_SIZE(v);
        total += len[b + 1];
        if (len[b + 1] > *xmax) *xmax = len[b + 1];
    }
    uint8_t *buf = PyMem_Malloc((size_t)total + 1);
    if (buf == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) len[i + 1] += len[i]; /* now offsets */
    pos = 0;
    while (PyDict_Next(extras, &pos, &k, &v)) {
        Py_ssize_t b = PyLong_AsSsize_t(k);
        if (b < 0 || b >= n) continue;
        memcpy(buf + len[b], PyBytes_AS_STRING(v), (size_t)PyBytes_GET_SIZE(v));
    }
    *xbuf = buf;
    *xoff = len;
    return 0;
fail:
    PyMem_Free(len);
    if (!PyErr_Occurred()) PyErr_NoMemory();
    return -1;
}

PyObject *nkv_chain(PyObject *self, PyObject *args) {
    Py_buffer parent, person;
    PyObject *tokens, *extras;
    Py_ssize_t page;
    if (!PyArg_ParseTuple(args, "y*OnOy*:chain", &parent, &tokens, &page, &extras, &person)) return NULL;
    PyObject *result = NULL, *seq = NULL;
    uint32_t *toks = NULL;
    uint8_t *out = NULL, *scratch = NULL, *xbuf = NULL;
    Py_ssize_t *xoff = NULL, xmax = 0;
    if (parent.len != 16 || person.len > 16 || page < 1) {
        PyErr_SetString(PyExc_ValueError, "chain: parent must be 16 bytes, person at most 16, page >= 1");
        goto done;
    }
    seq = PySequence_Fast(tokens, "token ids must be a sequence");
    if (seq == NULL) goto done;
    Py_ssize_t ntok = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    toks = PyMem_Malloc(sizeof(uint32_t) * ((size_t)ntok + 1));
    if (toks == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < ntok; i++) /* every id is checked, the partial last block's too */
        if (token_of(items[i], &toks[i]) < 0) goto done;
    Py_ssize_t n = ntok / page;
    if (extras != Py_None && PyDict_GET_SIZE(extras) > 0) {
        if (!PyDict_Check(extras)) {
            PyErr_SetString(PyExc_TypeError, "extras must be a dict or None");
            goto done;
        }
        if (gather_extras(extras, n, &xbuf, &xoff, &xmax) < 0) goto done;
    }
    out = PyMem_Malloc(16 * ((size_t)n + 1));
    scratch = PyMem_Malloc(16 + 4 * (size_t)page + (size_t)xmax);
    if (out == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint8_t pers[16] = {0};
    memcpy(pers, person.buf, (size_t)person.len);
    uint64_t h0[8];
    b2_init_state(h0, 16, pers);
    if (n >= RELEASE_GIL_BLOCKS) {
        Py_BEGIN_ALLOW_THREADS
        chain_blocks(h0, parent.buf, toks, page, n, xbuf, xoff, scratch, out);
        Py_END_ALLOW_THREADS
    } else {
        chain_blocks(h0, parent.buf, toks, page, n, xbuf, xoff, scratch, out);
    }
    result = PyList_New(n);
    if (result == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)out + 16 * i, 16);
        if (key == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, key);
    }
done:
    PyBuffer_Release(&parent);
    PyBuffer_Release(&person);
    Py_XDECREF(seq);
    PyMem_Free(toks);
    PyMem_Free(out);
    PyMem_Free(scratch);
    PyMem_Free(xbuf);
    PyMem_Free(xoff);
    return result;
}

PyObject *nkv_blake2b16(PyObject *self, PyObject *args) {
    Py_buffer data, person;
    if (!PyArg_ParseTuple(args, "y*y*:blake2b16", &data, &person)) return NULL;
    PyObject *result = NULL;
    if (person.len > 16) {
        PyErr_SetString(PyExc_ValueError, "person must be at most 16 bytes");
    } else {
        uint8_t pers[16] = {0}, out[16];
        uint64_t h0[8];
        memcpy(pers, person.buf, (size_t)person.len);
        b2_init_state(h0, 16, pers);
        b2_hash16(h0, data.buf, (size_t)data.len, out);
        result = PyBytes_FromStringAndSize((const char *)out, 16);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&person);
    return result;
}
