"""Every kv_* option is one row of ``obcache_vllm.options.OPTIONS``: a throwaway row added in a
test reaches the request model, its refusals, the resolved options, the wire form, the server's
built-in defaults and the docs' options table, with nothing else declared."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from obcache_vllm import config, options
from obcache_vllm.admission import resolve
from obcache_vllm.options import KvOptionsError, OptionSpec, OptionTable

ROOT = Path(__file__).resolve().parents[2]


def _flavor() -> OptionSpec:
    return OptionSpec(
        "kv_flavor", options.one_of(lambda: ("plain", "spicy")), "plain", (str,),
        doc="a throwaway option: how the cache tastes", examples=("plain", "spicy"),
    )  # fmt: skip


def test_a_new_option_is_one_row() -> None:
    table = OptionTable((*options.OPTIONS, _flavor()), module=__name__)
    assert table.fields[-1] == "kv_flavor"
    # the request model: parsed, defaulted, refused naming the field, needing a budget
    request = table.parse_request({"kv_budget": 64, "kv_flavor": "spicy"})
    assert request.flavor == "spicy"
    assert table.parse_request({"kv_budget": 64}).flavor == "plain"
    with pytest.raises(KvOptionsError, match="known: plain, spicy") as info:
        table.parse_request({"kv_budget": 64, "kv_flavor": "sweet"})
    assert info.value.field == "kv_flavor"
    with pytest.raises(KvOptionsError, match="requires kv_budget") as info:
        table.parse_request({"kv_flavor": "spicy"})
    assert info.value.field == "kv_flavor"
    # the resolved options and their wire form
    resolved = resolve(request, 1000)
    assert isinstance(resolved, table.options_type) and resolved.flavor == "spicy"
    assert table.options_type.from_wire(resolved.to_wire()) == resolved
    with pytest.raises(options.WireError, match="flavor"):
        table.options_type.from_wire(resolved.to_wire()[:-5] + (7, None, False, None, False))
    # the server's built-in defaults and the fuzzer's plausible values
    assert table.builtin_defaults()["kv_flavor"] == "plain"
    assert table.spec("kv_flavor").example_values() == ("plain", "spicy")
    # the module's own table is untouched
    assert "kv_flavor" not in options.FIELDS and "kv_flavor" not in config.BUILTIN_DEFAULTS


def test_the_docs_table_is_the_option_rows(monkeypatch) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_reference
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(options, "OPTIONS", (*options.OPTIONS, _flavor()))
    assert gen_reference._option_rows()["kv_flavor"] == "a throwaway option: how the cache tastes"


def test_the_modules_types_are_the_tables() -> None:
    names = [spec.name for spec in options.OPTIONS]
    request_fields = [f.name for f in dataclasses.fields(options.KvRequest)]
    assert request_fields == names  # the client's options only (the policy rides beside)
    resolved_fields = [f.name for f in dataclasses.fields(options.KvOptions)]
    assert resolved_fields == [*names, "requested_budget", "tentative", "max_error", "kl_target"]
    assert options.FIELDS == tuple(spec.field for spec in options.OPTIONS)
    assert tuple(config.BUILTIN_DEFAULTS) == options.FIELDS
    assert config.PER_REQUEST_ONLY == ("kv_compress_at", "kv_session")
    # every option is documented and has plausible values (or is a prompt position)
    for spec in options.OPTIONS:
        assert spec.doc and (spec.example_values() or spec.field == "kv_compress_at"), spec.field
    with pytest.raises(ValueError, match="distinct"):
        OptionTable((*options.OPTIONS, options.OPTIONS[0]))


def test_the_declared_request_and_options_classes_are_the_tables() -> None:
    """``KvRequest``/``KvOptions`` are built from the table at run time; options.py also
    declares them (under ``TYPE_CHECKING``) for readers and type checkers. Read from the
    source: the same fields, in the same order, with the same defaults, and KvOptions'
    annotations the wire types the table checks."""
    import ast

    tree = ast.parse((ROOT / "obcache_vllm" / "options.py").read_text())
    guard = next(node for node in tree.body if isinstance(node, ast.If)
                 and ast.unparse(node.test) == "TYPE_CHECKING")  # fmt: skip
    declared = {node.name: node for node in guard.body if isinstance(node, ast.ClassDef)}
    assert sorted(declared) == ["KvOptions", "KvRequest"]
    for cls in (options.KvRequest, options.KvOptions):
        rows = [node for node in declared[cls.__name__].body if isinstance(node, ast.AnnAssign)]
        runtime = dataclasses.fields(cls)
        assert [row.target.id for row in rows] == [f.name for f in runtime]
        for row, f in zip(rows, runtime, strict=True):
            value = row.value
            if isinstance(value, ast.Call):  # field(default=..., ...)
                keywords = {k.arg: ast.literal_eval(k.value) for k in value.keywords}
                assert keywords.pop("default") == f.default, f.name
                assert keywords.get("kw_only", False) == f.kw_only, f.name
                assert keywords.get("compare", True) == f.compare, f.name
            elif value is None:
                assert f.default is dataclasses.MISSING, f.name
            else:
                assert ast.literal_eval(value) == f.default, f.name
            if cls is options.KvOptions:
                types = options.KvOptions.table.wire_types[f.name]
                names = {"None" if t is type(None) else t.__name__ for t in types}
                assert set(ast.unparse(row.annotation).split(" | ")) == names, f.name
