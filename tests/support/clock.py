"""A clock a test sets by hand, for what takes one (BlockPool's soft pins, EventLog's
timestamps): durations come out exact, and no test waits for time to pass."""


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now  # seconds; the test moves it

    def __call__(self) -> float:
        return self.now
