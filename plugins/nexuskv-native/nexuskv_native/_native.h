/* Shared declarations of the NexusKV native extension. */
#ifndef NEXUSKV_NATIVE_H
#define NEXUSKV_NATIVE_H
#include <Python.h>

PyObject *nkv_chain(PyObject *self, PyObject *args);
PyObject *nkv_blake2b16(PyObject *self, PyObject *args);
PyObject *nkv_now(PyObject *self, PyObject *unused);
extern PyTypeObject nkv_KeyTableType;

#endif
