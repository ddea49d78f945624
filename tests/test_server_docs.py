"""``docs/server.md`` stays true to the code: its
command lines parse with the real parsers, and ``jaxkv serve``'s flags turn into
the session rules they promise. (Its python block needs the embedded model and
a minute of CPU; tests/test_readme.py runs it with every page of docs/.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from jaxkv import cli
from jaxkv.errors import ConfigError
from jaxkv.server.run import rules_from_args

DOC = Path(__file__).resolve().parent.parent / "docs" / "server.md"


def command_lines() -> list[str]:
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.DOTALL):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


@pytest.mark.parametrize("line", command_lines())
def test_doc_command_lines_parse(line):
    words = shlex.split(line)
    if words[0] == "curl":
        assert "/v1/chat/completions" in line
        return
    if words[0] == "jaxkv":
        args = cli.build_parser().parse_args(words[1:])
        assert args.func is cli._cmd_serve
        rules_from_args(args)
        return
    assert words[:3] == ["python", "-m", "eval.bench.server"], line
    from eval.bench.server import build_parser

    build_parser().parse_args(words[3:])


def test_serve_flags_become_session_rules():
    args = cli.build_parser().parse_args(
        ["serve", "--policy", "snapkv", "--budget", "512", "--repair", "32", "--allow-policies", "h2o,full", "--max-budget", "1024"]
    )
    rules = rules_from_args(args)
    assert rules.resolve({}) == {"keep_reasoning": False, "policy": "snapkv", "budget": 512, "layout": "dead_slot", "repair": 32}
    assert rules.resolve({"policy": "full"}) == {"keep_reasoning": False}  # the default repair applies to policies only
    for bad in (["--allow-policies", "nonsense"], ["--policy", "snapkv"]):
        with pytest.raises(ConfigError):
            rules_from_args(cli.build_parser().parse_args(["serve", *bad]))
    everything = rules_from_args(cli.build_parser().parse_args(["serve", "--allow-policies", "all"]))
    assert {"snapkv", "h2o", "full"} <= everything.allow_policies


def test_decode_chunk_flag_reaches_the_scheduler():
    import jaxkv
    from jaxkv.server.run import make_app
    from jaxkv.serving.scheduler import DECODE_CHUNK

    assert cli.build_parser().parse_args(["serve"]).decode_chunk == DECODE_CHUNK
    args = cli.build_parser().parse_args(["serve", "--decode-chunk", "8"])
    app = make_app(jaxkv.load_model("embedded"), rows=1, max_positions=256, decode_chunk=args.decode_chunk)
    try:
        assert app.state.jaxkv.server.scheduler.decode_chunk == 8
    finally:
        app.state.jaxkv.server.close()
