"""The docs stay true: README.md, ARCHITECTURE.md and the pages in docs/ link only to files and headings that
exist, name only flags that a command of this repository accepts, and docs/settings.md names every setting.

Flags are checked against the argparse parsers the commands build (``tokenfan.cli.parsers()`` and the
scripts the docs run), not by running them.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
from pathlib import Path

import tokenfan_settings as settings
from tests.procs import ROOT
from tokenfan import cli
from tokenfan_bench.cpu import client_cost
from tokenfan_bench.report import matrix

README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README, ROOT / "ARCHITECTURE.md", ROOT / "CHANGELOG.md", ROOT / "deploy" / "README.md", *PAGES]

# Flags of other programs the docs quote: the clients and servers we measured with or configure. No parser
# here can check them, so they are listed by program; a flag the docs stop naming must leave the list too.
FOREIGN_FLAGS = {
    "aiperf": {"--tokenizer", "--endpoint-type", "--streaming", "--request-count", "--isl", "--osl",
               "--random-seed", "--workers-max", "--record-processors", "--no-gpu-telemetry", "--ui",
               "--extra-inputs", "--use-server-token-count"},
    "vllm bench serve": {"--dataset-name", "--random-input-len", "--random-output-len", "--ignore-eos",
                         "--max-concurrency", "--request-rate", "--burstiness"},
    "vllm serve": {"--disable-log-stats", "--enable-prompt-embeds", "--trust-request-chat-template",
                   "--trust-request-mm-kwargs"},  # the last three: what tokenfan does not offer (api-fields.md)
    "chromium": {"--ignore-certificate-errors", "--ignore-certificate-errors-spki-list"},
    "certbot": {"--deploy-hook"},
    "iptables": {"--mode", "--probability"},  # the loss rules of tokenfan_bench/network/lossy.py
    "curl": {"--http3"},
    "docker": {"--build", "--build-arg", "--rm"},
    "buildah run": {"--isolation", "--network", "--pull", "--user"},  # the built image run in chroot (deploy.md)
    "pip": {"--no-deps", "--index-url"},
    "kubectl": {"--raw"},
    "py-spy record": {"--gil", "--format"},  # the front end's profile in vs-vllm.md
    "redis-server": {"--maxmemory", "--maxmemory-policy"},  # the shipped Redis (operations.md)
}

FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$", re.MULTILINE)
FLAG = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)(\*)?")


def prose(text: str) -> str:
    """``text`` without code: fenced blocks and inline spans (a link or a heading there is not one)."""
    return INLINE.sub("", FENCED.sub("", text))


def code(text: str) -> list[str]:
    """The fenced blocks and inline code spans of ``text``."""
    blocks = [m.group(0) for m in FENCED.finditer(text)]
    return blocks + INLINE.findall(FENCED.sub("", text))


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes for the headings of ``path``: lower case, punctuation dropped, spaces to
    hyphens, ``-1``, ``-2`` … after a repeated one."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCED.sub("", path.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The relative link targets of ``path`` (``https:``, ``mailto:`` … left out)."""
    return [t for t in LINK.findall(prose(path.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def named_flags(path: Path) -> set[str]:
    """``--flag``s in the code of ``path``; ``--prefix-*`` (a family) is kept as ``--prefix-*``."""
    return {flag + star for span in code(path.read_text()) for flag, star in FLAG.findall(span)}


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    out: set[str] = set()
    for action in parser._actions:
        out.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= flags_of(sub)
    return out


@functools.cache
def accepted_flags() -> frozenset[str]:
    """Every flag of every ``tokenfan`` command and of the repository's scripts the docs run."""
    spec = importlib.util.spec_from_file_location("asgi_servers", ROOT / "tools" / "asgi_servers.py")
    assert spec and spec.loader
    asgi_servers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(asgi_servers)
    parsers = [*cli.parsers().values(), settings.parser(), client_cost.parser(), matrix.parser(),
               asgi_servers.parser()]
    return frozenset().union(*map(flags_of, parsers))


def test_every_relative_link_reaches_a_file_and_its_heading() -> None:
    broken = []
    for doc in DOCS:
        for target in links(doc):
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_flag_the_docs_name_is_accepted_by_a_command() -> None:
    accepted = accepted_flags()
    foreign = set().union(*FOREIGN_FLAGS.values())
    unknown = []
    for doc in DOCS:
        for flag in sorted(named_flags(doc)):
            if flag.endswith("*"):
                ok = any(a.startswith(flag[:-1]) for a in accepted)
            else:
                ok = flag in accepted or flag in foreign
            if not ok:
                unknown.append(f"{doc.relative_to(ROOT)}: {flag}")
    assert not unknown, "flags no command accepts:\n" + "\n".join(unknown)


def test_foreign_flags_are_named_by_the_docs_and_not_ours() -> None:
    named = set().union(*map(named_flags, DOCS))
    for program, flags in FOREIGN_FLAGS.items():
        assert flags <= named, f"{program}: the docs no longer name {sorted(flags - named)}"
        assert not flags & accepted_flags(), f"{program}: {sorted(flags & accepted_flags())} are ours"


def test_every_setting_has_its_flag_and_environment_variable_in_the_settings_page() -> None:
    page = (ROOT / settings.SETTINGS_DOC).read_text()
    for s in settings.SETTINGS:
        assert f"`{s.option}`" in page, s.option
        assert f"`{s.env_var}`" in page, s.env_var


def test_readme_is_short_and_links_every_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250, "the README is read in five minutes: move the reference into docs/"
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(README)}
    assert not [p.name for p in PAGES if p.resolve() not in linked], "a docs/ page the README does not link"
    assert (ROOT / "ARCHITECTURE.md").resolve() in linked


def test_every_flag_and_endpoint_of_the_readme_is_explained_in_a_page() -> None:
    pages = "\n".join(p.read_text() for p in PAGES)
    for flag in named_flags(README):
        assert flag in pages, f"{flag}: the README names it, no page in docs/ does"
    for endpoint in set(re.findall(r"/v1/[a-z_/{}.-]*[a-z}]", README.read_text())):
        assert endpoint in pages, f"{endpoint}: the README names it, no page in docs/ does"


def test_every_request_field_of_vllm_serve_is_in_the_fields_page() -> None:
    """docs/api-fields.md says, for every field vLLM's chat and completions request models accept, whether
    tokenfan honours or refuses it: a field a new vLLM adds fails here until the page names it."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    page = (ROOT / "docs" / "api-fields.md").read_text()
    chat, _, completions = page.partition("## Completions")
    for model, section in ((ChatCompletionRequest, chat), (CompletionRequest, completions)):
        named = set(re.findall(r"`([a-z_]+)`", section))
        assert not set(model.model_fields) - named, (model.__name__, sorted(set(model.model_fields) - named))


# Words about how the work was done, not about the software: the docs are for its users.
PROCESS_WORDS = re.compile(r"\bissue[- ]?#?\d+|\bissues? \d+|\bnot met\b|\bsitting\b|under the (shared )?lock\b|"
                           r"throwaway|other sessions|\bblocked on\b|\bTODO\b|\bFIXME\b", re.IGNORECASE)


def test_the_docs_use_no_words_about_how_the_work_was_done() -> None:
    found = [f"{doc.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
             for doc in [*DOCS, ROOT / "CHANGELOG.md"] for text in [doc.read_text()]
             for m in PROCESS_WORDS.finditer(text)]
    assert not found, "\n".join(found)


def test_sections_with_dated_figures_come_newest_first() -> None:
    """Within a page, headings that carry a date (YYYY-MM-DD) go from the newest to the oldest."""
    for doc in (PAGES):
        dates = [d for h in HEADING.findall(FENCED.sub("", doc.read_text()))
                 for d in re.findall(r"\d{4}-\d{2}-\d{2}", h)[:1]]
        assert dates == sorted(dates, reverse=True), f"{doc.name}: {dates}"
