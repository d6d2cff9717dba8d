"""fp16 loss scaling with DeepSpeed's semantics (``deepspeed.runtime.fp16.loss_scaler``).

The loss is multiplied by ``scale`` before backward so that small fp16 gradients do not flush to
zero; the optimizer divides it out again (``ZenFlowAdamW.step(grad_divisor=scale)``). Dynamic
scaling starts at ``2**initial_scale_power``; after an overflow (a skipped step) it halves, but
only once ``hysteresis`` overflows have been seen since the scale last grew; after
``loss_scale_window`` steps without overflow it doubles. It never goes below ``min_loss_scale``
(DeepSpeed raises there instead; we keep skipping, and every skip is counted). A static scale
(``loss_scale > 0``) never changes.
"""

from zenflow.config import FP16Config


class LossScaler:
    def __init__(
        self,
        scale: float,
        dynamic: bool = False,
        window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
    ):
        self.scale = float(scale)
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self._hysteresis_left = hysteresis
        self._iteration = 0
        self._last_overflow = -1

    @classmethod
    def from_config(cls, fp16: FP16Config) -> "LossScaler":
        """The scaler an fp16 config asks for; a scale of 1 (no scaling) when fp16 is off."""
        if not fp16.enabled:
            return cls(1.0)
        if not fp16.dynamic_loss_scale:
            return cls(fp16.loss_scale)
        return cls(
            2.0**fp16.initial_scale_power,
            dynamic=True,
            window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            min_scale=fp16.min_loss_scale,
        )

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step, ``overflow`` telling whether it was skipped."""
        if not self.dynamic:
            return
        if overflow:
            if self._hysteresis_left <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self._hysteresis_left -= 1
            self._last_overflow = self._iteration
        else:
            stable_steps = self._iteration - self._last_overflow - 1
            if stable_steps > 0 and stable_steps % self.window == 0:
                self._hysteresis_left = self.hysteresis
                self.scale *= 2
        self._iteration += 1

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "hysteresis_left": self._hysteresis_left,
            "iteration": self._iteration,
            "last_overflow": self._last_overflow,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._hysteresis_left = state["hysteresis_left"]
        self._iteration = state["iteration"]
        self._last_overflow = state["last_overflow"]
