"""One source per setting: ``dasktensor.yaml`` (defaults) and ``dasktensor-schema.yaml``
(type and description) hold the same keys, the defaults fit the schema, and every key
the code reads, or the tests and benchmarks set, is in both."""

from __future__ import annotations

import ast
from pathlib import Path

import dask.config
import jsonschema
import pytest
import yaml

import dasktensor  # noqa: F401  (loads the defaults into dask.config)

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = yaml.safe_load((ROOT / "dasktensor" / "dasktensor.yaml").read_text())
SCHEMA = yaml.safe_load((ROOT / "dasktensor" / "dasktensor-schema.yaml").read_text())


def default_keys(tree: dict, prefix: str = "") -> set[str]:
    """The leaf keys of a defaults tree, dotted (``remote.probe-after``)."""
    keys = set()
    for k, v in tree.items():
        keys |= default_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
    return keys


def schema_entries(node: dict, prefix: str = "") -> dict[str, dict]:
    """``{dotted key: schema entry}`` of a schema's leaves."""
    found = {}
    for k, v in node.get("properties", {}).items():
        if v.get("type") == "object":
            found.update(schema_entries(v, f"{prefix}{k}."))
        else:
            found[prefix + k] = v
    return found


def keys_read(paths) -> dict[str, list[str]]:
    """``{key: [where]}`` of every setting read in ``paths``: ``_config.get("k")``,
    ``_config.seconds("k")``, ``dask.config.get("dasktensor.k")``, and the keys of a
    ``dask.config.set({"dasktensor.k": ...})``."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = ast.unparse(node.func.value)
            name = node.func.attr
            strings = []
            if owner == "_config" and name in ("get", "seconds") and node.args:
                strings = [("", node.args[0])]
            elif owner == "dask.config" and name == "get" and node.args:
                strings = [("dasktensor.", node.args[0])]
            elif owner == "dask.config" and name == "set" and node.args:
                if isinstance(node.args[0], ast.Dict):
                    strings = [("dasktensor.", k) for k in node.args[0].keys if k is not None]
            for prefix, arg in strings:
                if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                    continue
                if not arg.value.startswith(prefix):
                    continue
                key = arg.value[len(prefix) :].replace("_", "-")  # Dask reads both
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                found.setdefault(key, []).append(where)
    return found


def python_files(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]


def test_the_defaults_and_the_schema_hold_the_same_keys():
    defaults = default_keys(DEFAULTS["dasktensor"])
    entries = schema_entries(SCHEMA["properties"]["dasktensor"])
    assert defaults == set(entries), (
        f"only in dasktensor.yaml: {sorted(defaults - set(entries))}; "
        f"only in the schema: {sorted(set(entries) - defaults)}"
    )


@pytest.mark.parametrize("key", sorted(schema_entries(SCHEMA["properties"]["dasktensor"])))
def test_every_setting_has_a_type_and_a_description(key):
    entry = schema_entries(SCHEMA["properties"]["dasktensor"])[key]
    assert entry.get("type"), f"dasktensor.{key}: no type"
    assert len(entry.get("description", "").split()) >= 5, f"dasktensor.{key}: no description"


def test_the_defaults_fit_the_schema_and_a_wrong_value_does_not():
    jsonschema.validate(DEFAULTS, SCHEMA)
    jsonschema.validate({"dasktensor": dask.config.get("dasktensor")}, SCHEMA)
    wrong = {"dasktensor": {**DEFAULTS["dasktensor"], "execute": {"path": "rpc"}}}
    with pytest.raises(jsonschema.ValidationError, match="'rpc' is not one of"):
        jsonschema.validate(wrong, SCHEMA)
    typo = {"dasktensor": {**DEFAULTS["dasktensor"], "remote": {"probe-afer": "1s"}}}
    with pytest.raises(jsonschema.ValidationError, match="probe-afer"):
        jsonschema.validate(typo, SCHEMA)


def test_every_key_the_code_reads_is_in_the_defaults_and_the_schema():
    read = keys_read(python_files("dasktensor", "dasktensor_worker"))
    # the check sees the reads (a broken scan would pass trivially)
    assert {"execute.path", "remote.lease-check", "sample.silent-worker"} <= set(read)
    known = set(schema_entries(SCHEMA["properties"]["dasktensor"]))
    missing = {k: w for k, w in read.items() if k not in known}
    assert not missing, f"read but not in dasktensor.yaml and its schema: {missing}"
    # and nothing is described that no code reads
    unread = known - set(read)
    assert not unread, f"in the schema but read nowhere: {sorted(unread)}"


def test_every_key_the_tests_and_benchmarks_set_exists():
    set_keys = keys_read(python_files("tests", "benchmarks"))
    known = set(schema_entries(SCHEMA["properties"]["dasktensor"]))
    groups = {k.split(".")[0] for k in known}
    # keys of other libraries read through dask.config.get("...") carry no prefix here
    ours = {k: w for k, w in set_keys.items() if k.split(".")[0] in groups or k in known}
    assert ours, "the scan found no setting set by the tests"
    missing = {k: w for k, w in ours.items() if k not in known}
    assert not missing, f"set but not a setting: {missing}"


def test_the_scan_finds_a_setting_read_that_does_not_exist(tmp_path):
    source = tmp_path / "reads.py"
    source.write_text(
        "import dask\nfrom dasktensor import _config\n"
        "_config.seconds('remote.probe-afer')\n"
        "dask.config.get('dasktensor.execute.path')\n"
        "dask.config.set({'dasktensor.shard.min-rows': 4})\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        read = keys_read([source])
    finally:
        ROOT = saved
    assert read == {
        "remote.probe-afer": ["reads.py:3"],
        "execute.path": ["reads.py:4"],
        "shard.min-rows": ["reads.py:5"],
    }
