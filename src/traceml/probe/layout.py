"""The step's layout, declared once: the probe's state, and the slots of a step's and a window's lists.

step.py takes its indices, zeros and slots from here, and setup.py writes the compiled timers'
header (_layout.h) from this file at build time: the C struct's fields and member table, the
slot enums and names, and a _Static_assert for each order the C relies on. So C and Python read
the same fields and index the same slots by the same names. The compiled module says back what
it was built from (_fastpath.LAYOUT); step.py uses it only when that matches, and otherwise
times in Python. Adding a slot or a field is one line here (plus the code that fills and reads
it). Plain Python, no imports: setup.py runs it before anything is installed.
"""

# Bumped when the compiled timers' behaviour changes in a way the layout does not show.
VERSION = 13

NO_PHASE = -1

# The step in flight, one list a step (starting a step is one store): the phases' ns, in
# records.TIMED_PHASES' order (a phase's number is its slot: PHASE_SLOTS), the input wait inside the block, the traced model's outermost calls, the
# samples and tokens given to it, the collective wait (DDP's inside backward; under FSDP, in any
# phase) and of it the parts in forward and in the optimizer's step; then the real
# tokens per attention_mask (None: no mask seen), the device copies of masks' sums still in
# flight (None: none), and the phase an exception left through (for an OOM report). C copies
# the leading slots whose zero is an int out as numbers when a step ends (STEP_INTS), and holds
# the rest as the objects they are.
STEP_SLOTS = (
    ("h2d", 0),
    ("forward", 0),
    ("backward", 0),
    ("optimizer", 0),
    ("input_wait_ns", 0),
    ("forward_calls", 0),
    ("samples", 0),
    ("tokens", 0),
    ("comm_wait_ns", 0),
    ("forward_comm_wait_ns", 0),
    ("optimizer_comm_wait_ns", 0),
    ("real_tokens", None),
    ("token_copies", None),
    ("failed_phase", NO_PHASE),
)

# A step's whole window (the step and the gap after it), all ints: garbage-collector pauses
# [pause ns, collections, longest pause ns, full (generation 2) collections, pause ns of
# generations 0, 1 and 2], then evaluation, checkpoint-save and torch.compile ns, of the saves
# the ns between steps (a save after the last step is not that step's), and the DataLoader's
# wait between steps.
WINDOW_SLOTS = (
    "gc_ns",
    "gc_collections",
    "gc_max_ns",
    "gc_full",
    "gc_gen0_ns",
    "gc_gen1_ns",
    "gc_gen2_ns",
    "eval_ns",
    "checkpoint_ns",
    "compile_ns",
    "checkpoint_between_ns",
    "input_wait_gap_ns",
)


PHASE_SLOTS = ("h2d", "forward", "backward", "optimizer")

# The probe's state that a step's timers read and write on every call: (the name Python reads,
# its C type). Compiled, these are _fastpath.ProbeState's struct fields (the name without its
# leading underscore) and member table; in Python, step.PythonProbeState's slots.
STATE_FIELDS = (
    ("in_step", "int"),  # 0 between steps, else the depth of nested trace_step blocks
    ("open_phase", "int"),  # the phase being timed (its slot), or NO_PHASE
    ("plain", "bool"),  # the patches may time inline (StepProbe.plain)
    ("in_evaluation", "bool"),  # a trainer's evaluation runs
    ("auto_steps", "bool"),  # steps are inferred (no trace_step)
    ("layers_active", "bool"),  # this step runs deep-dive's hooks
    ("comm_timed", "bool"),  # DDP's collective wait is timed
    ("_optimizer_ends_steps", "bool"),  # inferred steps: an update ends steps, backward never
    ("rank", "int"),
    ("fetching", "int"),  # the training thread's depth in timed DataLoader __next__ calls
    ("training_thread", "unsigned long"),  # the thread whose steps are timed
    ("step_index", "long long"),
    ("_step_start_ns", "long long"),
    ("setup_started_ns", "long long"),
    ("_optimizer_timed", "Py_ssize_t"),  # id() of the optimizer whose update is timed, or 0
    ("_optimizer_start_ns", "long long"),  # when that update started
    ("due_step", "double"),  # the next step whose start has work to do (enter, in Python)
    ("sums", "list"),  # the step in flight's list (STEP_SLOTS)
    ("window", "list"),  # the window's list (WINDOW_SLOTS)
    ("timeline", "object"),  # DeviceTimeline on CUDA, else None
    ("sender", "object"),
    ("host_rss", "object"),
    ("_settled_optimizer", "object"),  # inferred steps: id() of the update that ends a step, or None
    ("span_totals", "object"),  # user spans: name -> its SpanTotal for the latest step it ran in
)

