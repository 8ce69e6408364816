"""Options of the ``tidefeed`` command line: help with defaults, environment variables
scoped per command, value checks, logging set-up and the exit codes.

Environment variables. Every option of a command reads ``TIDEFEED_<COMMAND>_<OPTION>``
(``TIDEFEED_SERVE_PORT``, ``TIDEFEED_EMIT_ON_BAD_RECORD``). The short form
``TIDEFEED_<OPTION>`` is read too where it cannot mean two things: for options that one
command alone has (``TIDEFEED_SOURCE``), and for :data:`SHARED` options, which mean the same
in every command (``TIDEFEED_LOG``, ``TIDEFEED_FEED``, ``TIDEFEED_TOKEN``, ``TIDEFEED_KEY``).
``TIDEFEED_PORT`` or ``TIDEFEED_FORMAT`` would mean different things to ``serve`` and
``receive``, or to ``check`` and ``emit``, and are not read. A value from the environment is
checked exactly like the flag (it is parsed as if given first on the command line, so a
flag given on the command line wins) and an error names the variable.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import orjson

from feed.errors import EXIT_USAGE, UsageError

__all__ = [
    "DEFAULT_LOG_LEVEL",
    "LOG_LEVELS",
    "non_negative_int",
    "scope_env",
    "with_env",
    "EXIT_FAILED",
    "EXIT_INCOMPLETE",
    "EXIT_OK",
    "EXIT_USAGE",
    "SHARED",
    "OptionParser",
    "checked_token",
    "configure_logging",
    "env_names",
    "UsageError",
    "exit_code_for_signal",
    "non_negative_float",
    "port",
    "positive_float",
    "positive_int",
    "version",
]

EXIT_OK = 0
EXIT_FAILED = 1  # invalid input, a failed command
#: a batch ``emit`` whose input ended inside source transactions: what was complete is
#: committed, the rest is held back (docs/emitter.md)
EXIT_INCOMPLETE = 3
#: options that mean the same to every command that has them
SHARED = ("--log", "--feed", "--token", "--key", "--log-level", "--log-format", "--debug")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "info"


def exit_code_for_signal(signum: int) -> int:
    """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("tidefeed")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _env_suffix(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_").upper()


def env_names(command: str, flag: str, *, short: bool) -> list[str]:
    """The variables ``flag`` of ``command`` reads, the scoped one first."""
    names = [f"TIDEFEED_{command.upper()}_{_env_suffix(flag)}"]
    if short:
        names.append(f"TIDEFEED_{_env_suffix(flag)}")
    return names


# ---- value types: argparse turns a ValueError/ArgumentTypeError into "invalid value" ----
def _number(kind: type, text: str, *, low: float | None, what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if low is not None and value < low:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    return int(_number(int, text, low=1, what="a whole number >= 1"))


def positive_float(text: str) -> float:
    value = _number(float, text, low=None, what="a number of seconds > 0")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return float(value)


def non_negative_float(text: str) -> float:
    return float(_number(float, text, low=0, what="a number of seconds >= 0"))


def non_negative_int(text: str) -> int:
    return int(_number(int, text, low=0, what="a whole number >= 0"))


def port(text: str) -> int:
    value = _number(int, text, low=1, what="a TCP port (1-65535)")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return int(value)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default (when it has one) and the variables it reads."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and "%(default)" not in text
            and default not in (None, False, argparse.SUPPRESS)
            and not isinstance(action, argparse._HelpAction | argparse._VersionAction)
        ):
            text += " (default: %(default)s)"
        env = getattr(action, "env_names", None)
        if env:
            text += f" [env: {', '.join(env)}]"
        return text


class OptionParser(argparse.ArgumentParser):
    """An ArgumentParser whose options also come from the environment (module docstring).

    Subcommand parsers record each option's variables; :meth:`parse_with_env` puts the
    values found in the environment in front of the command line's own arguments."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", _HelpFormatter)
        # no abbreviations: --sourc would be --source today and ambiguous tomorrow
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)
        self.env_options: list[argparse.Action] = []
        self._from_env: dict[str, str] = {}  # flag -> variable, for error messages
        self._raw: list[str] = []  # what this (sub)command was given, for error messages

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._raw = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _meant(self, flag: str) -> str:
        """ " (did you mean --x?)" for a flag the command given does not know."""
        import difflib

        known: list[str] = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and self._raw:
                command = action.choices.get(self._raw[0])
                if command is not None:
                    known = list(command._option_string_actions)
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
        return f" (did you mean {close[0]}?)" if close else ""

    def _unknown_flag(self) -> str | None:
        """The first flag given that this parser does not know, with the one meant."""
        import difflib

        known = list(self._option_string_actions)
        for arg in self._raw:
            if arg == "--":
                break
            flag = arg.split("=", 1)[0]
            if flag.startswith("-") and len(flag) > 1 and flag not in known:
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
                return f"unknown option {flag}" + (f" (did you mean {close[0]}?)" if close else "")
        return None

    def option(self, *flags: str, **kw: Any) -> argparse.Action:
        """Add an option that also reads its environment variables (set later by
        :func:`scope_env`, once every command's options are known)."""
        action = self.add_argument(*flags, **kw)
        self.env_options.append(action)
        return action

    def env_arguments(self) -> list[str]:
        """The arguments the environment gives this (sub)command, flags first."""
        out: list[str] = []
        for action in self.env_options:
            for name in getattr(action, "env_names", ()):
                value = os.environ.get(name)
                if value is None:
                    continue
                flag = action.option_strings[-1]
                self._from_env[flag] = name
                if action.nargs == 0:  # a switch: set by any value but 0/false/no/empty
                    if value.strip().lower() not in ("", "0", "false", "no"):
                        out.append(flag)
                else:
                    out.append(f"{flag}={value}")
                break
        return out

    def env_variable(self, flag: str) -> str | None:
        """The variable that gave ``flag`` its value, if the environment did."""
        return self._from_env.get(flag)

    def error(self, message: str) -> NoReturn:
        # a mistyped flag first: "--souce" is the mistake, not the --source it left out
        if message.startswith("the following arguments are required"):
            unknown = self._unknown_flag()
            if unknown is not None:
                message = unknown
        elif message.startswith("unrecognized arguments: "):
            message += self._meant(message.split(": ", 1)[1].split()[0].split("=", 1)[0])
        for flag, name in self._from_env.items():
            if message.startswith("argument ") and flag in message.split(":", 1)[0]:
                message += f" (from ${name})"
                break
        super().error(message)


def scope_env(commands: dict[str, OptionParser]) -> None:
    """Give every command's options their variable names (module docstring)."""
    seen: dict[str, int] = {}
    for parser in commands.values():
        for action in parser.env_options:
            seen[action.option_strings[-1]] = seen.get(action.option_strings[-1], 0) + 1
    for command, parser in commands.items():
        for action in parser.env_options:
            flag = action.option_strings[-1]
            short = flag in SHARED or seen[flag] == 1
            action.env_names = env_names(command, flag, short=short)  # type: ignore[attr-defined]


def with_env(argv: Sequence[str], commands: dict[str, OptionParser]) -> list[str]:
    """``argv`` with the environment's values of its command's options put first."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg.startswith("-"):
            continue
        parser = commands.get(arg)
        if parser is None:
            break
        return [*argv[: i + 1], *parser.env_arguments(), *argv[i + 1 :]]
    return argv


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out).decode()


def configure_logging(level: str = DEFAULT_LOG_LEVEL, fmt: str = "text") -> None:
    """tidefeed's one logger set-up: ``tidefeed.*`` at ``level`` on stderr, as text lines or
    JSON objects; py4j's chatter (connection open/close) only when it is a warning."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("tidefeed").setLevel(level.upper())
    logging.getLogger("py4j").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def checked_token(token: str | None, command: str) -> str | None:
    """``--token`` as given; an empty one (``--token ""``, an empty ``TIDEFEED_TOKEN``) is
    refused rather than taken as "no token": that would turn authentication off."""
    if token is not None and not token.strip():
        raise SystemExit(
            f"tidefeed {command}: --token is empty; give a token, or leave the flag (and "
            "TIDEFEED_TOKEN) out to run without one"
        )
    return token
