"""argparse value types shared by the ``duetime`` subcommands: one message style everywhere
(``must be an integer >= 1, got 'x'``), which argparse prints as a one-line usage error."""

from __future__ import annotations

import argparse


def _int(text: str, lo: int, hi: int | None = None) -> int:
    what = f"an integer >= {lo}" if hi is None else f"an integer in {lo}..{hi}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < lo or (hi is not None and value > hi):
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int(text, 1)


def count(text: str) -> int:
    """An integer >= 0."""
    return _int(text, 0)


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    return _int(text, 0, 65535)


def positive_float(text: str) -> float:
    """A number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def unit_rate(text: str) -> float:
    """A number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def key_value(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` (a policy parameter on the command line; the policy checks the value)."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"must be NAME=VALUE, got {text!r}")
    return name.strip(), value.strip()


def frontend(text: str):  # -> FrontendModel
    """``REQ_MS,CHUNK_MS[,N]``: an API server's milliseconds of work per request and per
    output chunk, and N servers (:class:`~duetime.engine.frontend.FrontendModel`)."""
    from duetime.engine.frontend import FrontendModel

    parts = [v.strip() for v in text.split(",")]
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"expected REQ_MS,CHUNK_MS[,N], e.g. 1.6,0.09, got "
                                         f"{text!r}")
    try:
        return FrontendModel.from_dict(dict(zip(("request_ms", "chunk_ms", "servers"), parts,
                                                strict=False)))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def profile(text: str) -> str:
    """An engine profile's name: a measured one, or ``MODEL@GPU[xN]`` derived on other
    hardware (:func:`duetime.engine.profiles.load_profile`)."""
    from duetime.engine.profiles import load_profile

    try:
        load_profile(text)
    except KeyError as e:
        raise argparse.ArgumentTypeError(e.args[0]) from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
