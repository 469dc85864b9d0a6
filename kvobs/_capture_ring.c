/* The capture ring in C: kvobs/capture_ring.py's PythonCaptureRing, the reference it is tested against
 * (tests/unit/test_capture_ring.py runs both on the same operations).
 *
 * Why C: a tap on vLLM's scheduler thread appends its capture here with one vectorcall, and nothing is
 * allocated for it: no tuple to pass the fields, no float for the time (push_timed reads the monotonic
 * clock here, the clock time.monotonic() reads, and stores the double; the float is made when the
 * capture is applied, on kvobs's applier). An allocation per call is what made the garbage collector
 * kvobs's biggest cost (issue 43; docs/performance.md).
 *
 * A slot holds one reference, or a time (obj NULL). The ring grows by doubling and never drops: the
 * recorder bounds it, applying the captures where they reach its limit (kvobs.codes.CAPTURE_LIMIT).
 * Every method runs under the GIL and runs no Python code while it changes the ring, so a push from
 * vLLM's thread and a popleft from kvobs's applier never interleave inside one another.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <time.h>

typedef struct {
    PyObject *obj; /* a reference the ring owns, or NULL: the slot is a time */
    double time;
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    Py_ssize_t capacity; /* a power of two */
    Py_ssize_t head;     /* the oldest slot */
    Py_ssize_t count;
} Ring;

#define FIRST_CAPACITY 1024

static int
ring_room(Ring *self, Py_ssize_t more)
{
    if (self->count + more <= self->capacity) {
        return 0;
    }
    Py_ssize_t capacity = self->capacity;
    while (capacity < self->count + more) {
        if (capacity > PY_SSIZE_T_MAX / 2 / (Py_ssize_t)sizeof(Slot)) {
            PyErr_NoMemory();
            return -1;
        }
        capacity *= 2;
    }
    Slot *slots = PyMem_Malloc((size_t)capacity * sizeof(Slot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t first = self->capacity - self->head; /* the slots from head to the end of the old array */
    if (first > self->count) {
        first = self->count;
    }
    memcpy(slots, self->slots + self->head, (size_t)first * sizeof(Slot));
    memcpy(slots + first, self->slots, (size_t)(self->count - first) * sizeof(Slot));
    PyMem_Free(self->slots);
    self->slots = slots;
    self->capacity = capacity;
    self->head = 0;
    return 0;
}

static inline void
ring_put(Ring *self, PyObject *obj)
{
    Slot *slot = &self->slots[(self->head + self->count) & (self->capacity - 1)];
    Py_INCREF(obj);
    slot->obj = obj;
    slot->time = 0.0;
    self->count++;
}

static double
monotonic_now(void)
{
    /* As CPython's time.monotonic() on Linux: CLOCK_MONOTONIC as nanoseconds, then seconds as a double
     * (_PyTime_AsSecondsDouble: the nanoseconds divided by 1e9), so the two read the same clock alike. */
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) {
        return 0.0;
    }
    long long ns = (long long)ts.tv_sec * 1000000000LL + (long long)ts.tv_nsec;
    if (ns % 1000000000LL == 0) {
        return (double)(ns / 1000000000LL);
    }
    return (double)ns / 1e9;
}

static PyObject *
ring_push(Ring *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (ring_room(self, nargs) < 0) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        ring_put(self, args[i]);
    }
    Py_RETURN_NONE;
}

static PyObject *
ring_push_timed(Ring *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (ring_room(self, nargs + 1) < 0) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        ring_put(self, args[i]);
    }
    Slot *slot = &self->slots[(self->head + self->count) & (self->capacity - 1)];
    slot->obj = NULL;
    slot->time = monotonic_now();
    self->count++;
    Py_RETURN_NONE;
}

