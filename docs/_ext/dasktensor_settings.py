"""The settings page, made at build time from the package's two settings files.

``dasktensor/dasktensor-schema.yaml`` gives every key its type and description,
``dasktensor/dasktensor.yaml`` its default.  The directive

.. code-block:: rst

   .. dasktensor-settings::

writes one section per group of keys (``dasktensor.remote``, ...) and one ``confval`` entry
per key: its type, its default as the YAML file spells it, the environment variable that
sets it, and its description.  Pages refer to a key with ``:confval:`dasktensor.x.y```
(``{confval}`` in Markdown), so a key renamed in the YAML files breaks the build (``-W``)
wherever the documentation still names the old one.  Nothing here is copied by hand.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

PACKAGE = Path(__file__).resolve().parents[2] / "dasktensor"
DEFAULTS = PACKAGE / "dasktensor.yaml"
SCHEMA = PACKAGE / "dasktensor-schema.yaml"


def raw_defaults(node: yaml.Node, prefix: str = "") -> dict[str, str]:
    """``{dotted key: default as written in the YAML file}`` (``5.0e+7``, not ``50000000.0``)."""
    found = {}
    for key, value in node.value:
        name = prefix + key.value
        if isinstance(value, yaml.MappingNode):
            found.update(raw_defaults(value, name + "."))
        else:
            found[name] = value.value if value.value != "" else "null"
    return found


def groups(schema: dict, prefix: str = "dasktensor") -> list[tuple[str, str, dict[str, dict]]]:
    """``[(group, its description, {key: schema entry})]``: the top-level keys first, then
    one group per object of the schema, in the schema's order."""
    leaves, nested = {}, []
    for name, entry in schema.get("properties", {}).items():
        if entry.get("type") == "object":
            nested.extend(groups(entry, f"{prefix}.{name}"))
        else:
            leaves[f"{prefix}.{name}"] = entry
    own = [(prefix, schema.get("description", ""), leaves)] if leaves else []
    return own + nested


def type_text(entry: dict) -> str:
    kinds = entry.get("type", "any")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    text = " or ".join(kinds)
    if "enum" in entry:
        text += ", one of " + ", ".join(f"``{v}``" for v in entry["enum"])
    return text


def environment_variable(key: str) -> str:
    """The variable Dask reads for ``key``: ``DASK_`` and the key's parts joined by ``__``."""
    return "DASK_" + "__".join(part.replace("-", "_").upper() for part in key.split("."))


def escaped(text: str) -> str:
    """Plain text as reStructuredText: no character starts inline markup."""
    for char in "\\*`|_[]":
        text = text.replace(char, "\\" + char)
    return text


def settings_rst() -> list[str]:
    schema = yaml.safe_load(SCHEMA.read_text())["properties"]["dasktensor"]
    defaults = raw_defaults(yaml.compose(DEFAULTS.read_text()))
    lines: list[str] = []
    for group, description, entries in groups(schema):
        lines += [f"``{group}``", "~" * (len(group) + 4), ""]
        if description:
            lines += [escaped(description.strip()), ""]
        for key, entry in entries.items():
            if key not in defaults:
                raise ValueError(
                    f"{key} is in {SCHEMA.name} but has no default in {DEFAULTS.name}"
                )
            lines += [
                f".. confval:: {key}",
                f"   :type: {type_text(entry)}",
                f"   :default: ``{defaults[key]}``",
                "",
                f"   Environment variable: ``{environment_variable(key)}``",
                "",
            ]
            lines += ["   " + line for line in escaped(entry["description"].strip()).splitlines()]
            lines.append("")
    missing = sorted(set(defaults) - {k for _, _, e in groups(schema) for k in e})
    if missing:
        raise ValueError(
            f"{missing} have defaults in {DEFAULTS.name} but no entry in {SCHEMA.name}"
        )
    return lines


class SettingsDirective(SphinxDirective):
    """``.. dasktensor-settings::``: every setting, grouped, with type, default, description."""

    has_content = False

    def run(self):
        for path in (DEFAULTS, SCHEMA):
            self.env.note_dependency(str(path))
        holder = nodes.section()
        holder.document = self.state.document
        nested_parse_with_titles(self.state, StringList(settings_rst(), str(SCHEMA)), holder)
        return holder.children


def setup(app):
    app.add_directive("dasktensor-settings", SettingsDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
