/* Chained block keys in C: bit-identical to nexuskv.state.identity.BlockKeyer, with the GIL released on long chains.
 *
 * key_i = BLAKE2b-128(person="nexuskv.block", msg = key_(i-1) || uint32-LE token ids of block i || extras of i)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "_blake2b.h"
#include "_native.h"

#define RELEASE_GIL_BLOCKS 512 /* below (~80 us of hashing), taking the GIL back costs more than others gain */
#define DEADLINE_EVERY 16     /* blocks between two deadline checks (about 2.5 us of hashing) */
static Py_ssize_t pipeline_blocks = 512; /* from here a second thread hashes while this one reads the ids */
#define PUBLISH_EVERY 256     /* token ids read between two progress updates to the hashing thread */

static const char TOKEN_ERROR[] = "token ids must be integers in [0, 2**32)";

/* One token id as uint32: 0 when read directly, 1 when Python code ran to read it (`__index__`, which may have
 * changed the sequence being read), -1 with ValueError set when it is not an integer in [0, 2**32). */
static inline int token_of(PyObject *o, uint32_t *out) {
    if (PyLong_CheckExact(o)) {
#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
        const PyLongObject *v = (const PyLongObject *)o;
        switch (Py_SIZE(o)) { /* 30-bit digits: ids below 2**60 need at most two */
        case 0:
            *out = 0;
            return 0;
        case 1:
            *out = (uint32_t)v->ob_digit[0];
            return 0;
        case 2:
            if (v->ob_digit[1] < 4) {
                *out = (uint32_t)v->ob_digit[0] | ((uint32_t)v->ob_digit[1] << 30);
                return 0;
            }
            break;
        }
#elif PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)o);
            if (v >= 0 && v <= 0xFFFFFFFFLL) {
                *out = (uint32_t)v;
                return 0;
            }
        }
#endif
        unsigned long long big = PyLong_AsUnsignedLongLong(o); /* an exact int: no Python code runs */
        if (!(big == (unsigned long long)-1 && PyErr_Occurred()) && big <= 0xFFFFFFFFULL) {
            *out = (uint32_t)big;
            return 0;
        }
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: %R is out of range", TOKEN_ERROR, o);
        return -1;
    }
    Py_INCREF(o); /* __index__ may drop the sequence's reference to it */
    int rc = 1;
    PyObject *ix = PyNumber_Index(o);
    if (ix == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: %R is not an integer", TOKEN_ERROR, o);
        rc = -1;
    } else {
        unsigned long long v = PyLong_AsUnsignedLongLong(ix);
        Py_DECREF(ix);
        if ((v == (unsigned long long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFULL) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s: %R is out of range", TOKEN_ERROR, o);
            rc = -1;
        } else {
            *out = (uint32_t)v;
        }
    }
    Py_DECREF(o);
    return rc;
}

/* One chain to hash, shared by the thread reading the ids (which holds the GIL) and the thread hashing them. */
typedef struct {
    const uint64_t *h0;
    const uint8_t *parent;
    const uint32_t *toks;
    Py_ssize_t page, n;
    const uint8_t *xbuf;
    const Py_ssize_t *xoff;
    uint8_t *scratch, *out;
    double deadline;
    _Atomic Py_ssize_t ready; /* token ids converted so far (the reader publishes, the hasher waits on it) */
    _Atomic int abort;        /* the reader failed or ran out of time: stop */
    Py_ssize_t done;          /* keys written */
} Job;

/* Wait until the ids of block i are converted; 0 when the job was aborted meanwhile. */
static int wait_ready(Job *job, Py_ssize_t i) {
    const Py_ssize_t need = (i + 1) * job->page;
    for (unsigned spins = 0; atomic_load_explicit(&job->ready, memory_order_acquire) < need; spins++) {
        if (atomic_load_explicit(&job->abort, memory_order_relaxed)) return 0;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        if (spins % 64 == 63) sched_yield(); /* a few us: give the core back when the reader shares it */
    }
    return 1;
}

