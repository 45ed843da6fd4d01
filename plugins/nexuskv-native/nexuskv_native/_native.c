/* The nexuskv_native._native module: chained block keys (_keys.c) and the compact key table (_table.c). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_native.h"

static PyMethodDef methods[] = {
    {"chain", nkv_chain, METH_VARARGS,
     "chain(parent, token_ids, page, extras, person, start=0, stop=len, deadline=inf) -> 16-byte keys of the full "
     "blocks of token_ids[start:stop]; fewer when the deadline (a perf_counter value) passed first"},
    {"pipeline", nkv_pipeline, METH_O,
     "pipeline(min_blocks) -> the previous value: chains from this many blocks are hashed by a second thread while "
     "the ids are read (0: never)"},
    {"now", nkv_now, METH_NOARGS, "now() -> the clock chain() checks deadlines on (time.perf_counter's)"},
    {"blake2b16", nkv_blake2b16, METH_VARARGS, "blake2b16(data, person) -> 16-byte BLAKE2b digest"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "NexusKV native fast path.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) {
        PyErr_SetString(PyExc_ImportError, "nexuskv_native needs a little-endian machine");
        return NULL;
    }
    if (PyType_Ready(&nkv_KeyTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "KeyTable", (PyObject *)&nkv_KeyTableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
