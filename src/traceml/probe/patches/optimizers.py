"""The optimizer's update, from torch's global optimizer step hooks: the optimizer phase, and
with steps inferred, the step's end."""
from typing import Any

from traceml.probe.patches.patch import Patch
from traceml.probe.step_state import OPTIMIZER, fast_path


class OptimizerSteps(Patch):
    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        probe = self.probe

        def before_step(optimizer: Any, args: Any, kwargs: Any) -> Any:
            if not probe.in_step and not probe.auto_steps:  # outside the steps: nothing to time
                return None
            if probe.layers_active:  # a sampled step (a plain one's update never comes here)
                probe.watch_optimizer(optimizer)
            # args are step()'s own, the optimizer first: step(closure) has it second.
            closure = (args[1] if len(args) > 1 else kwargs.get("closure")) if kwargs or len(args) > 1 else None
            if closure is None:
                start_ns = probe.phase_begin(OPTIMIZER)
                if start_ns:
                    probe._optimizer_timed, probe._optimizer_start_ns = id(optimizer), start_ns
                return None  # None keeps the arguments as they are
            # optimizer.step(closure) runs forward and backward inside the step (Lightning does
            # this every step): the update is timed from when the closure returns. An optimizer
            # that calls the closure again (LBFGS re-evaluates the loss) stops the update's clock
            # meanwhile: those forwards and backwards are forward and backward.
            def timed_closure() -> Any:
                after_step(optimizer, (), {}, inferring=False)
                result = closure()
                before_step(optimizer, (optimizer,), {})
                return result

            if len(args) > 1:
                return (args[0], timed_closure, *args[2:]), kwargs
            return args, {**kwargs, "closure": timed_closure}

        def after_step(optimizer: Any, args: Any, kwargs: Any, inferring: bool = True) -> None:
            if probe._optimizer_timed == id(optimizer):
                probe._optimizer_timed = 0
                probe.phase_end(OPTIMIZER, probe._optimizer_start_ns)
            if inferring and probe.auto_steps:
                probe.optimizer_stepped(optimizer)

        pre_hook: Any = before_step
        post_hook: Any = after_step
        if fast_path is not None:  # a plain step's update compiled; any other, the Python above
            pre_hook = fast_path.Timer(fast_path.OPTIMIZER_BEFORE, before_step, before_step, probe)
            post_hook = fast_path.Timer(fast_path.OPTIMIZER_AFTER, after_step, after_step, probe)
        self.on_remove(register_optimizer_step_pre_hook(pre_hook).remove)
        self.on_remove(register_optimizer_step_post_hook(post_hook).remove)
