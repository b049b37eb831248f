/* The plain step's phase timers in C: what probe/patches/ does on the common call, without
 * a Python frame. Optional: where this is not built, the patches' Python does the same.
 *
 * A plain step (see StepProbe.plain: host clock, no deep-dive sample, no DDP) times each phase
 * with two clock reads and one addition into the step's list of sums. Each Timer here does that
 * for one patch (the DataLoader's __next__, the model's call, torch.autograd.backward, the
 * optimizer's step hooks; Tensor.to only skips the calls it never times) and hands every other
 * call, unchanged, to the Python function it
 * stands in front of (`general`), which knows the rest (deep-dive, CUDA events, DDP, inferred
 * steps, evaluation). The probe's state the timers read lives in ProbeState, StepProbe's base
 * class, so Python and C read and write the same fields.
 *
 * Inferred steps (zero-code mode, the Trace API) end at the optimizer's step once its turn is
 * known, here too; and the Trace API's span and log_scalar of a float have their C short
 * paths in TraceState, the base class of tracer.Trace.
 *
 * Nothing here may fail the user's call: bookkeeping that fails is dropped (its error cleared),
 * and an exception from the wrapped call leaves exactly as it came.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>

/* Generated from layout.py by setup.py: the slots of a step's and a window's lists (H2D ..,
 * GC_NS ..), ProbeState's fields (STATE_FIELDS, STATE_MEMBERS), the fields of ClosedStep and
 * EndedWindow, and static asserts for the orders this file relies on. The module says them
 * back (LAYOUT) and step.py uses it only when they are its own. */
#include <stddef.h>
#include "_layout.h"

/* time.perf_counter_ns()'s clock (step.py checks the two agree before using this module). */
static inline long long
now_ns(void)
{
    struct timespec ts;
#ifdef __APPLE__
    return (long long)clock_gettime_nsec_np(CLOCK_UPTIME_RAW);
#else
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
#endif
}

/* Bookkeeping that failed costs its figure only: its error is dropped, and counted for the
 * probe to log at the end of the run (faults()). Never printed into the user's output. */
static Py_ssize_t bookkeeping_faults = 0;

static void
drop_bookkeeping_error(void)
{
    if (PyErr_Occurred()) {
        PyErr_Clear();
        bookkeeping_faults++;
    }
}

/* A fault in a step's start or end: handed to the probe's on_fault (which logs it and takes
 * TraceML out of the training), as StepProbe.enter and exit do from their `except`. */
static void
report_fault(PyObject *probe, const char *where)
{
    PyObject *type, *value, *traceback, *old_type, *old_value, *old_traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    PyErr_GetExcInfo(&old_type, &old_value, &old_traceback);
    PyErr_SetExcInfo(type, value, traceback);  /* sys.exc_info() for on_fault's log; steals */
    PyObject *result = PyObject_CallMethod(probe, "on_fault", "s", where);
    if (result == NULL)
        drop_bookkeeping_error();
    Py_XDECREF(result);
    PyErr_SetExcInfo(old_type, old_value, old_traceback);
}

/* ---- ProbeState: the fields a step's timers read and write -------------------------------- */

/* A step whose window has ended, as the training thread left it: plain numbers, so that a
 * step's end makes no Python object. The sender's thread makes its EndedWindow (take_ended).
 * A step ended in Python (its long path) is held as the EndedWindow it made (`ended`). */
typedef struct {
    PyObject *ended;            /* an EndedWindow made in Python, else NULL (and the rest holds it) */
    long long step, start_ns, end_ns, window_end_ns;
    long long host_rss_bytes;   /* -1: no reading */
    long long sums[STEP_INTS];  /* the step list's leading ints */
    PyObject *objects[STEP_OBJECTS];  /* the rest of its slots, owned (NULL once moved or cleared) */
    long long window[WINDOW_SLOTS];
} StepEntry;

typedef struct ProbeState {
    PyObject_HEAD
    STATE_FIELDS  /* layout.py's STATE_FIELDS: what Python reads and writes too */
    PyObject *closed;     /* the ClosedStep waiting for the next start to end its window */
    PyObject *unconfirmed;  /* inferred steps: the EndedWindow waiting for this step to prove one */
    /* The closed step and the unconfirmed one as numbers (has_*), when the compiled end made
     * them; step.py's _closed and _unconfirmed read them as the objects Python makes. */
    char has_closed, has_unconfirmed;
    StepEntry closed_entry, unconfirmed_entry;
    /* Steps whose window has ended, in order, until the sender takes them: ring[tail..head). */
    StepEntry *ring;
    Py_ssize_t ring_size, ring_head, ring_tail;
    Py_ssize_t steps_dropped;   /* ring full: dropped and counted (the sender adds them to its count) */
} ProbeState;

static void
entry_clear(StepEntry *entry)
{
    Py_CLEAR(entry->ended);
    for (int i = 0; i < STEP_OBJECTS; i++)
        Py_CLEAR(entry->objects[i]);
}

/* The entry's references have moved elsewhere (a copy of it holds them now). */
static void
entry_forget(StepEntry *entry)
{
    entry->ended = NULL;
    for (int i = 0; i < STEP_OBJECTS; i++)
        entry->objects[i] = NULL;
}

static int
entry_traverse(StepEntry *entry, visitproc visit, void *arg)
{
    Py_VISIT(entry->ended);
    for (int i = 0; i < STEP_OBJECTS; i++)
        Py_VISIT(entry->objects[i]);
    return 0;
}

static int
state_traverse(ProbeState *self, visitproc visit, void *arg)
{
    STATE_VISIT_OBJECTS
    Py_VISIT(self->closed);
    Py_VISIT(self->unconfirmed);
    int visited = entry_traverse(&self->closed_entry, visit, arg);
    if (visited == 0)
        visited = entry_traverse(&self->unconfirmed_entry, visit, arg);
    for (Py_ssize_t i = self->ring_tail; visited == 0 && i < self->ring_head; i++)
        visited = entry_traverse(&self->ring[i % self->ring_size], visit, arg);
    return visited;
}

static int
state_clear(ProbeState *self)
{
    STATE_CLEAR_OBJECTS
    Py_CLEAR(self->closed);
    Py_CLEAR(self->unconfirmed);
    entry_clear(&self->closed_entry);
    entry_clear(&self->unconfirmed_entry);
    self->has_closed = self->has_unconfirmed = 0;
    for (; self->ring_tail < self->ring_head; self->ring_tail++)
        entry_clear(&self->ring[self->ring_tail % self->ring_size]);
    return 0;
}

