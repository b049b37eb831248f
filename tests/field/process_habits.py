"""A script that leans on how its process starts and ends, as long jobs do: it configures
logging its own way, keeps a log file it never closes, says goodbye in an atexit handler, and
leaves a non-daemon thread to finish after its last line. It looks at its process at its
first line (what is open, how signals are handled) and prints what it sees, so a launcher
that leaves anything of its own behind shows in the output.

    python process_habits.py --out DIR [--steps 20]
"""
import atexit
import os
import signal
import stat
import sys
import threading


def held_sockets():
    """How many sockets this process holds (a collector's listening socket would be one)."""
    count = 0
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        try:
            count += stat.S_ISSOCK(os.fstat(int(name)).st_mode)
        except OSError:  # the directory's own fd, closed by now
            pass
    return count


# Before anything else: what the process came with.
print(f"sockets held at start: {held_sockets()}")
print(f"SIGINT handler: {signal.getsignal(signal.SIGINT).__name__}")
print(f"SIGTERM handler: {signal.getsignal(signal.SIGTERM)}")
print(f"argv: {[os.path.basename(sys.argv[0]), *sys.argv[1:]]}")

import argparse  # noqa: E402  (the checks above come first on purpose)
import logging  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    # Its own logging set-up: a handler someone else configured first would make this a no-op.
    logging.basicConfig(format="LOG %(levelname)s %(name)s: %(message)s", level=logging.INFO, stream=sys.stdout)
    log = logging.getLogger("habits")
    log.info("logging is the script's own")
    # Buffered and never closed: only the interpreter's own end flushes it.
    journal = open(os.path.join(args.out, "journal.txt"), "w")
    atexit.register(lambda: print("atexit: goodbye from the script", flush=True))

    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    inputs = torch.randn(args.steps, 16, 4)
    targets = inputs.sum(dim=2, keepdim=True)
    for step in range(args.steps):
        loss = nn.functional.mse_loss(model(inputs[step]), targets[step])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        journal.write(f"step {step} loss {loss.item():.6f}\n")
    torch.save(model.state_dict(), os.path.join(args.out, "model.pt"))
    print(f"updates {args.steps}")

    def last_words():
        time.sleep(0.2)
        print("a thread finishing after the last line", flush=True)

    threading.Thread(target=last_words).start()  # not a daemon: the interpreter waits for it
    log.info("main done")


main()
