"""Griffe extension for the docs build only (``mkdocs.yml``; not part of the package).

The docstrings cross-reference with Sphinx roles (``:class:`Chunk```, ``:func:`~kvnotes.kv.patch.patched_logits```,
``:mod:`.tokens```). Markdown has no roles, so each becomes an *optional* autorefs reference: a link
where the target is rendered in the API reference, plain code where it is not (neither warns).
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|obj|exc|const):`(~?)([^`]+)`")


def _members(obj):
    """Every object defined under ``obj`` (imported names are skipped)."""
    for member in obj.members.values():
        if member.is_alias:
            continue
        yield member
        yield from _members(member)


def _exists(collection, path: str) -> bool:
    try:
        collection[path]
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False
    return True


def _resolve(obj, target: str) -> str:
    """The dotted path a role's target names, seen from ``obj`` (absolute, ``.relative`` or a name in scope)."""
    collection = obj.modules_collection
    if target.startswith("."):
        module = obj.module
        base = module.path.split(".") if module.is_init_module else module.path.split(".")[:-1]
        level = len(target) - len(target.lstrip("."))
        base = base[: len(base) - (level - 1)] if level > 1 else base
        return ".".join([*base, target.lstrip(".")])
    if _exists(collection, target):
        return target
    scope = obj
    while scope is not None:
        candidate = f"{scope.path}.{target}"
        if _exists(collection, candidate):
            return candidate
        scope = scope.parent
    return target


class RstRoles(griffe.Extension):
    """Rewrite reST roles in every docstring of a loaded package."""

    def on_package(self, *, pkg, loader, **kwargs) -> None:
        for obj in [pkg, *_members(pkg)]:
            if obj.docstring is None or ":" not in obj.docstring.value:
                continue

            def link(match, obj=obj):
                tilde, target = match.groups()
                target = target.strip().removesuffix("()")
                shown = target.lstrip(".").rsplit(".", 1)[-1] if tilde else target
                ident = _resolve(obj, target)
                return f'<autoref optional identifier="{ident}"><code>{shown}</code></autoref>'

            obj.docstring.value = ROLE.sub(link, obj.docstring.value)