static void
state_dealloc(ProbeState *self)
{
    PyObject_GC_UnTrack(self);
    state_clear(self);
    PyMem_Free(self->ring);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef state_members[] = {
    STATE_MEMBERS
    {NULL},
};

/* What step.py hands over once (configure): the records a step's ends make, and the zeros a
 * new step's and window's lists start from. */
static PyObject *closed_step_type, *ended_window_type, *step_zeros, *window_zeros;
static PyObject *str_enter_long, *str_exit_long, *str_push, *str_latest_bytes, *str_buffer, *str_capacity,
    *str_append, *str_spans, *str_push_span;

static inline int
is_none(PyObject *value)
{
    return value == NULL || value == Py_None;
}

/* The sender's queue a record goes to while it has room (its buffer; a span's total, its
 * spans' queue), and how many its buffer (for a span, with that queue) and `waiting` hold
 * against its capacity. Looked up on each push and never kept, so nothing here holds a sender
 * its probe has let go of. NULL, no error set, when full or when the sender has no such queue:
 * its own push (which drops and counts) decides then. */
static PyObject *
queue_with_room(PyObject *sender, PyObject *queue_name, Py_ssize_t waiting, Py_ssize_t *buffered, Py_ssize_t *room)
{
    PyObject *buffer = PyObject_GetAttr(sender, str_buffer);
    PyObject *queue = buffer == NULL ? NULL : queue_name == str_buffer ? Py_NewRef(buffer)
        : PyObject_GetAttr(sender, queue_name);
    PyObject *capacity = queue ? PyObject_GetAttr(sender, str_capacity) : NULL;
    Py_ssize_t in_buffer = capacity ? PyObject_Size(buffer) : -1;
    Py_ssize_t in_queue = in_buffer < 0 ? -1 : queue == buffer ? 0 : PyObject_Size(queue);
    *room = in_queue < 0 ? -1 : PyLong_AsSsize_t(capacity);
    *buffered = in_buffer;
    Py_XDECREF(buffer);
    Py_XDECREF(capacity);
    if (*room < 0 || in_buffer + in_queue + waiting >= *room) {
        PyErr_Clear();
        Py_CLEAR(queue);
    }
    return queue;
}

/* sender.push(record), or with `queue_name` _spans sender.push_span(ended), without its Python
 * frame while the sender has room; else its own method. -1 with an error set when not pushed. */
static int
push_to(PyObject *sender, PyObject *queue_name, PyObject *method_name, PyObject *item)
{
    Py_ssize_t buffered, room;
    Py_INCREF(sender);  /* held: a lookup may run Python, which may let the probe's sender go */
    PyObject *queue = queue_with_room(sender, queue_name, 0, &buffered, &room);
    PyObject *pushed = queue ? PyObject_CallMethodOneArg(queue, str_append, item)
        : PyObject_CallMethodOneArg(sender, method_name, item);
    Py_XDECREF(queue);
    Py_DECREF(sender);
    if (pushed == NULL)
        return -1;
    Py_DECREF(pushed);
    return 0;
}

/* ---- the ring of ended steps: filled by the training thread, emptied by the sender's --------- */

static PyObject *ended_window_of(StepEntry *entry);

/* Queue a step whose window has ended (the entry's references move into the ring). The ring
 * and the sender's buffer together hold the sender's capacity, as the buffer alone does for
 * Python's path: beyond it the step is dropped and counted, never waited for. -1 with an error
 * set when the step cannot be queued. */
static int
publish(ProbeState *self, StepEntry *entry)
{
    Py_ssize_t buffered, capacity, waiting = self->ring_head - self->ring_tail;
    PyObject *sender = Py_NewRef(self->sender ? self->sender : Py_None);
    PyObject *queue = queue_with_room(sender, str_buffer, waiting, &buffered, &capacity);
    Py_XDECREF(queue);
    if (buffered < 0 || capacity < 0) {  /* a sender without a buffer of its own: its push decides, as in Python */
        PyObject *ended = ended_window_of(entry);
        entry_clear(entry);
        PyObject *pushed = ended ? PyObject_CallMethodOneArg(sender, str_push, ended) : NULL;
        Py_XDECREF(ended);
        Py_XDECREF(pushed);
        Py_DECREF(sender);
        return pushed ? 0 : -1;
    }
    Py_DECREF(sender);
    Py_ssize_t size = capacity > 0 ? capacity : 1;
    if (self->ring == NULL || self->ring_size != size) {
        if (self->ring_head != self->ring_tail) {  /* another sender while steps wait: the old ones go */
            self->steps_dropped += self->ring_head - self->ring_tail;
            for (; self->ring_tail < self->ring_head; self->ring_tail++)
                entry_clear(&self->ring[self->ring_tail % self->ring_size]);
        }
        PyMem_Free(self->ring);
        self->ring_size = size;
        self->ring_head = self->ring_tail = 0;
        /* calloc: pages are counted in RSS only once used, and the ring restarts at its first
         * entry each time the sender empties it */
        self->ring = PyMem_Calloc(self->ring_size, sizeof(StepEntry));
        if (self->ring == NULL) {
            self->ring_size = 0;
            entry_clear(entry);
            PyErr_NoMemory();
            return -1;
        }
    }
    if (self->ring_head - self->ring_tail + buffered >= capacity) {
        entry_clear(entry);
        self->steps_dropped++;
        return 0;
    }
    self->ring[self->ring_head % self->ring_size] = *entry;
    self->ring_head++;
    entry_forget(entry);  /* moved, not released */
    return 0;
}

/* Queue an EndedWindow made in Python (a step's long path), in its place among the others. */
static int
publish_object(ProbeState *self, PyObject *ended)
{
    StepEntry entry = {.ended = Py_NewRef(ended)};
    return publish(self, &entry);
}

static int
long_of(PyObject *value, long long *out)
{
    *out = PyLong_AsLongLong(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* The first `ints` items of a step's or window's list of `slots`, as numbers. -1 with an error
 * set when the list is not one. */
static int
copy_ints(PyObject *list, Py_ssize_t slots, Py_ssize_t ints, long long *out)
{
    if (list == NULL || !PyList_CheckExact(list) || PyList_GET_SIZE(list) != slots) {
        PyErr_SetString(PyExc_TypeError, "traceml: not a step's (or window's) list");
        return -1;
    }
    for (Py_ssize_t i = 0; i < ints; i++)
        if (long_of(PyList_GET_ITEM(list, i), &out[i]) < 0)
            return -1;
    return 0;
}

/* The step ending now, as numbers: its index, bounds, host RSS and its list of sums. */
static int
close_entry(ProbeState *self, long long now, StepEntry *entry)
{
    PyObject *sums = self->sums;
    if (copy_ints(sums, STEP_SLOTS, STEP_INTS, entry->sums) < 0)
        return -1;
    entry->host_rss_bytes = -1;
    if (!is_none(self->host_rss)) {
        PyObject *rss = PyObject_GetAttr(self->host_rss, str_latest_bytes);
        int failed = rss == NULL || (!is_none(rss) && long_of(rss, &entry->host_rss_bytes) < 0);
        Py_XDECREF(rss);
        if (failed)
            return -1;
    }
    for (int i = 0; i < STEP_OBJECTS; i++)
        entry->objects[i] = Py_NewRef(PyList_GET_ITEM(sums, STEP_INTS + i));
    entry->ended = NULL;
    entry->step = self->step_index;
    entry->start_ns = self->step_start_ns;
    entry->end_ns = now;
    return 0;
}

/* The closed step's window ends now: its figures from the window's list. */
static int
end_window(ProbeState *self, StepEntry *entry, long long now)
{
    if (copy_ints(self->window, WINDOW_SLOTS, WINDOW_SLOTS, entry->window) < 0)
        return -1;
    entry->window_end_ns = now;
    return 0;
}

/* The next step's (or window's) list: the one held, zeroed in place when nothing else holds it
 * (its figures were copied out), else a new one (the step before went out with it). */
static int
fresh_list(PyObject **slot, PyObject *zeros)
{
    PyObject *list = *slot;
    Py_ssize_t size = PyTuple_GET_SIZE(zeros);
    if (list == NULL || !PyList_CheckExact(list) || Py_REFCNT(list) != 1 || PyList_GET_SIZE(list) != size) {
        PyObject *made = PySequence_List(zeros);
        if (made == NULL)
            return -1;
        Py_XSETREF(*slot, made);
        return 0;
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        PyObject *old = PyList_GET_ITEM(list, i), *zero = PyTuple_GET_ITEM(zeros, i);
        if (old != zero) {
            PyList_SET_ITEM(list, i, Py_NewRef(zero));
            Py_DECREF(old);
        }
    }
    return 0;
}

/* copy_ints the other way: a new list of `slots` whose first `ints` items are these numbers
 * (the rest left for the caller to set). NULL with an error set when it cannot be made. */
static PyObject *
list_of_ints(const long long *values, Py_ssize_t ints, Py_ssize_t slots)
{
    PyObject *list = PyList_New(slots);
    for (Py_ssize_t i = 0; list != NULL && i < ints; i++) {
        PyObject *value = PyLong_FromLongLong(values[i]);
        if (value == NULL)
            Py_CLEAR(list);  /* a list whose unset items are NULL is released as such */
        else
            PyList_SET_ITEM(list, i, value);
    }
    return list;
}

/* type(*fields), by position (layout.py's field order): the fields left NULL are None. */
static PyObject *
made_by_position(PyObject *type, PyObject **fields, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++)
        if (fields[i] == NULL)
            fields[i] = Py_None;
    return PyObject_Vectorcall(type, fields, count, NULL);
}

/* What Python sees of a closed step: step.py's ClosedStep, its list of sums made again. A
 * plain step has no device figures or events (None) and no deep-dive sample. */
static PyObject *
closed_step_of(StepEntry *entry)
{
    PyObject *sums = list_of_ints(entry->sums, STEP_INTS, STEP_SLOTS), *closed = NULL;
    PyObject *step = PyLong_FromLongLong(entry->step), *start = PyLong_FromLongLong(entry->start_ns);
    PyObject *end = PyLong_FromLongLong(entry->end_ns);
    PyObject *rss = entry->host_rss_bytes < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(entry->host_rss_bytes);
    if (sums == NULL || step == NULL || start == NULL || end == NULL || rss == NULL)
        goto done;
    for (int i = 0; i < STEP_OBJECTS; i++)
        PyList_SET_ITEM(sums, STEP_INTS + i, Py_NewRef(entry->objects[i] ? entry->objects[i] : Py_None));
    PyObject *fields[CLOSED_STEP_FIELD_COUNT] = {
        [CLOSED_STEP] = step, [CLOSED_START_NS] = start, [CLOSED_END_NS] = end, [CLOSED_SUMS] = sums,
        [CLOSED_HOST_RSS_BYTES] = rss, [CLOSED_INSTRUMENTED] = Py_False};
    closed = made_by_position(closed_step_type, fields, CLOSED_STEP_FIELD_COUNT);
done:
    Py_XDECREF(sums);
    Py_XDECREF(step);
    Py_XDECREF(start);
    Py_XDECREF(end);
    Py_XDECREF(rss);
    return closed;
}

/* An EndedWindow of these parts (no device event: the CPU's clock ended the window). */
static PyObject *
ended_window_made(PyObject *closed, PyObject *window_end_ns, PyObject *window)
{
    PyObject *fields[ENDED_WINDOW_FIELD_COUNT] = {
        [ENDED_CLOSED] = closed, [ENDED_WINDOW_END_NS] = window_end_ns, [ENDED_WINDOW] = window};
    return made_by_position(ended_window_type, fields, ENDED_WINDOW_FIELD_COUNT);
}

/* What Python sees of a step whose window has ended: step.py's EndedWindow. */
static PyObject *
ended_window_of(StepEntry *entry)
{
    if (entry->ended != NULL)
        return Py_NewRef(entry->ended);
    PyObject *closed = closed_step_of(entry), *window = list_of_ints(entry->window, WINDOW_SLOTS, WINDOW_SLOTS);
    PyObject *end = PyLong_FromLongLong(entry->window_end_ns), *ended = NULL;
    if (closed != NULL && window != NULL && end != NULL)
        ended = ended_window_made(closed, end, window);
    Py_XDECREF(closed);
    Py_XDECREF(window);
    Py_XDECREF(end);
    return ended;
}

/* The sender's thread: the steps ended since it last asked, in order, as EndedWindows (their
 * StepRecords are made in one place, StepRecords.record_from), and how many a full ring dropped
 * meanwhile. A step that cannot be made is dropped and counted. */
static PyObject *
state_take_ended(ProbeState *self, PyObject *unused)
{
    PyObject *steps = PyList_New(0);
    if (steps == NULL)
        return NULL;
    while (self->ring_tail < self->ring_head) {
        /* Out of the ring before making its object, which may run Python (the garbage
         * collector's callbacks) while the training thread queues more, or moves the ring. */
        StepEntry entry = self->ring[self->ring_tail % self->ring_size];
        self->ring_tail++;
        PyObject *step = ended_window_of(&entry);
        if (step == NULL || PyList_Append(steps, step) < 0) {
            drop_bookkeeping_error();
            self->steps_dropped++;
        }
        Py_XDECREF(step);
        entry_clear(&entry);
    }
    /* Emptied: the next steps go to its first entries again, a few KiB that stay in the caches
     * and in the process's RSS from the start, rather than on round all 2 MiB of it: each
     * step's entry in memory untouched for seconds, and calloc's pages counted in RSS only as
     * the ring first went round them, which the memory rules read as the user's creep. */
    self->ring_tail = self->ring_head = 0;
    /* Taken before the tuple is made, which may run Python: a drop counted then stays for the
     * next call. */
    Py_ssize_t dropped = self->steps_dropped;
    self->steps_dropped = 0;
    PyObject *drained = Py_BuildValue("(Nn)", steps, dropped);
    if (drained == NULL)
        self->steps_dropped += dropped;
    return drained;
}

static PyObject *
state_publish_ended(ProbeState *self, PyObject *ended)
{
    if (publish_object(self, ended) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* step.py's _closed and _unconfirmed: the object Python made, or the one the compiled end
 * left as numbers, made into that object now (Python's long paths and the run's end). */
static PyObject *
get_held(ProbeState *self, void *which)
{
    int unconfirmed = which != NULL;
    if (unconfirmed ? self->has_unconfirmed : self->has_closed) {
        StepEntry *entry = unconfirmed ? &self->unconfirmed_entry : &self->closed_entry;
        PyObject *made = unconfirmed ? ended_window_of(entry) : closed_step_of(entry);
        if (made == NULL)
            return NULL;
        entry_clear(entry);
        if (unconfirmed) {
            self->has_unconfirmed = 0;
            Py_XSETREF(self->unconfirmed, made);
        } else {
            self->has_closed = 0;
            Py_XSETREF(self->closed, made);
        }
    }
    PyObject *held = unconfirmed ? self->unconfirmed : self->closed;
    return Py_NewRef(held ? held : Py_None);
}

static int
set_held(ProbeState *self, PyObject *value, void *which)
{
    int unconfirmed = which != NULL;
    entry_clear(unconfirmed ? &self->unconfirmed_entry : &self->closed_entry);
    if (unconfirmed)
        self->has_unconfirmed = 0;
    else
        self->has_closed = 0;
    Py_XSETREF(*(unconfirmed ? &self->unconfirmed : &self->closed), Py_NewRef(value ? value : Py_None));
    return 0;
}

static PyGetSetDef state_getset[] = {
    {"_closed", (getter)get_held, (setter)set_held, "The closed step waiting for the next start (step.py).", NULL},
    {"_unconfirmed", (getter)get_held, (setter)set_held, "Inferred steps: the step waiting on this one.",
     (void *)1},
    {NULL},
};

/* `with trace_step(model):` entering, for the common step (host clock, one level of trace_step,
 * no set-up to fold in, no work due): the step before ends its window now; everything else is
 * StepProbe.enter's, in Python. Same work as StepProbe.enter for that step, with the
 * ended step queued as numbers and the lists zeroed in place: no object made. */
static PyObject *
state_enter(ProbeState *self, PyObject *unused)
{
    if (self->in_step || !is_none(self->timeline) || self->setup_started_ns
            || (double)self->step_index >= self->due_step || closed_step_type == NULL)
        return PyObject_CallMethodNoArgs((PyObject *)self, str_enter_long);
    long long now = now_ns();
    if (self->has_closed) {
        self->has_closed = 0;
        StepEntry *entry = &self->closed_entry;
        if (end_window(self, entry, now) < 0) {
            entry_clear(entry);
            goto fail;
        }
        if (self->auto_steps) {  /* sent once this step proves to be one (see exit) */
            entry_clear(&self->unconfirmed_entry);
            self->unconfirmed_entry = *entry;
            entry_forget(entry);  /* moved */
            self->has_unconfirmed = 1;
            Py_XSETREF(self->unconfirmed, Py_NewRef(Py_None));
        } else if (publish(self, entry) < 0) {
            goto fail;
        }
    } else if (!is_none(self->closed)) {  /* closed by Python's long path: an object */
        PyObject *now_object = PyLong_FromLongLong(now);
        if (now_object == NULL)
            goto fail;
        PyObject *ending = ended_window_made(self->closed, now_object, self->window ? self->window : Py_None);
        Py_DECREF(now_object);
        if (ending == NULL)
            goto fail;
        Py_SETREF(self->closed, Py_NewRef(Py_None));
        if (self->auto_steps) {
            entry_clear(&self->unconfirmed_entry);
            self->has_unconfirmed = 0;
            Py_XSETREF(self->unconfirmed, ending);
        } else {
            int published = publish_object(self, ending);
            Py_DECREF(ending);
            if (published < 0)
                goto fail;
        }
    }
    if (fresh_list(&self->window, window_zeros) < 0 || fresh_list(&self->sums, step_zeros) < 0)
        goto fail;
    self->step_start_ns = now;
    self->in_step = 1;
    self->plain = !self->layers_active && !self->comm_timed;
    return Py_NewRef(self);
fail:  /* the training comes first: a fault here costs telemetry only */
    report_fault((PyObject *)self, "trace_step enter");
    return Py_NewRef(self);
}

/* The common step's end (no exception, a plain step, one level): closes it, as numbers, its
 * window still open until the next start. Anything else is StepProbe.exit's. */
static PyObject *
state_exit(ProbeState *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long now = now_ns();
    PyObject *failed = nargs >= 2 ? args[1] : Py_None;
    if (!is_none(failed) || !self->plain || self->in_step > 1 || closed_step_type == NULL) {
        PyObject *keywords = Py_BuildValue("{sOsL}", "failed", failed, "now", now);
        if (keywords == NULL)
            return NULL;
        PyObject *no_args = PyTuple_New(0);
        PyObject *method = no_args ? PyObject_GetAttr((PyObject *)self, str_exit_long) : NULL;
        PyObject *result = method ? PyObject_Call(method, no_args, keywords) : NULL;
        Py_XDECREF(method);
        Py_XDECREF(no_args);
        Py_DECREF(keywords);
        return result;
    }
    /* inferred steps: this one proved a step, the one before it is sent */
    int published = 0;
    if (self->has_unconfirmed) {
        self->has_unconfirmed = 0;
        published = publish(self, &self->unconfirmed_entry);
    } else if (!is_none(self->unconfirmed)) {
        published = publish_object(self, self->unconfirmed);
        Py_SETREF(self->unconfirmed, Py_NewRef(Py_None));
    }
    self->in_step = 0;
    self->plain = 0;
    self->open_phase = NO_PHASE;
    entry_clear(&self->closed_entry);
    if (published < 0 || close_entry(self, now, &self->closed_entry) < 0) {
        entry_clear(&self->closed_entry);
        report_fault((PyObject *)self, "trace_step exit");
        Py_RETURN_NONE;
    }
    self->has_closed = 1;
    Py_XSETREF(self->closed, Py_NewRef(Py_None));
    self->step_index += 1;
    Py_RETURN_NONE;
}

static PyMethodDef state_methods[] = {
    {"__enter__", (PyCFunction)state_enter, METH_NOARGS, "Start a step (see step.py)."},
    {"__exit__", (PyCFunction)(void (*)(void))state_exit, METH_FASTCALL, "End a step (see step.py)."},
    {"take_ended", (PyCFunction)state_take_ended, METH_NOARGS,
     "take_ended(): ([EndedWindows of the steps ended since the last call], dropped)."},
    {"publish_ended", (PyCFunction)state_publish_ended, METH_O,
     "Queue an EndedWindow made in Python among the steps take_ended returns."},
    {NULL},
};

static PyTypeObject ProbeStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traceml.probe._fastpath.ProbeState",
    .tp_doc = "The step state the phase timers share with StepProbe (its base class).",
    .tp_basicsize = sizeof(ProbeState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)state_traverse,
    .tp_clear = (inquiry)state_clear,
    .tp_dealloc = (destructor)state_dealloc,
    .tp_members = state_members,
    .tp_methods = state_methods,
    .tp_getset = state_getset,
};

/* list[index] += delta, for a list of ints; -1 with an error set when it is not one. */
static int
add_ns(PyObject *list, Py_ssize_t index, long long delta)
{
    if (list == NULL || !PyList_CheckExact(list) || index >= PyList_GET_SIZE(list)) {
        PyErr_SetString(PyExc_TypeError, "traceml: not a list of sums");
        return -1;
    }
    PyObject *old = PyList_GET_ITEM(list, index);
    long long value = PyLong_AsLongLong(old);
    if (value == -1 && PyErr_Occurred())
        return -1;
    PyObject *updated = PyLong_FromLongLong(value + delta);
    if (updated == NULL)
        return -1;
    PyList_SET_ITEM(list, index, updated);
    Py_DECREF(old);
    return 0;
}

/* Call a probe method for its effect (backward_returned, optimizer_stepped, ...). */
static int
call_probe(PyObject *probe, PyObject *name, PyObject *arg)
{
    PyObject *args[2] = {probe, arg};
    PyObject *result = PyObject_VectorcallMethod(name, args, (arg ? 2 : 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

/* ---- Timer: one patch's fast path ---------------------------------------------------------- */

enum { NEXT, MODEL_CALL, BACKWARD_CALL, OPTIMIZER_BEFORE, OPTIMIZER_AFTER, TENSOR_TO };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *original;      /* what the patch replaced */
    PyObject *general;       /* the Python patch: every call off the fast path */
    PyObject *probe;         /* a ProbeState (MODEL_CALL: None, the model's own is found per call) */
    PyObject *models;        /* MODEL_CALL: ModelCalls._models, id(model) -> _TracedModel */
    PyObject *grad_enabled;  /* torch.is_grad_enabled */
    PyObject *tensor_type;   /* torch.Tensor */
    PyObject *batch_size;    /* patches.tokens.batch_size(args, kwargs, tensor_type) */
} Timer;

static PyObject *str_probe, *str_token_inputs, *str_shape, *str_enter, *str_note_failure,
    *str_backward_returned, *str_optimizer_stepped, *str_name, *str_qualname, *str_doc, *str_module;

static inline ProbeState *
state_of(PyObject *probe)
{
    return PyObject_TypeCheck(probe, &ProbeStateType) ? (ProbeState *)probe : NULL;
}

/* The exception leaving a phase: tell the probe (note_failure), keeping the exception. */
static void
note_failure(PyObject *probe, int phase)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *index = PyLong_FromLong(phase);
    if (index == NULL || call_probe(probe, str_note_failure, index) < 0)
        drop_bookkeeping_error();
    Py_XDECREF(index);
    PyErr_Restore(type, value, traceback);
}

/* The phase opened by a fast path has ended: add its time, unless a nested patch closed it. */
static void
close_phase(ProbeState *state, PyObject *sums, int phase, long long start_ns)
{
    if (state->open_phase != phase)
        return;
    long long elapsed_ns = now_ns() - start_ns;
    state->open_phase = NO_PHASE;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (add_ns(sums, phase, elapsed_ns) < 0)
        drop_bookkeeping_error();
    PyErr_Restore(type, value, traceback);
}

/* DataLoader __next__ (args[0]: the iterator) on the training thread: its wait is the step's
 * input wait, or between steps the training's input wait (gradients on) or evaluation's
 * (gradients off). Another thread's call (a prefetching thread's) is not that wait: the patch's
 * Python measures it as that thread's cost of a batch. */
static PyObject *
time_next(Timer *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    ProbeState *state = (ProbeState *)self->probe;
    if (PyThread_get_thread_ident() != state->training_thread)
        return PyObject_Vectorcall(self->general, args, nargsf, kwnames);
    long long start_ns = now_ns();
    state->fetching++;
    PyObject *result = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    state->fetching--;
    long long elapsed_ns = now_ns() - start_ns;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);  /* StopIteration ends each epoch: it goes on as it came */
    int failed = 0;
    if (state->in_step) {
        failed = add_ns(state->sums, INPUT_WAIT_NS, elapsed_ns);
    } else if (!state->in_evaluation) {
        PyObject *enabled = PyObject_CallNoArgs(self->grad_enabled);
        if (enabled == NULL) {
            failed = -1;
        } else {
            failed = add_ns(state->window, enabled == Py_True ? INPUT_WAIT_GAP_NS : EVAL_NS, elapsed_ns);
            Py_DECREF(enabled);
        }
    }
    if (failed)
        drop_bookkeeping_error();
    PyErr_Restore(type, value, traceback);
    return result;
}

/* The samples of model(inputs, ...): inputs' first dimension, else patches.tokens.batch_size. */
static long long
samples_of(Timer *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    /* A type check, not isinstance: torch.Tensor's metaclass makes isinstance a Python-level
     * lookup. Whatever only claims to be a tensor goes to _batch_size, which asks isinstance. */
    int is_tensor = nargs >= 2 && PyType_Check(self->tensor_type)
        && PyObject_TypeCheck(args[1], (PyTypeObject *)self->tensor_type);
    if (is_tensor) {
        PyObject *shape = PyObject_GetAttr(args[1], str_shape);
        if (shape == NULL || !PyTuple_Check(shape)) {
            Py_XDECREF(shape);
            return -1;
        }
        long long samples = PyTuple_GET_SIZE(shape) ? PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 0)) : 1;
        Py_DECREF(shape);
        return samples;
    }
    PyObject *positional = PyTuple_New(nargs - 1);
    PyObject *keywords = PyDict_New();
    if (positional == NULL || keywords == NULL)
        goto fail;
    for (Py_ssize_t i = 1; i < nargs; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(positional, i - 1, args[i]);
    }
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nkw; i++)
        if (PyDict_SetItem(keywords, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0)
            goto fail;
    PyObject *counted = PyObject_CallFunctionObjArgs(self->batch_size, positional, keywords, self->tensor_type, NULL);
    Py_DECREF(positional);
    Py_DECREF(keywords);
    if (counted == NULL)
        return -1;
    long long samples = PyLong_AsLongLong(counted);
    Py_DECREF(counted);
    return samples;
fail:
    Py_XDECREF(positional);
    Py_XDECREF(keywords);
    return -1;
}

/* The model's call (args[0]: the module): the outermost call of a traced model in a plain
 * step is forward. torch.compile's tracing never gets here (the patches' shim calls the original). */
static PyObject *
time_model_call(Timer *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1)
        return PyObject_Vectorcall(self->general, args, nargsf, kwnames);
    PyObject *key = PyLong_FromVoidPtr(args[0]);
    if (key == NULL) {  /* no memory for the key: Python's patch has the call */
        drop_bookkeeping_error();
        return PyObject_Vectorcall(self->general, args, nargsf, kwnames);
    }
    /* Owned, not borrowed: the probe's __enter__ below may take TraceML out on a fault, which
     * pops the model from `models` and would free its entry under us. */
    PyObject *traced = PyDict_GetItemWithError(self->models, key);
    Py_DECREF(key);
    if (traced == NULL) {
        if (PyErr_Occurred())
            PyErr_Clear();
        return PyObject_Vectorcall(self->original, args, nargsf, kwnames);  /* not a traced model */
    }
    Py_INCREF(traced);
    PyObject *probe = PyObject_GetAttr(traced, str_probe);
    ProbeState *state = probe ? state_of(probe) : NULL;
    if (state == NULL) {
        PyErr_Clear();
        Py_XDECREF(probe);
        Py_DECREF(traced);
        return PyObject_Vectorcall(self->general, args, nargsf, kwnames);
    }
    if (!state->in_step && state->auto_steps) {
        /* Steps inferred: the model's first call with gradients opens one. */
        PyObject *enabled = PyObject_CallNoArgs(self->grad_enabled);
        if (enabled == Py_True && call_probe(probe, str_enter, NULL) < 0)
            drop_bookkeeping_error();
        if (enabled == NULL)
            drop_bookkeeping_error();
        Py_XDECREF(enabled);
    }
    PyObject *token_inputs = PyObject_GetAttr(traced, str_token_inputs);
    Py_DECREF(traced);
    int common = token_inputs == Py_False && state->plain && state->open_phase == NO_PHASE;
    Py_XDECREF(token_inputs);
    if (!common) {
        PyErr_Clear();
        Py_DECREF(probe);
        return PyObject_Vectorcall(self->general, args, nargsf, kwnames);
    }
    PyObject *sums = state->sums;
    Py_XINCREF(sums);
    long long samples = samples_of(self, args, nargs, kwnames);
    if (samples < 0 || add_ns(sums, FORWARD_CALLS, 1) < 0 || add_ns(sums, SAMPLES, samples) < 0)
        drop_bookkeeping_error();
    state->open_phase = FORWARD;
    long long start_ns = now_ns();
    PyObject *result = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (result == NULL)
        note_failure(probe, FORWARD);
    close_phase(state, sums, FORWARD, start_ns);
    Py_XDECREF(sums);
    Py_DECREF(probe);
    return result;
}

