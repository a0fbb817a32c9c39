"""Running a command line: argv in, an exit status out, errors as one line each.

Shared by ``prefixkv`` (``prefixkv.cli``) and the parts that can run their command alone
(``python -m prefixkv.bench.cli``), so neither imports the other.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from .errors import PrefixKVError


_NEGATIVE_VALUE = re.compile(r"^-\d")


def _attach_negative_values(argv: list[str]) -> list[str]:
    """``--pool -1GiB`` as ``--pool=-1GiB``: argparse takes ``-1GiB`` for an option and says only
    "expected one argument"; attached, the option's own check names the bad value."""
    out: list[str] = []
    for item in argv:
        if out and _NEGATIVE_VALUE.match(item) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={item}"
        else:
            out.append(item)
    return out


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command parser ``args`` was parsed by: ``compare``, ``tier stats``, ..."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return _command_parser(action.choices[name], args)
    return parser


def _refuse_unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    """Unrecognized arguments, refused by the command's own parser (its usage, not the top level's),
    with the option a misspelt one was likely meant to be (``--polices``: ``--policies``)."""
    import difflib

    command = _command_parser(parser, args)
    options = [o for a in command._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for extra in extras:
        if extra.startswith("--"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], options, n=1, cutoff=0.6)
            if close:
                hints.append(f"{extra.split('=', 1)[0]}: did you mean {close[0]}?")
    command.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else ""))


def run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """Parse ``argv`` and run the chosen command (``args.func``), as the shell expects: its
    status, a one-line error naming the command, 130 and "interrupted" on Ctrl-C."""
    try:
        args, extras = parser.parse_known_args(_attach_negative_values(argv))
        if extras:
            _refuse_unrecognized(parser, args, extras)
        try:
            return args.func(args)
        except BrokenPipeError:  # `prefixkv ... | head`: the reader left; not an error of ours
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        except (PrefixKVError, ValueError, OSError, RuntimeError) as exc:
            parser.exit(2, f"prefixkv {args.command}: error: {exc}\n")
    except KeyboardInterrupt:
        # Ctrl-C: one line and the shell's status for SIGINT, no traceback; outputs were written
        # atomically, so nothing partial is left behind.
        print("interrupted", file=sys.stderr)
        return 130
