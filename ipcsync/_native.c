/* ipcsync._native: the steady write step's copy (and, on CUDA, its ready-event record)
 * in one C call instead of a torch dispatch; and the steady READY / RELEASE frames decoded
 * by hand (decode_readies, decode_release: see "steady frames" below).
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

/* ---------------------------------------------------------------- steady frames
 * decode_readies(frames, max_frame, max_items, ready_kind, max_int) and
 * decode_release(frame, max_frame, max_items, max_batch, release_kind, max_int): the
 * steady READY and RELEASE frames parsed by hand, for core.protocol's decoders of the same
 * names (the reference; they call these through protocol.use_native_decoders).
 *
 * The frames are a peer's bytes: every read is bounds-checked against the frame's end
 * before it happens, and no length in a frame is trusted (a count is compared with what
 * the limits and the frame's remaining bytes allow before anything is read for it).
 * Accepted is only what msgpack.unpackb (with core.protocol's limits) decodes, and then
 * to the same values; anything this parser does not take (another shape, a str, float32
 * or container meta, ext, trailing bytes, a non-bytes frame) stops it: decode_readies
 * returns the READYs before that frame, decode_release returns None, and the Python
 * decoder takes the rest. Bad input never raises; only wrong argument types do. */

typedef struct {
    const unsigned char *p, *end;
} cursor_t;

static uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* The next object's n payload bytes after its one type byte, or NULL (truncated). */
static const unsigned char *take(cursor_t *c, int n) {
    const unsigned char *at = c->p + 1;
    if (c->end - c->p < 1 + n)
        return NULL;
    c->p = at + n;
    return at;
}

/* The next object as a msgpack integer, any of its encodings: 1 with the value in *u
 * (*neg: it is negative, the value is then (int64_t)*u), 0 when it is not an integer or
 * is truncated (nothing consumed that matters: the parse stops). */
static int read_int(cursor_t *c, uint64_t *u, int *neg) {
    const unsigned char *q;
    unsigned char t;
    if (c->p >= c->end)
        return 0;
    t = *c->p;
    *neg = 0;
    if (t <= 0x7f) {
        c->p++;
        *u = t;
        return 1;
    }
    if (t >= 0xe0) {
        c->p++;
        *u = (uint64_t)(int64_t)(int8_t)t;
        *neg = 1;
        return 1;
    }
    if (t >= 0xcc && t <= 0xcf) { /* uint 8/16/32/64 */
        int n = 1 << (t - 0xcc);
        if ((q = take(c, n)) == NULL)
            return 0;
        *u = be(q, n);
        return 1;
    }
    if (t >= 0xd0 && t <= 0xd3) { /* int 8/16/32/64 */
        int n = 1 << (t - 0xd0);
        int64_t s;
        if ((q = take(c, n)) == NULL)
            return 0;
        uint64_t raw = be(q, n);
        switch (n) {
        case 1: s = (int8_t)raw; break;
        case 2: s = (int16_t)raw; break;
        case 4: s = (int32_t)raw; break;
        default: s = (int64_t)raw; break;
        }
        *u = (uint64_t)s;
        *neg = s < 0;
        return 1;
    }
    return 0;
}

/* A non-negative integer no larger than max (the field rule of core.protocol). */
static int read_field(cursor_t *c, uint64_t max, uint64_t *out) {
    int neg;
    return read_int(c, out, &neg) && !neg && *out <= max;
}

/* An array header: its length, or -1 (not an array, truncated). */
static Py_ssize_t read_array(cursor_t *c) {
    const unsigned char *q;
    unsigned char t;
    if (c->p >= c->end)
        return -1;
    t = *c->p;
    if (t >= 0x90 && t <= 0x9f) {
        c->p++;
        return t & 0x0f;
    }
    if (t == 0xdc && (q = take(c, 2)) != NULL)
        return (Py_ssize_t)be(q, 2);
    if (t == 0xdd && (q = take(c, 4)) != NULL)
        return (Py_ssize_t)be(q, 4);
    return -1;
}

/* A READY's meta when it is nil, a bool, an integer or a float64: a new reference (or
 * Py_None), else NULL without an exception (stop); NULL with one only when out of memory. */
static PyObject *read_meta(cursor_t *c) {
    const unsigned char *q;
    uint64_t u;
    int neg;
    unsigned char t;
    if (c->p >= c->end)
        return NULL;
    t = *c->p;
    if (t == 0xc0) {
        c->p++;
        Py_RETURN_NONE;
    }
    if (t == 0xc2 || t == 0xc3) {
        c->p++;
        return PyBool_FromLong(t == 0xc3);
    }
    if (t == 0xcb) {
        double d;
        if ((q = take(c, 8)) == NULL)
            return NULL;
        u = be(q, 8);
        memcpy(&d, &u, sizeof d);
        return PyFloat_FromDouble(d);
    }
    if (!read_int(c, &u, &neg))
        return NULL;
    return neg ? PyLong_FromLongLong((long long)(int64_t)u) : PyLong_FromUnsignedLongLong(u);
}

/* The frame's bytes when it is a bytes object of 1..max_frame bytes, else 0. */
static int frame_bytes(PyObject *frame, Py_ssize_t max_frame, cursor_t *c) {
    Py_ssize_t n;
    if (!PyBytes_Check(frame))
        return 0;
    n = PyBytes_GET_SIZE(frame);
    if (n == 0 || n > max_frame)
        return 0;
    c->p = (const unsigned char *)PyBytes_AS_STRING(frame);
    c->end = c->p + n;
    return 1;
}