/* torch.autograd.backward: a plain step's backward. */
static PyObject *
time_backward(Timer *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    ProbeState *state = (ProbeState *)self->probe;
    if (!state->in_step && !state->auto_steps)  /* outside the steps: nothing to time, no frame */
        return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (!state->plain || state->open_phase != NO_PHASE)
        return PyObject_Vectorcall(self->general, args, nargsf, kwnames);
    PyObject *sums = state->sums;
    Py_XINCREF(sums);
    state->open_phase = BACKWARD;
    long long start_ns = now_ns();
    PyObject *result = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (result == NULL)
        note_failure(self->probe, BACKWARD);
    close_phase(state, sums, BACKWARD, start_ns);
    Py_XDECREF(sums);
    /* backward_returned has nothing to do once an optimizer ends the steps */
    if (result != NULL && state->auto_steps && !state->optimizer_ends_steps
            && call_probe(self->probe, str_backward_returned, NULL) < 0) {
        Py_DECREF(result);
        return NULL;  /* as the Python patch: backward_returned guards itself */
    }
    return result;
}

/* The optimizer's step pre-hook (optimizer, args, kwargs): a plain step's update, no closure. */
static PyObject *
before_optimizer_step(Timer *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    ProbeState *state = (ProbeState *)self->probe;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs == 3 && kwnames == NULL && state->plain && state->open_phase == NO_PHASE
            && PyTuple_Check(args[1]) && PyTuple_GET_SIZE(args[1]) == 1
            && PyDict_Check(args[2]) && PyDict_GET_SIZE(args[2]) == 0) {
        state->open_phase = OPTIMIZER;
        state->optimizer_timed = (Py_ssize_t)args[0];  /* id(optimizer) */
        state->optimizer_start_ns = now_ns();
        Py_RETURN_NONE;  /* None keeps step()'s arguments as they are */
    }
    if (!state->in_step && !state->auto_steps)  /* outside the steps: nothing to time, no frame */
        Py_RETURN_NONE;
    return PyObject_Vectorcall(self->general, args, nargsf, kwnames);
}

