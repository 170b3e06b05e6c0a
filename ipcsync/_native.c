/* ipcsync._native: the steady write step's copy (and, on CUDA, its ready-event record)
 * in one C call instead of a torch dispatch.
 *
 *   copy(dst_ptr, src_ptr, nbytes)                          memcpy (CPU backend)
 *   cuda_copy_record(dst_ptr, src_ptr, nbytes, stream, event[, device])
 *       cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream), then
 *       cudaEventRecord(event, stream): the record follows the copy on the same stream.
 *   cuda_available() -> bool, cuda_reason() -> str | None   (resolves the runtime once)
 *
 * Integers in, None out. The pointers are the caller's own (a slot of its own arena and
 * the user's tensor): nothing here reads memory a peer wrote, and no address is computed
 * from anything but the arguments. The caller checks nbytes against the slot's span.
 *
 * No CUDA headers at build time: the few runtime functions are declared here and resolved
 * at first use, from the libcudart torch loaded (dlsym(RTLD_DEFAULT, ...): torch loads it
 * into the global scope; else the libcudart named in /proc/self/maps, reopened with
 * RTLD_NOLOAD, so never a second copy of the runtime). Not found: cuda_available() is
 * False, cuda_reason() says why, and the Python side keeps torch's copy. A CUDA error
 * raises RuntimeError naming the error (cudaGetErrorName) and its code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* Above this many bytes, copy() lets other threads run while it copies. */
#define NOGIL_BYTES (256 * 1024)
#define CUDA_MEMCPY_DEFAULT 4 /* cudaMemcpyDefault: the direction inferred from the pointers */

typedef int cuda_error_t;
typedef cuda_error_t (*memcpy_async_fn)(void *, const void *, size_t, int, void *);
typedef cuda_error_t (*event_record_fn)(void *, void *);
typedef cuda_error_t (*get_device_fn)(int *);
typedef cuda_error_t (*set_device_fn)(int);
typedef const char *(*error_name_fn)(cuda_error_t);
typedef cuda_error_t (*last_error_fn)(void);

static memcpy_async_fn memcpy_async;
static event_record_fn event_record;
static get_device_fn get_device;
static set_device_fn set_device;
static error_name_fn error_name;
static last_error_fn last_error;
static int resolved;          /* 0: not tried yet, 1: found, -1: not found */
static char reason[512];

static int lookup(void *lib) {
    memcpy_async = (memcpy_async_fn)dlsym(lib, "cudaMemcpyAsync");
    event_record = (event_record_fn)dlsym(lib, "cudaEventRecord");
    get_device = (get_device_fn)dlsym(lib, "cudaGetDevice");
    set_device = (set_device_fn)dlsym(lib, "cudaSetDevice");
    error_name = (error_name_fn)dlsym(lib, "cudaGetErrorName");
    last_error = (last_error_fn)dlsym(lib, "cudaGetLastError");
    return memcpy_async && event_record && get_device && set_device && error_name && last_error;
}

/* The path of the libcudart mapped into this process, or 0. */
static int mapped_cudart(char *out, size_t size) {
    FILE *maps = fopen("/proc/self/maps", "r");
    char line[4096];
    int found = 0;
    if (maps == NULL)
        return 0;
    while (!found && fgets(line, sizeof line, maps) != NULL) {
        char *path = strchr(line, '/');
        if (path == NULL || strstr(path, "/libcudart.so") == NULL)
            continue;
        path[strcspn(path, "\n")] = '\0';
        if (strlen(path) < size) {
            strcpy(out, path);
            found = 1;
        }
    }
    fclose(maps);
    return found;
}

static int resolve(void) {
    char path[4096];
    void *lib;
    if (resolved)
        return resolved > 0;
    resolved = -1;
    if (lookup(RTLD_DEFAULT)) {
        resolved = 1;
        return 1;
    }
    if (!mapped_cudart(path, sizeof path)) {
        snprintf(reason, sizeof reason,
                 "the CUDA runtime (libcudart) is not loaded in this process: torch has no CUDA here");
        return 0;
    }
    lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL);
    if (lib == NULL || !lookup(lib)) {
        snprintf(reason, sizeof reason, "%s does not export the CUDA runtime calls needed (%s)", path,
                 lib == NULL ? dlerror() : "cudaMemcpyAsync, cudaEventRecord, cudaGetDevice, cudaSetDevice, cudaGetErrorName, cudaGetLastError");
        return 0;
    }
    resolved = 1; /* the handle stays open: the runtime lives as long as the process */
    return 1;
}

/* args[first..n) each a non-negative int (bool excluded) that fits in 64 bits, into
 * out[first..n); errors name the argument's position. */
static int unsigned_args(PyObject *const *args, Py_ssize_t first, Py_ssize_t n, unsigned long long *out) {
    for (Py_ssize_t i = first; i < n; i++) {
        if (!PyLong_Check(args[i]) || PyBool_Check(args[i])) {
            PyErr_Format(PyExc_TypeError, "argument %zd must be an int, not %.80s", i + 1,
                         Py_TYPE(args[i])->tp_name);
            return 0;
        }
        out[i] = PyLong_AsUnsignedLongLong(args[i]);
        if (out[i] == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "argument %zd must be a non-negative int below 2**64", i + 1);
            return 0;
        }
    }
    return 1;
}

