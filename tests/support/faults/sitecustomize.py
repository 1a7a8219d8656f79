"""Fault injection for tests, outside the product: Python imports this module at start-up
in every process of a stack started with faults=True (tests/support/stack.py puts this
folder first on their PYTHONPATH). In an engine's processes, the simulated model's next
step raises once the file `fault-<engine name>` appears in KVOPS_TEST_FAULT_DIR
(Stack.arm_fault makes it); the file is consumed, so one step fails."""
import os

_DIR = os.environ.get("KVOPS_TEST_FAULT_DIR")
_ENGINE = os.environ.get("KVOPS_ENGINE_NAME")


def _arm() -> None:
    from engine.model.simulated_runner import SimulatedRunner

    trigger = os.path.join(_DIR, f"fault-{_ENGINE}")
    forward = SimulatedRunner.forward

    def failing(self, out):
        try:
            os.remove(trigger)
        except FileNotFoundError:
            return forward(self, out)
        raise RuntimeError("injected fault (tests/support/faults)")

    SimulatedRunner.forward = failing


if _DIR and _ENGINE:
    _arm()
