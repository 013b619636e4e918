"""One line for an error, with what to do about it when we know (a package to import)."""

from __future__ import annotations

import re

from .._errors import alone, first_line

__all__ = ["NAMESPACE_PACKAGES", "NAME_PREFIX_PACKAGES", "describe", "first_line"]

NAMESPACE_PACKAGES = {
    "ALE": "ale_py",
    "MetaWorld": "metaworld",
    "GymV21": "shimmy",
    "GymV26": "shimmy",
}
"""Env-id namespaces (``NS/Name-v0``) registered by a package that must be imported first."""

NAME_PREFIX_PACKAGES = {"MiniGrid-": "minigrid", "BabyAI-": "minigrid"}
"""Env ids without a namespace, registered by a package when it is imported."""


def describe(exc: BaseException) -> str:
    """:func:`first_line`, and the fix for an env id a package registers."""
    return first_line(exc) + namespace_hint(alone(exc))


def namespace_hint(exc: BaseException) -> str:
    """What to do about gymnasium's NamespaceNotFound (or NameNotFound for ids a known
    package registers): import the registering package."""
    if type(exc).__name__ == "NameNotFound":
        for prefix, registrar in NAME_PREFIX_PACKAGES.items():
            if f"`{prefix}" in str(exc):
                return (
                    f" (these envs are registered by the {registrar} package: install it in "
                    f"this environment and add --package {registrar})"
                )
        return ""
    if type(exc).__name__ != "NamespaceNotFound":
        return ""
    match = re.search(r"Namespace (\S+) not found", str(exc))
    namespace = match.group(1) if match else None
    package = NAMESPACE_PACKAGES.get(namespace or "")
    if package is None:
        return (
            " (import the package that registers this namespace first: "
            "--package PACKAGE, or --env PACKAGE:NAMESPACE/ENV)"
        )
    return (
        f" (the {namespace} envs are registered by the {package} package: install it in "
        f"this environment and add --package {package}, or use --env {package}:{namespace}/...)"
    )
