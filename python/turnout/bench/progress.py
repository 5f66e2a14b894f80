"""A one-line progress bar on stderr, written by rank 0 of a measurement."""
import sys


class Progress:
    """``[#####.....] 3/9 ceiling 24 SMs``, redrawn in place on a terminal; one
    line per step otherwise, so a log shows where a run stopped."""

    def __init__(self, total: int, label: str, enabled: bool = True, width: int = 20, stream=None) -> None:
        self.total, self.label, self.enabled, self.width = total, label, enabled, width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.count = 0
        self._last_len = 0

    def step(self, detail: str = "") -> None:
        """Marks the start of the next step."""
        if not self.enabled:
            return
        self.count += 1
        filled = self.width * self.count // max(self.total, 1)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.count}/{self.total} {self.label} {detail}".rstrip()
        if self.tty:
            # Pad so a shorter line covers the longer one before it.
            self.stream.write("\r" + line.ljust(self._last_len))
            self._last_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self.count:
            self.stream.write("\n")
            self.stream.flush()
