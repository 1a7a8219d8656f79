"""Fault injection for tests, outside the product: Python imports this module at start-up
in every process of a stack started with faults=True (tests/support/stack.py puts this
folder first on their PYTHONPATH). In an engine's processes, the simulated model's next
step raises once the file `fault-<engine name>` appears in KVOPS_TEST_FAULT_DIR
(Stack.arm_fault makes it); the file is consumed, so one step fails. With
KVOPS_TEST_STAGE_BLOCKS in the stack's env, an engine core stages that many
blocks of its moves between two steps instead of STAGE_BLOCKS, so that a move of a few
hundred blocks takes seconds: long enough for a test to kill an engine while the blocks
are being copied (tests/engine/test_migration_link.py lowers it in-process the same way)."""
import os
import sys

_DIR = os.environ.get("KVOPS_TEST_FAULT_DIR")
_ENGINE = os.environ.get("KVOPS_ENGINE_NAME")
_STAGE_BLOCKS = os.environ.get("KVOPS_TEST_STAGE_BLOCKS")


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


def _slow_copies() -> None:
    from engine.transfer import link

    link.STAGE_BLOCKS = int(_STAGE_BLOCKS)


if _DIR and _ENGINE:
    # This checkout's engine: at start-up the interpreter has not put the script's or
    # the working folder on sys.path yet, and an editable install of another checkout
    # (a git worktree's shared virtualenv) would otherwise be the one patched, and run
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))))
    _arm()
    if _STAGE_BLOCKS:
        _slow_copies()
