/* kvobs._speedups: the C twin of kvobs/recorder.py and kvobs/verdicts.py.
 *
 * Why: kvobs taps every lookup, store and eviction of vLLM's offload manager on
 * the scheduler thread, where vLLM itself spends about a microsecond a call.
 * In Python the bookkeeping alone costs more than that; here a tap costs a
 * vectorcall plus a few dict operations. Behaviour is defined by the Python
 * modules (the reference); tests/unit/test_recorder.py runs the same checks
 * against both. Nothing here imports vLLM: the LookupResult members a lookup
 * tap compares against are handed in.
 *
 * Threading: every function runs with the GIL held. Dict and set operations on
 * bytes and str keys run no Python code, so each recording step is atomic with
 * respect to other threads (vLLM's tier-poll thread); the frame (which tapped
 * call is running, for whom) is tagged with the thread that set it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pythread.h>
#include <time.h>

static PyObject *VerdictType = NULL; /* kvobs.verdicts.Verdict (a NamedTuple) */
static PyObject *NearMissType = NULL; /* kvobs.verdicts.NearMiss */
static PyObject *str_key, *str_req_id, *str_chunk_id, *str_new_req_ids, *str_req_context, *str_keys, *str_context;
static PyObject *stage_lookup, *stage_load, *stage_removal, *stage_finish, *stage_schedule_end, *stage_diagnosis;

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------------------------------
 * VCell: one verdict as the lookup tap stores it. Not a GC object: the hundreds of thousands
 * a busy engine keeps cost the garbage collector nothing. Read out as kvobs.verdicts.Verdict.
 * ------------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    long long serial;
    double time;
    char pending;
} VCell;

static PyTypeObject VCellType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvobs._speedups._VCell",
    .tp_basicsize = sizeof(VCell),
    .tp_flags = Py_TPFLAGS_DEFAULT,
};

static PyObject *VCell_make(long long serial, double time, int pending) {
    VCell *c = PyObject_New(VCell, &VCellType);
    if (c == NULL) return NULL;
    c->serial = serial;
    c->time = time;
    c->pending = (char)pending;
    return (PyObject *)c;
}

/* A stored verdict as the public Verdict type (a new reference). */
static PyObject *as_verdict(PyObject *v) {
    if (Py_IS_TYPE(v, &VCellType) && VerdictType != NULL) {
        VCell *c = (VCell *)v;
        PyObject *fields = Py_BuildValue("(LdO)", c->serial, c->time, c->pending ? Py_True : Py_False);
        if (fields == NULL) return NULL;
        PyObject *args = PyTuple_Pack(1, fields);
        Py_DECREF(fields);
        if (args == NULL) return NULL;
        PyObject *out = PyTuple_Type.tp_new((PyTypeObject *)VerdictType, args, NULL);
        Py_DECREF(args);
        return out;
    }
    Py_INCREF(v);
    return v;
}

/* ------------------------------------------------------------------------------------------
 * ReqState: one request's verdicts (internal)
 * ------------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *verdicts; /* dict key -> verdict */
    PyObject *broken;   /* dict key -> removal reason */
    long long gen;      /* watch generation: watch entries of another generation are stale */
    char watching;
    char incomplete;
    char alive;         /* 0 once finished (its watch entries are then stale) */
} ReqState;

static void ReqState_dealloc(ReqState *self) {
    Py_XDECREF(self->verdicts);
    Py_XDECREF(self->broken);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ReqStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvobs._speedups._ReqState",
    .tp_basicsize = sizeof(ReqState),
    .tp_dealloc = (destructor)ReqState_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
};

static ReqState *ReqState_new(long long gen) {
    ReqState *st = PyObject_New(ReqState, &ReqStateType);
    if (st == NULL) return NULL;
    st->verdicts = PyDict_New();
    st->broken = PyDict_New();
    st->gen = gen;
    st->watching = 1;
    st->incomplete = 0;
    st->alive = 1;
    if (st->verdicts == NULL || st->broken == NULL) {
        Py_DECREF(st);
        return NULL;
    }
    return st;
}

/* ------------------------------------------------------------------------------------------
 * WatchList: who may be watching one key, as (request, generation) pairs.
 *
 * The Python reference unwatches every key of a request when its load is pinned
 * (a set operation per key). Here pinning only flips the request's flag; entries
 * it leaves behind are stale and dropped when the key is next watched, removed,
 * or swept. An entry is live when its request is alive, watching, still in the
 * same generation, and still holds a verdict for the key: the same set of
 * watchers the reference keeps.
 * ------------------------------------------------------------------------------------------ */

typedef struct {
    ReqState *st; /* strong */
    long long gen;
} WatchItem;

typedef struct {
    PyObject_HEAD
    Py_ssize_t n, cap;
    WatchItem *items; /* == &one while cap == 1 */
    WatchItem one;
} WatchList;

static void WatchList_dealloc(WatchList *self) {
    for (Py_ssize_t i = 0; i < self->n; i++) Py_DECREF(self->items[i].st);
    if (self->items != &self->one) PyMem_Free(self->items);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject WatchListType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvobs._speedups._WatchList",
    .tp_basicsize = sizeof(WatchList),
    .tp_dealloc = (destructor)WatchList_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
};

static int watch_live(WatchItem *item, PyObject *key) {
    ReqState *st = item->st;
    if (!st->alive || !st->watching || st->gen != item->gen) return 0;
    return PyDict_Contains(st->verdicts, key);
}

/* Drop stale entries; 1 if (st, gen) is among the live ones, -1 on error. */
static int watch_prune(WatchList *wl, PyObject *key, ReqState *st) {
    Py_ssize_t kept = 0;
    int found = 0;
    for (Py_ssize_t i = 0; i < wl->n; i++) {
        WatchItem item = wl->items[i];
        if (st != NULL && item.st == st && item.gen == st->gen) { /* the caller's own entry: live */
            found = 1;
            wl->items[kept++] = item;
            continue;
        }
        int live = watch_live(&item, key);
        if (live < 0) {
            for (Py_ssize_t j = i; j < wl->n; j++) wl->items[kept++] = wl->items[j];
            wl->n = kept;
            return -1;
        }
        if (live) {
            wl->items[kept++] = item;
        } else {
            Py_DECREF(item.st);
        }
    }
    wl->n = kept;
    return found;
}