/* Inferred steps: StepProbe.optimizer_stepped, whose common call (the settled optimizer's: the
 * one that ends the steps, its turn known, no model awaited) ends the step here; any other goes
 * to Python. */
static PyObject *
optimizer_stepped(ProbeState *state, PyObject *optimizer)
{
    int settled = !is_none(state->settled_optimizer) && PyLong_CheckExact(state->settled_optimizer)
        && PyLong_AsVoidPtr(state->settled_optimizer) == (void *)optimizer;
    if (PyErr_Occurred()) {
        PyErr_Clear();
        settled = 0;
    }
    if (!settled) {
        if (call_probe((PyObject *)state, str_optimizer_stepped, optimizer) < 0)
            return NULL;  /* as the Python hook: optimizer_stepped guards itself */
        Py_RETURN_NONE;
    }
    if (state->in_step && state->open_phase == NO_PHASE)
        return state_exit(state, NULL, 0);  /* None, as exit guards itself */
    Py_RETURN_NONE;
}

/* The optimizer's step post-hook: ends the update the pre-hook timed. */
static PyObject *
after_optimizer_step(Timer *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    ProbeState *state = (ProbeState *)self->probe;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs >= 1 && state->plain && state->open_phase == OPTIMIZER
            && state->optimizer_timed == (Py_ssize_t)args[0]) {
        long long elapsed_ns = now_ns() - state->optimizer_start_ns;
        state->optimizer_timed = 0;
        state->open_phase = NO_PHASE;
        if (add_ns(state->sums, OPTIMIZER, elapsed_ns) < 0)
            drop_bookkeeping_error();
        if (state->auto_steps)
            return optimizer_stepped(state, args[0]);
        Py_RETURN_NONE;
    }
    /* An update not being timed, no steps to infer: after_step has nothing to do, no frame. */
    if (nargs >= 1 && !state->auto_steps && state->optimizer_timed != (Py_ssize_t)args[0])
        Py_RETURN_NONE;
    return PyObject_Vectorcall(self->general, args, nargsf, kwnames);
}

