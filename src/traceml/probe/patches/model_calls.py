"""The model's forward: the outermost call of a traced model timed from its class, never from
the model object, with the samples and tokens it is given.

Why the class: whatever is set on the model itself (an instance `forward`, a hook in its hook
dicts) travels with it into pickles, torch.save, deepcopy and state, and a checkpoint made under
TraceML would name traceml. A class is pickled by name, so a method set on it is invisible
there; the instance is left exactly as the user built it. Why not a module hook: any hook sends
every module call through torch's slow path, and a global hook makes torch.compile warn. One
wrapper per patched class checks whether the module being called is a traced model (a dict
lookup) and otherwise calls straight through.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Protocol, Tuple

from traceml.probe.patches import tokens
from traceml.probe.patches.dynamo import call_attribute, compiling, run_eagerly_under_dynamo
from traceml.probe.patches.patch import ABSENT
from traceml.probe.step_state import FORWARD, FORWARD_CALLS, SAMPLES, fast_path
from traceml.probe.step import StepProbe

if TYPE_CHECKING:
    from torch.nn import Module


class Evaluation(Protocol):
    """Where a traced model's call between steps with gradients off goes (evaluation.py)."""

    active: bool

    def model_called(self, call: Callable[..., Any], model: Module, args: tuple, kwargs: dict) -> Any: ...


class ModelCollectives(Protocol):
    """What times a hooked model's collectives (collectives.py)."""

    def model_hooked(self, model: Module) -> None: ...


class _TracedModel:
    """What the probe keeps about one traced model, away from the model itself."""

    __slots__ = ("probe", "model", "token_inputs", "slices_inputs", "labels_mirror_inputs")

    def __init__(self, probe: StepProbe, model: Module):
        self.probe = probe  # read by the compiled timer
        self.model = weakref.ref(model)  # for evaluation: the modules of its kind (a copy, a part)
        # Whether this model is given token ids, decided at its first call: the check then
        # costs one attribute read a call, not a look at the inputs.
        self.token_inputs: Optional[bool] = None
        # How many of them it trains on (see tokens.count_tokens), each decided once: whether it
        # slices its ids by one inside (its output is one shorter), and whether its labels
        # are its ids, which it shifts by one inside.
        self.slices_inputs = False
        self.labels_mirror_inputs: Optional[bool] = None


class ModelCalls:
    """The traced models and the classes patched for them. No patch until a model is hooked; a
    class gets its own call method back when no traced model of it is left (_ModelHandle)."""

    def __init__(self, probe: StepProbe, evaluation: Evaluation, collectives: ModelCollectives):
        self.probe, self.evaluation, self.collectives = probe, evaluation, collectives
        self._models: dict = {}  # id(model) -> _TracedModel, read by the compiled timer too
        # class -> [its own attribute before (or ABSENT), models traced, the call set on it]
        self._patched_classes: dict = {}

    def traced_models(self) -> List[Module]:
        return [traced.model() for traced in list(self._models.values())]

    def hook(self, model: Module) -> List[_ModelHandle]:
        """Time the outermost call of this model as forward and count the samples it is given."""
        import torch

        if id(model) in self._models:
            return []
        cls = type(model)
        attribute = call_attribute()
        entry = self._patched_classes.get(cls)
        if not self._patched_classes:
            for function in (StepProbe.phase_begin, StepProbe.phase_end, StepProbe.note_failure,
                             *tokens.BOOKKEEPING):  # what the call does on the model's way in and out
                run_eagerly_under_dynamo(function, callees_too=True)
        if entry is None:
            inherited = getattr(cls, attribute)
            inherited = getattr(inherited, "traceml_original", inherited)  # not a first-call wait
            timed = self._timed_call(inherited, torch.Tensor, compiling())
            entry = self._patched_classes[cls] = [cls.__dict__.get(attribute, ABSENT), 0, timed]
            setattr(cls, attribute, timed)
        entry[1] += 1
        self._models[id(model)] = _TracedModel(self.probe, model)
        self.collectives.model_hooked(model)
        return [_ModelHandle(model, self._forget, self._time_compiled_call(model, torch.Tensor))]

    def _forget(self, model_id: int, cls: type) -> None:
        if self._models.pop(model_id, None) is None:
            return
        entry = self._patched_classes.get(cls)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._patched_classes[cls]
            attribute = call_attribute()
            if cls.__dict__.get(attribute) is not entry[2]:
                return  # someone replaced it since: theirs stays
            if entry[0] is ABSENT:
                delattr(cls, attribute)
            else:
                setattr(cls, attribute, entry[0])

    def _time_compiled_call(self, model: Module, tensor_type: type) -> Optional[Tuple[Callable[..., Any], Callable[..., Any]]]:
        """model.compile() before TraceML saw the model: nn.Module calls the compiled call it keeps
        on the instance, never the class's call method. Timed there instead (torch drops that
        attribute from pickles and copies, so it stays invisible). Returns (timed, its own)."""
        own = model.__dict__.get("_compiled_call_impl")
        if own is None:
            return None
        timed = self._timed_call(lambda _model, *args, **kwargs: own(*args, **kwargs), tensor_type,
                                 compiling()).__get__(model)
        model._compiled_call_impl = timed
        return timed, own

    def _timed_call(self, original: Callable[..., Any], tensor_type: type, compiling: Callable[[], bool]) -> Callable[..., Any]:
        """The class's call method, timing the outermost call of a traced model as forward (or,
        between steps with gradients off, as evaluation)."""
        import torch

        grad_enabled, models, evaluation = torch.is_grad_enabled, self._models, self.evaluation

        def call(self: Any, *args: object, **kwargs: object) -> Any:
            traced = models.get(id(self))
            if traced is None or compiling():
                return original(self, *args, **kwargs)
            return _call_timed_in_general(original, traced, self, args, kwargs, tensor_type, grad_enabled,
                                          evaluation)

        call.__wrapped__ = original  # type: ignore[attr-defined]
        run_eagerly_under_dynamo(call)
        run_eagerly_under_dynamo(_call_timed_in_general)
        if fast_path is None:
            return call
        # The compiled timer does call's common case and hands it every other. It sits behind
        # a Python function, read by dynamo as call is (a C callable would break its graphs).
        timer = fast_path.Timer(fast_path.MODEL_CALL, original, call, models=models, grad_enabled=grad_enabled,
                                tensor_type=tensor_type, batch_size=tokens.batch_size)

        def timed_call(self: Any, *args: object, **kwargs: object) -> Any:
            if compiling():
                return original(self, *args, **kwargs)
            return timer(self, *args, **kwargs)

        timed_call.__wrapped__ = original  # type: ignore[attr-defined]
        run_eagerly_under_dynamo(timed_call)
        return timed_call