static int watch_add(PyObject *watched, PyObject *key, ReqState *st) {
    WatchList *wl = (WatchList *)PyDict_GetItemWithError(watched, key);
    if (wl == NULL) {
        if (PyErr_Occurred()) return -1;
        wl = PyObject_New(WatchList, &WatchListType);
        if (wl == NULL) return -1;
        wl->n = 0;
        wl->cap = 1;
        wl->items = &wl->one;
        int rc = PyDict_SetItem(watched, key, (PyObject *)wl);
        Py_DECREF(wl); /* the dict holds it */
        if (rc < 0) return -1;
    } else {
        int found = watch_prune(wl, key, st);
        if (found != 0) return found < 0 ? -1 : 0;
    }
    if (wl->n == wl->cap) {
        Py_ssize_t cap = wl->cap * 2;
        WatchItem *items = PyMem_Malloc((size_t)cap * sizeof(WatchItem));
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(items, wl->items, (size_t)wl->n * sizeof(WatchItem));
        if (wl->items != &wl->one) PyMem_Free(wl->items);
        wl->items = items;
        wl->cap = cap;
    }
    Py_INCREF(st);
    wl->items[wl->n].st = st;
    wl->items[wl->n].gen = st->gen;
    wl->n++;
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * Verdicts: kvobs.verdicts.LookupVerdicts in C
 * ------------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *requests; /* dict req_id -> ReqState */
    PyObject *watched;  /* dict key -> WatchList */
    Py_ssize_t entries;
    Py_ssize_t dropped;
    Py_ssize_t max_entries;
    Py_ssize_t sweep_at; /* sweep stale watch entries when `watched` grows past this */
    long long gen;
} Verdicts;

#define SWEEP_MIN 4096

static PyTypeObject VerdictsType;

static PyObject *Verdicts_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"max_entries", NULL};
    Py_ssize_t max_entries = 262144;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:Verdicts", kwlist, &max_entries)) return NULL;
    Verdicts *self = (Verdicts *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->requests = PyDict_New();
    self->watched = PyDict_New();
    if (self->requests == NULL || self->watched == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->max_entries = max_entries;
    self->sweep_at = SWEEP_MIN;
    return (PyObject *)self;
}

static void Verdicts_dealloc(Verdicts *self) {
    Py_XDECREF(self->requests);
    Py_XDECREF(self->watched);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Drop every stale watch entry (bounds `watched` when removals are never seen). */
static int v_sweep(Verdicts *self) {
    PyObject *empty = PyList_New(0);
    if (empty == NULL) return -1;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(self->watched, &pos, &key, &value)) {
        WatchList *wl = (WatchList *)value;
        if (watch_prune(wl, key, NULL) < 0 || (wl->n == 0 && PyList_Append(empty, key) < 0)) {
            Py_DECREF(empty);
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(empty); i++) {
        if (PyDict_DelItem(self->watched, PyList_GET_ITEM(empty, i)) < 0) {
            Py_DECREF(empty);
            return -1;
        }
    }
    Py_DECREF(empty);
    Py_ssize_t size = PyDict_GET_SIZE(self->watched);
    self->sweep_at = size * 2 > SWEEP_MIN ? size * 2 : SWEEP_MIN;
    return 0;
}

/* A HIT / HIT_PENDING by req_id for key: `verdict`, or (when NULL) a VCell of the given fields,
 * updated in place when the request already holds one for the key. */
static int v_report(Verdicts *self, PyObject *req_id, PyObject *key, PyObject *verdict, long long serial,
                    double time, int pending) {
    ReqState *st = (ReqState *)PyDict_GetItemWithError(self->requests, req_id);
    if (st == NULL) {
        if (PyErr_Occurred()) return -1;
        st = ReqState_new(++self->gen);
        if (st == NULL) return -1;
        int rc = PyDict_SetItem(self->requests, req_id, (PyObject *)st);
        Py_DECREF(st); /* the dict holds it */
        if (rc < 0) return -1;
    }
    PyObject *held = PyDict_GetItemWithError(st->verdicts, key);
    if (held == NULL && PyErr_Occurred()) return -1;
    if (held == NULL && self->entries >= self->max_entries) {
        self->dropped++;
        st->incomplete = 1;
        return 0;
    }
    if (verdict == NULL && held != NULL && Py_IS_TYPE(held, &VCellType)) {
        VCell *cell = (VCell *)held;
        cell->serial = serial;
        cell->time = time;
        cell->pending = (char)pending;
    } else {
        PyObject *value = verdict;
        if (value == NULL) {
            value = VCell_make(serial, time, pending);
            if (value == NULL) return -1;
        } else {
            Py_INCREF(value);
        }
        int rc = PyDict_SetItem(st->verdicts, key, value);
        Py_DECREF(value);
        if (rc < 0) return -1;
        if (held == NULL) self->entries++;
    }
    if (!st->watching) { /* watched again after a pin: earlier entries stay stale */
        st->watching = 1;
        st->gen = ++self->gen;
    }
    if (PyDict_GET_SIZE(st->broken) > 0 && PyDict_Contains(st->broken, key) == 1 &&
        PyDict_DelItem(st->broken, key) < 0) /* a fresh promise replaces the broken one */
        return -1;
    if (watch_add(self->watched, key, st) < 0) return -1;
    if (PyDict_GET_SIZE(self->watched) > self->sweep_at) return v_sweep(self);
    return 0;
}

static int v_reported(Verdicts *self, PyObject *req_id, PyObject *key, PyObject *verdict) {
    return v_report(self, req_id, key, verdict, 0, 0.0, 0);
}

static int v_not_reported(Verdicts *self, PyObject *req_id, PyObject *key) {
    ReqState *st = (ReqState *)PyDict_GetItemWithError(self->requests, req_id);
    if (st == NULL) return PyErr_Occurred() ? -1 : 0;
    int has = PyDict_Contains(st->verdicts, key);
    if (has <= 0) return has;
    if (PyDict_DelItem(st->verdicts, key) < 0) return -1; /* its watch entry is now stale */
    self->entries--;
    if (PyDict_GET_SIZE(st->broken) > 0 && PyDict_Contains(st->broken, key) == 1 &&
        PyDict_DelItem(st->broken, key) < 0)
        return -1;
    return 0;
}

static int v_pinned(Verdicts *self, PyObject *req_id) {
    ReqState *st = (ReqState *)PyDict_GetItemWithError(self->requests, req_id);
    if (st == NULL) return PyErr_Occurred() ? -1 : 0;
    if (st->watching) { /* its watch entries are now stale */
        st->watching = 0;
        PyDict_Clear(st->broken);
    }
    return 0;
}

static int v_finished(Verdicts *self, PyObject *req_id) {
    ReqState *st = (ReqState *)PyDict_GetItemWithError(self->requests, req_id);
    if (st == NULL) return PyErr_Occurred() ? -1 : 0;
    st->watching = 0;
    st->alive = 0;
    self->entries -= PyDict_GET_SIZE(st->verdicts);
    PyDict_Clear(st->verdicts);
    PyDict_Clear(st->broken);
    return PyDict_DelItem(self->requests, req_id);
}

/* Near misses among `keys` for req_id (a new list), then stop watching its promises. */
static PyObject *v_loaded(Verdicts *self, PyObject *req_id, PyObject *keys) {
    ReqState *st = (ReqState *)PyDict_GetItemWithError(self->requests, req_id);
    if (st == NULL) return PyErr_Occurred() ? NULL : PyList_New(0);
    PyObject *misses = PyList_New(0);
    if (misses == NULL) return NULL;
    if (PyDict_GET_SIZE(st->broken) > 0) {
        Py_INCREF(st); /* the loop calls Python (NearMiss.__new__) */
        PyObject *it = PyObject_GetIter(keys);
        PyObject *key;
        if (it == NULL) goto fail_st;
        while ((key = PyIter_Next(it)) != NULL) {
            PyObject *reason = PyDict_GetItemWithError(st->broken, key);
            if (reason == NULL) {
                Py_DECREF(key);
                if (PyErr_Occurred()) { Py_DECREF(it); goto fail_st; }
                continue;
            }
            Py_INCREF(reason);
            PyObject *stored = PyDict_GetItemWithError(st->verdicts, key);
            PyObject *miss = NULL;
            if (stored != NULL) {
                PyObject *verdict = as_verdict(stored);
                if (verdict != NULL) {
                    miss = PyObject_CallFunctionObjArgs(NearMissType, req_id, key, verdict, reason, NULL);
                    Py_DECREF(verdict);
                }
            } else if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_KeyError, "broken promise without a verdict");
            }
            Py_DECREF(reason);
            Py_DECREF(key);
            if (miss == NULL || PyList_Append(misses, miss) < 0) {
                Py_XDECREF(miss);
                Py_DECREF(it);
                goto fail_st;
            }
            Py_DECREF(miss);
        }
        Py_DECREF(it);
        Py_DECREF(st);
        if (PyErr_Occurred()) goto fail;
    }
    if (v_pinned(self, req_id) < 0) goto fail;
    return misses;
fail_st:
    Py_DECREF(st);
fail:
    Py_DECREF(misses);
    return NULL;
}