/* Tensor.to (args[0]: the tensor): a copy to the device is timed only at the top of a step
 * (the patches' Python does that); every other call, evaluation's and data prep's included, goes
 * straight to the original, so idle code pays no Python frame. */
static PyObject *
time_tensor_to(Timer *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    ProbeState *state = (ProbeState *)self->probe;
    int untimed = state->in_step ? state->open_phase != NO_PHASE : !state->auto_steps;
    return PyObject_Vectorcall(untimed ? self->original : self->general, args, nargsf, kwnames);
}

static vectorcallfunc timer_kinds[] = {
    (vectorcallfunc)time_next, (vectorcallfunc)time_model_call, (vectorcallfunc)time_backward,
    (vectorcallfunc)before_optimizer_step, (vectorcallfunc)after_optimizer_step, (vectorcallfunc)time_tensor_to,
};

static PyObject *
timer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"kind", "original", "general", "probe", "models", "grad_enabled", "tensor_type",
                               "batch_size", NULL};
    int kind;
    PyObject *original, *general, *probe = Py_None, *models = Py_None, *grad_enabled = Py_None,
             *tensor_type = Py_None, *batch_size = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOO|OOOOO", keywords, &kind, &original, &general, &probe,
                                     &models, &grad_enabled, &tensor_type, &batch_size))
        return NULL;
    if (kind < NEXT || kind > TENSOR_TO) {
        PyErr_SetString(PyExc_ValueError, "traceml: no such timer");
        return NULL;
    }
    if (kind == MODEL_CALL ? !PyDict_Check(models) : state_of(probe) == NULL) {
        PyErr_SetString(PyExc_TypeError, "traceml: a timer needs its probe (or, for the model, the models)");
        return NULL;
    }
    Timer *self = (Timer *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = timer_kinds[kind];
    PyObject **fields[] = {&self->original, &self->general, &self->probe, &self->models, &self->grad_enabled,
                           &self->tensor_type, &self->batch_size};
    PyObject *values[] = {original, general, probe, models, grad_enabled, tensor_type, batch_size};
    for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
        Py_INCREF(values[i]);
        *fields[i] = values[i];
    }
    return (PyObject *)self;
}

