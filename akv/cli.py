"""What every AKV command line shares: help that shows each option's default, and ``--version``."""

from __future__ import annotations

import argparse
import copy
from typing import Any

from akv import __version__


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; an option's help ends with its default unless it names one already
    (or the default is None, False or a flag's absence)."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _shows_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not _shows_default(action):
            return text
        return f"{text} (default: %(default)s)"


def _shows_default(action: argparse.Action) -> bool:
    return bool(action.option_strings) and not any(
        action.default is skip for skip in (None, False, argparse.SUPPRESS))


def parser(prog: str | None = None, description: str | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    """An ArgumentParser with :class:`HelpFormatter` and ``--version``."""
    made = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter, **kwargs)
    made.add_argument("--version", action="version", version=f"akv {__version__}")
    return made