/* Mark the promises `keys` broke; how many (-1 on error). */
static Py_ssize_t v_removed(Verdicts *self, PyObject *keys, PyObject *reason) {
    if (PyDict_GET_SIZE(self->watched) == 0) return 0;
    PyObject *seq = PySequence_Fast(keys, "keys must be iterable");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), broken = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        WatchList *wl = (WatchList *)PyDict_GetItemWithError(self->watched, key);
        if (wl == NULL) {
            if (PyErr_Occurred()) goto fail;
            continue;
        }
        Py_INCREF(wl);
        if (PyDict_DelItem(self->watched, key) < 0) { Py_DECREF(wl); goto fail; }
        for (Py_ssize_t j = 0; j < wl->n; j++) {
            int live = watch_live(&wl->items[j], key);
            if (live < 0 || (live && PyDict_SetItem(wl->items[j].st->broken, key, reason) < 0)) {
                Py_DECREF(wl);
                goto fail;
            }
            broken += live;
        }
        Py_DECREF(wl);
    }
    Py_DECREF(seq);
    return broken;
fail:
    Py_DECREF(seq);
    return -1;
}

static Py_ssize_t v_removed_all(Verdicts *self, PyObject *reason) {
    PyObject *keys = PyDict_Keys(self->watched);
    if (keys == NULL) return -1;
    Py_ssize_t n = v_removed(self, keys, reason);
    Py_DECREF(keys);
    return n;
}

/* -- Python methods -- */