/* A tuple of size items, the first n of them v[0..n) as ints (the rest for the caller to
 * set), or NULL with an exception (out of memory). */
static PyObject *uint_tuple(const uint64_t *v, Py_ssize_t n, Py_ssize_t size) {
    PyObject *tuple = PyTuple_New(size);
    if (tuple == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromUnsignedLongLong(v[i]);
        if (x == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
        PyTuple_SET_ITEM(tuple, i, x);
    }
    return tuple;
}

/* One steady READY: its (seq, slot, gen, sent_ns, layout_id, meta), or NULL (without an
 * exception: not one this parser takes; with one: out of memory). */
static PyObject *parse_ready(PyObject *frame, Py_ssize_t max_frame, Py_ssize_t max_items, uint64_t kind,
                             uint64_t max_int) {
    cursor_t c;
    uint64_t v[6];
    PyObject *meta, *tuple;
    if (!frame_bytes(frame, max_frame, &c) || read_array(&c) != 8 || max_items < 8)
        return NULL;
    if (!read_field(&c, UINT64_MAX, &v[0]) || v[0] != kind)
        return NULL;
    for (int i = 1; i < 6; i++)
        if (!read_field(&c, max_int, &v[i]))
            return NULL;
    if (c.p >= c.end || *c.p != 0xc0) /* the layout: nil on the steady path */
        return NULL;
    c.p++;
    if ((meta = read_meta(&c)) == NULL)
        return NULL;
    if (c.p != c.end) { /* trailing bytes: unpackb raises ExtraData */
        Py_DECREF(meta);
        return NULL;
    }
    if ((tuple = uint_tuple(v + 1, 5, 6)) == NULL) {
        Py_DECREF(meta);
        return NULL;
    }
    PyTuple_SET_ITEM(tuple, 5, meta);
    return tuple;
}

/* A limit too large for any buffer is one no buffer reaches. */
static Py_ssize_t clamp(unsigned long long v) {
    return v > (unsigned long long)PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX : (Py_ssize_t)v;
}

static PyObject *native_decode_readies(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long a[5];
    PyObject *seq, *out;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "decode_readies(frames, max_frame, max_items, ready_kind, max_int) "
                     "takes 5 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!unsigned_args(args, 1, 5, a))
        return NULL;
    if ((seq = PySequence_Fast(args[0], "frames must be a sequence of bytes")) == NULL)
        return NULL;
    if ((out = PyList_New(0)) == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    /* The size and each item are read afresh, and the frame held while it is parsed: an
     * allocation may run a collection, whose finalizers may change the list. */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *frame = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(frame);
        PyObject *r = parse_ready(frame, clamp(a[1]), clamp(a[2]), a[3], a[4]);
        Py_DECREF(frame);
        if (r == NULL) {
            if (PyErr_Occurred())
                Py_CLEAR(out);
            break;
        }
        int failed = PyList_Append(out, r);
        Py_DECREF(r);
        if (failed) {
            Py_CLEAR(out);
            break;
        }
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *native_decode_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    unsigned long long a[6];
    cursor_t c;
    uint64_t kind, e[3];
    Py_ssize_t count, max_items;
    PyObject *out;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "decode_release(frame, max_frame, max_items, max_batch, release_kind, "
                     "max_int) takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!unsigned_args(args, 1, 6, a))
        return NULL;
    max_items = clamp(a[2]);
    if (!frame_bytes(args[0], clamp(a[1]), &c) || read_array(&c) != 2 || max_items < 2)
        Py_RETURN_NONE;
    if (!read_field(&c, UINT64_MAX, &kind) || kind != a[4])
        Py_RETURN_NONE;
    count = read_array(&c);
    /* Each entry takes at least 4 bytes (a fixarray and three fixints): a count the frame
     * cannot hold is refused before anything is allocated for it. */
    if (count < 0 || count > max_items || count > clamp(a[3]) || count > (c.end - c.p) / 4
            || (count > 0 && max_items < 3))
        Py_RETURN_NONE;
    if ((out = PyList_New(count)) == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *t;
        if (read_array(&c) != 3 || !read_field(&c, a[5], &e[0]) || !read_field(&c, a[5], &e[1])
                || !read_field(&c, a[5], &e[2])) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        if ((t = uint_tuple(e, 3, 3)) == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    if (c.p != c.end) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
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
    {"decode_readies", (PyCFunction)(void (*)(void))native_decode_readies, METH_FASTCALL,
     "decode_readies(frames, max_frame, max_items, ready_kind, max_int): the leading steady READY frames "
     "(layout nil; meta nil, bool, int or float64) as (seq, slot, gen, sent_ns, layout_id, meta) tuples, "
     "up to the first frame this parser does not take."},
    {"decode_release", (PyCFunction)(void (*)(void))native_decode_release, METH_FASTCALL,
     "decode_release(frame, max_frame, max_items, max_batch, release_kind, max_int): a RELEASE frame's "
     "[(seq, slot, gen), ...], or None where this parser does not take it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ipcsync._native",
    "The steady write step's copy (and CUDA ready-event record) in one C call, and the steady READY / "
    "RELEASE frames decoded by hand; see ipcsync.backends.native.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
