"""One byte range of a trace file, read in a process of its own, so that a large file keeps every core busy.

    python -m harness.analysis.worker FILE START STOP [FILE START STOP ...]

writes `("ok", [Totals, ...])` or `("error", message)`, pickled, to its standard output: the totals
of the events in bytes [START, STOP) of each FILE (`summary.summarize_range`; STOP `-`: to the end),
or the InputError that reading one raised. A plain child process rather than `multiprocessing`: it
costs no resource tracker process and no semaphores, and it is safe to start from a threaded sweep
(nothing is forked with the caller's threads or SSH connections). It imports the reader alone, not
the command line.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from harness.analysis.summary import summarize_range
from harness.errors import InputError


def main(argv: list[str]) -> int:
    ranges = [(Path(path), int(start), None if stop == "-" else int(stop))
              for path, start, stop in zip(argv[0::3], argv[1::3], argv[2::3], strict=True)]
    try:
        result: tuple = ("ok", [summarize_range(*r) for r in ranges])
    except InputError as e:
        result = ("error", str(e))
    pickle.dump(result, sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
