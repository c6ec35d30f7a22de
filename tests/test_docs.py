"""What README.md and docs/*.md show a reader must match the code.

Cheap static checks that catch drift as soon as it happens: every setting the
docs name is read by the code and every setting the code reads is documented;
the Python examples compile, define or import every name they use, and call
Relay's API with arguments its signatures accept; every ``relay`` command line
parses with the real CLI; the demo transcript counts every migration.
tests/web/test_docs_routes.py checks the HTTP paths.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import inspect
import json
import re
import shlex
import symtable
from pathlib import Path

import click
import pytest

import relay_core
from relay_core import Job, Relay
from relay_core.cli import main as cli
from relay_core.worker.retention import Retention

from .doc_examples import DOCS, ROOT, blocks, inline_code, shell_lines

CODE_DIRS = ("relay_core", "relay_web", "examples")
#: Files that read settings from the shell rather than from Python.
DEPLOY_FILES = ("Procfile", "render.yaml", "railway.json", "railway.worker.json")
#: Settings read under a computed name: the prefix in the code, then every name it makes.
DYNAMIC_SETTINGS = {
    "RELAY_RETENTION_": {f"RELAY_RETENTION_{f.name.upper()}" for f in dataclasses.fields(Retention)},
}
SETTING = re.compile(r"^(RELAY|SHOP)_[A-Z0-9_]*[A-Z0-9]$")


def _docs_text() -> str:
    return "\n".join(path.read_text(encoding="utf-8") for path in DOCS)


def _code_settings() -> set[str]:
    """Every RELAY_*/SHOP_* name the code reads: string constants that are exactly such a name."""
    found: set[str] = set()
    for folder in CODE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and SETTING.match(node.value):
                    found.add(node.value)
                elif isinstance(node, ast.JoinedStr) and node.values:
                    first = node.values[0]
                    if isinstance(first, ast.Constant) and re.match(r"^RELAY_[A-Z0-9_]*_$", str(first.value)):
                        assert first.value in DYNAMIC_SETTINGS, (
                            f"{path.relative_to(ROOT)} reads {first.value}...: list its names in DYNAMIC_SETTINGS"
                        )
                        found |= DYNAMIC_SETTINGS[first.value]
    return found


def _deploy_settings() -> tuple[set[str], set[str]]:
    """(names the deploy files read with ``$NAME``, names they set for the processes)."""
    read: set[str] = set()
    assigned: set[str] = set()
    for name in DEPLOY_FILES:
        text = (ROOT / name).read_text(encoding="utf-8")
        read |= set(re.findall(r"\$\{?(RELAY_[A-Z0-9_]+)", text))
        assigned |= set(re.findall(r"key:\s*(RELAY_[A-Z0-9_]+)", text))
    return read, assigned


def test_every_setting_the_docs_name_is_read_by_the_code() -> None:
    read = _code_settings() | _deploy_settings()[0]
    named = set(re.findall(r"\b((?:RELAY|SHOP)_[A-Z0-9_]*[A-Z0-9])\b(?!_?\*)", _docs_text()))
    assert named - read == set(), "the docs name settings nothing reads"
    for prefix in re.findall(r"\b(RELAY_[A-Z0-9_]*?)_?\*", _docs_text()):
        assert any(name.startswith(prefix) for name in read), f"the docs name {prefix}*, which nothing reads"


def test_every_setting_the_deploy_files_set_is_read_by_the_code() -> None:
    assert _deploy_settings()[1] - _code_settings() == set()


def _documented(name: str, text: str) -> bool:
    """Named in full, or as a suffix after a sibling: "`RELAY_RETENTION_SUCCEEDED`, `_CANCELLED`"."""
    if re.search(rf"\b{name}\b", text):
        return True
    parts = name.split("_")
    for cut in range(2, len(parts)):
        prefix, suffix = "_".join(parts[:cut]), "_" + "_".join(parts[cut:])
        sibling = rf"{prefix}_[A-Z0-9_]+`?(?:,? (?:or |and )?`_[A-Z0-9_]+`)*,? (?:or |and )?`{suffix}`"
        if re.search(sibling, text):
            return True
    return False


def test_every_setting_the_code_reads_is_documented() -> None:
    """Relay's own settings and the example shop's (the demo's producer and workers read them)."""
    text = _docs_text()
    undocumented = sorted(n for n in _code_settings() if not _documented(n, text))
    assert undocumented == [], "settings read by the code but named nowhere in README.md or docs/"


# -- Python examples ------------------------------------------------------

PYTHON_DOCS = [path for path in DOCS if blocks(path, "python")]


def _undefined_names(source: str, filename: str) -> set[str]:
    """Names a module uses that it neither defines, imports nor gets from builtins."""
    top = symtable.symtable(source, filename, "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    known = bound | set(dir(builtins))
    missing: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for symbol in table.get_symbols():
            is_global = table is top or symbol.is_global()
            if is_global and symbol.is_referenced() and symbol.get_name() not in known:
                missing.add(symbol.get_name())
    return missing


@pytest.mark.parametrize("path", PYTHON_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_compile_and_use_only_names_they_define_or_import(path: Path) -> None:
    found = blocks(path, "python")
    for block in found:
        compile(block.text, block.where, "exec")
    # A reader pastes one block after another into one module.
    source = "\n\n".join(block.text for block in found)
    assert _undefined_names(source, str(path)) == set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "relay_core":
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                assert hasattr(module, alias.name), f"{path.name}: from {node.module} import {alias.name}"


def _signature_of(call: ast.Call) -> inspect.Signature | None:
    """The real signature a call in an example targets: Relay(...), relay.x(...), job.x(...), Backoff(...)."""
    func = call.func
    if isinstance(func, ast.Name) and func.id in relay_core.__all__:
        try:
            return inspect.signature(getattr(relay_core, func.id))
        except ValueError:  # an exception class that keeps Exception's (*args)
            return None
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner = {"relay": Relay, "job": Job}.get(func.value.id)
        if owner is not None:
            assert hasattr(owner, func.attr), f"{owner.__name__} has no {func.attr}"
            return inspect.signature(getattr(owner, func.attr))
    return None


def _check_calls(tree: ast.AST, where: str) -> int:
    checked = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue
        signature = _signature_of(node)
        if signature is None:
            continue
        params = list(signature.parameters.values())
        args = [object()] * len(node.args)
        if params and params[0].name == "self":
            args.insert(0, object())
        try:
            signature.bind(*args, **{k.arg: object() for k in node.keywords if k.arg})
        except TypeError as exc:
            pytest.fail(f"{where}: {ast.unparse(node)}: {exc}")
        checked += 1
    return checked


def test_python_examples_call_relay_with_arguments_it_accepts() -> None:
    checked = 0
    for path in DOCS:
        for block in blocks(path, "python"):
            checked += _check_calls(ast.parse(block.text), block.where)
        for span in inline_code(path):
            try:
                tree = ast.parse(span.lstrip("@"), mode="eval")
            except SyntaxError:
                continue
            checked += _check_calls(tree, f"{path.relative_to(ROOT)}: `{span}`")
    assert checked > 10


def test_job_attributes_the_docs_name_exist() -> None:
    attributes = {f.name for f in dataclasses.fields(Job)} | set(dir(Job))
    for path in DOCS:
        texts = [b.text for b in blocks(path, "python")] + inline_code(path)
        for text in texts:
            for name in re.findall(r"\bjob\.([a-z_]+)", text):
                assert name in attributes, f"{path.relative_to(ROOT)}: job.{name}"


# -- relay commands -------------------------------------------------------


def _relay_commands() -> list[tuple[str, list[str], bool]]:
    """(where, argv after `relay`, whether values are concrete) of every relay command shown."""
    lines: list[tuple[str, str, bool]] = []
    for path in DOCS:
        for block in blocks(path, "sh", "bash", "shell", ""):
            lines += [(block.where, line, True) for line in shell_lines(block)]
        # Inline spans may hold placeholders (NAME, admin|viewer): only option names are checked.
        lines += [(str(path.relative_to(ROOT)), span, False) for span in inline_code(path)]
    for line in (ROOT / "Procfile").read_text(encoding="utf-8").splitlines():
        lines.append(("Procfile", line.partition(":")[2], True))
    render = (ROOT / "render.yaml").read_text(encoding="utf-8")
    for command in re.findall(r"(?:startCommand|preDeployCommand):\s*(.+?)(?:\s+#.*)?$", render, re.M):
        lines.append(("render.yaml", command, True))
    for name in ("railway.json", "railway.worker.json"):
        deploy = json.loads((ROOT / name).read_text())["deploy"]
        for command in [deploy["startCommand"], *deploy.get("preDeployCommand", [])]:
            lines.append((name, command, True))
    found = []
    for where, line, concrete in lines:
        for segment in re.split(r"&&|\|\||;|\|(?!\w)", line):
            try:
                words = shlex.split(segment, comments=True)
            except ValueError:
                continue
            while words and (words[0] == "export" or re.match(r"^[A-Z_][A-Z0-9_]*=", words[0])):
                words.pop(0)
            if words[:1] == ["relay"]:
                found.append((where, words[1:], concrete))
            elif words[:3] == ["python", "-m", "relay_core"]:
                found.append((where, words[3:], concrete))
    return found


def _options(command: click.Command) -> set[str]:
    return {o for p in command.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}


def _check_options(argv: list[str]) -> None:
    """Every --option in argv belongs to the (sub)command it follows; every command word exists."""
    command: click.Command = cli
    words = list(argv)
    while words:
        word = words.pop(0)
        if word.startswith("--"):
            name = word.partition("=")[0]
            assert name in _options(command), f"relay {' '.join(argv)}: {command.name} has no option {name}"
            param = next(p for p in command.params if name in p.opts or name in getattr(p, "secondary_opts", ()))
            if isinstance(command, click.Group) and not getattr(param, "is_flag", False) and "=" not in word:
                words.pop(0)  # the group option's value
        elif isinstance(command, click.Group):
            sub = command.get_command(click.Context(command), word)
            assert sub is not None, f"relay {' '.join(argv)}: no command {word!r}"
            command = sub


def _parse(argv: list[str]) -> None:
    """Parse argv as `relay` would, down to the subcommand, without running anything."""
    ctx = cli.make_context("relay", list(argv))
    command: click.Command = cli
    while isinstance(command, click.Group):
        # Click 8.2+ keeps the subcommand's words in _protected_args (protected_args warns).
        protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
        rest = [*protected, *ctx.args]
        name, sub, rest = command.resolve_command(ctx, rest)
        assert sub is not None and name is not None
        command = sub
        ctx = command.make_context(name, rest, parent=ctx)


def test_every_relay_command_in_the_docs_and_deploy_files_parses() -> None:
    commands = _relay_commands()
    assert len(commands) > 20
    for where, argv, concrete in commands:
        try:
            _check_options(argv)
        except AssertionError as exc:
            pytest.fail(f"{where}: {exc}")
        if concrete:
            try:
                _parse(argv)
            except click.ClickException as exc:
                pytest.fail(f"{where}: relay {' '.join(argv)}: {exc.format_message()}")


def test_the_demo_transcript_counts_every_migration() -> None:
    shown = re.search(r"schema: (\d+) migration\(s\) applied", (ROOT / "docs" / "demo.md").read_text())
    assert shown is not None
    assert int(shown[1]) == len(list((ROOT / "relay_core" / "migrations").glob("*.sql")))
