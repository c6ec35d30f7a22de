"""Every HTTP path the docs show (curl walkthroughs, endpoint tables, dashboard pages) is a route of the app."""

from __future__ import annotations

import re
import shlex
from urllib.parse import urlsplit

import pytest
from flask import Flask
from werkzeug.exceptions import HTTPException
from werkzeug.routing import RequestRedirect

from ..doc_examples import DOCS, ROOT, blocks, inline_code, shell_lines

#: Placeholders the docs write in paths, and a value each route accepts.
PLACEHOLDERS = {"{id}": "1", "<id>": "1", "{queue}": "default"}
ENDPOINT = re.compile(r"^(GET|POST|PUT|PATCH|DELETE) +(/\S*)$")


def _fill(path: str) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        path = path.replace(placeholder, value)
    return urlsplit(path).path


def _curl_requests() -> list[tuple[str, str, str]]:
    """(where, method, path) of every curl command in a shell block."""
    found = []
    for doc in DOCS:
        for block in blocks(doc, "sh", "bash", "shell", ""):
            for line in shell_lines(block):
                words = shlex.split(line.replace("$(", " "), comments=True)
                while "curl" in words:
                    words = words[words.index("curl") + 1 :]
                    command = words[: words.index("|")] if "|" in words else words
                    method = "POST" if "-d" in command else "GET"
                    if "-X" in command:
                        method = command[command.index("-X") + 1]
                    for word in command:
                        url = re.sub(r"^\$\{?(B|BASE)\}?", "http://localhost", word)
                        if url.startswith(("http://", "https://")):
                            found.append((block.where, method, _fill(urlsplit(url).path or "/")))
    return found


def _documented_endpoints() -> list[tuple[str, str, str]]:
    """(where, method, path) of every `METHOD /path` span, and of the dashboard's pages table."""
    found = []
    for doc in DOCS:
        for span in inline_code(doc):
            match = ENDPOINT.match(span)
            if match:
                found.append((str(doc.relative_to(ROOT)), match[1], _fill(match[2])))
    dashboard = (ROOT / "docs" / "dashboard.md").read_text(encoding="utf-8")
    for path in re.findall(r"^\| [A-Z][a-z]+ \| `(/[^`]*)` \|", dashboard, re.M):
        found.append(("docs/dashboard.md", "GET", _fill(path)))
    return found


def test_every_path_the_docs_show_is_a_route(app: Flask) -> None:
    requests = _curl_requests() + _documented_endpoints()
    assert len(requests) > 30
    adapter = app.url_map.bind("localhost")
    for where, method, path in requests:
        try:
            adapter.match(path, method=method)
        except RequestRedirect as redirect:
            pytest.fail(f"{where}: {method} {path} redirects to {redirect.new_url}")
        except HTTPException as exc:
            pytest.fail(f"{where}: {method} {path}: {exc.code} {exc.name}")
