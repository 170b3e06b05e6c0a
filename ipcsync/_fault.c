/* ipcsync._fault: why a process died writing into memory ipcsync maps read-only.
 *
 * Consumers map received items read-only (the CPU backend's arenas), so an in-place op
 * on a received tensor is a SIGSEGV in the process that did it. This module's SIGSEGV
 * handler looks the fault address up in the ranges ipcsync registered (``watch``), writes
 * a line saying what happened and what to do (with write(2): async-signal-safe), then
 * hands the signal on to the handler that was there before (faulthandler's, which prints
 * the Python traceback; or the default action, which ends the process). A fault elsewhere
 * is handed on untouched. See ipcsync/writefaults.py, which loads it (and has a
 * pure-Python stand-in where this is not built).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define MAX_RANGES 4096
#define LABEL_MAX 256

typedef struct {
    volatile uintptr_t start;
    volatile uintptr_t end; /* 0: unused */
    const volatile int64_t *seq; /* the last item's seq there (< 0: none), or NULL */
    char label[LABEL_MAX];
} range_t;

static range_t ranges[MAX_RANGES];
static volatile int high; /* ranges[0:high] may be in use */
static struct sigaction previous;
static volatile sig_atomic_t entered;

static void put(const char *s, size_t n) {
    while (n > 0) {
        ssize_t w = write(2, s, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return;
        s += w;
        n -= (size_t)w;
    }
}

static void say(const char *s) {
    size_t n = 0;
    while (s[n])
        n++;
    put(s, n);
}

static void say_int(int64_t v) {
    char buf[24];
    int i = 24;
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do {
        buf[--i] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        buf[--i] = '-';
    put(buf + i, (size_t)(24 - i));
}

static void explain(const range_t *r) {
    say("\nipcsync: this process wrote into memory it received read-only (");
    if (r->seq != NULL && *r->seq >= 0) {
        say("item ");
        say_int(*r->seq);
        say(", ");
    }
    say(r->label);
    say("): received tensors are zero-copy views of the producer's shared memory, mapped "
        "read-only so that no other reader sees a change, and an in-place op on one (x.add_(...), "
        "x[i] = v, out=x, ...) or on a view kept from it faults. clone() a received tensor before "
        "changing it in place: x = item[\"x\"].clone(). (The traceback below, where faulthandler is "
        "on, shows the line.)\n");
}

static void hand_on(int sig, siginfo_t *info, void *ctx) {
    struct sigaction prev = previous, dfl;
    if (entered > 1) { /* handed back to us (a loop): end it the default way */
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigaction(sig, &dfl, NULL);
        return;
    }
    if (prev.sa_flags & SA_SIGINFO) {
        if ((void *)prev.sa_sigaction != (void *)SIG_DFL && (void *)prev.sa_sigaction != (void *)SIG_IGN) {
            prev.sa_sigaction(sig, info, ctx);
            return;
        }
    } else if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN) {
        prev.sa_handler(sig);
        return;
    }
    /* The default action: put it back, return, and the faulting write faults again. */
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigaction(sig, &dfl, NULL);
}

static void on_fault(int sig, siginfo_t *info, void *ctx) {
    entered++;
    if (entered == 1 && info != NULL && info->si_code > 0) { /* (a real fault, not a kill) */
        uintptr_t a = (uintptr_t)info->si_addr;
        const range_t *best = NULL;
        int n = high;
        for (int i = 0; i < n; i++) {
            const range_t *r = &ranges[i];
            uintptr_t end = r->end;
            if (end != 0 && a >= r->start && a < end && (best == NULL || end - r->start < best->end - best->start))
                best = r;
        }
        if (best != NULL)
            explain(best);
    }
    hand_on(sig, info, ctx);
}

/* install(): our handler on SIGSEGV, unless it is there already; the one it replaces is
   handed every signal on. Returns True. */
static PyObject *fault_install(PyObject *self, PyObject *unused) {
    struct sigaction now, ours;
    if (sigaction(SIGSEGV, NULL, &now) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_fault)
        Py_RETURN_TRUE;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_fault;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    previous = now;
    if (sigaction(SIGSEGV, &ours, NULL) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_TRUE;
}

/* installed(): whether our handler is SIGSEGV's now. */
static PyObject *fault_installed(PyObject *self, PyObject *unused) {
    struct sigaction now;
    if (sigaction(SIGSEGV, NULL, &now) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyBool_FromLong((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_fault);
}

/* watch(start, nbytes, label, seq_address) -> token: a read-only range to explain; the
   int64 at seq_address (0: none) holds the seq of the item last received there. */
static PyObject *fault_watch(PyObject *self, PyObject *args) {
    unsigned long long start, nbytes, seq;
    const char *label;
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "KKs#K", &start, &nbytes, &label, &len, &seq))
        return NULL;
    if (nbytes == 0 || start + nbytes < start) {
        PyErr_SetString(PyExc_ValueError, "watch: an empty or wrapping range");
        return NULL;
    }
    for (int i = 0; i < MAX_RANGES; i++) {
        range_t *r = &ranges[i];
        if (r->end != 0)
            continue;
        size_t n = (size_t)len < LABEL_MAX - 1 ? (size_t)len : LABEL_MAX - 1;
        memcpy(r->label, label, n);
        r->label[n] = 0;
        r->seq = (const volatile int64_t *)(uintptr_t)seq;
        r->start = (uintptr_t)start;
        r->end = (uintptr_t)(start + nbytes); /* last: the range is whole before it is seen */
        if (i >= high)
            high = i + 1;
        return PyLong_FromLong(i);
    }
    PyErr_SetString(PyExc_OverflowError, "watch: too many read-only ranges");
    return NULL;
}

/* unwatch(token): forget a range. */
static PyObject *fault_unwatch(PyObject *self, PyObject *arg) {
    long i = PyLong_AsLong(arg);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (i >= 0 && i < MAX_RANGES) {
        ranges[i].end = 0;
        ranges[i].seq = NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"install", fault_install, METH_NOARGS, "Install the SIGSEGV handler (once)."},
    {"installed", fault_installed, METH_NOARGS, "Whether it is SIGSEGV's handler now."},
    {"watch", fault_watch, METH_VARARGS, "watch(start, nbytes, label, seq_address) -> token"},
    {"unwatch", fault_unwatch, METH_O, "unwatch(token)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ipcsync._fault",
    "Why a process died writing into memory ipcsync maps read-only (see ipcsync/writefaults.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__fault(void) { return PyModule_Create(&module); }