static int
timer_traverse(Timer *self, visitproc visit, void *arg)
{
    Py_VISIT(self->original);
    Py_VISIT(self->general);
    Py_VISIT(self->probe);
    Py_VISIT(self->models);
    Py_VISIT(self->grad_enabled);
    Py_VISIT(self->tensor_type);
    Py_VISIT(self->batch_size);
    return 0;
}

static int
timer_clear(Timer *self)
{
    Py_CLEAR(self->original);
    Py_CLEAR(self->general);
    Py_CLEAR(self->probe);
    Py_CLEAR(self->models);
    Py_CLEAR(self->grad_enabled);
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->batch_size);
    return 0;
}

static void
timer_dealloc(Timer *self)
{
    PyObject_GC_UnTrack(self);
    timer_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Set on a class (DataLoader's iterator) it binds like a function: iterator.__next__(). */
static PyObject *
timer_get(PyObject *self, PyObject *instance, PyObject *owner)
{
    if (is_none(instance)) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, instance);
}

/* What introspection of the patched attribute finds: the original's name and docs. */
static PyObject *
timer_original_attribute(Timer *self, void *name)
{
    if (self->original == NULL)
        Py_RETURN_NONE;
    return PyObject_GetAttr(self->original, *(PyObject **)name);
}

static PyObject *
timer_wrapped(Timer *self, void *unused)
{
    PyObject *original = self->original ? self->original : Py_None;
    Py_INCREF(original);
    return original;
}

static PyGetSetDef timer_getset[] = {
    {"__wrapped__", (getter)timer_wrapped, NULL, "What the patch replaced.", NULL},
    {"__name__", (getter)timer_original_attribute, NULL, NULL, &str_name},
    {"__qualname__", (getter)timer_original_attribute, NULL, NULL, &str_qualname},
    {"__doc__", (getter)timer_original_attribute, NULL, NULL, &str_doc},
    {"__module__", (getter)timer_original_attribute, NULL, NULL, &str_module},
    {NULL},
};

static PyTypeObject TimerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traceml.probe._fastpath.Timer",
    .tp_basicsize = sizeof(Timer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(Timer, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = timer_new,
    .tp_traverse = (traverseproc)timer_traverse,
    .tp_clear = (inquiry)timer_clear,
    .tp_dealloc = (destructor)timer_dealloc,
    .tp_descr_get = timer_get,
    .tp_getset = timer_getset,
};

/* ---- TraceState: the Trace API's span and log_scalar ------------------------------------ */

static PyObject *scalar_record_type, *general_log_scalar;

typedef struct {
    PyObject_HEAD
    PyObject *probe;  /* the StepProbe while a region is traced, else None */
} TraceState;

typedef struct {
    PyObject_HEAD
    PyObject *tracer;  /* the TraceState whose probe the span's time goes to */
    PyObject *name;
    long long start_ns;
} Span;

static PyTypeObject SpanType;

/* tracer.span(name): one call of a user span. */
static PyObject *
trace_span(TraceState *self, PyObject *name)
{
    Span *span = PyObject_GC_New(Span, &SpanType);
    if (span == NULL)
        return NULL;
    span->tracer = Py_NewRef(self);
    span->name = Py_NewRef(name);
    span->start_ns = 0;
    PyObject_GC_Track(span);
    return (PyObject *)span;
}

/* The step a span or scalar belongs to: the step in flight, else the one whose window (it
 * runs to the next step's start) this gap belongs to. */
static inline long long
current_step(ProbeState *state)
{
    return state->in_step ? state->step_index : (state->step_index > 0 ? state->step_index - 1 : 0);
}

/* A user span's calls in one step, summed where they end (step.py's SpanTotal, in C). */
typedef struct {
    PyObject_HEAD
    long long step, start_ns, total_ns, calls;  /* start_ns: the first call's */
} SpanTotal;

static PyMemberDef span_total_members[] = {
    {"step", T_LONGLONG, offsetof(SpanTotal, step), READONLY, NULL},
    {"start_ns", T_LONGLONG, offsetof(SpanTotal, start_ns), READONLY, NULL},
    {"total_ns", T_LONGLONG, offsetof(SpanTotal, total_ns), READONLY, NULL},
    {"calls", T_LONGLONG, offsetof(SpanTotal, calls), READONLY, NULL},
    {NULL},
};

static PyTypeObject SpanTotalType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traceml.probe._fastpath.SpanTotal",
    .tp_doc = "A user span's calls in one step: step, start_ns (the first call's), total_ns, calls.",
    .tp_basicsize = sizeof(SpanTotal),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_members = span_total_members,
};

/* One call of a user span, added to its name's total for its step (no object made); a call
 * in a later step hands the earlier total to the sender as (name, total) (sender.push_span) and
 * starts anew, in the probe's dict of totals as it is after that push: the push may run Python
 * (a full buffer), where another thread can swap the dict (flush_spans). The caller holds the
 * probe. */
static int
add_span_call(ProbeState *state, PyObject *name, long long start_ns, long long end_ns)
{
    long long step = current_step(state);
    for (int pushed = 0;; pushed = 1) {
        PyObject *totals = state->span_totals;
        if (totals == NULL || !PyDict_CheckExact(totals)) {
            PyErr_SetString(PyExc_TypeError, "traceml: the probe has no span totals");
            return -1;
        }
        Py_INCREF(totals);  /* held: a name's hash may run Python too */
        PyObject *held = PyDict_GetItemWithError(totals, name), *ended = NULL;
        int done = held == NULL && PyErr_Occurred() ? -1 : 1;  /* 1: not yet */
        if (done == 1 && held != NULL && Py_IS_TYPE(held, &SpanTotalType) && ((SpanTotal *)held)->step == step) {
            ((SpanTotal *)held)->total_ns += end_ns - start_ns;
            ((SpanTotal *)held)->calls++;
            done = 0;
        } else if (done == 1 && (held == NULL || pushed)) {
            SpanTotal *total = PyObject_New(SpanTotal, &SpanTotalType);
            if (total != NULL) {
                total->step = step;
                total->start_ns = start_ns;
                total->total_ns = end_ns - start_ns;
                total->calls = 1;
            }
            done = total == NULL ? -1 : PyDict_SetItem(totals, name, (PyObject *)total);
            Py_XDECREF(total);
        } else if (done == 1) {
            ended = PyTuple_Pack(2, name, held);
            done = ended == NULL ? -1 : 1;
        }
        Py_DECREF(totals);
        if (done != 1)
            return done;
        done = push_to(state->sender ? state->sender : Py_None, str_spans, str_push_span, ended);
        Py_DECREF(ended);
        if (done < 0)
            return -1;
    }
}

/* A number's ScalarRecord, for the probe's step: a fault costs that scalar, never the call. */
static PyObject *
push_scalar(ProbeState *state, PyObject *name, double value)
{
    PyObject *rank = PyLong_FromLong(state->rank);
    PyObject *step = PyLong_FromLongLong(current_step(state));
    PyObject *number = PyFloat_FromDouble(value);
    PyObject *record = NULL;
    if (rank && step && number) {
        PyObject *fields[] = {rank, step, name, number};
        record = PyObject_Vectorcall(scalar_record_type, fields, 4, NULL);
    }
    Py_XDECREF(rank);
    Py_XDECREF(step);
    Py_XDECREF(number);
    if (record == NULL || push_to(state->sender ? state->sender : Py_None, str_buffer, str_push, record) < 0)
        drop_bookkeeping_error();
    Py_XDECREF(record);
    Py_RETURN_NONE;
}

/* tracer.log_scalar(name, value): a float or an int is recorded here; anything else (a
 * tensor, keywords) goes to tracer.py's Python, which reads tensors without waiting. */
static PyObject *
trace_log_scalar(TraceState *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    ProbeState *state = is_none(self->probe) ? NULL : state_of(self->probe);
    if (state != NULL && nargs == 2 && kwnames == NULL && scalar_record_type != NULL
            && (PyFloat_CheckExact(args[1]) || PyLong_CheckExact(args[1]))) {
        double value = PyFloat_AsDouble(args[1]);
        if (!(value == -1.0 && PyErr_Occurred())) {
            Py_INCREF(state);  /* held: the push may run Python, which may end the traced region */
            PyObject *done = push_scalar(state, args[0], value);
            Py_DECREF(state);
            return done;
        }
        PyErr_Clear();  /* an int too large for a float: Python's float() says so, below */
    }
    if (is_none(self->probe))
        Py_RETURN_NONE;
    if (general_log_scalar == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "traceml: the tracer is not configured");
        return NULL;
    }
    /* general_log_scalar(self, *args, **kwargs) */
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[8], **forwarded = total + 1 <= 8 ? small : PyMem_Malloc((total + 1) * sizeof(PyObject *));
    if (forwarded == NULL)
        return PyErr_NoMemory();
    forwarded[0] = (PyObject *)self;
    for (Py_ssize_t i = 0; i < total; i++)
        forwarded[i + 1] = args[i];
    PyObject *result = PyObject_Vectorcall(general_log_scalar, forwarded, nargs + 1, kwnames);
    if (forwarded != small)
        PyMem_Free(forwarded);
    return result;
}