static PyObject *Verdicts_reported(Verdicts *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "reported(req_id, key, verdict)");
    if (v_reported(self, args[0], args[1], args[2]) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Verdicts_not_reported(Verdicts *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "not_reported(req_id, key)");
    if (v_not_reported(self, args[0], args[1]) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Verdicts_get(Verdicts *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "get(req_id, key)");
    ReqState *st = (ReqState *)PyDict_GetItemWithError(self->requests, args[0]);
    if (st == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *v = PyDict_GetItemWithError(st->verdicts, args[1]);
    if (v == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    return as_verdict(v);
}

static PyObject *Verdicts_incomplete(Verdicts *self, PyObject *req_id) {
    ReqState *st = (ReqState *)PyDict_GetItemWithError(self->requests, req_id);
    if (st == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_FALSE;
    }
    return PyBool_FromLong(st->incomplete);
}

static PyObject *Verdicts_pinned(Verdicts *self, PyObject *req_id) {
    if (v_pinned(self, req_id) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Verdicts_loaded(Verdicts *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "loaded(req_id, keys)");
    return v_loaded(self, args[0], args[1]);
}

static PyObject *Verdicts_finished(Verdicts *self, PyObject *req_id) {
    if (v_finished(self, req_id) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Verdicts_removed(Verdicts *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "removed(keys, reason)");
    Py_ssize_t n = v_removed(self, args[0], args[1]);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

static PyObject *Verdicts_removed_all(Verdicts *self, PyObject *reason) {
    Py_ssize_t n = v_removed_all(self, reason);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

static PyObject *Verdicts_clear(Verdicts *self, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(self->requests, &pos, &key, &value)) ((ReqState *)value)->alive = 0;
    PyDict_Clear(self->requests);
    PyDict_Clear(self->watched);
    self->entries = 0;
    Py_RETURN_NONE;
}

static Py_ssize_t Verdicts_len(Verdicts *self) { return self->entries; }

static PyObject *Verdicts_watched_keys(Verdicts *self, void *Py_UNUSED(closure)) {
    Py_ssize_t pos = 0, count = 0;
    PyObject *key, *value;
    while (PyDict_Next(self->watched, &pos, &key, &value)) {
        WatchList *wl = (WatchList *)value;
        for (Py_ssize_t j = 0; j < wl->n; j++) {
            int live = watch_live(&wl->items[j], key);
            if (live < 0) return NULL;
            if (live) {
                count++;
                break;
            }
        }
    }
    return PyLong_FromSsize_t(count);
}

static PyObject *Verdicts_watch_entries(Verdicts *self, void *Py_UNUSED(closure)) {
    return PyLong_FromSsize_t(PyDict_GET_SIZE(self->watched));
}

static PyMethodDef Verdicts_methods[] = {
    {"reported", (PyCFunction)(void (*)(void))Verdicts_reported, METH_FASTCALL,
     "A lookup by req_id answered HIT / HIT_PENDING for key."},
    {"not_reported", (PyCFunction)(void (*)(void))Verdicts_not_reported, METH_FASTCALL,
     "A later lookup by req_id answered MISS/RETRY: the old promise is void."},
    {"get", (PyCFunction)(void (*)(void))Verdicts_get, METH_FASTCALL, "The verdict of (req_id, key), or None."},
    {"incomplete", (PyCFunction)Verdicts_incomplete, METH_O, "True if a verdict of this request was dropped."},
    {"pinned", (PyCFunction)Verdicts_pinned, METH_O, "The request was scheduled: stop watching."},
    {"loaded", (PyCFunction)(void (*)(void))Verdicts_loaded, METH_FASTCALL,
     "The request's load asked for keys: the broken promises among them, then stop watching."},
    {"finished", (PyCFunction)Verdicts_finished, METH_O, "The request is gone: forget its verdicts."},
    {"removed", (PyCFunction)(void (*)(void))Verdicts_removed, METH_FASTCALL,
     "Keys left the cache: mark (and stop watching) the promises they broke; how many."},
    {"removed_all", (PyCFunction)Verdicts_removed_all, METH_O, "Every watched chunk left the cache."},
    {"clear", (PyCFunction)Verdicts_clear, METH_NOARGS, "Forget everything."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Verdicts_members[] = {
    {"max_entries", T_PYSSIZET, offsetof(Verdicts, max_entries), 0, "At most this many verdicts are kept."},
    {"dropped", T_PYSSIZET, offsetof(Verdicts, dropped), 0, "Verdicts that did not fit."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Verdicts_getset[] = {
    {"watched_keys", (getter)Verdicts_watched_keys, NULL, "Keys with an unpinned promise.", NULL},
    {"watch_entries", (getter)Verdicts_watch_entries, NULL, "Keys in the watch index, stale ones included.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Verdicts_as_sequence = {
    .sq_length = (lenfunc)Verdicts_len,
};

static PyTypeObject VerdictsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvobs._speedups.Verdicts",
    .tp_doc = "kvobs.verdicts.LookupVerdicts in C (same behaviour; lazy unwatching).",
    .tp_basicsize = sizeof(Verdicts),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Verdicts_new,
    .tp_dealloc = (destructor)Verdicts_dealloc,
    .tp_methods = Verdicts_methods,
    .tp_members = Verdicts_members,
    .tp_getset = Verdicts_getset,
    .tp_as_sequence = &Verdicts_as_sequence,
};

/* ------------------------------------------------------------------------------------------
 * Recorder: the frame, the serial, the removal queue, the chunk-slot stamps
 * ------------------------------------------------------------------------------------------ */

#define MAX_REASONS 8

/* A growable byte buffer (the queue's numeric columns). */
typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buf;

static int buf_push(Buf *b, const void *item, Py_ssize_t size) {
    if (b->len + size > b->cap) {
        Py_ssize_t cap = b->cap ? b->cap * 2 : 4096;
        while (cap < b->len + size) cap *= 2;
        char *data = PyMem_Realloc(b->data, (size_t)cap);
        if (data == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->data = data;
        b->cap = cap;
    }
    memcpy(b->data + b->len, item, (size_t)size);
    b->len += size;
    return 0;
}

/* The buffer's bytes, and empty it (its memory is kept for the next run). */
static PyObject *buf_take(Buf *b) {
    PyObject *out = PyBytes_FromStringAndSize(b->data ? b->data : "", b->len);
    if (out != NULL) b->len = 0;
    return out;
}

typedef struct {
    PyObject_HEAD
    Verdicts *verdicts;
    PyObject *reasons;         /* tuple of reason names */
    Py_ssize_t reset_reason;
    PyObject *on_error;        /* on_error(stage, exc) */
    PyObject *drain;           /* drain() */
    PyObject *off_thread_path; /* off_thread_path() -> int */
    Py_ssize_t drain_keys, drain_batches;
    long long serial;
    /* the queue, by column: native int64 / float64 arrays the history reads with np.frombuffer */
    long long first_serial;
    Buf p_hashes, p_counts, p_times, p_flags;
    PyObject *p_reqs;
    PyObject *p_batches; /* full records, only while keep_batches */
    Py_ssize_t p_keys, p_resets;
    int keep_batches;
    long long evicted[MAX_REASONS], batches[MAX_REASONS];
    /* the frame: which tapped call is running, for whom, on which thread */
    int path;
    PyObject *req; /* strong, or NULL */
    unsigned long thread;
    double *stamps;
    Py_ssize_t num_stamps;
} Recorder;

static PyTypeObject RecorderType;

static int new_columns(Recorder *r) {
    PyObject *reqs = PyList_New(0), *batches = PyList_New(0);
    if (reqs == NULL || batches == NULL) {
        Py_XDECREF(reqs);
        Py_XDECREF(batches);
        return -1;
    }
    Py_XSETREF(r->p_reqs, reqs);
    Py_XSETREF(r->p_batches, batches);
    r->p_hashes.len = r->p_counts.len = r->p_times.len = r->p_flags.len = 0;
    r->p_keys = 0;
    r->p_resets = 0;
    return 0;
}

static PyObject *Recorder_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"verdicts", "reasons", "num_stamps", "on_error", "drain", "off_thread_path",
                             "drain_keys", "drain_batches", NULL};
    PyObject *verdicts, *reasons, *on_error, *drain, *off_thread_path;
    Py_ssize_t num_stamps, drain_keys = 16384, drain_batches = 2048; /* kvobs.recorder's defaults */
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!nOOO|nn:Recorder", kwlist, &VerdictsType, &verdicts,
                                     &PyTuple_Type, &reasons, &num_stamps, &on_error, &drain, &off_thread_path,
                                     &drain_keys, &drain_batches))
        return NULL;
    if (PyTuple_GET_SIZE(reasons) > MAX_REASONS) return PyErr_Format(PyExc_ValueError, "too many reasons");
    Py_ssize_t reset = -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(reasons); i++) {
        PyObject *name = PyTuple_GET_ITEM(reasons, i);
        if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "reset") == 0) reset = i;
    }
    if (reset < 0) return PyErr_Format(PyExc_ValueError, "reasons must include 'reset'");
    if (num_stamps < 0) num_stamps = 0;
    Recorder *self = (Recorder *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    Py_INCREF(verdicts);
    self->verdicts = (Verdicts *)verdicts;
    Py_INCREF(reasons);
    self->reasons = reasons;
    self->reset_reason = reset;
    Py_INCREF(on_error);
    self->on_error = on_error;
    Py_INCREF(drain);
    self->drain = drain;
    Py_INCREF(off_thread_path);
    self->off_thread_path = off_thread_path;
    self->drain_keys = drain_keys;
    self->drain_batches = drain_batches;
    self->num_stamps = num_stamps;
    self->stamps = PyMem_Calloc(num_stamps ? (size_t)num_stamps : 1, sizeof(double));
    if (self->stamps == NULL || new_columns(self) < 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static int Recorder_traverse(Recorder *self, visitproc visit, void *arg) {
    Py_VISIT(self->verdicts);
    Py_VISIT(self->reasons);
    Py_VISIT(self->on_error);
    Py_VISIT(self->drain);
    Py_VISIT(self->off_thread_path);
    Py_VISIT(self->p_reqs);
    Py_VISIT(self->p_batches);
    Py_VISIT(self->req);
    return 0;
}

static int Recorder_clear(Recorder *self) {
    Py_CLEAR(self->verdicts);
    Py_CLEAR(self->reasons);
    Py_CLEAR(self->on_error);
    Py_CLEAR(self->drain);
    Py_CLEAR(self->off_thread_path);
    Py_CLEAR(self->p_reqs);
    Py_CLEAR(self->p_batches);
    Py_CLEAR(self->req);
    return 0;
}

static void Recorder_dealloc(Recorder *self) {
    PyObject_GC_UnTrack(self);
    Recorder_clear(self);
    PyMem_Free(self->stamps);
    PyMem_Free(self->p_hashes.data);
    PyMem_Free(self->p_counts.data);
    PyMem_Free(self->p_times.data);
    PyMem_Free(self->p_flags.data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Hand the pending exception, a fault of kvobs's own, to on_error(stage, exc) and clear it: 0.
 * An exception that is not an Exception (KeyboardInterrupt, SystemExit) is left set: -1, and the
 * caller lets it propagate, as the Python reference's `except Exception` does. */
static int report_error(Recorder *r, PyObject *stage) {
    PyObject *type, *value, *tb;
    if (!PyErr_Occurred()) return 0;
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
    if (r->on_error != NULL) {
        PyObject *res = PyObject_CallFunctionObjArgs(r->on_error, stage, value ? value : Py_None, NULL);
        if (res == NULL) PyErr_Clear();
        Py_XDECREF(res);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return 0;
}

/* report_error for a tap that got `result` from vLLM: the result, or NULL if an exception
 * that must propagate is set (the result is then dropped). */
static PyObject *reported(Recorder *r, PyObject *stage, PyObject *result) {
    if (report_error(r, stage) < 0) {
        Py_XDECREF(result);
        return NULL;
    }
    return result;
}

static void frame_enter(Recorder *r, int path, PyObject *req) {
    PyObject *old = r->req;
    Py_XINCREF(req);
    r->req = req;
    r->path = path;
    r->thread = PyThread_get_thread_ident();
    Py_XDECREF(old);
}

static void frame_exit(Recorder *r) {
    PyObject *old = r->req;
    r->req = NULL;
    r->thread = 0;
    Py_XDECREF(old);
}


/* Queue one removal batch. Steals `keys` (a list) and `residency` (a list or NULL).
 * path < 0: take path and req from the frame. Returns -1 with an exception set on error,
 * leaving the queue as it was. */
static int record_removal(Recorder *r, PyObject *keys, Py_ssize_t reason, PyObject *residency, double now,
                          int path, PyObject *req_id) {
    PyObject *req_obj = NULL, *record = NULL;
    int64_t *hashes = NULL;
    Py_ssize_t lens[6];
    if (reason < 0 || reason >= PyTuple_GET_SIZE(r->reasons)) {
        PyErr_Format(PyExc_ValueError, "bad reason code %zd", reason);
        goto fail;
    }
    if (path < 0) {
        if (r->thread != 0 && r->thread == PyThread_get_thread_ident()) {
            path = r->path;
            if (r->req != NULL && r->req != Py_None) {
                PyObject *req = r->req;
                Py_INCREF(req); /* req_id may be computed by Python code that ends the frame */
                req_obj = PyObject_GetAttr(req, str_req_id);
                Py_DECREF(req);
                if (req_obj == NULL) goto fail;
            }
        } else {
            PyObject *code = PyObject_CallNoArgs(r->off_thread_path);
            if (code == NULL) goto fail;
            path = (int)PyLong_AsLong(code);
            Py_DECREF(code);
            if (path == -1 && PyErr_Occurred()) goto fail;
        }
    } else if (req_id != NULL) {
        Py_INCREF(req_id);
        req_obj = req_id;
    }
    if (req_obj == NULL) {
        Py_INCREF(Py_None);
        req_obj = Py_None;
    }
    /* Everything that can run Python code (and so let another thread queue or drain) is done
     * above and here, before the queue's lengths are noted: from there on nothing switches. */
    Py_ssize_t nkeys = PyList_GET_SIZE(keys);
    hashes = PyMem_Malloc((size_t)(nkeys ? nkeys : 1) * sizeof(int64_t));
    if (hashes == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < nkeys; i++) {
        hashes[i] = (int64_t)PyObject_Hash(PyList_GET_ITEM(keys, i));
        if (hashes[i] == -1 && PyErr_Occurred()) goto fail;
    }
    lens[0] = r->p_hashes.len;
    lens[1] = r->p_counts.len;
    lens[2] = r->p_times.len;
    lens[3] = r->p_flags.len;
    lens[4] = PyList_GET_SIZE(r->p_reqs);
    lens[5] = PyList_GET_SIZE(r->p_batches);
    if (buf_push(&r->p_hashes, hashes, (Py_ssize_t)(nkeys * (Py_ssize_t)sizeof(int64_t))) < 0) goto rollback;
    int64_t count = (int64_t)nkeys, flags = (int64_t)reason | ((int64_t)path << 2);
    if (buf_push(&r->p_counts, &count, sizeof count) < 0 || buf_push(&r->p_times, &now, sizeof now) < 0 ||
        buf_push(&r->p_flags, &flags, sizeof flags) < 0 || PyList_Append(r->p_reqs, req_obj) < 0)
        goto rollback;
    PyObject *reason_name = PyTuple_GET_ITEM(r->reasons, reason);
    Py_ssize_t broken = (reason == r->reset_reason && nkeys == 0) ? v_removed_all(r->verdicts, reason_name)
                                                                    : v_removed(r->verdicts, keys, reason_name);
    if (broken < 0) goto rollback;
    long long serial = r->serial;
    if (r->keep_batches) {
        record = Py_BuildValue("(LdnnOOOn)", serial, now, reason, (Py_ssize_t)path, req_obj, keys,
                               residency ? residency : Py_None, broken);
        if (record == NULL || PyList_Append(r->p_batches, record) < 0) goto rollback;
        Py_DECREF(record);
        record = NULL;
    }
    if (lens[4] == 0) r->first_serial = serial;
    r->serial = serial + 1;
    r->p_keys += nkeys;
    if (reason == r->reset_reason) r->p_resets++;
    r->evicted[reason] += nkeys;
    r->batches[reason] += 1;
    Py_DECREF(keys);
    Py_XDECREF(residency);
    Py_DECREF(req_obj);
    PyMem_Free(hashes);
    if (r->p_keys >= r->drain_keys || PyList_GET_SIZE(r->p_reqs) >= r->drain_batches) {
        PyObject *res = PyObject_CallNoArgs(r->drain);
        if (res == NULL && report_error(r, stage_removal) < 0) return -1;
        Py_XDECREF(res);
    }
    return 0;
rollback: {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        r->p_hashes.len = lens[0];
        r->p_counts.len = lens[1];
        r->p_times.len = lens[2];
        r->p_flags.len = lens[3];
        PyObject *cols[2] = {r->p_reqs, r->p_batches};
        for (int i = 0; i < 2; i++) {
            if (PyList_GET_SIZE(cols[i]) > lens[4 + i] &&
                PyList_SetSlice(cols[i], lens[4 + i], PY_SSIZE_T_MAX, NULL) < 0)
                PyErr_Clear();
        }
        PyErr_Restore(type, value, tb);
    }
fail:
    PyMem_Free(hashes);
    Py_XDECREF(keys);
    Py_XDECREF(residency);
    Py_XDECREF(req_obj);
    Py_XDECREF(record);
    return -1;
}

static PyObject *Recorder_removal(Recorder *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"keys", "reason", "residency", "now", "path", "req_id", NULL};
    PyObject *keys, *residency, *req_id = Py_None;
    Py_ssize_t reason;
    double now;
    int path = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnOd|iO:removal", kwlist, &keys, &reason, &residency, &now,
                                     &path, &req_id))
        return NULL;
    PyObject *key_list = PySequence_List(keys);
    if (key_list == NULL) return NULL;
    PyObject *res_list = NULL;
    if (residency != Py_None) {
        res_list = PySequence_List(residency);
        if (res_list == NULL) {
            Py_DECREF(key_list);
            return NULL;
        }
    }
    if (record_removal(self, key_list, reason, res_list, now, path, req_id) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Recorder_take_pending(Recorder *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = Py_BuildValue("(LNNNNOOn)", self->first_serial, buf_take(&self->p_hashes),
                                  buf_take(&self->p_counts), buf_take(&self->p_times), buf_take(&self->p_flags),
                                  self->p_reqs, self->keep_batches || PyList_GET_SIZE(self->p_batches)
                                  ? self->p_batches : Py_None, self->p_resets);
    if (out == NULL) return NULL;
    if (new_columns(self) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *Recorder_totals(Recorder *self, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t n = PyTuple_GET_SIZE(self->reasons);
    PyObject *evicted = PyTuple_New(n), *batches = PyTuple_New(n);
    if (evicted == NULL || batches == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyLong_FromLongLong(self->evicted[i]), *b = PyLong_FromLongLong(self->batches[i]);
        PyTuple_SET_ITEM(evicted, i, e);
        PyTuple_SET_ITEM(batches, i, b);
        if (e == NULL || b == NULL) goto fail;
    }
    return Py_BuildValue("(NN)", evicted, batches);
fail:
    Py_XDECREF(evicted);
    Py_XDECREF(batches);
    return NULL;
}

static int chunk_slot(Recorder *r, PyObject *chunk, Py_ssize_t *slot) {
    PyObject *cid = PyObject_GetAttr(chunk, str_chunk_id);
    if (cid == NULL) return -1;
    Py_ssize_t id = PyLong_AsSsize_t(cid);
    Py_DECREF(cid);
    if (id == -1 && PyErr_Occurred()) return -1;
    if (id < 0 || id >= r->num_stamps) {
        PyErr_Format(PyExc_IndexError, "chunk_id %zd outside the %zd stamped slots", id, r->num_stamps);
        return -1;
    }
    *slot = id;
    return 0;
}

static PyObject *Recorder_ages(Recorder *self, PyObject *args) {
    PyObject *chunks;
    double now;
    if (!PyArg_ParseTuple(args, "Od:ages", &chunks, &now)) return NULL;
    PyObject *out = PyList_New(0), *it = PyObject_GetIter(chunks), *chunk;
    if (out == NULL || it == NULL) goto fail;
    while ((chunk = PyIter_Next(it)) != NULL) {
        Py_ssize_t slot;
        int rc = chunk_slot(self, chunk, &slot);
        Py_DECREF(chunk);
        if (rc < 0) {
            if (!PyErr_ExceptionMatches(PyExc_IndexError)) goto fail;
            PyErr_Clear(); /* an unknown slot is skipped, like an unstamped one */
            continue;
        }
        double stamp = self->stamps[slot];
        if (stamp != 0.0) {
            PyObject *age = PyFloat_FromDouble(now - stamp);
            if (age == NULL || PyList_Append(out, age) < 0) {
                Py_XDECREF(age);
                goto fail;
            }
            Py_DECREF(age);
        }
    }
    if (PyErr_Occurred()) goto fail;
    Py_DECREF(it);
    return out;
fail:
    Py_XDECREF(it);
    Py_XDECREF(out);
    return NULL;
}

static PyObject *Recorder_next_serial(Recorder *self, void *Py_UNUSED(c)) { return PyLong_FromLongLong(self->serial); }
static PyObject *Recorder_pending_count(Recorder *self, void *Py_UNUSED(c)) {
    return PyLong_FromSsize_t(PyList_GET_SIZE(self->p_reqs));
}
static PyObject *Recorder_get_verdicts(Recorder *self, void *Py_UNUSED(c)) {
    Py_INCREF(self->verdicts);
    return (PyObject *)self->verdicts;
}

/* ------------------------------------------------------------------------------------------
 * Tap: a callable standing in for one bound method of the inner manager
 * ------------------------------------------------------------------------------------------ */

enum { TAP_LOOKUP, TAP_CALL, TAP_LOAD, TAP_EVICT, TAP_ALLOCATE };
enum { AFTER_NONE, AFTER_FINISHED, AFTER_PINNED };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *inner;
    Recorder *rec;
    int kind, path, req_pos, after, set_frame;
    PyObject *hit, *hit_pending;     /* lookup */
    PyObject *on_failure, *on_near;  /* load */
} Tap;

static PyTypeObject TapType;

static int Tap_traverse(Tap *self, visitproc visit, void *arg) {
    Py_VISIT(self->inner);
    Py_VISIT(self->rec);
    Py_VISIT(self->hit);
    Py_VISIT(self->hit_pending);
    Py_VISIT(self->on_failure);
    Py_VISIT(self->on_near);
    return 0;
}

static int Tap_clear(Tap *self) {
    Py_CLEAR(self->inner);
    Py_CLEAR(self->rec);
    Py_CLEAR(self->hit);
    Py_CLEAR(self->hit_pending);
    Py_CLEAR(self->on_failure);
    Py_CLEAR(self->on_near);
    return 0;
}

static void Tap_dealloc(Tap *self) {
    PyObject_GC_UnTrack(self);
    Tap_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Argument `name` at position `pos` or by keyword (borrowed; NULL if absent). */
static PyObject *arg_of(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int pos, PyObject *name) {
    if (pos >= 0 && pos < nargs) return args[pos];
    if (kwnames != NULL) {
        Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nkw; i++) {
            PyObject *kw = PyTuple_GET_ITEM(kwnames, i);
            if (kw == name || PyUnicode_Compare(kw, name) == 0) return args[nargs + i];
        }
    }
    return NULL;
}

static PyObject *require_req_id(PyObject *req) {
    if (req == NULL) {
        PyErr_SetString(PyExc_TypeError, "no req_context argument");
        return NULL;
    }
    return PyObject_GetAttr(req, str_req_id);
}

static PyObject *tap_lookup(Tap *t, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Recorder *r = t->rec;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *req = arg_of(args, nargs, kwnames, 1, str_req_context);
    if (t->set_frame) frame_enter(r, t->path, req);
    PyObject *result = PyObject_Vectorcall(t->inner, args, nargsf, kwnames);
    if (t->set_frame) frame_exit(r);
    if (result == NULL) return NULL;
    PyObject *key = arg_of(args, nargs, kwnames, 0, str_key);
    PyObject *req_id = require_req_id(req);
    int rc = -1;
    if (req_id != NULL && key != NULL) {
        if (result == t->hit || result == t->hit_pending) {
            rc = v_report(r->verdicts, req_id, key, NULL, r->serial, monotonic_now(), result == t->hit_pending);
        } else {
            rc = v_not_reported(r->verdicts, req_id, key);
        }
    } else if (req_id != NULL) {
        PyErr_SetString(PyExc_TypeError, "no key argument");
    }
    Py_XDECREF(req_id);
    return rc < 0 ? reported(r, stage_lookup, result) : result;
}

static PyObject *tap_call(Tap *t, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Recorder *r = t->rec;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *req = arg_of(args, nargs, kwnames, t->req_pos, str_req_context);
    Py_XINCREF(req);
    frame_enter(r, t->path, req);
    PyObject *result = PyObject_Vectorcall(t->inner, args, nargsf, kwnames);
    frame_exit(r);
    if (result == NULL || t->after == AFTER_NONE) {
        Py_XDECREF(req);
        return result;
    }
    int rc = -1;
    if (t->after == AFTER_FINISHED) {
        PyObject *req_id = require_req_id(req);
        if (req_id != NULL) {
            rc = v_finished(r->verdicts, req_id);
            Py_DECREF(req_id);
        }
    } else {
        PyObject *context = arg_of(args, nargs, kwnames, 0, str_context);
        PyObject *ids = context == NULL ? NULL : PyObject_GetAttr(context, str_new_req_ids);
        if (context == NULL) PyErr_SetString(PyExc_TypeError, "no context argument");
        PyObject *it = ids == NULL ? NULL : PyObject_GetIter(ids), *req_id;
        Py_XDECREF(ids);
        if (it != NULL) {
            rc = 0;
            while (rc == 0 && (req_id = PyIter_Next(it)) != NULL) {
                rc = v_pinned(r->verdicts, req_id);
                Py_DECREF(req_id);
            }
            if (PyErr_Occurred()) rc = -1;
            Py_DECREF(it);
        }
    }
    Py_XDECREF(req);
    return rc < 0 ? reported(r, t->after == AFTER_FINISHED ? stage_finish : stage_schedule_end, result) : result;
}

static PyObject *tap_load(Tap *t, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Recorder *r = t->rec;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *result = PyObject_Vectorcall(t->inner, args, nargsf, kwnames);
    PyObject *keys = arg_of(args, nargs, kwnames, 0, str_keys);
    PyObject *req = arg_of(args, nargs, kwnames, 1, str_req_context);
    if (result == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AssertionError)) return NULL;
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL) PyException_SetTraceback(value, tb);
        PyObject *res = PyObject_CallFunctionObjArgs(t->on_failure, value, keys ? keys : Py_None,
                                                     req ? req : Py_None, NULL);
        if (res == NULL && report_error(r, stage_diagnosis) < 0) { /* an interrupt: it propagates instead */
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            return NULL;
        }
        Py_XDECREF(res);
        PyErr_Restore(type, value, tb); /* vLLM's own assertion, same object, same traceback */
        return NULL;
    }
    PyObject *req_id = require_req_id(req);
    PyObject *near = NULL;
    if (req_id != NULL && keys == NULL) PyErr_SetString(PyExc_TypeError, "no keys argument");
    else if (req_id != NULL) near = v_loaded(r->verdicts, req_id, keys);
    Py_XDECREF(req_id);
    if (near == NULL) {
        return reported(r, stage_load, result);
    } else {
        if (PyList_GET_SIZE(near) > 0) {
            PyObject *res = PyObject_CallOneArg(t->on_near, near);
            if (res == NULL && report_error(r, stage_load) < 0) {
                Py_DECREF(near);
                Py_DECREF(result);
                return NULL;
            }
            Py_XDECREF(res);
        }
        Py_DECREF(near);
    }
    return result;
}

static PyObject *tap_evict(Tap *t, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Recorder *r = t->rec;
    PyObject *evicted = PyObject_Vectorcall(t->inner, args, nargsf, kwnames);
    if (evicted == NULL || evicted == Py_None) return evicted;
    int truth = PyObject_IsTrue(evicted);
    if (truth <= 0) {
        return truth < 0 ? reported(r, stage_removal, evicted) : evicted;
    }
    double now = monotonic_now();
    PyObject *keys = NULL, *ages = NULL;
    PyObject *seq = PySequence_Fast(evicted, "evict() must return a sequence");
    if (seq == NULL) goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    keys = PyList_New(n);
    if (keys == NULL) goto fail;
    if (r->keep_batches) { /* residency is only for sinks that take batches (the journal) */
        ages = PyList_New(0);
        if (ages == NULL) goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = items[i];
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "evict() items must be (key, chunk) pairs");
            goto fail;
        }
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        Py_INCREF(key);
        PyList_SET_ITEM(keys, i, key);
        if (ages == NULL) continue;
        Py_ssize_t slot;
        if (chunk_slot(r, PyTuple_GET_ITEM(pair, 1), &slot) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_IndexError)) goto fail;
            PyErr_Clear(); /* a slot never stamped: no age, like an unstamped one */
            continue;
        }
        double stamp = r->stamps[slot];
        if (stamp != 0.0) {
            PyObject *age = PyFloat_FromDouble(now - stamp);
            if (age == NULL || PyList_Append(ages, age) < 0) {
                Py_XDECREF(age);
                goto fail;
            }
            Py_DECREF(age);
        }
    }
    Py_DECREF(seq);
    seq = NULL;
    if (record_removal(r, keys, 0, ages, now, -1, NULL) < 0) return reported(r, stage_removal, evicted);
    return evicted;
fail:
    Py_XDECREF(seq);
    Py_XDECREF(keys);
    Py_XDECREF(ages);
    return reported(r, stage_removal, evicted);
}

static PyObject *tap_allocate(Tap *t, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Recorder *r = t->rec;
    PyObject *chunks = PyObject_Vectorcall(t->inner, args, nargsf, kwnames);
    if (chunks == NULL || !r->keep_batches) return chunks; /* residency only goes to sinks that take batches */
    double now = monotonic_now();
    PyObject *seq = PySequence_Fast(chunks, "allocate must return a sequence");
    if (seq == NULL) return reported(r, stage_removal, chunks);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t slot;
        if (chunk_slot(r, items[i], &slot) < 0) {
            Py_DECREF(seq);
            return reported(r, stage_removal, chunks);
        }
        r->stamps[slot] = now;
    }
    Py_DECREF(seq);
    return chunks;
}

static PyObject *Tap_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Tap *t = (Tap *)self;
    switch (t->kind) {
    case TAP_LOOKUP: return tap_lookup(t, args, nargsf, kwnames);
    case TAP_CALL: return tap_call(t, args, nargsf, kwnames);
    case TAP_LOAD: return tap_load(t, args, nargsf, kwnames);
    case TAP_EVICT: return tap_evict(t, args, nargsf, kwnames);
    default: return tap_allocate(t, args, nargsf, kwnames);
    }
}

static PyObject *Tap_get_inner(Tap *self, void *Py_UNUSED(c)) {
    Py_INCREF(self->inner);
    return self->inner;
}

static PyGetSetDef Tap_getset[] = {
    {"__wrapped__", (getter)Tap_get_inner, NULL, "The inner manager's method this tap calls.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvobs._speedups.Tap",
    .tp_doc = "Calls one of the inner manager's methods and records around it.",
    .tp_basicsize = sizeof(Tap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Tap, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = (traverseproc)Tap_traverse,
    .tp_clear = (inquiry)Tap_clear,
    .tp_dealloc = (destructor)Tap_dealloc,
    .tp_getset = Tap_getset,
};

static Tap *new_tap(Recorder *rec, PyObject *inner, int kind) {
    if (!PyCallable_Check(inner)) {
        PyErr_SetString(PyExc_TypeError, "a tap needs a callable");
        return NULL;
    }
    Tap *t = PyObject_GC_New(Tap, &TapType);
    if (t == NULL) return NULL;
    t->vectorcall = Tap_vectorcall;
    Py_INCREF(inner);
    t->inner = inner;
    Py_INCREF(rec);
    t->rec = rec;
    t->kind = kind;
    t->path = 0;
    t->req_pos = -1;
    t->after = AFTER_NONE;
    t->set_frame = 0;
    t->hit = t->hit_pending = t->on_failure = t->on_near = NULL;
    PyObject_GC_Track(t);
    return t;
}

static PyObject *Recorder_lookup_tap(Recorder *self, PyObject *args) {
    PyObject *inner, *hit, *hit_pending;
    int path, set_frame;
    if (!PyArg_ParseTuple(args, "OiOOp:lookup_tap", &inner, &path, &hit, &hit_pending, &set_frame)) return NULL;
    Tap *t = new_tap(self, inner, TAP_LOOKUP);
    if (t == NULL) return NULL;
    t->path = path;
    t->set_frame = set_frame;
    Py_INCREF(hit);
    t->hit = hit;
    Py_INCREF(hit_pending);
    t->hit_pending = hit_pending;
    return (PyObject *)t;
}

static PyObject *Recorder_call_tap(Recorder *self, PyObject *args) {
    PyObject *inner;
    int path, req_pos, after;
    if (!PyArg_ParseTuple(args, "Oiii:call_tap", &inner, &path, &req_pos, &after)) return NULL;
    if (after < AFTER_NONE || after > AFTER_PINNED) return PyErr_Format(PyExc_ValueError, "bad 'after': %d", after);
    Tap *t = new_tap(self, inner, TAP_CALL);
    if (t == NULL) return NULL;
    t->path = path;
    t->req_pos = req_pos;
    t->after = after;
    return (PyObject *)t;
}

static PyObject *Recorder_load_tap(Recorder *self, PyObject *args) {
    PyObject *inner, *on_failure, *on_near;
    if (!PyArg_ParseTuple(args, "OOO:load_tap", &inner, &on_failure, &on_near)) return NULL;
    Tap *t = new_tap(self, inner, TAP_LOAD);
    if (t == NULL) return NULL;
    Py_INCREF(on_failure);
    t->on_failure = on_failure;
    Py_INCREF(on_near);
    t->on_near = on_near;
    return (PyObject *)t;
}

static PyObject *Recorder_evict_tap(Recorder *self, PyObject *inner) {
    return (PyObject *)new_tap(self, inner, TAP_EVICT);
}

static PyObject *Recorder_allocate_tap(Recorder *self, PyObject *inner) {
    return (PyObject *)new_tap(self, inner, TAP_ALLOCATE);
}

static PyMethodDef Recorder_methods[] = {
    {"removal", (PyCFunction)(void (*)(void))Recorder_removal, METH_VARARGS | METH_KEYWORDS,
     "Queue one removal batch; mark the promises it breaks now (path -1: from the tapped call)."},
    {"take_pending", (PyCFunction)Recorder_take_pending, METH_NOARGS,
     "(first_serial, hashes, counts, times, flags, reqs, batches or None, resets): the queue, emptied."},
    {"totals", (PyCFunction)Recorder_totals, METH_NOARGS, "(chunks, batches) removed so far, per reason code."},
    {"ages", (PyCFunction)Recorder_ages, METH_VARARGS, "Seconds since each chunk's slot was allocated."},
    {"lookup_tap", (PyCFunction)Recorder_lookup_tap, METH_VARARGS, "lookup_tap(inner, path, hit, hit_pending, set_frame)"},
    {"call_tap", (PyCFunction)Recorder_call_tap, METH_VARARGS, "call_tap(inner, path, req_pos, after)"},
    {"load_tap", (PyCFunction)Recorder_load_tap, METH_VARARGS, "load_tap(inner, on_failure, on_near)"},
    {"evict_tap", (PyCFunction)Recorder_evict_tap, METH_O, "evict_tap(inner)"},
    {"allocate_tap", (PyCFunction)Recorder_allocate_tap, METH_O, "allocate_tap(inner)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Recorder_getset[] = {
    {"next_serial", (getter)Recorder_next_serial, NULL, "Serial the next removal batch will get.", NULL},
    {"pending_count", (getter)Recorder_pending_count, NULL, "Queued removal records.", NULL},
    {"verdicts", (getter)Recorder_get_verdicts, NULL, "The verdict table.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef Recorder_members[] = {
    {"keep_batches", T_INT, offsetof(Recorder, keep_batches), 0, "Queue full records (keys, residency) for sinks."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvobs._speedups.Recorder",
    .tp_doc = "kvobs.recorder.PyRecorder in C (same behaviour).",
    .tp_basicsize = sizeof(Recorder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = Recorder_new,
    .tp_traverse = (traverseproc)Recorder_traverse,
    .tp_clear = (inquiry)Recorder_clear,
    .tp_dealloc = (destructor)Recorder_dealloc,
    .tp_methods = Recorder_methods,
    .tp_members = Recorder_members,
    .tp_getset = Recorder_getset,
};

/* ------------------------------------------------------------------------------------------ */

static PyObject *configure(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *verdict, *near_miss;
    if (!PyArg_ParseTuple(args, "O!O:configure", &PyType_Type, &verdict, &near_miss)) return NULL;
    Py_INCREF(verdict);
    Py_XSETREF(VerdictType, verdict);
    Py_INCREF(near_miss);
    Py_XSETREF(NearMissType, near_miss);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_VARARGS, "configure(Verdict, NearMiss): the public types verdicts are read as."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT, "kvobs._speedups", "C twin of kvobs.recorder and kvobs.verdicts.", -1, module_methods,
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__speedups(void) {
    INTERN(str_key, "key");
    INTERN(str_req_id, "req_id");
    INTERN(str_chunk_id, "chunk_id");
    INTERN(str_new_req_ids, "new_req_ids");
    INTERN(str_req_context, "req_context");
    INTERN(str_keys, "keys");
    INTERN(str_context, "context");
    INTERN(stage_lookup, "record.lookup");
    INTERN(stage_load, "record.load");
    INTERN(stage_removal, "record.removal");
    INTERN(stage_finish, "record.finish");
    INTERN(stage_schedule_end, "record.schedule_end");
    INTERN(stage_diagnosis, "diagnosis");
    if (PyType_Ready(&VCellType) < 0 || PyType_Ready(&WatchListType) < 0 || PyType_Ready(&ReqStateType) < 0 || PyType_Ready(&VerdictsType) < 0 || PyType_Ready(&RecorderType) < 0 ||
        PyType_Ready(&TapType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&speedups_module);
    if (m == NULL) return NULL;
    Py_INCREF(&VerdictsType);
    Py_INCREF(&RecorderType);
    Py_INCREF(&TapType);
    if (PyModule_AddObject(m, "Verdicts", (PyObject *)&VerdictsType) < 0 ||
        PyModule_AddObject(m, "Recorder", (PyObject *)&RecorderType) < 0 ||
        PyModule_AddObject(m, "Tap", (PyObject *)&TapType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
