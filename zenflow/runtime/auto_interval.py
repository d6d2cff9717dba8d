"""The adaptive update interval (``update_interval: "auto"``): when to run the CPU update.

The rule: for each weight, compare the energy of the unselected columns' accumulated gradient
(the host accumulator's squared norm) with what a selected column receives in one step, both
per column:

    piled_w    = ||sum over the window of G_unselected||^2 / (columns - k)
    selected_w = mean over the window's steps of ||G_selected||^2 / k

A weight *needs* an update once ``piled_w >= selected_w``: its waiting columns now carry as
much as one step of the columns updated every step. The window closes when at least
``auto_ratio`` of the weights (those with both selected and unselected columns) need one, or
after ``max_interval`` steps, whichever comes first. Concentrated importance (the ZenFlow case)
gives long windows, and so does noise in the unselected columns, which cancels in the sum;
a consistent drift there gives short ones.
"""

from dataclasses import dataclass


@dataclass
class _Window:
    piled: float = 0.0
    selected_sum: float = 0.0


class AutoUpdateInterval:
    def __init__(self, auto_ratio: float, max_interval: int):
        if max_interval < 1:
            raise ValueError(f"max_interval must be >= 1, got {max_interval}")
        self.auto_ratio = auto_ratio
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