static int
trace_traverse(TraceState *self, visitproc visit, void *arg)
{
    Py_VISIT(self->probe);
    return 0;
}

static int
trace_clear(TraceState *self)
{
    Py_CLEAR(self->probe);
    return 0;
}

static void
trace_dealloc(TraceState *self)
{
    PyObject_GC_UnTrack(self);
    trace_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef trace_members[] = {
    {"_probe", T_OBJECT, offsetof(TraceState, probe), 0, NULL},
    {NULL},
};

static PyMethodDef trace_methods[] = {
    {"span", (PyCFunction)trace_span, METH_O,
     "span(name): `with tracer.span(\"forward_pass\"):` a named part of the step, shown in the\n"
     "timeline and beside the breakdown (spans overlap the phases; they are not added to them)."},
    {"log_scalar", (PyCFunction)(void (*)(void))trace_log_scalar, METH_FASTCALL | METH_KEYWORDS,
     "log_scalar(name, value): log a float or a 0-dim tensor at the current step. A CUDA tensor\n"
     "is copied to the host without waiting and read by the sender thread once its copy is done:\n"
     "no sync."},
    {NULL},
};

static PyTypeObject TraceStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traceml.probe._fastpath.TraceState",
    .tp_doc = "The Trace API's span and log_scalar in C (the base class of tracer.Trace).",
    .tp_basicsize = sizeof(TraceState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)trace_traverse,
    .tp_clear = (inquiry)trace_clear,
    .tp_dealloc = (destructor)trace_dealloc,
    .tp_members = trace_members,
    .tp_methods = trace_methods,
};

static PyObject *
span_enter(Span *self, PyObject *unused)
{
    self->start_ns = now_ns();
    return Py_NewRef(self);
}

