"""Hugging Face Trainer: the one thing it needs from zenflow beside ``ZenFlowAdamW`` itself.

Trainer drives ZenFlowAdamW as any torch optimizer (``optimizers=(opt, scheduler)``): its LR
schedulers set ``param_groups[i]["lr"]``, its clipping (``max_grad_norm``) goes through
``torch.nn.utils.clip_grad_norm_``, which ``.grad`` of owned weights answers
(``zenflow.runtime.staged_gradient``), and its checkpoints hold ``state_dict()``. What it cannot
know is that the unselected columns take their last window's update only at the next window
boundary: ``ZenFlowCallback`` applies it when training ends, so that the model Trainer saves
and evaluates afterwards is the trained one. Checkpoints taken during training are not
flushed: they resume exactly, the optimizer's state holding what the parameters lack.
"""

import transformers

from zenflow.optimizer import ZenFlowAdamW


class ZenFlowCallback(transformers.TrainerCallback):
    """Flushes the trainer's ZenFlowAdamW at the end of training (see the module docstring).
    Stateless: it finds the optimizer in the trainer's callback arguments."""

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        innermost = _unwrapped(optimizer)
        if not isinstance(innermost, ZenFlowAdamW):
            raise TypeError(
                f"ZenFlowCallback on a Trainer whose optimizer is {type(innermost).__name__}, "
                "not a ZenFlowAdamW: pass "
                "optimizers=(zenflow.ZenFlowAdamW(model.parameters(), ...), None)"
            )
        innermost.flush()


def _unwrapped(optimizer):
    # Accelerate wraps the optimizer (AcceleratedOptimizer keeps it in .optimizer).
    while not isinstance(optimizer, ZenFlowAdamW) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer
