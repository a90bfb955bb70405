"""Start smg (Shepherd Model Gateway) in front of patched AKV workers, with conversation affinity.

``python -m akv.system.launch_router --worker-urls URL [URL ...] [smg flags]`` checks that the
installed router is smg 1.13 (the version checked to pass ``drop_message`` / ``reposition`` through
and to pin routing keys), adds ``--routing-key-override`` (sticky routing keys on any policy) and
``--policy least_load`` unless given, and hands every flag to ``smg launch``.

Every request carrying the ``x-smg-routing-key`` header (``akv.agent.send_chat_request`` sets it
to the conversation's root id, ``CacheOperationHistory.routing_key`` gives it to harnesses that send
requests themselves) goes to the worker its key is pinned to; a new key goes to the worker the
policy picks (``least_load``: the fewest queued requests and the least KV in use, as the workers'
``/v1/loads`` report it) and stays there. A key whose worker stops answering moves to another
worker, which recovers the conversation's KV by prefill.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

from akv import __version__ as akv_version

ROUTER = "smg"
ROUTER_PIN = "1.13.0"
ROUTER_SERIES = "1.13."
INSTALL_COMMAND = f'python -m pip install "{ROUTER}=={ROUTER_PIN}" (or, in the AKV checkout, -e ".[router]")'

STRIPPING_ROUTERS = ("sglang-router",)
"""Routers known to drop the AKV fields: sglang-router (checked: 0.3.2, the last release of that name)
parses chat requests into a typed struct and sends that on, without drop_message and reposition."""

AFFINITY_DEFAULTS: dict[str, str] = {"--policy": "least_load"}
"""Flags added when absent: the policy that picks the worker of a new routing key."""

AFFINITY_SWITCHES: tuple[str, ...] = ("--routing-key-override",)
"""Switches added when absent (smg's alias: ``--sticky-sessions``)."""

_SWITCH_ALIASES = {"--routing-key-override": ("--routing-key-override", "--sticky-sessions")}


class RouterError(RuntimeError):
    """The router cannot be started as asked; the message says why and what to do."""


def installed_versions() -> dict[str, str | None]:
    """The installed versions of smg and of the routers known to drop the AKV fields."""
    versions: dict[str, str | None] = {}
    for name in (ROUTER, *STRIPPING_ROUTERS):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def check_router(versions: dict[str, str | None]) -> str:
    """The smg version to run; RouterError when smg is missing or untested, naming a stripping
    router that is installed instead."""
    smg = versions.get(ROUTER)
    if smg is None:
        stripping = [f"{name} {versions[name]}" for name in STRIPPING_ROUTERS if versions.get(name)]
        if stripping:
            raise RouterError(
                f"{', '.join(stripping)} is installed but smg is not: sglang-router cannot serve AKV, because it "
                "re-serialises chat requests without drop_message and reposition, so every AKV turn would silently "
                f"run as a plain request on the worker. Install its successor smg, which passes them through: "
                f"{INSTALL_COMMAND}")
        raise RouterError(f"smg is not installed; install it with: {INSTALL_COMMAND}")
    if not smg.startswith(ROUTER_SERIES):
        raise RouterError(
            f"smg {smg} is not the tested series {ROUTER_SERIES}x: AKV checked that smg {ROUTER_PIN} passes "
            f"drop_message/reposition through unchanged and pins routing keys; install it with: {INSTALL_COMMAND}")
    return smg


def with_affinity(argv: list[str]) -> list[str]:
    """``argv`` plus the affinity defaults it lacks."""
    flags = {arg.partition("=")[0] for arg in argv}
    added = [item for flag, value in AFFINITY_DEFAULTS.items() if flag not in flags for item in (flag, value)]
    switches = [flag for flag in AFFINITY_SWITCHES if not flags.intersection(_SWITCH_ALIASES[flag])]
    return list(argv) + added + switches


def router_command(argv: list[str]) -> list[str]:
    """The smg command line for ``argv`` (the launcher's own arguments)."""
    return [sys.executable, "-m", ROUTER, "launch", *with_affinity(argv)]


def usage() -> str:
    added = " ".join([*(f"{f} {v}" for f, v in AFFINITY_DEFAULTS.items()), *AFFINITY_SWITCHES])
    return (f"usage: python -m akv.system.launch_router --worker-urls URL [URL ...] [smg flags]\n\n"
            f"{__doc__.strip()}\n\nAdded unless given (default: {added}).\n"
            f"smg's flags: python -m smg launch --help\n")


def main(argv: list[str] | None = None, versions: dict[str, str | None] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    versions = installed_versions() if versions is None else versions
    if "--version" in args:
        print(f"akv {akv_version}; smg {versions.get(ROUTER) or 'not installed'}")
        return 0
    if "-h" in args or "--help" in args:
        print(usage(), flush=True)
        return 0
    try:
        check_router(versions)
    except RouterError as exc:
        print(f"akv.system.launch_router: {exc}", file=sys.stderr)
        return 2
    command = router_command(args)
    sys.stdout.flush()
    os.execv(command[0], command)  # smg replaces this process


if __name__ == "__main__":
    sys.exit(main())
