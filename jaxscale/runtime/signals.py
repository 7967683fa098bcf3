"""Ctrl-C held back while something must not be cut in half (a checkpoint being written).

Python turns SIGINT into KeyboardInterrupt at whatever bytecode the main thread is running.
Inside a library that writes with its own threads and event loops (Orbax), that leaves a
half-written step and threads that die with tracebacks at interpreter shutdown. Inside
`interrupts_held()` a Ctrl-C is noted instead (with one line saying what it waits for), and
raised as KeyboardInterrupt the moment the block ends: the work finishes, then the program
stops as the user asked. Off the main thread (where Python delivers no signals) it does
nothing.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def interrupts_held(waiting_for: str = "", say: Callable[[str], None] | None = None,
                    reraise: bool = True) -> Iterator[None]:
    """Hold SIGINT for the block; raise KeyboardInterrupt after it if one came (unless
    `reraise` is False: the block is the program's last work anyway).

    `say(line)` is called once, at the first Ctrl-C, with "finishing WAITING_FOR before
    stopping" (nothing is said when `say` is None, or when stderr is busy writing at that
    instant). A SIGINT handler that is not Python's own (ignored, or the host program's)
    is left alone; inside another held block this one adds nothing: the outermost raises.
    """
    previous = signal.getsignal(signal.SIGINT)
    if (threading.current_thread() is not threading.main_thread()
            or previous not in (signal.default_int_handler, signal.SIG_DFL)):
        yield
        return
    held: list[int] = []

    def hold(signum, frame):
        if not held and say is not None:
            try:
                say(f"finishing {waiting_for or 'the work in flight'} before stopping")
            except RuntimeError:  # stderr was mid-write when the signal came: say nothing
                pass
        held.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held and reraise:
        raise KeyboardInterrupt