/* Hash up to `n` blocks: msg_i = parent || tokens of block i || extras of block i; keys written to `out` (16 bytes
 * each). Stops early once `deadline` (a perf_counter value) has passed, checked every DEADLINE_EVERY blocks and
 * before the first, or when the job is aborted; returns how many keys it wrote. While `ready` is short of all the
 * ids, another thread is still converting them: each block waits for its own. Never touches a Python object. */
static Py_ssize_t chain_job(Job *job) {
    const size_t tbytes = (size_t)job->page * 4;
    const int timed = job->deadline < 1e300, piped = atomic_load(&job->ready) < job->n * job->page;
    uint8_t *scratch = job->scratch, *out = job->out;
    const Py_ssize_t *xoff = job->xoff;
    memcpy(scratch, job->parent, 16);
    for (Py_ssize_t i = 0; i < job->n; i++) {
        if (timed && i % DEADLINE_EVERY == 0 && nkv_clock() > job->deadline) return i;
        if (piped && !wait_ready(job, i)) return i;
        const uint32_t *toks = job->toks;
        const Py_ssize_t page = job->page;
        const uint8_t *xbuf = job->xbuf;
        const uint64_t *h0 = job->h0;
        memcpy(scratch + 16, toks + i * page, tbytes); /* uint32 little-endian on little-endian hosts */
        size_t len = 16 + tbytes;
        if (xoff != NULL && xoff[i + 1] > xoff[i]) {
            memcpy(scratch + len, xbuf + xoff[i], (size_t)(xoff[i + 1] - xoff[i]));
            len += (size_t)(xoff[i + 1] - xoff[i]);
        }
        b2_hash16(h0, scratch, len, out + 16 * i);
        memcpy(scratch, out + 16 * i, 16);
    }
    return job->n;
}

static void *chain_thread(void *arg) {
    Job *job = arg;
    job->done = chain_job(job);
    return NULL;
}