# The fields of step.py's ClosedStep and EndedWindow, in their order: the compiled end makes
# them by position.
CLOSED_STEP_FIELDS = ("step", "start_ns", "end_ns", "sums", "device_allocated_bytes", "device_peak_bytes",
                      "device_reserved_bytes", "start_event", "end_event", "phase_events", "host_rss_bytes",
                      "instrumented")
ENDED_WINDOW_FIELDS = ("closed", "window_end_ns", "window", "next_start_event")

# A C type as the struct holds it, and as its member table hands it to Python.
_C_TYPES = {"int": ("int", "T_INT"), "bool": ("char", "T_BOOL"), "long long": ("long long", "T_LONGLONG"),
            "unsigned long": ("unsigned long", "T_ULONG"), "Py_ssize_t": ("Py_ssize_t", "T_PYSSIZET"),
            "double": ("double", "T_DOUBLE"), "object": ("PyObject *", "T_OBJECT"),
            "list": ("PyObject *", "T_OBJECT_EX")}


def step_ints() -> int:
    """How many of the step's slots lead with an int zero: C copies these out as numbers."""
    count = 0
    while count < len(STEP_SLOTS) and type(STEP_SLOTS[count][1]) is int:
        count += 1
    return count


def _enum(names, prefix: str, count: str) -> str:
    return "enum { " + ", ".join(prefix + name.upper() for name in names) + f", {count} }};"


def _names(array: str, names) -> str:
    return f"static const char *const {array}[] = {{" + ", ".join(f'"{n}"' for n in names) + "};"


def _check() -> None:
    step_names = [name for name, _ in STEP_SLOTS]
    if tuple(step_names[:len(PHASE_SLOTS)]) != PHASE_SLOTS:
        raise ValueError("layout.py: the step's first slots are the timed phases (PHASE_SLOTS)")
    if step_ints() == len(STEP_SLOTS):
        raise ValueError("layout.py: the step's list ends with at least one slot that holds an object")
    for name, c_type in STATE_FIELDS:
        if c_type not in _C_TYPES:
            raise ValueError(f"layout.py: {name}'s C type {c_type!r} is not one of {sorted(_C_TYPES)}")


def c_header() -> str:
    """_layout.h: the slots as C enums (upper-cased names) and their names; ProbeState's fields,
    member table and object fields (for the garbage collector); the fields of ClosedStep and
    EndedWindow as enums; and static asserts for the orders the C relies on."""
    _check()
    step_names = [name for name, _ in STEP_SLOTS]
    fields = [(name, name.lstrip("_"), *_C_TYPES[c_type]) for name, c_type in STATE_FIELDS]
    objects = [c_name for _, c_name, c_type, _ in fields if c_type == "PyObject *"]
    lines = [
        "/* Generated by setup.py from src/traceml/probe/layout.py: edit that file, not this one. */",
        f"#define LAYOUT_VERSION {VERSION}", f"#define NO_PHASE ({NO_PHASE})",
        _enum(step_names, "", "STEP_SLOTS"), _enum(WINDOW_SLOTS, "", "WINDOW_SLOTS"),
        f"enum {{ STEP_INTS = {step_ints()}, STEP_OBJECTS = STEP_SLOTS - STEP_INTS }};",
        _names("STEP_SLOT_NAMES", step_names), _names("WINDOW_SLOT_NAMES", WINDOW_SLOTS),
        _enum(CLOSED_STEP_FIELDS, "CLOSED_", "CLOSED_STEP_FIELD_COUNT"),
        _enum(ENDED_WINDOW_FIELDS, "ENDED_", "ENDED_WINDOW_FIELD_COUNT"),
        _names("CLOSED_STEP_FIELDS", CLOSED_STEP_FIELDS), _names("ENDED_WINDOW_FIELDS", ENDED_WINDOW_FIELDS),
        _names("STATE_FIELD_NAMES", [name for name, _ in STATE_FIELDS]),
        "#define STATE_FIELDS " + " ".join(f"{c_type} {c_name};" for _, c_name, c_type, _ in fields),
        "#define STATE_MEMBERS " + " ".join(f'{{"{name}", {member}, offsetof(ProbeState, {c_name}), 0, NULL}},'
                                             for name, c_name, _, member in fields),
        "#define STATE_VISIT_OBJECTS " + " ".join(f"Py_VISIT(self->{c_name});" for c_name in objects),
        "#define STATE_CLEAR_OBJECTS " + " ".join(f"Py_CLEAR(self->{c_name});" for c_name in objects),
        # A phase's number is its slot: the timers add a phase's ns at sums[phase].
        "_Static_assert(" + " && ".join(f"{name.upper()} == {index}" for index, name in enumerate(PHASE_SLOTS))
        + ', "the timed phases are the step\'s first slots, in TIMED_PHASES\' order");',
        '_Static_assert(STEP_OBJECTS > 0, "the step\'s list ends with the slots held as objects");',
    ]
    return "\n".join(lines) + "\n"
