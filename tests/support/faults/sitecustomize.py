"""Fault injection for tests, outside the product: Python imports this module at start-up
in every process of a stack started with faults=True (tests/support/stack.py puts this
folder first on their PYTHONPATH). In an engine's processes, the simulated model's next
step raises once the file `fault-<engine name>` appears in KVOPS_TEST_FAULT_DIR
(Stack.arm_fault makes it); the file is consumed, so one step fails. With
KVOPS_TEST_STAGE_BLOCKS in the stack's env, an engine core stages that many
blocks of its moves between two steps instead of STAGE_BLOCKS, so that a move of a few
hundred blocks takes seconds: long enough for a test to kill an engine while the blocks
are being copied (tests/engine/test_migration_link.py lowers it in-process the same way).

The disk tier's writes (engine/kv/tiers/disk_files.write_new, as the tier calls it), in
an engine's processes too: while `disk-full-<engine>` exists, each fails as on a full
disk (ENOSPC) once its first part is written; once `tear-<engine>` appears, the next one
stops after its first part (its temporary file made), writes `torn-<engine>` (the
block's file name) and hangs there, for a test to SIGKILL the engine mid-write (the
trigger is consumed).

In the ops worker (KVOPS_TEST_STALL_WHAT_IF set in its env), a what-if replay
(engine/sim/replay_stats.replay_stats) writes `what-if-replaying` and waits while
`stall-what-if` exists, so that a test can kill the worker mid-run."""
import errno
import os
import threading

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


def _disk_faults() -> None:
    from engine.kv.tiers import disk

    write_new = disk.write_new
    full = os.path.join(_DIR, f"disk-full-{_ENGINE}")
    tear = os.path.join(_DIR, f"tear-{_ENGINE}")

    class FirstPartThen(list):
        """The parts of a block's file, as write_new iterates them: the first, then
        `then()` (which raises or never returns)."""

        def __init__(self, parts, then):
            super().__init__(parts)
            self.then = then

        def __iter__(self):
            yield self[0]
            self.then()
            yield from self[1:]

    def no_space():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def writing(folder, name, data):
        parts = data if isinstance(data, list) else [data]
        if os.path.exists(full):
            return write_new(folder, name, FirstPartThen(parts, no_space))
        try:
            os.remove(tear)
        except FileNotFoundError:
            return write_new(folder, name, data)
        return write_new(folder, name, FirstPartThen(parts, lambda: _hang(name)))

    disk.write_new = writing


def _hang(name: str) -> None:
    said = os.path.join(_DIR, f"torn-{_ENGINE}")
    with open(said + ".part", "w") as f:
        f.write(name)
    os.replace(said + ".part", said)
    threading.Event().wait()


def _stall_what_if() -> None:
    import time

    from engine.sim import replay_stats as module

    replay = module.replay_stats
    stall = os.path.join(_DIR, "stall-what-if")

    def stalled(*args, **kwargs):
        open(os.path.join(_DIR, "what-if-replaying"), "w").close()
        while os.path.exists(stall):
            time.sleep(0.05)
        return replay(*args, **kwargs)

    module.replay_stats = stalled


if _DIR and _ENGINE:
    _arm()
    _disk_faults()
    if _STAGE_BLOCKS:
        _slow_copies()
if _DIR and os.environ.get("KVOPS_TEST_STALL_WHAT_IF"):
    _stall_what_if()
