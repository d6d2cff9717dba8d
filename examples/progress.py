"""Progress of a long loop that reads well where it is written: a live tqdm bar on a terminal,
a few summary lines in a log file (CI, ``> run.log``), where a bar would write a line per
update."""

import sys
import time

from tqdm import tqdm


class Progress:
    """Iterates over ``range(total)``. Owns where it reports (``stream``), the values shown
    beside the count (``set_postfix``) and, without a terminal, which quarters it has logged."""

    def __init__(self, total: int, desc: str, stream=None, lines: int = 4):
        self.total, self.desc = total, desc
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()
        self._bar = tqdm(total=total, desc=desc, file=self.stream) if self.live else None
        self._marks = {max(1, round(total * (i + 1) / lines)) for i in range(lines)}
        self._postfix: dict[str, str] = {}
        self._start = time.perf_counter()

    def set_postfix(self, **values) -> None:
        self._postfix = {key: str(value) for key, value in values.items()}
        if self._bar is not None:
            self._bar.set_postfix(self._postfix, refresh=False)

    def __iter__(self):
        for i in range(self.total):
            yield i
            self._advance(i + 1)
        if self._bar is not None:
            self._bar.close()

    def _advance(self, done: int) -> None:
        if self._bar is not None:
            self._bar.update(1)
        elif done in self._marks:
            values = "".join(f" {key}={value}" for key, value in self._postfix.items())
            elapsed = time.perf_counter() - self._start
            print(
                f"{self.desc}: {done}/{self.total} ({done / self.total:.0%}) "
                f"{elapsed:.1f} s{values}",
                file=self.stream,
                flush=True,
            )
