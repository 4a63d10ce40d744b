"""`accelerate launch` as rlhf runs it: the same arguments and processes, but when a started process fails,
the launcher exits with that process's exit code (`rlhf` then adds its one line) instead of printing its own
Python traceback (torch's `ChildFailedError` report) under the process's one-line error.

    python -m rlhf_cli.accelerate_launch <accelerate launch arguments>

`rlhf_cli.supervise.handle` runs this; `rlhf ... dry_run=true` prints the plain `accelerate launch` line,
which does the same work.
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # its "failed (exitcode: N) local_rank: ..." record would repeat what `rlhf` reports in its one line
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    args = launch_command_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        launch_command(args)
    except ChildFailedError as e:
        code = e.get_first_failure()[1].exitcode
        return 128 - code if code < 0 else code if 0 < code < 256 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
