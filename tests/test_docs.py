"""The docs as a new user follows them: docs/serve.md's curl and openai examples run as written against a served
quickstart run, and the commands that need an optional extra say in one line which install brings it.
(tests/test_readme.py walks the README's commands.)"""

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require

openai = require("openai")
require("fastapi")

import jaxlm  # noqa: E402
from jaxlm import cli, serve  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def blocks(path: Path, lang: str | None = None) -> list[str]:
    """The fenced code blocks of a markdown file (of one language when given), in order."""
    return [body for fence, body in re.findall(r"```(\w*)\n(.*?)```", path.read_text(), re.S)
            if lang is None or fence == lang]


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory, shakespeare_file):
    """The quickstart's model (its preset, at a tiny size) trained in a folder named qs, as docs/serve.md's
    `jaxlm train quickstart run_dir=/tmp/qs` makes; bytes of tiny Shakespeare rather than the standard library's
    source, which would take longer to prepare (the same byte vocabulary)."""
    tmp = tmp_path_factory.mktemp("docs")
    run = tmp / "qs"
    code = cli.main(["train", "quickstart", f"run_dir={run}", f"data.input={shakespeare_file}",
                     f"data.dir={tmp / 'bytes'}", "model.n_layers=2", "model.d_model=32", "training.steps=20",
                     "training.batch_size=8", "training.eval_interval=20", "training.eval_batches=1",
                     "training.sample_tokens=0", "logging.progress=false", "logging.tensorboard=false"])
    assert code == 0
    return run


def test_serve_docs_curl_and_openai_examples_run_as_written(quickstart_run, tmp_path, capsys):
    # docs/serve.md's openai snippet asked for model "qs" of a server of another folder (400: not served here) and
    # made a chat request the quickstart's tokenizer has no template for (400); there was no curl example. Its
    # examples now run as printed against `jaxlm serve /tmp/qs` (the chat one with its documented template), the
    # port being the one this test's server got (8000 may be taken on a shared machine).
    doc = ROOT / "docs" / "serve.md"
    template = tmp_path / "chat.jinja"
    template.write_text(blocks(doc, "jinja")[0])
    cfg = serve.settings_config({"serve.chat_template": str(template), "serve.max_slots": 4, "serve.max_queue": 8})
    srv = serve.Server(serve.build(quickstart_run, cfg, log=lambda s: None), "127.0.0.1", 0).start()
    try:
        port = lambda text: text.replace("127.0.0.1:8000", f"127.0.0.1:{srv.port}")  # noqa: E731
        curl = next(b for b in blocks(doc, "bash") if "curl" in b)
        done = subprocess.run(["bash", "-c", port(curl)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        models, completion = _two_json(done.stdout)
        assert [m["id"] for m in models["data"]] == ["qs"]
        greedy = jaxlm.load(quickstart_run).generate_text("def ", max_new_tokens=64, temperature=0)
        assert completion["model"] == "qs" and len(completion["choices"][0]["text"]) >= 32
        assert greedy.startswith(completion["choices"][0]["text"])  # 32 greedy tokens (bytes) of the same text

        completions, chat = [b for b in blocks(doc, "python") if "client" in b][:2]
        scope: dict = {}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(port(completions), scope)
        assert scope["model"] == "qs"
        assert out.getvalue().startswith(greedy + "\n") and len(out.getvalue()) > len(greedy) + 1
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(chat, scope)
        assert out.getvalue(), "the chat example printed nothing"
    finally:
        srv.stop()


def _two_json(text: str) -> list:
    """The two JSON documents curl printed one after the other."""
    decoder = json.JSONDecoder()
    first, end = decoder.raw_decode(text)
    second, _ = decoder.raw_decode(text[end:].lstrip())
    return [first, second]


@pytest.mark.parametrize("argv, extra, module", [
    (["serve", "RUN"], "serve", "uvicorn"),
    (["eval", "RUN", "--tasks", "hellaswag"], "eval,serve", "httpx"),
    (["eval", "RUN", "--tasks", "hellaswag"], "eval,serve", "fastapi"),  # it serves the model itself without --url
    (["eval", "RUN", "--tasks", "hellaswag", "--url", "http://127.0.0.1:8000"], "eval", "lm_eval"),
])
def test_commands_without_their_extra_end_in_one_line_naming_the_install(argv, extra, module, monkeypatch, capsys):
    # `jaxlm serve` without the serve extra ended in `ModuleNotFoundError: No module named 'uvicorn'`, `jaxlm eval
    # --tasks` without the eval extra in `No module named 'httpx'`. (A module set to None in sys.modules is one that
    # cannot be imported, as when it is not installed.)
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: jaxlm {argv[0]}"), err
    assert f"needs {module}" in err and f"pip install 'jaxlm[{extra}]'" in err, err


def test_eval_of_a_run_prints_no_read_only_warning(quickstart_run, capsys, caplog):
    # every `jaxlm eval` printed `WARNING:absl:Given directory is read only=.../checkpoints` (Orbax's note on a
    # manager that only reads), as if something were wrong (pytest takes log records to caplog, not to stderr)
    capsys.readouterr()
    with caplog.at_level("INFO"):
        assert cli.main(["eval", str(quickstart_run), "training.sample_tokens=0"]) == 0
    out, err = capsys.readouterr()
    assert "val" in out and "read only" not in err + out, err
    assert [r.getMessage() for r in caplog.records if "read only" in r.getMessage()] == []
