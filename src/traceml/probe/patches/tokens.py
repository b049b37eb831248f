"""What a traced model's call is given: its samples (the batch's leading dimension) and the
tokens a step trains on."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple, Type

from traceml.probe.step_state import REAL_TOKENS, TOKENS, TOKEN_COPIES
from traceml.probe.step import StepProbe

if TYPE_CHECKING:
    from torch import Tensor

IGNORED_LABEL = -100  # the label torch's cross_entropy (and so Hugging Face's losses) leaves out


def batch_size(args: Tuple[object, ...], kwargs: Dict[str, object], tensor_type: Type[Tensor]) -> int:
    """The leading dimension of the first tensor the model is given, looking one level deep."""
    if args and isinstance(args[0], tensor_type):  # model(inputs): the common case, first
        shape = args[0].shape
        return shape[0] if shape else 1
    for value in (*args, *kwargs.values()):
        if isinstance(value, dict):
            candidates: Any = value.values()
        elif isinstance(value, (list, tuple)):
            candidates = value
        else:
            candidates = (value,)
        for candidate in candidates:
            if isinstance(candidate, tensor_type):
                return int(candidate.shape[0]) if candidate.dim() > 0 else 1
    return 0


def token_ids(args: Tuple[object, ...], kwargs: Dict[str, object], tensor_type: Type[Tensor]) -> Optional[Tensor]:
    """The token ids a model is given: input_ids, or an integer (batch, length) first input."""
    ids = kwargs.get("input_ids")
    if ids is None and args and isinstance(args[0], tensor_type):
        ids = args[0]
    if not isinstance(ids, tensor_type) or ids.is_floating_point() or ids.dim() != 2:
        return None
    return ids


def count_tokens(probe: StepProbe, traced: Any, model: Any, args: Tuple[object, ...], kwargs: Dict[str, object], tensor_type: Type[Tensor]) -> None:
    """The tokens a step trains on: of the token ids (batch, length) a call is given, the
    positions a next token is predicted for, and the real ones among them.
    - labels= the ids (Hugging Face's causal LMs, which shift them by one inside): batch x
      (length - 1), the real ones those whose label is not -100 (padding, a masked prompt);
    - ids sliced by one inside the model (fed a (batch, length + 1) chunk; seen from its
      output, one shorter): batch x (length - 1), the real ones per attention_mask;
    - else (inputs and targets given apart, nanoGPT's model(x, y)): all the ids given, the real
      ones per attention_mask.
    A count on the device (a mask's or the labels' sum) is copied to pinned host memory without
    waiting; the step's record reads it once the step is done. traced: the model's _TracedModel,
    which keeps what is decided once a model."""
    ids = token_ids(args, kwargs, tensor_type)
    if ids is None:
        return
    labels = kwargs.get("labels") if kwargs else None
    if isinstance(labels, tensor_type) and labels.shape == ids.shape:
        if traced.labels_mirror_inputs is None:
            traced.labels_mirror_inputs = labels_mirror_inputs(model, ids, labels)
        if traced.labels_mirror_inputs:
            probe.sums[TOKENS] += ids.shape[0] * (ids.shape[1] - 1)  # type: ignore[operator]  # probe.step: typed when the StepProbe split lands
            add_real_tokens(probe.sums, (labels[:, 1:] != IGNORED_LABEL).sum(), labels.is_cpu)
            return
    if traced.slices_inputs:
        probe.sums[TOKENS] += ids.shape[0] * (ids.shape[1] - 1)  # type: ignore[operator]  # probe.step: typed when the StepProbe split lands
    else:
        probe.sums[TOKENS] += ids.numel()  # type: ignore[operator]  # probe.step: typed when the StepProbe split lands
    mask = kwargs.get("attention_mask") if kwargs else None
    if isinstance(mask, tensor_type):
        add_real_tokens(probe.sums, (mask[:, 1:] if traced.slices_inputs else mask).sum(), mask.is_cpu)


def add_real_tokens(sums: list, count: Any, on_cpu: bool) -> None:
    if on_cpu:
        sums[REAL_TOKENS] = (sums[REAL_TOKENS] or 0) + int(count)
        return
    if sums[TOKEN_COPIES] is None:
        sums[TOKEN_COPIES] = []
    sums[TOKEN_COPIES].append(count.to("cpu", non_blocking=True))
    sums[REAL_TOKENS] = sums[REAL_TOKENS] or 0


def labels_mirror_inputs(model: Any, ids: Any, labels: Any) -> bool:
    """Whether a model's labels are its own ids (where not -100): then it trains on them shifted
    by one (trained unshifted, they would teach it to copy its input). Not for an encoder-
    decoder, whose labels are its decoder's. Asked once a model: one look at the values."""
    try:
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            return False
        if labels is ids:
            return True
        kept = labels != IGNORED_LABEL
        return bool(((labels == ids) | ~kept).all())
    except Exception:  # labels we cannot compare: counted as the ids given
        return False


def slices_by_one(result: object, ids: Optional[Tensor], tensor_type: Type[Tensor]) -> bool:
    """Whether a model's output (its logits: the tensor, the first of a tuple, `logits` of a
    dict or ModelOutput) is one position shorter than its ids: it predicts each next token of a
    chunk it slices inside. A model that returns only its loss cannot be seen doing so."""
    try:
        if isinstance(result, dict):
            result = result.get("logits")
        elif isinstance(result, (tuple, list)):
            result = next((value for value in result if isinstance(value, tensor_type)), None)
        return (ids is not None and isinstance(result, tensor_type) and result.dim() >= 2
                and result.shape[0] == ids.shape[0] and result.shape[1] == ids.shape[1] - 1)
    except Exception:
        return False


BOOKKEEPING = (batch_size, token_ids, count_tokens, add_real_tokens, labels_mirror_inputs, slices_by_one)