/* Collect `extras` ({block index: bytes}) into one buffer with per-block offsets (blocks past `n` are ignored). */
static int gather_extras(PyObject *extras, Py_ssize_t n, uint8_t **xbuf, Py_ssize_t **xoff, Py_ssize_t *xmax) {
    Py_ssize_t total = 0, pos = 0;
    PyObject *k, *v;
    *xmax = 0;
    Py_ssize_t *len = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
    if (len == NULL) {
        PyErr_NoMemory();
        return -1;
    }
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
    Py_ssize_t page, start = 0, stop = PY_SSIZE_T_MAX;
    double deadline = 1e308;
    if (!PyArg_ParseTuple(args, "y*OnOy*|nnd:chain", &parent, &tokens, &page, &extras, &person, &start, &stop,
                          &deadline))
        return NULL;
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
    if (start < 0 || stop < 0) {
        PyErr_SetString(PyExc_ValueError, "chain: start and stop must not be negative");
        goto done;
    }
    if (start > ntok) start = ntok; /* token_ids[start:stop], read in place */
    if (stop > ntok) stop = ntok;
    ntok = stop > start ? stop - start : 0;
    PyObject **items = PySequence_Fast_ITEMS(seq) + start;
    Py_ssize_t n = ntok / page;
    if (extras != Py_None) {
        if (!PyDict_Check(extras)) {
            PyErr_SetString(PyExc_TypeError, "extras must be a dict or None");
            goto done;
        }
        if (PyDict_GET_SIZE(extras) > 0 && gather_extras(extras, n, &xbuf, &xoff, &xmax) < 0) goto done;
    }
    toks = PyMem_Malloc(sizeof(uint32_t) * ((size_t)ntok + 1));
    out = PyMem_Malloc(16 * ((size_t)n + 1));
    scratch = PyMem_Malloc(16 + 4 * (size_t)page + (size_t)xmax);
    if (toks == NULL || out == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint8_t pers[16] = {0};
    memcpy(pers, person.buf, (size_t)person.len);
    uint64_t h0[8];
    b2_init_state(h0, 16, pers);
    Job job = {.h0 = h0, .parent = parent.buf, .toks = toks, .page = page, .n = n, .xbuf = xbuf, .xoff = xoff,
               .scratch = scratch, .out = out, .deadline = deadline};
    pthread_t hasher;
    /* With a deadline (a plan), the GIL is kept: taking it back from busy threads can cost a whole switch
     * interval (5 ms), far past any planning deadline. Without one, other threads run while this one hashes. */
    const int release = deadline >= 1e300;
    int piped = pipeline_blocks > 0 && n >= pipeline_blocks && pthread_create(&hasher, NULL, chain_thread, &job) == 0;
    int failed = 0;
    const Py_ssize_t size = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < ntok; i++) { /* every id is checked, the partial last block's too */
        int got = token_of(items[i], &toks[i]);
        if (got == 1) { /* Python code ran: the sequence (a list) may have changed under us */
            if (PySequence_Fast_GET_SIZE(seq) != size) {
                PyErr_SetString(PyExc_RuntimeError, "token ids changed while they were read");
                got = -1;
            }
            items = PySequence_Fast_ITEMS(seq) + start;
        }
        if (got < 0) {
            failed = 1;
            break;
        }
        if (i % PUBLISH_EVERY == PUBLISH_EVERY - 1) {
            atomic_store_explicit(&job.ready, i + 1, memory_order_release);
            if (deadline < 1e300 && i % 8192 == 8191 && nkv_clock() > deadline) { /* a huge request: bounded too */
                n = 0;
                break;
            }
        }
    }
    if (failed || n == 0) {
        atomic_store(&job.abort, 1);
    } else {
        atomic_store_explicit(&job.ready, ntok, memory_order_release);
    }
    if (!failed && n > 0) { /* the key objects, made while a hasher works; filled in once the hashing is done */
        result = PyList_New(n);
        for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
            PyObject *key = PyBytes_FromStringAndSize(NULL, 16);
            if (key == NULL) {
                Py_CLEAR(result);
                break;
            }
            PyList_SET_ITEM(result, i, key);
        }
        if (result == NULL) {
            failed = 1;
            atomic_store(&job.abort, 1);
        }
    }
    if (piped) {
        if (release) {
            Py_BEGIN_ALLOW_THREADS
            pthread_join(hasher, NULL);
            Py_END_ALLOW_THREADS
        } else {
            pthread_join(hasher, NULL);
        }
    } else if (!failed && n > 0) {
        if (release && n >= RELEASE_GIL_BLOCKS) {
            Py_BEGIN_ALLOW_THREADS
            job.done = chain_job(&job);
            Py_END_ALLOW_THREADS
        } else {
            job.done = chain_job(&job);
        }
    }
    if (failed) {
        Py_CLEAR(result);
        goto done;
    }
    if (result == NULL) { /* no full block, or the deadline passed while the ids were read */
        result = PyList_New(0);
        goto done;
    }
    n = job.done; /* fill in, and drop the keys past a deadline */
    for (Py_ssize_t i = 0; i < n; i++) memcpy(PyBytes_AS_STRING(PyList_GET_ITEM(result, i)), out + 16 * i, 16);
    if (n < PyList_GET_SIZE(result) && PyList_SetSlice(result, n, PyList_GET_SIZE(result), NULL) < 0)
        Py_CLEAR(result);
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

PyObject *nkv_pipeline(PyObject *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t old = pipeline_blocks;
    pipeline_blocks = n;
    return PyLong_FromSsize_t(old);
}

PyObject *nkv_now(PyObject *self, PyObject *unused) { return PyFloat_FromDouble(nkv_clock()); }

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
