/* Shared declarations of the NexusKV native extension. */
#ifndef NEXUSKV_NATIVE_H
#define NEXUSKV_NATIVE_H
#include <Python.h>
#include <time.h>

/* Seconds on the clock time.perf_counter() reads (CLOCK_MONOTONIC on Linux): deadlines are checked in C. */
static inline double nkv_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

PyObject *nkv_chain(PyObject *self, PyObject *args);
PyObject *nkv_blake2b16(PyObject *self, PyObject *args);
PyObject *nkv_now(PyObject *self, PyObject *unused);
PyObject *nkv_pipeline(PyObject *self, PyObject *arg);
extern PyTypeObject nkv_KeyTableType;

#endif
