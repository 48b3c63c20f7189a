"""Every `mixbit ...` command the docs show parses with the real CLI, so docs and CLI cannot drift;
flags are kebab-case with the underscore spelling accepted."""

from __future__ import annotations

import re
import shlex

import pytest

from mixbit.server.cli import build_parser, kebab_case

from .conftest import ROOT, run_cli

DOCS = [ROOT / "README.md", ROOT / "quant" / "README.md", ROOT / "deploy" / "README.md",
        ROOT / "models" / "tiny-qwen3.5" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_END = {"&&", "||", "|", ";", "&", ">", ">>", "2>&1"}


COMMAND_AFTER = {"--", "&&", "||", ";", "|", "sudo", "exec", "time", "nohup", "then", "do"}


def _from_shell(line: str) -> list[str]:
    """`mixbit ...` invocations in one shell line: `mixbit` (or a path to it) as the command
    word, first or after `--`, `sudo`, `&&`, an environment assignment and the like."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    out, command_next = [], True
    for i, w in enumerate(words):
        if (w == "mixbit" or w.endswith("/mixbit")) and command_next:
            args = []
            for a in words[i + 1:]:
                if a in SHELL_END:
                    break
                args.append(a)
            out.append(shlex.join(["mixbit", *args]))
        if w in COMMAND_AFTER or w in SHELL_END:
            command_next = True
        elif not (command_next and re.match(r"^[A-Z_][A-Z0-9_]*=", w)):
            command_next = False  # an environment assignment before a command keeps it next
    return out


def _from_synopsis(span: str) -> str | None:
    """An inline synopsis such as `mixbit serve [--model SRC] [--port N] ...` as a command: an
    ellipsis after a flag is its value, anywhere else it means "and more flags"."""
    if not span.startswith("mixbit "):
        return None
    words = span.replace("[", " ").replace("]", " ").replace("|", " ").split()
    out = []
    for w in words:
        if w == "...":
            if out and out[-1].startswith("--"):
                out.append("VALUE")
            continue
        out.append(w.rstrip(",").removesuffix(",..."))
    return " ".join(out)


def documented_commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        rel = doc.relative_to(ROOT)
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                found += [(f"{rel}", cmd) for cmd in _from_shell(line)]
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`([^`\n]+)`", prose):
            cmd = _from_synopsis(span)
            if cmd and len(cmd.split()) > 1 and not cmd.split()[1].startswith("<"):
                found.append((f"{rel}", cmd))
    return sorted(set(found))


COMMANDS = documented_commands()


def test_the_docs_show_commands():
    subcommands = {cmd.split()[1] for _, cmd in COMMANDS}
    assert {"serve", "quantize", "eval", "chat", "train-tiny", "config"} <= subcommands, subcommands
    assert any("--target-bpw" in cmd for _, cmd in COMMANDS)


@pytest.mark.parametrize("doc, command", COMMANDS, ids=[f"{d}: {c}"[:90] for d, c in COMMANDS])
def test_documented_command_parses(doc, command):
    argv = shlex.split(command)[1:]
    parser = build_parser()
    try:
        args = parser.parse_args(kebab_case(argv))
    except SystemExit as exc:
        if argv[-1:] == ["--help"] and exc.code == 0:
            return
        pytest.fail(f"{doc} shows `{command}`, which the CLI rejects")
    assert callable(args.func)


def test_underscore_flags_are_aliases():
    parser = build_parser()
    a = parser.parse_args(kebab_case(["quantize", "--recipe", "mixbit-auto", "--target_bpw", "4.5"]))
    b = parser.parse_args(kebab_case(["quantize", "--recipe", "mixbit-auto", "--target-bpw", "4.5"]))
    assert a.target_bpw == b.target_bpw == "4.5"
    assert parser.parse_args(kebab_case(["eval", "--n_tool=8"])).n_tool == 8
    # the value of --set keeps its underscores; so does anything after `--`
    s = parser.parse_args(kebab_case(["config", "--set", "server.max_body_bytes=5000"]))
    assert s.set == ["server.max_body_bytes=5000"]
    assert kebab_case(["chat", "--", "--my_text"]) == ["chat", "--", "--my_text"]


def test_help_shows_kebab_case_and_the_documented_form_runs():
    out = run_cli("quantize", "--help")
    assert out.returncode == 0 and "--target-bpw" in out.stdout and "--target_bpw" not in out.stdout
    # the README's form, end to end through the settings (config prints what was understood)
    out = run_cli("config", "--recipe", "mixbit-auto", "--target-bpw", "3.5")
    assert out.returncode == 0, out.stderr
    assert '"target_bpw": 3.5' in out.stdout
    out = run_cli("config", "--target_bpw", "5.0")
    assert out.returncode == 0 and '"target_bpw": 5.0' in out.stdout


@pytest.mark.parametrize("script", sorted((ROOT / "tests" / "bench").glob("*.py")), ids=lambda p: p.name)
def test_benchmark_scripts_compile(script):
    """The docs tell users to run these: a syntax error must not wait for someone to try."""
    import py_compile

    py_compile.compile(str(script), doraise=True)