static int check_copy(unsigned long long dst, unsigned long long src, unsigned long long nbytes) {
    if (nbytes > (unsigned long long)PY_SSIZE_T_MAX) {
        PyErr_SetString(PyExc_ValueError, "nbytes is larger than any buffer");
        return 0;
    }
    if (nbytes && (dst == 0 || src == 0)) {
        PyErr_SetString(PyExc_ValueError, "a null pointer with nbytes > 0");
        return 0;
    }
    return 1;
}

static PyObject *native_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long a[3];
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "copy(dst_ptr, src_ptr, nbytes) takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!unsigned_args(args, 0, 3, a) || !check_copy(a[0], a[1], a[2]))
        return NULL;
    if (a[2] >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        memmove((void *)(uintptr_t)a[0], (const void *)(uintptr_t)a[1], (size_t)a[2]);
        Py_END_ALLOW_THREADS
    } else if (a[2]) {
        memmove((void *)(uintptr_t)a[0], (const void *)(uintptr_t)a[1], (size_t)a[2]);
    }
    Py_RETURN_NONE;
}

/* The error raised; the runtime's last error is cleared, so that torch's next launch
 * check does not report ours as its own. */
static PyObject *cuda_error(const char *call, cuda_error_t err) {
    const char *name = error_name(err);
    last_error();
    PyErr_Format(PyExc_RuntimeError, "%s failed: %s (CUDA error %d)", call, name ? name : "unknown", err);
    return NULL;
}

static PyObject *native_cuda_copy_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long a[5];
    long device = -1;
    int before = -1;
    cuda_error_t err;
    if (nargs != 5 && nargs != 6) {
        PyErr_Format(PyExc_TypeError,
                     "cuda_copy_record(dst_ptr, src_ptr, nbytes, stream, event[, device]) takes 5 or 6 "
                     "arguments (%zd given)", nargs);
        return NULL;
    }
    if (!unsigned_args(args, 0, 5, a) || !check_copy(a[0], a[1], a[2]))
        return NULL;
    if (a[4] == 0) {
        PyErr_SetString(PyExc_ValueError, "event must be a CUDA event handle, not 0");
        return NULL;
    }
    if (nargs == 6) {
        if (!PyLong_Check(args[5]) || PyBool_Check(args[5])) {
            PyErr_Format(PyExc_TypeError, "argument 6 must be an int, not %.80s", Py_TYPE(args[5])->tp_name);
            return NULL;
        }
        device = PyLong_AsLong(args[5]);
        if (device == -1 && PyErr_Occurred())
            return NULL;
        if (device < -1 || device > 65535) {
            PyErr_SetString(PyExc_ValueError, "device must be a device index (or -1: the current one)");
            return NULL;
        }
    }
    if (!resolve()) {
        PyErr_Format(PyExc_RuntimeError, "CUDA runtime not available: %s", reason);
        return NULL;
    }
    /* The stream's device must be current for the copy and the record (as torch's guard). */
    if (device >= 0) {
        if ((err = get_device(&before)) != 0)
            return cuda_error("cudaGetDevice", err);
        if (before != device && (err = set_device((int)device)) != 0)
            return cuda_error("cudaSetDevice", err);
    }
    void *stream = (void *)(uintptr_t)a[3];
    err = a[2] ? memcpy_async((void *)(uintptr_t)a[0], (const void *)(uintptr_t)a[1], (size_t)a[2],
                              CUDA_MEMCPY_DEFAULT, stream) : 0;
    const char *call = "cudaMemcpyAsync";
    if (err == 0) {
        err = event_record((void *)(uintptr_t)a[4], stream);
        call = "cudaEventRecord";
    }
    if (device >= 0 && before != device)
        set_device(before);
    if (err != 0)
        return cuda_error(call, err);
    Py_RETURN_NONE;
}

static PyObject *native_cuda_available(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(resolve());
}

static PyObject *native_cuda_reason(PyObject *self, PyObject *unused) {
    if (resolve())
        Py_RETURN_NONE;
    return PyUnicode_FromString(reason);
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))native_copy, METH_FASTCALL,
     "copy(dst_ptr, src_ptr, nbytes): copy nbytes host bytes (the GIL is released for large copies)."},
    {"cuda_copy_record", (PyCFunction)(void (*)(void))native_cuda_copy_record, METH_FASTCALL,
     "cuda_copy_record(dst_ptr, src_ptr, nbytes, stream, event[, device]): cudaMemcpyAsync on stream, "
     "then cudaEventRecord(event, stream); RuntimeError naming a CUDA error."},
    {"cuda_available", native_cuda_available, METH_NOARGS,
     "Whether the CUDA runtime torch loaded was found (resolved once)."},
    {"cuda_reason", native_cuda_reason, METH_NOARGS, "Why the CUDA runtime was not found, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ipcsync._native",
    "The steady write step's copy (and CUDA ready-event record) in one C call; see ipcsync.backends.native.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