def _call_timed_in_general(original: Callable[..., Any], traced: _TracedModel, model: Module, args: tuple,
                           kwargs: dict, tensor_type: type, grad_enabled: Callable[[], bool],
                           evaluation: Evaluation) -> Any:
    """The timed call: every call of a traced model in Python, and, where the compiled timer
    stands in front, every call but a plain step's outermost one (inside another phase,
    outside the steps, the first call, token inputs, on CUDA, a deep-dive step)."""
    probe = traced.probe
    start_ns = probe.phase_begin(FORWARD)
    first_token_call = False  # how many tokens it trains is read once its output is known
    if start_ns:
        probe.sums[FORWARD_CALLS] += 1  # type: ignore[operator]  # probe.step: typed when the StepProbe split lands
        probe.sums[SAMPLES] += tokens.batch_size(args, kwargs, tensor_type)  # type: ignore[operator]  # probe.step: typed when the StepProbe split lands
        if traced.token_inputs is None:
            traced.token_inputs = first_token_call = tokens.token_ids(args, kwargs, tensor_type) is not None
        elif traced.token_inputs:
            tokens.count_tokens(probe, traced, model, args, kwargs, tensor_type)
    elif not probe.in_step and not grad_enabled() and not probe.in_evaluation and evaluation.active:
        return evaluation.model_called(original, model, args, kwargs)  # evaluation
    try:
        if probe.layers_active and probe.layers.active:  # a deep-dive step: count saved tensors
            with probe.layers.saved_tensors_context():
                result = original(model, *args, **kwargs)
        else:
            result = original(model, *args, **kwargs)
    except BaseException:
        probe.note_failure(FORWARD)
        raise
    finally:
        if start_ns:
            probe.phase_end(FORWARD, start_ns)
    if first_token_call:
        traced.slices_inputs = tokens.slices_by_one(result, tokens.token_ids(args, kwargs, tensor_type), tensor_type)
        tokens.count_tokens(probe, traced, model, args, kwargs, tensor_type)
    return result


class _ModelHandle:
    """Stops timing one model; its class gets its own call method back when no traced model of
    that class is left (taken out, or garbage-collected)."""

    def __init__(self, model: Module, forget: Callable[[int, type], None],
                 compiled_call: Optional[Tuple[Callable[..., Any], Callable[..., Any]]] = None):
        self._model = weakref.ref(model)
        self._compiled_call = compiled_call  # (timed, its own) when model.compile() came first
        # The entry goes with the model, so a new object reusing its id() is not taken for it.
        self._finalizer = weakref.finalize(model, forget, id(model), type(model))

    def remove(self) -> None:
        model = self._model()
        if model is not None and self._compiled_call is not None:
            timed, own = self._compiled_call
            if model.__dict__.get("_compiled_call_impl") is timed:
                model._compiled_call_impl = own
        self._finalizer()  # runs forget once, now or never again
