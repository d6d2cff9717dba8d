"""The adaptive update interval (``update_interval: "auto"``): when to run the CPU update, and
how large a step a window's update takes.

When: for each weight, compare the energy of the unselected columns' accumulated gradient (the
host accumulator's squared norm) with what a selected column receives in one step, both per
column:

    piled_w    = ||sum over the window of G_unselected||^2 / (columns - k)
    selected_w = mean over the window's steps of ||G_selected||^2 / k

A weight *needs* an update once ``piled_w >= selected_w``: its waiting columns now carry as
much as one step of the columns updated every step. The window closes when at least
``auto_ratio`` of the weights (those with both selected and unselected columns) need one, but
not before ``min_interval`` steps, and after ``max_interval`` steps at the latest.
Concentrated importance (the ZenFlow case) gives long windows, and so does noise in the
unselected columns, which cancels in the sum; a consistent drift there gives short ones. The
floor is a budget: "auto" never runs the CPU update more often than a fixed interval of
``min_interval`` would.

How large: a window of n steps updates its columns once, from the mean of n gradients taken
while those columns stood still: for them it is one step on an n times larger batch, so its
learning rate follows Adam's square-root scaling rule, ``lr * sqrt(n)``
(``zenflow.runtime.schedule.lr_scale``). With a
fixed interval every window has the same length and that factor would be a constant (ZenFlow's
semantics, and DeepSpeed's, take one ``lr`` step per window); "auto" chooses lengths from 1 to
``max_interval``, and without the factor its longest windows would move the waiting columns
least.
"""

from dataclasses import dataclass


@dataclass
class _Window:
    piled: float = 0.0
    selected_sum: float = 0.0


DEFAULT_MIN_INTERVAL = 4
"""The floor when none is given (lowered to ``max_interval`` if that is smaller): ZenFlow's usual
fixed interval, the one its paper and DeepSpeed's examples run."""


class AutoUpdateInterval:
    def __init__(self, auto_ratio: float, *, min_interval: int | None, max_interval: int):
        if max_interval < 1:
            raise ValueError(f"max_update_interval must be >= 1, got {max_interval}")
        if min_interval is None:
            min_interval = min(DEFAULT_MIN_INTERVAL, max_interval)
        if not 1 <= min_interval <= max_interval:
            raise ValueError(
                f"min_update_interval must be between 1 and max_update_interval ({max_interval}), "
                f"got {min_interval}"
            )
        self.auto_ratio = auto_ratio
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.steps = 0
        self._windows: dict[int, _Window] = {}

    def observe(self, energies: dict[int, tuple[float, float, int, int]]) -> bool:
        """Account one committed step; ``energies`` maps a weight key to (this step's selected
        energy, the accumulated unselected energy, k, columns). Returns True when the window
        should close now."""
        self.steps += 1
        considered = needing = 0
        for key, (selected, unselected, k, columns) in energies.items():
            if k == 0 or k == columns:
                continue
            window = self._windows.setdefault(key, _Window())
            window.piled = unselected / (columns - k)
            window.selected_sum += selected / k
            considered += 1
            needing += window.piled >= window.selected_sum / self.steps
        if self.steps >= self.max_interval:
            return True
        if self.steps < self.min_interval:
            return False
        return considered > 0 and needing >= self.auto_ratio * considered

    def state_dict(self) -> dict:
        windows = {key: (w.piled, w.selected_sum) for key, w in self._windows.items()}
        return {"steps": self.steps, "windows": windows}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        self._windows = {key: _Window(*values) for key, values in state["windows"].items()}

    def reset(self) -> None:
        """A window closed: start counting the next one."""
        self.steps = 0
        self._windows.clear()