static PyObject *
ring_extend(Ring *self, PyObject *items)
{
    PyObject *seq = PySequence_Fast(items, "extend() takes an iterable");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (ring_room(self, n) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject **each = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        ring_put(self, each[i]);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *
ring_popleft(Ring *self, PyObject *Py_UNUSED(ignored))
{
    if (self->count == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from an empty capture ring");
        return NULL;
    }
    Slot *slot = &self->slots[self->head];
    PyObject *obj = slot->obj;
    double time = slot->time;
    slot->obj = NULL;
    self->head = (self->head + 1) & (self->capacity - 1);
    self->count--;
    if (obj == NULL) {
        return PyFloat_FromDouble(time);
    }
    return obj; /* the ring's reference, handed over */
}

static int
ring_clear(Ring *self)
{
    /* Every reference taken out first, then released: a finalizer that runs on a release sees a
     * consistent, empty ring. */
    Py_ssize_t count = self->count, head = self->head, capacity = self->capacity;
    Slot *slots = self->slots;
    if (count == 0) {
        return 0;
    }
    Slot *old = PyMem_Malloc((size_t)capacity * sizeof(Slot));
    if (old == NULL) { /* no memory to defer: release in place, the ring emptied first */
        self->count = 0;
        self->head = 0;
        for (Py_ssize_t i = 0; i < count; i++) {
            Slot *slot = &slots[(head + i) & (capacity - 1)];
            PyObject *obj = slot->obj;
            slot->obj = NULL;
            Py_XDECREF(obj);
        }
        return 0;
    }
    memcpy(old, slots, (size_t)capacity * sizeof(Slot));
    for (Py_ssize_t i = 0; i < capacity; i++) {
        slots[i].obj = NULL;
    }
    self->count = 0;
    self->head = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_XDECREF(old[(head + i) & (capacity - 1)].obj);
    }
    PyMem_Free(old);
    return 0;
}

static PyObject *
ring_clear_method(Ring *self, PyObject *Py_UNUSED(ignored))
{
    ring_clear(self);
    Py_RETURN_NONE;
}

static int
ring_traverse(Ring *self, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < self->count; i++) {
        Py_VISIT(self->slots[(self->head + i) & (self->capacity - 1)].obj);
    }
    return 0;
}

static Py_ssize_t
ring_len(Ring *self)
{
    return self->count;
}

static PyObject *
ring_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":CaptureRing", names)) {
        return NULL;
    }
    Ring *self = (Ring *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->slots = PyMem_Calloc(FIRST_CAPACITY, sizeof(Slot));
    if (self->slots == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->capacity = FIRST_CAPACITY;
    self->head = 0;
    self->count = 0;
    return (PyObject *)self;
}

static void
ring_dealloc(Ring *self)
{
    PyObject_GC_UnTrack(self);
    if (self->slots != NULL) {
        ring_clear(self);
        PyMem_Free(self->slots);
        self->slots = NULL;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef ring_methods[] = {
    {"push", (PyCFunction)(void (*)(void))ring_push, METH_FASTCALL,
     "push(*items): each item, in order."},
    {"push_timed", (PyCFunction)(void (*)(void))ring_push_timed, METH_FASTCALL,
     "push_timed(*items): each item, then the monotonic time now (a float when popped)."},
    {"extend", (PyCFunction)ring_extend, METH_O, "extend(items): each of items, in order."},
    {"popleft", (PyCFunction)ring_popleft, METH_NOARGS,
     "The oldest item; IndexError when there is none."},
    {"clear", (PyCFunction)ring_clear_method, METH_NOARGS, "Every item dropped."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods ring_as_sequence = {
    .sq_length = (lenfunc)ring_len,
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvobs._capture_ring.CaptureRing",
    .tp_doc = "kvobs's capture buffer: references and times in order, appended without an allocation.",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = ring_new,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_traverse = (traverseproc)ring_traverse,
    .tp_clear = (inquiry)ring_clear,
    .tp_methods = ring_methods,
    .tp_as_sequence = &ring_as_sequence,
};

static struct PyModuleDef ring_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvobs._capture_ring",
    .m_doc = "The capture ring in C (kvobs/capture_ring.py has its reference in Python).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__capture_ring(void)
{
    if (PyType_Ready(&RingType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&ring_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&RingType);
    if (PyModule_AddObject(module, "CaptureRing", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