/* The span's time goes to its step's total for its name (StepProbe.span_done, in C). */
static PyObject *
span_exit(Span *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long end_ns = now_ns();
    PyObject *probe = ((TraceState *)self->tracer)->probe;
    ProbeState *state = is_none(probe) ? NULL : state_of(probe);
    if (state == NULL)
        Py_RETURN_FALSE;
    Py_INCREF(probe);  /* held: the push may run Python, which may end the traced region */
    if (add_span_call(state, self->name, self->start_ns, end_ns) < 0)
        drop_bookkeeping_error();  /* costs this span's time only */
    Py_DECREF(probe);
    Py_RETURN_FALSE;
}

static int
span_traverse(Span *self, visitproc visit, void *arg)
{
    Py_VISIT(self->tracer);
    Py_VISIT(self->name);
    return 0;
}

static int
span_clear(Span *self)
{
    Py_CLEAR(self->tracer);
    Py_CLEAR(self->name);
    return 0;
}

static void
span_dealloc(Span *self)
{
    PyObject_GC_UnTrack(self);
    span_clear(self);
    PyObject_GC_Del(self);
}

static PyMethodDef span_methods[] = {
    {"__enter__", (PyCFunction)span_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))span_exit, METH_FASTCALL, NULL},
    {NULL},
};

static PyTypeObject SpanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traceml.probe._fastpath.Span",
    .tp_doc = "One call of a user span (Trace.span).",
    .tp_basicsize = sizeof(Span),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)span_traverse,
    .tp_clear = (inquiry)span_clear,
    .tp_dealloc = (destructor)span_dealloc,
    .tp_methods = span_methods,
};

static PyObject *
fast_now_ns(PyObject *module, PyObject *unused)
{
    return PyLong_FromLongLong(now_ns());
}

static PyObject *
faults(PyObject *module, PyObject *unused)
{
    return PyLong_FromSsize_t(bookkeeping_faults);
}

static PyObject *
configure(PyObject *module, PyObject *args)
{
    PyObject *closed, *ended, *step, *window;
    if (!PyArg_ParseTuple(args, "OOO!O!", &closed, &ended, &PyTuple_Type, &step, &PyTuple_Type, &window))
        return NULL;
    Py_XSETREF(closed_step_type, Py_NewRef(closed));
    Py_XSETREF(ended_window_type, Py_NewRef(ended));
    Py_XSETREF(step_zeros, Py_NewRef(step));
    Py_XSETREF(window_zeros, Py_NewRef(window));
    Py_RETURN_NONE;
}

static PyObject *
configure_trace(PyObject *module, PyObject *args)
{
    PyObject *scalar_record, *general;
    if (!PyArg_ParseTuple(args, "OO", &scalar_record, &general))
        return NULL;
    Py_XSETREF(scalar_record_type, Py_NewRef(scalar_record));
    Py_XSETREF(general_log_scalar, Py_NewRef(general));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"now_ns", fast_now_ns, METH_NOARGS, "The timers' clock, in ns (time.perf_counter_ns's)."},
    {"faults", faults, METH_NOARGS, "How many times the timers' bookkeeping failed (and was dropped)."},
    {"configure", configure, METH_VARARGS,
     "configure(ClosedStep, EndedWindow, step zeros, window zeros): what a step's ends make."},
    {"configure_trace", configure_trace, METH_VARARGS,
     "configure_trace(ScalarRecord, log_scalar): what a scalar makes, and the Python that logs any other."},
    {NULL},
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT, "_fastpath", "The plain step's phase timers in C (see _fastpath.c).", -1,
    module_methods,
};

static PyObject *
names_of(const char *const *names, Py_ssize_t count)
{
    PyObject *tuple = PyTuple_New(count);
    for (Py_ssize_t i = 0; tuple != NULL && i < count; i++) {
        PyObject *name = PyUnicode_FromString(names[i]);
        if (name == NULL)
            Py_CLEAR(tuple);
        else
            PyTuple_SET_ITEM(tuple, i, name);
    }
    return tuple;
}

/* What this build was made from: the step's and window's slots, the fields it makes ClosedStep
 * and EndedWindow with, by position, and ProbeState's fields (layout.py's, all five). */
static PyObject *
layout_of(void)
{
    return Py_BuildValue("(NNNNN)", names_of(STEP_SLOT_NAMES, STEP_SLOTS), names_of(WINDOW_SLOT_NAMES, WINDOW_SLOTS),
                         names_of(CLOSED_STEP_FIELDS, CLOSED_STEP_FIELD_COUNT),
                         names_of(ENDED_WINDOW_FIELDS, ENDED_WINDOW_FIELD_COUNT),
                         names_of(STATE_FIELD_NAMES, sizeof(STATE_FIELD_NAMES) / sizeof(STATE_FIELD_NAMES[0])));
}

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    struct { PyObject **slot; const char *text; } names[] = {
        {&str_probe, "probe"}, {&str_token_inputs, "token_inputs"}, {&str_shape, "shape"},
        {&str_enter, "__enter__"}, {&str_note_failure, "note_failure"},
        {&str_backward_returned, "backward_returned"}, {&str_optimizer_stepped, "optimizer_stepped"},
        {&str_name, "__name__"}, {&str_qualname, "__qualname__"}, {&str_doc, "__doc__"},
        {&str_module, "__module__"}, {&str_enter_long, "enter"}, {&str_exit_long, "exit"},
        {&str_push, "push"}, {&str_latest_bytes, "latest_bytes"}, {&str_buffer, "_buffer"},
        {&str_capacity, "capacity"}, {&str_append, "append"}, {&str_spans, "_spans"},
        {&str_push_span, "push_span"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL)
            return NULL;
    if (PyType_Ready(&ProbeStateType) < 0 || PyType_Ready(&TimerType) < 0 || PyType_Ready(&TraceStateType) < 0
            || PyType_Ready(&SpanType) < 0 || PyType_Ready(&SpanTotalType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&fastpath_module);
    if (module == NULL)
        return NULL;
#ifdef Py_GIL_DISABLED
    /* The probe's state and its ring are shared by the training and sender threads under the
     * GIL. step.py does not load this module on a free-threaded build; should anyone else, the
     * interpreter keeps the GIL on for it. */
    if (PyUnstable_Module_SetGIL(module, Py_MOD_GIL_USED) < 0) {
        Py_DECREF(module);
        return NULL;
    }
#endif
    Py_INCREF(&ProbeStateType);
    Py_INCREF(&TimerType);
    Py_INCREF(&TraceStateType);
    Py_INCREF(&SpanTotalType);  /* AddObject steals one; static types are not immortal before 3.12 */
    if (PyModule_AddObject(module, "ProbeState", (PyObject *)&ProbeStateType) < 0
            || PyModule_AddObject(module, "Timer", (PyObject *)&TimerType) < 0
            || PyModule_AddObject(module, "TraceState", (PyObject *)&TraceStateType) < 0
            || PyModule_AddObject(module, "SpanTotal", (PyObject *)&SpanTotalType) < 0
            || PyModule_AddIntConstant(module, "VERSION", LAYOUT_VERSION) < 0
            || PyModule_AddObject(module, "LAYOUT", layout_of()) < 0
            || PyModule_AddIntConstant(module, "NEXT", NEXT) < 0
            || PyModule_AddIntConstant(module, "MODEL_CALL", MODEL_CALL) < 0
            || PyModule_AddIntConstant(module, "BACKWARD_CALL", BACKWARD_CALL) < 0
            || PyModule_AddIntConstant(module, "OPTIMIZER_BEFORE", OPTIMIZER_BEFORE) < 0
            || PyModule_AddIntConstant(module, "OPTIMIZER_AFTER", OPTIMIZER_AFTER) < 0
            || PyModule_AddIntConstant(module, "TENSOR_TO", TENSOR_TO) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
